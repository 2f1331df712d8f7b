"""The Triton kernels of the elementwise and data-movement ops (issue 16: one launch per node, as ggml-cuda) against
their torch reference (gdnpass.kernels.reference, the semantic spec), byte for byte.

GET_ROWS, CONCAT, CPY/CONT, ADD and MUL only move bits, convert types or do one IEEE f32 operation per element: their
bytes are the reference's wherever they run. UNARY (SILU, SIGMOID, SOFTPLUS, EXP) and GLU (SWIGLU) call exp and log:
the kernels use the reference's expression operation for operation (IEEE division, no FMA contraction), and exp and
log are the ones torch uses on CUDA (libdevice's __nv_expf / __nv_logf = CUDA's expf / logf), so compiled they are
byte-identical to the reference (the gpu tests below). Triton's interpreter has no libdevice: there exp and log are
numpy's, which differ from torch's CPU exp and log (Sleef) in the last bit of ~40% / ~10% of the inputs, so on the CPU
these tests give the reference numpy's exp and log and then ask for identical bytes: everything but the two library
functions is proven to be the reference's.

Inputs and outputs are strided views of one NaN-poisoned arena (support.arena), and ``Arena.run`` fails on a byte
written outside the outputs. Tensors stay tiny: the interpreter pays per program.
"""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from gdnpass.errors import KernelError
from gdnpass.ir import Op
from gdnpass.kernels import reference as ref
from gdnpass.kernels import triton_core as core
from gdnpass.kernels import triton_elementwise as elt
from gdnpass.kernels import triton_matvec as mv
from gdnpass.kernels import triton_norms as norms
from gdnpass.kernels import triton_rope as rope
from gdnpass.kernels import triton_ssm as ssm
from gdnpass.kernels.backends import TORCH_BACKEND, TRITON_BACKEND
from gdnpass.patterns import RECORDS
from gdnpass.models.fill import fill
from support.arena import DEVICE, Arena, node, rnd
from support.compare import assert_bits
from support.rope_cases import QWEN35_ROPE, ROPE_CASES

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    # the interpreter's numpy on the edge values: inf and NaN results are what is being tested
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

F32, F16, BF16, I32 = torch.float32, torch.float16, torch.bfloat16, torch.int32
NAN = float("nan")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class _Counted:
    """A kernel whose launches are logged: ``kernel[grid](...)`` appends the kernel's name."""

    def __init__(self, kernel, name: str, log: list):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.log.append(self.name)
            return launch(*args, **kwargs)

        return run


@pytest.fixture
def launches(monkeypatch) -> list:
    """The names of the Triton kernels launched during the test, in order."""
    log: list = []
    for module in (elt, norms, mv, ssm, rope):
        for name, k in vars(module).items():
            if name.startswith("_") and name.endswith("_kernel"):
                monkeypatch.setattr(module, name, _Counted(k, name, log))
    return log


def edge_values(n: int) -> torch.Tensor:
    """n f32 values (n >= 40): signed zeros, infinities, quiet NaNs with payloads, f32 and f16 subnormals, the f16
    range edge, exact round-to-nearest-even ties of f16 and bf16, then normals of mixed magnitudes."""
    bits = torch.tensor([0x7FC00000, 0xFFC00000, 0x7FC01234, 0x7FFFFFFF, 0x00000001, 0x807FFFFF, 0x00400000],
                        dtype=torch.int64).to(torch.int32).view(F32)
    fixed = torch.tensor([0.0, -0.0, 1.0, -1.5, float("inf"), float("-inf"), 3.4e38, -3.4e38, 65504.0, 65520.0,
                          -65519.0, 6e-8, 2.98e-8, -3e-5, 1e-40, 1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11),
                          1 + 2**-8, 1 + 3 * 2**-8, 2**-133, 20.0, 20.000002, 19.999998, -20.0, 88.8, -88.8, 90.0,
                          -104.0, 1e-7, -1e-7, 0.5], dtype=F32)
    head = torch.cat([bits, fixed])
    tail = rnd(n - head.numel()).cpu() * torch.logspace(-6, 6, n - head.numel())
    return torch.cat([head, tail]).to(DEVICE)


def view(a: Arena, shape, dtype=F32, row_stride=None) -> torch.Tensor:
    """``a.view``, for i32 and i64 too: poisoned with all-ones (-1) through an f32 view (the arena poisons with
    NaN)."""
    if dtype in (I32, torch.int64):
        *outer, d0 = shape
        r = 2 * (row_stride or d0) if dtype == torch.int64 else row_stride
        return a.view((*outer, d0 * (2 if dtype == torch.int64 else 1)), F32, r).view(dtype)
    return a.view(shape, dtype, row_stride)


def put(a: Arena, x: torch.Tensor, row_stride=None) -> torch.Tensor:
    return view(a, tuple(x.shape), x.dtype, row_stride).copy_(x)


def ids_of(a: Arena, values, shape) -> torch.Tensor:
    return put(a, torch.tensor(values, dtype=I32, device=DEVICE).reshape(shape))


def put_values(a: Arena, shape, dtype=F32, row_stride=None, scale: float = 1.0, nan: bool = True) -> torch.Tensor:
    """A view holding edge values (f32 -> ``dtype`` as torch converts; ints: random in +-1000); without NaNs when
    ``nan`` is False (the second operand of a binary op: where a NaN meets a NaN, which payload survives is torch's
    loop's choice on the CPU, vectorised or not, so the reference does not define it; CUDA gives the canonical NaN)."""
    n = int(np.prod(shape))
    if dtype == I32:
        return put(a, torch.randint(-1000, 1001, shape, dtype=I32, device=DEVICE), row_stride)
    x = edge_values(max(n, 40) + 8)
    x = x[~x.isnan()] if not nan else x[:max(n, 40)]
    x = x[torch.randperm(x.numel(), device=DEVICE)[:n]].reshape(shape) * scale
    return a.put(x.to(dtype), row_stride)


