"""The attention side of a qwen35 verify graph, executed (issue 17): ROPE (NORMAL, NEOX, MROPE, IMROPE; YaRN),
SET_ROWS, SOFT_MAX, FLASH_ATTN_EXT, MUL_MAT / GET_ROWS of f16 and bf16 sources, and CONT / PERMUTE around them.

1. Per op, against ggml-python's CPU (ggml 0.15.3, whose CPU ops for these are the pinned llama.cpp's: its IMROPE,
   its one-chunk / tiled flash attention): each op built with gdnpass.ops, planned, run by gdnpass's Executor; the
   same op built with ggml from the same inputs, run by ggml; compared as max |Δ| / max |ggml| (the "rel" below).
2. A qwen35 attention block (tests/test_ops.py's: q+gate projection, q/k norms, IMROPE, SET_ROWS into the F16
   KV cache, flash attention or MUL_MAT + SOFT_MAX + MUL_MAT, the sigmoid gate, the FFN) run by both.
3. llama.cpp itself (the pinned build, tests/conftest.py's ``llama``): a captured verify graph of a tiny random
   qwen35 file, with the compute and cache buffers as llama.cpp had them when the verify started
   (``Settings(record_memory=True)``) and the weights from the file, executed by gdnpass: its logits against
   llama.cpp's; and node by node against llama.cpp's own bytes of every node (``record_nodes``), each node fed
   llama.cpp's inputs.

Tolerances (rel) and why:

- data movement (SET_ROWS, GET_ROWS, CONT): 0, bit for bit;
- f32 arithmetic (ROPE, SOFT_MAX; FLASH_ATTN_EXT and MUL_MAT with ggml-cpu's rounding modelled, GGML_CPU_BACKEND):
  1e-6. Observed <= 3e-7: ggml-python's build contracts ROPE's rotation into FMAs (the pinned -O0 build does not),
  its SIMD expf is within an ulp of torch's, its dot products sum in its own lane order;
- ROPE of an f16 row: 1e-3 (an ulp of f32 before the f16 rounding can move the f16 result by one f16 ulp, 2^-11);
- FLASH_ATTN_EXT with the f32 semantics (TORCH_BACKEND) against the CPU: 5e-3. ggml-cpu's one-chunk path (fewer than
  64 query rows) rounds Q to f16 and accumulates P·V in f16 (observed ~1.5e-3); the tiled path (64 or more rows) is
  f32, and there both forms are within 1e-6;
- MUL_MAT of f16 / bf16 weights with the f32 semantics: 2e-2 (ggml-cpu rounds the activation to the weight's type,
  bf16 keeps 8 bits);
- the whole captured verify's logits (f32 file): 1e-4 with GGML_CPU_BACKEND (observed 3.8e-5 with flash attention,
  1.3e-5 without: each node is within 5e-7 of llama.cpp given llama.cpp's inputs, but f32 differences of 1e-7 flip
  f16 roundings of the KV cache and of flash attention's accumulator, ~5e-4 of an element, downstream); 1e-3 with
  TORCH_BACKEND (observed 1.3e-4 / 1.1e-4: the f16 rounding of Q and of P·V it does not model).
"""

from __future__ import annotations

import copy
import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("ggml", reason="ggml-python is not installed (pip install 'ggml-python==0.0.45')")

from gdnpass import alloc, ops  # noqa: E402
from gdnpass.frontends import ggml as fg  # noqa: E402
from gdnpass.ir import DType, Flag, Graph, GraphError, Op, Prec, op_label, runs_kernel  # noqa: E402
from gdnpass.kernels import reference as ref  # noqa: E402
from gdnpass.kernels.backends import GGML_CPU_BACKEND, TORCH_BACKEND, TRITON_BACKEND, kernel  # noqa: E402
from gdnpass.runtime import TORCH_DTYPES, Executor  # noqa: E402
from support.attention_block import HD, KV, NKV, T, GgmlCalls, IrCalls, attention_block  # noqa: E402
from support.rope_cases import QWEN35_ROPE, ROPE_CASES  # noqa: E402

F32, F16, BF16, I32, I64 = DType.F32, DType.F16, DType.BF16, DType.I32, DType.I64
NEG_INF = float("-inf")


def rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| / max |theirs| over the finite elements of theirs; infinities and NaNs must coincide."""
    a, b = ours.double(), theirs.double()
    assert a.shape == b.shape, (a.shape, b.shape)
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a)) and torch.equal(a[~fin].nan_to_num(), b[~fin].nan_to_num()), \
        "non-finite elements differ"
    if not fin.any():
        return 0.0
    top = float(b[fin].abs().max())
    d = float((a[fin] - b[fin]).abs().max())
    return d / top if top else d


def exact(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Bit for bit (as raw bytes: -0.0 and NaN payloads count)."""
    return ours.shape == theirs.shape and ours.dtype == theirs.dtype and torch.equal(
        ours.contiguous().view(torch.uint8), theirs.contiguous().view(torch.uint8))


