"""The ops a qwen35 verify graph of the pinned llama.cpp adds to gdnpass's own: ROPE (IMROPE), SET_ROWS into an f16
KV cache at i64 row ids, FLASH_ATTN_EXT, SOFT_MAX, GLU (swiglu_split), zero-size nodes.

Per op: a shape ggml accepts builds and validates, a shape ggml asserts on is one GraphError line; the decoder against
op_params words laid out by hand as ggml.c lays them out; a qwen35 attention block (flash attention on and off) built
with gdnpass's constructors is node for node what ggml builds from the same calls; it saves, loads and dumps; the
executor refuses a mode it has no kernel for in one line, before running anything (the ops' execution:
tests/kernels/test_attention_ops.py).
"""

from __future__ import annotations

import struct

import pytest

from gdnpass import alloc, ops, serialize
from gdnpass.dump import Row, format_rows, params_text
from gdnpass.frontends.decode import UNARY_OPS, ir_op
from gdnpass.ir import DType, Flag, Glu, Graph, GraphError, Op, Prec, Tensor, Unary
from gdnpass.runtime import Executor
from support.attention_block import GgmlCalls, IrCalls, attention_block

F32, F16, I32, I64 = DType.F32, DType.F16, DType.I32, DType.I64
IMROPE = 40


def leaf(name: str, type_: DType, ne, buffer: str = "input") -> Tensor:
    return ops.new_tensor(name, type_, ne, buffer=buffer, flags=Flag.INPUT if buffer == "input" else Flag.NONE)


def one_line_error(build, match: str) -> str:
    with pytest.raises(GraphError, match=match) as err:
        build()
    assert "\n" not in str(err.value)
    return str(err.value)


def rope(a: Tensor, pos: Tensor, mode: int = IMROPE, sections=(2, 1, 1, 0), n_dims: int = 8, **kw) -> Tensor:
    return ops.rope_ext(a, pos, kw.pop("freq_factors", None), n_dims, mode, 4096, 1e7, 1.0, 0.0, 1.0, 32.0, 1.0,
                        sections=sections, **kw)


# ---------------------------------------------------------------------------------------------------------------------
# shape rules: what ggml accepts builds and validates
# ---------------------------------------------------------------------------------------------------------------------


def test_rope_multi_keeps_the_shape_and_records_its_params():
    q = leaf("q", F32, (16, 4, 3))
    pos = leaf("inp_pos", I32, (12,))  # M-RoPE: 4 positions per token
    r = ops.rope_multi(q, pos, None, 8, (2, 1, 1, 0), IMROPE, 4096, 1e7, 1.0, 0.0, 1.0, 32.0, 1.0)
    assert (r.op, r.type, r.ne, r.nb, r.view_src) == (Op.ROPE, F32, q.ne, q.nb, None)
    assert r.src == [q, pos] and r.op_params["sections"] == (2, 1, 1, 0) and r.op_params["mode"] == IMROPE
    ops.validate_node(r)
    inplace = rope(q, pos, inplace=True)
    assert inplace.view_src is q and inplace.nb == q.nb
    plain = ops.rope_ext(q, leaf("pos", I32, (3,)), leaf("ff", F32, (4,), "weights"), 8, 2, 0, 1e4, 1, 0, 1, 0, 0)
    assert plain.ne == q.ne and len(plain.src) == 3


@pytest.mark.parametrize("build, match", [
    (lambda q, p: rope(q, leaf("p", I32, (3,))), r"M-RoPE needs 4 positions per token: 3 for 3 tokens"),
    (lambda q, p: rope(q, p, mode=2), r"12 positions for 3 tokens"),
    (lambda q, p: rope(q, leaf("p", I32, (3,)), mode=2), r"sections \[2, 1, 1, 0\] without M-RoPE"),
    (lambda q, p: rope(q, leaf("p", F32, (12,))), r"positions 'p' must be an i32 vector"),
    (lambda q, p: rope(q, leaf("p", I32, (6, 2))), r"positions 'p' must be an i32 vector"),
    (lambda q, p: rope(q, p, mode=IMROPE | 1), r"mode 41: mode & 1 is no longer supported"),
    (lambda q, p: rope(q, p, freq_factors=leaf("ff", F32, (3,))), r"at least n_dims/2 = 4 values"),
])
def test_rope_refuses_what_ggml_asserts(build, match):
    q, pos = leaf("q", F32, (16, 4, 3)), leaf("inp_pos", I32, (12,))
    one_line_error(lambda: build(q, pos), r"node 'q \(rope\)' \(ROPE\): .*" + match)


