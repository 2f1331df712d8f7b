"""The quantized weights in the kernels: GET_ROWS of quantized rows and the mat-vec reading ggml's blocks (Q8_0, Q4_K,
Q5_K, Q6_K), against the torch reference (:func:`gdnpass.kernels.quants.dequantize`, itself bit for bit ggml's). The
decoded values are exact, so GET_ROWS is compared bit for bit; the products within the f32 tolerance of the plain
types' tests (the sums' order is the kernel's), and a pair / a product with its residual ADD byte-identical to the
single product, as for the plain types."""

from __future__ import annotations

import pytest
import torch

from gdnpass import ops, prepasses
from gdnpass.errors import KernelError
from gdnpass.ir import DType, Op
from gdnpass.kernels import backends
from gdnpass.kernels import reference as ref
from gdnpass.kernels import triton_core as core
from gdnpass.kernels import triton_elementwise as elt
from gdnpass.kernels import triton_matvec as mv
from gdnpass.kernels.quants import (dequantize, file_rows, held_rows, mul_mat_q, quantize_x, quantize_x_ggml_cpu,
                                    random_blocks)
from gdnpass.launches import node_launches
from support.arena import DEVICE, Arena, assert_close, rnd
from support.compare import assert_bits, assert_same_bytes

QTYPES = [t for t in DType if t.is_quantized]


def _weights(a: Arena, dtype: DType, rows: int, K: int, seed: int = 0) -> torch.Tensor:
    """Random ``dtype`` rows as gdnpass holds them (quants.held_rows), in the arena; quants' own functions take
    them as the file has them (quants.file_rows)."""
    g = torch.Generator().manual_seed(seed)
    return a.put(held_rows(random_blocks(rows, K, dtype, g, 0.05), dtype).view(1, 1, rows, -1).to(DEVICE))



@pytest.mark.parametrize("dtype", QTYPES, ids=lambda t: t.label)
def test_get_rows_of_quantized_rows_are_the_references_bits(dtype):
    """Token embeddings: rows of a quantized matrix by id (repeated, out of order), in two batches (e1 = 2), rows of
    two programs (512 elements)."""
    a = Arena()
    K, rows = 512, 7
    w = a.put(torch.cat([_weights(a, dtype, rows, K, s) for s in (1, 2)], dim=1))  # (1, e1 = 2, rows, bytes)
    ids = a.put(torch.tensor([[3, 0, 6, 3], [1, 1, 5, 2]], dtype=torch.int32, device=DEVICE).view(1, 1, 2, 4))
    out = a.view((1, 2, 4, K))
    a.run(lambda: elt.get_rows(w, ids, out, dtype), out)
    assert_bits(out, ref.get_rows(w, ids, dtype), "GET_ROWS of quantized rows")
    assert_bits(out[0, 1, 2], dequantize(file_rows(w[0, 1, 5], dtype), dtype), "row 5 of batch 1")


def _rounding_bound(wd: torch.Tensor, x: torch.Tensor, group: int) -> torch.Tensor:
    """What the activations' int8 rounding may cost each output of x · wdᵀ: Σ_k |wd[r, k]| · step(k) / 2, with step
    amax / 127 of k's group of activations (q8_1's 32 for Q8_0, q8_K's 256 for the K-quants), plus 1% (f32)."""
    amax = x.double().unflatten(-1, (-1, group)).abs().amax(-1, keepdim=True)
    step = (amax / 127).expand(*amax.shape[:-1], group).flatten(-2)
    return 1.01 * (step @ wd.abs().transpose(-1, -2)) / 2


