"""Triton kernels of the data movement (GET_ROWS, CONCAT, CPY/CONT, SET_ROWS) and the elementwise ops (ADD, MUL, DIV,
UNARY, GLU, SCALE, CLAMP): one program per ELT_BLOCK elements (SET_ROWS: per row and ELT_BLOCK elements). Conventions and
the shared helpers (SiLU, exp and log as torch computes them): :mod:`gdnpass.kernels.triton_core`.

The data-movement kernels move bits (int views of the tensors, :func:`_bits`) or convert as torch converts
(:func:`convert`), so their bytes are the reference's everywhere; the elementwise ones write the reference's
expressions operation for operation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnpass.kernels.limits import check_row_ids
from gdnpass.kernels.reference import f32
from gdnpass.kernels.triton_core import (GROUPS_K, LAUNCH, Q4_K_BYTES, Q5_K_BYTES, Q6_K_PLANES,
                                         QK_K, QTYPES, SUB, _alias_ok, _byte, _f16, _repeats, _require, _row_offset,
                                         _src1_at, XCOLS, _scale_min_k4, _strides, activations_to_fill, chain_args,
                                         chain_at, chain_sides, clamp_f32, product_columns, require_whole_rows,
                                         silu_f32, store_activations, unary_f32, wait_for_previous_kernels)

ELT_BLOCK = 1024    # elements per program (the elementwise and data-movement kernels)


# ---- launch helpers -------------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same size: a copy of these is a copy of the bits (NaN payloads, -0.0)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _elementwise(op: str, out: torch.Tensor, *srcs: torch.Tensor) -> None:
    """The checks of a one-pass kernel over ``out`` (non-empty): int32 offsets suffice, and the aliasing is one it
    can do (:func:`_alias_ok`)."""
    _require(out.numel() < 2**31 and all(sum((d - 1) * s for d, s in zip(t.shape, t.stride())) < 2**31
                                         for t in (out, *srcs)), f"{op}: offsets beyond int32")
    _alias_ok(op, out, *srcs)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, ELT_BLOCK),)


# ---- GET_ROWS -------------------------------------------------------------------------------------------------------


@triton.jit
def _get_rows_kernel(a_ptr, ids_ptr, y_ptr, n, ne0, n_ids, e1, n_rows,
                     a_s0, a_s1, a_s2, a_s3,   # a [ne0, n_rows, e1, e2], any strides (int64 offsets: a may be large)
                     i_s0, i_s1, i_s2,         # ids [n_ids, e1, e2] i32
                     y_s0, y_s1, y_s2, y_s3,   # y [ne0, n_ids, e1, e2], written as int32 bits
                     SRC: tl.constexpr, BLOCK: tl.constexpr):
    wait_for_previous_kernels()
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    i0, r = idx % ne0, idx // ne0
    i, j, k = r % n_ids, r // n_ids % e1, r // (n_ids * e1)
    row = tl.load(ids_ptr + i * i_s0 + j * i_s1 + k * i_s2, mask=mask, other=0)
    ok = mask & (row >= 0) & (row < n_rows)  # never read outside a (the launcher has refused such ids already)
    src = a_ptr + (i0.to(tl.int64) * a_s0 + row.to(tl.int64) * a_s1 + j.to(tl.int64) * a_s2 + k.to(tl.int64) * a_s3)
    if SRC == "f16":  # exact; a NaN: CUDA's conversion gives 0x7FFFFFFF (as torch's there); the interpreter's keeps
        # the payload, quieted here as x86's vcvtph2ps (torch's vectorised CPU conversion) quiets it
        x = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        bits = tl.where(x != x, bits | 0x400000, bits)
    elif SRC == "bf16":  # bf16 is the top half of an f32: a shift (the interpreter's bf16 cast is not exact)
        bits = tl.load(src, mask=ok, other=0).to(tl.int32) << 16
    else:  # f32 or i32: the bits themselves
        bits = tl.load(src, mask=ok, other=0)
    tl.store(y_ptr + i0 * y_s0 + _row_offset(r, n_ids, e1, y_s1, y_s2, y_s3), tl.where(ok, bits, -1), mask=mask)


_GET_ROWS_SRC = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int32: "i32"}


def _check_ids(ids: torch.Tensor, n_rows: int, op: str = "GET_ROWS") -> None:
    """Every id names a row of the source (:func:`limits.check_row_ids`, on the host before the launch). Not
    possible while a CUDA graph is being captured (the ids are only read at replay): there the kernel's mask is the
    guard, and a row of an out-of-range id is written 0xFFFFFFFF (NaN; -1 for i32 sources), never read from outside
    the source."""
    check_row_ids(ids, n_rows, op)


def get_rows(a: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, dtype=None) -> None:
    """GET_ROWS into ``out``: ``out[k, j, i, :] = a[k, j, ids[0, k, j, i], :]`` (semantics :func:`reference.get_rows`).
    a ne [ne0, rows, e1, e2] f32/f16/bf16 (out f32) or i32 (out i32), any strides; ids i32 ne [n, e1, e2] any
    strides; out ne [ne0, n, e1, e2] any strides. One program per ELT_BLOCK output elements; values are moved as
    bits (f16 through the exact hardware conversion), so the bytes are the reference's. Raises KernelError for an
    id outside 0..rows-1 (see :func:`_check_ids`). A quantized ``dtype`` (a: the rows' bytes, ne [row bytes, rows,
    e1, e2], contiguous rows): each row taken is decoded (:func:`_get_rows_quantized`)."""
    if out.numel() == 0:
        return
    if dtype is not None and dtype.is_quantized:
        return _get_rows_quantized(a, ids, out, dtype)
    e2, e1, n_ids = ids.shape[1], ids.shape[2], ids.shape[3]
    _require(ids.dtype == torch.int32 and ids.shape[0] == 1, "GET_ROWS ids must be i32 ne [n, e1, e2]")
    _require(a.dtype in _GET_ROWS_SRC, f"GET_ROWS of {a.dtype} rows")
    _require(tuple(a.shape[:2]) == (e2, e1), f"GET_ROWS ids {tuple(ids.shape)} do not match rows {tuple(a.shape)}")
    _require(tuple(out.shape) == (e2, e1, n_ids, a.shape[3]), f"GET_ROWS output shape {tuple(out.shape)}")
    _require(out.dtype == (torch.int32 if a.dtype == torch.int32 else torch.float32), f"GET_ROWS output {out.dtype}")
    _elementwise("GET_ROWS", out, ids)  # (a may be large: the kernel's offsets into a are int64)
    _alias_ok("GET_ROWS", out, ids, a, same_ok=False)
    _check_ids(ids, a.shape[2])
    src = a.dtype
    a = _bits(a) if src in (torch.float32, torch.int32, torch.bfloat16) else a
    _get_rows_kernel[_grid(out.numel())](
        a, ids, _bits(out), out.numel(), out.shape[3], n_ids, e1, a.shape[2], *_strides(a), *_strides(ids)[:3],
        *_strides(out), SRC=_GET_ROWS_SRC[src], BLOCK=ELT_BLOCK, **LAUNCH)


ROWS_NS = 8  # sub-blocks per GET_ROWS program: 256 elements (a K-quant block)


@triton.jit
def quantized_groups(w_ptr, row_off, row_mask, g, g_mask, K, QTYPE: tl.constexpr):
    """Groups ``g`` ([G] indices: elements [32g, 32g + 32)) of the ``K``-element weight rows at byte offsets
    ``row_off`` ([BLOCK_M] int64) from ``w_ptr`` (uint8, the rows as gdnpass holds them: quants.held_rows):
    (q, scale, scale2, offset), q the int32 quants [G, BLOCK_M, 32], the others [G, BLOCK_M]; element l's value is
    ``scale * q - offset`` (Q6_K: ``scale`` for l < 16, ``scale2`` after; no offset: zero). Masked rows and groups
    read nothing (zeros)."""
    lane = tl.arange(0, SUB)[None, None, :]
    rows = (w_ptr + row_off)[None, :]                             # [1, BLOCK_M]
    mask = g_mask[:, None] & row_mask[None, :]                    # [G, BLOCK_M]
    m3 = mask[:, :, None]
    if QTYPE == "q8_0":  # held rows split (quants.held_rows): element k's quant at byte k, group g's f16 d at K + 2g
        q = _byte(rows[:, :, None] + (g * SUB)[:, None, None] + lane, m3).to(tl.int8).to(tl.int32)
        a = _f16(rows + K + 2 * g[:, None], mask)
        a2, b = a, tl.zeros_like(a)
    elif QTYPE == "q4_k" or QTYPE == "q5_k":
        # {f16 d, dmin; u8 scales[12]; (Q5_K: u8 qh[32];) u8 qs[128]}: sub-block j's element l is nibble j % 2 of
        # qs[32 * (j // 2) + l] (Q5_K: plus 16 if bit j of qh[l]); value (d * sc_j) * q - dmin * m_j
        SIZE: tl.constexpr = Q4_K_BYTES if QTYPE == "q4_k" else Q5_K_BYTES
        QS: tl.constexpr = SIZE - QK_K // 2
        blk = rows + (g // GROUPS_K)[:, None] * SIZE
        j = (g % GROUPS_K)[:, None]
        w32 = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        sw = (row_off[None, :] + (g // GROUPS_K)[:, None] * SIZE) // 4 + 1  # the scale bytes' three words
        sc, m = _scale_min_k4(tl.load(w32 + sw, mask=mask, other=0), tl.load(w32 + sw + 1, mask=mask, other=0),
                              tl.load(w32 + sw + 2, mask=mask, other=0), j)
        q = (_byte(blk[:, :, None] + QS + (32 * (j // 2))[:, :, None] + lane, m3) >> (4 * (j % 2))[:, :, None]) & 0xF
        if QTYPE == "q5_k":
            q += ((_byte(blk[:, :, None] + 16 + lane, m3) >> j[:, :, None]) & 1) << 4
        a = _f16(blk, mask) * sc
        a2, b = a, _f16(blk + 2, mask) * m
    else:
        tl.static_assert(QTYPE == "q6_k", "quantized_groups: an unknown block type")
        # held rows split (quants.held_rows): block sb's {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d} in their
        # planes (Q6_K_PLANES) at 128 sb, K/2 + 64 sb, 3K/4 + 16 sb, 13K/16 + 2 sb. Group j of a block (half
        # n = j // 4, quarter p = j % 4): element l is nibble p // 2 of ql[64n + 32(p % 2) + l] below bits 2p, 2p + 1
        # of qh[32n + l], minus 32, times d * scales[8n + 2p + l // 16]
        sb, blocks = (g // GROUPS_K)[:, None], K // QK_K
        j = (g % GROUPS_K)[:, None]
        n, p = j // 4, j % 4
        lo = (_byte(rows[:, :, None] + (128 * sb + 64 * n + 32 * (p % 2))[:, :, None] + lane, m3)
              >> (4 * (p // 2))[:, :, None]) & 0xF
        hi = (_byte(rows[:, :, None] + (blocks * Q6_K_PLANES[1] + 64 * sb + 32 * n)[:, :, None] + lane, m3)
              >> (2 * p)[:, :, None]) & 3
        q = (lo | (hi << 4)) - 32
        d = _f16(rows + blocks * Q6_K_PLANES[3] + 2 * sb, mask)
        sc = rows + blocks * Q6_K_PLANES[2] + 16 * sb + 8 * n + 2 * p
        a = d * _byte(sc, mask).to(tl.int8).to(tl.float32)
        a2, b = d * _byte(sc + 1, mask).to(tl.int8).to(tl.float32), tl.zeros_like(a)
    return q, a, a2, b


@triton.jit
def dequantized_groups(w_ptr, row_off, row_mask, g, g_mask, K, QTYPE: tl.constexpr):
    """Groups ``g`` of the rows as their f32 values [G, BLOCK_M, 32]: ggml's dequantization, bit for bit."""
    q, a, a2, b = quantized_groups(w_ptr, row_off, row_mask, g, g_mask, K, QTYPE)
    scale = tl.where(tl.arange(0, SUB)[None, None, :] < 16, a[:, :, None], a2[:, :, None])
    return scale * q.to(tl.float32) - b[:, :, None]