def test_set_rows_is_a_view_of_its_destination():
    cache = leaf("cache_k_l3", F16, (32, 64), "cache")
    k = leaf("k_cur", F32, (32, 4))
    for ids in (leaf("attn_inp_k_idxs", I64, (4,)), leaf("ids32", I32, (4,))):
        s = ops.set_rows(cache, k, ids)
        assert s.src == [k, ids, cache]  # ggml's (legacy) source order
        assert (s.op, s.type, s.ne, s.nb, s.view_src, s.view_offs) == (Op.SET_ROWS, F16, cache.ne, cache.nb, cache, 0)
        ops.validate_node(s)
    # the transposed V cache: one element per row, row ids for every element
    v_view = ops.reshape(leaf("cache_v_l3", F16, (32, 64), "cache"), 1, 32 * 64)
    s = ops.set_rows(v_view, ops.reshape(leaf("v", F32, (32, 4)), 1, 128), leaf("v_idxs", I64, (128,)))
    assert s.ne == (1, 2048, 1, 1) and s.view_src.name == "cache_v_l3"


@pytest.mark.parametrize("rows, ids, match", [
    ((32, 5), (4,), r"5 rows but 4 ids"),
    ((16, 4), (4,), r"rows 'r' \(16, 4, 1, 1\) do not fit destination"),
    ((32, 4, 2), (4, 3), r"ids 'i' \(4, 3, 1, 1\) do not broadcast over rows"),
    ((32, 4, 2), (4, 0), r"ids 'i' \(4, 0, 1, 1\) do not broadcast over rows"),
])
def test_set_rows_refuses_what_ggml_asserts(rows, ids, match):
    cache = leaf("cache", F16, (32, 64, *rows[2:]), "cache")
    one_line_error(lambda: ops.set_rows(cache, leaf("r", F32, rows), leaf("i", I64, ids)),
                   r"node 'cache \(view\)' \(SET_ROWS\): .*" + match)


def test_set_rows_types():
    cache = leaf("cache", F16, (32, 64), "cache")
    one_line_error(lambda: ops.set_rows(cache, leaf("r", DType.BF16, (32, 4)), leaf("i", I64, (4,))),
                   r"rows 'r' must be f32 or f16, not bf16")
    one_line_error(lambda: ops.set_rows(cache, leaf("r", F32, (32, 4)), leaf("i", F32, (4,))),
                   r"row ids 'i' must be i64 or i32, not f32")
    strided = ops.view_2d(leaf("wide", F32, (64, 4)), 32, 4, 256, 0)
    assert ops.set_rows(cache, strided, leaf("i", I64, (4,))).ne == cache.ne  # rows need only nb[0] == 4
    columns = ops.transpose(leaf("tall", F32, (4, 32)))  # nb[0] = 16: rows not contiguous
    one_line_error(lambda: ops.set_rows(cache, columns, leaf("i", I64, (4,))), "need contiguous rows")


def test_flash_attn_ext_result_is_permuted_f32():
    q = ops.permute(leaf("q", F32, (16, 4, 3)), 0, 2, 1, 3)           # [d_k, n_batch 3, n_head 4, 1]
    k = ops.permute(leaf("k", F16, (16, 2, 32), "cache"), 0, 2, 1, 3)  # [d_k, n_kv 32, n_head_kv 2, 1]
    v = ops.permute(leaf("v", F16, (24, 2, 32), "cache"), 0, 2, 1, 3)  # d_v 24
    mask = leaf("attn_inp_kq_mask", F16, (32, 3, 1, 1))
    fa = ops.prec_set_acc(ops.flash_attn_ext(q, k, v, mask, 0.25), Prec.F32)
    assert (fa.op, fa.type, fa.ne, fa.view_src) == (Op.FLASH_ATTN_EXT, F32, (24, 4, 3, 1), None)
    assert fa.nb == (4, 96, 384, 1152) and fa.src == [q, k, v, mask]
    assert fa.op_params == {"scale": 0.25, "max_bias": 0.0, "logit_softcap": 0.0, "prec": "F32", "n_kv_max": 0}
    ops.validate_node(fa)
    sinks = leaf("sinks", F32, (4,), "weights")
    assert ops.flash_attn_ext(q, k, v, None, 0.25, sinks=sinks).src == [q, k, v, None, sinks]