# ---- GET_ROWS -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F16, BF16, I32], ids=["f32", "f16", "bf16", "i32"])
def test_get_rows(dtype):
    """Rows of every source type, gathered from a permuted source (ne1 and ne2 swapped: rows 40 elements of a
    (2, 5, 3, 40) block) by strided ids (every other element) into an output with row gaps."""
    a = Arena()
    src = put_values(a, (2, 5, 3, 40), dtype).transpose(1, 2)  # ne [40, 5 rows, 3, 2], rows not adjacent
    ids = ids_of(a, [0, 4, 4, 1, 2, 3] * 12, (1, 2, 3, 12))[..., ::3]
    out = view(a, (2, 3, 4, 40), I32 if dtype == I32 else F32, row_stride=44)
    a.run(lambda: elt.get_rows(src, ids, out), out)
    assert_bits(out, ref.get_rows(src, ids), f"GET_ROWS {dtype}")


def test_get_rows_nan_rows_of_every_f16_pattern():
    """All 65536 f16 bit patterns as rows: every value exact, every NaN 0x7FFFFFFF (torch's .float() on the CPU; on
    CUDA the same conversion instruction as torch's)."""
    a = Arena()
    src = a.put(torch.arange(-2**15, 2**15, dtype=torch.int32, device=DEVICE).to(torch.int16).view(F16)
                .reshape(1, 1, 64, 1024))
    ids = ids_of(a, list(range(63, -1, -1)), (1, 1, 1, 64))
    out = a.view((1, 1, 64, 1024))
    a.run(lambda: elt.get_rows(src, ids, out), out)
    assert_bits(out, ref.get_rows(src, ids), "GET_ROWS f16 patterns")


@pytest.mark.parametrize("bad", [-1, 5])
def test_get_rows_refuses_an_id_outside_the_rows_before_launch(bad, launches):
    a = Arena()
    src = a.put(rnd(1, 1, 5, 8))
    ids = ids_of(a, [0, bad, 2], (1, 1, 1, 3))
    out = a.view((1, 1, 3, 8))
    with pytest.raises(KernelError, match=f"row id {bad} is outside the source's 5 rows"):
        a.run(lambda: elt.get_rows(src, ids, out))  # nothing written
    assert launches == []


# ---- CONCAT ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
def test_concat(dim, dtype):
    """a a transposed view (ne0 and ne1 swapped), b with row gaps, the output with row gaps; b's extent along dim
    differs from a's."""
    a = Arena()
    t = 3 - dim
    shape_a, shape_b = [2, 3, 4, 5], [2, 3, 4, 5]
    shape_b[t] = 2
    base = put_values(a, (*shape_a[:2], shape_a[3], shape_a[2]), dtype)
    x = base.transpose(2, 3)  # shape_a, strided
    y = put_values(a, tuple(shape_b), dtype, row_stride=shape_b[3] + 3)
    want = ref.concat(x, y, dim)
    out = a.view(tuple(want.shape), dtype, row_stride=want.shape[3] + 1)
    a.run(lambda: elt.concat(x, y, dim, out), out)
    assert_bits(out, want, f"CONCAT dim {dim}")


def test_concat_as_the_graph_uses_it():
    """build_conv_state's CONCAT: the gathered state [dc-1, C] and the transposed projection [n_t, C] along dim 0,
    through the backend table."""
    a = Arena()
    states = a.put(rnd(1, 1, 64, 3))
    proj = a.put(rnd(1, 1, 4, 64)).transpose(-1, -2)  # qkv_mixed transposed: ne [4, 64], element stride 64
    out = a.view((1, 1, 64, 7))
    a.run(lambda: TRITON_BACKEND[Op.CONCAT](node(Op.CONCAT, dim=0), [states, proj], out), out)
    assert_bits(out, ref.concat(states, proj, 0), "CONCAT")


# ---- CPY / CONT -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("src_t,dst_t", [(F32, F32), (F32, F16), (F32, BF16), (F32, I32), (F16, F16), (BF16, BF16),
                                         (I32, I32)], ids=lambda t: str(t).split(".")[-1])
def test_cpy(src_t, dst_t):
    """A transposed source into a destination of another shape (same element count) taking every other row:
    elements map by row-major index, as ggml_cpy. f32 -> f16 / bf16 round to nearest even (ties included), overflow
    to inf, subnormals; NaN keeps torch's pattern (bf16: 0xFFFF on the CPU, 0x7FFF on CUDA). f32 -> i32 rounds
    toward zero (values within the i32 range)."""
    a = Arena()
    if dst_t == I32 and src_t == F32:
        base = a.put(rnd(1, 2, 8, 6) * 1000.0)  # truncation of negative and positive fractions
    else:
        base = put_values(a, (1, 2, 8, 6), src_t)
    src = base.transpose(-1, -2)  # (1, 2, 6, 8), strided
    dst = view(a, (2, 3, 8, 4), dst_t)[:, :, ::2, :]  # (2, 3, 4, 4): 96 elements, every other row
    want = ref.cpy(src, dst)
    a.run(lambda: elt.cpy(src, dst), dst)
    assert_bits(dst, want, f"CPY {src_t} -> {dst_t}")


