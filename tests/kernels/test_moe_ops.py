"""The expert FFN's ops (issue 36): ARGSORT, SUM_ROWS, CLAMP, DIV, MUL_MAT_ID.

1. Their rules and constructors: shapes, types, views, ggml's asserts as one-line refusals.
2. Their torch references against semantics written out independently here (numpy, loops): ggml-cpu's std::sort
   order, the double sum, MAX(MIN(x, max), min) with NaN going to max, one correctly rounded f32 division, each
   token's selected experts.
3. CLAMP's max of +inf through the graph file (written as "Infinity") and the decoder; NaN refused.
4. Their Triton kernels against the references, bit for bit (ARGSORT, SUM_ROWS, CLAMP, DIV), and MUL_MAT_ID on
   the mat-vec kernel, plain and quantized experts: each (slot, token) product the bytes of the single mat-vec of
   its expert's matrix; the router's nodes run on the Triton backend as on torch's.
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


# ---- 4. Triton: every op on its kernel, against its reference ---------------------------------------------------------


def _kernels_for(op, x_ne=(8, 4)):
    """A node of ``op`` as the router makes it, and the Triton adapter the backend gives it."""
    probs = _inp("probs", F32, x_ne)
    topk = ops.argsort_top_k(probs, 2)
    total = ops.sum_rows(probs)
    node = {Op.ARGSORT: lambda: topk.view_src, Op.SUM_ROWS: lambda: total,
            Op.CLAMP: lambda: ops.clamp(total, 0.0, float("inf")), Op.DIV: lambda: ops.div(probs, total),
            Op.MUL_MAT_ID: lambda: ops.mul_mat_id(_inp("w", F32, (16, 32, x_ne[0])), _inp("x", F32, (16, 1, x_ne[1])),
                                                  topk)}[op]()
    return node, kernel(TRITON_BACKEND, node)


@pytest.mark.parametrize("op", NEW_OPS, ids=lambda o: o.value)
def test_triton_runs_each_on_its_kernel(op):
    """The Triton backend has a kernel of its own for each (none is the torch reference's adapter), and the cost
    model names its programs (gdnpass.cli.INTERPRETER_S prices each)."""
    from gdnpass import cli
    from gdnpass.kernels.backends import programs

    node, fn = _kernels_for(op)
    assert fn is not None and fn is not kernel(TORCH_BACKEND, node)
    names = [k for k, _, _ in programs(node)]
    assert names and all(k in cli.INTERPRETER_S for k in names), names


def test_a_quantized_mul_mat_id_launches_its_pre_pass_then_the_mat_vec():
    """Launch counts and the cost model: a Q4_K expert stack's MUL_MAT_ID is two launches (its activations'
    pre-pass, every column of the n_b·n_t in chunks of 16, then the mat-vec: a program a row block and slot), a bf16
    one one."""
    from gdnpass.kernels.backends import programs
    from gdnpass.launches import node_launches

    ids = ops.argsort_top_k(_inp("probs", F32, (8, 9)), 2)
    gate = ops.mul_mat_id(_inp("wq", DType.Q4_K, (512, 64, 8)), _inp("x", F32, (512, 1, 9)), ids)
    down = ops.mul_mat_id(_inp("wd", DType.Q4_K, (512, 64, 8)), _inp("xd", F32, (512, 2, 9)), ids)
    plain = ops.mul_mat_id(_inp("wb", DType.BF16, (512, 64, 8)), _inp("x2", F32, (512, 1, 9)), ids)
    assert (node_launches(gate), node_launches(down), node_launches(plain)) == (2, 2, 1)
    for node, chunks in ((gate, 1), (down, 2)):  # 9 columns; 18
        (pre, n_pre, _), (mat, n_mat, _) = programs(node)
        assert (pre, n_pre, mat) == ("quantize_x", chunks * 16 * 2, "mat_vec") and n_mat % (2 * 9) == 0
    assert [k for k, _, _ in programs(plain)] == ["mat_vec"]


def _sort_rows(ne0: int, rows: int, gen) -> torch.Tensor:
    """Router-like rows with what a sort must order exactly: ties (runs of one value), ±0, ±inf and NaNs of both
    signs, and a subnormal."""
    x = torch.randn(rows, ne0, generator=gen)
    if ne0 >= 8:
        x[0, : ne0 // 2] = 0.25                                  # a run of ties
        x[1, :8] = torch.tensor([float("nan"), 1.0, -0.0, 0.0, float("-inf"), -float("nan"), 1.0, float("inf")])
        x[2, 1::2] = x[2, 0::2][: len(x[2, 1::2])]               # every value twice
        x[3, 0] = 1e-45
    return x


@pytest.mark.parametrize("ne0", [1, 5, 8, 37, 64])
@pytest.mark.parametrize("order", [0, 1], ids=["asc", "desc"])
def test_argsort_kernel_is_the_reference_s_bits(ne0, order, device):
    """ARGSORT's kernel (a bitonic network on (value, index) keys) against reference.argsort bit for bit: ascending
    and descending, equal values in index order, NaNs after +inf (first, descending), -0.0 equal to 0.0; rows of
    any length up to a power of two and past one, with gaps between them, two batches; nothing else written."""
    from gdnpass.kernels import triton_sort as ts
    from support.arena import Arena
    from support.compare import assert_bits

    gen = torch.Generator().manual_seed(ne0)
    a = Arena()
    x = a.put(_sort_rows(ne0, 10, gen).view(1, 2, 5, ne0).to(device), row_stride=ne0 + 3)
    out = a.view((1, 2, 5, ne0), torch.int32)
    a.run(lambda: ts.argsort(x, order, out), out)
    assert_bits(out, ref.argsort(x, order), f"ARGSORT order {order}, rows of {ne0}")


def test_argsort_past_the_kernel_s_rows_runs_the_reference():
    """A row longer than the kernel sorts in registers (limits.ARGSORT_MAX_ROW) runs the torch reference through
    the backend (as SOFT_MAX's refusals do); the launcher refuses it in one line."""
    from gdnpass.kernels import triton_sort as ts
    from gdnpass.kernels.limits import ARGSORT_MAX_ROW

    n = ARGSORT_MAX_ROW + 1
    node, fn = _kernels_for(Op.ARGSORT, (n, 2))
    x = torch.randn(1, 1, 2, n)
    out = torch.empty(1, 1, 2, n, dtype=torch.int32)
    fn(node, [x], out)
    assert torch.equal(out, ref.argsort(x, 1))
    with pytest.raises(KernelError, match=f"^ARGSORT: rows of {n} elements") as e:
        ts.argsort(x, 1, out)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("ne0", [1, 4, 8, 37])
def test_sum_rows_kernel_is_the_reference_s_bits(ne0, device):
    """SUM_ROWS' kernel against reference.sum_rows bit for bit: a double sum in ggml's order (a row whose sum
    depends on it), rows with gaps, a strided output, three batches."""
    from gdnpass.kernels import triton_norms as tn
    from support.arena import Arena
    from support.compare import assert_same_bytes

    gen = torch.Generator().manual_seed(ne0)
    x = torch.randn(1, 3, 5, ne0, generator=gen) * torch.logspace(-20, 20, 5).view(1, 1, 5, 1)
    if ne0 == 4:
        x[0, 0, 0] = torch.tensor([2.0 ** 60, 1.0, -2.0 ** 60, 1.0])  # 1 in ggml's order, 0 pairwise
    a = Arena()
    xv = a.put(x.to(device), row_stride=ne0 + 5)
    out = a.view((1, 3, 5, 1), row_stride=3)
    a.run(lambda: tn.sum_rows(xv, out), out)
    want = ref.sum_rows(xv)
    assert_same_bytes(out, want, f"SUM_ROWS of rows of {ne0}")
    if ne0 == 4:
        assert out[0, 0, 0, 0].item() == 1.0


CLAMP_X = [-1.0, 0.0, -0.0, 1e-9, 6.1e-5, 0.5, 2.0 ** 100, float("inf"), float("-inf"), float("nan"), -float("nan"),
           1e-45, -3.0]


@pytest.mark.parametrize("lo, hi", [(6.103515625e-5, float("inf")), (-2.0, 2.0), (float("-inf"), 1.0),
                                    (float("-inf"), float("inf")), (1.0, -1.0)])
def test_clamp_kernel_is_the_reference_s_bits(lo, hi, device):
    """CLAMP's kernel against reference.clamp bit for bit: MAX(MIN(x, max), min), NaNs (either sign) to max, ±inf
    bounds, min above max; into a new tensor and in place (ggml_clamp_inplace, the plan's CLAMP over its SUM_ROWS)."""
    from gdnpass.kernels import triton_elementwise as te
    from support.arena import Arena
    from support.compare import assert_bits

    x = torch.tensor(CLAMP_X * 3).view(1, 3, 1, len(CLAMP_X)).to(device)
    a = Arena()
    xv, out = a.put(x, row_stride=len(CLAMP_X) + 2), a.view(tuple(x.shape))
    a.run(lambda: te.clamp(xv, lo, hi, out), out)
    want = ref.clamp(x, lo, hi)
    assert_bits(out, want, f"CLAMP [{lo}, {hi}]")
    a.run(lambda: te.clamp(xv, lo, hi, xv), xv)
    assert_bits(xv, want, f"CLAMP [{lo}, {hi}] in place")


def test_div_kernel_is_the_reference_s_bits(device):
    """DIV's kernel against reference.div bit for bit (one IEEE division): b tiled over a (the router's weights by
    their sum: a row of one; a row of a's width; a's shape) and in place (over a; over b of a's shape); quotients
    that overflow, underflow to subnormals, divide by ±0, NaN."""
    from gdnpass.kernels import triton_elementwise as te
    from support.arena import Arena
    from support.compare import assert_bits

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 2, 4, 8, generator=gen) * 1e3
    x[0, 0, 0, :5] = torch.tensor([1e-40, 3e38, float("nan"), 0.0, -1.0])
    for b_shape in ((1, 1, 4, 1), (1, 1, 1, 8), (1, 2, 4, 8)):
        y = torch.rand(b_shape, generator=gen) + 0.5
        y.view(-1)[0] = 1e-30 if b_shape[3] == 1 else 0.0
        y.view(-1)[-1] = -0.0
        a = Arena()
        av, bv, out = a.put(x.to(device)), a.put(y.to(device), row_stride=b_shape[3] + 1), a.view(tuple(x.shape))
        want = ref.div(av, bv)
        a.run(lambda: te.div(av, bv, out), out)
        assert_bits(out, want, f"DIV by {b_shape}")
        a.run(lambda: te.div(av, bv, av), av)
        assert_bits(av, want, f"DIV by {b_shape}, in place over a")
    bv = a.put(y.to(device))
    av = a.put(x.to(device))
    want = ref.div(av, bv)
    a.run(lambda: te.div(av, bv, bv), bv)
    assert_bits(bv, want, "DIV in place over b")


