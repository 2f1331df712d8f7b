"""The GEMM (triton_matvec.mul_mat_gemm: MUL_MAT of over 16 columns of an f16 / bf16 weight) vs the torch reference
and a float64 product (the interpreter on CPU, small grids; compiled at qwen3.5-9b's shapes on a GPU), its bytes run
to run, its scope and what routes to it.

Tolerance. bf16 weights: x is split exactly into three bf16 terms (24 significant bits), each bf16 x bf16 product is
exact in f32, so only the f32 accumulation rounds, as the reference's own sum does. f16 weights: the weight tile in
f32 and an f32 (ieee) dot, f32 rounding. So both agree with f64 at f32 level: the interpreter's numpy dots round
each add (observed ~1e-7 of the largest magnitude at K 200), and :data:`F32_RTOL` holds there; compiled, the tensor
cores' accumulation does not round to nearest, so the mat-vec's tensor-core tolerance (tests/kernels/
test_kernels.py: 1e-4, through the same ``assert_close``) is the GEMM's too (:data:`RTOL`).
"""

import pytest
import torch

from gdnpass import ops
from gdnpass.errors import KernelError
from gdnpass.ir import DType, Op
from gdnpass.kernels import backends
from gdnpass.kernels import reference as ref
from gdnpass.kernels import triton_core as core
from gdnpass.kernels import triton_matvec as mv
from gdnpass.kernels.limits import MAT_VEC_COLS
from gdnpass.launches import node_launches
from support.arena import Arena, assert_close, rnd
from support.compare import assert_same_bytes

RTOL = 1e-4      # the mat-vec's tensor-core form's (compiled: the MMA's accumulation truncates)
F32_RTOL = 1e-5  # f32 rounding (the interpreter: each add rounded to nearest)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def f64(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().transpose(-1, -2)).float()


# (M, K, columns as (n3, n2, n1), tile): rows not a multiple of BLOCK_M, K not of BLOCK_K; 17, 33 and 100 columns,
# the last over x's ne2 / ne3 with gaps between rows; None: the model tile of the shape (gemm_tile); K split in 2 and
# in 4 (200 = 64 + 64 + 64 + 8: the last slice short)
CASES = [(100, 200, (1, 1, 17), None), (300, 130, (1, 1, 33), None), (70, 72, (2, 5, 10), None),
         (100, 200, (1, 3, 23), mv.GemmTile(32, 32, 32, 4)),  # several row blocks and column tiles
         (100, 200, (1, 3, 23), mv.GemmTile(32, 32, 32, 4, split_k=2)),
         (40, 200, (1, 1, 20), mv.GemmTile(16, 16, 32, 4, 1, split_k=4))]


@pytest.mark.parametrize("wtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("M,K,cols,tile", CASES,
                         ids=["17cols", "33cols", "100cols-strided", "small-tile", "split-2", "split-4"])
def test_gemm_matches_the_reference_and_f64(wtype, M, K, cols, tile):
    """Against the reference and f64 (f32-level, see the module's docstring), every output element written and no
    byte outside, the same bytes on a second run; x's columns with gaps (rows K + 24 apart), over ne1..ne3, and an
    output with gaps between its rows."""
    a = Arena(1 << 24)
    w = a.put(rnd(1, 1, M, K).to(wtype))
    x = a.put(rnd(*cols, K), row_stride=K + 24)
    y, again = a.view((*cols, M), row_stride=M + 8), a.view((*cols, M))
    assert cols[0] * cols[1] * cols[2] > MAT_VEC_COLS
    a.run(lambda: (mv.mul_mat_gemm(w, x, y, tile), mv.mul_mat_gemm(w, x, again, tile)), y, again)
    assert_close(y, ref.mul_mat(w, x), rtol=RTOL)
    assert_close(y, f64(w, x), rtol=RTOL if not core.INTERPRETED else F32_RTOL)
    assert_same_bytes(again, y, "second run")


def test_gemm_refuses_what_it_does_not_run():
    """One-line KernelErrors: f32 weights (torch's matmul), a batched weight, an output on its input."""
    a = Arena()
    x = a.put(rnd(1, 1, 20, 64))
    with pytest.raises(KernelError, match="mul_mat_gemm of f32 weights"):
        mv.mul_mat_gemm(a.put(rnd(1, 1, 8, 64)), x, a.view((1, 1, 20, 8)))
    with pytest.raises(KernelError, match="one weight matrix"):
        mv.mul_mat_gemm(a.put(rnd(1, 2, 8, 64).bfloat16()), a.put(rnd(1, 2, 20, 64)), a.view((1, 2, 20, 8)))
    with pytest.raises(KernelError, match="overlaps an input"):
        mv.mul_mat_gemm(a.put(rnd(1, 1, 8, 64).bfloat16()), x, x[..., :8])