def test_cont_and_cpy_through_the_backend_table():
    """CONT of a permuted view (views [src], out the new tensor) and CPY (views [src, dst], out dst's view)."""
    a = Arena()
    src = a.put(rnd(2, 3, 4, 5)).permute(0, 2, 1, 3)  # (2, 4, 3, 5)
    out = a.view((1, 1, 8, 15))  # CONT may reshape: the element count is kept
    a.run(lambda: TRITON_BACKEND[Op.CONT](node(Op.CONT), [src], out), out)
    assert_bits(out, ref.cpy(src, out), "CONT")
    dst = a.view((1, 1, 8, 15), F16)
    a.run(lambda: TRITON_BACKEND[Op.CPY](node(Op.CPY), [src, dst], dst), dst)
    assert_bits(dst, ref.cpy(src, dst), "CPY f16")


def test_cpy_snapshot_window_into_a_cache_row():
    """The verify graph's snapshot CPY: a window of the CONCAT (ne [dc-1, C], row stride dc-1+n_t) into a
    contiguous cache row (ne [(dc-1)*C])."""
    a = Arena()
    conv_input = a.put(rnd(1, 1, 32, 3 + 4))
    window = conv_input[..., 2:2 + 3]
    row = a.view((1, 1, 1, 3 * 32))
    a.run(lambda: elt.cpy(window, row), row)
    assert_bits(row, ref.cpy(window, row), "snapshot CPY")


# ---- ADD, MUL -------------------------------------------------------------------------------------------------------


BROADCASTS = [  # (a, b) torch shapes: b repeats into a (ggml tiles: element i of a meets i % ne of b)
    ((2, 3, 4, 6), (2, 3, 4, 6)),
    ((2, 3, 4, 6), (1, 1, 1, 1)),
    ((2, 3, 4, 6), (1, 3, 2, 3)),  # tiling, not stretching: ne1 2 -> 4 and ne0 3 -> 6
    ((2, 3, 4, 6), (2, 1, 4, 1)),
]


@pytest.mark.parametrize("op", ["ADD", "MUL"])
@pytest.mark.parametrize("shapes", BROADCASTS, ids=["same", "scalar", "tiled", "rows"])
def test_binary_broadcast_strided(op, shapes):
    """a with row gaps, b transposed (non-contiguous), out with row gaps; edge values (inf - inf, 0 * inf, NaNs
    with payloads, -0.0)."""
    sa, sb = shapes
    a = Arena()
    x = put_values(a, sa, row_stride=sa[3] + 2)
    y = put_values(a, (*sb[:2], sb[3], sb[2]), nan=False).transpose(2, 3)
    out = a.view(sa, row_stride=sa[3] + 1)
    a.run(lambda: TRITON_BACKEND[Op[op]](node(Op[op]), [x, y], out), out)
    assert_bits(out, (ref.add if op == "ADD" else ref.mul)(x, y), f"{op} {sb} into {sa}")


@pytest.mark.parametrize("onto", ["a", "b"])
def test_binary_in_place(onto):
    """gallocr's in-place reuse: the output is src0's memory (or src1's, same layout)."""
    a = Arena()
    x, y = put_values(a, (1, 2, 3, 50)), put_values(a, (1, 2, 3, 50), nan=False)
    want = ref.add(x, y)
    out = x if onto == "a" else y
    a.run(lambda: elt.add(x, y, out), out)
    assert_bits(out, want, f"ADD in place on {onto}")


def test_binary_refuses_partial_overlap(launches):
    """An output overlapping an input other than element for element (one program could read what another wrote):
    refused before launch. gallocr never plans one; the torch reference would compute it in full first."""
    a = Arena()
    x = a.put(rnd(1, 1, 4, 8))
    flat = x.reshape(-1)
    shifted = flat[1:].as_strided((1, 1, 3, 8), (24, 24, 8, 1))
    with pytest.raises(KernelError, match="overlaps an input"):
        elt.add(x[..., :3, :], x[..., :3, :], shifted)
    assert launches == []


# ---- UNARY, GLU: exp and log ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", elt.UNARY_KINDS)
def test_unary(kind, kernel_exp):
    """Each kind on edge values (softplus' x > 20 branch on both sides of 20, exp overflow and underflow, NaNs),
    strided in and out, and in place."""
    a = Arena()
    x = put_values(a, (2, 3, 4, 40), row_stride=48, scale=3.0)
    out = a.view((2, 3, 4, 40), row_stride=41)
    want = ref.UNARY[kind](x)
    a.run(lambda: TRITON_BACKEND[Op.UNARY](node(Op.UNARY, kind=kind), [x], out), out)
    assert_bits(out, want, kind)
    a.run(lambda: elt.unary(kind, x, x), x)  # in place (the graph's SOFTPLUS and SILU are)
    assert_bits(x, want, f"{kind} in place")


@pytest.mark.parametrize("form", ["split", "halves", "halves-swapped", "halves-odd"])
def test_glu_swiglu(form, kernel_exp):
    """SWIGLU: split (gate a, up b, both with row gaps) and the one-source halves form (swapped exchanges them; an
    odd row's last element belongs to neither half, as in ggml)."""
    a = Arena()
    gate = put_values(a, (1, 2, 3, 65 if form == "halves-odd" else 64), row_stride=70, scale=2.0)
    up = put_values(a, (1, 2, 3, 64), row_stride=66, nan=False) if form == "split" else None
    swapped = form == "halves-swapped"
    want = ref.glu("SWIGLU", gate, up, swapped)
    out = a.view(tuple(want.shape), row_stride=want.shape[3] + 5)
    views = [gate] + ([up] if up is not None else [])
    a.run(lambda: TRITON_BACKEND[Op.GLU](node(Op.GLU, kind="SWIGLU", swapped=swapped), views, out), out)
    assert_bits(out, want, f"SWIGLU {form}")