@pytest.mark.parametrize("dtype", QTYPES, ids=lambda t: t.label)
@pytest.mark.parametrize("n", [1, 3, 16])
def test_mul_mat_vec_reads_quantized_blocks(dtype, n):
    """The mat-vec on the blocks (the activations' int8 blocks from the pre-pass, each group's integer dot on the
    tensor cores, exact: ggml-cpu's q8_K numerics for the K-quants, mmvq's q8_1 for Q8_0): within f32 summation
    accuracy of its reference
    (quants.mul_mat_q, f64 sums) at the tiles mat_vec_tile gives (thin rows; wide rows; K split, one slice empty),
    at a small M (the interpreter pays per program); the exact product of the dequantized weight within what the
    activations' int8 rounding may cost (:func:`_rounding_bound`); the pair byte-identical to the single products;
    the tickets zero after."""
    M, K = (8, 512) if n == 1 else (40, 768)  # thin (alpha/beta) and wide; rows not a multiple of the tile
    tile = mv.mat_vec_tile(M if n == 1 else 4096, n, K, dtype.label)
    if n == 16:
        tile = tile._replace(split_k=4)
    a = Arena(1 << 24)
    w, w2 = _weights(a, dtype, M, K, 1), _weights(a, dtype, M, K, 2)
    x = a.put(rnd(1, 1, n, K), row_stride=K + 32)  # activation columns with gaps
    y, y2, p, p2 = (a.view((1, 1, n, M)) for _ in range(4))
    a.run(lambda: (mv._mat_vecs([(w, y)], x, tile, dtype=dtype), mv._mat_vecs([(w2, y2)], x, tile, dtype=dtype),
                   mv._mat_vecs([(w, p), (w2, p2)], x, tile, dtype=dtype)), y, y2, p, p2)
    for got, v in ((y, w), (y2, w2)):
        assert_close(got, mul_mat_q(file_rows(v, dtype), x, dtype), rtol=1e-5)
        wd = dequantize(file_rows(v, dtype), dtype).double()
        exact = x.double() @ wd.transpose(-1, -2)
        slack = _rounding_bound(wd, x, 32 if dtype is DType.Q8_0 else 256) + 1e-5 * float(exact.abs().max())
        assert ((got.double() - exact).abs() <= slack).all(), float(((got.double() - exact).abs() / slack).max())
    assert_same_bytes(p, y, "pair, first product")
    assert_same_bytes(p2, y2, "pair, second product")
    _, tickets = core._SPLIT_WORKSPACE.get(w.device, (None, torch.zeros(1)))
    assert not tickets.any(), "tickets left non-zero"


@pytest.mark.parametrize("K", [96, 800])
def test_q8_0_rows_of_any_whole_groups_are_read_split(K):
    """Q8_0 rows of 3 and 25 groups (not whole K steps of 256; rows not on 16 bytes): the held rows' scales lie after
    the row's K quants, wherever K ends (quants.held_rows). The mat-vec, unsplit and in 2 K slices, within f32
    summation accuracy of the reference on the file's bytes; GET_ROWS the reference's bits."""
    dtype, M, n = DType.Q8_0, 24, 3
    a = Arena(1 << 22)
    w = _weights(a, dtype, M, K, 4)
    x = a.put(rnd(1, 1, n, K))
    tile = mv.mat_vec_tile(M, n, K, dtype.label)
    ys = [a.view((1, 1, n, M)) for _ in range(2)]
    a.run(lambda: [mv._mat_vecs([(w, y)], x, tile._replace(split_k=s), dtype=dtype) for y, s in zip(ys, (1, 2))], *ys)
    for y in ys:
        assert_close(y, mul_mat_q(file_rows(w, dtype), x, dtype), rtol=1e-5)
    ids = a.put(torch.tensor([5, 0, 23], dtype=torch.int32, device=DEVICE).view(1, 1, 1, 3))
    out = a.view((1, 1, 3, K))
    a.run(lambda: elt.get_rows(w, ids, out, dtype), out)
    assert_bits(out[0, 0], dequantize(file_rows(w[0, 0, [5, 0, 23]], dtype), dtype), "rows 5, 0, 23")