def _mul_mat(wtype: DType, w_ne, x_ne):
    w = ops.new_tensor("w", wtype, w_ne, buffer="weights")
    return ops.mul_mat(w, ops.new_tensor("x", DType.F32, x_ne, buffer="input"))


@pytest.mark.parametrize("wtype,w_ne,x_ne,gemm", [
    (DType.BF16, (64, 40), (64, 17), True), (DType.F16, (64, 40), (64, 4, 5), True),  # 20 columns over ne2
    (DType.BF16, (64, 40), (64, 16), False),  # the mat-vec's
    (DType.F32, (64, 40), (64, 17), False),   # torch's matmul: an f32 weight needs no conversion
    (DType.BF16, (64, 40, 2), (64, 17, 2), False),  # batched (attention's KQ / KQV): torch's matmul
], ids=["bf16-17", "f16-4x5", "bf16-16", "f32-17", "batched"])
def test_the_triton_backend_runs_wide_products_on_the_gemm(monkeypatch, wtype, w_ne, x_ne, gemm):
    """TRITON_BACKEND's MUL_MAT takes the GEMM exactly where limits.runs_as_gemm says (a spy on the launcher), with
    the reference's result; its cost estimate (programs) and launch count follow: one launch of the tile's grid."""
    n = _mul_mat(wtype, w_ne, x_ne)
    calls = []
    real = mv.mul_mat_gemm
    monkeypatch.setattr(mv, "mul_mat_gemm", lambda *args, **kw: (calls.append(args[1].shape), real(*args, **kw)))
    a = Arena()
    torch_type = {DType.BF16: torch.bfloat16, DType.F16: torch.float16, DType.F32: torch.float32}[wtype]
    w = a.put(rnd(*reversed((*w_ne, 1, 1)[:4])).to(torch_type))
    x = a.put(rnd(*reversed((*x_ne, 1, 1)[:4])))
    y = a.view((*x.shape[:3], w.shape[2]))
    a.run(lambda: backends.TRITON_BACKEND[Op.MUL_MAT](n, [w, x], y), y)
    assert_close(y, ref.mul_mat(w, x), rtol=RTOL)
    assert len(calls) == int(gemm)
    progs = backends.programs(n)
    terms = gemm and wtype is DType.BF16  # (a bf16 weight's GEMM first splits x into its bf16 terms)
    assert node_launches(n) == 1 + terms
    if gemm:
        N = x.shape[0] * x.shape[1] * x.shape[2]
        t = mv.gemm_tile(40, N, 64, wtype.label)
        assert progs == [("gemm_terms", N, 1)] * terms + [
            ("gemm", t.split_k * -(-40 // t.block_m) * -(-N // t.block_n), -(-64 // (t.block_k * t.split_k)))]
    else:
        assert all(k != "gemm" for k, *_ in progs)


def test_the_terms_pre_pass_is_its_reference_byte_for_byte():
    """The bf16 GEMM's operand: x's three bf16 terms, exactly as torch rounds them (head + middle + tail == x), over
    columns with gaps between rows and across ne2, at magnitudes from 1e-30 to 1e30 and K past a program's block.
    (Not subnormals: the interpreter converts subnormal f32 to bf16 wrongly; a term that small is below every
    tolerance of the product.)"""
    a = Arena(1 << 24)
    x = rnd(1, 3, 7, mv.GEMM_TERMS_BLOCK + 40)
    x[0, 0, 0, :64] = torch.logspace(-30, 30, 64)
    x = a.put(x, row_stride=x.shape[-1] + 24)
    terms = a.view((1, 3, 21, x.shape[-1]), dtype=torch.bfloat16)
    a.run(lambda: mv.gemm_terms(x, terms), terms)
    want = mv.gemm_terms_reference(x)
    assert_same_bytes(terms[0], want, "terms")
    assert torch.equal(want.float().sum(0), x.reshape(21, -1))  # (exact: each addition is)


@pytest.mark.parametrize("wtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_a_pair_and_a_residual_beyond_16_columns_are_the_single_gemms_bytes(wtype):
    """MUL_MAT_VEC_PAIR and MUL_MAT_ADD over 16 columns run the GEMM with a second product on its grid / with the
    residual added at its store: each pair product byte-identical to its single GEMM, the sum to the single GEMM's
    product then the ADD's one rounding, in place on the addend too."""
    from gdnpass.kernels import reference as ref

    a = Arena()
    w, w2 = (a.put(rnd(1, 1, 40, 64).to(wtype)) for _ in range(2))
    x = a.put(rnd(1, 1, 20, 64))
    r = a.put(rnd(1, 1, 20, 40))
    y, y2, p, p2, s = (a.view((1, 1, 20, 40)) for _ in range(5))
    tile = mv.GemmTile(16, 16, 32, 4, 1, split_k=2)  # (row blocks, column tiles and K slices on a small product)
    residual = mv.Epilogue(("ADD",), (r,))
    a.run(lambda: (mv.mul_mat_gemm(w, x, y, tile), mv.mul_mat_gemm(w2, x, y2, tile),
                   mv.mul_mat_gemm(w, x, p, tile, second=(w2, p2)), mv.mul_mat_gemm(w, x, s, tile, epilogue=residual)),
          y, y2, p, p2, s)
    assert_same_bytes(p, y, "pair, first product")
    assert_same_bytes(p2, y2, "pair, second product")
    assert_same_bytes(s, ref.add(y, r), "product + residual")
    in_place = r.clone()
    mv.mul_mat_gemm(w, x, r, tile, epilogue=residual)
    assert_same_bytes(r, ref.add(y, in_place), "product + residual, in place")
    with pytest.raises(KernelError, match="second weight and output must be laid out as the first"):
        mv.mul_mat_gemm(w, x, p, tile, second=(w2[..., :32], p2))
    # the pair's and MUL_MAT_ADD's launchers take this route beyond 16 columns (their production tile)
    mv.mul_mat_gemm(w, x, y)
    mv.mul_mat_gemm(w2, x, y2)
    mv.mul_mat_vec_pair(w, w2, x, p, p2)
    mv.mul_mat_vec_add(w, x, in_place, s)
    assert_same_bytes(p, y, "mul_mat_vec_pair, first product")
    assert_same_bytes(p2, y2, "mul_mat_vec_pair, second product")
    assert_same_bytes(s, ref.add(y, in_place), "mul_mat_vec_add")


# ---- compiled, at qwen3.5-9b's shapes -------------------------------------------------------------------------------

NINE_B = {"ffn up/gate 4096 -> 12288": (12288, 4096), "ffn down 12288 -> 4096": (4096, 12288),
          "lm head 248320 x 4096": (248320, 4096)}


@pytest.mark.gpu
@pytest.mark.parametrize("n", [32, 128])
@pytest.mark.parametrize("shape", list(NINE_B), ids=["up", "down", "lm-head"])
def test_gpu_wide_gemm_at_the_9b_shapes(shape, n):
    """Compiled, at 32 (8 sequences x 4 tokens) and 128 columns (32 x 4): within RTOL of f64 (the lm head's on every
    61st row, its f64 copy would take 8 GB), every element written, the same bytes over 10 eager launches and a
    CUDA-graph replay. Prints the kernel time next to the torch reference's (the f32 conversion and matmul)."""
    from gdnpass.bench.timing import kernel_us

    M, K = NINE_B[shape]
    w = (torch.randn(1, 1, M, K, device="cuda") / 64).bfloat16()
    x = torch.randn(1, 1, n, K, device="cuda")
    y = torch.full((1, 1, n, M), float("nan"), device="cuda")
    mv.mul_mat_gemm(w, x, y)
    rows = torch.arange(0, M, 61 if M > 65536 else 1, device="cuda")
    assert_close(y[..., rows], f64(w[:, :, rows], x), rtol=RTOL)
    again = torch.empty_like(y)
    for _ in range(10):
        again.fill_(float("nan"))
        mv.mul_mat_gemm(w, x, again)
        assert_same_bytes(again, y, "eager run")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mv.mul_mat_gemm(w, x, again)
    again.fill_(float("nan"))
    g.replay()
    assert_same_bytes(again, y, "graph replay")
    ours = kernel_us(lambda: mv.mul_mat_gemm(w, x, again))[0]
    theirs = kernel_us(lambda: again.copy_(ref.mul_mat(w, x)))[0]
    print(f"\n{shape}, {n} columns, {mv.gemm_tile(M, n, K, 'bf16')}: gemm {ours:.1f} us, torch reference "
          f"{theirs:.1f} us, weight read at {w.numel() * 2 / ours / 1e3:.0f} GB/s")