@pytest.mark.skipif(not core.INTERPRETED, reason="the interpreter's numpy exp; compiled, the gpu tests compare")
@pytest.mark.parametrize("kind,ulps", [("EXP", 2), ("SILU", 4), ("SIGMOID", 4)])
def test_unary_in_the_interpreter_is_off_torch_by_numpys_exp_only(kind, ulps):
    """What the byte-for-byte tests cannot give on the CPU, stated instead of tolerated: against torch's own CPU exp
    the interpreted kernels are off by what numpy's expf is off torch's (measured here: at most 2 ulps for exp, 3
    for SILU and 2 for SIGMOID, on ~17% to 40% of the inputs). SOFTPLUS has no ulp bound: where 1 + exp(x) rounds
    to within a few ulps of 1 (x around -16), one ulp of exp moves that rounding and log's result by up to 100%."""
    x = edge_values(2000)[40:].reshape(1, 1, 49, 40) * 3  # finite normals
    out = torch.empty_like(x)
    elt.unary(kind, x, out)
    d = (out.view(I32).long() - ref.UNARY[kind](x).view(I32).long()).abs()
    assert int(d.max()) <= ulps


# ---- no torch fallback, one launch per node -------------------------------------------------------------------------


ONE_LAUNCH = {  # op -> (node params, sources) on tiny shapes
    "GET_ROWS": ({}, lambda a: [a.put(rnd(1, 1, 4, 8).bfloat16()), ids_of(a, [3, 0], (1, 1, 1, 2))], (1, 1, 2, 8)),
    "CONCAT": ({"dim": 1}, lambda a: [a.put(rnd(1, 1, 2, 8)), a.put(rnd(1, 1, 3, 8))], (1, 1, 5, 8)),
    "CPY": ({}, lambda a: [a.put(rnd(1, 1, 4, 8)), a.view((1, 1, 8, 4), F16)], None),
    "CONT": ({}, lambda a: [a.put(rnd(1, 1, 4, 8)).transpose(-1, -2)], (1, 1, 8, 4)),
    "ADD": ({}, lambda a: [a.put(rnd(1, 2, 4, 8)), a.put(rnd(1, 1, 1, 8))], (1, 2, 4, 8)),
    "MUL": ({}, lambda a: [a.put(rnd(1, 2, 4, 8)), a.put(rnd(1, 2, 1, 1))], (1, 2, 4, 8)),
    "GLU": ({"kind": "SWIGLU", "swapped": True}, lambda a: [a.put(rnd(1, 1, 4, 16))], (1, 1, 4, 8)),
    "SCALE": ({"s": 0.5, "b": 0.0}, lambda a: [a.put(rnd(1, 1, 4, 8))], (1, 1, 4, 8)),
    "RMS_NORM": ({"eps": 1e-6}, lambda a: [a.put(rnd(1, 1, 4, 32))], (1, 1, 4, 32)),
    "L2_NORM": ({"eps": 1e-6}, lambda a: [a.put(rnd(1, 1, 4, 32))], (1, 1, 4, 32)),
    **{f"UNARY({k})": ({"kind": k}, lambda a: [a.put(rnd(1, 1, 4, 8))], (1, 1, 4, 8)) for k in elt.UNARY_KINDS},
    "SET_ROWS": ({}, lambda a: [a.put(rnd(1, 2, 3, 8)), ids_of(a, [4, 0, 2], (1, 1, 1, 3)),
                                a.put(rnd(1, 2, 6, 8).to(F16))], (1, 2, 6, 8)),
    "ROPE": (dict(QWEN35_ROPE, n_dims=8, mode=40, sections=(2, 1, 1, 0), n_offs=0),
             lambda a: [a.put(rnd(1, 2, 3, 16)), ids_of(a, [5, 9, 5, 9, 5, 9, 0, 0], (1, 1, 1, 8))], (1, 2, 3, 16)),
}


def test_triton_backend_has_no_torch_fallback(monkeypatch, launches):
    """The table entries of these ops are not TORCH_BACKEND's, none of them calls a reference function (all are
    poisoned here), and each node is exactly one Triton launch."""
    for label in ONE_LAUNCH:
        op = Op[label.split("(")[0]]
        assert TRITON_BACKEND[op] is not TORCH_BACKEND[op], label
    for op in (Op.SSM_CONV, Op.GATED_DELTA_NET, *RECORDS):
        assert TRITON_BACKEND[op] is not TORCH_BACKEND[op], op

    def poisoned(*args, **kwargs):
        raise AssertionError("the Triton backend called the torch reference")

    for name, fn in inspect.getmembers(ref, inspect.isfunction):
        if fn.__module__ == ref.__name__ and name not in ("f32", "gdn_scale", "rope_scalars", "rope_yarn_corr_dims"):
            # (op params, rounded on the host)
            monkeypatch.setattr(ref, name, poisoned)
    a = Arena()
    for label, (params, src_fn, shape) in ONE_LAUNCH.items():
        op = Op[label.split("(")[0]]
        src = src_fn(a)
        out = src[1] if op is Op.CPY else src[2] if op is Op.SET_ROWS else a.view(shape)
        before = len(launches)
        a.run(lambda: TRITON_BACKEND[op](node(op, **params), src, out), out)
        assert len(launches) == before + 1, f"{label}: {launches[before:]}"
        assert not out.isnan().any(), label