@pytest.mark.parametrize("wt", ["f32", "bf16"])
@pytest.mark.parametrize("n_b", [1, 3], ids=["b-shared", "b-per-slot"])
def test_mul_mat_id_on_the_mat_vec_kernel_is_each_expert_s_single_mat_vec(wt, n_b, device):
    """The Triton MUL_MAT_ID (the mat-vec kernel, the experts' matrices found from the ids on the device): each
    slot's product is the bytes of the single mat-vec of its expert's matrix and column (same kernel, same tile),
    repeated and unused experts included, b shared by the slots (the gate / up form) or one row a slot (down), and
    within f32 summation accuracy of the reference; the expert no token chose (3: NaN) is never read; an id outside
    the experts is one line."""
    from gdnpass.kernels import triton_matvec as mv
    from support.arena import Arena, assert_close, rnd
    from support.compare import assert_bits

    K, M, n_as, n_used, n_t = 64, 40, 5, 3, 2
    a = Arena(1 << 22)
    w = a.put((rnd(1, n_as, M, K) / 8).to({"f32": torch.float32, "bf16": torch.bfloat16}[wt]))
    w[0, 3] = float("nan")
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


QUANTIZED = [t for t in DType if t.is_quantized]


@pytest.mark.parametrize("dtype, n_b", [(t, 3) for t in QUANTIZED] + [(DType.Q4_K, 1)],
                         ids=lambda v: v.label if isinstance(v, DType) else {1: "b-shared", 3: "b-per-slot"}[v])
