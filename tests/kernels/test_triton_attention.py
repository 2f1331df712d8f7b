"""FLASH_ATTN_EXT and SOFT_MAX on their Triton kernels (gdnpass/kernels/triton_attention.py) against their torch
references (reference.flash_attn_ext with cpu=False, reference.soft_max); without a GPU, in Triton's interpreter.

Operands are strided views into one NaN-poisoned arena, as the executor hands them out: q permuted as llama.cpp's
build_attn_mha permutes it, K and V permuted views of an interleaved cache, outputs strided or permuted views (and
``Arena.run`` checks that nothing outside the output was written). Tolerances, rel = max |Δ| / max |ref|:

- FLASH_ATTN_EXT: 1e-5 (the 3xTF32 products, summation order, the online softmax's rescaling). Observed <= 5e-7 in
  the interpreter (f32 products); compiled on an H200, qwen3.5's verify shape (DK = DV = 256, 16 heads over 4, 256
  KV positions of an f16 cache, 1..16 rows) is within 2.4e-6 (the torch reference itself: 1.8e-6 from f64).
- SOFT_MAX: 1e-6 in the interpreter, whose exp is numpy's (an ulp from torch's CPU exp; observed <= 1.2e-7); bit for
  bit compiled on CUDA (asserted there; seen on an H200), where the kernel's exp is torch's (CUDA's expf) and only
  its f64 sum runs in another order.
"""

from __future__ import annotations

import pytest
import torch

from gdnpass import alloc, ops
from gdnpass.errors import KernelError
from gdnpass.ir import DType, Flag, Graph, Op, Prec
from gdnpass.kernels import reference as ref
from gdnpass.kernels import triton_attention as ta
from gdnpass.kernels.backends import TORCH_BACKEND, TRITON_BACKEND
from gdnpass.runtime import TORCH_DTYPES, Executor
from support.arena import DEVICE, Arena, node, rnd

NEG_INF = float("-inf")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
CUDA = DEVICE == "cuda"

pytestmark = [
    # the interpreter evaluates both sides of every tl.where: -inf - -inf and 1/0 in lanes that are then dropped
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| / max |theirs| over the finite elements of theirs; NaNs and infinities must coincide."""
    a, b = ours.double().cpu(), theirs.double().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a)), "non-finite elements differ"
    assert torch.equal(a[~fin].nan_to_num(), b[~fin].nan_to_num()), "non-finite elements differ"
    top = float(b[fin].abs().max()) if fin.any() else 0.0
    d = float((a[fin] - b[fin]).abs().max()) if fin.any() else 0.0
    return d / top if top else d


def kq_mask(n_kv: int, rows: int, first: int, planes=(1, 1), alibi: bool = False, dead_row=None) -> torch.Tensor:
    """llama.cpp's KQ mask, torch shape (ne33, ne32, rows, n_kv): row i sees cells 0 .. first + i (0; ALiBi: minus
    the distance), the rest -inf; plane p shifts the window by p (so broadcasting the wrong plane shows); row
    ``dead_row`` sees nothing."""
    n33, n32 = planes
    m = torch.full((n33, n32, rows, n_kv), NEG_INF)
    for p in range(n33 * n32):
        for i in range(rows):
            end = min(n_kv, first + i + 1 + p)
            m.view(-1, rows, n_kv)[p, i, :end] = -torch.arange(end, 0, -1) / 4 if alibi else 0.0
    if dead_row is not None:
        m[:, :, dead_row] = NEG_INF
    return m


# ---- FLASH_ATTN_EXT -------------------------------------------------------------------------------------------------

# (id, DK, DV, H, H_kv, n_q, n_kv, K/V type, ne3, extras): qwen3.5's attention at a tiny size (GQA 2:1, f16 cache,
# a causal f16 mask padded to 8 rows, one row that sees nothing), a decode without a mask, GQA 4:1 over an f32 cache
# and a KV length off the block size, sinks, logit softcapping, ALiBi over 2 mask planes, bf16 K/V with DV != DK,
# two ne3 streams of 20 query rows (two row blocks) with one mask plane per stream
FA_CASES = [
    ("qwen35", 64, 64, 4, 2, 5, 64, F16, 1, {"dead_row": 2}),
    ("decode-no-mask", 32, 32, 4, 4, 1, 128, F16, 1, {"no_mask": True}),
    ("gqa4-f32-kv", 32, 32, 4, 1, 3, 40, F32, 1, {}),
    ("sinks", 32, 32, 4, 2, 4, 64, F16, 1, {"sinks": True, "dead_row": 1}),
    ("softcap", 32, 32, 4, 1, 3, 40, F16, 1, {"softcap": 5.0, "scale": 0.5}),
    ("alibi", 32, 32, 4, 4, 3, 40, F16, 1, {"max_bias": 8.0, "planes": (1, 2)}),
    ("bf16-dv-differs", 64, 32, 4, 2, 2, 48, BF16, 1, {}),
    ("ne3-two-row-blocks", 32, 32, 2, 1, 20, 33, F16, 2, {"planes": (2, 1), "sinks": True}),
    ("kv-broadcast-ne3", 32, 32, 4, 2, 3, 33, F16, 2, {"kv_n3": 1}),  # both q streams read the one K/V stream
]


def fa_operands(a: Arena, case):
    """q, k, v, mask, sinks and the output view of a case, laid out as llama.cpp's graph has them."""
    _, DK, DV, H, Hkv, n_q, n_kv, kvt, n3, ex = case
    q = a.put(rnd(n3, n_q, H, DK)).permute(0, 2, 1, 3)  # [DK, H, n_q] rows permuted to [DK, n_q, H]
    cells = n_kv + 8  # the cache holds more cells than the view reads, and 2 * H_kv heads a cell
    kv3 = ex.get("kv_n3", n3)
    k = a.put(rnd(kv3, cells, 2 * Hkv, DK).to(kvt))[:, :n_kv, :Hkv].permute(0, 2, 1, 3)
    v = a.put(rnd(kv3, cells, 2 * Hkv, DV).to(kvt))[:, :n_kv, :Hkv].permute(0, 2, 1, 3)
    mask = None
    if not ex.get("no_mask"):
        rows = n_q + (-n_q) % 8
        mask = a.put(kq_mask(n_kv, rows, n_kv - n_q - 8, ex.get("planes", (1, 1)), bool(ex.get("max_bias")),
                             ex.get("dead_row")).to(F16))
    sinks = a.put(rnd(1, 1, 1, H)) if ex.get("sinks") else None
    # the output: a permuted view (rows of DV, heads outermost) or rows of DV + 4 elements
    out = a.view((n3, H, n_q, DV)).permute(0, 2, 1, 3) if n_q % 2 else a.view((n3, n_q, H, DV), row_stride=DV + 4)
    return q, k, v, mask, sinks, out


