"""Triton kernels of the attention ops, one launch per graph node (as ggml-cuda): FLASH_ATTN_EXT and SOFT_MAX.

Their specs and torch references are :func:`gdnpass.kernels.reference.flash_attn_ext` (the f32 semantics,
``cpu=False``) and :func:`gdnpass.kernels.reference.soft_max`; tests/kernels/test_triton_attention.py compares each
kernel with its reference. Conventions as :mod:`gdnpass.kernels.triton_core` (whose helpers and launch options these
kernels share): 4-D torch views (ne3, ne2, ne1, ne0), strides in elements passed in ggml order, no FMA contraction
(``LAUNCH``), offsets in int64 (a KV cache view spans more than 2^31 elements at long contexts).

- FLASH_ATTN_EXT: one program per (block of FA_BLOCK_M rows, group of query heads, ne3), looping over the KV in
  blocks of BLOCK_N (:func:`fa_tile`) with an online softmax (a new row maximum rescales the running sum and
  accumulator). A group is the query heads that read one K/V head (GQA; :func:`fa_grid`), its rows (head, query row)
  side by side, so a verify's few query rows of several heads fill one block and the group's K/V is read once.
  Q·Kᵀ and P·V are ``tl.dot`` of f32 operands in 3xTF32 (:data:`FA_DOT`), K/V widened from f16/bf16 exactly.
  Against the reference the products are ~2^-21 rather than f32-rounded, the sums run in another order and the online
  rescaling rounds a few times more: within 1e-5 (max |Δ| / max |ref|), not bit for bit. When the row blocks and
  heads are too few programs for the GPU (a verify: one block of rows, a few heads), the KV is split too
  (:func:`fa_split`): each program runs its slice's online softmax into a workspace slot, and the last program of a
  (row block, head group) to draw its ticket merges the slices in their fixed order, as the mat-vec's split-K
  (:func:`~gdnpass.kernels.triton_core.last_to_arrive`): the same inputs give the same bytes, run to run.
- SOFT_MAX: one program per SM_TILE elements' worth of rows, three passes over each row (maximum, Σ, write: a long
  row never has to fit in registers), the reference's arithmetic operation for operation: its Σ in f64, its
  multiply by the rounded reciprocal, CUDA's expf compiled (torch's). Only the order of the f64 sum differs (a fixed
  tree per column block, :func:`~gdnpass.kernels.triton_core.soft_max_sum`, which the fused router shares), far
  below the f32 rounding of 1/Σ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from gdnpass.kernels import reference as ref
from gdnpass.kernels.limits import SM_TILE, soft_max_tile  # SOFT_MAX's elements and [BLOCK_R, BLOCK_C] a pass
from gdnpass.kernels.reference import f32
from gdnpass.kernels.triton_core import (INTERPRETED, LAUNCH, _extent, _require, _strides, exp_f32,
                                         last_to_arrive, soft_max_sum, soft_max_w, split_workspace,
                                         wait_for_previous_kernels)

FA_BLOCK_M = 16     # query rows per program: the smallest tl.dot tile, and a whole verify (n_q <= 16) in one block
FA_MAX_D = 512      # head sizes up to this have a kernel (next power of two): wider tiles overflow shared memory
FA_PROGRAMS = 128   # programs a launch aims for by splitting the KV (fa_split): about one per SM of an H100/H200
# (at 512 the kernel is slower than the torch reference on an H200, 137 against 85 us at n_kv = 256: one launch, 16
# programs, each with 32-position steps; qwen3.5's 256 is 23 against 60-76 us)
# Q·Kᵀ and P·V on the tensor cores in 3xTF32 (each f32 operand a TF32 head + tail, the tail x tail term dropped):
# f32-level products, ~2^-21 relative. "ieee" (CUDA-core FMAs) measured 15x slower on an H200 at the verify shape
# (340 us against 23 us) for no better agreement with the reference (both ~1.5e-6 from an f64 truth)
FA_DOT = tl.constexpr("tf32x3")
FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)

if INTERPRETED:  # the interpreter has no libdevice: tanh from exp (its absolute error is exp's, ~1e-7)
    @triton.jit
    def tanh_f32(x):
        e = tl.exp(-2.0 * tl.abs(x))
        t = tl.math.div_rn(1.0 - e, 1.0 + e)
        return tl.where(x < 0, -t, t)
else:
    @triton.jit
    def tanh_f32(x):  # CUDA's tanhf, which torch's tanh calls
        return libdevice.tanh(x)


# ---- ALiBi slopes ---------------------------------------------------------------------------------------------------


_slope_tables: dict[tuple, torch.Tensor] = {}


def _slopes(n_head: int, max_bias: float, device: torch.device) -> torch.Tensor:
    """reference.alibi_slopes on the device, built once per (head count, max_bias): a later run (or its CUDA-graph
    capture, which the executor warms up first) does no host->device copy."""
    key = (device, n_head, f32(max_bias))
    t = _slope_tables.get(key)
    if t is None:
        t = _slope_tables[key] = ref.alibi_slopes(n_head, max_bias, device).contiguous()
    return t


def _overlaps(out: torch.Tensor, *srcs: torch.Tensor | None) -> bool:
    lo, hi = _extent(out)
    return any(s is not None and s.numel() and _extent(s)[0] < hi and lo < _extent(s)[1] for s in srcs)


def _mask_fits(mask: torch.Tensor | None, n_cols: int, n_rows: int) -> bool:
    """The mask has a value per column and row, as ggml lays it out (n_cols wide, at least n_rows tall: padding rows
    are not read); its planes broadcast by modulo. (The reference would also stretch a 1-wide or 1-tall mask,
    torch's broadcasting; no graph rule lets one through, so the kernels leave it to the reference.)"""
    return mask is None or mask.numel() > 0 and mask.shape[3] == n_cols and mask.shape[2] >= n_rows


# ---- FLASH_ATTN_EXT -------------------------------------------------------------------------------------------------


@triton.jit
def _flash_attn_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, sinks_ptr, slopes_ptr, o_ptr,
                       n_q, n_kv, DK, DV, r_k, r_v, r3_k, r3_v, m_ne2, m_ne3, scale, softcap, pack,
                       q_s0, q_s1, q_s2, q_s3,   # q    [DK, n_q, H, ne3]
                       k_s0, k_s1, k_s2, k_s3,   # k    [DK, n_kv, H_kv, ne3k]: query head h reads h // r_k
                       v_s0, v_s1, v_s2, v_s3,   # v    [DV, n_kv, H_kv, ne3v]
                       m_s0, m_s1, m_s2, m_s3,   # mask [n_kv, >= n_q, ne32, ne33], planes broadcast by modulo
                       sinks_s0,                 # sinks [H]
                       o_s0, o_s1, o_s2, o_s3,   # out  [DV, H, n_q, ne3]
                       ws_ptr, cnt_ptr,          # KV-split partials (f32) and tickets (i32); None when SPLIT == 1
                       HAS_MASK: tl.constexpr, HAS_SINKS: tl.constexpr, ALIBI: tl.constexpr,
                       SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SPLIT: tl.constexpr):
    wait_for_previous_kernels()
    # grid axis 1: a group of ``pack`` query heads that read one KV head (GQA), whose rows (head, query row) a row
    # block takes together, so the group's K/V is read once; axis 2: ne3
    g, i3 = tl.program_id(1), tl.program_id(2)
    # grid axis 0: the row block, then its KV slice sl of SPLIT (whole BLOCK_N steps; the last short or empty)
    blk, sl = tl.program_id(0) // SPLIT, tl.program_id(0) % SPLIT
    kv_len = tl.cdiv(tl.cdiv(n_kv, BLOCK_N), SPLIT) * BLOCK_N
    kv_lo = sl * kv_len
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)  # the group's rows: head-major, then query row
    rmask = rows < n_q * pack
    head = g * pack + rows // n_q
    h64, r64, i364 = head.to(tl.int64), (rows % n_q).to(tl.int64), i3.to(tl.int64)
    g64 = (g * pack).to(tl.int64)  # the group's first head: every head of it reads the same K and V head
    dk, dv = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
    dkm, dvm = dk < DK, dv < DV
    q = tl.load(q_ptr + i364 * q_s3 + h64[:, None] * q_s2 + r64[:, None] * q_s1 + dk[None, :] * q_s0,
                mask=rmask[:, None] & dkm[None, :], other=0.0).to(tl.float32)
    k_head = k_ptr + (i364 // r3_k) * k_s3 + (g64 // r_k) * k_s2 + dk[:, None] * k_s0  # [BLOCK_DK, 1]
    v_head = v_ptr + (i364 // r3_v) * v_s3 + (g64 // r_v) * v_s2 + dv[None, :] * v_s0  # [1, BLOCK_DV]
    if HAS_MASK:
        m_rows = mask_ptr + (i364 % m_ne3) * m_s3 + (h64 % m_ne2)[:, None] * m_s2 + r64[:, None] * m_s1
    if ALIBI:
        slope = tl.load(slopes_ptr + head, mask=rmask, other=0.0)
    # the sink joins the softmax as one more score with no value: slice 0 starts from it (exp(sink - sink) = 1 in
    # the sum)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        m_i = tl.where(sl == 0, tl.load(sinks_ptr + head * sinks_s0, mask=rmask, other=0.0), m_i)
        l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for j0 in range(kv_lo, tl.minimum(kv_lo + kv_len, n_kv), BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        cmask = cols < n_kv
        c64 = cols.to(tl.int64)
        kt = tl.load(k_head + c64[None, :] * k_s1, mask=dkm[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        s = tl.dot(q, kt, input_precision=FA_DOT) * scale
        if SOFTCAP:
            s = tanh_f32(s) * softcap
        if HAS_MASK:
            mk = tl.load(m_rows + c64[None, :] * m_s0, mask=rmask[:, None] & cmask[None, :], other=0.0)
            mk = mk.to(tl.float32)
            if ALIBI:
                mk = slope[:, None] * mk
            s = s + mk
        s = tl.where(cmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no finite score yet subtracts 0, not -inf: its exp(-inf) terms are 0, never NaN
        m_off = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = exp_f32(m_i - m_off)
        p = exp_f32(s - m_off[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + c64[:, None] * v_s1, mask=cmask[:, None] & dvm[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=FA_DOT)
        m_i = m_new
    o_at = o_ptr + i364 * o_s3 + r64[:, None] * o_s2 + h64[:, None] * o_s1 + dv[None, :] * o_s0
    if SPLIT == 1:
        _fa_store(o_at, acc, l_i, rmask[:, None] & dvm[None, :])
    else:
        # the slice's (m, l, acc) into its workspace slot; the program that draws the tile's last ticket merges the
        # slices in the order 0..SPLIT-1, whichever finished last (the mat-vec's split-K protocol)
        tile = (i3 * tl.num_programs(1) + g) * (tl.num_programs(0) // SPLIT) + blk
        PART: tl.constexpr = BLOCK_M * (BLOCK_DV + 2)
        rl = tl.arange(0, BLOCK_M)
        part = ws_ptr + tile * (SPLIT * PART)
        at_acc = rl[:, None] * BLOCK_DV + dv[None, :]
        at_m, at_l = BLOCK_M * BLOCK_DV + rl, BLOCK_M * (BLOCK_DV + 1) + rl
        tl.store(part + sl * PART + at_acc, acc)
        tl.store(part + sl * PART + at_m, m_i)
        tl.store(part + sl * PART + at_l, l_i)
        if last_to_arrive(cnt_ptr, tile, SPLIT):
            m = tl.load(part + at_m, cache_modifier=".cg")
            for j in tl.static_range(1, SPLIT):
                m = tl.maximum(m, tl.load(part + j * PART + at_m, cache_modifier=".cg"))
            m_off = tl.where(m > float("-inf"), m, 0.0)
            l_sum = tl.zeros([BLOCK_M], tl.float32)
            total = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            for j in tl.static_range(SPLIT):
                w = exp_f32(tl.load(part + j * PART + at_m, cache_modifier=".cg") - m_off)
                l_sum = l_sum + w * tl.load(part + j * PART + at_l, cache_modifier=".cg")
                total = total + w[:, None] * tl.load(part + j * PART + at_acc, cache_modifier=".cg")
            _fa_store(o_at, total, l_sum, rmask[:, None] & dvm[None, :])
            tl.store(cnt_ptr + tile, 0)  # zero for the next launch (and the next CUDA-graph replay)


@triton.jit
def _fa_store(o_at, acc, l_i, mask):
    """acc / Σ into the output; Σ = 0 (every score -inf, no sink): 0, as the CPU's S == 0 case."""
    o = tl.where(l_i[:, None] == 0.0, 0.0, tl.math.div_rn(acc, tl.where(l_i == 0.0, 1.0, l_i)[:, None]))
    tl.store(o_at, o.to(o_at.dtype.element_ty), mask=mask)


def flash_attn_ext_refusal(q, k, v, mask, sinks, out) -> str | None:
    """Why :func:`flash_attn_ext` has no kernel for these operands (None: it has). Each refusal is a case the torch
    reference handles (or rejects) itself; the adapter runs the reference for it."""
    n3, H, n_q, DK = q.shape
    if any(t.dtype not in FLOAT_TYPES for t in (q, k, v)) or mask is not None and mask.dtype not in FLOAT_TYPES:
        return "q, k, v and the mask must be f32, f16 or bf16 (no quantized K/V)"
    if (k.shape[3] != DK or k.shape[2] != v.shape[2] or H % k.shape[1] or H % v.shape[1] or n3 % k.shape[0]
            or n3 % v.shape[0]):
        return f"k {tuple(k.shape)} / v {tuple(v.shape)} do not broadcast over q {tuple(q.shape)}"
    if k.shape[2] == 0:
        return "no KV positions (the reference's maximum over none raises)"
    if max(DK, v.shape[3]) > FA_MAX_D:
        return f"head size {max(DK, v.shape[3])} > {FA_MAX_D} (the tiles would not fit)"
    if not _mask_fits(mask, k.shape[2], n_q):
        return f"mask {tuple(mask.shape)} does not hold {n_q} rows of {k.shape[2]} positions"
    if sinks is not None and (sinks.numel() != H or sinks.shape[-1] != H or sinks.dtype != torch.float32):
        return f"sinks must be {H} f32 values along ne0"
    if tuple(out.shape) != (n3, n_q, H, v.shape[3]):
        return f"output shape {tuple(out.shape)} != {(n3, n_q, H, v.shape[3])}"
    if out.numel() and _overlaps(out, q, k, v, mask, sinks):
        return "the output overlaps an input (a program could read what another wrote)"
    return None


def flash_attn_ext(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   sinks: torch.Tensor | None, scale: float, max_bias: float, logit_softcap: float,
                   out: torch.Tensor, split: int | None = None) -> None:
    """FLASH_ATTN_EXT into ``out`` (torch shape (ne3, n_q, H, DV), any strides), one launch: reference.flash_attn_ext
    with ``cpu=False`` (its semantics: GQA and ne3 broadcast, the mask broadcast by modulo, ALiBi slopes, logit
    softcapping, sinks, a row without a finite score nor a sink gives 0), within 1e-5 of it (max |Δ| / max |ref|:
    3xTF32 products, summation order, the online rescaling). q, k, v and the mask f32, f16 or bf16, any strides.
    ``split``: a benchmark's override of :func:`fa_split` (KV slices per row block and head group)."""
    why = flash_attn_ext_refusal(q, k, v, mask, sinks, out)
    _require(why is None, f"FLASH_ATTN_EXT: {why}")
    n3, H, n_q, DK = q.shape
    n_kv, DV = k.shape[2], v.shape[3]
    if out.numel() == 0:
        return
    sc = f32(scale)
    if logit_softcap != 0.0:  # the reference's rounding: scale / softcap in f32, softcap applied after tanh
        sc = f32(ref._f(scale) / ref._f(logit_softcap))
    alibi = mask is not None and max_bias > 0.0
    m = mask if mask is not None else q
    block_n, warps, stages = fa_tile(DK, DV, max(k.element_size(), v.element_size()))
    pack, blocks, auto = fa_grid(n_q, H, n3, H // k.shape[1], H // v.shape[1], n_kv, block_n)
    split = split or auto
    _require(1 <= split <= max(1, triton.cdiv(n_kv, block_n)), f"FLASH_ATTN_EXT: {split} KV slices of {n_kv} positions")
    ws = cnt = None
    tiles = blocks * (H // pack) * n3
    if split > 1:
        ws, cnt = split_workspace(q.device, tiles * split * FA_BLOCK_M * (fa_block_d(DV) + 2), tiles, "FLASH_ATTN_EXT")
    _flash_attn_kernel[(blocks * split, H // pack, n3)](
        q, k, v, m, sinks if sinks is not None else q, _slopes(H, max_bias, q.device) if alibi else q, out,
        n_q, n_kv, DK, DV, H // k.shape[1], H // v.shape[1], n3 // k.shape[0], n3 // v.shape[0],
        m.shape[1], m.shape[0], sc, f32(logit_softcap), pack,
        *_strides(q), *_strides(k), *_strides(v), *_strides(m), sinks.stride(-1) if sinks is not None else 0,
        *_strides(out), ws, cnt,
        HAS_MASK=mask is not None, HAS_SINKS=sinks is not None, ALIBI=alibi, SOFTCAP=logit_softcap != 0.0,
        BLOCK_M=FA_BLOCK_M, BLOCK_N=block_n, BLOCK_DK=fa_block_d(DK), BLOCK_DV=fa_block_d(DV), SPLIT=split,
        **{**LAUNCH, "num_warps": warps, "num_stages": stages})


def fa_block_d(d: int) -> int:
    """The tile width of a head of ``d`` elements (a power of two, >= 16 for tl.dot)."""
    return max(16, triton.next_power_of_2(d))


def fa_grid(n_q: int, H: int, n3: int, r_k: int, r_v: int, n_kv: int, block_n: int) -> tuple[int, int, int]:
    """(heads a program takes together, row blocks per group and ne3, KV slices): a GQA group's query heads (``r_k``
    of them read one K head, ``r_v`` one V head; when the two differ, one head a program) share a program's rows, so
    a verify's 4 query rows x 4 heads fill its 16; then :func:`fa_split`."""
    pack = r_k if r_k == r_v else 1
    blocks = triton.cdiv(n_q * pack, FA_BLOCK_M)
    return pack, blocks, fa_split(n_kv, blocks * (H // pack) * n3, block_n)


def fa_split(n_kv: int, programs: int, block_n: int) -> int:
    """KV slices per (row block, head group) of ``programs`` such: enough programs for the GPU (FA_PROGRAMS) when
    those alone are too few (a verify: qwen3.5-9b's 4 query rows x 4 heads of a group are one block, its 4 groups 4
    programs), never more slices than KV steps."""
    return max(1, min(triton.cdiv(n_kv, block_n), FA_PROGRAMS // max(programs, 1)))


def fa_tile(DK: int, DV: int, kv_bytes: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for heads of DK / DV elements and K/V elements of ``kv_bytes``: KV steps of
    128 positions for heads up to 128, 64 up to 256, 32 beyond, 8 warps (the H200 sweep's best at n_kv = 256 and 16
    heads, f16 K/V: 12.0 us at 128 (steps of 64: 14.7 us), 22.5 us at 256 (steps of 32: 33 us; 4 warps: 56 us)).
    Triton's 3 pipeline stages, except for f32 K or V, whose 3 buffered f32 tiles would pass the 227 KiB of shared
    memory a program may have from heads of 96 on (sm_90 compile: 288 KiB at 128 wide, 80 KiB with 1 stage)."""
    d = max(DK, DV)
    return (128 if d <= 128 else 64 if d <= 256 else 32), 8, (1 if kv_bytes > 2 else 3)


# ---- SOFT_MAX -------------------------------------------------------------------------------------------------------


@triton.jit
def _soft_max_kernel(x_ptr, mask_ptr, sinks_ptr, slopes_ptr, y_ptr, n_rows, ne0, ne1, ne2, m_ne2, m_ne3, scale,
                     x_s0, x_s1, x_s2, x_s3,    # x    [ne0, ne1, ne2, ne3]
                     m_s0, m_s1, m_s2, m_s3,    # mask [ne0, >= ne1, ne12, ne13], planes broadcast by modulo
                     sinks_s0,                  # sinks [ne2]
                     y_s0, y_s1, y_s2, y_s3,
                     HAS_MASK: tl.constexpr, HAS_SINKS: tl.constexpr, ALIBI: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    wait_for_previous_kernels()
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    r64 = r.to(tl.int64)
    i1, i2, i3 = r64 % ne1, r64 // ne1 % ne2, r64 // (ne1 * ne2)
    x_row = i1 * x_s1 + i2 * x_s2 + i3 * x_s3
    y_row = i1 * y_s1 + i2 * y_s2 + i3 * y_s3
    m_row = mask_ptr + (i3 % m_ne3) * m_s3 + (i2 % m_ne2) * m_s2 + i1 * m_s1
    slope = tl.load(slopes_ptr + i2, mask=rmask, other=1.0) if ALIBI else 1.0
    c = tl.arange(0, BLOCK_C)
    mx = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for c0 in range(0, ne0, BLOCK_C):
        ok = rmask[:, None] & (c0 + c < ne0)[None, :]
        w = soft_max_w(x_ptr, x_row, m_row, slope, c0 + c, ok, x_s0, m_s0, scale, HAS_MASK, ALIBI)
        mx = tl.maximum(mx, tl.max(w, 1))
    if HAS_SINKS:
        sk = tl.load(sinks_ptr + i2 * sinks_s0, mask=rmask, other=0.0)
        mx = tl.maximum(mx, sk)
    total = tl.zeros([BLOCK_R], tl.float64)
    for c0 in range(0, ne0, BLOCK_C):
        ok = rmask[:, None] & (c0 + c < ne0)[None, :]
        w = soft_max_w(x_ptr, x_row, m_row, slope, c0 + c, ok, x_s0, m_s0, scale, HAS_MASK, ALIBI)
        total += soft_max_sum(w, mx, ok)
    if HAS_SINKS:
        total += exp_f32(sk - mx).to(tl.float64)
    inv = (1.0 / total).to(tl.float32)  # f64 division (IEEE), rounded once to f32: the reference's reciprocal
    for c0 in range(0, ne0, BLOCK_C):  # recomputed, not kept: the same bits, and a row of any length fits
        ok = rmask[:, None] & (c0 + c < ne0)[None, :]
        w = soft_max_w(x_ptr, x_row, m_row, slope, c0 + c, ok, x_s0, m_s0, scale, HAS_MASK, ALIBI)
        y = exp_f32(w - mx[:, None]) * inv[:, None]
        tl.store(y_ptr + y_row[:, None] + (c0 + c).to(tl.int64)[None, :] * y_s0, y.to(y_ptr.dtype.element_ty),
                 mask=ok)


def soft_max_refusal(x, mask, sinks, out) -> str | None:
    """Why :func:`soft_max` has no kernel for these operands (None: it has); the adapter runs the reference then."""
    if any(t is not None and t.dtype not in FLOAT_TYPES for t in (x, mask, out)):
        return "x, the mask and the output must be f32, f16 or bf16"
    if tuple(out.shape) != tuple(x.shape):
        return f"output shape {tuple(out.shape)} != {tuple(x.shape)}"
    n3, n2, n1, ne0 = x.shape
    if not _mask_fits(mask, ne0, n1):
        return f"mask {tuple(mask.shape)} does not hold {n1} rows of {ne0}"
    if sinks is not None and (sinks.numel() != n2 or sinks.shape[-1] != n2 or sinks.dtype != torch.float32):
        return f"sinks must be {n2} f32 values along ne0"
    if out.numel() == 0:
        return None
    same = out.data_ptr() == x.data_ptr() and out.stride() == x.stride() and out.dtype == x.dtype
    if not same and _overlaps(out, x) or _overlaps(out, mask, sinks):
        return "the output overlaps an input other than element for element"
    return None


def soft_max(x: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor | None, scale: float, max_bias: float,
             out: torch.Tensor) -> None:
    """SOFT_MAX into ``out`` (x's shape, any strides; ``out`` may be ``x`` itself: ggml's in-place soft_max, each
    element read before it is written), one launch: reference.soft_max operation for operation (Σ in f64, the
    reciprocal rounded to f32, then multiplied). Compiled, its exp is torch's CUDA expf and only the f64 summation
    order differs, which changes a byte only where the two sums' last-bit difference straddles an f32 rounding
    point of 1/Σ (bit for bit in every test on an H200). Interpreted, exp is numpy's (an ulp from torch's CPU exp):
    within 1e-6. A row of all -inf (and no sink) is NaN, as there."""
    why = soft_max_refusal(x, mask, sinks, out)
    _require(why is None, f"SOFT_MAX: {why}")
    n3, n2, n1, ne0 = x.shape
    n_rows = n1 * n2 * n3
    if out.numel() == 0:
        return
    block_r, block_c = soft_max_tile(ne0)
    alibi = mask is not None and max_bias > 0.0
    m = mask if mask is not None else x
    _soft_max_kernel[(triton.cdiv(n_rows, block_r),)](
        x, m, sinks if sinks is not None else x, _slopes(n2, max_bias, x.device) if alibi else x, out,
        n_rows, ne0, n1, n2, m.shape[1], m.shape[0], f32(scale), *_strides(x), *_strides(m),
        sinks.stride(-1) if sinks is not None else 0, *_strides(out),
        HAS_MASK=mask is not None, HAS_SINKS=sinks is not None, ALIBI=alibi, BLOCK_R=block_r, BLOCK_C=block_c,
        **LAUNCH)


# ---- launch sizes (for cost estimates) -------------------------------------------------------------------------------


def programs(node) -> list[tuple[str, int, int]]:
    """:func:`gdnpass.kernels.backends.programs` for the two attention ops: ``[(kernel, programs, steps)]`` of one
    execution of graph node ``node`` under TRITON_BACKEND (steps: KV blocks per program for flash attention, column
    blocks per pass for soft_max). Pure: reads shapes only."""
    from gdnpass.ir import Op

    if node.op is Op.FLASH_ATTN_EXT:
        q, k, v = node.src[:3]  # q ne [DK, n_q, H, ne3], k ne [DK, n_kv, H_kv, ne3]
        block_n, _, _ = fa_tile(q.ne[0], v.ne[0], max(k.type.size, v.type.size))
        H = q.ne[2]
        pack, blocks, split = fa_grid(q.ne[1], H, q.ne[3], H // k.ne[2], H // v.ne[2], k.ne[1], block_n)
        return [("flash_attn", blocks * (H // pack) * q.ne[3] * split,
                 triton.cdiv(triton.cdiv(k.ne[1], block_n), split))]
    if node.op is Op.SOFT_MAX:
        ne = node.src[0].ne
        block_r, block_c = soft_max_tile(ne[0])
        return [("soft_max", triton.cdiv(ne[1] * ne[2] * ne[3], block_r), triton.cdiv(ne[0], block_c))]
    return []