@pytest.mark.parametrize("dtype, K", [(DType.Q8_0, 512), (DType.Q6_K, 2048)], ids=["q8_0", "q6_k"])
def test_scales_loaded_a_step_at_once_are_the_per_group_forms_bytes(dtype, K):
    """Held-split rows on 16 bytes, of whole K steps, load a step's 16 bytes of scales a row at once (Q8_0's 8 f16,
    Q6_K's 16 int8; Q8_0 then masks no group: mv.aligned_rows); the same bytes 2 bytes off take 16-bit loads (Q8_0's
    per-group form). The products byte-identical, unsplit and in 2 K slices (each launch checked to take the form it
    should). (Q6_K's rows are on 16 bytes from K = 2048: 1680 bytes.)"""
    M, n = 24, 3
    a = Arena(1 << 22)
    w = _weights(a, dtype, M, K, 5)
    off = a.view((1, 1, 1, w.numel() + 2), torch.uint8)[..., 2:].view(w.shape).copy_(w)
    assert mv.aligned_rows(dtype, K, w) and not mv.aligned_rows(dtype, K, off)
    x = a.put(rnd(1, 1, n, K))
    tile = mv.mat_vec_tile(M, n, K, dtype.label)
    for s in (1, 2):
        y, y_off = a.view((1, 1, n, M)), a.view((1, 1, n, M))
        a.run(lambda: [mv._mat_vecs([(v, o)], x, tile._replace(split_k=s), dtype=dtype)
                       for v, o in ((w, y), (off, y_off))], y, y_off)
        assert_same_bytes(y_off, y, f"the per-group form, {s} K slice(s)")


def test_a_view_of_part_of_q8_0_rows_is_refused():
    """Held Q8_0 rows keep their scales after their K quants, so a view of a row's first blocks would read quants as
    scales: the mat-vec and GET_ROWS refuse it by name (the file's blocks allowed it)."""
    a = Arena(1 << 20)
    w = _weights(a, DType.Q8_0, 8, 512)
    half = w[..., :DType.Q8_0.row_bytes(256)]
    with pytest.raises(KernelError, match="mul_mat_vec: Q8_0 rows are read whole"):
        mv.mul_mat_vec(half, a.put(rnd(1, 1, 2, 256)), a.view((1, 1, 2, 8)), DType.Q8_0)
    ids = a.put(torch.tensor([1, 2], dtype=torch.int32, device=DEVICE).view(1, 1, 1, 2))
    with pytest.raises(KernelError, match="GET_ROWS: Q8_0 rows are read whole"):
        elt.get_rows(half, ids, a.view((1, 1, 2, 256)), DType.Q8_0)


def test_activation_groups_round_halves_away_from_zero():
    """quantize_x: d = amax / 127 per group of 32, q = roundf(x / d): x = 127 makes d 1, so halves stay halves."""
    x = torch.zeros(2, 64)
    x[0, :5] = torch.tensor([127.0, 2.5, -2.5, 0.49999997, -3.5])
    q, d, s = quantize_x(x)
    assert q[0, 0, :5].tolist() == [127, 3, -3, 0, -4]
    assert d.tolist() == [[1.0, 0.0], [0.0, 0.0]] and not q[0, 1].any() and not q[1].any()  # amax 0: q 0
    assert s[0, 0] == x[0, :32].sum()


@pytest.mark.parametrize("dtype", [DType.Q8_0, DType.Q6_K], ids=lambda t: t.label)
def test_mul_mat_vec_add_on_quantized_blocks_is_the_product_plus_the_addend(dtype):
    """MUL_MAT_ADD's kernel on a quantized weight: the bytes of the single product's, then the f32 ADD."""
    M, K, n = 16, 512, 3
    a = Arena(1 << 24)
    w = _weights(a, dtype, M, K)
    x, r = a.put(rnd(1, 1, n, K)), a.put(rnd(1, 1, n, M))
    y, s = a.view((1, 1, n, M)), a.view((1, 1, n, M))
    a.run(lambda: (mv.mul_mat_vec(w, x, y, dtype), mv.mul_mat_vec_add(w, x, r, s, dtype)), y, s)
    assert_bits(s, y + r, "product + addend")