@triton.jit
def _get_rows_q_kernel(a_ptr, ids_ptr, y_ptr, K, n_ids, e1, n_rows, a_s1, a_s2, a_s3, i_s0, i_s1, i_s2,
                       y_s1, y_s2, y_s3, NS: tl.constexpr, QTYPE: tl.constexpr):
    """Program (i, c, batch): elements [c * 32 * NS, ...) of row ids[i, j, k] of a's batch (j, k) into y's row i.
    An id outside the rows (only under CUDA-graph capture: the launcher refuses them otherwise) reads nothing and
    writes NaN, as the plain types' GET_ROWS kernel."""
    wait_for_previous_kernels()
    i = tl.program_id(0)
    j, k = tl.program_id(2) % e1, tl.program_id(2) // e1
    row = tl.load(ids_ptr + i * i_s0 + j * i_s1 + k * i_s2 + tl.arange(0, 1))
    ok = (row >= 0) & (row < n_rows)
    at = row.to(tl.int64) * a_s1 + j.to(tl.int64) * a_s2 + k.to(tl.int64) * a_s3
    y_row = y_ptr + i.to(tl.int64) * y_s1 + j.to(tl.int64) * y_s2 + k.to(tl.int64) * y_s3
    g = tl.program_id(1) * NS + tl.arange(0, NS)                 # its groups of 32
    ks = g[:, None] * SUB + tl.arange(0, SUB)[None, :]           # [NS, 32]
    v = dequantized_groups(a_ptr, at, ok, g, g * SUB < K, K, QTYPE)  # [NS, 1, 32]
    v = tl.where(ok[None, :, None], v, float("nan"))
    tl.store(y_row + ks[:, None, :], v, mask=(ks < K)[:, None, :])