@pytest.mark.parametrize("case", FA_CASES, ids=[c[0] for c in FA_CASES])
@pytest.mark.parametrize("steps", ["tile", "16-wide"])
def test_flash_attn_ext_matches_reference(case, steps, monkeypatch):
    """Each case with its own tile (fa_tile: one KV step at these sizes), and in KV steps of 16, where nearly every
    step raises some row's maximum and rescales what came before (the online softmax), and the KV is split into 3-8
    slices merged at the end (fa_split: these cases have 4-8 programs), slices of masked-out positions and rows that
    see nothing included."""
    if steps == "16-wide":
        monkeypatch.setattr(ta, "fa_tile", lambda DK, DV, kv_bytes: (16, 4, 1))
    ex = case[9]
    a = Arena()
    q, k, v, mask, sinks, out = fa_operands(a, case)
    prm = (ex.get("scale", 0.125), ex.get("max_bias", 0.0), ex.get("softcap", 0.0))
    a.run(lambda: ta.flash_attn_ext(q, k, v, mask, sinks, *prm, out), out)
    want = ref.flash_attn_ext(q, k, v, mask, sinks, *prm)
    assert not out.isnan().any()
    assert rel(out, want) <= 1e-5, rel(out, want)
    if "dead_row" in ex:  # no finite score: 0 (with a sink too: its value-less weight is all there is)
        assert torch.equal(out[:, ex["dead_row"]], torch.zeros_like(out[:, ex["dead_row"]]))
        assert torch.equal(want[:, ex["dead_row"]], torch.zeros_like(want[:, ex["dead_row"]]))
    if ex.get("max_bias"):  # the slopes matter: without them the result is another one
        assert rel(ref.flash_attn_ext(q, k, v, mask, sinks, prm[0], 0.0, 0.0), want) > 1e-2


def test_flash_attn_ext_refuses_what_it_cannot_run():
    """The launcher refuses (KernelError) what its adapter sends to the reference instead: an output overlapping an
    input, a head wider than FA_MAX_D, a mask narrower than the KV."""
    a = Arena()
    q, k, v, mask, sinks, out = fa_operands(a, FA_CASES[0])
    with pytest.raises(KernelError, match="overlaps"):
        ta.flash_attn_ext(q, k, v, mask, sinks, 0.125, 0.0, 0.0, q.permute(0, 2, 1, 3))
    assert "does not hold" in ta.flash_attn_ext_refusal(q, k, v, mask[..., :1], sinks, out)
    wide = torch.zeros(1, 1, 1, ta.FA_MAX_D + 8, device=DEVICE)
    assert "head size" in ta.flash_attn_ext_refusal(wide, wide.half(), wide.half(), None, None,
                                                     torch.zeros_like(wide))