@pytest.mark.parametrize("dtype", QTYPES, ids=lambda t: t.label)
def test_a_32_column_launch_is_the_16_column_launches_bytes(dtype):
    """One launch of 17-32 columns reads the weight once for two chunks of the activation workspace: each column's
    bytes are those of the 16-column launch that holds it (every sum is the column's own), on a split tile; and
    within f32 summation accuracy of the reference."""
    M, K, n = 24, 512, 27
    tile = mv.mat_vec_tile(4096, n, K, dtype.label)._replace(split_k=2)
    assert tile.cols == 32
    a = Arena(1 << 24)
    w = _weights(a, dtype, M, K, 3)
    x = a.put(rnd(1, 1, n, K))
    y, lo, hi = a.view((1, 1, n, M)), a.view((1, 1, 16, M)), a.view((1, 1, n - 16, M))
    a.run(lambda: (mv._mat_vecs([(w, y)], x, tile, dtype=dtype),
                   mv._mat_vecs([(w, lo)], x[:, :, :16], tile._replace(cols=16), dtype=dtype),
                   mv._mat_vecs([(w, hi)], x[:, :, 16:], tile._replace(cols=16), dtype=dtype)), y, lo, hi)
    assert_same_bytes(y[:, :, :16], lo, "columns 0..15")
    assert_same_bytes(y[:, :, 16:], hi, "columns 16..26")
    assert_close(y, mul_mat_q(file_rows(w, dtype), x, dtype), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("wtype", [t.label for t in QTYPES] + ["bf16"])
def test_the_weights_l2_prefetch_changes_no_byte(wtype):
    """The weights' L2 prefetch (MatVecTile.early: a program's first K steps asked for before its wait) is a hint: at
    every count, 0 (none) to past the slice's end, on a split tile with a short last row block, a pair, and
    MUL_MAT_ID (which asks for none: its matrix is known after the wait), the bytes are those without it; and no
    prefetch faults."""
    if not core.PREFETCH_SUPPORTED:
        pytest.skip("no L2 bulk prefetch here (below sm_90, or GDN_PREFETCH=0)")
    M, K, n, experts = 200, 4096, 4, 3  # (200 rows: a short last row block; 4 K slices)
    dtype = DType.parse(wtype)
    g = torch.Generator().manual_seed(5)
    if dtype.is_quantized:
        ws = [held_rows(random_blocks(M, K, dtype, g, 0.05), dtype).view(1, 1, M, -1).cuda() for _ in range(experts)]
    else:
        ws = [(torch.randn(1, 1, M, K, generator=g) / 64).to(torch.bfloat16).cuda() for _ in range(experts)]
    x = torch.randn(1, 1, n, K, generator=g).cuda()
    stack = torch.cat(ws, dim=1)  # (1, experts, M, row): MUL_MAT_ID's experts
    ids = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32, device="cuda").view(1, 1, 2, 2)
    xid = torch.randn(1, 2, 2, K, generator=g).cuda()
    q = dtype if dtype.is_quantized else None

    def run(early: int, on: bool) -> list[torch.Tensor]:
        tile = mv.mat_vec_tile(4096, n, K, wtype)._replace(split_k=4, early=early)
        y, p, p2, yid = (torch.full(s, float("nan"), device="cuda") for s in
                         ((1, 1, n, M), (1, 1, n, M), (1, 1, n, M), (1, 2, 2, M)))
        with core.l2_prefetch(on):
            mv._mat_vecs([(ws[0], y)], x, tile, dtype=q)
            mv._mat_vecs([(ws[0], p), (ws[1], p2)], x, tile, dtype=q)
            mv.mul_mat_id(stack, xid, ids, yid, q)
        torch.cuda.synchronize()
        return [y, p, p2, yid]

    plain = run(0, False)
    for early, on in ((1, True), (4, True), (16, True), (4, False)):
        for got, want, what in zip(run(early, on), plain, ("mat-vec", "pair 1", "pair 2", "MUL_MAT_ID")):
            assert_same_bytes(got, want, f"{wtype} {what}, {early} K steps asked of the L2 early, on={on}")


