"""The expert FFN's ops (issue 36): ARGSORT, SUM_ROWS, CLAMP, DIV, MUL_MAT_ID.

1. Their rules and constructors: shapes, types, views, ggml's asserts as one-line refusals.
2. Their torch references against semantics written out independently here (numpy, loops): ggml-cpu's std::sort
   order, the double sum, MAX(MIN(x, max), min) with NaN going to max, one correctly rounded f32 division, each
   token's selected experts.
3. CLAMP's max of +inf through the graph file (written as "Infinity") and the decoder; NaN refused.
4. The Triton backend refuses each of them in one line naming the op, but MUL_MAT_ID, which runs on the mat-vec
   kernel: each (slot, token) product the bytes of the single mat-vec of its expert's matrix.
5. llama.cpp itself: its captured verify of the tiny qwen35moe file decodes every one of them (no OPAQUE node
   left), validates, and node by node, fed llama.cpp's own inputs, gdnpass's references give llama.cpp's bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gdnpass import ops, serialize
from gdnpass.errors import GraphError, KernelError
from gdnpass.frontends import decode
from gdnpass.ir import DType, Graph, Op, op_label, runs_kernel
from gdnpass.kernels import reference as ref
from gdnpass.kernels.backends import GGML_CPU_BACKEND, TORCH_BACKEND, TRITON_BACKEND, kernel
from gdnpass.runtime import TORCH_DTYPES, Executor

F32, I32 = DType.F32, DType.I32
NEW_OPS = (Op.ARGSORT, Op.SUM_ROWS, Op.CLAMP, Op.DIV, Op.MUL_MAT_ID)


def _inp(name, type_, ne):
    return ops.new_tensor(name, type_, ne, buffer="input")


# ---- 1. rules and constructors ---------------------------------------------------------------------------------------


def test_constructors_make_ggml_s_shapes():
    probs = _inp("probs", F32, (8, 4))
    topk = ops.argsort_top_k(probs, 2)
    srt = topk.view_src
    assert (srt.op, srt.type, srt.ne, srt.op_params) == (Op.ARGSORT, I32, (8, 4, 1, 1), {"order": 1})
    assert (topk.op, topk.ne, topk.nb, topk.view_offs) == (Op.VIEW, (2, 4, 1, 1), srt.nb, 0)
    w = ops.reshape(ops.get_rows(ops.reshape(probs, 1, 8, 4), topk), 2, 4)
    total = ops.sum_rows(w)
    assert (total.ne, total.type) == ((1, 4, 1, 1), F32)
    c = ops.clamp(total, 6.103515625e-5, float("inf"))
    assert c.ne == total.ne and c.view_src is None and c.op_params == {"min": 6.103515625e-5, "max": float("inf")}
    assert ops.clamp(total, 0.0, 1.0, inplace=True).view_src is total  # ggml_clamp_inplace
    d = ops.div(w, c)
    assert d.ne == w.ne and d.view_src is None
    exps = _inp("exps", F32, (16, 32, 8))
    x = _inp("x", F32, (16, 1, 4))
    y = ops.mul_mat_id(exps, x, topk)
    assert (y.ne, y.type, y.src) == ((32, 2, 4, 1), F32, [exps, x, topk])
    ops.validate(_graph([d, y]))


@pytest.mark.parametrize("build, msg", [
    (lambda: ops.argsort(_inp("a", I32, (8, 4)), 1), "must be a contiguous f32 tensor"),
    (lambda: ops.argsort(_inp("a", F32, (8, 4)), 2), "order 2 is not a ggml_sort_order"),
    (lambda: ops.argsort_top_k(_inp("a", F32, (8, 4)), 9), "k 9 must be 1..8"),
    (lambda: ops.sum_rows(_inp("a", I32, (8, 4))), "must be f32"),
    (lambda: ops.div(_inp("a", F32, (2, 4)), _inp("b", F32, (1, 3))), "does not broadcast"),
    (lambda: ops.mul_mat_id(_inp("w", F32, (16, 32, 8)), _inp("x", F32, (16, 1, 4)), _inp("i", F32, (2, 4))),
     "expert ids 'i' must be i32"),
    (lambda: ops.mul_mat_id(_inp("w", F32, (16, 32, 8)), _inp("x", F32, (16, 1, 3)), _inp("i", I32, (2, 4))),
     "4 expert lists for 3 tokens"),
    (lambda: ops.mul_mat_id(_inp("w", F32, (16, 32, 8)), _inp("x", F32, (16, 3, 4)), _inp("i", I32, (2, 4))),
     "do not broadcast over 2 slots"),
    (lambda: ops.mul_mat_id(_inp("w", F32, (16, 32, 8)), _inp("x", F32, (12, 1, 4)), _inp("i", I32, (2, 4))),
     "inner dims differ"),
])
def test_rules_refuse_what_ggml_asserts_in_one_line(build, msg):
    with pytest.raises(GraphError, match=msg) as e:
        build()
    assert "\n" not in str(e.value)


# ---- 2. the references -----------------------------------------------------------------------------------------------


def test_argsort_orders_rows_as_std_sort():
    x = torch.randn(1, 2, 5, 8)
    for order, sign in ((0, 1), (1, -1)):
        got = ref.argsort(x, order)
        assert got.dtype == torch.int32
        want = np.argsort(sign * x.numpy(), axis=-1, kind="stable")
        assert np.array_equal(got.numpy(), want)
    ties = torch.tensor([[[[1.0, 3.0, 3.0, 2.0]]]])  # std::sort leaves ties unspecified; here: index order
    assert ref.argsort(ties, 1).tolist() == [[[[1, 2, 3, 0]]]]


def test_sum_rows_sums_in_double_and_rounds_once():
    x = torch.tensor([[[[1.0, 2.0 ** -24, 2.0 ** -24, -1.0]]]])  # f32 left to right loses both small terms
    assert ref.sum_rows(x).item() == 2.0 ** -23
    r = torch.randn(1, 3, 4, 37)
    want = r.numpy().astype(np.float64).sum(-1, keepdims=True).astype(np.float32)
    assert np.array_equal(ref.sum_rows(r).numpy(), want)


def test_clamp_is_max_of_min_with_ggml_s_macros():
    x = torch.tensor([[[[-1.0, 0.0, 1e-9, 0.5, 2.0 ** 100, float("inf"), float("nan")]]]])
    got = ref.clamp(x, 6.103515625e-5, float("inf"))
    lo = 6.103515625e-5
    assert got.tolist()[0][0][0][:6] == [lo, lo, lo, 0.5, 2.0 ** 100, float("inf")]
    # MIN(NaN, max) is max (the comparison is false), then MAX(max, min) is max: +inf here
    assert got[0, 0, 0, 6].item() == float("inf")
    assert ref.clamp(x, -2.0, 2.0)[0, 0, 0].tolist() == [-1.0, 0.0, float(np.float32(1e-9)), 0.5, 2.0, 2.0, 2.0]


def test_div_is_one_correctly_rounded_f32_division_with_broadcast():
    a = torch.randn(1, 3, 4, 8) * 1e3
    b = torch.rand(1, 1, 4, 1) + 0.5
    got = ref.div(a, b)
    want = a.numpy() / np.broadcast_to(b.numpy(), a.shape)  # numpy's f32 division: IEEE, correctly rounded
    assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want)


def test_mul_mat_id_multiplies_each_token_s_selected_experts():
    gen = torch.Generator().manual_seed(0)
    K, M, n_as, n_used, n_t = 16, 12, 6, 3, 5
    w = torch.randn(1, n_as, M, K, generator=gen)
    ids = torch.stack([torch.randperm(n_as, generator=gen)[:n_used] for _ in range(n_t)]).int().view(1, 1, n_t, n_used)
    for n_b in (1, n_used):
        x = torch.randn(1, n_t, n_b, K, generator=gen)
        got = ref.mul_mat_id(w, x, ids)
        assert got.shape == (1, n_t, n_used, M)
        for t in range(n_t):
            for e in range(n_used):
                want = w[0, ids[0, 0, t, e]].double() @ x[0, t, e % n_b].double()
                assert torch.allclose(got[0, t, e].double(), want, rtol=1e-5, atol=1e-5)
    bad = ids.clone()
    bad[0, 0, 2, 1] = n_as
    with pytest.raises(KernelError, match=f"MUL_MAT_ID: expert id {n_as} is outside the {n_as} experts"):
        ref.mul_mat_id(w, x, bad)


def test_mul_mat_id_of_bf16_experts_rounds_the_activation_on_the_cpu_form():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(1, 4, 8, 32, generator=gen).to(torch.bfloat16)
    x = torch.randn(1, 3, 1, 32, generator=gen)
    ids = torch.tensor([[[[0, 3], [2, 1], [3, 0]]]], dtype=torch.int32)
    cpu, f32 = ref.mul_mat_id(w, x, ids, cpu=True), ref.mul_mat_id(w, x, ids)
    for t in range(3):
        for e in range(2):
            m = w[0, ids[0, 0, t, e]].double()
            rounded, exact_x = m @ x[0, t, 0].bfloat16().double(), m @ x[0, t, 0].double()
            assert (rounded - exact_x).abs().max() > 1e-3  # (the two forms are told apart)
            assert torch.allclose(cpu[0, t, e].double(), rounded, rtol=0, atol=1e-5)
            assert torch.allclose(f32[0, t, e].double(), exact_x, rtol=0, atol=1e-5)


# ---- 3. +inf in the graph file and the decoder ----------------------------------------------------------------------


def _graph(outs, leafs=()) -> Graph:
    """ggml_build_forward_expand of each of ``outs`` in turn."""
    g = Graph()
    for t in outs:
        g.expand(t)
    return g


def test_an_infinite_clamp_bound_survives_the_graph_file(tmp_path):
    w = _inp("w", F32, (2, 4))
    s = ops.sum_rows(w)
    c = ops.clamp(s, 6.103515625e-5, float("inf"))
    lo = ops.clamp(s, float("-inf"), 1.0)
    lo.name = "lo"
    g = _graph([s, c, lo], [w])
    text = serialize.dumps(g)
    entries = [json.loads(line.rstrip(",")) for line in text.splitlines() if line.startswith('  {"id"')]
    by_name = {e["name"]: e for e in entries}
    assert by_name[c.name]["op_params"]["max"] == "Infinity" and by_name[lo.name]["op_params"]["min"] == "-Infinity"
    back = serialize.loads(text)
    got = {n.name: n.op_params for n in back.nodes}
    assert got[c.name] == {"min": 6.103515625e-5, "max": float("inf")}
    assert got[lo.name] == {"min": float("-inf"), "max": 1.0}
    assert serialize.dumps(back) == text


@pytest.mark.parametrize("key, value, msg", [
    ("max", "nan", "'max' must be a number or ±inf"),
    ("max", "inf", "'max' must be a number or ±inf"),  # JSON's name is "Infinity", as gdnpass writes it
    ("max", "NaN", "'max' must be a number or ±inf"),
    ("min", None, "'min' must be a number or ±inf"),
])
def test_a_bad_clamp_bound_in_a_file_is_one_line(key, value, msg):
    w = _inp("w", F32, (2, 4))
    s = ops.sum_rows(w)
    text = serialize.dumps(_graph([s, ops.clamp(s, 0.0, float("inf"))], [w]))
    d = json.loads(text)
    d["tensors"][-1]["op_params"][key] = value
    with pytest.raises(GraphError, match=msg) as e:
        serialize.loads(json.dumps(d))
    assert "\n" not in str(e.value)


def test_nan_bounds_and_inf_elsewhere_are_refused():
    w = _inp("w", F32, (2, 4))
    s = ops.sum_rows(w)
    with pytest.raises(GraphError, match="not a finite number"):
        serialize.dumps(_graph([s, ops.clamp(s, 0.0, float("nan"))], [w]))
    text = serialize.dumps(_graph([ops.rms_norm(w, 1e-6)], [w]))
    d = json.loads(text)
    d["tensors"][-1]["op_params"]["eps"] = "Infinity"  # only a BOUND reads "Infinity"
    with pytest.raises(GraphError, match="'eps' must be a finite number"):
        serialize.loads(json.dumps(d))


def test_the_decoder_reads_an_infinite_max():
    inf_bits = int(np.array([np.inf], dtype=np.float32).view(np.int32)[0])
    lo_bits = int(np.array([6.103515625e-5], dtype=np.float32).view(np.int32)[0])
    op, params = decode.ir_op("CLAMP", [lo_bits, inf_bits], inplace=False, is_node=True)
    assert op is Op.CLAMP and params == {"min": 6.103515625e-5, "max": float("inf")}
    op, params = decode.ir_op("CLAMP", [lo_bits, inf_bits], inplace=True, is_node=True)
    assert params["inplace"] is True


# ---- 4. Triton: refused by name ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [o for o in NEW_OPS if o is not Op.MUL_MAT_ID], ids=lambda o: o.value)
def test_triton_refuses_each_by_name(op):
    probs = _inp("probs", F32, (8, 4))
    topk = ops.argsort_top_k(probs, 2)
    total = ops.sum_rows(probs)
    node = {Op.ARGSORT: topk.view_src, Op.SUM_ROWS: total, Op.CLAMP: ops.clamp(total, 0.0, float("inf")),
            Op.DIV: ops.div(probs, total),
            Op.MUL_MAT_ID: ops.mul_mat_id(_inp("w", F32, (16, 32, 8)), _inp("x", F32, (16, 1, 4)), topk)}[op]
    fn = kernel(TRITON_BACKEND, node)
    with pytest.raises(KernelError, match=f"^{op.value} has no Triton kernel yet") as e:
        fn(node, [], None)
    assert "\n" not in str(e.value)
    assert kernel(TORCH_BACKEND, node) is not None


@pytest.mark.parametrize("wt", ["f32", "bf16"])
@pytest.mark.parametrize("n_b", [1, 3], ids=["b-shared", "b-per-slot"])
def test_mul_mat_id_on_the_mat_vec_kernel_is_each_expert_s_single_mat_vec(wt, n_b, device):
    """The Triton MUL_MAT_ID (the mat-vec kernel, the experts' matrices found from the ids on the device): each
    slot's product is the bytes of the single mat-vec of its expert's matrix and column (same kernel, same tile),
    repeated and unused experts included, b shared by the slots (the gate / up form) or one row a slot (down), and
    within f32 summation accuracy of the reference; an id outside the experts is one line."""
    from gdnpass.kernels import triton_matvec as mv
    from support.arena import Arena, assert_close, rnd
    from support.compare import assert_bits

    K, M, n_as, n_used, n_t = 64, 40, 5, 3, 2
    a = Arena(1 << 22)
    w = a.put((rnd(1, n_as, M, K) / 8).to({"f32": torch.float32, "bf16": torch.bfloat16}[wt]))
    x = a.put(rnd(1, n_t, n_b, K))
    ids = a.put(torch.tensor([[[[4, 0, 4], [2, 2, 1]]]], dtype=torch.int32, device=device))  # (1, 1, n_t, n_used)
    out = a.view((1, n_t, n_used, M))
    a.run(lambda: mv.mul_mat_id(w, x, ids, out), out)
    for t in range(n_t):
        for e in range(n_used):
            one = a.view((1, 1, 1, M))
            expert = int(ids[0, 0, t, e])
            a.run(lambda: mv.mul_mat_vec(w[:, expert:expert + 1], x[:, t:t + 1, e % n_b:e % n_b + 1], one), one)
            assert_bits(out[0, t, e], one[0, 0, 0], f"slot {e} of token {t} (expert {expert})")
    assert_close(out, ref.mul_mat_id(w, x, ids, DType.parse(wt)), rtol=1e-5)
    bad = a.put(torch.tensor([[[[0, 5, 1], [1, 1, 1]]]], dtype=torch.int32, device=device))
    with pytest.raises(KernelError, match="^MUL_MAT_ID: an expert id outside the 5 experts$"):
        mv.mul_mat_id(w, x, bad, out)


def test_a_triton_executor_refuses_before_running_anything():
    """The Triton backend's executor names the first such node before any node runs (as it refuses an op without
    any kernel)."""
    probs = _inp("probs", F32, (8, 4))
    g = _graph([ops.div(ops.scale(probs, 2.0), ops.sum_rows(probs))])
    from gdnpass.alloc import plan

    plan(g, 32)
    ex = Executor(g, backend=TRITON_BACKEND)
    ran = []
    ex.kernels = {**ex.kernels, Op.SCALE: lambda *a: ran.append("SCALE")}
    with pytest.raises(KernelError, match=r"^node '.*\(sum_rows\)': SUM_ROWS has no Triton kernel yet") as e:
        ex.run()
    assert "\n" not in str(e.value) and ran == []


# ---- 5. llama.cpp: the captured qwen35moe verify ------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_capture(llama, tmp_path_factory):
    from gdnpass.frontends.llama import capture
    from gdnpass.models.gguf_write import write_gguf

    path = write_gguf("tiny-qwen35moe", tmp_path_factory.mktemp("moe") / "moe.gguf", wtype="f32", seed=1)
    s = capture.Settings(n_tokens=4, n_rs_seq=3, n_ubatch=8, n_batch=8, record_memory=True, record_nodes=True)
    return path, capture.capture(path, s, install=llama)


def _replay(cap, path: Path, backend: dict) -> Executor:
    """An Executor of the captured graph with llama.cpp's memory at the verify's start and the file's weights (as
    tests/kernels/test_attention_ops.py's replay)."""
    from gguf import GGUFReader

    g = cap.verify
    ex = Executor(g, backend=backend)
    for name, data in cap.memory.items():
        ex.buffers[name][: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    reader = GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    for t in g.leafs:
        if t.buffer == "weights":
            raw = np.ascontiguousarray(by_name[t.name].data).reshape(-1).view(np.uint8)
            ex.buffers["weights"][t.offset: t.offset + raw.size].copy_(torch.from_numpy(raw.copy()))
    return ex


def test_the_capture_decodes_every_moe_op(moe_capture):
    """No OPAQUE node is left in llama.cpp's qwen35moe verify; its CLAMP holds +inf, and gallocr placed it over
    the SUM_ROWS it clamps (CLAMP is in ggml's in-place list, and so in gdnpass's)."""
    _, cap = moe_capture
    g = cap.verify
    assert not [n for n in g.nodes if n.op is Op.OPAQUE]
    ops.validate(g)
    n_layer = 4
    found = {op: [n for n in g.nodes if n.op is op] for op in NEW_OPS}
    assert {op.value: len(v) for op, v in found.items()} == {"ARGSORT": n_layer, "SUM_ROWS": n_layer,
                                                             "CLAMP": n_layer, "DIV": n_layer,
                                                             "MUL_MAT_ID": 3 * n_layer}
    for c in found[Op.CLAMP]:
        assert c.op_params == {"min": 6.103515625e-5, "max": float("inf")}
        assert c.src[0].op is Op.SUM_ROWS and (c.buffer, c.offset) == (c.src[0].buffer, c.src[0].offset)
    assert all(n.op_params == {"order": 1} for n in found[Op.ARGSORT])
    back = serialize.loads(serialize.dumps(g))  # +inf through the graph file
    assert [n.op_params for n in back.nodes if n.op is Op.CLAMP] == [c.op_params for c in found[Op.CLAMP]]


def test_every_moe_node_matches_llama_cpp_s_bytes(moe_capture):
    """Node by node, each fed llama.cpp's own inputs (its bytes copied in after each node), gdnpass's references
    (GGML_CPU_BACKEND) against llama.cpp's bytes: ARGSORT, SUM_ROWS, CLAMP, DIV and the data movement bit for bit,
    MUL_MAT_ID within 1e-6 (ggml's f32 sums run in its own order; measured 4.8e-7)."""
    path, cap = moe_capture
    g = cap.verify
    ex = _replay(cap, path, GGML_CPU_BACKEND)
    bitwise = {"ARGSORT", "SUM_ROWS", "CLAMP", "DIV", "GET_ROWS", "CPY", "CONT", "CONCAT", "ADD", "MUL", "SCALE",
               "RMS_NORM", "SSM_CONV"}
    worst: dict[str, float] = {}
    seen = set()
    for i, n in enumerate(g.nodes):
        if not runs_kernel(n):
            continue
        fn = kernel(ex.kernels, n)
        fn(n, [ex.view(s) if s is not None else None for s in [*n.src, *n.outs]], ex.view(n))
        raw = torch.frombuffer(bytearray(cap.node_data[i]), dtype=TORCH_DTYPES[n.type])
        theirs = raw.as_strided(tuple(reversed(n.ne)), tuple(x // n.type.size for x in reversed(n.nb)), 0)
        ours = ex.view(n)
        label = op_label(n)
        seen.add(n.op)
        if label in bitwise:
            assert torch.equal(ours.contiguous().view(torch.uint8), theirs.contiguous().view(torch.uint8)), \
                f"node {i} {n.name!r} ({label}) is not bit-identical to llama.cpp's"
        else:
            a, b = ours.double(), theirs.double()
            worst[label] = max(worst.get(label, 0.0), float((a - b).abs().max() / b.abs().max()))
        ours.copy_(theirs)
    assert set(NEW_OPS) <= seen
    # the other ops are test_attention_ops.py's (1e-6 on tiny-qwen35); here FLASH_ATTN_EXT measured 2.0e-6
    assert worst.get("MUL_MAT_ID", 1.0) <= 1e-6 and all(v <= 5e-6 for v in worst.values()), sorted(worst.items())


def test_captured_moe_verify_logits_match_llama_cpp_s(moe_capture):
    """The whole captured graph run by gdnpass from llama.cpp's memory (GGML_CPU_BACKEND): its logits against
    llama.cpp's, max |Δ| / max |ref| <= 1e-4 (the f32 file's bound of tests/frontends/llama/test_referee.py)."""
    path, cap = moe_capture
    ex = _replay(cap, path, GGML_CPU_BACKEND)
    ex.run()
    want = torch.from_numpy(np.frombuffer(cap.logits, dtype=np.float32).copy()).reshape(4, cap.n_vocab)
    got = ex.read(cap.verify.find("result_output")).reshape(want.shape)
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= 1e-4, err  # measured 2026-12-04: see docs/moe.md
