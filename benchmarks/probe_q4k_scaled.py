"""Probe (not yet timed): Q4_K's block sums on the tensor cores, three chained dots a block instead of eight awaited ones.

    python benchmarks/probe_q4k_scaled.py [--shapes 12288x4096,4096x4096,4096x12288] [--cols 1,4,16]

The production kernel (``triton_matvec.matvec_cols_q``) makes each group's int8 dot, awaits it, and adds it times
the group's 6-bit scale into an int32 sum: 8 wgmma round trips a block, each awaited at once (Triton waits on a dot
without a loop-carried accumulator right after it). Here the scale goes into the dot's operand instead: with
sc = 8a + b (a, b < 8) and Q4_K's quants q < 16, a * q and b * q are < 128, so they are int8 and ONE 32-bit multiply
of a register of 4 packed quants by a makes all 4 products (no carry crosses a byte). Then

    Σ_g sc_g · dot(q_g, x_g) = 8 · Σ_g dot(a_g q_g, x_g) + Σ_g dot(b_g q_g, x_g)

are two dots accumulating over the block's 8 groups, and the mins' Σ_g m_g · Σ x_g is a third (the operand m_g in
every byte of the group). The same integers, the same f32 step a block: the bytes are the production kernel's (the
check below compares them, split-K off), so only the time can differ. What the compile for sm_90a says (on the CPU,
ptxas -v): 88 registers against the production kernel's 128 (more programs an SM), 24 dots a block instead of 8 —
and Triton still awaits each wgmma at once (its A operand is in registers; accumulating in a loop does not change
that), so whether the fewer instructions and registers pay for 3x the awaited dots is the GPU's to say. On the CPU the interpreter checks the bytes;
on a GPU the script also times both (profiler kernel durations over a CUDA graph of rotated weight copies, the
mat-vec alone) next to a read of the same bytes. Split-K here adds the slices with atomics (timing only).
"""

from __future__ import annotations

import argparse
import itertools
import torch
import triton
import triton.language as tl

from gdnpass.bench.matvec import column_counts, quantized_weight, read_us, rotation, shape_list
from gdnpass.bench.timing import kernel_us
from gdnpass.ir import DType
from gdnpass.kernels import quants
from gdnpass.kernels import triton_matvec as mv
from gdnpass.kernels.triton_core import INTERPRETED, _scale_min_k4, f16_bits

PTX = tl.constexpr(not INTERPRETED)


@triton.jit
def _times(q, a):
    """Packed quants q (int8, each < 16) times a per-row a < 8 (int32, broadcast over the row): one 32-bit multiply
    for 4 quants."""
    a = tl.broadcast_to(a[:, None], q.shape)
    if not PTX:
        return (q.to(tl.int32) * a).to(tl.int8)
    return tl.inline_asm_elementwise("mul.lo.u32 $0, $1, $2;", "=r,r,r,r,r,r", [q, a], dtype=tl.int8, is_pure=True,
                                     pack=4)


@triton.jit
def _every_byte(m, like):
    """Per-row m < 128 (int32) in every byte of a tile shaped as ``like``, as int8."""
    m = tl.broadcast_to(m[:, None], like.shape)
    if not PTX:
        return m.to(tl.int8)
    return tl.inline_asm_elementwise("mul.lo.u32 $0, $1, 0x01010101;", "=r,r,r,r,r", [m], dtype=tl.int8,
                                     is_pure=True, pack=4)