def test_quantized_launch_refusals():
    a = Arena()
    w = _weights(a, DType.Q4_K, 8, 256)
    x, y = a.put(rnd(1, 1, 1, 256)), a.view((1, 1, 1, 8))
    with pytest.raises(KernelError, match="q4_k weights are given as their bytes"):
        mv.mul_mat_vec(w.view(torch.int8), x, y, DType.Q4_K)
    with pytest.raises(KernelError, match="q4_k weights need the tensor-core form"):
        mv._mat_vecs([(w, y)], x, mv.MatVecTile(16, 4, 32, True, 4), dtype=DType.Q4_K)
    with pytest.raises(KernelError, match="8 or 16 columns for 1"):  # (a chunk the pre-pass never wrote)
        mv._mat_vecs([(w, y)], x, mv.mat_vec_tile(4096, 1, 256, "q4_k")._replace(cols=32), dtype=DType.Q4_K)
    with pytest.raises(KernelError, match="8 or 16 columns for 1"):  # (narrower than the sum's 8: _group_dots)
        mv._mat_vecs([(w, y)], x, mv.mat_vec_tile(4096, 1, 256, "q4_k")._replace(cols=4), dtype=DType.Q4_K)
    with pytest.raises(KernelError, match="mul_mat_vec of torch.uint8 weights"):
        mv.mul_mat_vec(w, x, y)  # bytes without their type