@pytest.mark.parametrize("change, match", [
    (dict(k=(8, 2, 32)), r"k \(8, 32, 2, 1\) cannot multiply q \(16, 3, 4, 1\)"),
    (dict(k=(16, 3, 32)), r"k \(16, 32, 3, 1\) cannot multiply q"),
    (dict(mask_type=F32), r"mask 'm' must be f16, not f32"),
    (dict(mask=(32, 3, 3, 1)), r"mask \(32, 3, 3, 1\) does not broadcast over q"),
    (dict(max_bias=8.0, mask=None), r"max_bias > 0 \(ALiBi\) needs a mask"),
    (dict(sinks=3), r"sinks 's' must be f32 with one value per head \(4\)"),
])
def test_flash_attn_ext_refuses_what_ggml_asserts(change, match):
    q = ops.permute(leaf("q", F32, (16, 4, 3)), 0, 2, 1, 3)
    k = ops.permute(leaf("k", F16, change.get("k", (16, 2, 32)), "cache"), 0, 2, 1, 3)
    v = ops.permute(leaf("v", F16, (16, 2, 32), "cache"), 0, 2, 1, 3)
    mask_ne = change.get("mask", (32, 3, 1, 1))
    mask = None if mask_ne is None else leaf("m", change.get("mask_type", F16), mask_ne)
    sinks = leaf("s", F32, (change["sinks"],)) if "sinks" in change else None
    one_line_error(lambda: ops.flash_attn_ext(q, k, v, mask, 0.25, change.get("max_bias", 0.0), sinks=sinks),
                   r"\(FLASH_ATTN_EXT\): .*" + match)


def test_soft_max_ext_with_mask_and_scale():
    kq = leaf("kq", F32, (32, 3, 4))
    mask = leaf("attn_inp_kq_mask", F32, (32, 8))  # more rows than kq: the padded mask
    sm = ops.soft_max_ext(kq, mask, 0.125, 0.0)
    assert (sm.op, sm.type, sm.ne, sm.nb, sm.src) == (Op.SOFT_MAX, F32, kq.ne, kq.nb, [kq, mask])
    assert sm.op_params == {"scale": 0.125, "max_bias": 0.0}
    assert ops.soft_max(kq).src == [kq] and ops.soft_max_ext(kq, None, 1.0, inplace=True).view_src is kq
    assert ops.soft_max_ext(kq, leaf("m16", F16, (32, 3)), 1.0).src[1].type is F16
    for bad, match in [
        (lambda: ops.soft_max_ext(kq, leaf("m", F32, (16, 3)), 1.0), r"mask \(16, 3, 1, 1\) does not cover"),
        (lambda: ops.soft_max_ext(kq, leaf("m", F32, (32, 2)), 1.0), r"does not cover 'kq' \(32, 3, 4, 1\)"),
        (lambda: ops.soft_max_ext(kq, leaf("m", F32, (32, 3, 3)), 1.0), r"does not broadcast"),
        (lambda: ops.soft_max_ext(kq, leaf("m", I32, (32, 3)), 1.0), r"mask 'm' must be f16 or f32"),
        (lambda: ops.soft_max_ext(kq, None, 1.0, 8.0), r"max_bias > 0 \(ALiBi\) needs a mask"),
        (lambda: ops.soft_max_ext(ops.transpose(kq), None, 1.0), r"must be contiguous"),
        (lambda: ops.soft_max_ext(kq, None, 1.0, sinks=leaf("s", F32, (3,))), r"one value per head \(4\)"),
    ]:
        one_line_error(bad, r"\(SOFT_MAX\): .*" + match)