class Pair:
    """One small graph built twice from the same calls: with gdnpass.ops (planned, run by gdnpass's Executor) and
    with ggml (run by ggml-python's CPU backend), its leafs given the same values."""

    def __init__(self) -> None:
        self.s = fg.GgmlSession()
        self.g, self.ctx = self.s.g, self.s.ctx
        self.graph = Graph()
        self.values: list[tuple] = []
        self.outs: dict[str, tuple] = {}
        self._theirs: dict[str, torch.Tensor] | None = None

    def close(self) -> None:
        self.s.close()

    def leaf(self, name: str, dtype: DType, ne, value: torch.Tensor, buffer: str = "input"):
        ours = ops.new_tensor(name, dtype, ne, buffer=buffer, flags=Flag.INPUT if buffer == "input" else Flag.NONE)
        theirs = self.s.new_tensor(buffer, name, dtype, ne, input=buffer == "input")
        self.values.append((ours, theirs, value.to(TORCH_DTYPES[dtype]).reshape(-1)))
        return ours, theirs

    def out(self, label: str, ours, theirs) -> None:
        self.graph.expand(ours)
        self.g.ggml_set_output(theirs)
        self.s.expand(theirs)
        self.outs[label] = (ours, theirs)

    def theirs(self) -> dict[str, torch.Tensor]:
        if self._theirs is None:
            self.s.allocate()
            for _, t, v in self.values:
                self.s.write(t, v)
            self.s.compute()
            self._theirs = {k: self.s.read(t) for k, (_, t) in self.outs.items()}
        return self._theirs

    def ours(self, backend: dict = TORCH_BACKEND) -> dict[str, torch.Tensor]:
        if not self.graph.buffers:
            ops.validate(self.graph)
            alloc.plan(self.graph, self.s.alignment)
        ex = Executor(self.graph, backend=backend)
        ex.buffers[ex.arena].fill_(0xFF)  # NaN: nothing reads what was not written
        for o, _, v in self.values:
            ex.view(o).copy_(v.reshape(ex.view(o).shape))
        ex.run()
        return {k: ex.read(o) for k, (o, _) in self.outs.items()}


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


# ---------------------------------------------------------------------------------------------------------------------
# ROPE
# ---------------------------------------------------------------------------------------------------------------------

ROPE_T, ROPE_H = 5, 3