EMPTY = {  # a launcher call on zero-size tensors (views of a real buffer: an empty view still has an address)
    "get_rows": lambda a, v: (elt.get_rows, a.put(rnd(1, 1, 4, 8)), view(a, (1, 1, 1, 0), I32), v((1, 1, 0, 8))),
    "get_rows-ne0": lambda a, v: (elt.get_rows, v((1, 1, 4, 0)), ids_of(a, [9, 9], (1, 1, 1, 2)), v((1, 1, 2, 0))),
    "concat": lambda a, v: (elt.concat, v((1, 0, 2, 8)), v((1, 0, 3, 8)), 1, v((1, 0, 5, 8))),
    "cpy": lambda a, v: (elt.cpy, v((1, 1, 0, 8)), a.view((1, 1, 8, 0), F16)),
    "add": lambda a, v: (elt.add, v((1, 1, 0, 8)), v((1, 1, 0, 8)), v((1, 1, 0, 8))),
    "mul": lambda a, v: (elt.mul, v((1, 1, 0, 8)), a.put(rnd(1, 1, 1, 8)), v((1, 1, 0, 8))),
    "unary": lambda a, v: (elt.unary, "SOFTPLUS", v((1, 1, 0, 8)), v((1, 1, 0, 8))),
    "glu": lambda a, v: (elt.glu, "SWIGLU", v((1, 1, 0, 16)), None, False, v((1, 1, 0, 8))),
}


@pytest.mark.parametrize("call", EMPTY.values(), ids=EMPTY.keys())
def test_zero_size_is_a_no_op(call, launches):
    """Zero-size tensors: no launch, no byte written (the executor skips empty nodes too; these are the launchers'
    own guards, for direct callers), no refusal (an empty GET_ROWS reads no id)."""
    a = Arena()
    fn, *args = call(a, a.view)
    a.run(lambda: fn(*args))
    assert launches == []