def test_glu_split_and_fused():
    gate, up = leaf("ffn_gate", F32, (48, 3)), leaf("ffn_up", F32, (48, 3))
    s = ops.swiglu_split(gate, up)
    assert (s.op, s.ne, s.src, s.op_params) == (Op.GLU, (48, 3, 1, 1), [gate, up], {"kind": "SWIGLU", "swapped": False})
    fused = ops.glu(gate, Glu.GEGLU, swapped=True)
    assert fused.ne == (24, 3, 1, 1) and fused.op_params == {"kind": "GEGLU", "swapped": True}
    assert ops.glu_split(gate, up, Glu.SWIGLU_OAI, alpha=1.702, limit=7.0).op_params["limit"] == 7.0
    for bad, match in [
        (lambda: ops.swiglu_split(gate, leaf("u", F32, (48, 4))), r"gate 'u' f32 \(48, 4, 1, 1\) differs from"),
        (lambda: ops.swiglu_split(gate, leaf("u", F16, (48, 3))), r"gate 'u' f16"),
        (lambda: ops.swiglu(ops.transpose(gate)), r"must be contiguous in its rows"),
        (lambda: ops.glu_split(gate, up, Glu.SWIGLU_CLAMP), r"op_params lack 'limit'"),
    ]:
        one_line_error(bad, r"\(GLU\): .*" + match)


def test_get_rows_of_f16_gives_f32_and_checks_ne3():
    tok_embd = leaf("token_embd.weight", F16, (16, 100), "weights")
    assert ops.get_rows(tok_embd, leaf("inp_tokens", I32, (5,))).type is F32
    cur = leaf("cur", F32, (16, 5))
    assert ops.get_rows(cur, leaf("out_ids", I32, (1,))).ne == (16, 1, 1, 1)
    one_line_error(lambda: ops.get_rows(leaf("a", F32, (4, 3, 2, 2)), leaf("i", I32, (3, 2, 3))),
                   r"ids \(3, 2, 3, 1\) do not match rows of \(4, 3, 2, 2\)")


def test_zero_size_nodes_build_and_validate():
    # build_rs: the state clear is a no-op on a zero-size view; no extra states to copy
    states = leaf("cache_s_l0", F32, (64, 4), "cache")
    zero = ops.scale(ops.view_1d(states, 0, 0), 0.0, inplace=True)
    extra = ops.get_rows(states, leaf("rs_s_copy_extra", I32, (0,)))
    dst = ops.view_2d(states, 64, 0, states.nb[1], 4 * states.nb[1])  # starts at the end of the buffer
    copy = ops.cpy(extra, dst)
    g = Graph()
    for t in (zero, copy):
        g.expand(t)
    assert all(n.is_empty for n in g.nodes if n.op is not Op.NONE)
    ops.validate(g)
    g2 = serialize.loads(serialize.dumps(g))
    assert [n.ne for n in g2.nodes] == [n.ne for n in g.nodes]


def test_a_zero_divisor_is_a_graph_error_not_a_crash():
    one_line_error(lambda: ops.mul_mat(leaf("w", F32, (8, 4, 0)), leaf("x", F32, (8, 3, 2))),
                   r"batch dims do not broadcast")


# ---------------------------------------------------------------------------------------------------------------------
# decoding op_params words as ggml.c lays them out
# ---------------------------------------------------------------------------------------------------------------------


def words(*fmt_values) -> list[int]:
    """16 int32 words: pairs (struct code, value) packed from word 0 up ('i' int32, 'f' f32, 'Q' a size_t)."""
    raw = b"".join(struct.pack("<" + code, v) for code, v in fmt_values)
    raw += bytes(64 - len(raw))
    return list(struct.unpack("<16i", raw))


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def decode(op_name: str, w: list[int], **kw) -> tuple[Op, dict]:
    return ir_op(op_name, w, inplace=kw.pop("inplace", False), is_node=True, **kw)


