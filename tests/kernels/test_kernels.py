"""Triton kernels vs the torch reference (interpreter on CPU), and the reference vs independent float64 math.

Inputs and outputs are strided views into one uint8 arena, as the executor gives them; outputs are poisoned with NaN
first so an element the kernel forgot to write shows up. Grids stay small: the interpreter pays per program.
"""

import os

import numpy as np
import pytest
import torch

from gdnpass.errors import KernelError
from gdnpass.ir import Op, Unary
from gdnpass.kernels.backends import TORCH_BACKEND, TRITON_BACKEND
from gdnpass.kernels import reference as ref
from gdnpass.kernels import triton_core as core
from gdnpass.kernels import triton_elementwise as elt
from gdnpass.kernels import triton_matvec as mv
from gdnpass.kernels import triton_norms as norms
from gdnpass.kernels import triton_ssm as ssm
from support.compare import assert_bits, assert_same_bytes
from support.arena import DEVICE, Arena, assert_close, node, rnd

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# triton 3.6's interpreter converts runtime loop bounds through a deprecated numpy path
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---- SSM_CONV -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_conv,C,n_t,n_s,block_c", [
    (3, 64, 1, 1, 256), (4, 256, 16, 2, 256), (5, 96, 7, 3, 256), (4, 200, 3, 1, 64), (4, 64, 20, 1, 64),
])
def test_ssm_conv(d_conv, C, n_t, n_s, block_c):
    a = Arena()
    sx = a.put(rnd(1, n_s, C, d_conv - 1 + n_t))
    c = a.put(rnd(1, 1, C, d_conv))
    y = a.view((1, n_s, n_t, C))
    a.run(lambda: ssm.ssm_conv(sx, c, y, block_c=block_c), y)
    assert_close(y, ref.ssm_conv(sx, c))
    if INTERPRETED:  # no FMA contraction there: taps in order, mul then add, is bit-exact
        assert torch.equal(y, ref.ssm_conv(sx, c))


def test_ssm_conv_reference_vs_f64():
    sx, c = rnd(1, 2, 48, 3 + 6).cpu(), rnd(1, 1, 48, 4).cpu()
    s, w = sx.double().numpy()[0], c.double().numpy()[0, 0]
    want = np.stack([np.stack([(s[:, :, t:t + 4] * w).sum(-1) for t in range(6)], 1)])  # (1, n_s, n_t, C)
    np.testing.assert_allclose(ref.ssm_conv(sx, c).numpy(), want, rtol=1e-5, atol=1e-6)


# ---- SiLU -----------------------------------------------------------------------------------------------------------


def test_silu_strided():
    a = Arena()
    x = a.put(rnd(2, 3, 5, 300), row_stride=320)  # rows with gaps
    y = a.view((2, 3, 5, 300))
    a.run(lambda: elt.silu(x, y), y)
    assert_close(y, ref.silu(x))


def test_silu_in_place():
    a = Arena()
    x = a.put(rnd(1, 2, 7, 256) * 4)
    want = ref.silu(x)
    a.run(lambda: elt.silu(x, x), x)
    assert_close(x, want)


# ---- L2_NORM --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("S,H_k,H_v,n_t,n_s", [(32, 2, 4, 3, 2), (64, 1, 2, 16, 1), (128, 2, 2, 2, 2)])
@pytest.mark.parametrize("strided_out", [False, True])
def test_l2_norm_on_conv_views(S, H_k, H_v, n_t, n_s, strided_out):
    """q and k as the real graph reads them: head views of the SiLU output [C, n_t, n_s]."""
    a = Arena()
    C = 2 * S * H_k + S * H_v
    conv = a.put(rnd(1, n_s, n_t, C))
    conv[0, 0, 0, :S] *= 1e-8  # a row below eps: the max(Σx², eps²) branch
    flat = conv.reshape(-1)
    for off in (0, S * H_k):  # q, then k
        x = flat[off:].as_strided((n_s, n_t, H_k, S), (n_t * C, C, S, 1))
        y = a.view((n_s, n_t, H_k, S), row_stride=S + 8 if strided_out else None)
        a.run(lambda: norms.l2_norm(x, 1e-6, y), y)
        assert_close(y, ref.l2_norm(x, 1e-6))


def test_l2_norm_reference_vs_f64():
    x = rnd(1, 3, 4, 64).cpu()
    x[0, 0, 0] *= 1e-9
    xd = x.double().numpy()
    want = xd / np.maximum(np.sqrt((xd * xd).sum(-1, keepdims=True)), 1e-6)
    np.testing.assert_allclose(ref.l2_norm(x, 1e-6).numpy(), want, rtol=1e-6, atol=0)


# ---- RMS_NORM, SCALE (upstream's q/k norm: SCALE(RMS_NORM(x, eps/n), 1/sqrtf(n))) -------------------------------


@pytest.mark.parametrize("S,H_k,H_v,n_t,n_s", [(32, 2, 4, 3, 2), (128, 1, 2, 2, 1)])
@pytest.mark.parametrize("strided_out", [False, True])
def test_rms_norm_on_conv_views(S, H_k, H_v, n_t, n_s, strided_out):
    """q and k as the real graph reads them (head views of the SiLU output), eps = eps/n as the builder sets it.
    Within 2^-20 relative of the reference: the same f32 operations, but the reference sums in torch's order and
    the kernel in sum_sq_rows' fixed pairwise tree (and on a GPU rsqrt is approximate)."""
    from gdnpass.models.hparams import qk_rms_params

    eps, _ = qk_rms_params(1e-6, S)
    a = Arena()
    C = 2 * S * H_k + S * H_v
    conv = a.put(rnd(1, n_s, n_t, C))
    conv[0, 0, 0, :S] *= 1e-6  # mean(x²) below eps
    conv[0, 0, 0, S:2 * S] = 0.0  # Σx² = 0
    flat = conv.reshape(-1)
    for off in (0, S * H_k):  # q, then k
        x = flat[off:].as_strided((n_s, n_t, H_k, S), (n_t * C, C, S, 1))
        y = a.view((n_s, n_t, H_k, S), row_stride=S + 8 if strided_out else None)
        a.run(lambda: norms.rms_norm(x, eps, y), y)
        assert_close(y, ref.rms_norm(x, eps), rtol=2 ** -20)