def _get_rows_quantized(a: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, dtype) -> None:
    """GET_ROWS of ``dtype`` rows (``a``: their bytes as gdnpass holds them, quants.held_rows, ne [row bytes, rows,
    e1, e2] with contiguous rows) into f32 ``out`` ne [ne0, n, e1, e2] with contiguous rows: each row decoded as
    :func:`quants.dequantize` decodes the file's."""
    _require(dtype in QTYPES and a.dtype == torch.uint8 and a.stride(3) == 1, f"GET_ROWS of {dtype.label} rows")
    _require(ids.dtype == torch.int32 and ids.shape[0] == 1 and tuple(a.shape[:2]) == tuple(ids.shape[1:3]),
             f"GET_ROWS ids {tuple(ids.shape)} do not match rows {tuple(a.shape)}")
    K = out.shape[3]
    _require(a.shape[3] == dtype.row_bytes(K) and out.dtype == torch.float32 and out.stride(3) == 1
             and tuple(out.shape[:3]) == (a.shape[0], a.shape[1], ids.shape[3]),
             f"GET_ROWS of {dtype.label} rows of {a.shape[3]} bytes into {tuple(out.shape)}")
    require_whole_rows("GET_ROWS", dtype, a)
    _alias_ok("GET_ROWS", out, ids, a, same_ok=False)
    _check_ids(ids, a.shape[2])
    e2, e1, n_ids = ids.shape[1], ids.shape[2], ids.shape[3]
    i_s = _strides(ids)
    _get_rows_q_kernel[(n_ids, triton.cdiv(K, ROWS_NS * SUB.value), e1 * e2)](
        a, ids, out, K, n_ids, e1, a.shape[2], *_strides(a)[1:], *i_s[:3], *_strides(out)[1:],
        NS=ROWS_NS, QTYPE=QTYPES[dtype], **LAUNCH)


# ---- CONCAT ---------------------------------------------------------------------------------------------------------


@triton.jit
def _concat_kernel(a_ptr, b_ptr, y_ptr, n, ne0, ne1, ne2, na, b_shift,
                   a_s0, a_s1, a_s2, a_s3, b_s0, b_s1, b_s2, b_s3, y_s0, y_s1, y_s2, y_s3,
                   DIM: tl.constexpr, BLOCK: tl.constexpr):
    wait_for_previous_kernels()
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    i0, r = idx % ne0, idx // ne0
    i1, i2, i3 = r % ne1, r // ne1 % ne2, r // (ne1 * ne2)
    if DIM == 0:
        d = i0
    elif DIM == 1:
        d = i1
    elif DIM == 2:
        d = i2
    else:
        d = i3
    in_a = d < na
    a = tl.load(a_ptr + i0 * a_s0 + i1 * a_s1 + i2 * a_s2 + i3 * a_s3, mask=mask & in_a)
    b = tl.load(b_ptr + (i0 * b_s0 + i1 * b_s1 + i2 * b_s2 + i3 * b_s3 - b_shift), mask=mask & (d >= na))
    tl.store(y_ptr + i0 * y_s0 + i1 * y_s1 + i2 * y_s2 + i3 * y_s3, tl.where(in_a, a, b), mask=mask)