def test_decode_rope_multi():
    # ggml_rope_impl: {n_past 0, n_dims, mode, n_ctx 0, n_ctx_orig}, then six f32s, the 4 sections, n_offs
    w = words(("i", 0), ("i", 64), ("i", IMROPE), ("i", 0), ("i", 262144), ("f", 1e7), ("f", 1.0), ("f", 0.0),
              ("f", 1.0), ("f", 32.0), ("f", 1.0), ("i", 11), ("i", 11), ("i", 10), ("i", 0), ("i", 0))
    assert decode("ROPE", w) == (Op.ROPE, {
        "n_dims": 64, "mode": IMROPE, "n_ctx_orig": 262144, "freq_base": f32(1e7), "freq_scale": 1.0,
        "ext_factor": 0.0, "attn_factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "sections": (11, 11, 10, 0),
        "n_offs": 0})
    assert decode("ROPE", w, inplace=True)[1]["inplace"] is True
    legacy = list(w)
    legacy[0] = 5  # n_past: no longer part of ggml's rope; a word gdnpass cannot place keeps the node opaque
    op, params = decode("ROPE", legacy)
    assert op is Op.OPAQUE and params["why"] == "op_params word 0 = 5 is not modelled"
    assert params["ggml_op_params"] == legacy and params["can_inplace"] is True


def test_decode_soft_max_and_flash_attn():
    assert decode("SOFT_MAX", words(("f", 0.0625), ("f", 0.0))) == (Op.SOFT_MAX, {"scale": 0.0625, "max_bias": 0.0})
    assert decode("SOFT_MAX", words(("f", 1.0), ("f", 8.0)), inplace=True)[1] == {
        "scale": 1.0, "max_bias": 8.0, "inplace": True}
    # ggml_flash_attn_ext {scale, max_bias, logit_softcap}; ggml_prec_set_acc -> word 3; set_n_kv_max -> word 4
    w = words(("f", 0.0625), ("f", 0.0), ("f", 30.0), ("i", 10), ("i", 512))
    assert decode("FLASH_ATTN_EXT", w) == (Op.FLASH_ATTN_EXT, {
        "scale": 0.0625, "max_bias": 0.0, "logit_softcap": 30.0, "prec": "F32", "n_kv_max": 512})
    assert decode("FLASH_ATTN_EXT", words(("f", 1.0)))[1]["prec"] == "UNDEFINED"
    op, params = decode("FLASH_ATTN_EXT", words(("f", 1.0), ("f", 0.0), ("f", 0.0), ("i", 11)))
    assert op is Op.OPAQUE and "word 3 (prec) = 11 is not a prec ggml defines" in params["why"]


def test_decode_glu():
    assert decode("GLU", words(("i", 2), ("i", 0))) == (Op.GLU, {"kind": "SWIGLU", "swapped": False})
    assert decode("GLU", words(("i", 1), ("i", 1))) == (Op.GLU, {"kind": "GEGLU", "swapped": True})
    assert decode("GLU", words(("i", 99)), glu_name="SWIGLU") == (Op.GLU, {"kind": "SWIGLU", "swapped": False})
    # swiglu_oai: alpha in word 2, limit in word 3; swiglu_clamp: limit alone in word 3
    assert decode("GLU", words(("i", 3), ("i", 0), ("f", 1.702), ("f", 7.0)))[1] == {
        "kind": "SWIGLU_OAI", "swapped": False, "alpha": f32(1.702), "limit": 7.0}
    assert decode("GLU", words(("i", 6), ("i", 0), ("i", 0), ("f", 7.0)))[1] == {
        "kind": "SWIGLU_CLAMP", "swapped": False, "limit": 7.0}
    assert decode("GLU", words(("i", 7)))[1]["ggml_op"] == "GLU(#7)"
    assert decode("GLU", words(("i", 2), ("i", 0), ("f", 1.0)))[0] is Op.OPAQUE  # alpha on a plain SWIGLU


def test_decode_unary_kinds():
    for i, name in enumerate(UNARY_OPS):
        op, params = decode("UNARY", words(("i", i)))
        if name == "XIELU":  # its four coefficients are not modelled
            assert (op, params["ggml_op"]) == (Op.OPAQUE, "UNARY(XIELU)")
        else:
            assert (op, params) == (Op.UNARY, {"kind": name}) and Unary(name)
    assert decode("UNARY", words(("i", 0)), unary_name="SOFTPLUS", inplace=True) == (
        Op.UNARY, {"kind": "SOFTPLUS", "inplace": True})