# ---- SOFT_MAX -------------------------------------------------------------------------------------------------------

# (id, mask type, mask planes (ne13, ne12), scale, max_bias, sinks, (ne3, ne2, ne1, ne0)): llama.cpp's non-flash
# attention (an f32 mask with padding rows, one plane for all heads), an f16 mask, a mask per head, no mask, ALiBi,
# sinks over 2 mask planes, rows longer than SM_TILE (two column blocks per pass) in two ne3 streams
SM_CASES = [
    ("f32-mask", F32, (1, 1), 0.125, 0.0, False, (1, 4, 5, 48)),
    ("f16-mask", F16, (1, 1), 0.3, 0.0, False, (1, 4, 5, 48)),
    ("per-head", F32, (1, 4), 0.125, 0.0, False, (1, 4, 5, 48)),
    ("no-mask", None, (1, 1), 0.7, 0.0, False, (1, 4, 5, 48)),
    ("alibi", F32, (1, 1), 0.125, 8.0, False, (1, 4, 5, 48)),
    ("sinks", F16, (1, 2), 0.125, 0.0, True, (1, 4, 5, 48)),
    ("long-rows", F16, (2, 1), 0.125, 0.0, True, (2, 2, 3, ta.SM_TILE + 476)),
]


@pytest.mark.parametrize("case", SM_CASES, ids=[c[0] for c in SM_CASES])
@pytest.mark.parametrize("in_place", [False, True], ids=["strided-out", "in-place"])
def test_soft_max_matches_reference(case, in_place):
    _, mt, planes, scale, max_bias, with_sinks, shape = case
    n3, n2, n1, ne0 = shape
    a = Arena()
    x = a.put(rnd(*shape) * 4)
    mask = None
    if mt is not None:  # a row that sees nothing: NaN without a sink, 0 with one (both as the reference)
        mask = a.put(kq_mask(ne0, n1 + (-n1) % 8, ne0 - n1 - 8, planes, bool(max_bias), dead_row=1).to(mt))
    sinks = a.put(rnd(1, 1, 1, n2)) if with_sinks else None
    want = ref.soft_max(x, mask, sinks, scale, max_bias)
    out = x if in_place else a.view(shape, row_stride=ne0 + 3)
    a.run(lambda: ta.soft_max(x, mask, sinks, scale, max_bias, out), out)
    if CUDA:
        assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())
    else:
        assert rel(out, want) <= 1e-6, rel(out, want)
    if mask is not None:
        assert bool(out[:, :, 1].isnan().all()) != with_sinks
    if max_bias:  # the slopes matter: without them the result is another one
        assert rel(ref.soft_max(x, mask, sinks, scale, 0.0).nan_to_num(), want.nan_to_num()) > 1e-2


# ---- through the executor -------------------------------------------------------------------------------------------


class _Counted:
    """A kernel whose launches are logged."""

    def __init__(self, kernel, name: str, log: list) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(self.name)
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_executor_runs_each_attention_node_as_one_triton_launch(monkeypatch):
    """A FLASH_ATTN_EXT over permuted views of an F16 KV cache (as build_attn_mha: f16 mask, sinks, prec F32) and a
    SOFT_MAX of KQ with that mask, planned and run by the Executor on TRITON_BACKEND: one launch each, within the
    tolerances above of TORCH_BACKEND."""
    log: list = []
    for name in ("_flash_attn_kernel", "_soft_max_kernel"):
        monkeypatch.setattr(ta, name, _Counted(getattr(ta, name), name, log))
    DK, H, Hkv, n_q, n_kv, cells = 32, 4, 2, 3, 40, 48
    q = ops.new_tensor("q", DType.F32, (DK, H, n_q), buffer="input", flags=Flag.INPUT)
    kc = ops.new_tensor("cache_k", DType.F16, (DK * Hkv, cells), buffer="cache")
    vc = ops.new_tensor("cache_v", DType.F16, (DK * Hkv, cells), buffer="cache")
    mask = ops.new_tensor("kq_mask", DType.F16, (n_kv, 8), buffer="input", flags=Flag.INPUT)
    sinks = ops.new_tensor("sinks", DType.F32, (H,), buffer="weights")
    kq = ops.new_tensor("kq", DType.F32, (n_kv, n_q, H), buffer="input", flags=Flag.INPUT)

    def get_kv(c):  # get_k / get_v: [DK, H_kv, n_kv] of the cache, permuted to [DK, n_kv, H_kv]
        return ops.permute(ops.view_4d(c, (DK, Hkv, n_kv, 1), 2 * DK, 2 * DK * Hkv, 2 * DK * Hkv * cells, 0),
                           0, 2, 1, 3)

    fa = ops.prec_set_acc(ops.flash_attn_ext(ops.permute(q, 0, 2, 1, 3), get_kv(kc), get_kv(vc), mask, 0.125,
                                             sinks=sinks), Prec.F32)
    sm = ops.soft_max_ext(kq, mask, 0.125, sinks=sinks)
    g = Graph()
    g.expand(fa)
    g.expand(sm)
    ops.validate(g)
    alloc.plan(g)
    values = {t: rnd(t.nelements) for t in (q, kc, vc, sinks, kq)}
    values[mask] = kq_mask(n_kv, 8, n_kv - n_q - 4, dead_row=2).reshape(-1)
    results = []
    for backend in (TORCH_BACKEND, TRITON_BACKEND):
        ex = Executor(g, device=DEVICE, backend=backend)
        ex.buffers[ex.arena].fill_(0xFF)  # NaN: nothing reads what was not written
        for t, val in values.items():
            ex.view(t).copy_(val.to(TORCH_DTYPES[t.type]).reshape(ex.view(t).shape))
        ex.run()
        results.append((ex.read(fa), ex.read(sm)))
    assert log == ["_flash_attn_kernel", "_soft_max_kernel"]
    (fa_t, sm_t), (fa_k, sm_k) = results
    assert rel(fa_k, fa_t) <= 1e-5, rel(fa_k, fa_t)
    assert rel(sm_k, sm_t) <= 1e-6, rel(sm_k, sm_t)