@pytest.mark.skipif(not INTERPRETED, reason="exact only where rsqrt is 1/sqrt (the interpreter, torch on the CPU)")
def test_rms_norm_exact_when_the_sum_is_exact():
    """Integer rows whose squares sum exactly in f32 in any order: then the kernel and the reference do the same
    operations on the same values (Σ / n, + eps, rsqrt, times x), so the bytes are equal; row lengths 100
    (masked lanes) and 32 (n a power of two)."""
    a = Arena()
    for ne0 in (100, 32):
        x = a.put(torch.randint(-50, 51, (2, 3, 5, ne0), device=DEVICE).float())
        y = a.view(tuple(x.shape))
        a.run(lambda: norms.rms_norm(x, 3.125e-8, y), y)
        assert torch.equal(y, ref.rms_norm(x, 3.125e-8))


def test_rms_norm_in_place():
    a = Arena()
    x = a.put(rnd(1, 2, 7, 64))
    want = ref.rms_norm(x.clone(), 1e-6)
    a.run(lambda: norms.rms_norm(x, 1e-6, x), x)
    assert_close(x, want, rtol=2 ** -20)


def test_rms_norm_reference_vs_f64():
    x = rnd(1, 3, 4, 64).cpu()
    x[0, 0, 0] *= 1e-6
    xd = x.double().numpy()
    want = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + ref.f32(1e-6))
    np.testing.assert_allclose(ref.rms_norm(x, 1e-6).numpy(), want, rtol=1e-6, atol=0)
    # upstream's q/k norm is the L2 direction: x / sqrt(Σx² + eps)
    eps, s = 1e-6 / 64, 64 ** -0.5
    np.testing.assert_allclose(ref.scale(ref.rms_norm(x, eps), s).numpy(),
                               xd / np.sqrt((xd * xd).sum(-1, keepdims=True) + 1e-6), rtol=1e-6, atol=0)


@pytest.mark.parametrize("s,b", [(0.17677669, 0.0), (0.0, 0.0), (0.5, 0.25), (0.3, 0.7)])
def test_scale_strided_and_in_place(s, b):
    """b == 0: x * s, byte-identical (one f32 multiply; -0.0 and NaN kept). b != 0: fma(x, s, b), one rounding on
    the GPU; the interpreter evaluates tl.fma as numpy's x*s + b in f32 (two roundings), so there it is exact only
    where x*s is (s = 0.5) and otherwise within half an ulp of x*s plus half an ulp of the result."""
    a = Arena()
    x = a.put(rnd(2, 3, 5, 300) * 3, row_stride=320)  # rows with gaps
    x[0, 0, 0, :3] = torch.tensor([-0.0, float("nan"), -1.0])
    y = a.view((2, 3, 5, 300))
    a.run(lambda: elt.scale(x, s, b, y), y)
    want = ref.scale(x, s, b)
    if b == 0.0 or s == 0.5 or not INTERPRETED:
        assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y[~y.isnan()], want[~want.isnan()])
        if b == 0.0:
            assert torch.equal(y.view(torch.int32)[~y.isnan()], want.view(torch.int32)[~want.isnan()])  # -0.0
    else:
        ok = ~want.isnan()  # mul-then-add: half an ulp of x*s plus half an ulp of the sum, at most
        bound = 2 ** -23 * (x[ok].abs() * abs(s) + abs(b))
        assert ((y[ok] - want[ok]).abs() <= bound).all()
    view = x[..., 1:, :]  # in place on a view, as build_rs zeroes a cache row
    a.run(lambda: elt.scale(view, 0.0, 0.0, view), view)
    assert (view[~view.isnan()] == 0).all()