@triton.jit
def _q4k_scaled_kernel(w_ptr, ws_ptr, y_ptr, M, K, N, w_stride, BM: tl.constexpr, SPLIT: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_mask = rows < M
    rm = row_mask[:, None]
    cols = tl.arange(0, 16)
    n_sb = K // 256
    per = tl.cdiv(n_sb, SPLIT)
    lo_sb = tl.program_id(1) * per
    hi_sb = tl.minimum(lo_sb + per, n_sb)
    e = tl.arange(0, 32)
    x8 = ws_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
    xd = (ws_ptr + 16 * K).to(tl.pointer_type(tl.float32), bitcast=True)
    w32 = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    w_row = rows.to(tl.int64) * w_stride
    acc = tl.zeros([BM, 16], tl.float32)
    for sb in range(lo_sb, hi_sb):
        blk = w_row + sb * 144
        dm = tl.load(w32 + blk // 4, mask=row_mask, other=0)
        s0 = tl.load(w32 + blk // 4 + 1, mask=row_mask, other=0)
        s1 = tl.load(w32 + blk // 4 + 2, mask=row_mask, other=0)
        s2 = tl.load(w32 + blk // 4 + 3, mask=row_mask, other=0)
        t8 = tl.zeros([BM, 16], tl.int32)
        t1 = tl.zeros([BM, 16], tl.int32)
        tm = tl.zeros([BM, 16], tl.int32)
        for p in range(4):  # a loop, not unrolled: Triton keeps a loop's chained wgmmas in flight
            qb = tl.load(w_ptr + blk[:, None] + 16 + 32 * p + e[None, :], mask=rm, other=0)
            for h in tl.static_range(2):  # the low nibbles are group 2p, the high ones 2p + 1
                q = mv._nibbles(qb, h)
                sc, m = _scale_min_k4(s0, s1, s2, 2 * p + h)
                xq = mv._group_x(x8, tl.zeros([], tl.int32) + sb * 8 + 2 * p + h)  # (a tensor, for the interpreter)
                t8 = tl.dot(_times(q, sc >> 3), xq, t8, out_dtype=tl.int32)
                t1 = tl.dot(_times(q, sc & 7), xq, t1, out_dtype=tl.int32)
                tm = tl.dot(_every_byte(m, q), xq, tm, out_dtype=tl.int32)
        dx = tl.load(xd + sb * 16 + cols)
        acc += (f16_bits(dm)[:, None] * dx[None, :]) * (8 * t8 + t1).to(tl.float32) \
            - (f16_bits(dm >> 16)[:, None] * dx[None, :]) * tm.to(tl.float32)
    at = cols[None, :] * M + rows[:, None]
    mask = rm & (cols < N)[None, :]
    if SPLIT == 1:
        tl.store(y_ptr + at, acc, mask=mask)
    else:
        tl.atomic_add(y_ptr + at, acc, mask=mask, sem="relaxed")


def launch(w, x, y, M, K, N, bm, warps, stages, split):
    acts = mv.quantize_activations(x, DType.Q4_K, K, N, (N, 1, K, N * K, N * K))
    if split > 1:
        y.zero_()
    _q4k_scaled_kernel[(triton.cdiv(M, bm), split)](w, acts, y, M, K, N, w.shape[-1], BM=bm, SPLIT=split,
                                                     num_warps=warps, num_stages=stages, enable_fp_fusion=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=shape_list, default=shape_list("12288x4096,4096x4096,4096x12288"))
    ap.add_argument("--cols", type=column_counts, default=[1, 4, 16])
    a = ap.parse_args()
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    print(torch.cuda.get_device_name() if gpu else "cpu (interpreter)", torch.__version__, triton.__version__)
    print(f"{'M x K':>11} {'N':>2} {'production us':>13} {'scaled us (tile)':>24} {'read us':>8}")
    for (M, K), N in itertools.product(a.shapes, a.cols):
        w = quantized_weight(DType.Q4_K, M, K) if gpu else \
            quants.random_blocks(M, K, DType.Q4_K, torch.Generator().manual_seed(0), K ** -0.5).reshape(1, 1, M, -1)
        x = torch.randn(1, 1, N, K, device=dev)
        want, got = torch.empty(1, 1, N, M, device=dev), torch.empty(N, M, device=dev)
        tile = mv.mat_vec_tile(M, N, K, "q4_k")
        mv._mat_vecs([(w, want)], x, tile._replace(split_k=1), dtype=DType.Q4_K)
        launch(w, x, got, M, K, N, tile.block_m, tile.warps, tile.stages, 1)
        if not torch.equal(got.view(torch.int32).cpu(), want.reshape(N, M).view(torch.int32).cpu()):
            raise SystemExit(f"{M}x{K}, {N} columns: the scaled form's bytes differ from the production kernel's")
        if not gpu:
            print(f"{M:>5}x{K:<5} {N:>2} {'(bytes equal)':>13}")
            continue
        copies = [w] + [w.clone() for _ in range(rotation(w.numel()) - 1)]
        prod = kernel_us(lambda: [mv.mul_mat_vec(v, x, want, DType.Q4_K) for v in copies], 10,
                         "mul_mat_vec")[0] / len(copies)
        best = min((kernel_us(lambda: [launch(v, x, got, M, K, N, bm, wp, st, sp) for v in copies], 10,
                              "q4k_scaled")[0] / len(copies), f"{bm}/{wp}/{st}/{sp}")
                   for bm, wp, st, sp in itertools.product((64, 128), (4,), (2, 3), (tile.split_k, 2 * tile.split_k))
                   if sp <= K // 256)
        print(f"{M:>5}x{K:<5} {N:>2} {prod:13.2f} {best[0]:12.2f} ({best[1]:>9}) {read_us(w.numel()):8.2f}", flush=True)


if __name__ == "__main__":
    main()