def test_mul_mat_id_of_quantized_experts_is_each_expert_s_single_mat_vec(dtype, n_b, device):
    """MUL_MAT_ID of quantized experts (Q8_0, Q4_K, Q5_K, Q6_K: their blocks as gdnpass holds them) on the quantized
    mat-vec: the activation columns quantized once (n_b·n_t of them: 18 for down's b of a row a slot, two workspace
    chunks of 16; 6 for gate / up's shared b), each slot's product the bytes of the single quantized mat-vec of its
    expert's matrix and that column (one launch per expert on the columns that chose it: a quantized tile's K steps
    and slices, which alone decide the bytes, do not depend on the columns); the experts no token chose are never read (their bytes all 0xFF: NaN scales, which any
    read would spread); within f32 summation accuracy of the reference (quants.mul_mat_q, the kernels' activation
    scheme)."""
    from gdnpass.kernels import triton_matvec as mv
    from gdnpass.kernels.quants import held_rows, random_blocks
    from support.arena import Arena, assert_close, rnd
    from support.compare import assert_bits

    K, M, n_as, n_used, n_t = 256, 20, 6, 3, 6
    gen = torch.Generator().manual_seed(3)
    experts = torch.stack([random_blocks(M, K, dtype, gen, 0.05) for _ in range(n_as)]).view(1, n_as, M, -1)
    chosen = torch.tensor([[4, 0, 4], [2, 2, 1], [0, 1, 2], [4, 4, 4], [1, 0, 2], [2, 4, 0]], dtype=torch.int32)
    unused = sorted(set(range(n_as)) - set(chosen.view(-1).tolist()))
    assert unused == [3, 5]
    experts[0, unused] = 0xFF
    a = Arena(1 << 22)
    w = a.put(held_rows(experts, dtype).to(device))
    x = a.put(rnd(1, n_t, n_b, K), row_stride=K + 32)
    ids = a.put(chosen.view(1, 1, n_t, n_used).to(device))
    out = a.view((1, n_t, n_used, M))
    a.run(lambda: mv.mul_mat_id(w, x, ids, out, dtype), out)
    assert not out.isnan().any()
    for expert in sorted(set(chosen.view(-1).tolist())):
        slots = [(t, e) for t in range(n_t) for e in range(n_used) if chosen[t, e] == expert]
        tile_n, tile_1 = mv.mat_vec_tile(M, len(slots), K, dtype.label), mv.mul_mat_id_tile(M, K, dtype.label, 1)
        assert (tile_n.block_k, tile_n.split_k) == (tile_1.block_k, tile_1.split_k)
        cols = a.put(torch.stack([x[0, t, e % n_b] for t, e in slots]).view(1, 1, len(slots), K))
        single = a.view((1, 1, len(slots), M))
        a.run(lambda: mv.mul_mat_vec(w[:, expert:expert + 1], cols, single, dtype), single)
        for j, (t, e) in enumerate(slots):
            assert_bits(out[0, t, e], single[0, 0, j], f"slot {e} of token {t} (expert {expert})")
    assert_close(out, ref.mul_mat_id(w, x, ids, dtype), rtol=1e-5)