def test_adapter_runs_the_reference_where_the_kernel_refuses(monkeypatch):
    """A FLASH_ATTN_EXT head wider than FA_MAX_D: TRITON_BACKEND's adapter runs the torch reference, launching
    nothing, and writes its result."""
    log: list = []
    monkeypatch.setattr(ta, "_flash_attn_kernel", _Counted(ta._flash_attn_kernel, "_flash_attn_kernel", log))
    a = Arena()
    D = ta.FA_MAX_D + 8
    q, k, v = a.put(rnd(1, 2, 1, D)), a.put(rnd(1, 1, 3, D).half()), a.put(rnd(1, 1, 3, D).half())
    out = a.view((1, 1, 2, D))
    n = node(Op.FLASH_ATTN_EXT, scale=0.1, max_bias=0.0, logit_softcap=0.0, prec="F32", n_kv_max=0)
    TRITON_BACKEND[Op.FLASH_ATTN_EXT](n, [q, k, v], out)
    assert log == []
    assert torch.equal(out, ref.flash_attn_ext(q, k, v, None, None, 0.1))


def test_flash_attn_ext_split_kv_is_deterministic_and_leaves_its_tickets_zero(monkeypatch):
    """The KV split (8 slices of 16 positions here) merges the slices in a fixed order whichever program finishes
    last: two launches write the same bytes, and every ticket is zero again afterwards (the next launch, or the next
    CUDA-graph replay, starts from zero)."""
    from gdnpass.kernels import triton_core as core

    monkeypatch.setattr(ta, "fa_tile", lambda DK, DV, kv_bytes: (16, 4, 1))
    case = FA_CASES[0][:6] + (128,) + FA_CASES[0][7:]  # qwen35's shape over 128 positions
    assert ta.fa_split(128, 4, 16) == 8
    a = Arena()
    q, k, v, mask, sinks, out = fa_operands(a, case)
    runs = []
    for _ in range(2):
        a.run(lambda: ta.flash_attn_ext(q, k, v, mask, sinks, 0.125, 0.0, 0.0, out), out)
        runs.append(out.clone())
    assert torch.equal(runs[0].view(torch.uint8), runs[1].view(torch.uint8))
    assert not core._SPLIT_WORKSPACE[out.device][1].any(), "tickets left non-zero"
    assert rel(out, ref.flash_attn_ext(q, k, v, mask, sinks, 0.125, 0.0, 0.0)) <= 1e-5


def test_flash_attn_grid_packs_a_gqa_group_and_splits_the_kv_of_a_verify():
    """qwen3.5-9b's attention (16 query heads over 4 KV heads, 256 wide, f16): a verify's 4 query rows of a group's 4
    heads are one block of 16 rows, 4 programs, its 256 KV positions in 4 slices; 8 rows are two blocks; a long
    context splits up to FA_PROGRAMS programs; K and V heads of different ratios take one head a program."""
    block_n = ta.fa_tile(256, 256)[0]
    assert ta.fa_grid(4, 16, 1, 4, 4, 256, block_n) == (4, 1, 4)
    assert ta.fa_grid(8, 16, 1, 4, 4, 4096, block_n) == (4, 2, ta.FA_PROGRAMS // 8)
    assert ta.fa_grid(512, 16, 1, 4, 4, 4096, block_n) == (4, 128, 1)  # a prompt: enough programs unsplit
    assert ta.fa_grid(4, 16, 1, 4, 2, 256, block_n)[0] == 1