def test_programs_of_the_new_kernels():
    """programs(node): one program per ELT_BLOCK output elements for each of these ops (the interpreter's cost
    model, gdnpass.cli.INTERPRETER_S, has an entry for each name)."""
    from gdnpass import cli, pipeline
    from gdnpass.kernels.backends import programs
    from gdnpass.models import VerifyConfig

    g = pipeline.run(VerifyConfig("tiny-qwen35", 4, 3, n_layers=1), pipeline.PassOptions(fusion=False)).graph
    seen = set()
    for n in g.nodes:
        for kernel, count, steps in programs(n):
            assert kernel.rstrip("0123456789") in cli.INTERPRETER_S
            if n.op in (Op.GET_ROWS, Op.CONCAT, Op.CPY, Op.ADD, Op.MUL, Op.GLU, Op.UNARY):
                assert (count, steps) == (-(-n.nelements // elt.ELT_BLOCK), 1)
                seen.add(kernel)
    assert seen == {"get_rows", "concat", "cpy", "add", "mul", "swiglu", "silu", "sigmoid", "softplus"}


@pytest.mark.parametrize("model, wtype, flash, fusion", [("tiny-qwen35", "bf16", True, False),
                                                         ("tiny-qwen35", "bf16", True, True),
                                                         ("tiny-qwen35", "bf16", False, True),
                                                         ("tiny-qwen35moe", "bf16", True, True),
                                                         ("tiny-qwen35moe", "q8_0", True, False)])
def test_the_interpreter_cost_model_knows_every_kernel_of_a_whole_forward(model, wtype, flash, fusion):
    """Every kernel backends.programs names for a whole tiny-qwen35 forward (attention included; the expert FFN's;
    a quantized model's) has a cost in gdnpass.cli.INTERPRETER_S, so `gdnpass run --whole --backend triton` on the
    CPU estimates instead of raising."""
    from gdnpass import cli, pipeline
    from gdnpass.kernels.backends import programs
    from gdnpass.models import VerifyConfig

    cfg = VerifyConfig(model, 4, 3, whole=True, flash_attn=flash, n_past=8, wtype=wtype)
    g = pipeline.run(cfg, pipeline.PassOptions(fusion=fusion)).graph
    names = {k.rstrip("0123456789") for n in g.nodes for k, _, _ in programs(n)}
    assert names - set(cli.interpreter_table()) == set()  # (a fused kernel's entries are its record's)
    assert ("flash_attn" if flash else "soft_max") in names
    assert 0 < cli.interpreter_seconds(g.nodes)


@pytest.mark.parametrize("case", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("H", [3, rope.ROPE_HEADS + 3], ids=["heads-3", "heads-past-a-program"])
def test_rope(case, dtype, H):
    """ROPE (every implemented mode, YaRN, freq_factors, a partial rotation, f32 and f16 rows with gaps between
    them, positions far into a context, a token's heads in one program or more) byte for byte against the
    reference: the same angles (repeated f32 multiplication), cos and sin of double rounded once, the rotation
    rounded as written."""
    name, mode, hd, n_dims, sections, prm = case
    mrope = bool(mode & ref.ROPE_MROPE)
    T = 5
    p = [0, 1, 5, 17, 63] if prm["ext_factor"] else [0, 1, 17, 4096, 100003]
    pos = p + [v // 3 + 1 for v in p] + [v % 7 + 2 for v in p] + [v % 5 for v in p] if mrope else p
    a = Arena()
    x = a.put(rnd(1, T, H, hd).to(dtype), row_stride=hd + 8)
    ids = ids_of(a, pos, (1, 1, 1, len(pos)))
    ff = a.put(torch.rand(1, 1, 1, n_dims // 2, device=DEVICE) + 0.5) if "yarn" in name else None
    out = a.view((1, T, H, hd), dtype)
    kw = dict(prm, n_dims=n_dims, mode=mode, sections=sections)
    a.run(lambda: rope.rope(x, ids, ff, out, **kw), out)
    assert_bits(out, ref.rope(x, ids, ff, **kw), f"ROPE {name}")


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("id_type,planes", [(torch.int64, (1, 1)), (torch.int32, (2, 1)), (torch.int64, (1, 3))],
                         ids=["i64", "i32-per-plane", "i64-per-ne3"])
def test_set_rows(dtype, id_type, planes):
    """SET_ROWS in place, byte for byte against the reference: edge values (NaN, inf, overflow, subnormals) converted
    as CPY converts, ids broadcast over planes (plane (i2, i3) reads ids[i2 % .., i3 % ..]), only the named rows
    written (Arena.run fails on any other byte), an out-of-range id refused in one line."""
    a = Arena()
    rows = put_values(a, (3, 2, 4, 40), row_stride=48)
    n2, n3 = planes
    vals = torch.tensor([[[5, 0, 9, 2], [1, 8, 3, 6]][:n2]] * n3, device=DEVICE).reshape(1, n3, n2, 4)
    ids = put(a, vals.to(id_type))
    dst = a.put(rnd(3, 2, 10, 40).to(dtype))
    want = ref.set_rows(dst.clone(), rows, ids)
    a.run(lambda: elt.set_rows(rows, ids, dst), dst)
    assert_bits(dst, want, f"SET_ROWS f32 -> {dtype}")
    bad = put(a, torch.tensor([[[[0, 10, 1, 2]]]], device=DEVICE, dtype=id_type))
    with pytest.raises(KernelError, match="SET_ROWS: row id 10 is outside the destination's 10 rows"):
        elt.set_rows(rows, bad, dst)


# ---- graph level: fused vs unfused ----------------------------------------------------------------------------------


def test_check_tiny_qwen35_through_the_new_kernels(launches):
    """run --check on tiny-qwen35 (4 tokens, 3 rollback planes, 1 layer) with every op of this file on its Triton
    kernel: fused and unfused byte-identical. The mat-vecs run on torch here (the interpreter spends ~40 s a run on
    them; the CLI test below runs them too): fused and unfused still share them, so exactness is unaffected."""
    from gdnpass import pipeline
    from gdnpass.check import check_fusion
    from gdnpass.models import VerifyConfig, default_ids

    cfg = VerifyConfig("tiny-qwen35", 4, 3, n_layers=1)
    g = pipeline.run(cfg, pipeline.PassOptions(fusion=False)).graph
    from gdnpass.patterns import matchers

    backend = {**TRITON_BACKEND, **{op: TORCH_BACKEND[op] for op in (Op.MUL_MAT, Op.MUL_MAT_VEC_PAIR, Op.MUL_MAT_ADD)}}
    # (not mul_mat_chain: on torch its SiLU would be torch's, the unfused one the Triton kernel's; its own tests run
    # it against the unfused kernels on Triton, the CLI test below in the whole graph)
    res = check_fusion(g, device=DEVICE, backend=backend, ids=default_ids(cfg),
                       patterns=[m for m in matchers() if m.name != "mul_mat_chain"])
    assert res.identical, [c.to_json() for c in res.compared if not c.identical]
    assert {"_get_rows_kernel", "_concat_kernel", "_cpy_kernel", "_binary_kernel", "_unary_kernel",
            "_swiglu_kernel", "_gdn_conv_chain_kernel"} <= set(launches)


def test_whole_tiny_qwen35_attention_through_rope_and_set_rows_kernels(launches):
    """The whole tiny-qwen35 forward (its attention layer: IMROPE of q and k, SET_ROWS into the F16 KV caches at
    I64 cells) with ROPE and SET_ROWS on their Triton kernels and every other op on torch: every buffer (logits,
    caches) byte-identical to the all-torch run, through the executor's adapters and the real plan."""
    from gdnpass import pipeline
    from gdnpass.models import VerifyConfig, default_ids
    from gdnpass.runtime import Executor

    cfg = VerifyConfig("tiny-qwen35", 4, 3, whole=True)
    g = pipeline.run(cfg, pipeline.PassOptions(fusion=False)).graph
    assert {Op.ROPE, Op.SET_ROWS} <= {n.op for n in g.nodes}
    caches = [t for t in g.leafs if t.buffer == "cache" and not t.is_view]
    assert any(t.name.startswith("cache_k") for t in caches)
    runs = []
    for table in (TORCH_BACKEND, {**TORCH_BACKEND, Op.ROPE: TRITON_BACKEND[Op.ROPE],
                                  Op.SET_ROWS: TRITON_BACKEND[Op.SET_ROWS]}):
        ex = Executor(g, device=DEVICE, backend=table)
        fill(ex, seed=3, ids=default_ids(cfg))
        ex.run()
        # every cache tensor (the K/V caches SET_ROWS wrote, the recurrent states) and the whole arena (fill poisons
        # it: its bytes are defined), which holds the logits; not the buffers' alignment gaps, never written
        runs.append({**{t.name: ex.bytes_of(t) for t in caches}, "arena": ex.snapshot()["arena"]})
    assert {"_rope_kernel", "_set_rows_kernel"} <= set(launches)
    assert [k for k in runs[0] if not (torch.equal(runs[0][k], runs[1][k]) if k == "arena"
                                       else runs[0][k] == runs[1][k])] == []


@pytest.mark.slow
def test_cli_run_check_triton_tiny_qwen35():
    """The CLI itself: ``gdnpass run --check --backend triton --model tiny-qwen35 --tokens 4 --rs-seq 3 --layers 1``
    (every kernel in the interpreter, mat-vecs included: ~100 s on a 2-core machine, hence --allow-slow)."""
    root = Path(__file__).resolve().parents[2]  # the repository (this file: tests/kernels/)
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1" if DEVICE == "cpu" else "0")}
    r = subprocess.run([sys.executable, "-m", "gdnpass.cli", "run", "--check", "--backend", "triton", "--model",
                        "tiny-qwen35", "--tokens", "4", "--rs-seq", "3", "--layers", "1", "--allow-slow", "--quiet",
                        *(["--device", "cuda"] if DEVICE == "cuda" else [])],
                       cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert ", 0 differing" in r.stdout, r.stdout[-2000:]


# ---- compiled: byte for byte against torch on CUDA, over many bit patterns ------------------------------------------


def _patterns(step: int) -> torch.Tensor:
    """Every ``step``-th f32 bit pattern (all signs, exponents, NaNs), as a (1, 1, rows, 4096) f32 tensor on CUDA."""
    bits = torch.arange(0, 2**32, step, dtype=torch.int64, device="cuda")
    bits = bits[: bits.numel() // 4096 * 4096]
    return bits.to(torch.int32).view(F32).reshape(1, 1, -1, 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", elt.UNARY_KINDS)
def test_gpu_unary_matches_torch_on_2_24_patterns(kind):
    x = _patterns(251)
    out = torch.empty_like(x)
    elt.unary(kind, x, out)
    assert_bits(out, ref.UNARY[kind](x), kind)


@triton.jit
def _silu_unrolled_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, core.silu_f32_unrolled(tl.load(x_ptr + i)))


@pytest.mark.gpu
def test_gpu_silu_unrolled_on_all_f32():
    """The fused chain's SiLU (silu_f32_unrolled: silu_quotient, div_rn without its branch) on every one of the 2^32
    f32 bit patterns, 2^28 at a time, against torch: its special cases (x < -80, x = +-0 or +inf, y = inf, NaN)
    are a few bit patterns each, which a sample misses."""
    for first in range(0, 2**32, 2**28):
        x = torch.arange(first, first + 2**28, dtype=torch.int64, device="cuda").to(torch.int32).view(F32)
        out = torch.empty_like(x)
        _silu_unrolled_kernel[(x.numel() // 1024,)](x, out, BLOCK=1024)
        assert_bits(out, ref.silu(x), f"silu_f32_unrolled on bit patterns {first:#x}..")


@pytest.mark.gpu
def test_gpu_swiglu_and_conversions_match_torch():
    x = _patterns(509)
    up = x.flip(-1).contiguous()
    out = torch.empty_like(x)
    elt.glu("SWIGLU", x, up, False, out)
    assert_bits(out, ref.swiglu(x, up), "SWIGLU")
    for dtype in (F16, BF16, I32):
        dst = torch.empty(x.shape, dtype=dtype, device="cuda")
        elt.cpy(x, dst)
        assert_bits(dst, ref.cpy(x, dst), f"CPY f32 -> {dtype}")
    for dtype in (F16, BF16):
        src = torch.arange(-2**15, 2**15, dtype=I32, device="cuda").to(torch.int16).view(dtype).reshape(1, 1, 64, 1024)
        ids = torch.arange(64, dtype=I32, device="cuda").reshape(1, 1, 1, 64)
        out = torch.empty(1, 1, 64, 1024, device="cuda")
        elt.get_rows(src, ids, out)
        assert_bits(out, ref.get_rows(src, ids), f"GET_ROWS {dtype}")


@pytest.mark.parametrize("model, T, flash", [("tiny-qwen35", 4, True), ("qwen3.5-9b", 8, True),
                                             ("qwen3.5-9b", 4, False)])
def test_every_node_of_a_whole_verify_is_triton_launches(model, T, flash):
    """A whole verify forward (flash attention, or MUL_MAT + SOFT_MAX + MUL_MAT; fusion on and off) has no node on a
    torch composite under TRITON_BACKEND: every computing node has Triton programs, as many launches as
    launches.node_launches counts (so bench.py's per-kernel durations line up with the nodes)."""
    from gdnpass import pipeline
    from gdnpass.ir import runs_kernel
    from gdnpass.kernels.backends import programs
    from gdnpass.models import VerifyConfig
    from gdnpass.launches import node_launches

    cfg = VerifyConfig(model, T, T - 1, whole=True, dflash=True, n_past=16, share_weights=True, flash_attn=flash)
    for fusion in (False, True):
        g = pipeline.run(cfg, pipeline.PassOptions(fusion=fusion)).graph
        torch_nodes = [n.name for n in g.nodes if runs_kernel(n) and not programs(n)]
        assert torch_nodes == [], torch_nodes[:5]
        assert all(len(programs(n)) == node_launches(n) for n in g.nodes if runs_kernel(n) and not n.op.is_fused)


def _launched_kernels():
    """Every ``*_kernel`` of the kernel families and the patterns' own kernel modules: what launches with LAUNCH."""
    import importlib
    import pkgutil

    import gdnpass.patterns

    modules = [elt, mv, norms, rope, ssm, importlib.import_module("gdnpass.kernels.triton_attention")]
    for info in pkgutil.walk_packages(gdnpass.patterns.__path__, "gdnpass.patterns."):
        if info.name.endswith(".kernel"):
            modules.append(importlib.import_module(info.name))
    # (@triton.jit's object, compiled or interpreted, keeps the Python function as .fn)
    return [(m.__name__, name, fn.fn) for m in modules for name, fn in vars(m).items()
            if name.endswith("_kernel") and inspect.isfunction(getattr(fn, "fn", None))
            and fn.fn.__module__ == m.__name__]


# What a kernel may call before it waits for the kernel before it: Triton's index arithmetic, casts, and the helpers
# below, whose own bodies call nothing else (the L2 prefetch's inline PTX, in prefetch_l2 only, reads nothing into
# the program: the loads come after the wait). Every other call may load or store.
INDEX_ARITHMETIC = {"program_id", "num_programs", "arange", "minimum", "cdiv"}


def _helpers_before_the_wait() -> dict:
    from gdnpass.kernels import triton_matvec as mv

    return {"k_slice": mv.k_slice.fn, "prefetch_weights": mv.prefetch_weights.fn, "prefetch_l2": core.prefetch_l2.fn}


def _may_come_first(call, inside=None) -> bool:
    """Whether ``call`` (an ast.Call) may come before the wait: index arithmetic (``tl.<name>``), a cast (``.to``), a
    helper whose body calls only such; the bulk prefetch's inline PTX inside prefetch_l2."""
    import ast

    f = call.func
    if isinstance(f, ast.Attribute):
        tl_call = isinstance(f.value, ast.Name) and f.value.id == "tl"
        return (f.attr == "to" or tl_call and f.attr in INDEX_ARITHMETIC
                or tl_call and f.attr == "inline_asm_elementwise" and inside == "prefetch_l2")
    helpers = _helpers_before_the_wait()
    if not isinstance(f, ast.Name) or f.id not in helpers:
        return False
    body = ast.parse(inspect.getsource(helpers[f.id]))
    return all(_may_come_first(c, f.id) for c in ast.walk(body) if isinstance(c, ast.Call))


def _waits_first(stmts: list) -> bool:
    """Every path through ``stmts`` calls wait_for_previous_kernels() before any call that may load or store
    (:func:`_may_come_first`) and before any return."""
    return _first(stmts) == "waits"


def _first(stmts: list) -> str:
    """What ``stmts`` do first: "waits" on every path, "fails" (a call that may load or store, or a return, before the
    wait on some path) or "through" (reach their end on some path without either)."""
    import ast

    for st in stmts:
        if (isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)
                and getattr(st.value.func, "id", None) == "wait_for_previous_kernels"):
            return "waits"
        if isinstance(st, ast.Return):
            return "fails"
        if isinstance(st, ast.If):
            if not all(_may_come_first(c) for c in ast.walk(st.test) if isinstance(c, ast.Call)):
                return "fails"
            arms = {_first(st.body), _first(st.orelse)}
            if "fails" in arms:
                return "fails"
            if arms == {"waits"}:
                return "waits"
            continue  # (an arm that waited and one that did not: the rest is checked as not waited)
        if not all(_may_come_first(c) for c in ast.walk(st) if isinstance(c, ast.Call)):
            return "fails"
    return "through"


def test_every_kernel_waits_for_the_previous_one_first():
    """Under programmatic dependent launch (triton_core.LAUNCH on sm_90+) a kernel may start while the one before it
    runs: only wait_for_previous_kernels(), before any load or store (index arithmetic and a weight's L2 prefetch may
    come first: BEFORE_THE_WAIT), keeps its loads and stores behind its predecessor's."""
    import ast

    kernels = _launched_kernels()
    assert len(kernels) >= 17, [k[:2] for k in kernels]  # the 17 of 2026-12-03: none went missing from the scan
    for module, name, fn in kernels:
        body = ast.parse(inspect.getsource(fn)).body[0].body
        assert _waits_first(body), f"{module}.{name} does not wait for the previous kernel before its first access"


def test_the_wait_check_finds_a_load_before_the_wait():
    import ast

    def waits_first(src):
        return _waits_first(ast.parse(src).body)

    assert waits_first("r = tl.program_id(0) * 4\nwait_for_previous_kernels()\nx = tl.load(p + r)")
    assert waits_first("if IDS:\n    wait_for_previous_kernels()\nelse:\n    prefetch_weights(w, s, r, n, 4, a, b, q)\n"
                       "    wait_for_previous_kernels()\nx = tl.load(p)")
    assert not waits_first("x = tl.load(p)\nwait_for_previous_kernels()")
    assert not waits_first("if IDS:\n    wait_for_previous_kernels()\nx = tl.load(p)")  # one arm only
    assert not waits_first("if IDS:\n    x = tl.load(p)\n    wait_for_previous_kernels()\n"
                           "else:\n    wait_for_previous_kernels()")
    assert not waits_first("r = tl.program_id(0)")  # never waits
    assert not waits_first("if r < 0:\n    return\nwait_for_previous_kernels()")  # a path that returns first
    assert not waits_first("r = helper(p)\nwait_for_previous_kernels()")  # any other helper may load
    assert not waits_first("r = tl.inline_asm_elementwise(a)\nwait_for_previous_kernels()")  # PTX outside the prefetch


def test_programmatic_launch_switch_restores_the_launch_options():
    before = dict(core.LAUNCH)
    with core.programmatic_launch(False):
        assert core.LAUNCH.get("launch_pdl") in ((False,) if core.PDL_SUPPORTED else (None,))
    with core.programmatic_launch(True):
        pass
    assert core.LAUNCH == before