# ---- MUL_MAT (mat-vec) ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "broadcast"])
def test_reference_mul_mat_is_the_repeated_weights_product(wtype, layout):
    """The reference multiplies a single weight without repeating it (a copy of the whole f32 weight: 4 GB for the
    9B's lm head, held by every CUDA graph of a wide ubatch), and its bytes are those of the repeated form it had."""
    w = rnd(2, 2, 24, 40).to(wtype)
    if layout == "transposed":  # (attention's K as a permuted view)
        w = rnd(2, 2, 40, 24).to(wtype).transpose(-1, -2)
    x = rnd(2, 2, 20, 40) if layout != "broadcast" else rnd(2, 6, 20, 40)
    old = w.to(torch.float32).repeat_interleave(x.shape[1] // w.shape[1], 1).repeat_interleave(
        x.shape[0] // w.shape[0], 0)
    assert_bits(ref.mul_mat(w, x), x @ old.transpose(-1, -2), f"mul_mat {layout}")


@pytest.mark.parametrize("wtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cols", [(1, 1, 1), (3, 1, 1), (2, 2, 2)])
def test_mul_mat_vec(wtype, cols):
    a = Arena()
    M, K = 96, 200  # K is not a multiple of the K step
    w = a.put(rnd(1, 1, M, K).to(wtype))
    n1, n2, n3 = cols
    x = a.put(rnd(n3, n2, n1, K), row_stride=K + 24)  # activation columns with gaps
    y = a.view((n3, n2, n1, M))
    a.run(lambda: mv.mul_mat_vec(w, x, y), y)
    assert_close(y, ref.mul_mat(w, x))


@pytest.mark.parametrize("what, kv_type, tile", [
    ("KQ f16", torch.float16, None), ("KQV f32", torch.float32, None),
    ("KQ f16, 2 slices", torch.float16, mv.MatVecTile(4, 4, 16, False, 4, 2)),
    ("KQV bf16, tensor cores", torch.bfloat16, mv.MatVecTile(16, 16, 16, True, 4, 1)),
])
def test_mul_mat_vec_batched_as_attention(what, kv_type, tile):
    """Attention's batched MUL_MATs as llama.cpp builds them without flash attention: KQ = K·Q, K a permuted view of
    the KV cache (2 KV heads, cells of 2 heads x 32, more cells than the view reads), Q 4 query heads (GQA: head h
    reads KV head h // 2) over 2 sequences (ne3) of 3 tokens; KQV = V·softmax(KQ) with V a view of a transposed
    cache (rows of cells). One launch per node, batches on a grid axis; against ggml's broadcast semantics."""
    a = Arena()
    n_kv, D, n_t = 40, 32, 3
    if what.startswith("KQ "):  # w ne [D, n_kv, H_kv, 1]: rows of D, cells strided by the cache's row
        cache = a.put(rnd(1, n_kv + 8, 2 * 2, D).to(kv_type))
        w = cache[:, :n_kv, :2].permute(0, 2, 1, 3)                  # (1, H_kv, n_kv, D)
        x = a.put(rnd(2, 3 + 1, 4, D))[:, :n_t].permute(0, 2, 1, 3)  # (2, H, n_t, D), ne3 = 2 streams
        w = w.expand(2, -1, -1, -1)                                  # (the second stream reads the same cache)
        M, K = n_kv, D
    else:  # w ne [n_kv, D, H_kv, 1]: the transposed V cache, rows of cells
        vt = a.put(rnd(1, 2, D + 4, n_kv + 8).to(kv_type))
        w = vt[:, :, :D, :n_kv]                                      # (1, H_kv, D, n_kv)
        x = a.put(rnd(1, 4, n_t, n_kv))                              # (1, H, n_t, n_kv), softmax(KQ)
        M, K = D, n_kv
    y = a.view((x.shape[0], x.shape[1], n_t, M))
    a.run(lambda: mv._mat_vecs([(w, y)], x, tile), y)
    assert_close(y, ref.mul_mat(w, x))
    assert not y.isnan().any()
    if tile is not None and tile.split_k > 1:
        assert not core._SPLIT_WORKSPACE[w.device][1].any(), "tickets left non-zero"
    with pytest.raises(KernelError, match="do not broadcast"):  # 2 KV heads cannot serve 3 query heads
        mv.mul_mat_vec(w, x[:, :3], y[:, :3])


@pytest.mark.parametrize("wtype,n", [(torch.float32, 9), (torch.float16, 9), (torch.bfloat16, 9), (torch.bfloat16, 3)])
def test_mul_mat_vec_tensor_core_form(wtype, n):
    """The tensor-core (DOT) form, which mat_vec_tile picks for wide products with many columns: 3xTF32, or bf16
    weights times the activations as three bf16 terms side by side in one operand (from 4 padded columns: 3 columns
    make a 16-wide operand; in the interpreter the same split on f32 operands). Its sums are not f32 rounding:
    within 1e-4 of the reference; the pair (one launch, one tile) is byte-identical to the two single products. Run
    at a small M with the real model's tile (the interpreter pays per program)."""
    tile = mv.mat_vec_tile(4096 if n > 4 else 8192, n, 4096, mv.WTYPES[wtype])
    assert tile.dot
    M, K = 100, 200  # rows not a multiple of the row tile, K not of the K step, columns not of the tile's
    a = Arena(1 << 24)
    w, w2 = (a.put(rnd(1, 1, M, K).to(wtype)) for _ in range(2))
    x = a.put(rnd(1, 1, n, K))
    y, y2, p, p2 = (a.view((1, 1, n, M)) for _ in range(4))
    a.run(lambda: (mv._mat_vecs([(w, y)], x, tile), mv._mat_vecs([(w2, y2)], x, tile),
                   mv._mat_vecs([(w, p), (w2, p2)], x, tile)), y, y2, p, p2)
    assert_close(y, ref.mul_mat(w, x), rtol=1e-4)
    assert_bits(p, y, "pair, first product")
    assert_bits(p2, y2, "pair, second product")


# small tiles of both forms: a few row blocks (the last one partial) of a product whose K (not a multiple of a
# slice) spans several steps per slice
SPLIT_FORMS = {"dot": (mv.MatVecTile(32, 16, 32, True, 4), 100, 300, 9),
               "dot-one": (mv.MatVecTile(32, 4, 32, True, 4), 100, 300, 3),  # (bf16: the terms in one operand)
               "fma": (mv.MatVecTile(8, 4, 32, False, 4), 36, 300, 3),
               "fma-empty-slice": (mv.MatVecTile(8, 4, 32, False, 4), 36, 80, 3)}  # 4 slices of 32: 32, 32, 16, 0
SPLIT_CASES = [(f, w, s) for f in ("dot", "fma") for w in (torch.float32, torch.bfloat16) for s in (2, 4)]
SPLIT_CASES.append(("dot-one", torch.bfloat16, 4))
SPLIT_CASES.append(("fma-empty-slice", torch.float32, 4))


@pytest.mark.parametrize("form,wtype,split_k", SPLIT_CASES,
                         ids=[f"{f}-{mv.WTYPES[w]}-split{s}" for f, w, s in SPLIT_CASES])
def test_mul_mat_vec_split_k(form, wtype, split_k):
    """Split-K (MatVecTile.split_k): each row block's K slices summed by as many programs into the workspace, the
    last ticket's program adding them in slice order. Accurate (against f64: 1e-4 in the tensor-core form, as above;
    1e-5 in the FMA form), run-to-run identical, the pair byte-identical to the single products, and the tickets zero
    again after every launch (a second launch would otherwise leave y unwritten: NaN)."""
    base, M, K, n = SPLIT_FORMS[form]
    tile = base._replace(split_k=split_k)
    a = Arena(1 << 24)
    w, w2 = (a.put(rnd(1, 1, M, K).to(wtype)) for _ in range(2))
    x = a.put(rnd(1, 1, n, K), row_stride=K + 24)  # activation columns with gaps
    y, again, y2, p, p2 = (a.view((1, 1, n, M)) for _ in range(5))
    a.run(lambda: (mv._mat_vecs([(w, y)], x, tile), mv._mat_vecs([(w, again)], x, tile),
                   mv._mat_vecs([(w2, y2)], x, tile), mv._mat_vecs([(w, p), (w2, p2)], x, tile)), y, again, y2, p, p2)
    for got, v in ((y, w), (y2, w2)):
        assert_close(got, (x.double() @ v.double().transpose(-1, -2)).float(), rtol=1e-4 if tile.dot else 1e-5)
    assert_same_bytes(again, y, "second run")
    assert_same_bytes(p, y, "pair, first product")
    assert_same_bytes(p2, y2, "pair, second product")
    _, tickets = core._SPLIT_WORKSPACE[w.device]
    assert not tickets.any(), "tickets left non-zero"


GLU_CASES = [("dot", torch.bfloat16, 1, False), ("dot-one", torch.bfloat16, 4, True), ("fma", torch.float32, 4, False),
             ("fma-empty-slice", torch.float32, 4, True), ("fma", torch.bfloat16, 1, True)]


@pytest.mark.parametrize("form,wtype,split_k,swapped", GLU_CASES,
                         ids=[f"{f}-{mv.WTYPES[w]}-split{s}{'-swapped' if sw else ''}" for f, w, s, sw in GLU_CASES])
def test_mul_mat_vec_pair_glu_is_the_glu_of_the_pair(form, wtype, split_k, swapped):
    """The pair with SwiGLU's epilogue (one ticket a row block for both products' slices, at split 1 too) writes the
    bytes the GLU kernel makes of the pair's two products, gate and up either way round, and leaves the tickets
    zero (a second launch would otherwise store nothing). The ticket's count is the GPU test's
    (test_gpu_pair_glu_at_the_ffn_shape): in the interpreter's order a wrong one still ends right."""
    base, M, K, n = SPLIT_FORMS[form]
    tile = base._replace(split_k=split_k)
    a = Arena(1 << 24)
    w, w2 = (a.put(rnd(1, 1, M, K).to(wtype)) for _ in range(2))
    x = a.put(rnd(1, 1, n, K), row_stride=K + 24)
    p, p2, want, y, again = (a.view((1, 1, n, M)) for _ in range(5))
    poison = lambda: core.split_workspace(w.device, 1, 1, "test")[0].fill_(float("nan"))  # (no stale partials)
    a.run(lambda: (mv._mat_vecs([(w, p), (w2, p2)], x, tile), elt.glu("SWIGLU", p, p2, swapped, want), poison(),
                   mv._mat_vecs([(w, y), (w2, y)], x, tile, glu=2 if swapped else 1), poison(),
                   mv._mat_vecs([(w, again), (w2, again)], x, tile, glu=2 if swapped else 1)), p, p2, want, y, again)
    # (the GLU kernel's exp is numpy's in the interpreter, torch's compiled: its own bytes only there)
    assert_close(want, ref.swiglu(p2, p) if swapped else ref.swiglu(p, p2), rtol=1e-6)
    assert_same_bytes(y, want, "the pair's SwiGLU")
    assert_same_bytes(again, want, "a second launch")
    assert not core._SPLIT_WORKSPACE[w.device][1].any(), "tickets left non-zero"


@pytest.mark.gpu
@pytest.mark.parametrize("wtype", [torch.float32, torch.bfloat16])
def test_gpu_pair_glu_at_the_ffn_shape(wtype):
    """Compiled, the programs of a row block run concurrently and either product's may draw the last ticket (the
    interpreter runs them in order, which hides a wrong ticket count: the last program's store comes last and is
    right): qwen3.5-9b's FFN gate / up shape at every mat-vec width with its model tile, the GLU kernel's bytes of the
    pair's products over 10 launches each, tickets zero after."""
    M, K = 12288, 4096
    w, w2 = ((torch.randn(1, 1, M, K, device="cuda") / 64).to(wtype) for _ in range(2))
    for n in range(1, 17):
        x = torch.randn(1, 1, n, K, device="cuda")
        p, p2, want, y = (torch.full((1, 1, n, M), float("nan"), device="cuda") for _ in range(4))
        mv.mul_mat_vec_pair(w, w2, x, p, p2)
        elt.glu("SWIGLU", p, p2, False, want)
        for _ in range(10):
            y.fill_(float("nan"))
            mv.mul_mat_vec_pair_glu(w, w2, x, y)
            assert_same_bytes(y, want, f"the pair's SwiGLU at {n} columns")
    assert not core._SPLIT_WORKSPACE[w.device][1].any(), "tickets left non-zero"


def test_mul_mat_vec_pair_glu_refusals():
    """SwiGLU's epilogue is a plain pair's, into one output, at the mat-vec's widths."""
    a = Arena()
    w, w2, x = a.put(rnd(1, 1, 8, 64)), a.put(rnd(1, 1, 8, 64)), a.put(rnd(1, 1, 1, 64))
    y, y2 = a.view((1, 1, 1, 8)), a.view((1, 1, 1, 8))
    with pytest.raises(KernelError, match="into one output"):
        mv._mat_vecs([(w, y), (w2, y2)], x, glu=1)
    with pytest.raises(KernelError, match="not the mat-vec's"):
        mv.mul_mat_vec_pair_glu(w, w2, a.put(rnd(1, 1, 17, 64)), a.view((1, 1, 17, 8)))


@pytest.mark.gpu
@pytest.mark.parametrize("wtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,split_k", [(2, 8), (12, 4)], ids=["fma-split8", "dot-split4"])
def test_gpu_mul_mat_vec_split_k_is_deterministic(wtype, n, split_k):
    """Compiled, the K slices of a row block run concurrently and any of them may draw the last ticket: a real
    shape's split launch (its model tile, split) gives one set of bytes over 20 eager launches and 20 CUDA-graph
    replays, the pair the single products', within tolerance of f64, tickets zero after."""
    M, K = 4096, 4096
    tile = mv.mat_vec_tile(M, n, K, mv.WTYPES[wtype])._replace(split_k=split_k)
    w, w2 = ((torch.randn(1, 1, M, K, device="cuda") / 64).to(wtype) for _ in range(2))
    x = torch.randn(1, 1, n, K, device="cuda")
    y, y2, p, p2 = (torch.full((1, 1, n, M), float("nan"), device="cuda") for _ in range(4))
    mv._mat_vecs([(w, y)], x, tile)
    mv._mat_vecs([(w2, y2)], x, tile)
    mv._mat_vecs([(w, p), (w2, p2)], x, tile)
    assert_close(y, (x.double() @ w.double().transpose(-1, -2)).float(), rtol=1e-4 if tile.dot else 1e-5)
    assert_same_bytes(p, y, "pair, first product")
    assert_same_bytes(p2, y2, "pair, second product")
    again = torch.empty_like(y)
    for _ in range(20):
        again.fill_(float("nan"))
        mv._mat_vecs([(w, again)], x, tile)
        assert_same_bytes(again, y, "eager run")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mv._mat_vecs([(w, again)], x, tile)
    for _ in range(20):
        again.fill_(float("nan"))
        g.replay()
        assert_same_bytes(again, y, "graph replay")
    assert not core._SPLIT_WORKSPACE[w.device][1].any(), "tickets left non-zero"


def _model_tiles():
    """(tile, M, K, N, weight type) of every distinct tile qwen3.5-9b's and -27b's products take at 1-16 columns,
    each with the first (smallest) shape that takes it."""
    import itertools

    from gdnpass.bench.matvec import product_shapes

    shapes = sorted({(p.M * p.K, p.M, p.K) for m in ("qwen3.5-9b", "qwen3.5-27b") for p in product_shapes(m)})
    seen = {}
    for (_, M, K), N, wt in itertools.product(shapes, range(1, 17), (torch.bfloat16, torch.float32)):
        seen.setdefault((mv.mat_vec_tile(M, N, K, mv.WTYPES[wt]), wt), (M, K, N))
    return [(t, *v, wt) for (t, wt), v in seen.items()]


@pytest.mark.gpu
def test_gpu_every_model_tile_launches_and_is_accurate():
    """Every tile the models' products take, launched on the GPU at a real shape (a tile that compiles may still be
    refused at launch, or be wrong only compiled): within tolerance of f64, no element left unwritten, the pair
    byte-identical to its products."""
    failed = []
    for tile, M, K, N, wt in _model_tiles():
        w, w2 = ((torch.randn(1, 1, M, K, device="cuda") / 64).to(wt) for _ in range(2))
        x = torch.randn(1, 1, N, K, device="cuda")
        y, p, p2 = (torch.full((1, 1, N, M), float("nan"), device="cuda") for _ in range(3))
        try:
            mv.mul_mat_vec(w, x, y)
            mv.mul_mat_vec_pair(w, w2, x, p, p2)
        except Exception as e:  # noqa: BLE001 - name every failing tile, not only the first
            failed.append(f"{tile} at {M}x{K}, {N} columns: {type(e).__name__}: {str(e)[:200]}")
            continue
        want = (x.double() @ w.double().transpose(-1, -2))
        err = ((y.double() - want).abs().max() / want.abs().max()).item()
        if not err <= (1e-4 if tile.dot else 1e-5) or not torch.equal(p.view(torch.int32), y.view(torch.int32)):
            failed.append(f"{tile} at {M}x{K}, {N} columns: rel err {err:.1e}, pair equal "
                          f"{torch.equal(p.view(torch.int32), y.view(torch.int32))}")
        del w, w2
    assert not failed, "\n".join(failed)


def test_mul_mat_vec_split_k_refusals(monkeypatch):
    """split_k is a power of two; the workspace never grows inside CUDA-graph capture (checked before allocating, so
    this runs without a GPU)."""
    a = Arena()
    w, x, y = a.put(rnd(1, 1, 8, 64)), a.put(rnd(1, 1, 1, 64)), a.view((1, 1, 1, 8))
    with pytest.raises(KernelError, match="split_k 3"):
        mv._mat_vecs([(w, y)], x, mv.MatVecTile(8, 1, 32, False, 4, split_k=3))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(KernelError, match="CUDA-graph capture"):
        core.split_workspace(torch.device("cuda", 0), 1 << 40, 1, "mul_mat_vec")


# ---- GATED_DELTA_NET ------------------------------------------------------------------------------------------------


def gdn_inputs(a: Arena, S, H_k, H_v, n_t, n_s, per_row_gate):
    """q, k (l2-normed) and v as head views of one [C, n_t, n_s] buffer, as the GDN reads them in the real graph."""
    C = 2 * S * H_k + S * H_v
    qkv = rnd(n_s, n_t, C)
    for off in (0, S * H_k):
        heads = qkv[..., off:off + S * H_k].reshape(n_s, n_t, H_k, S)
        qkv[..., off:off + S * H_k] = ref.l2_norm(heads, 1e-6).flatten(2)
    flat = a.put(qkv.reshape(1, n_s, n_t, C)).reshape(-1)
    q, k, v = (flat[off:].as_strided((n_s, n_t, h, S), (n_t * C, C, S, 1))
               for off, h in ((0, H_k), (S * H_k, H_k), (2 * S * H_k, H_v)))
    g = a.put(rnd(n_s, n_t, H_v, S if per_row_gate else 1, lo=-2.0, hi=-0.01))
    beta = a.put(rnd(n_s, n_t, H_v, 1, lo=0.05, hi=1.0))
    state = a.put(0.1 * rnd(n_s, H_v, S, S))
    return q, k, v, g, beta, state


GDN_CASES = [  # S, H_k, H_v, n_t, n_s, K, per_row_gate
    (32, 1, 1, 1, 1, 1, False),
    (64, 2, 4, 5, 2, 1, False),
    (32, 2, 2, 3, 2, 4, False),   # n_t < K: slot 3 is not written
    (32, 1, 2, 16, 1, 3, True),
    (128, 1, 1, 4, 1, 2, False),
    (64, 2, 4, 1, 2, 4, True),    # one-token decode with K snapshots
    (80, 1, 1, 4, 1, 2, False),   # a head size llama.cpp accepts that is no power of two: rows past 80 masked
    (80, 1, 2, 3, 1, 2, True),
]


@pytest.mark.parametrize("S,H_k,H_v,n_t,n_s,K,per_row_gate", GDN_CASES)
def test_gated_delta_net(S, H_k, H_v, n_t, n_s, K, per_row_gate):
    a = Arena()
    src = gdn_inputs(a, S, H_k, H_v, n_t, n_s, per_row_gate)
    out = a.view((1, 1, n_t * n_s + K * S * n_s, S * H_v))
    want = ref.gated_delta_net(*src, K, out=out)
    a.run(lambda: ssm.gated_delta_net(*src, K, out), out)  # the default tile (GDN_BLOCK_V columns per program)
    n_written = n_t * n_s + min(n_t, K) * S * n_s  # rows: scores, then the slots < n_t
    assert_close(out[..., :n_written, :], want[..., :n_written, :])
    assert out[..., n_written:, :].isnan().all(), "slots >= n_t must keep the old bytes"
    looped = a.view(tuple(out.shape))  # the token loop kept, as for a prompt: the same bytes
    a.run(lambda: ssm.gated_delta_net(*src, K, looped, unrolled=False), looped)
    assert_same_bytes(looped[..., :n_written, :], out[..., :n_written, :], "the looped GDN")
    assert looped[..., n_written:, :].isnan().all(), "the looped GDN: slots >= n_t must keep the old bytes"


@pytest.mark.parametrize("S,H_k,H_v,n_t,n_s,K,per_row_gate", [GDN_CASES[1], GDN_CASES[2], GDN_CASES[5]])
def test_gated_delta_net_snapshots_straight_into_cache_rows(S, H_k, H_v, n_t, n_s, K, per_row_gate):
    """The launcher's ``snapshots``: the states go to a strided destination (cache rows of D + 8 elements, a slot
    every ``cells`` rows, as ggml_view_3d of the recurrent cache) instead of the op's own slots. Byte-identical to
    the slots the op writes itself (the same kernel), the scores too; the rows' padding and the slots >= n_t left
    alone. (The kernel half of GDN writing its snapshots into the cache, upstream's form; the pattern is to come.)"""
    a = Arena()
    src = gdn_inputs(a, S, H_k, H_v, n_t, n_s, per_row_gate)
    D, n_w, cells = S * S * H_v, min(n_t, K), n_s + 1
    out = a.view((1, 1, n_t * n_s + K * S * n_s, S * H_v))
    scores = a.view(tuple(out.shape))
    cache = a.view((1, 1, n_w * cells, D + 8))
    snaps = cache[0, 0].as_strided((1, n_w, n_s, D), (0, cells * (D + 8), D + 8, 1), cache[0, 0].storage_offset())
    a.run(lambda: (ssm.gated_delta_net(*src, K, out), ssm.gated_delta_net(*src, K, scores, snapshots=snaps)),
          out, scores, cache)
    n_scores = n_t * n_s * H_v * S
    assert_same_bytes(scores.reshape(-1)[:n_scores], out.reshape(-1)[:n_scores], "scores")
    own = out.reshape(-1)[n_scores:n_scores + n_w * n_s * D].view(n_w, n_s, D)
    assert_same_bytes(snaps[0], own, "snapshots in the cache rows")
    assert scores.reshape(-1)[n_scores:].isnan().all(), "the op's own slots stay unwritten"
    assert cache[0, 0, :, D:].isnan().all() and cache[0, 0].view(n_w, cells, D + 8)[:, n_s:].isnan().all()
    with pytest.raises(KernelError, match="overlaps an input"):  # a destination over the state it reads
        ssm.gated_delta_net(*src, K, scores, snapshots=src[5].reshape(1, 1, n_s, -1)[..., :D].expand(1, n_w, n_s, D))


@pytest.mark.parametrize("S,H_v,n_t,n_s,per_row_gate,unrolled", [
    (32, 2, 4, 1, False, True),    # a verify: the gates of all tokens at once, a lane each
    (32, 4, 16, 2, False, True),   # all 16 lanes
    (64, 2, 1, 1, False, True),
    (80, 1, 3, 1, False, True),    # rows past the head size masked
    (32, 2, 5, 2, False, False),   # a prompt's loop: a token's gates at a time
    (32, 2, 3, 1, True, True),     # a decay a key row: computed per token, as a vector over the rows
])
def test_gated_delta_net_computes_its_gates_as_their_elementwise_kernels(S, H_v, n_t, n_s, per_row_gate, unrolled,
                                                                          kernel_exp):
    """``g_steps`` / ``beta_steps`` (the gdn_gates pattern): the GDN reads the inputs of the elementwise nodes that
    made its g and beta (Qwen3.5's decay chain ADD dt_bias -> SOFTPLUS -> MUL ssm_a over the alpha product
    [H_v, n_t, n_s], beta's SIGMOID over [1, H_v, n_t, n_s]) and computes them where it reads them: every byte is
    the one the ELEMENTWISE_CHAIN and UNARY kernels then the plain GDN write, and the torch adapter's gates are theirs
    (in the interpreter with the kernels' exp and log: the ``kernel_exp`` fixture)."""
    from gdnpass.patterns.gdn_state_cache.record import _gates

    a = Arena()
    q, k, v, _, _, state = gdn_inputs(a, S, 1, H_v, n_t, n_s, per_row_gate)
    alpha = a.put(rnd(n_s, n_t, H_v, S) if per_row_gate else rnd(1, n_s, n_t, H_v))  # ne [(S,) H_v, n_t, n_s]
    dt_bias = a.put(rnd(1, 1, H_v, 1) if per_row_gate else rnd(1, 1, 1, H_v))  # a bias a head, repeated
    ssm_a = a.put(rnd(*dt_bias.shape, lo=-2.0, hi=-0.1))
    beta_x = a.put(rnd(n_s, n_t, H_v, 1, lo=-3.0, hi=3.0))
    steps, sides = ["ADD", "SOFTPLUS", "MUL"], [dt_bias, ssm_a]
    g_out, b_out = a.view(tuple(alpha.shape)), a.view(tuple(beta_x.shape))
    a.run(lambda: (elt.elementwise_chain(steps, alpha, sides, g_out), elt.unary("SIGMOID", beta_x, b_out)),
          g_out, b_out)
    g = g_out.reshape(n_s, n_t, H_v, S if per_row_gate else 1)
    K = 2
    want, got = (a.view((1, 1, n_t * n_s + K * S * n_s, S * H_v)) for _ in range(2))
    a.run(lambda: ssm.gated_delta_net(q, k, v, g, b_out, state, K, want, unrolled=unrolled), want)
    a.run(lambda: ssm.gated_delta_net(q, k, v, alpha, beta_x, state, K, got, unrolled=unrolled,
                                      g_steps=tuple(steps), g_sides=tuple(sides), beta_steps=("SIGMOID",)), got)
    n_written = n_t * n_s + min(n_t, K) * S * n_s
    assert_same_bytes(got[..., :n_written, :], want[..., :n_written, :], "GDN computing its gates")
    node_ = node(Op.GATED_DELTA_NET, g_steps=steps, beta_steps=["SIGMOID"])
    g_ref, b_ref = _gates(node_, [q, k, v, alpha, beta_x, state, *sides])[3:5]
    assert_same_bytes(g_ref, g, "the torch adapter's decay")
    assert_same_bytes(b_ref, b_out, "the torch adapter's beta")


def test_gated_delta_net_computed_gates_keep_negative_zero():
    """A token's computed gate is picked out of its lane bit for bit: a beta of -0.0 (MUL of +0.0 by -1) stays -0.0,
    so a state of -0.0 times it keeps its sign (a float sum of the lanes would give +0.0: 1568 words differed)."""
    a = Arena()
    S, H_v, n_t = 32, 2, 2
    q, k, v, g, _, _ = gdn_inputs(a, S, 1, H_v, n_t, 1, False)
    state = a.put(torch.full((1, H_v, S, S), -0.0))
    beta_x, minus = a.put(torch.zeros(1, n_t, H_v, 1)), a.put(torch.full((1, 1, 1, 1), -1.0))
    beta = a.view(tuple(beta_x.shape))
    a.run(lambda: elt.mul(beta_x, minus, beta), beta)
    assert (beta.view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).all()
    want, got = (a.view((1, 1, n_t + S, S * H_v)) for _ in range(2))
    a.run(lambda: ssm.gated_delta_net(q, k, v, g, beta, state, 1, want), want)
    a.run(lambda: ssm.gated_delta_net(q, k, v, g, beta_x, state, 1, got, beta_steps=("MUL",), beta_sides=(minus,)),
          got)
    assert_same_bytes(got, want, "GDN with a -0.0 beta computed")


@pytest.mark.parametrize("row", [0, 1, 2])
def test_gated_delta_net_gathers_its_state_from_the_cache_rows(row):
    """``state_ids`` (the gdn_state_gather pattern): the GDN starts from the cache row the ids name, as GET_ROWS into
    the arena then the plain GDN does, byte for byte, the snapshots going to cache rows 0 and 1: with the gathered
    row one of them (rows 0, 1) each program reads its slice before it writes it; row 2 is none of them."""
    a = Arena()
    S, H_v, n_t, K = 32, 2, 3, 2
    q, k, v, g, beta, _ = gdn_inputs(a, S, 1, H_v, n_t, 1, False)
    cache = a.put(0.1 * rnd(1, 3, H_v * S, S))                     # 3 rows of [S, S, H_v]
    ids = a.put(torch.tensor([[[[row]]]], dtype=torch.int32))
    gathered = a.view((1, H_v, S, S))
    a.run(lambda: elt.get_rows(cache.reshape(1, 1, 3, H_v * S * S), ids.reshape(1, 1, 1, 1),
                               gathered.reshape(1, 1, 1, H_v * S * S)), gathered)
    D = S * S * H_v
    snaps = lambda c: c.reshape(-1)[:2 * D].as_strided((1, 2, 1, D), (0, D, D, 1))  # noqa: E731 (rows 0, 1)
    want, got = (a.view((1, 1, n_t, S * H_v)) for _ in range(2))
    after = a.put(cache.clone())
    a.run(lambda: ssm.gated_delta_net(q, k, v, g, beta, gathered, K, want, snapshots=snaps(cache)), want, cache)
    a.run(lambda: ssm.gated_delta_net(q, k, v, g, beta, after.reshape(3, H_v, S, S), K, got, snapshots=snaps(after),
                                      state_ids=ids.reshape(1)), got, after)
    assert_same_bytes(got, want, "scores")
    assert_same_bytes(after, cache, "the cache rows (snapshots written, the rest left)")


def test_gated_delta_net_refuses_snapshots_off_the_gathered_rows():
    """Gathering, snapshot rows that overlap the cache's rows off their row boundaries (half a row on) would have one
    program store into a slice another gathers: refused before launch, named (the matcher's
    ``gather.output-overlaps-input`` refuses it first)."""
    a = Arena()
    S, H_v, n_t = 32, 2, 2
    q, k, v, g, beta, _ = gdn_inputs(a, S, 1, H_v, n_t, 1, False)
    D = S * S * H_v
    cache = a.put(0.1 * rnd(1, 1, 3, D))
    ids = a.put(torch.tensor([[[[1]]]], dtype=torch.int32)).reshape(1)
    out = a.view((1, 1, n_t, S * H_v))
    half_on = cache.reshape(-1)[D // 2:].as_strided((1, 1, 1, D), (0, D, D, 1))
    with pytest.raises(KernelError, match="GATED_DELTA_NET: the output overlaps an input"):
        ssm.gated_delta_net(q, k, v, g, beta, cache[0, 0].unflatten(-1, (H_v, S, S)), 1, out, snapshots=half_on,
                            state_ids=ids)


def test_gated_delta_net_refuses_gate_inputs_it_cannot_index():
    """The kernel reads a gate's input in the operand's shape or flat without its leading 1: any other shape of the
    same elements is refused before launch, named (the gdn_gates matcher's layout rule refuses it first: its trip
    graph ``gdn-gates.layout[input-shape]``)."""
    a = Arena()
    q, k, v, g, beta, state = gdn_inputs(a, 32, 1, 2, 4, 1, False)
    out = a.view((1, 1, 4 + 32, 64))
    with pytest.raises(KernelError, match="GDN gates: g ne \\[4, 2, 1, 1\\]"):
        ssm.gated_delta_net(q, k, v, g.reshape(1, 1, 2, 4), beta, state, 1, out, g_steps=("EXP",))


def test_gated_delta_net_refuses_an_output_over_its_state():
    """Its programs read q, k, v, the gates and the state while others write: an output overlapping any of them is
    refused before launch (gallocr never plans one)."""
    a = Arena()
    q, k, v, g, beta, state = gdn_inputs(a, 32, 1, 1, 2, 1, False)
    out = a.view((1, 1, 2 + 32, 32))  # two score rows, then one slot
    in_out = out.reshape(-1)[-state.numel():].view(state.shape).copy_(state)  # the state in the slot's memory
    with pytest.raises(KernelError, match="GATED_DELTA_NET: the output overlaps an input"):
        ssm.gated_delta_net(q, k, v, g, beta, in_out, 1, out)


def gdn_f64(q, k, v, g, beta, state, K):
    """Independent float64 recurrence on explicit S[i][col] matrices (CUDA's update form), returning
    (scores [n_s, n_t, H_v, S], {slot: states [n_s, H_v, S(col), S(i)]})."""
    q, k, v, g, beta, state = (t.double().numpy() for t in (q, k, v, g, beta, state))
    n_s, n_t, H_v, S = v.shape
    scores, slots = np.zeros(v.shape), {}
    for s in range(n_s):
        for h in range(H_v):
            St = state[s, h].T.copy()  # St[i, col]
            for t in range(n_t):
                kk, qq = k[s, t, h % k.shape[2]], q[s, t, h % q.shape[2]]
                decay = np.exp(g[s, t, h])[:, None]  # (1 or S, 1): per head or per key row i
                delta = (v[s, t, h] - (decay * St).T @ kk) * beta[s, t, h, 0]
                St = decay * St + np.outer(kk, delta)
                scores[s, t, h] = St.T @ qq / np.sqrt(S)
                if n_t - 1 - t < K:
                    slots.setdefault(n_t - 1 - t, np.zeros((n_s, H_v, S, S)))[s, h] = St.T
    return scores, slots


@pytest.mark.parametrize("n_t,K,per_row_gate", [(3, 2, False), (2, 3, True)])
def test_gated_delta_net_reference_vs_f64(n_t, K, per_row_gate):
    S, H_k, H_v, n_s = 8, 1, 2, 2
    src = gdn_inputs(Arena(), S, H_k, H_v, n_t, n_s, per_row_gate)
    got = ref.gated_delta_net(*(t.cpu() for t in src), K).reshape(-1).numpy()
    scores, slots = gdn_f64(*(t.cpu() for t in src), K)
    np.testing.assert_allclose(got[:scores.size], scores.reshape(-1), rtol=1e-5, atol=1e-6)
    for slot, st in slots.items():
        at = scores.size + slot * st.size
        np.testing.assert_allclose(got[at:at + st.size], st.reshape(-1), rtol=1e-5, atol=1e-6)
    assert len(slots) == min(n_t, K) and not got[scores.size + len(slots) * S * S * H_v * n_s:].any()


# ---- reference semantics of the data-movement and elementwise ops ---------------------------------------------------


def test_reference_broadcast_is_tiling():
    a, b = rnd(1, 1, 4, 3), rnd(1, 1, 2, 3)  # ggml ne1 2 -> 4: row i1 uses b row i1 % 2
    torch.testing.assert_close(ref.add(a, b), a + b[:, :, [0, 1, 0, 1]])
    torch.testing.assert_close(ref.mul(a, b[..., :1, :1]), a * b[0, 0, 0, 0])


def test_reference_mul_mat_batch_broadcast():
    w, x = rnd(1, 2, 5, 7).half(), rnd(1, 4, 3, 7)  # x batch i2 uses weight batch i2 // 2
    want = torch.stack([x[0, i] @ w[0, i // 2].float().T for i in range(4)])[None]
    torch.testing.assert_close(ref.mul_mat(w, x), want)


def test_reference_get_rows_concat_cpy():
    a = rnd(2, 3, 5, 4)  # ne [4, 5, 3, 2]
    ids = torch.randint(0, 5, (1, 2, 3, 6), dtype=torch.int32, device=DEVICE)  # ne [6, 3, 2]
    out = ref.get_rows(a, ids)
    assert out.shape == (2, 3, 6, 4) and torch.equal(out[1, 2, 4], a[1, 2, ids[0, 1, 2, 4]])
    b = rnd(2, 3, 5, 2)
    assert torch.equal(ref.concat(a, b, 0)[..., 4:], b)
    src = rnd(1, 1, 6, 4).transpose(-1, -2)  # non-contiguous source
    dst = torch.empty(1, 2, 3, 4, dtype=torch.float16, device=DEVICE)
    got = ref.cpy(src, dst)
    assert got.dtype == torch.float16 and torch.equal(got.reshape(-1), src.reshape(-1).half())


def test_reference_unary_and_norms():
    x = torch.tensor([-30.0, -1.0, 0.5, 21.0], device=DEVICE).view(1, 1, 1, 4)
    torch.testing.assert_close(ref.softplus(x), torch.where(x > 20, x, torch.log1p(torch.exp(x))))
    torch.testing.assert_close(ref.sigmoid(x), torch.sigmoid(x))
    torch.testing.assert_close(ref.silu(x), torch.nn.functional.silu(x))
    torch.testing.assert_close(ref.rms_norm(x, 1e-6), x / x.pow(2).mean().add(1e-6).sqrt())
    torch.testing.assert_close(ref.scale(x, 2.0, 1.0), 2 * x + 1)


# ---- backend tables -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,src_fn,out_shape", [
    (node(Op.SSM_CONV), lambda a: [a.put(rnd(1, 2, 64, 3 + 4)), a.put(rnd(1, 1, 64, 4))], (1, 2, 4, 64)),
    (node(Op.L2_NORM, eps=1e-6), lambda a: [a.put(rnd(2, 3, 4, 32))], (2, 3, 4, 32)),
    (node(Op.RMS_NORM, eps=3.125e-8), lambda a: [a.put(rnd(2, 3, 4, 32))], (2, 3, 4, 32)),
    (node(Op.SCALE, s=0.17677669, b=0.0), lambda a: [a.put(rnd(2, 3, 4, 32))], (2, 3, 4, 32)),
    (node(Op.MUL_MAT), lambda a: [a.put(rnd(1, 1, 40, 64).bfloat16()), a.put(rnd(1, 2, 3, 64))], (1, 2, 3, 40)),
    (node(Op.MUL_MAT), lambda a: [a.put(rnd(1, 1, 40, 64)), a.put(rnd(1, 1, 9, 64))], (1, 1, 9, 40)),  # torch
    (node(Op.UNARY, kind=Unary.SOFTPLUS.value), lambda a: [a.put(rnd(1, 2, 3, 16))], (1, 2, 3, 16)),  # torch
    (node(Op.GATED_DELTA_NET, K=2), lambda a: list(gdn_inputs(a, 32, 1, 2, 3, 1, False)), (1, 1, 3 + 2 * 32, 64)),
], ids=["ssm_conv", "l2_norm", "rms_norm", "scale", "mat_vec", "mul_mat_9cols", "softplus", "gdn"])
def test_triton_backend_matches_torch_backend(n, src_fn, out_shape):
    a = Arena()
    src = src_fn(a)
    want, got = a.view(out_shape), a.view(out_shape)
    TORCH_BACKEND[n.op](n, src, want)
    a.run(lambda: TRITON_BACKEND[n.op](n, src, got), got)
    assert_close(got, want)


@pytest.mark.parametrize("backend", [TORCH_BACKEND, TRITON_BACKEND], ids=["torch", "triton"])
def test_backend_silu_in_place(backend):
    a = Arena()
    x = a.put(rnd(1, 3, 5, 128))
    want = ref.silu(x.clone())
    a.run(lambda: backend[Op.UNARY](node(Op.UNARY, kind=Unary.SILU.value), [x], x), x)
    assert_close(x, want)


def test_torch_backend_writes_through_views():
    """CPY into a strided f16 destination and an in-place SCALE on a view: results land only where the views point."""
    a = Arena()
    dst = a.view((1, 1, 8, 6), torch.float16)[..., ::2, :]  # every other row of an f16 matrix
    src = rnd(1, 1, 6, 4)  # 24 elements, mapped by flat index onto dst's 4 x 6
    a.run(lambda: TORCH_BACKEND[Op.CPY](node(Op.CPY), [src, dst], dst), dst)
    assert torch.equal(dst.reshape(-1), src.reshape(-1).half())
    x = a.put(rnd(1, 1, 3, 5))
    view = x[..., 1:, :]
    a.run(lambda: TORCH_BACKEND[Op.SCALE](node(Op.SCALE, s=0.0, b=0.0), [view], view), view)
    assert (view == 0).all()
