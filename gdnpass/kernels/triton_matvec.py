"""Triton kernels of MUL_MAT for 1-16 columns (the mat-vec: every such MUL_MAT, attention's batched KQ / KQV too) and of
MUL_MAT_VEC_PAIR, which is the same kernel with a second product on the grid, so each product of a pair is
byte-identical to its single mat-vec. A tile per shape and weight type (:func:`~gdnpass.kernels.tiles.mat_vec_tile`):
CUDA-core FMAs for few columns, tensor cores at f32-level accuracy for many, K split across programs where the row
blocks alone leave SMs idle (:class:`MatVecTile`). Beyond 16 columns (several sequences' verify: S x T columns; a
prompt's ubatch) a single f16 / bf16 weight runs the GEMM (:func:`mul_mat_gemm`): the mat-vec's tensor-core sum on a
grid of row blocks x column tiles, reading the weight as it is where torch's matmul would first convert all of it to f32
on every call (49 ms for a 9B verify of 8 sequences, 7.1 ms for one: H100). A single product's store may run an epilogue
of elementwise chain steps on each sum (:class:`Epilogue`: MUL_MAT_ADD's residual, MUL_MAT_CHAIN's chain). Conventions:
:mod:`gdnpass.kernels.triton_core`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gdnpass import prepasses
from gdnpass.kernels.limits import (GEMM_WEIGHTS, MAT_VEC_COLS, QUANT_MAT_VEC_COLS, mat_vec_chunks, mat_vec_columns,
                                    mul_mat_path, pre_pass, runs_as_gemm, runs_as_mat_vec)
from gdnpass.ir import HELD_SPLIT, DType
from gdnpass.kernels import tiles
from gdnpass.kernels.tiles import GemmTile, MatVecTile, gemm_tile, hands_on_q8_1, mat_vec_tile
from gdnpass.kernels.triton_core import (GROUPS_K, INTERPRETED, LAUNCH, Q4_K_BYTES, Q5_K_BYTES, Q6_K_PLANES, QK_K,
                                         QTYPES, SUB, XCOLS, _alias_ok, _byte_of, _column_chunk, _require,
                                         _row_offset, _scales_mins_k4, _strides, activation_bytes, activation_workspace,
                                         activations_key, activations_to_fill, chain_sides, chain_step, chunk_columns,
                                         f16_bits, HAND_OFF_SLOT, held_activations, last_to_arrive, prefetch_l2,
                                         PREFETCH, product_columns, require_whole_rows, silu_f32, split_workspace,
                                         store_activations, store_q8_1_rows, wait_for_previous_kernels)

# bf16 tensor-core operands as they are on a GPU; the interpreter's bf16 arithmetic is broken (see matvec_cols)
NATIVE_BF16 = tl.constexpr(not INTERPRETED)


# ---- the sum: two forms ---------------------------------------------------------------------------------------------


@triton.jit
def _round_bf16(x):
    """f32 -> the nearest bf16 value (ties to even), still f32: integer arithmetic, the same in the interpreter."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


# The bf16 tensor-core form takes x as three bf16 terms, side by side in one operand up to ONE_DOT_COLS padded columns
# (tiles.ONE_DOT_COLS says why), the fourth block zero
TERMS = tl.constexpr(4)
ONE_DOT_COLS = tl.constexpr(tiles.ONE_DOT_COLS)


@triton.jit
def _split_bf16(x):
    """x = head + middle + tail exactly, each a bf16 value (as f32): each residual is exact in f32, together 24
    significant bits. Integer rounding: the same in the interpreter."""
    hi = _round_bf16(x)
    r = x - hi
    mid = _round_bf16(r)
    return hi, mid, _round_bf16(r - mid)


@triton.jit
def _bf16_terms(x, term):
    """x's bf16 term ``term`` (0 head, 1 middle, 2 tail, 3 zero) per element, as f32."""
    hi, mid, lo = _split_bf16(x)
    return tl.where(term == 0, hi, tl.where(term == 1, mid, tl.where(term == 2, lo, 0.0)))


@triton.jit
def _dot_bf16_terms(w, x, acc):
    """acc + w·x for bf16 ``w`` and f32 ``x`` as three dots, tail, middle, head (16 columns: see ONE_DOT_COLS)."""
    hi, mid, lo = _split_bf16(x)
    return _dot_terms(w, hi, mid, lo, acc)