def concat(a: torch.Tensor, b: torch.Tensor, dim: int, out: torch.Tensor) -> None:
    """CONCAT along ggml dim ``dim`` (0..3) into ``out``: b follows a (semantics :func:`reference.concat`). a, b and
    out of one type (any), any strides. One program per ELT_BLOCK output elements, each element copied as bits."""
    if out.numel() == 0:
        return
    _require(0 <= dim <= 3 and a.dtype == b.dtype == out.dtype, f"CONCAT dim {dim} of {a.dtype}, {b.dtype}")
    t = 3 - dim
    want = list(a.shape)
    want[t] += b.shape[t]
    _require(all(a.shape[i] == b.shape[i] for i in range(4) if i != t) and list(out.shape) == want,
             f"CONCAT of {tuple(a.shape)} and {tuple(b.shape)} along {dim} into {tuple(out.shape)}")
    _elementwise("CONCAT", out, a, b)
    bs = _strides(b)
    _concat_kernel[_grid(out.numel())](
        _bits(a), _bits(b), _bits(out), out.numel(), out.shape[3], out.shape[2], out.shape[1], a.shape[t],
        a.shape[t] * bs[dim], *_strides(a), *bs, *_strides(out), DIM=dim, BLOCK=ELT_BLOCK, **LAUNCH)


# ---- CPY / CONT -----------------------------------------------------------------------------------------------------


@triton.jit
def f32_to_bf16_bits(x, nan_bits):
    """f32 -> bf16 bits, round to nearest even (what cvt.rn.bf16.f32 and torch's conversion do for every non-NaN;
    overflow rounds to inf), in integer arithmetic: the interpreter's bf16 cast truncates. NaN -> ``nan_bits``."""
    u = x.to(tl.int32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, nan_bits, r).to(tl.int16)


@triton.jit
def convert(x, MODE: tl.constexpr, nan_bits):
    """An f32 element as CPY / SET_ROWS store it: MODE "f16" / "bf16" (the bits, round to nearest even), "i32"
    (toward zero), or "bits" (same type: as it is)."""
    if MODE == "f16":  # round to nearest even (the hardware conversion, as torch's; CUDA: every NaN 0x7FFF), a
        # NaN quieted as x86's vcvtps2ph quiets it (torch's CPU conversion; the interpreter's numpy keeps it signaling)
        h = x.to(tl.float16).to(tl.int16, bitcast=True)
        y = tl.where(x != x, h | 0x200, h)
    elif MODE == "bf16":
        y = f32_to_bf16_bits(x, nan_bits)
    elif MODE == "i32":
        y = x.to(tl.int32)  # toward zero
    else:  # same type: the bits
        y = x
    return y