def _positions(mrope: bool, distinct: bool, small: bool = False) -> torch.Tensor:
    """Positions of ROPE_T tokens: text tokens (t = h = w = p, e = 0) far into a context, or four distinct streams;
    ``small``: below 64 (YaRN, see test_rope_matches_ggml)."""
    p = torch.tensor([0, 1, 5, 17, 63] if small else [0, 1, 17, 4096, 100003], dtype=torch.int32)
    if not mrope:
        return p
    if not distinct:
        return torch.cat([p, p, p, torch.zeros_like(p)])
    return torch.cat([p, p // 3 + 1, p % 7 + 2, p % 5])


def _rope_both(P: Pair, x, pos, ff, mode, n_dims, sections, prm):
    (xo, xt), (po, pt) = x, pos
    fo, ft = ff if ff is not None else (None, None)
    ours = ops.rope_ext(xo, po, fo, n_dims, mode, prm["n_ctx_orig"], prm["freq_base"], prm["freq_scale"],
                        prm["ext_factor"], prm["attn_factor"], prm["beta_fast"], prm["beta_slow"], sections=sections)
    args = (prm["n_ctx_orig"], prm["freq_base"], prm["freq_scale"], prm["ext_factor"], prm["attn_factor"],
            prm["beta_fast"], prm["beta_slow"])
    if mode & ref.ROPE_MROPE:
        theirs = P.g.ggml_rope_multi(P.ctx, xt, pt, ft, n_dims, (ctypes.c_int * 4)(*sections), mode, *args)
    else:
        theirs = P.g.ggml_rope_ext(P.ctx, xt, pt, ft, n_dims, mode, *args)
    return ours, theirs


@pytest.mark.parametrize("case", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
@pytest.mark.parametrize("distinct", [False, True], ids=["text-pos", "4-streams"])
def test_rope_matches_ggml(pair, case, distinct):
    """1e-6, positions up to 100003 (angles from the CPU's repeated f32 multiplication, as ggml-cpu's cache). With
    YaRN's ramp (ext_factor != 0) ggml-python's build contracts θ_interp·(1 - r) + θ_extrap·r into an FMA, where the
    pinned -O0 build, which the reference follows, rounds twice: an ulp of θ apart, i.e. ~θ·6e-8 of cos, so those
    cases use positions below 64 and 1e-5 (observed 2.7e-6 at position 4096; with the blend computed as an FMA the
    reference is within 7.4e-8 there)."""
    name, mode, hd, n_dims, sections, prm = case
    mrope = bool(mode & ref.ROPE_MROPE)
    if distinct and not mrope:
        pytest.skip("one position stream")
    yarn = prm["ext_factor"] != 0.0
    torch.manual_seed(hd + mode)
    x = pair.leaf("x", F32, (hd, ROPE_H, ROPE_T), torch.randn(ROPE_T * ROPE_H * hd))
    pv = _positions(mrope, distinct, small=yarn)
    pos = pair.leaf("inp_pos", I32, (pv.numel(),), pv)
    ff = pair.leaf("freq_factors", F32, (n_dims // 2,), torch.rand(n_dims // 2) + 0.5) if "yarn" in name else None
    pair.out("rope", *_rope_both(pair, x, pos, ff, mode, n_dims, sections, prm))
    ours, theirs = pair.ours()["rope"], pair.theirs()["rope"]
    assert rel(ours, theirs) <= (1e-5 if yarn else 1e-6), rel(ours, theirs)
    x_in = pair.values[0][2].view(1, ROPE_T, ROPE_H, hd)
    assert torch.equal(ours[..., n_dims:], x_in[..., n_dims:])  # the unrotated tail is copied
    assert rel(ours[..., :n_dims], x_in[..., :n_dims]) > 1e-2  # and the head rotated


def test_imrope_interleaves_the_sections():
    """IMROPE is not MROPE: the same input under ggml's MROPE is far from gdnpass's IMROPE (and gdnpass's MROPE is
    ggml's), so the sector rule (t, h, w by sector % 3 within 3 * section) is what the comparison above checked."""
    P = Pair()
    try:
        torch.manual_seed(3)
        x = P.leaf("x", F32, (64, 2, ROPE_T), torch.randn(ROPE_T * 2 * 64))
        pv = _positions(True, True)
        pos = P.leaf("inp_pos", I32, (pv.numel(),), pv)
        for mode in (8, 40):
            P.out(str(mode), *_rope_both(P, x, pos, None, mode, 64, (11, 11, 10, 0), QWEN35_ROPE))
        ours, theirs = P.ours(), P.theirs()
        assert rel(ours["40"], theirs["40"]) <= 1e-6 and rel(ours["8"], theirs["8"]) <= 1e-6
        assert rel(ours["40"], theirs["8"]) > 1e-2
    finally:
        P.close()


def test_rope_of_an_f16_row_matches_ggml(pair):
    torch.manual_seed(5)
    x = pair.leaf("x", F16, (64, 2, ROPE_T), torch.randn(ROPE_T * 2 * 64))
    pv = _positions(False, False)
    pos = pair.leaf("inp_pos", I32, (pv.numel(),), pv)
    pair.out("rope", *_rope_both(pair, x, pos, None, 2, 32, (0, 0, 0, 0), dict(QWEN35_ROPE, freq_base=1e4)))
    ours, theirs = pair.ours()["rope"], pair.theirs()["rope"]
    assert ours.dtype == theirs.dtype == torch.float16
    assert rel(ours, theirs) <= 1e-3 and torch.equal(ours[..., 32:], theirs[..., 32:])


def test_rope_yarn_corr_dims_follow_ggml():
    """The YaRN correction dims (ggml.c's float formula), against the float64 formula rounded the same way."""
    import math

    for n_dims, n_ctx, base, bf, bs in ((64, 4096, 1e4, 32.0, 1.0), (128, 262144, 1e7, 32.0, 1.0),
                                        (48, 2048, 5e5, 16.0, 2.0)):
        dim = lambda r: n_dims * math.log(n_ctx / (r * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
        want = (max(0.0, math.floor(dim(bf))), min(n_dims - 1.0, math.ceil(dim(bs))))
        assert ref.rope_yarn_corr_dims(n_dims, n_ctx, base, bf, bs) == want


def test_rope_modes_it_does_not_implement_are_refused_by_name():
    """VISION (24) is modelled (built, validated, saved) but not executed: the executor names it before running."""
    x = ops.new_tensor("x", F32, (16, 2, 3), buffer="input", flags=Flag.INPUT)
    pos = ops.new_tensor("inp_pos", I32, (12,), buffer="input", flags=Flag.INPUT)
    vision = ops.rope_multi(x, pos, None, 8, (2, 2, 0, 0), ref.ROPE_VISION, 4096, 1e4, 1.0, 0.0, 1.0, 32.0, 1.0)
    imrope = ops.rope_multi(x, pos, None, 8, (2, 1, 1, 0), ref.ROPE_IMROPE, 4096, 1e4, 1.0, 0.0, 1.0, 32.0, 1.0)
    for table in (TORCH_BACKEND, TRITON_BACKEND, GGML_CPU_BACKEND):
        assert kernel(table, vision) is None and kernel(table, imrope) is not None
    g = Graph()
    g.expand(vision)
    alloc.plan(g, 32)
    with pytest.raises(GraphError, match=r"node 'x \(rope\)': gdnpass cannot execute ROPE"):
        Executor(g).run()


# ---------------------------------------------------------------------------------------------------------------------
# SET_ROWS
# ---------------------------------------------------------------------------------------------------------------------

# (id, destination type, destination ne, rows type, rows ne, ids type, ids ne): the K cache store (f32 rows into an
# f16 cache at i64 cells), f32 into f32 at i32 ids, bf16 destination, ids broadcast over planes (ne11 = 1) and per
# plane, the transposed V cache (one element per row, an id per element)
SET_ROWS_CASES = [
    ("k-cache", F16, (64, 40), F32, (64, 4), I64, (4,)),
    ("f32-i32", F32, (24, 9), F32, (24, 3), I32, (3,)),
    ("bf16", BF16, (16, 8), F32, (16, 5), I64, (5,)),
    ("planes-shared-ids", F16, (8, 6, 3), F32, (8, 2, 3), I64, (2, 1)),
    ("planes-own-ids", F32, (8, 6, 3), F32, (8, 2, 3), I32, (2, 3)),
    ("v-transposed", F16, (1, 32 * 20), F32, (1, 32 * 3), I64, (32 * 3,)),
]


@pytest.mark.parametrize("case", SET_ROWS_CASES, ids=[c[0] for c in SET_ROWS_CASES])
def test_set_rows_matches_ggml_bit_for_bit(pair, case):
    _, dt, dne, rt, rne, it, ine = case
    torch.manual_seed(len(dne) * 7 + dne[0])
    n_dst = int(np.prod(dne))
    dst = pair.leaf("cache", dt, dne, torch.randn(n_dst), buffer="cache")  # never zeros: unwritten rows show
    rows = pair.leaf("rows", rt, rne, torch.randn(int(np.prod(rne))) * 3)
    n_rows, planes = dne[1], int(np.prod(ine[1:]))
    ids = torch.stack([torch.randperm(n_rows)[: ine[0]] for _ in range(planes)]).reshape(-1)
    idx = pair.leaf("ids", it, ine, ids)
    pair.out("set", ops.set_rows(dst[0], rows[0], idx[0]), pair.g.ggml_set_rows(pair.ctx, dst[1], rows[1], idx[1]))
    ours, theirs = pair.ours()["set"], pair.theirs()["set"]
    assert exact(ours, theirs)
    before = pair.values[0][2].view(theirs.shape)
    assert 0 < int((theirs != before).any(-1).sum()) < theirs[..., 0].numel()  # some rows written, others kept


def test_set_rows_of_f16_rows_copies_them():
    """f16 rows into an f16 destination: the pinned ggml-cpu copies the rows' bytes (ggml 0.15.3's ggml_set_rows
    still asserts f32 rows, so the check is against the pinned source: a memcpy), f16 rows into f32 widen exactly."""
    torch.manual_seed(2)
    rows = torch.randn(1, 1, 3, 16).half()
    rows[0, 0, 0, :4] = torch.tensor([float("nan"), -0.0, 65504.0, 6e-8]).half()
    ids = torch.tensor([5, 0, 2]).view(1, 1, 1, 3)
    for dst_dtype in (torch.float16, torch.float32):
        dst = torch.randn(1, 1, 8, 16).to(dst_dtype)
        out = ref.set_rows(dst, rows, ids)
        assert exact(out[0, 0, [5, 0, 2]], rows[0, 0].to(dst_dtype))
        assert exact(out[0, 0, [1, 3, 4, 6, 7]], dst[0, 0, [1, 3, 4, 6, 7]])


# ---------------------------------------------------------------------------------------------------------------------
# SOFT_MAX
# ---------------------------------------------------------------------------------------------------------------------

SM_KV, SM_Q, SM_H = 48, 5, 4


def _causal(n_kv: int, rows: int, first: int, dtype=torch.float32) -> torch.Tensor:
    """llama.cpp's KQ mask [n_kv, rows]: row i sees cells 0 .. first + i (0), the rest -inf."""
    m = torch.zeros(rows, n_kv)
    for i in range(rows):
        m[i, first + i + 1:] = NEG_INF
    return m.to(dtype)


# (id, mask type, mask planes, scale, max_bias, sinks): llama.cpp's non-flash attention (an f32 mask with padding rows,
# one plane for all heads), an f16 mask, a per-head mask, no mask, ALiBi with a finite mask, attention sinks
SM_CASES = [("f32-mask", F32, 1, 0.125, 0.0, False), ("f16-mask", F16, 1, 0.3, 0.0, False),
            ("per-head", F32, SM_H, 0.125, 0.0, False), ("no-mask", None, 1, 0.7, 0.0, False),
            ("alibi", F32, 1, 0.125, 8.0, False), ("sinks", F16, 1, 0.125, 0.0, True)]


@pytest.mark.parametrize("case", SM_CASES, ids=[c[0] for c in SM_CASES])
def test_soft_max_matches_ggml(pair, case):
    _, mt, planes, scale, max_bias, with_sinks = case
    torch.manual_seed(planes + int(10 * scale))
    kq = pair.leaf("kq", F32, (SM_KV, SM_Q, SM_H), torch.randn(SM_H * SM_Q * SM_KV) * 4)
    mask = sinks = (None, None)
    if mt is not None:
        mv = _causal(SM_KV, 8, 30).repeat(planes, 1)  # 8 rows for 5 queries: llama.cpp pads the mask
        if max_bias:  # ALiBi: a mask of distances, scaled per head
            mv = torch.where(torch.isinf(mv), mv, -torch.arange(SM_KV, dtype=torch.float32).flip(0))
        mask = pair.leaf("kq_mask", mt, (SM_KV, 8, planes), mv)
    if with_sinks:
        sinks = pair.leaf("sinks", F32, (SM_H,), torch.randn(SM_H), buffer="weights")
    ours = ops.soft_max_ext(kq[0], mask[0], scale, max_bias, sinks=sinks[0])
    theirs = pair.g.ggml_soft_max_ext(pair.ctx, kq[1], mask[1], scale, max_bias)
    if with_sinks:
        pair.g.ggml_soft_max_add_sinks(theirs, sinks[1])
    pair.out("sm", ours, theirs)
    o, t = pair.ours()["sm"], pair.theirs()["sm"]
    assert rel(o, t) <= 1e-6, rel(o, t)
    if max_bias:  # the slopes matter: without them the result is another one
        plain = ref.soft_max(pair.values[0][2].view(1, SM_H, SM_Q, SM_KV), pair.values[1][2].view(1, planes, 8, SM_KV),
                             None, scale, 0.0)
        assert rel(plain, t) > 1e-2


def test_soft_max_refuses_nothing_it_models():
    """ALiBi is implemented (the slopes of ggml-cpu), so the only SOFT_MAX without a kernel is none."""
    kq = ops.new_tensor("kq", F32, (8, 2, 4), buffer="input")
    mask = ops.new_tensor("m", F32, (8, 2), buffer="input")
    assert kernel(TORCH_BACKEND, ops.soft_max_ext(kq, mask, 1.0, 8.0)) is not None


# ---------------------------------------------------------------------------------------------------------------------
# FLASH_ATTN_EXT
# ---------------------------------------------------------------------------------------------------------------------

# (id, DK, DV, H, H_kv, n_q, n_kv, kv type, extras): qwen35's shape at a tiny size (GQA 2:1, f16 cache, causal f16
# mask after a prompt), attention sinks, logit softcapping, ALiBi, 64 query rows (ggml-cpu's tiled path), an f32 K/V,
# DV != DK, one query row (a decode), n_kv_max set
FA_CASES = [
    ("qwen35", 32, 32, 4, 2, 4, 64, F16, {}),
    ("sinks", 32, 32, 4, 2, 4, 64, F16, {"sinks": True}),
    ("softcap", 32, 32, 4, 1, 3, 40, F16, {"softcap": 5.0}),
    ("alibi", 16, 16, 4, 4, 3, 40, F16, {"max_bias": 8.0}),
    ("tiled-64-rows", 16, 16, 2, 1, 64, 96, F16, {}),
    ("f32-kv", 16, 16, 2, 1, 5, 40, F32, {}),
    ("dv-differs", 32, 16, 2, 2, 3, 40, F16, {}),
    ("one-row", 64, 64, 4, 2, 1, 64, F16, {"n_kv_max": 32}),
]


def _fa_pair(P: Pair, case):
    _, DK, DV, H, Hkv, n_q, n_kv, kvt, ex = case
    kv_size, first = n_kv + 16, n_kv - n_q - 8
    torch.manual_seed(DK + n_q)
    q = P.leaf("q", F32, (DK, H, n_q), torch.randn(n_q * H * DK))
    kc = P.leaf("cache_k", kvt, (DK * Hkv, kv_size), torch.randn(kv_size * Hkv * DK), buffer="cache")
    vc = P.leaf("cache_v", kvt, (DV * Hkv, kv_size), torch.randn(kv_size * Hkv * DV), buffer="cache")
    rows = n_q + (-n_q) % 8
    mv = _causal(n_kv, rows, first)
    if ex.get("max_bias"):
        mv = torch.where(torch.isinf(mv), mv, -torch.arange(n_kv, dtype=torch.float32).flip(0) / 4)
    mask = P.leaf("kq_mask", F16, (n_kv, rows), mv)
    sinks = P.leaf("sinks", F32, (H,), torch.randn(H), buffer="weights") if ex.get("sinks") else (None, None)
    es = kvt.size

    def views(view_4d, permute, t_q, t_k, t_v):  # build_attn_mha: q, and get_k / get_v of the cache, permuted
        k = view_4d(t_k, (DK, Hkv, n_kv, 1), es * DK, es * DK * Hkv, es * DK * Hkv * kv_size)
        v = view_4d(t_v, (DV, Hkv, n_kv, 1), es * DV, es * DV * Hkv, es * DV * Hkv * kv_size)
        return permute(t_q), permute(k), permute(v)

    oq, ok, ov = views(lambda t, ne, *nb: ops.view_4d(t, ne, *nb, 0),
                       lambda t: ops.permute(t, 0, 2, 1, 3), q[0], kc[0], vc[0])
    ours = ops.prec_set_acc(ops.flash_attn_ext(oq, ok, ov, mask[0], 0.2, ex.get("max_bias", 0.0),
                                               ex.get("softcap", 0.0), sinks=sinks[0],
                                               n_kv_max=ex.get("n_kv_max", 0)), Prec.F32)
    g, ctx = P.g, P.ctx
    tq, tk, tv = views(lambda t, ne, *nb: g.ggml_view_4d(ctx, t, *ne, *nb, 0),
                       lambda t: g.ggml_permute(ctx, t, 0, 2, 1, 3), q[1], kc[1], vc[1])
    theirs = g.ggml_flash_attn_ext(ctx, tq, tk, tv, mask[1], 0.2, ex.get("max_bias", 0.0), ex.get("softcap", 0.0))
    g.ggml_flash_attn_ext_set_prec(theirs, g.GGML_PREC_F32)
    if ex.get("sinks"):
        g.ggml_flash_attn_ext_add_sinks(theirs, sinks[1])
    if ex.get("n_kv_max"):
        g.ggml_flash_attn_ext_set_n_kv_max(theirs, ex["n_kv_max"])
    P.out("fa", ours, theirs)


@pytest.mark.parametrize("case", FA_CASES, ids=[c[0] for c in FA_CASES])
def test_flash_attn_ext_matches_ggml(pair, case):
    if case[8].get("n_kv_max") and not hasattr(pair.g, "ggml_flash_attn_ext_set_n_kv_max"):
        case = (*case[:8], {})
    _fa_pair(pair, case)
    theirs = pair.theirs()["fa"]
    cpu, f32 = rel(pair.ours(GGML_CPU_BACKEND)["fa"], theirs), rel(pair.ours(TORCH_BACKEND)["fa"], theirs)
    assert pair.outs["fa"][0].ne == tuple(int(x) for x in pair.outs["fa"][1].contents.ne)
    assert cpu <= 1e-6, cpu
    assert f32 <= 5e-3, f32
    if case[7] is F16 and case[5] < 64:  # the one-chunk path: f16 Q and accumulator, modelled by the CPU form only
        assert f32 > 100 * cpu, (f32, cpu)
    else:  # tiled path / f32 K and V: f32 on the CPU too
        assert f32 <= 1e-6, f32


def test_flash_attn_ext_precisions_the_cpu_does_not_run_are_refused():
    q = ops.new_tensor("q", F32, (16, 3, 2), buffer="input")
    k = ops.new_tensor("k", F16, (16, 8, 1), buffer="cache")
    fa = ops.flash_attn_ext(q, k, k, None, 0.25)
    assert kernel(TORCH_BACKEND, fa) is not None
    assert kernel(TORCH_BACKEND, ops.prec_set_acc(fa, Prec.F32)) is not None
    assert kernel(TORCH_BACKEND, ops.prec_set_acc(fa, Prec.F16)) is None


# ---------------------------------------------------------------------------------------------------------------------
# f16 / bf16 sources: GET_ROWS (token embedding), MUL_MAT (weights, and the non-flash attention's f16 KV views)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wt", [F16, BF16], ids=["f16", "bf16"])
def test_half_sources_match_ggml(pair, wt):
    torch.manual_seed(11)
    w = pair.leaf("token_embd.weight", wt, (32, 50), torch.randn(50 * 32), buffer="weights")
    tok = pair.leaf("inp_tokens", I32, (6,), torch.tensor([3, 49, 0, 3, 17, 8]))
    x = pair.leaf("x", F32, (32, 5, 2), torch.randn(320))
    pair.out("get_rows", ops.get_rows(w[0], tok[0]), pair.g.ggml_get_rows(pair.ctx, w[1], tok[1]))
    pair.out("mul_mat", ops.mul_mat(w[0], x[0]), pair.g.ggml_mul_mat(pair.ctx, w[1], x[1]))
    theirs = pair.theirs()
    for backend in (TORCH_BACKEND, GGML_CPU_BACKEND):
        ours = pair.ours(backend)
        assert exact(ours["get_rows"], theirs["get_rows"])
    assert rel(pair.ours(GGML_CPU_BACKEND)["mul_mat"], theirs["mul_mat"]) <= 1e-6
    f32 = rel(pair.ours(TORCH_BACKEND)["mul_mat"], theirs["mul_mat"])
    assert 1e-5 < f32 <= 2e-2, f32  # ggml-cpu rounds x to the weight type; the f32 semantics do not


# ---------------------------------------------------------------------------------------------------------------------
# a qwen35 attention block, as tests/test_ops.py builds it with both constructors (support.attention_block)
# ---------------------------------------------------------------------------------------------------------------------


def _block_values(graph: Graph, flash: bool) -> dict[str, torch.Tensor]:
    """Inputs as llama.cpp sets them for T tokens after a prompt of 20, random weights and caches."""
    first = 20
    vals: dict[str, torch.Tensor] = {}
    for t in graph.leafs:
        g = torch.Generator().manual_seed(sum(map(ord, t.name)))
        if t.name == "inp_pos":
            p = torch.arange(first, first + T)
            v = torch.cat([p, p, p, torch.zeros_like(p)])
        elif t.name == "attn_inp_k_idxs":
            v = torch.arange(first, first + T)
        elif t.name == "attn_inp_v_idxs":  # flash: one cell per token; else one id per element of the V^T cache
            v = torch.arange(first, first + T) if flash else torch.tensor(
                [c + j * KV for c in range(first, first + T) for j in range(HD * NKV)])
        elif t.name == "attn_inp_kq_mask":
            v = _causal(KV, T, first)
        elif t.name == "out_ids":
            v = torch.tensor([T - 1])
        elif t.type in (I32, I64):
            raise AssertionError(f"no value for {t.name}")
        else:
            v = torch.randn(t.nelements, generator=g) * (t.ne[0] ** -0.5 if t.buffer == "weights" else 1.0)
            if t.name.endswith("norm.weight"):
                v = v + 1.0
        vals[t.name] = v.reshape(-1)
    return vals


@pytest.mark.parametrize("flash", [True, False], ids=["flash-attn", "soft-max"])
def test_qwen35_attention_block_matches_ggml(flash):
    ours = IrCalls()
    attention_block(ours, flash)
    g = ours.g
    vals = _block_values(g, flash)
    s = fg.GgmlSession()
    try:
        attention_block(GgmlCalls(s), flash)
        s.allocate()
        imp = s.import_graph()
        assert fg.diff_graphs(g, imp.graph) == []
        for t in imp.graph.leafs:
            if not t.is_empty:
                s.write(imp.ptr(t), vals[t.name].to(TORCH_DTYPES[t.type]))
        s.compute()
        last = [i for i, n in enumerate(g.nodes) if n.op is Op.GET_ROWS][-1]  # the out_ids row of the FFN output
        caches = [t.name for t in g.leafs if t.name.startswith("cache_")]
        theirs = {"out": s.read(imp.ptr(imp.graph.nodes[last]))}
        theirs.update({c: s.read(imp.ptr(c)) for c in caches})
    finally:
        s.close()
    alloc.plan(g, 32)
    seen = {op_label(n) for n in g.nodes if runs_kernel(n)}
    assert {"ROPE", "SET_ROWS", "UNARY(SIGMOID)", "GLU(SWIGLU)"} <= seen
    assert ({"FLASH_ATTN_EXT"} if flash else {"SOFT_MAX", "CONT"}) <= seen
    errs = {}
    for name, backend in (("cpu", GGML_CPU_BACKEND), ("f32", TORCH_BACKEND)):
        ex = Executor(g, backend=backend)
        ex.buffers[ex.arena].fill_(0xFF)
        for t in g.leafs:
            if not t.is_empty:
                ex.view(t).copy_(vals[t.name].to(TORCH_DTYPES[t.type]).reshape(ex.view(t).shape))
        ex.run()
        for c in caches:  # the K/V stores: f16 roundings of the same f32 values (the f16 weights' products differ)
            assert rel(ex.read(c), theirs[c]) <= (1e-6 if name == "cpu" else 5e-2), c
        errs[name] = rel(ex.read(g.nodes[last]), theirs["out"])
    assert errs["cpu"] <= 1e-5, errs  # f16 weights: an ulp of f32 may flip an f16 rounding of x (see the module doc)
    assert errs["f32"] <= 5e-2, errs


# ---------------------------------------------------------------------------------------------------------------------
# llama.cpp's own verify graph, executed
# ---------------------------------------------------------------------------------------------------------------------

SETTINGS = dict(n_tokens=4, n_rs_seq=3, n_ubatch=8, n_batch=8)


@pytest.fixture(scope="session")
def qwen35_gguf(tmp_path_factory) -> Path:
    from gdnpass.models.gguf_write import write_gguf

    return write_gguf("tiny-qwen35", tmp_path_factory.mktemp("attn") / "tiny-qwen35.gguf")


_CAPTURES: dict[tuple, object] = {}


def _capture(llama, path: Path, **kw):
    from gdnpass.frontends.llama import capture

    key = (str(path), tuple(sorted(kw.items())))
    if key not in _CAPTURES:
        _CAPTURES[key] = capture.capture(path, capture.Settings(**SETTINGS, record_memory=True, **kw), install=llama)
    return copy.deepcopy(_CAPTURES[key])


def replay(cap, path: Path, backend: dict) -> Executor:
    """An Executor of the captured verify graph holding what llama.cpp's memory held when the verify began: the
    recorded compute and cache buffers, the weights read from the file (by name, each at its leaf's offset, which is
    its offset in the file's data section: llama.cpp maps the file)."""
    from gguf import GGUFReader

    from gdnpass.kernels.quants import held_rows

    g = cap.verify
    ex = Executor(g, backend=backend)
    assert set(cap.memory) == {n for n in g.buffers if n != "weights"}, sorted(cap.memory)
    for name, data in cap.memory.items():
        assert len(data) == g.buffers[name]
        ex.buffers[name][: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    reader = GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    weights = [t for t in g.leafs if t.buffer == "weights"]
    assert weights and all(t.view_src is None for t in weights)
    for t in weights:
        rt = by_name[t.name]
        assert int(rt.data_offset) == reader.data_offset + t.offset, t.name  # the mapped file, from its data section
        raw = np.ascontiguousarray(rt.data).reshape(-1).view(np.uint8)
        assert raw.size == t.nbytes, t.name
        value = held_rows(torch.from_numpy(raw.copy()).view(-1, t.type.row_bytes(t.ne[0])), t.type)  # (as loaded)
        ex.buffers["weights"][t.offset: t.offset + raw.size].copy_(value.reshape(-1))
    return ex


def _logits(cap) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(cap.logits, dtype=np.float32).copy()).reshape(-1, cap.n_vocab)


@pytest.mark.parametrize("flash", ["on", "off"])
def test_captured_qwen35_verify_logits_match_llama_cpp(llama, qwen35_gguf, flash):
    cap = _capture(llama, qwen35_gguf, flash_attn=flash)
    g = cap.verify
    ops_run = {op_label(n) for n in g.nodes if runs_kernel(n)}
    assert {"ROPE", "SET_ROWS", "GATED_DELTA_NET", "GET_ROWS"} <= ops_run
    assert ("FLASH_ATTN_EXT" in ops_run) == (flash == "on") and ("SOFT_MAX" in ops_run) == (flash == "off")
    want = _logits(cap)
    assert want.shape == (SETTINGS["n_tokens"], cap.n_vocab) and torch.isfinite(want).all()
    errs = {}
    for name, backend in (("cpu", GGML_CPU_BACKEND), ("f32", TORCH_BACKEND)):
        ex = replay(cap, qwen35_gguf, backend)
        ex.run()
        got = ex.read(g.find("result_output")).reshape(want.shape)
        errs[name] = rel(got, want)
    assert errs["cpu"] <= 1e-4, errs
    assert errs["f32"] <= 1e-3, errs


def test_llama_cpp_s_inputs_are_the_ones_gdnpass_reconstructs(llama, qwen35_gguf):
    """What the recorded compute buffer holds at the graph inputs: the ubatch's positions (M-RoPE: t = h = w, e = 0),
    cells, causal mask, output rows and state copy, as gdnpass.models.inputs sets them for its own whole forward; the
    token ids are the capture's. Only the caches (the prompt's K/V and recurrent states) need the recording."""
    from gdnpass.frontends.llama import capture

    cap = _capture(llama, qwen35_gguf, flash_attn="on")
    ex = replay(cap, qwen35_gguf, TORCH_BACKEND)
    n_t, p0 = SETTINGS["n_tokens"], cap.settings["n_prompt"]
    _, tokens = capture.Settings(**SETTINGS).tokens()
    n_kv = cap.verify.find("attn_inp_kq_mask").ne[0]
    want = {"inp_tokens": [x % cap.n_vocab for x in tokens],
            "inp_pos": list(range(p0, p0 + n_t)) * 3 + [0] * n_t,
            "attn_inp_k_idxs": list(range(p0, p0 + n_t)), "attn_inp_v_idxs": list(range(p0, p0 + n_t)),
            "attn_inp_kq_mask": _causal(n_kv, n_t, p0).reshape(-1).tolist(),
            "out_ids": list(range(n_t)), "rs_s_copy": [0]}
    for name, values in want.items():
        assert ex.read(name).reshape(-1).double().tolist() == [float(v) for v in values], name
    # the generate loop's writer (gdnpass.models.inputs) writes the same values for this ubatch
    from gdnpass.models.gguf_model import open_model
    from gdnpass.models.inputs import input_values

    cfg = open_model(qwen35_gguf).config(n_tokens=n_t, n_kv=n_kv, kv_size=max(n_kv, cap.settings["n_ctx"]),
                                         n_past=p0, flash_attn=True)
    ours = input_values(cfg, tokens=want["inp_tokens"])
    for name, values in want.items():
        assert ours[name].tolist() == values, name


@pytest.mark.parametrize("flash", ["on", "off"])
def test_every_node_of_the_captured_verify_matches_llama_cpp(llama, qwen35_gguf, flash):
    """Node by node against the bytes llama.cpp's nodes held just after each ran, each node fed llama.cpp's own
    inputs (after a node runs, its bytes are set to llama.cpp's): every op of the verify graph is checked alone.
    Data movement, ADD/MUL/SCALE, RMS_NORM (double sum) and SSM_CONV: bit for bit; the rest within 1e-6."""
    cap = _capture(llama, qwen35_gguf, flash_attn=flash, record_nodes=True)
    g = cap.verify
    ex = replay(cap, qwen35_gguf, GGML_CPU_BACKEND)
    bitwise = {"GET_ROWS", "SET_ROWS", "CPY", "CONT", "CONCAT", "ADD", "MUL", "SCALE", "RMS_NORM", "SSM_CONV"}
    worst: dict[str, float] = {}
    for i, n in enumerate(g.nodes):
        if not runs_kernel(n):
            continue
        fn = kernel(ex.kernels, n)
        assert fn is not None, f"node {i} {n.name!r}: no kernel for {op_label(n)}"
        fn(n, [ex.view(s) if s is not None else None for s in [*n.src, *n.outs]], ex.view(n))
        assert i in cap.node_data, f"node {i} {n.name!r}: llama.cpp's bytes were not recorded"
        raw = torch.frombuffer(bytearray(cap.node_data[i]), dtype=TORCH_DTYPES[n.type])
        theirs = raw.as_strided(tuple(reversed(n.ne)), tuple(x // n.type.size for x in reversed(n.nb)), 0)
        ours = ex.view(n)
        label = op_label(n)
        if label in bitwise:
            assert exact(ours, theirs), f"node {i} {n.name!r} ({label}) is not bit-identical to llama.cpp's"
        else:
            worst[label] = max(worst.get(label, 0.0), rel(ours, theirs))
        ours.copy_(theirs)  # the next nodes read llama.cpp's bytes
    assert all(v <= 1e-6 for v in worst.values()), worst
    assert {"ROPE", "MUL_MAT", "GATED_DELTA_NET"} <= set(worst) | bitwise
    assert ("FLASH_ATTN_EXT" in worst) == (flash == "on") and ("SOFT_MAX" in worst) == (flash == "off")