def _workspace_activations(acts: torch.Tensor, K: int):
    """The pre-pass's workspace (triton_core.activation_bytes) as q [16 columns, K] int8 (each group's 32 bytes as they
    lie) and its f32 / i32 words."""
    q = acts[:16 * K].view(K // 32, 16, 32).transpose(0, 1).reshape(16, K).view(torch.int8)
    return q, acts[16 * K:mv.activation_bytes(K)].view(torch.int32)


def test_k_quant_activations_are_ggml_cpus_q8_K_blocks():
    """The K-quants' pre-pass against quants.quantize_x_ggml_cpu bit for bit: q, d per block of 256, the quants' sums
    per group of 32; a tie of magnitudes (the first wins: -3 before 3), halves rounding to even, an all-zero block,
    strided columns, and the columns past N zero."""
    K, n = 512, 3
    a = Arena(1 << 22)
    x = rnd(1, 1, n, K)
    x[0, 0, 0, :2] = torch.tensor([-30.0, 30.0])                     # a tie: the first is max
    x[0, 0, 1, 256:] = 0.0                                           # an all-zero block
    x[0, 0, 2, 256:260] = torch.tensor([-127.0, 2.5, 3.5, -2.5])     # iscale 1: halves to even
    x = a.put(x, row_stride=K + 32)
    q_ref, d_ref = quantize_x_ggml_cpu(x.reshape(n, K).cpu(), DType.Q4_K)
    acts = mv.quantize_activations(x, DType.Q4_K, K, n, (n, 1, K + 32, n * (K + 32), n * (K + 32)))
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    q, words = _workspace_activations(acts.cpu(), K)
    d = words[:16 * (K // 256)].view(torch.float32).view(K // 256, 16).t()
    sums = words[16 * (K // 256):16 * (K // 256 + K // 32)].view(K // 32, 16).t()
    assert torch.equal(q[:n].to(torch.int16), q_ref) and not q[n:].any()
    assert torch.equal(d[:n].double(), d_ref[:, ::256]) and not d[n:].any()
    assert torch.equal(sums[:n], q_ref.view(n, -1, 32).sum(-1).int()) and not sums[n:].any()
    assert q_ref[0, :2].tolist() == [-127, 127] and d[1, 1] == 0 and d[2, 1] == 1
    assert q_ref[2, 256:260].tolist() == [-127, 2, 4, -2]


def test_q8_0_activations_are_q8_1_groups():
    """The Q8_0 pre-pass against quants.quantize_x bit for bit: q and d per group of 32; an odd number of groups (K
    not a multiple of 256), a group of zeros, strided columns, and the columns past N zero."""
    K, n = 544, 3
    groups = K // 32
    a = Arena(1 << 22)
    x = rnd(1, 1, n, K)
    x[0, 0, 1, 64:96] = 0.0                                           # a group of zeros: q 0, d 0
    x = a.put(x, row_stride=K + 32)
    q_ref, d_ref, _ = quantize_x(x.reshape(n, K).cpu())
    acts = mv.quantize_activations(x, DType.Q8_0, K, n, (n, 1, K + 32, n * (K + 32), n * (K + 32)))
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    q, words = _workspace_activations(acts.cpu(), K)
    d = words[:16 * groups].view(torch.float32).view(groups, 16).t()
    assert torch.equal(q[:n].view(n, groups, 32).to(torch.int16), q_ref)
    assert torch.equal(d[:n], d_ref) and d[1, 2] == 0 and not q[1, 64:96].any()
    assert not q[n:].any() and not d[n:].any()


@pytest.mark.parametrize("swapped", [False, True], ids=["gate-up", "up-gate"])
def test_q8_0_pair_glu_hands_on_the_glu_pre_pass_bytes(swapped):
    """A Q8_0 pair with SwiGLU's epilogue handing its output on (pair_glu, a producer of gdnpass.prepasses): y the
    bytes of the unfused pair and GLU, and the hand-off workspace the bytes the next Q8_0 product's pre-pass of y
    writes, every word of it (q8_1 groups of the 16 columns: the padding columns' zeros; M = 96: a short last row
    block, its rows past M no group), into its own slot while the pair read its activations in the other; the
    product after it reads them there as if its pre-pass had run."""
    M, K, n = 96, 512, 3
    tile = mv.mat_vec_tile(M, n, K, "q8_0", products=2)
    assert tile.split_k > 1 and tile.block_m == 64 and tile.cols == 16  # (the epilogue's scope: pair-glu.tile)
    a = Arena(1 << 24)
    w, w2, down = _weights(a, DType.Q8_0, M, K, 1), _weights(a, DType.Q8_0, M, K, 2), _weights(a, DType.Q8_0, 8, M, 3)
    x = a.put(rnd(1, 1, n, K))
    p, p2, want, y = (a.view((1, 1, n, M)) for _ in range(4))
    z_pre, z_hand = a.view((1, 1, n, 8)), a.view((1, 1, n, 8))
    saved = {}

    def run():
        mv.mul_mat_vec_pair(w, w2, x, p, p2, DType.Q8_0)
        elt.glu("SWIGLU", p, p2, swapped, want)
        mv.mul_mat_vec(down, want, z_pre, DType.Q8_0)  # (its pre-pass of the GLU's y)
        saved["pre"] = core._ACTIVATION_WORKSPACE[x.device, core.FILL_SLOT][:mv.activation_bytes(M)].clone()
        mv.mul_mat_vec_pair_glu(w, w2, x, y, swapped, DType.Q8_0, quantize="q8_1")
        saved["hand"] = core._ACTIVATION_WORKSPACE[x.device, core.HAND_OFF_SLOT][:mv.activation_bytes(M)].clone()
        with prepasses.skipping():
            mv.mul_mat_vec(down, y, z_hand, DType.Q8_0)

    a.run(run, p, p2, want, y, z_pre, z_hand)
    assert_same_bytes(y, want, "the pair's SwiGLU")
    assert torch.equal(saved["hand"].cpu(), saved["pre"].cpu()), "the hand-off is not the pre-pass's bytes"
    assert_same_bytes(z_hand, z_pre, "the product reading the hand-off")


@pytest.mark.parametrize("split_k", [1, 2], ids=["unsplit", "split2"])
def test_q8_0_chain_hands_on_the_pre_pass_bytes(split_k):
    """A Q8_0 product with a chain in its store (MUL_MAT_CHAIN: the GDN's z gate, SILU then RMUL by the normed
    output) handing its output on: out the chain's bytes, and the hand-off the bytes the next Q8_0 product's pre-pass
    of out writes, on an unsplit tile (every program stores its rows) and a split one (the last of a row block)."""
    M, K, n = 96, 512, 3
    tile = mv.mat_vec_tile(M, n, K, "q8_0")._replace(split_k=split_k)
    a = Arena(1 << 24)
    w, down = _weights(a, DType.Q8_0, M, K, 4), _weights(a, DType.Q8_0, 8, M, 5)
    x, side = a.put(rnd(1, 1, n, K)), a.put(rnd(1, 1, n, M))
    want, y, z = a.view((1, 1, n, M)), a.view((1, 1, n, M)), a.view((1, 1, n, 8))
    epilogue = mv.Epilogue(("SILU", "RMUL"), (side,))
    saved = {}

    def run():
        mv._mat_vecs([(w, want)], x, tile, epilogue, DType.Q8_0)
        mv.mul_mat_vec(down, want, z, DType.Q8_0)  # (its pre-pass of the chain's output)
        saved["pre"] = core._ACTIVATION_WORKSPACE[x.device, core.FILL_SLOT][:mv.activation_bytes(M)].clone()
        mv._mat_vecs([(w, y)], x, tile, epilogue, DType.Q8_0, hand_off="q8_1")
        saved["hand"] = core._ACTIVATION_WORKSPACE[x.device, core.HAND_OFF_SLOT][:mv.activation_bytes(M)].clone()

    a.run(run, want, y, z)
    assert_same_bytes(y, want, "the chain's output")
    assert torch.equal(saved["hand"].cpu(), saved["pre"].cpu()), "the hand-off is not the pre-pass's bytes"


@pytest.mark.gpu
def test_gpu_q8_0_pair_glu_hands_on_at_the_ffn_shape():
    """Compiled, at qwen3.5-9b's FFN gate / up shape with its model tile, every mat-vec width, 5 launches each:
    whichever program of a row block draws the last ticket hands its rows on, and the hand-off is the bytes the GLU
    kernel writes for the down product (y too); tickets zero after."""
    M, K = 12288, 4096
    g = torch.Generator().manual_seed(7)
    w, w2 = (held_rows(random_blocks(M, K, DType.Q8_0, g, 0.05), DType.Q8_0).view(1, 1, M, -1).cuda()
             for _ in range(2))
    size = mv.activation_bytes(M)
    for n in range(1, 17):
        x = torch.randn(1, 1, n, K, generator=g).cuda()
        p, p2, want, y = (torch.full((1, 1, n, M), float("nan"), device="cuda") for _ in range(4))
        mv.mul_mat_vec_pair(w, w2, x, p, p2, DType.Q8_0)
        elt.glu("SWIGLU", p, p2, False, want, quantize="q8_1")
        made = core._ACTIVATION_WORKSPACE[x.device, core.FILL_SLOT][:size].clone()
        for _ in range(5):
            y.fill_(float("nan"))
            stale = core._ACTIVATION_WORKSPACE.get((x.device, core.HAND_OFF_SLOT))
            if stale is not None:  # (bytes that are no hand-off: each launch writes every word it hands on)
                stale.fill_(0xAB)
            mv.mul_mat_vec_pair_glu(w, w2, x, y, dtype=DType.Q8_0, quantize="q8_1")
            assert_same_bytes(y, want, f"the pair's SwiGLU at {n} columns")
            assert torch.equal(core._ACTIVATION_WORKSPACE[x.device, core.HAND_OFF_SLOT][:size], made), \
                f"the hand-off at {n} columns"
    assert not core._SPLIT_WORKSPACE[w.device][1].any(), "tickets left non-zero"


def test_a_hand_off_refuses_what_it_cannot_hand_on():
    """An epilogue hands on q8_1 only, from a tile of whole groups of one chunk's columns, of a SwiGLU pair or a
    single product."""
    a = Arena(1 << 22)
    w, w2 = _weights(a, DType.Q8_0, 64, 256, 1), _weights(a, DType.Q8_0, 64, 256, 2)
    x, y = a.put(rnd(1, 1, 2, 256)), a.view((1, 1, 2, 64))
    with pytest.raises(KernelError, match="hands on q8_1 groups"):
        mv.mul_mat_vec_pair_glu(w, w2, x, y, dtype=DType.Q8_0, quantize="q8_K")
    tile = mv.mat_vec_tile(64, 2, 256, "q8_0", products=2)
    with pytest.raises(KernelError, match="hands on q8_1 groups"):
        mv._mat_vecs([(w, y), (w2, y)], x, tile._replace(block_m=48), dtype=DType.Q8_0, glu=1, hand_off="q8_1")
    with pytest.raises(KernelError, match="hands on q8_1 groups"):  # (a pair without its SwiGLU: two outputs)
        mv._mat_vecs([(w, y), (w2, a.view((1, 1, 2, 64)))], x, tile, dtype=DType.Q8_0, hand_off="q8_1")


@pytest.mark.parametrize("x_ne,chunks", [((256, 40), 2), ((256, 16), 0), ((256, 5, 4), 0)],
                         ids=["40-columns", "16-columns", "20-columns-over-ne2"])
def test_a_quantized_product_over_16_columns_runs_the_mat_vec_per_32(monkeypatch, x_ne, chunks):
    """TRITON_BACKEND's MUL_MAT of a quantized weight with more columns than the mat-vec takes, all in ne1, runs it
    once per 32 columns (limits.mul_mat_path's "chunks": a spy on the launcher), each launch its pre-pass and the
    mat-vec: the launch count and the programs follow, and the result is the reference's. Columns over ne2 (or 16 at
    most) are not chunked: torch's reference, or one mat-vec."""
    dtype, M, K = DType.Q8_0, 24, 256
    n = ops.mul_mat(ops.new_tensor("w", dtype, (K, M), buffer="weights"),
                    ops.new_tensor("x", DType.F32, x_ne, buffer="input"))
    calls = []
    real = mv.mul_mat_vec
    monkeypatch.setattr(mv, "mul_mat_vec", lambda *args, **kw: (calls.append(args[1].shape[2]), real(*args, **kw)))
    a = Arena(1 << 22)
    w = _weights(a, dtype, M, K, 1)
    x = a.put(rnd(*reversed((*x_ne, 1, 1)[:4])))
    y = a.view((*x.shape[:3], M))
    a.run(lambda: backends.TRITON_BACKEND[Op.MUL_MAT](n, [w, x], y), y)
    assert_close(y, mul_mat_q(file_rows(w, dtype), x, dtype), rtol=1e-5)
    cols = x.shape[0] * x.shape[1] * x.shape[2]
    if chunks:
        assert calls == [32, 8] and node_launches(n) == 2 * chunks
        progs = backends.programs(n)
        assert [k for k, *_ in progs] == ["quantize_x", "mat_vec"] * chunks
        assert [p for k, p, _ in progs if k == "quantize_x"] == [32 * (K // 256), 16 * (K // 256)]  # a column a program
    else:
        assert calls == ([cols] if cols <= 16 else []) and node_launches(n) == (2 if cols <= 16 else 1)