@triton.jit
def _dot_terms(w, hi, mid, lo, acc):
    """acc + w·(hi + mid + lo) for bf16 ``w`` and x's three bf16 terms (as f32 or bf16): three dots, tail first."""
    if NATIVE_BF16:
        acc = tl.dot(w, lo.to(tl.bfloat16), acc)
        acc = tl.dot(w, mid.to(tl.bfloat16), acc)
        acc = tl.dot(w, hi.to(tl.bfloat16), acc)
    else:  # (the interpreter's bf16 arithmetic is broken: the same products in f32)
        wf = w.to(tl.float32)
        acc = tl.dot(wf, lo.to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(wf, mid.to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(wf, hi.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _fold_terms(acc, COLS: tl.constexpr):
    """[BLOCK_M, TERMS * COLS] term-major sums -> [BLOCK_M, COLS]: (tail + middle) + head, in that order."""
    a = tl.permute(tl.reshape(acc, [acc.shape[0], 2, 2, COLS]), (0, 3, 1, 2))  # [M, COLS, term // 2, term % 2]
    even, odd = tl.split(a)  # terms 0, 2 and 1, 3: [M, COLS, term // 2]
    head, tail = tl.split(even)
    mid, _ = tl.split(odd)
    return (tail + mid) + head


@triton.jit
def x_columns(COLS: tl.constexpr, N, ne1, ne2, s1, s2, s3, TERMS_: tl.constexpr):
    """The activation columns a program's sum reads: element offsets and mask of each (COLS of them, or for the
    bf16 tensor-core form TERMS_ * COLS, term-major: column j is column j % COLS's term j // COLS)."""
    j = tl.arange(0, TERMS_ * COLS)
    col = j % COLS
    return _row_offset(col, ne1, ne2, s1, s2, s3), (col < N) & (j // COLS < 3)  # (the fourth term block: 0)


@triton.jit
def prefetch_weights(w_ptr, w_stride, row0, nrows, ROWS: tl.constexpr, K, k0, k1, QTYPE: tl.constexpr):
    """Ask the L2 for the weight's K range [k0, k1) of rows row0 .. row0 + nrows - 1 (``w_ptr``: a plain type's
    elements, or a block type's bytes with k0, k1 multiples of its 256; nothing where k0 >= k1): one bulk prefetch a
    row (:func:`~gdnpass.kernels.triton_core.prefetch_l2`) from its own row vector (the tile's rows lie in the dot's
    layout, several a thread: their addresses took the Q8_0 tile from 163 registers to 255), issued by every thread
    that holds the row: more than once where the program has more threads than rows (the same fetch asked again)."""
    i = tl.arange(0, ROWS)
    rows = row0 + i
    ask = (i < nrows) & (k0 < k1)
    if QTYPE == "":
        at = w_ptr + rows.to(tl.int64) * w_stride + k0
        nbytes = (k1 - k0) * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    elif QTYPE == "q8_0":  # held rows split (quants.held_rows): the range's quants at k0, their scales at K + k0 / 16
        row = w_ptr + rows.to(tl.int64) * w_stride
        at, nbytes = row + k0, k1 - k0
        prefetch_l2(row + K + k0 // (SUB // 2), (k1 - k0) // (SUB // 2), ask)
    elif QTYPE == "q6_k":  # held rows split (quants.held_rows): the range's part of the ql, qh and scales planes
        row = w_ptr + rows.to(tl.int64) * w_stride  # (its d, 2 bytes a block, left to the loads)
        at, nbytes = row + k0 // 2, (k1 - k0) // 2
        prefetch_l2(row + (K // QK_K) * Q6_K_PLANES[1] + k0 // 4, (k1 - k0) // 4, ask)
        prefetch_l2(row + (K // QK_K) * Q6_K_PLANES[2] + k0 // 16, (k1 - k0) // 16, ask)
    else:
        STEP: tl.constexpr = Q4_K_BYTES if QTYPE == "q4_k" else Q5_K_BYTES  # a block of 256's bytes
        at = w_ptr + rows.to(tl.int64) * w_stride + (k0 // QK_K) * STEP
        nbytes = (k1 - k0) // QK_K * STEP
    prefetch_l2(at, nbytes, ask)


@triton.jit
def matvec_cols(w_ptr, w_stride, rows, row_mask, x_ptr, x_cols, col_mask, K, BLOCK_K: tl.constexpr,
                DOT: tl.constexpr, EVICT: tl.constexpr = False, TERMS_: tl.constexpr = 1,
                IEEE: tl.constexpr = False):
    """Σ_k w[row, k]·x[col, k] for a block of weight rows and a tile of activation columns (``x_cols``: each column's
    element offset, :func:`x_columns`), in f32. Returns [BLOCK_M, COLS].

    Two forms of the same sum, picked per shape by :func:`mat_vec_tile` (so a product's bytes depend only on its
    shape and type). ``DOT`` off: a [BLOCK_M, COLS, BLOCK_K] accumulator of explicit FMAs (``tl.fma``: one rounding
    whatever the compiler flags) and one ``tl.sum`` over K at the end, on the CUDA cores. On: a ``tl.dot`` of the
    [BLOCK_M, BLOCK_K] weight tile with the activations per K step on the tensor cores, accumulated in place, at
    f32-level accuracy (not f32 rounding): bf16 weights as they are, times the activations as three bf16 terms side
    by side in one [BLOCK_K, TERMS * COLS] operand (:func:`_bf16_terms`: one dot per step, each bf16 x bf16 product
    exact, summed in f32; the terms' sums folded at the end, :func:`_fold_terms`); other weights in 3xTF32 (each f32
    operand split into a TF32 head and tail, the tail x tail term dropped; with ``IEEE``, the weight tile in f32 and
    an f32 dot, as the GEMM takes f16 weights). For many columns, where CUDA-core arithmetic would bound the
    time.

    A split-K program (:class:`MatVecTile`) sums its K slice by calling this with ``w_ptr`` and ``x_ptr`` advanced to
    the slice's first element and ``K`` its length: the same code on fewer steps. ``EVICT``: the weight's lines are
    the first the L2 evicts (each is read once; the activations are read by every program). Quantized weights have
    their own form, :func:`matvec_cols_q`."""
    ks = tl.arange(0, BLOCK_K)
    w_policy: tl.constexpr = "evict_first" if EVICT else ""
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * w_stride
    if DOT:
        acc = tl.zeros([rows.shape[0], x_cols.shape[0]], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            kmask = kk < K
            w = tl.load(w_rows + kk[None, :], mask=row_mask[:, None] & kmask[None, :], other=0.0,
                        eviction_policy=w_policy)
            xt = tl.load(x_ptr + x_cols[None, :] + kk[:, None], mask=kmask[:, None] & col_mask[None, :], other=0.0)
            if w_ptr.dtype.element_ty == tl.bfloat16 and TERMS_ > 1:  # the terms side by side: one dot
                xt = _bf16_terms(xt, tl.arange(0, x_cols.shape[0])[None, :] // (x_cols.shape[0] // TERMS_))
                if NATIVE_BF16:
                    acc = tl.dot(w, xt.to(tl.bfloat16), acc)
                else:  # (the interpreter's bf16 arithmetic is broken: the same products in f32)
                    acc = tl.dot(w.to(tl.float32), xt, acc, input_precision="ieee")
            elif w_ptr.dtype.element_ty == tl.bfloat16:
                acc = _dot_bf16_terms(w, xt, acc)
            elif IEEE:
                acc = tl.dot(w.to(tl.float32), xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(tl.float32), xt, acc, input_precision="tf32x3")
        if TERMS_ > 1:
            acc = _fold_terms(acc, x_cols.shape[0] // TERMS_)
    else:
        acc3 = tl.zeros([rows.shape[0], x_cols.shape[0], BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            kmask = kk < K
            # cast right after the load: f16/bf16 arithmetic is not f32 (and bf16 is broken in the interpreter)
            w = tl.load(w_rows + kk[None, :], mask=row_mask[:, None] & kmask[None, :], other=0.0,
                        eviction_policy=w_policy).to(tl.float32)
            x = tl.load(x_ptr + x_cols[:, None] + kk[None, :], mask=col_mask[:, None] & kmask[None, :], other=0.0)
            acc3 = tl.fma(w[:, None, :], x[None, :, :], acc3)
        acc = tl.sum(acc3, axis=2)
    return acc


@triton.jit
def _x_words(j, chunk):
    """Column ``j``'s place in the activation workspace, in its 4-byte words: its chunk's first word (``chunk``
    bytes a chunk, a multiple of 4) and its slot there (0..15)."""
    return (j // XCOLS).to(tl.int64) * (chunk // 4), j % XCOLS


@triton.jit
def _group_x(ws_ptr, chunk, g, j, on=True):
    """The activations' int8 quants of group ``g`` of columns ``j`` (``j`` a [C] tensor of workspace columns): a dot's
    right operand [32, C] (zeros where not ``on``)."""
    word, slot = _x_words(j, chunk)
    x8 = ws_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
    return tl.load(x8 + (4 * word + (g * XCOLS + slot) * SUB)[None, :] + tl.arange(0, SUB)[:, None], mask=on, other=0)


@triton.jit
def _quantize_x_kernel(x_ptr, ws_ptr, K, N, ne1, ne2, x_s1, x_s2, x_s3, chunk, FORM: tl.constexpr):
    """A quantized product's pre-pass, program (column c, block b of 256): the block quantized to FORM into the
    activation workspace, Q8_0's q8_1 groups or the K-quants' q8_K block
    (:func:`~gdnpass.kernels.triton_core.store_activations`); the columns past N are zeros. The references:
    :func:`gdnpass.kernels.quants.quantize_x` (q8_1), :func:`~gdnpass.kernels.quants.quantize_x_ggml_cpu` (q8_K)."""
    wait_for_previous_kernels()
    c, b = tl.program_id(0), tl.program_id(1)
    k = b * QK_K + tl.reshape(tl.arange(0, QK_K), (1, GROUPS_K, SUB))  # the elements, [block, group, lane]
    xt = tl.load(x_ptr + _row_offset(c, ne1, ne2, x_s1, x_s2, x_s3) + k, mask=(k < K) & (c < N), other=0.0)
    store_activations(ws_ptr, c, chunk, K, b + tl.arange(0, 1), xt, True, FORM)


@triton.jit
def _group_dot(a, xq):
    """The integer dots of the weight quants ``a`` [BLOCK_M, 32] (int8) with a group's activation quants ``xq``
    [32, C] (:func:`_group_x`): [BLOCK_M, C] int32, exact, on the tensor cores."""
    return tl.dot(a, xq, out_dtype=tl.int32)


@triton.jit
def _group_dots(a, ws_ptr, chunk, g, col0, N, on, COLS: tl.constexpr):
    """:func:`_group_dot` of ``a`` with group ``g`` of the sum's COLS columns (the product's [col0, col0 + N); zeros
    where not ``on``): [BLOCK_M, COLS]. The dot is 16 columns wide at the least, its first COLS kept: the activations'
    operand is then 512 contiguous bytes, 4 a thread, which Triton's pipeline copies ahead asynchronously (at 8
    columns, 2 a thread, each group's load waited on the L2)."""
    tl.static_assert(COLS == 8 or COLS >= XCOLS, "_group_dots: the sum is 8 columns wide or the dot's own")
    DOT: tl.constexpr = XCOLS if COLS < XCOLS else COLS
    c = tl.arange(0, DOT)
    t = _group_dot(a, _group_x(ws_ptr, chunk, g, c, ((c >= col0) & (c < col0 + N) & on)[None, :]))
    if DOT > COLS:  # (the first half: columns 0..7)
        t, _ = tl.split(tl.permute(tl.reshape(t, (t.shape[0], 2, COLS)), (0, 2, 1)))
    return t


# The weights' quants are decoded 4 bytes at a time: each op below is bytewise (no bit crosses a byte), so it runs on
# the 32-bit registers the loads fill, one instruction for 4 quants (Triton's own byte ops take one or more a byte).
# The interpreter, which runs no PTX, takes the same bytewise expressions on int8 tensors.
def _decode_asm(ql_shift: int, qh_shift: int | None, qh_mask: int, minus_32: bool) -> str:
    """PTX of (ql >> ql_shift) & 0xF | ((qh >> qh_shift) & qh_mask) << 4 [- 32], bytewise: the subtraction without
    borrows, (v | 0x80) - 0x20 with the top bit flipped back (v < 64)."""
    ops = [f"shr.u32 a, $1, {ql_shift};", "and.b32 a, a, 0x0F0F0F0F;"]
    if qh_shift is not None:
        m = qh_mask * 0x01010101
        ops += [f"shr.u32 b, $2, {qh_shift};", f"and.b32 b, b, {m:#010x};", "shl.b32 b, b, 4;", "or.b32 a, a, b;"]
    if minus_32:
        ops += ["or.b32 a, a, 0x80808080;", "sub.u32 a, a, 0x20202020;", "xor.b32 a, a, 0x80808080;"]
    return "{ .reg .b32 a, b; " + " ".join(ops) + " mov.b32 $0, a; }"


PACKED_DECODE = tl.constexpr(not INTERPRETED)
NIBBLE_ASM = tl.constexpr(tuple(_decode_asm(4 * h, None, 0, False) for h in range(2)))          # [high]
Q5_ASM = tl.constexpr(tuple(_decode_asm(4 * (j % 2), j, 1, False) for j in range(8)))             # [sub-block]
Q6_ASM = tl.constexpr(tuple(_decode_asm(4 * (k // 2), 2 * k, 3, True) for k in range(4)))         # [quarter]


@triton.jit
def _nibbles(qb, high: tl.constexpr):
    """Q4_K's quants: the low (``high`` 0) or high nibbles of ``qb`` (uint8), as int8."""
    if not PACKED_DECODE:
        return ((qb >> (4 * high)) & 0xF).to(tl.int8)
    return tl.inline_asm_elementwise(NIBBLE_ASM[high], "=r,r", [qb], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _q5_quants(qb, qh, j: tl.constexpr):
    """Q5_K's quants of sub-block ``j``: the nibbles of ``qb`` (low for even j) and bit j of ``qh`` as the fifth."""
    if not PACKED_DECODE:
        return (((qb >> (4 * (j % 2))) & 0xF) | (((qh >> j) & 1) << 4)).to(tl.int8)
    return tl.inline_asm_elementwise(Q5_ASM[j], "=r,r,r", [qb, qh], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _q6_quants(ql, qh, k: tl.constexpr):
    """Q6_K's quants of quarter ``k`` of a half: ql's low (k < 2) or high nibbles, bits 2k, 2k + 1 of qh above them,
    minus 32."""
    if not PACKED_DECODE:
        return ((((ql >> (4 * (k // 2))) & 0xF) | (((qh >> (2 * k)) & 3) << 4)).to(tl.int32) - 32).to(tl.int8)
    return tl.inline_asm_elementwise(Q6_ASM[k], "=r,r,r", [ql, qh], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _block_scales(w_ptr, w_row, row_mask, xd, sb, on, SIZE: tl.constexpr):
    """Q4_K / Q5_K block ``sb``'s scales (``SIZE`` bytes a block) for the rows ``w_row`` (byte offsets): its {d, dmin}
    as a word, its 8 sub-blocks' scales and mins as bytes of four (:func:`_scales_mins_k4`), and its activation
    scale; zeros where not ``on``. The quants feed the dots, so Triton pipelines their loads through shared memory.
    These feed only the arithmetic after the dots, so :func:`matvec_cols_q` loads them a step ahead itself, or each
    step would wait a memory round trip for them. (The activations' group sums stay in the step: carried too, they
    took 32 more registers, and the down projection lost a program an SM: docs/performance.md, sixth session.)"""
    w32 = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    at = (w_row + sb * SIZE) // 4
    mask = row_mask & on
    scales = _scales_mins_k4(tl.load(w32 + at + 1, mask=mask, other=0), tl.load(w32 + at + 2, mask=mask, other=0),
                             tl.load(w32 + at + 3, mask=mask, other=0))
    return tl.load(w32 + at, mask=mask, other=0), scales, tl.load(xd + sb * XCOLS, mask=on, other=0.0)


@triton.jit
def _load_words4(p, mask):
    """The 16 bytes at ``p`` (a [R] tensor of 16-byte aligned byte addresses) as 4 int32 words, one vector load a
    row; zeros where not ``mask``. (Triton's own load of a [R, 4] tensor came in a layout apart from the rows', and
    moved through shared memory to theirs: 16 more LDS and STS, 3 more BAR a step.)"""
    if not PACKED_DECODE:  # (the interpreter runs no PTX)
        w32 = p.to(tl.pointer_type(tl.int32), bitcast=True)
        return (tl.load(w32, mask=mask, other=0), tl.load(w32 + 1, mask=mask, other=0),
                tl.load(w32 + 2, mask=mask, other=0), tl.load(w32 + 3, mask=mask, other=0))
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $5, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; "
        "@p ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4]; }",
        "=r,=r,=r,=r,l,r", [p, mask.to(tl.int32)], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
        pack=1)


@triton.jit
def _load_16_bytes(p, mask, halves, ALIGNED: tl.constexpr):
    """The 16 bytes at ``p`` (a [R] tensor of byte addresses) as 4 int32 words (a row's 8 f16 scales, or 16 int8):
    where ``ALIGNED`` (16-byte aligned addresses) one vector load a row (:func:`_load_words4`), else 8 16-bit loads,
    half-word i read only where i < ``halves``; zeros where not ``mask`` (and past ``halves``)."""
    if ALIGNED:
        return _load_words4(p, mask)
    w16 = p.to(tl.pointer_type(tl.int16), bitcast=True)
    words = ()
    for i in tl.static_range(4):
        lo = tl.load(w16 + 2 * i, mask=mask & (2 * i < halves), other=0).to(tl.int32)
        hi = tl.load(w16 + 2 * i + 1, mask=mask & (2 * i + 1 < halves), other=0).to(tl.int32)
        words = words + ((lo & 0xFFFF) | (hi << 16),)
    return words


@triton.jit
def _q8_0_scales(w_ptr, w_row, row_mask, K, xd, sb, k_hi, on, ALIGNED: tl.constexpr):
    """Q8_0 step ``sb``'s scales (held rows, :func:`~gdnpass.kernels.quants.held_rows`: group g's f16 at byte K + 2g):
    its 8 groups' weight scales of the rows ``w_row`` as 4 words of two f16 each (where ``ALIGNED`` one 16-byte load a
    row, :func:`_load_words4`, else a 16-bit load a group), and its 8 groups' activation scales ([COLS] f32 each);
    zeros where not ``on`` or past ``k_hi``. Only the f32 step after the dots uses them, so Triton's pipeline does not
    copy them ahead, and :func:`matvec_cols_q` loads them a step ahead itself: loaded in their step, each step waited a
    memory round trip for its weight scales and an L2 one a group for its activation scales (SASS, compiled as
    launched; ncu had read 2.8 warps a scheduler, the issue slots 31% busy). 7-20% faster a launch at the 9B's shapes
    (H100); carrying the activation scales too takes the lm head to 133 registers, 3 programs an SM, and it still ran
    8% faster than with them loaded at the step's start (5 an SM; docs/performance.md, nineteenth session)."""
    g = sb * GROUPS_K  # the step's first group (groups past k_hi: only where K is not whole steps)
    ds = _load_16_bytes(w_ptr + w_row + K + 2 * g, row_mask & on, k_hi // SUB - g, ALIGNED)
    dx = ()
    for j in tl.static_range(GROUPS_K):
        dx = dx + (tl.load(xd + (g + j) * XCOLS, mask=on & ((g + j) * SUB < k_hi), other=0.0),)
    return ds, dx


@triton.jit
def _q6_k_scales(w_ptr, w_row, row_mask, K, xd, sb, on, ALIGNED: tl.constexpr):
    """Q6_K block ``sb``'s scales (held rows, :func:`~gdnpass.kernels.quants.held_rows`: its 16 int8 scales at byte
    3K/4 + 16 sb, its f16 d at 13K/16 + 2 sb: ``Q6_K_PLANES``) for the rows ``w_row``: the scales as 4 words (where
    ``ALIGNED`` one 16-byte load a row, :func:`_load_words4`, else a 16-bit load a pair), d as f32, and the block's
    activation scale ([COLS] f32); zeros where not ``on``. Loaded a step ahead, as :func:`_q8_0_scales` says why."""
    blocks = K // QK_K
    mask = row_mask & on
    words = _load_16_bytes(w_ptr + w_row + blocks * Q6_K_PLANES[2] + 16 * sb, mask, 8, ALIGNED)
    d16 = (w_ptr + w_row + blocks * Q6_K_PLANES[3] + 2 * sb).to(tl.pointer_type(tl.int16), bitcast=True)
    d = f16_bits(tl.load(d16, mask=mask, other=0).to(tl.int32))
    return words, d, tl.load(xd + sb * XCOLS, mask=on, other=0.0)


@triton.jit
def matvec_cols_q(w_ptr, w_stride, rows, row_mask, ws_ptr, K, k_lo, k_hi, chunk, col0, N, QTYPE: tl.constexpr,
                  COLS: tl.constexpr, ALIGNED: tl.constexpr):
    """Σ_k w[row, k]·x[col, k] over [k_lo, k_hi) (multiples of 256) for a block of rows of a quantized weight
    (``w_ptr`` its bytes as gdnpass holds them, :func:`~gdnpass.kernels.quants.held_rows`: Q8_0's and Q6_K's rows
    split, Q4_K's and Q5_K's as the file has them; rows ``w_stride`` bytes apart), on the activations the pre-pass
    quantized into the workspace ``ws_ptr`` (:func:`activation_bytes`; COLS columns, 8, 16 or 32: one or two chunks
    of 16 from ``ws_ptr``, ``chunk`` bytes apart, so the weight is read and decoded once for all of them). Each
    group's integer dot of the weight's quants (decoded to int8 in the dot operand's layout, 4 bytes a register: Q4_K
    / Q5_K's nibbles as they lie, the low ones one group and the high ones the next) with its activation quants is one
    int8 ``tl.dot`` on the tensor cores (exact; the columns padded to 16, the smallest dot: a column's sums are the same
    whatever COLS). Q8_0 (q8_1 activations, llama.cpp's mmvq): each group's dot times both scales, in f32 (where
    ``ALIGNED``, :func:`aligned_rows`, a step's 8 scales of a row are one load and no group is masked). The
    K-quants (q8_K activations, ggml-cpu's: one scale per block of 256): the block's group dots times their integer
    scales add up exactly in int32 (Q6_K's groups of 32 have a scale a half: two dot columns a column, each half's
    against the activations with the other half zeroed), as do the mins times the activations' group sums, then one
    f32 step per block: d·dx·Σ - dmin·dx·Σ_min (the scales loaded a block ahead: :func:`_block_scales`,
    :func:`_q6_k_scales`; Q8_0's :func:`_q8_0_scales`; ``ALIGNED``: Q6_K's 16 a row one load).
    The quants of the product's columns [col0, col0 + N) only are read, the others' dot operand is the loads' zero fill
    (12 of 16 columns' bytes not fetched at 4 tokens); a column's sum is its own either way, and only the product's are
    stored. (Their scales and group sums are read for every column.) COLS may be 8 where the product has 8 columns or
    fewer (:data:`~gdnpass.kernels.tiles.QUANT_MIN_COLS`; col0 then 0), the dot 16 wide all the same
    (:func:`_group_dots`). Returns [BLOCK_M, COLS] f32; the torch reference is
    :func:`gdnpass.kernels.quants.mul_mat_q`."""
    # each column's words after its quants (4 K words in): the f32 scales, then the K-quants' i32 group sums
    cols = tl.arange(0, COLS)
    word, slot = _x_words(cols, chunk)
    xd = ws_ptr.to(tl.pointer_type(tl.float32), bitcast=True) + word + 4 * K + slot
    xb = ws_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + word + 4 * K + XCOLS * (K // QK_K) + slot
    e = tl.arange(0, SUB)
    w_row = rows.to(tl.int64) * w_stride                                 # [BLOCK_M] byte offsets
    rm = row_mask[:, None]
    acc = tl.zeros([rows.shape[0], COLS], tl.float32)
    SIZE: tl.constexpr = Q4_K_BYTES if QTYPE == "q4_k" else Q5_K_BYTES  # (read by Q4_K and Q5_K only)
    if QTYPE == "q4_k" or QTYPE == "q5_k":
        ahead = _block_scales(w_ptr, w_row, row_mask, xd, k_lo // QK_K, k_lo < k_hi, SIZE)
    if QTYPE == "q8_0":
        ahead = _q8_0_scales(w_ptr, w_row, row_mask, K, xd, k_lo // QK_K, k_hi, k_lo < k_hi, ALIGNED)
    if QTYPE == "q6_k":
        ahead = _q6_k_scales(w_ptr, w_row, row_mask, K, xd, k_lo // QK_K, k_lo < k_hi, ALIGNED)
    for k0 in range(k_lo, k_hi, QK_K):
        sb = k0 // QK_K
        if QTYPE == "q8_0":  # held rows split (quants.held_rows): element k's quant at byte k, group g's f16 at K + 2g
            ds, dxs = ahead
            ahead = _q8_0_scales(w_ptr, w_row, row_mask, K, xd, sb + 1, k_hi, k0 + QK_K < k_hi, ALIGNED)
            for j in tl.static_range(GROUPS_K):
                g = sb * GROUPS_K + j
                on = True if ALIGNED else g * SUB < k_hi  # (only a K of part steps has groups past its end)
                d = f16_bits(ds[j // 2] >> (16 * (j % 2)))
                q = tl.load(w_ptr + w_row[:, None] + SUB * g + e[None, :], mask=rm & on, other=0).to(tl.int8)
                t = _group_dots(q, ws_ptr, chunk, g, col0, N, on, COLS).to(tl.float32)
                acc += d[:, None] * dxs[j][None, :] * t
        else:
            isum = tl.zeros([rows.shape[0], COLS], tl.int32)
            if QTYPE == "q4_k" or QTYPE == "q5_k":
                dm, packed, dx = ahead
                sc_lo, sc_hi, m_lo, m_hi = packed                        # 8 scales, 8 mins: a byte each
                ahead = _block_scales(w_ptr, w_row, row_mask, xd, sb + 1, k0 + QK_K < k_hi, SIZE)
                blk = w_row + sb * SIZE                                  # [BLOCK_M] the block's bytes
                if QTYPE == "q5_k":
                    qh = tl.load(w_ptr + blk[:, None] + 16 + e[None, :], mask=rm, other=0)
                msum = tl.zeros([rows.shape[0], COLS], tl.int32)
                for j in tl.static_range(GROUPS_K):
                    if j % 2 == 0:  # bytes 16j..16j+31 of qs: low nibbles group j, high nibbles group j + 1
                        qb = tl.load(w_ptr + blk[:, None] + (SIZE - QK_K // 2) + 16 * j + e[None, :], mask=rm,
                                     other=0)
                    if QTYPE == "q5_k":
                        q = _q5_quants(qb, qh, j)
                    else:
                        q = _nibbles(qb, j % 2)
                    g = sb * GROUPS_K + j
                    sc = _byte_of(sc_lo if j < 4 else sc_hi, j % 4)
                    m = _byte_of(m_lo if j < 4 else m_hi, j % 4)
                    isum += sc[:, None] * _group_dots(q, ws_ptr, chunk, g, col0, N, True, COLS)
                    msum += m[:, None] * tl.load(xb + g * XCOLS)[None, :]
                acc += (f16_bits(dm)[:, None] * dx[None, :]) * isum.to(tl.float32) \
                    - (f16_bits(dm >> 16)[:, None] * dx[None, :]) * msum.to(tl.float32)
            else:
                tl.static_assert(QTYPE == "q6_k", "matvec_cols_q: an unknown block type")
                # held rows split (quants.held_rows): block sb's ql[128] at 128 sb, qh[64] at K/2 + 64 sb. Group
                # j = 4n + k (half n, quarter k) takes the low (k < 2) or high nibbles of ql[64n + 32(k & 1) + l] and
                # bits 2k, 2k + 1 of qh[32n + l]. Each group of 32 has two scales, one a half: its dot is one of 32
                # columns, the activations' 16 with the second half zeroed interleaved with the 16 with the first
                # half zeroed (column 2c + half), each scaled by its half's scale; the halves' sums are added once a
                # block (all exact, in int32)
                sc_words, d, dx = ahead
                ahead = _q6_k_scales(w_ptr, w_row, row_mask, K, xd, sb + 1, k0 + QK_K < k_hi, ALIGNED)
                j2 = tl.arange(0, 2 * COLS)                               # column 2c + half of the dots
                in_half = (e[:, None] < 16) == (j2[None, :] % 2 == 0)     # [32, 2 COLS]: element k of half j2 % 2
                half_on = ((j2 // 2 >= col0) & (j2 // 2 < col0 + N))[None, :]
                halves = tl.zeros([rows.shape[0], 2 * COLS], tl.int32)
                for n in tl.static_range(2):
                    qh = tl.load(w_ptr + w_row[:, None] + ((K // QK_K) * Q6_K_PLANES[1] + 64 * sb + 32 * n)
                                 + e[None, :], mask=rm, other=0)
                    for i in tl.static_range(2):  # ql's 32 bytes i: quarter i in their low nibbles, i + 2 high
                        ql = tl.load(w_ptr + w_row[:, None] + (128 * sb + 64 * n + 32 * i) + e[None, :], mask=rm,
                                     other=0)
                        for h in tl.static_range(2):
                            q = _q6_quants(ql, qh, 2 * h + i)
                            g = sb * GROUPS_K + 4 * n + 2 * h + i
                            xq = _group_x(ws_ptr, chunk, g, j2 // 2, in_half & half_on)
                            pair = sc_words[2 * n + h] >> (16 * i)          # scales[8n + 2k], [8n + 2k + 1]
                            sc = tl.where(j2[None, :] % 2 == 0, ((pair << 24) >> 24)[:, None],
                                          ((pair << 16) >> 24)[:, None])
                            halves += sc * _group_dot(q, xq)
                isum = tl.sum(tl.reshape(halves, (rows.shape[0], COLS, 2)), axis=2)
                acc += (d[:, None] * dx[None, :]) * isum.to(tl.float32)
    return acc


# ---- MUL_MAT (mat-vec) ----------------------------------------------------------------------------------------------


@triton.jit
def _store_y(y_ptr, acc, rows, row_mask, cols, col_mask, ne1, ne2, y_s0, y_s1, y_s2, y_s3, s1_ptr, s2_ptr,
             STEPS: tl.constexpr, SIDES: tl.constexpr):
    """Store the product, or the product through an elementwise chain's STEPS (:func:`~gdnpass.kernels.triton_core.
    chain_step`; SIDES as :func:`~gdnpass.kernels.triton_core.chain_at`'s, side operands ``s1_ptr``, ``s2_ptr``
    laid out as y, each element read before y's is written, so y may be one of them): MUL_MAT_ADD's residual ADD,
    MUL_MAT_CHAIN's chain, the f32 values the unfused nodes make of the stored product."""
    at = _row_offset(cols, ne1, ne2, y_s1, y_s2, y_s3)[None, :] + rows[:, None] * y_s0
    mask = row_mask[:, None] & col_mask[None, :]
    for i in tl.static_range(len(STEPS)):
        b = acc
        if SIDES[i] == 1:
            b = tl.load(s1_ptr + at, mask=mask)
        elif SIDES[i] == 2:
            b = tl.load(s2_ptr + at, mask=mask)
        acc = chain_step(acc, b, STEPS, i)
    tl.store(y_ptr + at, acc, mask=mask)


@triton.jit
def _slot(ws_ptr, tile, R: tl.constexpr, C: tl.constexpr, SPLIT_K: tl.constexpr):
    """The split workspace's slot of ``tile``: its SPLIT_K partials side by side, each packed [R, C]."""
    return ws_ptr + tile * (SPLIT_K * R * C) + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]


@triton.jit
def _store_part(acc, ws_ptr, tile, s, SPLIT_K: tl.constexpr):
    """Store K slice ``s``'s partial ``acc`` [R, C] of ``tile`` into the split workspace (masked rows and columns
    are 0)."""
    tl.store(_slot(ws_ptr, tile, acc.shape[0], acc.shape[1], SPLIT_K) + s * (acc.shape[0] * acc.shape[1]), acc)


@triton.jit
def store_slice(acc, ws_ptr, cnt_ptr, tile, s, SPLIT_K: tl.constexpr):
    """Split-K, first half: :func:`_store_part`, then draw a ticket on the tile's counter: True for the program that
    stores the last (:func:`~gdnpass.kernels.triton_core.last_to_arrive`)."""
    _store_part(acc, ws_ptr, tile, s, SPLIT_K)
    return last_to_arrive(cnt_ptr, tile, SPLIT_K)


@triton.jit
def _slices(acc, ws_ptr, tile, SPLIT_K: tl.constexpr):
    """``tile``'s partials (``acc``'s shape) added in the fixed order 0..SPLIT_K-1 (read with .cg: at L2)."""
    R: tl.constexpr = acc.shape[0]
    C: tl.constexpr = acc.shape[1]
    part = _slot(ws_ptr, tile, R, C, SPLIT_K)
    total = tl.load(part, cache_modifier=".cg")
    for j in tl.static_range(1, SPLIT_K):
        total += tl.load(part + j * (R * C), cache_modifier=".cg")
    return total


@triton.jit
def sum_slices(acc, ws_ptr, cnt_ptr, tile, SPLIT_K: tl.constexpr):
    """Split-K, second half, in the program :func:`store_slice` chose: ``tile``'s partials added in the fixed order
    0..SPLIT_K-1, whichever program finished last, so the bytes do not depend on the schedule; the tile's counter
    zeroed for the next launch (and the next CUDA-graph replay)."""
    total = _slices(acc, ws_ptr, tile, SPLIT_K)
    tl.store(cnt_ptr + tile, 0)
    return total


@triton.jit
def k_slice(K, s, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """K slice ``s`` of SPLIT_K, [k_lo, k_hi): equal slices of whole K steps (the last one short or empty), so every
    slice runs the same code; all of K when SPLIT_K is 1."""
    k_len = tl.cdiv(K, BLOCK_K * SPLIT_K) * BLOCK_K
    return s * k_len, tl.minimum(s * k_len + k_len, K)


@triton.jit
def _mat_vec(w_ptr, y_ptr, rows, row_mask, x_ptr, M, K, N, ne1, ne2, w_s1, x_s1, x_s2, x_s3,
             y_s0, y_s1, y_s2, y_s3, ws_ptr, cnt_ptr, tile, s, k_lo, k_hi, s1_ptr, s2_ptr, col0, x_chunk, hand_ptr,
             COLS: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr, SPLIT_K: tl.constexpr, EVICT: tl.constexpr,
             STEPS: tl.constexpr, SIDES: tl.constexpr, QTYPE: tl.constexpr, ALIGNED: tl.constexpr,
             GLU: tl.constexpr, HAND_OFF: tl.constexpr):
    """y[rows] = w[rows]·x. With SPLIT_K > 1 this program sums K slice ``s``, [k_lo, k_hi) (:func:`k_slice`), into the
    workspace slot of its (product, row block) ``tile``; the program that draws the tile's last ticket adds the slices
    up (see :class:`MatVecTile`). The product's N columns are the sum's columns [col0, col0 + N) (col0 is 0 but for a
    quantized MUL_MAT_ID, whose column is one of a workspace chunk's 16). ``GLU`` (a pair, :func:`_glu_store`): y is
    SwiGLU of the two products, 1 silu(A)·B, 2 silu(B)·A. HAND_OFF (unbatched): y also handed on quantized
    (:func:`_hand_on`)."""
    cols = tl.arange(0, COLS)
    col_mask = (cols >= col0) & (cols < col0 + N)
    terms: tl.constexpr = TERMS if DOT and w_ptr.dtype.element_ty == tl.bfloat16 and COLS <= ONE_DOT_COLS else 1
    x_cols, x_mask = x_columns(COLS, N, ne1, ne2, x_s1, x_s2, x_s3, terms)
    if QTYPE != "":  # (its groups by their index in the row: the pointers stay at the row's start)
        acc = matvec_cols_q(w_ptr, w_s1, rows, row_mask, x_ptr, K, k_lo, k_hi, x_chunk, col0, N, QTYPE, COLS,
                            ALIGNED)
    elif SPLIT_K == 1:
        acc = matvec_cols(w_ptr, w_s1, rows, row_mask, x_ptr, x_cols, x_mask, K, BLOCK_K, DOT, EVICT, terms)
    else:
        acc = matvec_cols(w_ptr + k_lo, w_s1, rows, row_mask, x_ptr + k_lo, x_cols, x_mask, k_hi - k_lo, BLOCK_K,
                          DOT, EVICT, terms)
    if GLU != 0:
        _glu_store(y_ptr, acc, rows, row_mask, cols, col_mask, ne1, ne2, y_s0, y_s1, y_s2, y_s3, ws_ptr, cnt_ptr, tile,
                   s, M, hand_ptr, SPLIT_K, GLU, HAND_OFF)
    elif SPLIT_K == 1:
        _store_y(y_ptr, acc, rows, row_mask, cols - col0, col_mask, ne1, ne2, y_s0, y_s1, y_s2, y_s3, s1_ptr,
                 s2_ptr, STEPS, SIDES)
        _hand_on(y_ptr, hand_ptr, M, rows, cols, col_mask, ne1, ne2, y_s0, y_s1, y_s2, y_s3, HAND_OFF)
    else:
        if store_slice(acc, ws_ptr, cnt_ptr, tile, s, SPLIT_K):
            _store_y(y_ptr, sum_slices(acc, ws_ptr, cnt_ptr, tile, SPLIT_K), rows, row_mask, cols - col0, col_mask,
                     ne1, ne2, y_s0, y_s1, y_s2, y_s3, s1_ptr, s2_ptr, STEPS, SIDES)
            _hand_on(y_ptr, hand_ptr, M, rows, cols, col_mask, ne1, ne2, y_s0, y_s1, y_s2, y_s3, HAND_OFF)


@triton.jit
def _hand_on(y_ptr, hand_ptr, M, rows, cols, col_mask, ne1, ne2, y_s0, y_s1, y_s2, y_s3, HAND_OFF: tl.constexpr):
    """A product's epilogue handing its output on (HAND_OFF "q8_1": a Q8_0 product reads it next, gdnpass.prepasses;
    "": nothing): the program that stored row block ``rows`` of y, all its columns, reads those rows back (32 rows
    of a column lie together; a CTA barrier first, so every thread's stores are seen) and writes them as that
    product's q8_1 activations into ``hand_ptr`` (the HAND_OFF_SLOT workspace; the M rows are its K), the bytes its
    pre-pass would write (:func:`~gdnpass.kernels.triton_core.store_q8_1_rows`; the rows past M and the columns past
    the product's are zeros there, as the pre-pass's). Quantized from the stored values' registers instead, in the
    dot's layout, the FFN pair took 130-132 registers (3 programs an SM where 4 fit)."""
    if HAND_OFF == "q8_1":
        tl.debug_barrier()
        G: tl.constexpr = rows.shape[0] // SUB
        block = tl.program_id(0)
        r = (block * G + tl.arange(0, G))[:, None, None] * SUB + tl.arange(0, SUB)[None, None, :]
        c = cols[None, :, None]
        yt = tl.load(y_ptr + _row_offset(c, ne1, ne2, y_s1, y_s2, y_s3) + r * y_s0,
                     mask=(r < M) & col_mask[None, :, None], other=0.0)
        store_q8_1_rows(hand_ptr, M, block * G, yt)
    else:
        tl.static_assert(HAND_OFF == "", "_hand_on: hands on q8_1 only")


@triton.jit
def _glu_store(y_ptr, acc, rows, row_mask, cols, col_mask, ne1, ne2, y_s0, y_s1, y_s2, y_s3, ws_ptr, cnt_ptr, tile,
               s, M, hand_ptr, SPLIT_K: tl.constexpr, GLU: tl.constexpr, HAND_OFF: tl.constexpr):
    """A pair's SwiGLU epilogue (the pair_glu pattern): every program stores its K slice of its product into the
    split workspace, as a split-K program does (at any SPLIT_K, 1 too), and draws a ticket on its row block's one
    counter for both products' 2·SPLIT_K slices. The program that draws the last adds each product's slices in the
    fixed order 0..SPLIT_K-1 (so each is the single product's bytes), and stores SwiGLU's expression of them, the
    GLU kernel's (:func:`~gdnpass.kernels.triton_core.silu_f32` of the gate times the up), into y; neither product
    is stored. Unbatched: product p's ``tile`` is p·blocks + row block, and the row block's counter product 0's.
    That program then hands y on where HAND_OFF says (:func:`_hand_on`)."""
    block = tl.program_id(0)
    _store_part(acc, ws_ptr, tile, s, SPLIT_K)
    if last_to_arrive(cnt_ptr, block, 2 * SPLIT_K):
        blocks = tl.num_programs(0)
        a = _slices(acc, ws_ptr, block, SPLIT_K)
        b = _slices(acc, ws_ptr, blocks + block, SPLIT_K)
        tl.store(cnt_ptr + block, 0)
        if GLU == 1:
            y = silu_f32(a) * b
        else:
            y = silu_f32(b) * a
        _store_y(y_ptr, y, rows, row_mask, cols, col_mask, ne1, ne2, y_s0, y_s1, y_s2, y_s3, None, None, (), ())
        _hand_on(y_ptr, hand_ptr, M, rows, cols, col_mask, ne1, ne2, y_s0, y_s1, y_s2, y_s3, HAND_OFF)


@triton.jit
def _mul_mat_vec_kernel(w_ptr, y_ptr, w2_ptr, y2_ptr, x_ptr, M, K, N, ne1, ne2,
                        w_s1,                  # w, w2 [K, M], contiguous rows
                        x_s1, x_s2, x_s3,      # x [K, ne1, ne2, ne3], contiguous rows, N = ne1*ne2*ne3 columns
                        y_s0, y_s1, y_s2, y_s3,
                        ws_ptr, cnt_ptr,       # split-K partials (f32) and tickets (i32); None when SPLIT_K == 1
                        b2, r2, r3,            # batches (grid axis 2: x's ne2 * ne3, 1 unbatched): ne2, broadcasts
                        w_b2, w_b3, x_b2, x_b3, y_b2, y_b3,  # the batch strides (0 unbatched)
                        s1_ptr, s2_ptr,        # the epilogue's side operands, laid out as y (STEPS; unbatched, single)
                        ids_ptr, ids_s0, ids_s1,  # MUL_MAT_ID's expert ids [n_used, n_t] (IDS; None otherwise)
                        x_chunk,               # a quantized product's activation chunk bytes (activation_bytes)
                        hand_ptr,              # the HAND_OFF_SLOT activation workspace (HAND_OFF; else None)
                        BLOCK_M: tl.constexpr, COLS: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                        SPLIT_K: tl.constexpr, EVICT: tl.constexpr, STEPS: tl.constexpr, SIDES: tl.constexpr,
                        QTYPE: tl.constexpr, IDS: tl.constexpr, EARLY: tl.constexpr, ALIGNED: tl.constexpr,
                        GLU: tl.constexpr = 0, HAND_OFF: tl.constexpr = ""):
    # (only index arithmetic and the L2 prefetch of an unbatched weight, which no kernel writes, before the wait)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    # grid axis 1: product-major, then K slice (size 1, or 2 for a pair, when SPLIT_K == 1)
    product, s = tl.program_id(1) // SPLIT_K, tl.program_id(1) % SPLIT_K
    # grid axis 2: the batch (i2, i3) of a batched MUL_MAT, whose weight matrix is (i2 // r2, i3 // r3) as ggml's
    batch = tl.program_id(2)
    i2, i3 = batch % b2, batch // b2
    if product == 1:  # the pair's second product: its pointers into the one call (as the GEMM's: two calls, one in a
        w_ptr = w2_ptr    # branch, inlined the loop twice with its own pipeline buffers, twice the shared memory,
        y_ptr = y2_ptr    # which capped the programs an SM; an epilogue's launch is a single product)
    k_lo, k_hi = k_slice(K, s, BLOCK_K, SPLIT_K)
    if IDS:  # MUL_MAT_ID: batch (slot i2, token i3) reads the matrix of expert ids[i2, i3] (known after the wait)
        wait_for_previous_kernels()
        w_off = tl.load(ids_ptr + i2 * ids_s0 + i3 * ids_s1).to(tl.int64) * w_b2
    else:
        w_off = (i2 // r2).to(tl.int64) * w_b2 + (i3 // r3).to(tl.int64) * w_b3
        if EARLY > 0:  # (its first steps come while the kernel before still runs; 0 for a batched product, whose
            # "weight" is attention's K / V, which kernels write: _mat_vecs)
            row0 = tl.program_id(0) * BLOCK_M
            prefetch_weights(w_ptr + w_off, w_s1, row0, M - row0, BLOCK_M, K, k_lo,
                             tl.minimum(k_lo + EARLY * BLOCK_K, k_hi), QTYPE)
        wait_for_previous_kernels()
    tl.static_assert(not IDS or QTYPE == "" or COLS >= XCOLS, "MUL_MAT_ID: a quantized tile of its chunk's 16")
    if IDS and QTYPE != "":  # x_b2, x_b3 in columns of the pre-pass's chunks: this batch's column is col0 of one
        x_ptr, col0 = _column_chunk(x_ptr, i2 * x_b2 + i3 * x_b3, x_chunk)
    else:
        x_ptr += i2.to(tl.int64) * x_b2 + i3.to(tl.int64) * x_b3
        col0 = i2 * 0
    y_off = i2.to(tl.int64) * y_b2 + i3.to(tl.int64) * y_b3
    # (batch, product, row block): its workspace slot and ticket
    tile = (batch * (tl.num_programs(1) // SPLIT_K) + product) * tl.num_programs(0) + tl.program_id(0)
    _mat_vec(w_ptr + w_off, y_ptr + y_off, rows, row_mask, x_ptr, M, K, N, ne1, ne2, w_s1, x_s1, x_s2, x_s3,
             y_s0, y_s1, y_s2, y_s3, ws_ptr, cnt_ptr, tile, s, k_lo, k_hi, s1_ptr, s2_ptr, col0, x_chunk, hand_ptr,
             COLS, BLOCK_K, DOT, SPLIT_K, EVICT, STEPS, SIDES, QTYPE, ALIGNED, GLU, HAND_OFF)


WTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def aligned_rows(wtype: DType, K: int, *weights: torch.Tensor) -> bool:
    """The mat-vec kernel's ``ALIGNED``: Q8_0 or Q6_K weights (their bytes, held split) whose K steps of 256 are whole
    and whose rows all start on 16 bytes, where a step loads its 16 bytes of scales a row at once (Q8_0's 8 f16, Q6_K's
    16 int8) and Q8_0 masks no group (every weight of the 9B; a K of part steps, as the tiny models', or a view off 16
    bytes takes 16-bit loads). False for other types, whose kernels ignore it."""
    return wtype in HELD_SPLIT and K % QK_K.value == 0 and all(
        w.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in w.stride()[:-1]) for w in weights)


def weight_type(w: torch.Tensor, dtype: DType | None = None) -> DType:
    """The DType of mat-vec weight view ``w``: its torch dtype's, or ``dtype`` for a quantized weight (its bytes)."""
    if dtype is not None and dtype.is_quantized:
        _require(w.dtype == torch.uint8, f"mul_mat_vec: {dtype.label} weights are given as their bytes, not {w.dtype}")
        return dtype
    _require(w.dtype in WTYPES, f"mul_mat_vec of {w.dtype} weights")
    return DType.parse(WTYPES[w.dtype])


class Epilogue(NamedTuple):
    """What a single product's store does to its f32 sums (:func:`_store_y`): an elementwise chain's ``steps`` (1 to
    ``MAX_STEPS``, at most ``MAX_SIDES`` binary: elementwise_chain's scope), ``sides`` its binary steps' operands in
    order, f32 and laid out as the output. MUL_MAT_ADD's residual is ``Epilogue(("ADD",), (r,))``."""

    steps: tuple[str, ...]
    sides: tuple[torch.Tensor, ...]

    def args(self, out: torch.Tensor, where: str) -> tuple[tuple, dict]:
        """The kernels' side pointers (``out`` for a side not read) and STEPS / SIDES, the operands checked."""
        from gdnpass.patterns.elementwise_chain.scope import sides_fit

        steps = tuple(self.steps)
        _require(not steps and not self.sides or sides_fit(list(steps), len(self.sides), least=1),
                 f"{where}: steps {list(steps)} with {len(self.sides)} side operands: outside the epilogue's scope")
        for b in self.sides:
            _require(b.dtype == torch.float32 and b.shape == out.shape and b.stride() == out.stride(),
                     f"{where}: a side operand must be f32 and laid out as the output")
            _alias_ok(where, out, b)  # (each element read, then written, by one program: out may be the side)
        s1, s2 = (*self.sides, out, out)[:2]
        return (s1, s2), {"STEPS": steps, "SIDES": chain_sides(list(steps))}


NO_EPILOGUE = Epilogue((), ())


def _launch(t: MatVecTile) -> dict:
    """A mat-vec launch's keyword arguments but the sum's: the tile's compile options and LAUNCH's, and the steps it
    asks the L2 for early where prefetching is on."""
    return {**LAUNCH, **t.options(), "EARLY": t.early if PREFETCH["on"] else 0}


def _mat_vecs(products, x: torch.Tensor, tile: MatVecTile | None = None, epilogue: Epilogue = NO_EPILOGUE,
              dtype: DType | None = None, glu: int = 0, hand_off: str | None = None) -> None:
    """Launch [(w, out)] or [(w_a, out_a), (w_b, out_b)]: grid axis 1 picks the product (and the K slice). One
    kernel and one tile for both, so each product of a pair is byte-identical to the single mat-vec of its weight.
    A weight with batch dimensions (attention's K and V views) is a batched product: grid axis 2 runs x's batches,
    each against the weight matrix ggml's broadcast gives it. ``epilogue`` (a single unbatched product): out = the
    product through its steps (:class:`Epilogue`). ``tile``: a benchmark's override of :func:`mat_vec_tile`.
    ``dtype``: the weights' type where they are quantized (``w``: their bytes, (..., M, row bytes)). ``glu`` (an
    unbatched pair, both outputs the one tensor): the pair's SwiGLU epilogue (:func:`_glu_store`). ``hand_off``
    ("q8_1"; a pair with ``glu``, or a single unbatched product): the output also handed on quantized to that form in
    the HAND_OFF_SLOT workspace, for the Q8_0 product after it (gdnpass.prepasses: the plan's hand-off)."""
    (w, out), (w2, out2) = products[0], products[-1]
    wtype = weight_type(w, dtype)
    M, K = w.shape[-2], w.shape[-1] // wtype.size * wtype.block if wtype.is_quantized else w.shape[-1]
    batched = w.shape[0] * w.shape[1] > 1
    N = mat_vec_columns(w.shape[0] * w.shape[1], x.shape[::-1])
    for v, y in products:
        _require(v.shape == w.shape and v.dtype == w.dtype and v.stride() == w.stride() and y.stride() == out.stride(),
                 "the products of a pair need weights and outputs of one shape, type and layout")
    _require(w.stride(-1) == 1 and (batched or w.numel() == M * w.shape[-1]),
             "mul_mat_vec needs weight matrices with contiguous rows")
    _require(not wtype.is_quantized or not batched and w.shape[-1] == wtype.row_bytes(K),
             f"mul_mat_vec: {wtype.label} rows of whole blocks, unbatched")
    require_whole_rows("mul_mat_vec", wtype, w)
    _require(not batched or len(products) == 1, "mul_mat_vec: a pair of batched products")
    _require(not epilogue.steps or not batched and len(products) == 1,
             "mul_mat_vec: an epilogue is one unbatched product's")
    _require(not glu or len(products) == 2 and not batched and out is out2,
             "mul_mat_vec: SwiGLU's epilogue is an unbatched pair's, into one output")
    sides, consts = epilogue.args(out, "mul_mat_vec")
    _require(not batched or x.shape[1] % w.shape[1] == 0 and x.shape[0] % w.shape[0] == 0,
             f"mul_mat_vec: weight batches {tuple(w.shape[:2])} do not broadcast over {tuple(x.shape[:2])}")
    _require(x.dtype == torch.float32, f"mul_mat_vec of {x.dtype} columns")
    most = QUANT_MAT_VEC_COLS if wtype.is_quantized else MAT_VEC_COLS
    _require(1 <= N <= most and x.stride(-1) == 1, f"mul_mat_vec takes 1..{most} contiguous columns")
    _require(x.shape[3] == K and out.shape[3] == M and (out.shape[:3] == x.shape[:3] if batched else
                                                           out.numel() == M * N),
             f"mul_mat_vec: columns of {x.shape[3]} for K {K}, output rows of {out.shape[3]} for M {M}")
    t = tile or mat_vec_tile(M, N, K, wtype.label, len(products))
    if batched:  # (attention's KQ / KQV: the "weight" is K / V, which kernels write; none asked for before the wait)
        t = t._replace(early=0)
    _require(t.split_k >= 1 and t.split_k & (t.split_k - 1) == 0, f"mul_mat_vec: split_k {t.split_k} is not 2^n")
    widths = {chunk_columns(N)} | ({8} if N <= 8 else set())  # (_group_dots: the sum is 8 wide or the dot's own)
    _require(not wtype.is_quantized or t.block_k == QK_K.value and t.dot and t.block_m >= 16 and t.cols in widths,
             f"mul_mat_vec: {wtype.label} weights need the tensor-core form (dot), K steps of {QK_K.value} and "
             f"tiles of >= 16 rows and {' or '.join(map(str, sorted(widths)))} columns for {N}")
    blocks, batches = triton.cdiv(M, t.block_m), x.shape[0] * x.shape[1] if batched else 1
    ws = cnt = None
    if t.split_k > 1 or glu:
        tiles = blocks * len(products) * batches
        ws, cnt = split_workspace(w.device, tiles * t.split_k * t.block_m * t.cols, tiles, "mul_mat_vec")
    xs, ys = _strides(x), _strides(out)
    if batched:  # columns are x's ne1 alone; ne2 / ne3 are the batches
        cols_x, cols_y = (N, 1, xs[1], 0, 0), (ys[0], ys[1], 0, 0)
        batch = (x.shape[1], x.shape[1] // w.shape[1], x.shape[0] // w.shape[0], w.stride(1), w.stride(0),
                 xs[2], xs[3], ys[2], ys[3])
    else:
        cols_x, cols_y = product_columns(x)[1], ys
        batch = (1, 1, 1, 0, 0, 0, 0, 0, 0)
    if wtype.is_quantized:
        x = quantize_activations(x, wtype, K, N, cols_x)
    hand = None
    if hand_off:  # (after the pre-pass: its fill of FILL_SLOT forgets the HAND_OFF_SLOT's key)
        _require((glu or len(products) == 1) and not batched and hand_off == "q8_1" and hands_on_q8_1(t)
                 and out.stride(3) == 1, f"mul_mat_vec: a product's epilogue hands on q8_1 groups of whole row blocks "
                 f"of one chunk's columns, contiguous, of a SwiGLU pair or a single unbatched product, not "
                 f"{hand_off} on a {t.block_m} x {t.cols} tile")
        hand = activations_to_fill(out, hand_off, N, product_columns(out)[1], "mul_mat_vec", slot=HAND_OFF_SLOT)[0]
        _require(hand.data_ptr() != x.data_ptr(), "mul_mat_vec: the epilogue would hand on into the activations its "
                                                  "own programs read (a hand-off's)")
    _mul_mat_vec_kernel[(blocks, len(products) * t.split_k, batches)](
        w, out, w2, out2, x, M, K, N, *cols_x[:2], w.stride(-2), *cols_x[2:], *cols_y, ws, cnt, *batch,
        *sides, None, 0, 0, activation_bytes(K) if wtype.is_quantized else 0, hand,
        BLOCK_M=t.block_m, COLS=t.cols, BLOCK_K=t.block_k, DOT=t.dot, SPLIT_K=t.split_k, EVICT=t.evict,
        QTYPE=QTYPES.get(wtype, ""), IDS=False, ALIGNED=aligned_rows(wtype, K, w, w2), GLU=glu,
        HAND_OFF=hand_off or "", **consts, **_launch(t))


def mul_mat_id_tile(M: int, K: int, wtype: str, batches: int) -> MatVecTile:
    """MUL_MAT_ID's tile: the mat-vec's of one column (:func:`mat_vec_tile`), a quantized one 16 columns wide, since
    its program's column is any of its activation chunk's 16 (``col0``). The columns change no byte."""
    t = mat_vec_tile(M, 1, K, wtype, batches)
    return t._replace(cols=XCOLS.value) if DType.parse(wtype).is_quantized else t


def quantize_activations(x: torch.Tensor, wtype: DType, K: int, N: int, cols_x: tuple) -> torch.Tensor:
    """A quantized product's pre-pass: x's N columns of K (``cols_x``: ne1, ne2 and the strides s1, s2, s3, as the
    mat-vec takes them) quantized for a ``wtype`` weight into the activation workspace (:func:`activation_bytes`
    a chunk of 16 columns, as many chunks as N needs: Q8_0's q8_1 groups, the K-quants' q8_K blocks), which it
    returns (uint8). Within :func:`gdnpass.prepasses.skipping` it launches nothing and returns the workspace as an
    earlier pre-pass of the same activations left it (a KernelError if it holds anything else)."""
    form = prepasses.form(wtype)
    if prepasses.skipping_now():  # an earlier product's pre-pass left these very activations (the executor's plan)
        return held_activations(x.device, activations_key(x, form, N, cols_x), "mul_mat_vec")
    acts, chunk, chunks = activations_to_fill(x, form, N, cols_x, "mul_mat_vec")
    _quantize_x_kernel[(XCOLS.value * chunks, triton.cdiv(K, QK_K.value))](x, acts, K, N, *cols_x, chunk,
                                                                            FORM=form, **LAUNCH)
    return acts


PRE_PASS_NAME = "_quantize_x"  # the pre-passes' kernel names begin so (a profiler's filter for them)


def mul_mat_vec(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor, dtype: DType | None = None) -> None:
    """MUL_MAT for few columns: w ne [K, M] (f32/f16/bf16, torch (..., M, K) with unit leading dims, contiguous rows;
    or quantized, ``dtype``, its bytes (..., M, row bytes)), x f32 ne [K, N1, N2, N3] with N1*N2*N3 <= 16 columns
    (a quantized weight's: <= 32, limits.QUANT_MAT_VEC_COLS), out f32 ne [M, N1, N2, N3]; or batched (plain types),
    as attention's KQ and KQV: w ne [K, M, W2, W3] (any batch strides, contiguous rows), x ne [K, N1, B2, B3] with
    N1 <= 16 and W2 | B2, W3 | B3, out ne [M, N1, B2, B3]."""
    _mat_vecs([(w, out)], x, dtype=dtype)


def mul_mat_vec_chain(w: torch.Tensor, x: torch.Tensor, steps: list[str], sides: list[torch.Tensor],
                      out: torch.Tensor, dtype: DType | None = None, quantize: str | None = None) -> None:
    """MUL_MAT_CHAIN: out = the product w·x through an elementwise chain's ``steps`` (side operands ``sides``), the
    mat-vec of :func:`mul_mat_vec` (a single matrix, 1-16 columns; beyond, the GEMM of :func:`mul_mat_gemm`, as
    MUL_MAT runs it) running them on each sum as it stores it (:class:`Epilogue`), so out holds the bytes of the
    unfused chain on that product. The sides and out are f32 views of the product's shape (torch: x's column dims,
    M); out may be a side itself (each element is read before it is written, in one program), and overlaps nothing
    else the launch reads. ``quantize`` ("q8_1": the form of the Q8_0 product that reads ``out`` next,
    gdnpass.prepasses): ``out`` also handed on so quantized, the bytes that product's pre-pass would write, in the
    HAND_OFF_SLOT workspace (the mat-vec's epilogue: :func:`_hand_on`)."""
    epilogue = Epilogue(tuple(steps), tuple(sides))
    if runs_as_gemm(weight_type(w, dtype), 1, x.shape[0] * x.shape[1] * x.shape[2]):
        _require(not quantize, "mul_mat_vec_chain: the GEMM hands nothing on")
        mul_mat_gemm(w, x, out, epilogue=epilogue)
        return
    _alias_ok("mul_mat_vec_chain", out, x, w, same_ok=False)
    _mat_vecs([(w, out)], x, epilogue=epilogue, dtype=dtype, hand_off=quantize)


def mul_mat_vec_add(w: torch.Tensor, x: torch.Tensor, r: torch.Tensor, out: torch.Tensor,
                    dtype: DType | None = None) -> None:
    """MUL_MAT_ADD: out = w·x + r, :func:`mul_mat_vec_chain` of the one step ADD (IEEE addition commutes: which
    operand of the unfused ADD the product was changes no bit), so out holds the bytes of the unfused ADD of the
    product and r."""
    mul_mat_vec_chain(w, x, ["ADD"], [r], out, dtype)


def mul_mat_vec_pair(w_a: torch.Tensor, w_b: torch.Tensor, x: torch.Tensor, out_a: torch.Tensor,
                     out_b: torch.Tensor, dtype: DType | None = None) -> None:
    """MUL_MAT_VEC_PAIR: out_a = w_a·x and out_b = w_b·x (same weight shape, type and strides; outputs of one layout)
    in one launch of the mul_mat_vec kernel (beyond 16 columns, of the GEMM, as MUL_MAT runs them), so each product
    is byte-identical to the single product of its weight alone."""
    if runs_as_gemm(weight_type(w_a, dtype), 1, x.shape[0] * x.shape[1] * x.shape[2]):
        mul_mat_gemm(w_a, x, out_a, second=(w_b, out_b))
        return
    _mat_vecs([(w_a, out_a), (w_b, out_b)], x, dtype=dtype)


def mul_mat_vec_pair_glu(w_a: torch.Tensor, w_b: torch.Tensor, x: torch.Tensor, out: torch.Tensor,
                         swapped: bool = False, dtype: DType | None = None, quantize: str | None = None) -> None:
    """MUL_MAT_VEC_PAIR with SwiGLU's epilogue (the pair_glu pattern): out = silu(w_a·x)·(w_b·x), or
    silu(w_b·x)·(w_a·x) when ``swapped``, in one launch of the pair's kernel and tile (``dtype``: the weights' block
    type, as :func:`mul_mat_vec_pair`'s), at mat-vec widths: each product's sum is the single product's bytes and the
    expression the GLU kernel's, so ``out`` holds the unfused GLU's bytes (:func:`_glu_store`). Neither product is
    stored. ``quantize`` ("q8_1": gdnpass.prepasses.form of the Q8_0 product that reads ``out`` next) also hands
    ``out`` on so quantized, the bytes that product's pre-pass would write, in the HAND_OFF_SLOT workspace."""
    N = x.shape[0] * x.shape[1] * x.shape[2]
    _require(runs_as_mat_vec(w_a.shape[-2], N), f"MUL_MAT_VEC_PAIR with SwiGLU: {N} columns are not the mat-vec's")
    _alias_ok("mul_mat_vec_pair_glu", out, x, w_a, w_b, same_ok=False)  # (a row block's y while others read x)
    _mat_vecs([(w_a, out), (w_b, out)], x, dtype=dtype, glu=2 if swapped else 1, hand_off=quantize)


def mul_mat_id(w: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
               dtype: DType | None = None) -> None:
    """MUL_MAT_ID at verify widths: w ne [K, M, n_as] (one matrix per expert, contiguous rows: f32 / f16 / bf16,
    torch (1, n_as, M, K); or quantized, ``dtype``, their bytes (1, n_as, M, row bytes)), x f32 ne [K, n_b, n_t] with
    n_b 1 or n_used, ids i32 ne [n_used, n_t], out f32 ne [M, n_used, n_t]: out[:, e, t] = w[:, :, ids[e, t]] @
    x[:, e % n_b, t], one column a (slot, token) on grid axis 2, its matrix found on the device (no host round trip:
    CUDA graphs capture it), so only the selected experts' rows are read. The mat-vec kernel and tile of one column
    (:func:`mul_mat_id_tile`): each product is the bytes of the single mat-vec of that expert's matrix and column. A
    quantized product's pre-pass quantizes the n_b·n_t columns once (chunks of 16, :func:`quantize_activations`);
    its program takes its column of a chunk, which the single mat-vec's sum makes alike in every place. Outside a
    CUDA-graph capture the ids are checked on the host first (a one-line error for an id outside the experts, as the
    reference's; under capture they are not read)."""
    wtype = weight_type(w, dtype)
    n_as, M = w.shape[1], w.shape[2]
    K = w.shape[3] // wtype.size * wtype.block if wtype.is_quantized else w.shape[3]
    n_t, n_b, n_used = x.shape[1], x.shape[2], ids.shape[3]
    _require(not wtype.is_quantized or w.shape[3] == wtype.row_bytes(K),
             f"MUL_MAT_ID: {wtype.label} rows of whole blocks")
    _require(w.shape[0] == 1 and x.shape[0] == 1 and ids.shape[:2] == (1, 1) and ids.shape[2] == n_t,
             f"MUL_MAT_ID: as {tuple(w.shape)}, b {tuple(x.shape)}, ids {tuple(ids.shape)} are not 3-D / 2-D of n_t")
    _require(n_b in (1, n_used), f"MUL_MAT_ID: b's {n_b} rows per token: the kernel takes 1 or n_used ({n_used})")
    _require(ids.dtype == torch.int32 and x.dtype == out.dtype == torch.float32 and x.shape[3] == K
             and tuple(out.shape) == (1, n_t, n_used, M), "MUL_MAT_ID: i32 ids, f32 b and output of the ops' shapes")
    _require(w.stride(-1) == 1 and x.stride(-1) == 1, "MUL_MAT_ID needs contiguous rows")
    require_whole_rows("MUL_MAT_ID", wtype, w)
    if out.numel() == 0:
        return
    on_gpu_capture = w.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not on_gpu_capture:
        sel = ids[0, 0]
        _require(bool(((sel >= 0) & (sel < n_as)).all()), f"MUL_MAT_ID: an expert id outside the {n_as} experts")
    batches = n_used * n_t  # a column a slot and token
    t = mul_mat_id_tile(M, K, wtype.label, batches)
    blocks = triton.cdiv(M, t.block_m)
    ws = cnt = None
    if t.split_k > 1:
        tiles = blocks * batches
        ws, cnt = split_workspace(w.device, tiles * t.split_k * t.block_m * t.cols, tiles, "mul_mat_id")
    xs, ys, i_s = _strides(x), _strides(out), _strides(ids)
    if wtype.is_quantized:  # column e % n_b + n_b·t of the pre-pass's chunks
        x = quantize_activations(x, wtype, K, *product_columns(x))  # (n_b·n_t columns: ne1 = n_b, ne2 = n_t)
        x_b2, x_b3, x_chunk = int(n_b > 1), n_b, activation_bytes(K)
    else:  # slot e reads row e % n_b
        x_b2, x_b3, x_chunk = xs[1] if n_b > 1 else 0, xs[2], 0
    _mul_mat_vec_kernel[(blocks, t.split_k, batches)](
        w, out, w, out, x, M, K, 1, 1, 1, w.stride(-2), xs[1], xs[2], xs[3], ys[0], ys[1], 0, 0, ws, cnt,
        n_used, 1, 1, w.stride(1), 0, x_b2, x_b3, ys[1], ys[2], out, out, ids, i_s[0], i_s[1], x_chunk, None,
        BLOCK_M=t.block_m, COLS=t.cols, BLOCK_K=t.block_k, DOT=t.dot, SPLIT_K=t.split_k, EVICT=t.evict,
        STEPS=(), SIDES=(), QTYPE=QTYPES.get(wtype, ""), IDS=True, ALIGNED=aligned_rows(wtype, K, w), **_launch(t))


# ---- MUL_MAT of more than 16 columns (the GEMM) ---------------------------------------------------------------------

GEMM_TERMS_BLOCK = 1024  # K elements a program of the bf16 terms pre-pass splits


@triton.jit
def _gemm_terms_kernel(x_ptr, t_ptr, K, N, ne1, ne2, x_s1, x_s2, x_s3, BLOCK: tl.constexpr):
    """A bf16 GEMM's pre-pass, program (column c, K block): the column's three bf16 terms (:func:`_split_bf16`) into
    the terms workspace, bf16 [3, N, K] (head, middle, tail planes; a column's K contiguous), so the GEMM's dot
    operands come straight from memory (pipelined into shared memory) instead of being split in registers by every
    row block at every K step. The reference: :func:`gemm_terms_reference`."""
    wait_for_previous_kernels()  # (the workspace may still be read by the launch before)
    c = tl.program_id(0)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = k < K
    hi, mid, lo = _split_bf16(tl.load(x_ptr + _row_offset(c, ne1, ne2, x_s1, x_s2, x_s3) + k, mask=mask))
    at = t_ptr + c.to(tl.int64) * K + k
    plane = N.to(tl.int64) * K
    tl.store(at, hi.to(tl.bfloat16), mask=mask)
    tl.store(at + plane, mid.to(tl.bfloat16), mask=mask)
    tl.store(at + 2 * plane, lo.to(tl.bfloat16), mask=mask)


def gemm_terms(x: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """The bf16 GEMM's pre-pass: x f32 ne [K, N1, N2, N3] (contiguous rows, any strides above) -> ``terms``, bf16
    with room for [3, N, K] (N = N1·N2·N3; the activation workspace, for the GEMM), returned as that [3, N, K]."""
    K, N = x.shape[3], x.shape[0] * x.shape[1] * x.shape[2]
    _require(x.dtype == torch.float32 and x.stride(-1) == 1 and terms.dtype == torch.bfloat16
             and terms.is_contiguous() and terms.numel() >= 3 * N * K,
             "gemm_terms: f32 columns with contiguous rows, into contiguous bf16 room for three terms of each")
    out = terms.reshape(-1)[:3 * N * K].view(3, N, K)
    xs = _strides(x)
    _gemm_terms_kernel[(N, triton.cdiv(K, GEMM_TERMS_BLOCK))](
        x, out, K, N, x.shape[2], x.shape[1], xs[1], xs[2], xs[3], BLOCK=GEMM_TERMS_BLOCK, **LAUNCH)
    return out


def gemm_terms_reference(x: torch.Tensor) -> torch.Tensor:
    """:func:`_gemm_terms_kernel`'s bytes in torch: x f32 [..., K] (N columns) -> bf16 [3, N, K], x's head, middle
    and tail bf16 terms (each rounded to nearest even; head + middle + tail == x exactly for finite x)."""
    x = x.reshape(-1, x.shape[-1]).float()
    hi = x.bfloat16()
    mid = (x - hi.float()).bfloat16()
    lo = (x - hi.float() - mid.float()).bfloat16()
    return torch.stack([hi, mid, lo])


@triton.jit
def _gemm_terms_sum(w_ptr, w_s1, rows, row_mask, t_ptr, t_plane, cols, col_mask, K, k0, k_len,
                    BLOCK_K: tl.constexpr):
    """Σ_k w[row, k]·x[col, k] over k in [k0, k0 + k_len) for bf16 weights, x as the pre-pass's terms: per K step
    the three bf16 x bf16 dots of :func:`_dot_terms` (tail, middle, head into one f32 accumulator), the mat-vec's
    tensor-core sum with its operands loaded rather than split. Returns [BLOCK_M, BLOCK_N]."""
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * w_s1
    t_cols = t_ptr + cols.to(tl.int64)[None, :] * K
    k_end = tl.minimum(k0 + k_len, K)
    acc = tl.zeros([rows.shape[0], cols.shape[0]], tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        kk = k + ks
        kmask = kk < k_end
        w = tl.load(w_rows + kk[None, :], mask=row_mask[:, None] & kmask[None, :], other=0.0)
        t_at, t_mask = t_cols + kk[:, None], kmask[:, None] & col_mask[None, :]
        hi = tl.load(t_at, mask=t_mask, other=0.0)
        mid = tl.load(t_at + t_plane, mask=t_mask, other=0.0)
        lo = tl.load(t_at + 2 * t_plane, mask=t_mask, other=0.0)
        acc = _dot_terms(w, hi, mid, lo, acc)
    return acc


@triton.jit
def _gemm_block(w_ptr, y_ptr, x_ptr, s1_ptr, s2_ptr, ws_ptr, cnt_ptr, rb, ct, s, tile, M, K, N, ne1, ne2, w_s1,
                x_s1, x_s2, x_s3, y_s0, y_s1, y_s2, y_s3, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, STEPS: tl.constexpr, SIDES: tl.constexpr):
    """Row block ``rb`` x column tile ``ct`` of one product, K slice ``s`` of SPLIT_K (workspace slot ``tile``).
    bf16 weights: ``x_ptr`` is the pre-pass's terms (:func:`_gemm_terms_sum`); f16: x itself, f32 (the mat-vec's
    f32 dot, :func:`matvec_cols` with IEEE)."""
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = ct * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    k_len = tl.cdiv(K, BLOCK_K * SPLIT_K) * BLOCK_K  # equal slices of whole K steps (the last short or empty)
    k0 = s * k_len
    if w_ptr.dtype.element_ty == tl.bfloat16:
        acc = _gemm_terms_sum(w_ptr, w_s1, rows, row_mask, x_ptr, N.to(tl.int64) * K, cols, col_mask, K, k0, k_len,
                              BLOCK_K)
    else:
        x_cols = _row_offset(cols, ne1, ne2, x_s1, x_s2, x_s3)
        acc = matvec_cols(w_ptr + k0, w_s1, rows, row_mask, x_ptr + k0, x_cols, col_mask,
                          tl.minimum(k_len, K - k0), BLOCK_K, True, IEEE=True)
    if SPLIT_K == 1:
        _store_y(y_ptr, acc, rows, row_mask, cols, col_mask, ne1, ne2, y_s0, y_s1, y_s2, y_s3, s1_ptr, s2_ptr,
                 STEPS, SIDES)
    elif store_slice(acc, ws_ptr, cnt_ptr, tile, s, SPLIT_K):
        _store_y(y_ptr, sum_slices(acc, ws_ptr, cnt_ptr, tile, SPLIT_K), rows, row_mask, cols, col_mask, ne1, ne2,
                 y_s0, y_s1, y_s2, y_s3, s1_ptr, s2_ptr, STEPS, SIDES)


@triton.jit
def _gemm_kernel(w_ptr, y_ptr, w2_ptr, y2_ptr, x_ptr, s1_ptr, s2_ptr, ws_ptr, cnt_ptr, M, K, N, ne1, ne2,
                 w_s1,                  # w [K, M], one matrix, contiguous rows (w2 alike)
                 x_s1, x_s2, x_s3,      # f16: x [K, ne1, ne2, ne3], contiguous rows, N = ne1*ne2*ne3 columns
                 y_s0, y_s1, y_s2, y_s3,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 STEPS: tl.constexpr, SIDES: tl.constexpr, PAIR: tl.constexpr):
    """y[rows, cols] = w[rows]·x[cols] for one (row block, column tile, K slice) (:func:`_gemm_block`). The grid:
    product-major (PAIR, MUL_MAT_VEC_PAIR: a second product w2 -> y2 of the same shape and layouts, each program the
    single GEMM's code), then K slice, row block, column tile (the column tiles of a row block side by side, so its
    weight rows come from HBM once and from the L2 after). STEPS (MUL_MAT_ADD, MUL_MAT_CHAIN): y = the sum through
    them, their side operands laid out as y (the mat-vec's store, :func:`_store_y`). SPLIT_K > 1: the mat-vec's split
    protocol (:func:`store_slice`)."""
    wait_for_previous_kernels()
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    product, r = pid // (tiles * SPLIT_K), pid % (tiles * SPLIT_K)
    s, t = r // tiles, r % tiles
    if PAIR and product == 1:  # the pair's second product: its pointers into the one call (two calls would each
        w_ptr = w2_ptr         # get shared memory for their pipeline: twice sm_90's at 64 x 32 x 128, 4 stages)
        y_ptr = y2_ptr
    _gemm_block(w_ptr, y_ptr, x_ptr, s1_ptr, s2_ptr, ws_ptr, cnt_ptr, t // tiles_n, t % tiles_n, s,
                product * tiles + t, M, K, N, ne1, ne2, w_s1, x_s1, x_s2, x_s3, y_s0, y_s1, y_s2, y_s3, BLOCK_M,
                BLOCK_N, BLOCK_K, SPLIT_K, STEPS, SIDES)  # (a pair has no epilogue)


def mul_mat_gemm(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor, tile: GemmTile | None = None,
                 epilogue: Epilogue = NO_EPILOGUE, second: tuple | None = None) -> None:
    """MUL_MAT of many columns (:func:`gdnpass.kernels.limits.runs_as_gemm`): w ne [K, M] one f16 / bf16 matrix
    (torch (1, 1, M, K), contiguous rows), x f32 ne [K, N1, N2, N3] of any N1·N2·N3 columns (contiguous rows, any
    strides above), out f32 ne [M, N1, N2, N3] (any strides). The weight is read as it is (no f32 copy, as torch's
    matmul needs); the sum is the mat-vec's tensor-core form at f32-level accuracy, K in order within a program and
    K slices added in a fixed order: the same bytes every run. bf16 weights: two launches, x's bf16 terms first
    (:func:`_gemm_terms_kernel`, into the activation workspace), then the GEMM. ``tile``: a test's or benchmark's
    override of :func:`gemm_tile`. ``epilogue`` (MUL_MAT_ADD's, MUL_MAT_CHAIN's, :class:`Epilogue`): out = the
    product through its steps, the product's bytes then the unfused nodes' roundings. ``second`` (MUL_MAT_VEC_PAIR's):
    ``(w2, out2)`` of w's shape, type and strides and out's layout, computed in the same launch with w's tile (and
    the same terms), so each is the single GEMM's bytes."""
    wtype = weight_type(w)
    M, K = w.shape[-2], w.shape[-1]
    N = x.shape[0] * x.shape[1] * x.shape[2]
    _require(wtype.label in GEMM_WEIGHTS, f"mul_mat_gemm of {wtype.label} weights (takes {', '.join(GEMM_WEIGHTS)})")
    _require(w.shape[:2] == (1, 1) and w.stride(-1) == 1, "mul_mat_gemm needs one weight matrix with contiguous rows")
    _require(x.dtype == out.dtype == torch.float32 and x.stride(-1) == 1,
             f"mul_mat_gemm takes f32 columns with contiguous rows into f32, not {x.dtype} into {out.dtype}")
    _require(x.shape[3] == K and out.shape[3] == M and out.shape[:3] == x.shape[:3],
             f"mul_mat_gemm: columns {tuple(x.shape)} for K {K}, output {tuple(out.shape)} for M {M}")
    w2, out2 = second if second is not None else (w, out)
    _require(second is None or not epilogue.steps and w2.dtype == w.dtype and w2.shape == w.shape
             and w2.stride() == w.stride() and out2.dtype == out.dtype and out2.shape == out.shape
             and out2.stride() == out.stride(),
             "mul_mat_gemm: a pair's second weight and output must be laid out as the first (and no epilogue)")
    sides, consts = epilogue.args(out, "mul_mat_gemm")
    if out.numel() == 0:
        return
    _alias_ok("mul_mat_gemm", out, x, w, same_ok=False)  # (a program writes rows other programs' sums still read)
    if second is not None:
        _alias_ok("mul_mat_gemm", out2, x, w, w2, out, same_ok=False)
        _alias_ok("mul_mat_gemm", out, w2, same_ok=False)
    t = tile or gemm_tile(M, N, K, wtype.label)
    xs, ys, ne1, ne2 = _strides(x), _strides(out), x.shape[2], x.shape[1]
    products = 1 if second is None else 2
    tiles = triton.cdiv(M, t.block_m) * triton.cdiv(N, t.block_n)
    ws = cnt = None
    if t.split_k > 1:
        ws, cnt = split_workspace(w.device, products * tiles * t.split_k * t.block_m * t.block_n, products * tiles,
                                  "mul_mat_gemm")
    if pre_pass(wtype, "gemm"):  # x's bf16 terms: the operand the GEMM reads in x's place
        x = gemm_terms(x, activation_workspace(w.device, 6 * N * K, "mul_mat_gemm")[:6 * N * K].view(torch.bfloat16))
    _gemm_kernel[(products * t.split_k * tiles,)](
        w, out, w2, out2, x, *sides, ws, cnt, M, K, N, ne1, ne2, w.stride(-2),
        xs[1], xs[2], xs[3], *ys, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT_K=t.split_k,
        PAIR=second is not None, **consts,
        **{**LAUNCH, "num_warps": t.warps, "num_stages": t.stages})


# ---- launch sizes (for cost estimates) ------------------------------------------------------------------------------


def mat_vec_programs(w, x, products: int = 1) -> list[tuple[str, int, int]]:
    """The mat-vec's programs for weight ``w`` and activation ``x`` (graph tensors), ``products`` weights of that
    shape in one launch (the pair's 2), after a quantized weight's pre-pass (its own launch); empty for a product
    of over 16 columns (the GEMM's or torch's: :func:`programs`)."""
    batches = x.ne[2] * x.ne[3] if w.ne[2] * w.ne[3] != 1 else 1  # attention's batched KQ / KQV
    N = mat_vec_columns(w.ne[2] * w.ne[3], x.ne)
    return _launch_programs(w, N, batches, products) if runs_as_mat_vec(w.ne[1], N) else []


def _launch_programs(w, N: int, batches: int = 1, products: int = 1) -> list[tuple[str, int, int]]:
    """One mat-vec launch's programs (and a quantized weight's pre-pass, a program per column of its chunks and 256
    elements) for N columns of each batch (<= 16; a quantized weight's <= 32)."""
    K, M = w.ne[0], w.ne[1]
    t = mat_vec_tile(M, N, K, w.type.label)
    pre = [("quantize_x", chunk_columns(N) * triton.cdiv(K, QK_K.value), 1)] if w.type.is_quantized else []
    return pre + [("mat_vec", triton.cdiv(M, t.block_m) * t.split_k * batches * products,
                   triton.cdiv(K, t.block_k * t.split_k))]


def programs(node) -> list[tuple[str, int, int]]:
    """:func:`gdnpass.kernels.backends.programs` for MUL_MAT (steps: K blocks per program; the mat-vec's, or the
    GEMM's beyond 16 columns) and MUL_MAT_ID (a column a slot and token, after a quantized weight's pre-pass of every
    column; a quantized weight's over 16 columns: the mat-vec's of each 32, limits.mul_mat_path); empty for other
    ops and for the MUL_MATs of over 16 columns that run on torch (the pair's are its record's:
    gdnpass.patterns.mat_vec_pair). Pure: reads shapes only."""
    from gdnpass.ir import Op

    if node.op is Op.MUL_MAT_ID:
        w, x, ids = node.src
        t = mul_mat_id_tile(w.ne[1], w.ne[0], w.type.label, ids.ne[0] * ids.ne[1])
        pre = [("quantize_x", chunk_columns(x.ne[1] * x.ne[2]) * triton.cdiv(w.ne[0], QK_K.value), 1)] \
            if w.type.is_quantized else []
        return pre + [("mat_vec", triton.cdiv(w.ne[1], t.block_m) * t.split_k * ids.ne[0] * ids.ne[1],
                       triton.cdiv(w.ne[0], t.block_k * t.split_k))]
    return product_programs(*node.src) if node.op is Op.MUL_MAT else []


def product_programs(w, x, products: int = 1) -> list[tuple[str, int, int]]:
    """A MUL_MAT's programs for weight ``w`` and activation ``x`` (graph tensors), as :func:`programs` counts them:
    the GEMM's, a quantized weight's mat-vec per 32 columns, the mat-vec's, or none (torch's matmul); ``products``
    weights of that shape in one launch (the pair's 2: the mat-vec's or the GEMM's)."""
    path, N = mul_mat_path(w.type, w.ne[2] * w.ne[3], w.ne[1], x.ne), mat_vec_columns(w.ne[2] * w.ne[3], x.ne)
    if path == "gemm":
        t, K = gemm_tile(w.ne[1], N, w.ne[0], w.type.label), w.ne[0]
        pre = [("gemm_terms", N * triton.cdiv(K, GEMM_TERMS_BLOCK), 1)] if pre_pass(w.type, path) else []
        return pre + [("gemm", products * t.split_k * triton.cdiv(w.ne[1], t.block_m) * triton.cdiv(N, t.block_n),
                       triton.cdiv(K, t.block_k * t.split_k))]
    if path == "chunks":  # a quantized weight's, 32 columns a launch
        return [p for c in range(mat_vec_chunks(N))
                for p in _launch_programs(w, min(QUANT_MAT_VEC_COLS, N - c * QUANT_MAT_VEC_COLS))]
    return mat_vec_programs(w, x, products)