def _expert_blocks(n: int, M: int, K: int, dtype: DType, gen) -> torch.Tensor:
    """``n`` experts' matrices of ``dtype`` blocks (1, n, M, row bytes) as gdnpass holds them, each its own random
    quants, with the f16 scales of one quants.random_blocks matrix (which sizes them; finding them for each expert
    takes seconds)."""
    from gdnpass.kernels.quants import F16_FIELDS, held_rows, random_blocks

    base = random_blocks(M, K, dtype, gen, 0.02).view(M, -1, dtype.size)
    experts = torch.randint(0, 256, (n, *base.shape), dtype=torch.uint8, generator=gen)
    for off in F16_FIELDS[dtype]:
        experts[..., off:off + 2] = base[..., off:off + 2]
    return held_rows(experts.view(1, n, M, -1), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("n_expert, n_used", [(256, 8), (512, 10)], ids=["35b-a3b", "512-experts"])
def test_gpu_moe_kernels_at_the_models_shapes(n_expert, n_used):
    """Compiled, at the routers' and experts' shapes of Qwen3.5-35B-A3B (256 experts, 8 used; experts 512 x 2048,
    down 2048 x 512) and of a 512-expert router, for 1, 4 and 16 tokens: ARGSORT (DESC and ASC), SUM_ROWS, CLAMP and
    DIV the bytes of their references (on the GPU); MUL_MAT_ID of bf16, Q8_0 and K-quant experts, gate / up (b shared)
    and down (a row a slot), each product the bytes of the single mat-vec of its expert (bf16: a launch per slot;
    quantized: one per expert on the columns that chose it) and within 1e-5 of the reference."""
    from gdnpass.kernels import triton_elementwise as te
    from gdnpass.kernels import triton_matvec as mv
    from gdnpass.kernels import triton_norms as tn
    from gdnpass.kernels import triton_sort as ts
    from support.arena import assert_close
    from support.compare import assert_bits

    dev = "cuda"
    gen = torch.Generator().manual_seed(n_expert)
    E, F = 2048, 512
    routed = {}
    for n_t in (1, 4, 16):
        logits = torch.randn(1, 1, n_t, n_expert, generator=gen)
        logits[0, 0, 0, ::7] = 0.5                                   # ties
        probs = torch.softmax(logits, -1).to(dev)
        for order in (1, 0):
            out = torch.empty(probs.shape, dtype=torch.int32, device=dev)
            ts.argsort(probs, order, out)
            assert_bits(out, ref.argsort(probs, order), f"ARGSORT {order} of {n_t} x {n_expert}")
        ids = out.flip(-1)[..., :n_used].contiguous()                # (ASC flipped: the top n_used, most first)
        w = torch.gather(probs, -1, ids.long())
        total = torch.empty(1, 1, n_t, 1, device=dev)
        tn.sum_rows(w, total)
        assert_bits(total, ref.sum_rows(w), "SUM_ROWS")
        clamped = torch.empty_like(total)
        te.clamp(total, 6.103515625e-5, float("inf"), clamped)
        assert_bits(clamped, ref.clamp(total, 6.103515625e-5, float("inf")), "CLAMP")
        norm = torch.empty_like(w)
        te.div(w, clamped, norm)
        assert_bits(norm, ref.div(w, clamped), "DIV")
        routed[n_t] = ids
    if n_used != 8:
        return
    for wt in ("bf16", "q8_0", "q4_k", "q5_k", "q6_k"):
        dtype = DType.parse(wt)
        for M, K, n_b in ((F, E, 1), (E, F, n_used)):                # gate / up, then down
            if wt == "bf16":
                experts = (torch.randn(1, n_expert, M, K, generator=gen) / 16).to(torch.bfloat16).to(dev)
            else:
                experts = _expert_blocks(n_expert, M, K, dtype, gen).to(dev)
            for n_t, ids in routed.items():
                x = torch.randn(1, n_t, n_b, K, generator=gen).to(dev)
                y = torch.empty(1, n_t, n_used, M, device=dev)
                mv.mul_mat_id(experts, x, ids, y, dtype)
                chosen = ids[0, 0].tolist()
                for expert in sorted({e for row in chosen for e in row}):
                    slots = [(t, e) for t in range(n_t) for e in range(n_used) if chosen[t][e] == expert]
                    groups = [[s] for s in slots] if wt == "bf16" else [slots]  # (plain tiles depend on the columns)
                    for group in groups:
                        cols = torch.stack([x[0, t, e % n_b] for t, e in group]).view(1, 1, len(group), K)
                        single = torch.empty(1, 1, len(group), M, device=dev)
                        mv.mul_mat_vec(experts[:, expert:expert + 1], cols, single, dtype)
                        for j, (t, e) in enumerate(group):
                            assert_bits(y[0, t, e], single[0, 0, j], f"{wt} {M}x{K}: slot {e} of token {t}")
                assert_close(y, ref.mul_mat_id(experts, x, ids, dtype), rtol=1e-5)


def test_the_router_runs_on_triton_as_on_torch(kernel_exp):
    """The expert FFN's weights as build_moe_ffn makes them (SOFT_MAX, the DESC ARGSORT's top-k view, GET_ROWS,
    SUM_ROWS, CLAMP, DIV), planned (the CLAMP over its SUM_ROWS, as gallocr puts llama.cpp's) and run by an executor
    on each backend: the same bytes, every node (in the interpreter, the reference's exp is the kernels': see
    conftest's kernel_exp)."""
    from gdnpass.alloc import plan

    probs = ops.soft_max(_inp("logits", F32, (8, 5)))
    top = ops.argsort_top_k(probs, 3)
    w = ops.reshape(ops.get_rows(ops.reshape(probs, 1, 8, 5), top), 3, 5)
    total = ops.sum_rows(w)
    clamped = ops.clamp(total, 6.103515625e-5, float("inf"))
    norm = ops.div(w, clamped)
    g = _graph([top, norm])
    plan(g, 32)
    assert (clamped.buffer, clamped.offset) == (total.buffer, total.offset)
    runs = []
    for backend in (TORCH_BACKEND, TRITON_BACKEND):
        ex = Executor(g, backend=backend)
        ex.buffers["input"].copy_(torch.randn(ex.buffers["input"].numel() // 4, generator=torch.Generator()
                                              .manual_seed(5)).view(torch.uint8))
        runs.append(ex.run_probed([top.view_src, w, total, clamped, norm]))
    for t, a, b in zip(("argsort", "weights", "sum", "clamp", "norm"), *runs):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), t


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

    from gdnpass.kernels.quants import held_rows

    g = cap.verify
    ex = Executor(g, backend=backend)
    for name, data in cap.memory.items():
        ex.buffers[name][: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    reader = GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    for t in g.leafs:
        if t.buffer == "weights":
            raw = np.ascontiguousarray(by_name[t.name].data).reshape(-1).view(np.uint8)
            value = held_rows(torch.from_numpy(raw.copy()).view(-1, t.type.row_bytes(t.ne[0])), t.type)  # (as loaded)
            ex.buffers["weights"][t.offset: t.offset + raw.size].copy_(value.reshape(-1))
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