def test_decode_set_rows_mul_mat_and_the_rest():
    assert decode("SET_ROWS", words(), inplace=True) == (Op.SET_ROWS, {})  # always a view: nothing to record
    assert decode("MUL_MAT", words()) == (Op.MUL_MAT, {})
    assert decode("MUL_MAT", words(("i", 10))) == (Op.MUL_MAT, {"prec": "F32"})  # ggml_prec_set_acc(kq, F32)
    assert decode("MUL_MAT", words(("i", 0), ("i", 1)))[1]["why"] == "op_params word 1 = 1 is not modelled"  # hint
    assert decode("VIEW", words(("Q", 5 << 32 | 64)), inplace=True) == (Op.VIEW, {"offset": 5 << 32 | 64})
    assert decode("PERMUTE", words(("i", 0), ("i", 2), ("i", 1), ("i", 3))) == (Op.PERMUTE, {"axes": (0, 2, 1, 3)})
    assert decode("TRANSPOSE", words()) == (Op.TRANSPOSE, {"axes": (1, 0, 2, 3)})
    assert decode("SCALE", words(("f", 0.0), ("f", 0.0)), inplace=True) == (
        Op.SCALE, {"s": 0.0, "b": 0.0, "inplace": True})
    assert decode("RMS_NORM", words(("f", 1e-6))) == (Op.RMS_NORM, {"eps": f32(1e-6)})
    assert decode("GATED_DELTA_NET", words(("i", 8))) == (Op.GATED_DELTA_NET, {"K": 8})
    assert decode("CONCAT", words(("i", 0))) == (Op.CONCAT, {"dim": 0})
    assert ir_op("NONE", words(), inplace=False, is_node=True) == (Op.NONE, {"hint": "dependency"})
    assert ir_op("NONE", words(), inplace=False, is_node=False) == (Op.NONE, {})
    assert decode("SQR", [1, 2]) == (Op.OPAQUE, {"ggml_op": "SQR", "ggml_op_params": [1, 2], "can_inplace": True})
    assert decode("ARGMAX", [])[1]["can_inplace"] is False
    assert decode("SUM_ROWS", []) == (Op.SUM_ROWS, {})  # modelled since issue 36


def test_decode_takes_signed_and_unsigned_words():
    signed = words(("f", -2.5), ("f", -0.75))  # negative floats: the sign bit makes the int32 word negative
    unsigned = [w & 0xFFFFFFFF for w in signed]
    assert signed[0] < 0 and unsigned[0] > 0
    assert decode("SCALE", signed) == decode("SCALE", unsigned) == (
        Op.SCALE, {"s": -2.5, "b": -0.75, "inplace": False})
    assert decode("CONCAT", [0xFFFFFFFF]) == decode("CONCAT", [-1]) == (Op.CONCAT, {"dim": -1})  # short: rest is 0


def test_decoded_params_pass_the_rules():
    """What the decoder makes of ggml's words is what the constructors record (the node validates unchanged)."""
    q, pos = leaf("q", F32, (16, 4, 3)), leaf("inp_pos", I32, (12,))
    built = rope(q, pos, freq_factors=None)
    w = words(("i", 0), ("i", 8), ("i", IMROPE), ("i", 0), ("i", 4096), ("f", 1e7), ("f", 1.0), ("f", 0.0),
              ("f", 1.0), ("f", 32.0), ("f", 1.0), ("i", 2), ("i", 1), ("i", 1), ("i", 0))
    op, params = decode("ROPE", w)
    node = Tensor("q (rope)", F32, built.ne, built.nb, op, params, [q, pos])
    ops.validate_node(node)
    assert params == {**built.op_params, "freq_base": f32(1e7)}