@triton.jit
def _cpy_kernel(x_ptr, y_ptr, n, x_ne0, x_ne1, x_ne2, x_s0, x_s1, x_s2, x_s3,
                y_ne0, y_ne1, y_ne2, y_s0, y_s1, y_s2, y_s3, nan_bits,
                MODE: tl.constexpr, BLOCK: tl.constexpr):
    # element idx (row-major) of x goes to element idx (row-major) of y: the shapes may differ, the counts do not
    wait_for_previous_kernels()
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + (idx % x_ne0) * x_s0 + _row_offset(idx // x_ne0, x_ne1, x_ne2, x_s1, x_s2, x_s3), mask=mask)
    y = convert(x, MODE, nan_bits)
    tl.store(y_ptr + (idx % y_ne0) * y_s0 + _row_offset(idx // y_ne0, y_ne1, y_ne2, y_s1, y_s2, y_s3), y, mask=mask)


# torch's f32 -> bf16 NaN: 0xFFFF on the CPU (its AVX2/AVX-512 conversion), 0x7FFF on CUDA (cvt.rn.bf16.f32)
_BF16_NAN = {"cpu": -1, "cuda": 0x7FFF}


def _conversion(op: str, src: torch.Tensor, dst: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(MODE of :func:`convert`, the source and destination as the kernel reads and writes them: int views where
    bits move) for storing ``src``'s elements in ``dst``'s type: f32 -> f32/f16/bf16/i32, or any type to itself."""
    same = src.dtype == dst.dtype
    modes = {torch.float16: "f16", torch.bfloat16: "bf16", torch.int32: "i32"}
    _require(same and src.element_size() in (2, 4) or src.dtype == torch.float32 and dst.dtype in modes,
             f"{op} {src.dtype} -> {dst.dtype}")
    mode = "bits" if same else modes[dst.dtype]
    return mode, (_bits(src) if same else src), (_bits(dst) if mode in ("bits", "bf16", "f16") else dst)


def cpy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """CPY / CONT into ``dst``: element i of ``src`` (row-major) to element i of ``dst`` (semantics
    :func:`reference.cpy`), both of any shape and strides, the same element count. f32 -> f32/f16/bf16/i32 (f16
    and bf16 round to nearest even, i32 toward zero), or any type to itself (the bits). One program per ELT_BLOCK
    elements."""
    n = src.numel()
    _require(n == dst.numel(), f"CPY of {n} elements into {dst.numel()}")
    if n == 0:
        return
    _elementwise("CPY", dst, src)
    mode, x, y = _conversion("CPY", src, dst)
    _cpy_kernel[_grid(n)](
        x, y, n, src.shape[3], src.shape[2], src.shape[1], *_strides(src), dst.shape[3], dst.shape[2], dst.shape[1],
        *_strides(dst), _BF16_NAN.get(dst.device.type, 0x7FFF), MODE=mode, BLOCK=ELT_BLOCK, **LAUNCH)


@triton.jit
def _set_rows_kernel(r_ptr, ids_ptr, y_ptr, ne0, ne1, ne2, n_dst_rows, nan_bits,
                     r_s1, r_s2, r_s3,                 # rows [ne0, ne1, ne2, ne3], contiguous rows
                     i_s0, i_s1, i_s2, i_ne1, i_ne2,   # ids [ne1, i_ne1, i_ne2]: plane (i2, i3) reads ids % ..
                     y_s1, y_s2, y_s3,                 # dst [ne0, n_dst_rows, ne2, ne3], contiguous rows
                     MODE: tl.constexpr, BLOCK: tl.constexpr):
    wait_for_previous_kernels()
    row = tl.program_id(0).to(tl.int64)  # (offsets in int64: a KV cache can exceed 2^31 elements)
    i1, i2, i3 = row % ne1, row // ne1 % ne2, row // (ne1 * ne2)
    rid = tl.load(ids_ptr + i1 * i_s0 + (i2 % i_ne1) * i_s1 + (i3 % i_ne2) * i_s2).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (d < ne0) & (rid >= 0) & (rid < n_dst_rows)  # (an id out of range writes nothing: see set_rows)
    x = tl.load(r_ptr + i1 * r_s1 + i2 * r_s2 + i3 * r_s3 + d, mask=m)
    tl.store(y_ptr + rid * y_s1 + i2 * y_s2 + i3 * y_s3 + d, convert(x, MODE, nan_bits), mask=m)


def set_rows(rows: torch.Tensor, ids: torch.Tensor, dst: torch.Tensor) -> None:
    """SET_ROWS in place: row i of each (i2, i3) plane of ``rows`` into row ``ids[i, i2 % .., i3 % ..]`` of ``dst``,
    converted to dst's type as CPY converts (semantics :func:`reference.set_rows`); ids I32 or I64, checked on the
    host as GET_ROWS's are (inside a CUDA-graph capture the mask is the guard: an id out of range writes nothing).
    One program per row and ELT_BLOCK elements; only the rows named are written."""
    n3, n2, n1, ne0 = rows.shape
    _require(dst.shape[0] == n3 and dst.shape[1] == n2 and dst.shape[3] == ne0, "SET_ROWS: rows do not fit dst")
    _require(rows.stride(-1) == 1 and dst.stride(-1) == 1, "SET_ROWS: rows must be contiguous")
    _require(ids.shape[0] == 1 and ids.shape[3] == n1 and ids.dtype in (torch.int32, torch.int64),
             "SET_ROWS: ids must be i32 or i64, one per row")
    if rows.numel() == 0:
        return
    _check_ids(ids, dst.shape[2], "SET_ROWS")
    _alias_ok("SET_ROWS", dst, rows, ids, same_ok=False)
    mode, x, y = _conversion("SET_ROWS", rows, dst)
    rs, ys, i_s = _strides(rows), _strides(dst), _strides(ids)
    block = min(ELT_BLOCK, triton.next_power_of_2(ne0))
    _set_rows_kernel[(n1 * n2 * n3, triton.cdiv(ne0, block))](
        x, ids, y, ne0, n1, n2, dst.shape[2], _BF16_NAN.get(dst.device.type, 0x7FFF), rs[1], rs[2], rs[3],
        i_s[0], i_s[1], i_s[2], ids.shape[2], ids.shape[1], ys[1], ys[2], ys[3], MODE=mode, BLOCK=block, **LAUNCH)


# ---- ADD, MUL, DIV --------------------------------------------------------------------------------------------------


@triton.jit
def _binary_kernel(a_ptr, b_ptr, y_ptr, n, ne0, ne1, ne2, b_ne0, b_ne1, b_ne2, b_ne3,
                   a_s0, a_s1, a_s2, a_s3, b_s0, b_s1, b_s2, b_s3, y_s0, y_s1, y_s2, y_s3,
                   OP: tl.constexpr, BLOCK: tl.constexpr):
    wait_for_previous_kernels()
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    i0, r = idx % ne0, idx // ne0
    i1, i2, i3 = r % ne1, r // ne1 % ne2, r // (ne1 * ne2)
    a = tl.load(a_ptr + i0 * a_s0 + i1 * a_s1 + i2 * a_s2 + i3 * a_s3, mask=mask)
    b = _src1_at(b_ptr, i0, i1, i2, i3, b_ne0, b_ne1, b_ne2, b_ne3, b_s0, b_s1, b_s2, b_s3, mask)
    if OP == "ADD":
        y = a + b
    elif OP == "MUL":
        y = a * b
    else:  # DIV: one IEEE division (``/`` is approximate compiled)
        y = tl.math.div_rn(a, b)
    tl.store(y_ptr + i0 * y_s0 + i1 * y_s1 + i2 * y_s2 + i3 * y_s3, y, mask=mask)


BINARY_OPS = ("ADD", "MUL", "DIV")


def binary(op: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """ADD, MUL or DIV (``op``) into ``out``: a + b, a * b or a / b (one correctly rounded division, as
    :func:`reference.div`), b repeated into a as ggml broadcasts (each ne of b divides a's; semantics
    :func:`reference.add`), all f32, any strides; ``out`` may be ``a`` (or ``b`` when it is not broadcast) itself.
    One program per ELT_BLOCK elements."""
    if out.numel() == 0:
        return
    _require(op in BINARY_OPS, f"binary op {op!r}")
    _require(a.dtype == b.dtype == out.dtype == torch.float32, f"{op} of {a.dtype}, {b.dtype} into {out.dtype}")
    _require(tuple(out.shape) == tuple(a.shape) and _repeats(b, a),
             f"{op}: {tuple(b.shape)} does not repeat into {tuple(a.shape)} / output {tuple(out.shape)}")
    _elementwise(op, out, a, b)
    _binary_kernel[_grid(out.numel())](
        a, b, out, out.numel(), a.shape[3], a.shape[2], a.shape[1], *b.shape[::-1], *_strides(a), *_strides(b),
        *_strides(out), OP=op, BLOCK=ELT_BLOCK, **LAUNCH)


def add(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """ADD: see :func:`binary`."""
    binary("ADD", a, b, out)


def mul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """MUL: see :func:`binary`."""
    binary("MUL", a, b, out)


def div(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """DIV: see :func:`binary`."""
    binary("DIV", a, b, out)


# ---- UNARY (SILU, SIGMOID, SOFTPLUS, EXP) ---------------------------------------------------------------------------


UNARY_KINDS = ("SILU", "SIGMOID", "SOFTPLUS", "EXP")


@triton.jit
def _unary_kernel(x_ptr, y_ptr, n, ne0, ne1, ne2, x_s0, x_s1, x_s2, x_s3, y_s0, y_s1, y_s2, y_s3,
                  KIND: tl.constexpr, BLOCK: tl.constexpr):
    wait_for_previous_kernels()
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    i0, r = idx % ne0, idx // ne0
    x = tl.load(x_ptr + i0 * x_s0 + _row_offset(r, ne1, ne2, x_s1, x_s2, x_s3), mask=mask)
    tl.store(y_ptr + i0 * y_s0 + _row_offset(r, ne1, ne2, y_s1, y_s2, y_s3), unary_f32(x, KIND), mask=mask)


def unary(kind: str, x: torch.Tensor, out: torch.Tensor) -> None:
    """UNARY ``kind`` (one of :data:`UNARY_KINDS`) elementwise into ``out`` (same shape, any strides; ``out`` may be
    ``x`` itself), f32. One kernel, the kind a constexpr; one program per ELT_BLOCK elements."""
    if x.numel() == 0:
        return
    _require(kind in UNARY_KINDS, f"UNARY {kind} has no Triton kernel (kinds: {', '.join(UNARY_KINDS)})")
    _require(tuple(out.shape) == tuple(x.shape), f"UNARY output shape {tuple(out.shape)} != {tuple(x.shape)}")
    _require(x.dtype == out.dtype == torch.float32, f"UNARY of {x.dtype} into {out.dtype}")
    _elementwise(f"UNARY({kind})", out, x)
    _unary_kernel[_grid(x.numel())](
        x, out, x.numel(), x.shape[3], x.shape[2], x.shape[1], *_strides(x), *_strides(out),
        KIND=kind, BLOCK=ELT_BLOCK, **LAUNCH)


def silu(x: torch.Tensor, out: torch.Tensor) -> None:
    """UNARY SILU elementwise into ``out`` (same shape; ``out`` may be ``x`` itself)."""
    unary("SILU", x, out)


# ---- GLU (SWIGLU) ---------------------------------------------------------------------------------------------------


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, n, ne0, ne1, ne2, g_s0, g_s1, g_s2, g_s3, u_s0, u_s1, u_s2, u_s3,
                   y_s0, y_s1, y_s2, y_s3, BLOCK: tl.constexpr):
    wait_for_previous_kernels()
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    i0, r = idx % ne0, idx // ne0
    g = tl.load(g_ptr + i0 * g_s0 + _row_offset(r, ne1, ne2, g_s1, g_s2, g_s3), mask=mask)
    u = tl.load(u_ptr + i0 * u_s0 + _row_offset(r, ne1, ne2, u_s1, u_s2, u_s3), mask=mask)
    tl.store(y_ptr + i0 * y_s0 + _row_offset(r, ne1, ne2, y_s1, y_s2, y_s3), silu_f32(g) * u, mask=mask)


@triton.jit
def _swiglu_quantizing_kernel(g_ptr, u_ptr, y_ptr, n_rows, ne0, ne1, ne2, g_s0, g_s1, g_s2, g_s3, u_s0, u_s1, u_s2,
                              u_s3, y_s0, y_s1, y_s2, y_s3, ws_ptr, chunk, FORM: tl.constexpr):
    """SWIGLU writing its output quantized to FORM too, for the products after it (gdnpass.prepasses): program
    (row, block of 256), the pre-pass's grid; _swiglu_kernel's expression on the block, then the pre-pass's own
    :func:`~gdnpass.kernels.triton_core.store_activations` of it (rows past n_rows: the padding columns' zeros)."""
    wait_for_previous_kernels()
    r, b = tl.program_id(0), tl.program_id(1)
    i0 = b * QK_K + tl.arange(0, QK_K)
    mask = (i0 < ne0) & (r < n_rows)
    g = tl.load(g_ptr + i0 * g_s0 + _row_offset(r, ne1, ne2, g_s1, g_s2, g_s3), mask=mask, other=0.0)
    u = tl.load(u_ptr + i0 * u_s0 + _row_offset(r, ne1, ne2, u_s1, u_s2, u_s3), mask=mask, other=0.0)
    y = silu_f32(g) * u
    tl.store(y_ptr + i0 * y_s0 + _row_offset(r, ne1, ne2, y_s1, y_s2, y_s3), y, mask=mask)
    store_activations(ws_ptr, r, chunk, ne0, b + tl.arange(0, 1),
                      tl.reshape(tl.where(mask, y, 0.0), (1, GROUPS_K, SUB)), True, FORM)


def glu(kind: str, a: torch.Tensor, b: torch.Tensor | None, swapped: bool, out: torch.Tensor,
        quantize: str | None = None) -> None:
    """GLU ``kind`` (SWIGLU: silu(gate) * up, SILU's expression then one multiply, as reference.swiglu) into
    ``out``, f32, any strides. Split form (``b`` given): gate a, up b, same shape. One source: each row of a holds
    the gate then the up half (exchanged when ``swapped``), ``out`` ne0 = a ne0 // 2. One program per ELT_BLOCK
    output elements; or, ``quantize`` (a form: gdnpass.prepasses.form), per row and block of 256, writing ``out``
    so quantized into the activation workspace too, as a product's pre-pass of ``out`` would (rows of whole blocks,
    contiguous)."""
    if out.numel() == 0:
        return
    _require(kind == "SWIGLU", f"GLU {kind} has no Triton kernel")
    if b is None:
        h = a.shape[3] // 2
        a, b = a[..., :h], a[..., h:2 * h]  # the halves, as views
    if swapped:
        a, b = b, a
    _require(tuple(a.shape) == tuple(b.shape) == tuple(out.shape), f"GLU gate {tuple(a.shape)}, up "
                                                                   f"{tuple(b.shape)}, output {tuple(out.shape)}")
    _require(a.dtype == b.dtype == out.dtype == torch.float32, f"GLU of {a.dtype} into {out.dtype} (f32 only)")
    _elementwise(f"GLU({kind})", out, a, b)
    if quantize:
        K = out.shape[3]
        _require(K % QK_K.value == 0 and out.stride(3) == 1, f"GLU: rows of {K} are not quantized in the kernel")
        N, cols = product_columns(out)
        acts, chunk, chunks = activations_to_fill(out, quantize, N, cols, "GLU")
        _swiglu_quantizing_kernel[(XCOLS.value * chunks, K // QK_K.value)](
            a, b, out, N, K, out.shape[2], out.shape[1], *_strides(a), *_strides(b), *_strides(out), acts, chunk,
            FORM=quantize, **LAUNCH)
        return
    _swiglu_kernel[_grid(out.numel())](
        a, b, out, out.numel(), out.shape[3], out.shape[2], out.shape[1], *_strides(a), *_strides(b),
        *_strides(out), BLOCK=ELT_BLOCK, **LAUNCH)


# ---- ELEMENTWISE_CHAIN (the elementwise_chain pattern's kernel: the ops above, in one pass) ---------------------------


@triton.jit
def _chain_kernel(P, y_ptr, n, y_s0, y_s1, y_s2, y_s3, STEPS: tl.constexpr, SIDES: tl.constexpr,
                  BLOCK: tl.constexpr):
    wait_for_previous_kernels()
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    ne0, ne1, ne2 = P[1], P[2], P[3]
    i0, r = idx % ne0, idx // ne0
    i1, i2, i3 = r % ne1, r // ne1 % ne2, r // (ne1 * ne2)
    v = chain_at(i0, i1, i2, i3, mask, P, STEPS, SIDES)
    tl.store(y_ptr + i0 * y_s0 + i1 * y_s1 + i2 * y_s2 + i3 * y_s3, v, mask=mask)


def elementwise_chain(steps: list[str], x: torch.Tensor, sides: list[torch.Tensor], out: torch.Tensor) -> None:
    """ELEMENTWISE_CHAIN: x through ``steps`` (the pattern's scope: ``gdnpass.patterns.elementwise_chain.scope``)
    into ``out`` (x's shape, any strides), the binary steps' other operands ``sides`` in order, each repeating into
    x as ggml broadcasts src1 (a side operand that is src0 has x's shape: the matcher's rule); all f32. ``out`` may
    be x or a side operand of x's shape itself (element for element). One program per ELT_BLOCK elements."""
    from gdnpass.patterns.elementwise_chain.scope import BINARY, steps_fit

    if out.numel() == 0:
        return
    _require(steps_fit(steps) and len(sides) == sum(s in BINARY for s in steps),
             f"ELEMENTWISE_CHAIN: steps {steps} with {len(sides)} side operands are outside the kernel's scope")
    _require(all(t.dtype == torch.float32 for t in (x, out, *sides)), "ELEMENTWISE_CHAIN: every operand must be f32")
    binary = [s for s in steps if s in BINARY]
    _require(tuple(out.shape) == tuple(x.shape) and all(
        tuple(b.shape) == tuple(x.shape) if s.startswith("R") else _repeats(b, x) for s, b in zip(binary, sides)),
             f"ELEMENTWISE_CHAIN: {[tuple(b.shape) for b in sides]} do not repeat into (a src0: have the shape of) "
             f"{tuple(x.shape)} / output {tuple(out.shape)}")
    _elementwise("ELEMENTWISE_CHAIN", out, x, *sides)
    _chain_kernel[_grid(out.numel())](chain_args(x, sides), out, out.numel(), *_strides(out),
                                      STEPS=tuple(steps), SIDES=chain_sides(steps), BLOCK=ELT_BLOCK, **LAUNCH)


# ---- SCALE ----------------------------------------------------------------------------------------------------------


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, ne0, ne1, ne2, scale, bias, x_s0, x_s1, x_s2, x_s3, y_s0, y_s1, y_s2, y_s3,
                  HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    wait_for_previous_kernels()
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    i0, r = idx % ne0, idx // ne0
    x = tl.load(x_ptr + i0 * x_s0 + _row_offset(r, ne1, ne2, x_s1, x_s2, x_s3), mask=mask)
    if HAS_BIAS:
        y = tl.fma(x, scale, bias)  # one rounding, as ggml (see reference.scale); LAUNCH's no-contraction is for a*b+c
    else:
        y = x * scale
    tl.store(y_ptr + i0 * y_s0 + _row_offset(r, ne1, ne2, y_s1, y_s2, y_s3), y, mask=mask)


def scale(x: torch.Tensor, s: float, b: float, out: torch.Tensor) -> None:
    """SCALE elementwise into ``out`` (same shape, any strides; ``out`` may be ``x``, e.g. build_rs's in-place zeroing
    of a cache row): ``x * s`` when b == 0, else fma(x, s, b). s and b are rounded to f32 (ggml's op params)."""
    n = x.numel()
    if n == 0:
        return
    _require(tuple(out.shape) == tuple(x.shape), f"SCALE output shape {tuple(out.shape)} != {tuple(x.shape)}")
    _scale_kernel[(triton.cdiv(n, ELT_BLOCK),)](
        x, out, n, x.shape[3], x.shape[2], x.shape[1], f32(s), f32(b), *_strides(x), *_strides(out),
        HAS_BIAS=bool(b), BLOCK=ELT_BLOCK, **LAUNCH)


# ---- CLAMP ----------------------------------------------------------------------------------------------------------


@triton.jit
def _clamp_kernel(x_ptr, y_ptr, n, ne0, ne1, ne2, lo, hi, x_s0, x_s1, x_s2, x_s3, y_s0, y_s1, y_s2, y_s3,
                  BLOCK: tl.constexpr):
    """MAX(MIN(x, hi), lo) with C's macros (``a < b ? a : b``): a NaN fails MIN's comparison and comes out as hi."""
    wait_for_previous_kernels()
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    i0, r = idx % ne0, idx // ne0
    x = tl.load(x_ptr + i0 * x_s0 + _row_offset(r, ne1, ne2, x_s1, x_s2, x_s3), mask=mask)
    tl.store(y_ptr + i0 * y_s0 + _row_offset(r, ne1, ne2, y_s1, y_s2, y_s3), clamp_f32(x, lo, hi), mask=mask)


def clamp(x: torch.Tensor, lo: float, hi: float, out: torch.Tensor) -> None:
    """CLAMP elementwise into ``out`` (same shape, any strides; ``out`` may be ``x``, ggml_clamp_inplace): bit for bit
    :func:`reference.clamp`. The bounds are rounded to f32 (ggml's op params) and may be ±inf."""
    if x.numel() == 0:
        return
    _require(tuple(out.shape) == tuple(x.shape) and x.dtype == out.dtype == torch.float32,
             f"CLAMP of {x.dtype} {tuple(x.shape)} into {out.dtype} {tuple(out.shape)}")
    _require(lo == lo and hi == hi, "CLAMP: a NaN bound")
    _elementwise("CLAMP", out, x)
    _clamp_kernel[_grid(x.numel())](
        x, out, x.numel(), x.shape[3], x.shape[2], x.shape[1], f32(lo), f32(hi), *_strides(x), *_strides(out),
        BLOCK=ELT_BLOCK, **LAUNCH)


# ---- launch sizes (for cost estimates) ------------------------------------------------------------------------------


def programs(node) -> list[tuple[str, int, int]]:
    """:func:`gdnpass.kernels.backends.programs` for this module's ops: one program per ELT_BLOCK elements (SET_ROWS:
    per row and ELT_BLOCK elements), one step each; empty for other ops (and UNARY / GLU kinds without a kernel).
    Pure: reads shapes only."""
    from gdnpass.ir import Op, Unary

    op = node.op
    blocks = triton.cdiv(node.nelements, ELT_BLOCK)  # the elementwise and data-movement kernels: one per block
    if op is Op.UNARY:
        kind = Unary(node.op_params["kind"]).value
        return [(kind.lower(), blocks, 1)] if kind in UNARY_KINDS else []
    if op is Op.GLU:
        return [("swiglu", blocks, 1)] if node.op_params.get("kind") == "SWIGLU" else []
    if op is Op.GET_ROWS and node.src[0].type.is_quantized:  # a program per 256 elements of an output row
        return [("get_rows_q", node.ne[1] * node.ne[2] * node.ne[3] * triton.cdiv(node.ne[0], ROWS_NS * SUB.value), 1)]
    if op in (Op.SCALE, Op.ADD, Op.MUL, Op.DIV, Op.CLAMP, Op.CONCAT, Op.GET_ROWS):
        return [(op.value.lower(), blocks, 1)]
    if op in (Op.CPY, Op.CONT):
        return [("cpy", blocks, 1)]
    if op is Op.SET_ROWS:
        rows = node.src[0]
        return [("set_rows", rows.ne[1] * rows.ne[2] * rows.ne[3] * triton.cdiv(rows.ne[0], ELT_BLOCK), 1)]
    return []