# ---------------------------------------------------------------------------------------------------------------------
# a qwen35 attention block (build_layer_attn + build_attn + build_ffn), as ggml builds it: support.attention_block
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flash", [True, False], ids=["flash-attn", "soft-max"])
def test_attention_block_builds_validates_saves_and_dumps(flash, tmp_path):
    F = IrCalls()
    attention_block(F, flash)
    g = F.g
    ops.validate(g)
    want = {Op.ROPE, Op.SET_ROWS, Op.GLU, Op.GET_ROWS, Op.UNARY} | (
        {Op.FLASH_ATTN_EXT} if flash else {Op.SOFT_MAX, Op.CONT})
    assert want <= {n.op for n in g.nodes}
    alloc.plan(g, 32)
    serialize.save(g, tmp_path / "attn.json")
    g2 = serialize.load(tmp_path / "attn.json")
    assert serialize.to_dict(g2) == serialize.to_dict(g)
    text = "\n".join(format_rows([Row(" ", t, i) for i, t in enumerate(g2.nodes)], {}))
    assert "IMROPE n_dims=8 sections=2,1,1,0 base=1e+07" in text and "GLU(SWIGLU)" in text and "split" in text
    assert "ids i64" in text and "(empty)" in text
    if flash:
        assert "scale=0.25 prec=F32 mask" in text
    else:
        assert "scale=0.25 mask" in text and "prec=F32" in text  # the kq MUL_MAT's


def test_params_text_of_each_new_op():
    q = leaf("q", F32, (16, 4, 3))
    pos = leaf("inp_pos", I32, (12,))
    assert params_text(rope(q, pos, freq_factors=leaf("ff", F32, (4,)))) == (
        "IMROPE n_dims=8 sections=2,1,1,0 base=1e+07 freq_factors")
    kq = leaf("kq", F32, (32, 3, 4))
    assert params_text(ops.soft_max_ext(kq, None, 0.125, inplace=True)) == "scale=0.125 inplace"
    assert params_text(ops.glu(leaf("a", F32, (8, 2)), Glu.SWIGLU, swapped=True)) == "fused swapped"
    assert params_text(ops.scale(kq, 2.0, 1.0)) == "s=2 b=1"


def test_executor_refuses_the_new_ops_before_running_anything():
    """A modelled op without a kernel (here ROPE in VISION mode, the one ROPE mode gdnpass does not execute; the
    attention ops themselves run: tests/kernels/test_attention_ops.py) is refused by name before any node runs."""
    F = IrCalls()
    attention_block(F, flash=True)
    g = F.g
    for n in g.nodes:
        if n.op is Op.ROPE:
            n.op_params["mode"] = 24  # GGML_ROPE_TYPE_VISION
    alloc.plan(g, 32)
    ex = Executor(g)
    for b in ex.buffers.values():  # (not fill(): the block's integer inputs have no values gdnpass would choose)
        b.fill_(0x5A)
    before = ex.snapshot()
    msg = one_line_error(ex.run, r"node '[^']*': gdnpass cannot execute ROPE ")
    assert "has no kernel for it" in msg
    assert all(bool((ex.buffers[k] == v).all()) for k, v in before.items())  # nothing ran, nothing was written
    neg = ops.neg(leaf("x", F32, (4,)))
    g = Graph()
    g.expand(neg)
    alloc.plan(g, 32)
    one_line_error(Executor(g).run, r"node 'x \(neg\)': gdnpass cannot execute UNARY\(NEG\)")


# ---------------------------------------------------------------------------------------------------------------------
# the same block built by ggml itself (ggml-python's ggml 0.15.3), imported
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flash", [True, False], ids=["flash-attn", "soft-max"])
def test_ggml_builds_the_same_block(flash):
    fg = pytest.importorskip("gdnpass.frontends.ggml")
    pytest.importorskip("ggml")
    ours = IrCalls()
    attention_block(ours, flash)
    with fg.GgmlSession() as s:
        attention_block(GgmlCalls(s), flash)
        theirs = s.import_graph().graph  # validated by gdnpass's rules on import
    assert fg.diff_graphs(ours.g, theirs) == []
    assert {n.op for n in theirs.nodes} >= {Op.ROPE, Op.SET_ROWS, Op.GLU} and not any(
        n.op is Op.OPAQUE for n in theirs.nodes)
