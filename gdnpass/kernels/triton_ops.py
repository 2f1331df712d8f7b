"""Triton kernels for the ops the executor runs, one launch per graph node (as ggml-cuda), each writing straight into a
(possibly strided) output view: the arithmetic ops, and the data movement (GET_ROWS, CONCAT, CPY/CONT) and
elementwise ops (ADD, MUL, UNARY, GLU, SCALE), ROPE and SET_ROWS. MUL_MATs of more than 16 columns stay on torch (its
matmul); SOFT_MAX and FLASH_ATTN_EXT are :mod:`gdnpass.kernels.triton_attention`'s.

Tensors follow :mod:`gdnpass.kernels.reference`: 4-D torch views of shape (ne3, ne2, ne1, ne0), usually strided
windows into one uint8 buffer viewed as float32. Strides are passed in elements, in ggml order (s0 = stride of ne0).

The ``@triton.jit`` helpers (:func:`conv_dot`, :func:`silu_f32`, :func:`l2_scale_rows`, :func:`matvec_cols`) are the
arithmetic; a fused kernel calls the same helpers so its results are byte-identical to the unfused kernels'. Two
things would otherwise let the bytes depend on the kernel: FMA contraction (whether ``a*b + c`` rounds once or twice
depends on what the compiler sees around it), switched off for every launch (:data:`LAUNCH`), and ``tl.sum``, whose
order follows the register layout the compiler picks per kernel: the L2 sum is a fixed pairwise tree instead
(:func:`sum_sq_rows`), and the mat-vec pair runs the very kernel of the single mat-vec. Against the torch reference,
the elementwise kernels write its expressions operation for operation, with IEEE division (``tl.math.div_rn``; ``/``
is approximate compiled) and CUDA's own expf/logf (:func:`exp_f32`, :func:`log_f32`): compiled, their bytes are the
reference's on CUDA; the data-movement kernels move bits (or convert as torch converts), so theirs are everywhere.

Every kernel loads all inputs of the elements it owns before storing them, so an output may alias its input element
for element (SiLU in place); the launchers refuse any other overlap of an output with an input. Token counts stay
runtime values, loop bounds or the mask of a fixed tile (no recompile per n_t), except in the fused chain, where they
are constants of the node (see :func:`gdn_conv_chain`), and in SSM_CONV and GATED_DELTA_NET up to MAX_UNROLLED_T
tokens (a verify's loop unrolled: one compile per n_t); channels go on the grid.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from gdnpass.errors import KernelError
from gdnpass.kernels.limits import CHAIN, MAT_VEC_COLS, check_row_ids, mat_vec_columns
from gdnpass.kernels import reference as ref
from gdnpass.kernels.reference import f32, gdn_scale

NUM_WARPS = 4       # every launch but the mat-vec, the fused chain, GATED_DELTA_NET and flash attention (their own);
                    # a fused kernel reusing a reduction helper must launch with the same
ELT_BLOCK = 1024    # elements per program (the elementwise and data-movement kernels)
CONV_BLOCK_C = 256  # channels per program (SSM_CONV; taps need no reduction tree, any block gives the same bytes)
MAX_UNROLLED_T = 16  # SSM_CONV and GATED_DELTA_NET unroll their token loops up to a verify's width
L2_TILE = 512       # elements per L2 tile: [L2_TILE // BLOCK_D, BLOCK_D] rows (see l2_tile)
# (GDN_CONV_CHAIN's L2 sums are a fixed tree, so its tile and warps may differ from L2_NORM's: the bytes do not)
GDN_BLOCK_V = 16    # value columns per GDN program (the state slice is [S, GDN_BLOCK_V]), in GDN_WARPS warps
GDN_WARPS = 8       # (H200, S 128: 16 columns x 8 warps beat 32 x 4 at 1-16 tokens, docs/performance.md)


# read when this module loads, as @triton.jit reads it: the interpreter runs every kernel defined below
INTERPRETED = bool(triton.knobs.runtime.interpret)

# bf16 tensor-core operands as they are on a GPU; the interpreter's bf16 arithmetic is broken (see matvec_cols)
NATIVE_BF16 = tl.constexpr(not INTERPRETED)

# every launch: no FMA contraction, so each operation rounds as written, whichever kernel it is in
LAUNCH = dict(num_warps=NUM_WARPS, enable_fp_fusion=False)


def l2_tile(ne0: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D) of the L2 tile for rows of ne0 elements."""
    block_d = triton.next_power_of_2(ne0)
    return max(1, L2_TILE // block_d), block_d


def _require(cond: bool, msg: str) -> None:
    """A launcher's memory-safety check: raised, never ``assert`` (which ``python -O`` strips)."""
    if not cond:
        raise KernelError(msg)


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """Element strides in ggml order (s0, s1, s2, s3) of a 4-D (ne3, ne2, ne1, ne0) view."""
    _require(t.dim() == 4, f"expected a 4-D (ne3, ne2, ne1, ne0) view, got shape {tuple(t.shape)}")
    return t.stride()[::-1]


# ---- shared helpers -------------------------------------------------------------------------------------------------


# exp and log of f32 as torch computes them on the device the kernels run on. Compiled (CUDA): libdevice's __nv_expf
# and __nv_logf, CUDA's expf and logf, which torch's exp and log call: bit-identical to torch.exp / torch.log on all
# 2^32 f32 inputs (H200, torch 2.11+cu130, triton 3.6), where tl.exp (ex2.approx of x·log2 e) differs on 129 M of them.
# The interpreter has no libdevice: numpy's exp and log there, which are not torch's CPU functions (Sleef), so on the
# CPU these two differ from the reference in the last bits. (Division likewise: Triton's ``/`` on f32 is the
# approximate div.full.f32, 516 M inputs of x / (1 + x) off torch's IEEE quotient: the kernels divide with
# tl.math.div_rn.)
if INTERPRETED:
    @triton.jit
    def exp_f32(x):
        return tl.exp(x)

    @triton.jit
    def log_f32(x):
        return tl.log(x)

    @triton.jit
    def cos_sin_f64(x):
        return tl.cos(x), tl.sin(x)
else:
    @triton.jit
    def exp_f32(x):
        return libdevice.exp(x)

    @triton.jit
    def log_f32(x):
        return libdevice.log(x)

    @triton.jit
    def cos_sin_f64(x):  # CUDA's cos and sin of double, which torch's call
        return libdevice.cos(x), libdevice.sin(x)


if INTERPRETED:
    @triton.jit
    def silu_quotient(x, y):
        return tl.math.div_rn(x, y)
else:
    @triton.jit
    def silu_quotient(x, y):
        """x / y rounded to nearest even, as div_rn, for SiLU's operands (y = 1 + exp(-x)), without its branch.

        div_rn compiles to a fast path (reciprocal, one Newton step, quotient, residual, correction) and a branch
        to a slow subroutine for operands out of the fast path's range. The branch ends a basic block, so the
        compiler cannot interleave the fast paths of independent quotients: the fused chain's tokens then run one
        after another (H200 profile, docs/performance.md). Here the fast path runs for every element, and SiLU's
        operands out of its range are mapped into it or replaced, with every test on x or y (known before the
        reciprocal, off its dependency chain):
        x < -80 (y > 5e34; 1/y is subnormal from y = 2^126, which rcp flushes): x and y scaled by 2^-8, which
        leaves the quotient exact; x = +-0 or +inf: x itself (the residual is +0 or NaN there); y = inf (exp(-x)
        overflowed): x * 0, as x / inf. Bit-identical to div_rn on all 2^32 x (test_gpu_silu_unrolled_on_all_f32).
        """
        s = tl.where(x < -80.0, 0.00390625, 1.0)  # 2^-8
        keep = (x == 0.0) | (x == float("inf")) | (y == float("inf"))
        kept = tl.where(y == float("inf"), x * 0.0, x)
        xs, ys = x * s, y * s
        r0 = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [ys], dtype=tl.float32,
                                       is_pure=True, pack=1)
        r = tl.fma(r0, tl.fma(-ys, r0, 1.0), r0)
        q0 = xs * r
        return tl.where(keep, kept, tl.fma(r, tl.fma(-ys, q0, xs), q0))


@triton.jit
def silu_f32(x):
    """SiLU of each element, div_rn's quotient. (silu_quotient's bits too, but slower in the elementwise kernels:
    there the branch keeps a thread's loads issued together, H200, docs/performance.md.)"""
    return tl.math.div_rn(x, 1.0 + exp_f32(-x))


@triton.jit
def silu_f32_unrolled(x):
    """silu_f32, for a thread that computes many independent SiLUs (the fused chain's tokens): the same bits, its
    quotients free to interleave."""
    return silu_quotient(x, 1.0 + exp_f32(-x))


@triton.constexpr_function
def log2(n):
    return n.bit_length() - 1


@triton.jit
def sum_sq_rows(x):
    """Σx² of each row of x [BLOCK_R, BLOCK_D] (BLOCK_D a power of two) as a fixed tree: adjacent pairs, level by
    level. Each level adds given element pairs, so the bits do not depend on the layout (unlike tl.sum's order)."""
    s = x * x
    for _ in tl.static_range(log2(s.shape[1])):
        a, b = tl.split(tl.reshape(s, [s.shape[0], s.shape[1] // 2, 2]))
        s = a + b
    return tl.reshape(s, [s.shape[0]])


@triton.jit
def l2_scale_rows(x, eps):
    """x: [BLOCK_R, BLOCK_D] rows (masked lanes 0) -> x * rsqrt(max(Σx², eps²)) per row (ggml-cuda's form)."""
    return x * tl.math.rsqrt(tl.maximum(sum_sq_rows(x), eps * eps))[:, None]


@triton.jit
def rms_scale_rows(x, n, eps):
    """x: [BLOCK_R, BLOCK_D] rows of ``n`` elements (masked lanes 0) -> rsqrt(Σx² / n + eps) * x per row: ggml-cuda's
    rms_norm_f32 (mean = Σ / ncols in f32, rsqrtf(mean + eps), scale * x), Σ the same fixed tree as L2_NORM's."""
    mean = tl.math.div_rn(sum_sq_rows(x), n * 1.0)  # IEEE, as the reference's (``/`` is approximate compiled)
    return tl.math.rsqrt(mean + eps)[:, None] * x


@triton.jit
def conv_dot(win, w):
    """Causal depthwise conv of one token: Σ_j win[j]·w[j], taps in order from 0.0 (win, w: tuples of D_CONV
    tensors, the window's columns and the tap weights). SSM_CONV and the fused chain both call it."""
    acc = tl.zeros(win[0].shape, tl.float32)
    for j in tl.static_range(len(w)):
        acc += win[j] * w[j]
    return acc


@triton.jit
def _round_bf16(x):
    """f32 -> the nearest bf16 value (ties to even), still f32: integer arithmetic, the same in the interpreter."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _dot_bf16_terms(w, x, acc):
    """acc + w·x for bf16 ``w`` and f32 ``x``: x as three bf16 terms, head + middle + tail (each residual exact in
    f32; together 24 significant bits), each bf16 x bf16 product exact, summed on the tensor cores in f32. The
    interpreter runs the same split with f32 operands (its bf16 arithmetic is broken)."""
    hi = _round_bf16(x)
    r = x - hi
    mid = _round_bf16(r)
    lo = _round_bf16(r - mid)
    if NATIVE_BF16:
        acc = tl.dot(w, lo.to(tl.bfloat16), acc)
        acc = tl.dot(w, mid.to(tl.bfloat16), acc)
        acc = tl.dot(w, hi.to(tl.bfloat16), acc)
    else:
        wf = w.to(tl.float32)
        acc = tl.dot(wf, lo, acc, input_precision="ieee")
        acc = tl.dot(wf, mid, acc, input_precision="ieee")
        acc = tl.dot(wf, hi, acc, input_precision="ieee")
    return acc


@triton.jit
def matvec_cols(w_ptr, w_stride, rows, row_mask, x_ptr, x_cols, col_mask, K, BLOCK_K: tl.constexpr,
                DOT: tl.constexpr):
    """Σ_k w[row, k]·x[col, k] for a block of weight rows and a tile of activation columns (``x_cols``: each column's
    element offset), in f32. Returns [BLOCK_M, COLS].

    Two forms of the same sum, picked per shape by :func:`mat_vec_tile` (so a product's bytes depend only on its
    shape and type). ``DOT`` off: a [BLOCK_M, COLS, BLOCK_K] accumulator of explicit FMAs (``tl.fma``: one rounding
    whatever the compiler flags) and one ``tl.sum`` over K at the end, on the CUDA cores. On: a ``tl.dot`` of the
    [BLOCK_M, BLOCK_K] weight tile with the [BLOCK_K, COLS] activations per K step on the tensor cores, accumulated
    in place, at f32-level accuracy (not f32 rounding): bf16 weights as they are, times the activations as three
    bf16 terms (:func:`_dot_bf16_terms`); other weights in 3xTF32 (each f32 operand split into a TF32 head and tail,
    the tail x tail term dropped). For many columns, where CUDA-core arithmetic would bound the time.

    A split-K program (:class:`MatVecTile`) sums its K slice by calling this with ``w_ptr`` and ``x_ptr`` advanced to
    the slice's first element and ``K`` its length: the same code on fewer steps."""
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * w_stride
    if DOT:
        acc = tl.zeros([rows.shape[0], x_cols.shape[0]], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            kmask = kk < K
            w = tl.load(w_rows + kk[None, :], mask=row_mask[:, None] & kmask[None, :], other=0.0)
            xt = tl.load(x_ptr + x_cols[None, :] + kk[:, None], mask=kmask[:, None] & col_mask[None, :], other=0.0)
            if w_ptr.dtype.element_ty == tl.bfloat16:
                acc = _dot_bf16_terms(w, xt, acc)
            else:
                acc = tl.dot(w.to(tl.float32), xt, acc, input_precision="tf32x3")
    else:
        acc3 = tl.zeros([rows.shape[0], x_cols.shape[0], BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            kmask = kk < K
            # cast right after the load: f16/bf16 arithmetic is not f32 (and bf16 is broken in the interpreter)
            w = tl.load(w_rows + kk[None, :], mask=row_mask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptr + x_cols[:, None] + kk[None, :], mask=col_mask[:, None] & kmask[None, :], other=0.0)
            acc3 = tl.fma(w[:, None, :], x[None, :, :], acc3)
        acc = tl.sum(acc3, axis=2)
    return acc


@triton.jit
def _row_offset(r, ne1, ne2, s1, s2, s3):
    """Element offset of flat row index r = i1 + ne1*(i2 + ne2*i3)."""
    return (r % ne1) * s1 + (r // ne1 % ne2) * s2 + (r // (ne1 * ne2)) * s3


# ---- SSM_CONV -------------------------------------------------------------------------------------------------------


@triton.jit
def _ssm_conv_kernel(sx_ptr, c_ptr, y_ptr, C, n_t,
                     sx_s0, sx_s1, sx_s2,  # sx [dc-1+n_t, C, n_s]
                     c_s0, c_s1,           # c  [dc, C]
                     y_s0, y_s1, y_s2,     # y  [C, n_t, n_s]
                     D_CONV: tl.constexpr, BLOCK_C: tl.constexpr, N_T: tl.constexpr):
    seq = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = ch < C
    s_ptrs = sx_ptr + seq * sx_s2 + ch * sx_s1
    y_ptrs = y_ptr + seq * y_s2 + ch * y_s0
    w = ()
    for j in tl.static_range(D_CONV):
        w = w + (tl.load(c_ptr + ch * c_s1 + j * c_s0, mask=mask, other=0.0),)
    if N_T > 0:  # a verify's few tokens, unrolled: every window column loaded once, all loads in one round trip
        cols = ()
        for i in tl.static_range(D_CONV - 1 + N_T):
            cols = cols + (tl.load(s_ptrs + i * sx_s0, mask=mask, other=0.0),)
        for t in tl.static_range(N_T):
            win = ()
            for j in tl.static_range(D_CONV):
                win = win + (cols[t + j],)
            tl.store(y_ptrs + t * y_s1, conv_dot(win, w), mask=mask)
    else:  # a prompt's many tokens
        for t in range(n_t):
            win = ()
            for j in tl.static_range(D_CONV):
                win = win + (tl.load(s_ptrs + (t + j) * sx_s0, mask=mask, other=0.0),)
            tl.store(y_ptrs + t * y_s1, conv_dot(win, w), mask=mask)


def ssm_conv(sx: torch.Tensor, c: torch.Tensor, out: torch.Tensor, block_c: int = CONV_BLOCK_C) -> None:
    """SSM_CONV into ``out`` (ne [C, n_t, n_s]); sx ne [dc-1+n_t, C, n_s], c ne [dc, C], all f32. Up to
    MAX_UNROLLED_T tokens the token loop is unrolled (one compile per n_t); the same taps in the same order
    either way (conv_dot), so the bytes do not depend on it."""
    n_s, n_t, C = out.shape[1], out.shape[2], out.shape[3]
    d_conv = c.shape[-1]
    if out.numel() == 0:
        return
    sx_s, c_s, y_s = _strides(sx), _strides(c), _strides(out)
    _ssm_conv_kernel[(n_s, triton.cdiv(C, block_c))](
        sx, c, out, C, n_t, sx_s[0], sx_s[1], sx_s[2], c_s[0], c_s[1], y_s[0], y_s[1], y_s[2],
        D_CONV=d_conv, BLOCK_C=block_c, N_T=n_t if n_t <= MAX_UNROLLED_T else 0, **LAUNCH)


# ---- elementwise and data-movement launch helpers ------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same size: a copy of these is a copy of the bits (NaN payloads, -0.0)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte addresses [lo, hi) a non-empty view may touch."""
    lo = t.data_ptr()
    return lo, lo + (1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride()))) * t.element_size()


def _elementwise(op: str, out: torch.Tensor, *srcs: torch.Tensor) -> None:
    """The checks of a one-pass kernel over ``out`` (non-empty): int32 offsets suffice, and the aliasing is one it
    can do (:func:`_alias_ok`)."""
    _require(out.numel() < 2**31 and all(sum((d - 1) * s for d, s in zip(t.shape, t.stride())) < 2**31
                                         for t in (out, *srcs)), f"{op}: offsets beyond int32")
    _alias_ok(op, out, *srcs)


def _alias_ok(op: str, out: torch.Tensor, *srcs: torch.Tensor, same_ok: bool = True) -> None:
    """``out`` shares memory with an input only as the very same view (element i is read before element i is
    written, in one program; not even that unless ``same_ok``), never otherwise: one program could read what another
    has already written, where the torch reference reads everything first."""
    lo, hi = _extent(out)
    for s in srcs:
        s_lo, s_hi = _extent(s)
        if s_lo < hi and lo < s_hi:
            _require(same_ok and s.data_ptr() == out.data_ptr() and s.shape == out.shape
                     and s.stride() == out.stride() and s.element_size() == out.element_size(),
                     f"{op}: the output overlaps an input other than element for element")


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, ELT_BLOCK),)


# ---- GET_ROWS -------------------------------------------------------------------------------------------------------


@triton.jit
def _get_rows_kernel(a_ptr, ids_ptr, y_ptr, n, ne0, n_ids, e1, n_rows,
                     a_s0, a_s1, a_s2, a_s3,   # a [ne0, n_rows, e1, e2], any strides (int64 offsets: a may be large)
                     i_s0, i_s1, i_s2,         # ids [n_ids, e1, e2] i32
                     y_s0, y_s1, y_s2, y_s3,   # y [ne0, n_ids, e1, e2], written as int32 bits
                     SRC: tl.constexpr, BLOCK: tl.constexpr):
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


def get_rows(a: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """GET_ROWS into ``out``: ``out[k, j, i, :] = a[k, j, ids[0, k, j, i], :]`` (semantics :func:`reference.get_rows`).
    a ne [ne0, rows, e1, e2] f32/f16/bf16 (out f32) or i32 (out i32), any strides; ids i32 ne [n, e1, e2] any
    strides; out ne [ne0, n, e1, e2] any strides. One program per ELT_BLOCK output elements; values are moved as
    bits (f16 through the exact hardware conversion), so the bytes are the reference's. Raises KernelError for an
    id outside 0..rows-1 (see :func:`_check_ids`)."""
    if out.numel() == 0:
        return
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


# ---- CONCAT ---------------------------------------------------------------------------------------------------------


@triton.jit
def _concat_kernel(a_ptr, b_ptr, y_ptr, n, ne0, ne1, ne2, na, b_shift,
                   a_s0, a_s1, a_s2, a_s3, b_s0, b_s1, b_s2, b_s3, y_s0, y_s1, y_s2, y_s3,
                   DIM: tl.constexpr, BLOCK: tl.constexpr):
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


# ---- ADD, MUL -------------------------------------------------------------------------------------------------------


@triton.jit
def _binary_kernel(a_ptr, b_ptr, y_ptr, n, ne0, ne1, ne2, b_ne0, b_ne1, b_ne2, b_ne3,
                   a_s0, a_s1, a_s2, a_s3, b_s0, b_s1, b_s2, b_s3, y_s0, y_s1, y_s2, y_s3,
                   OP: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    i0, r = idx % ne0, idx // ne0
    i1, i2, i3 = r % ne1, r // ne1 % ne2, r // (ne1 * ne2)
    a = tl.load(a_ptr + i0 * a_s0 + i1 * a_s1 + i2 * a_s2 + i3 * a_s3, mask=mask)
    # ggml's broadcast tiles src1: element i of a meets element i % ne of b in every dim
    b = tl.load(b_ptr + (i0 % b_ne0) * b_s0 + (i1 % b_ne1) * b_s1 + (i2 % b_ne2) * b_s2 + (i3 % b_ne3) * b_s3,
                mask=mask)
    if OP == "ADD":
        y = a + b
    else:
        y = a * b
    tl.store(y_ptr + i0 * y_s0 + i1 * y_s1 + i2 * y_s2 + i3 * y_s3, y, mask=mask)


def binary(op: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """ADD or MUL (``op``) into ``out``: a + b or a * b, b repeated into a as ggml broadcasts (each ne of b divides
    a's; semantics :func:`reference.add`), all f32, any strides; ``out`` may be ``a`` (or ``b`` when it is not
    broadcast) itself. One program per ELT_BLOCK elements."""
    if out.numel() == 0:
        return
    _require(op in ("ADD", "MUL"), f"binary op {op!r}")
    _require(a.dtype == b.dtype == out.dtype == torch.float32, f"{op} of {a.dtype}, {b.dtype} into {out.dtype}")
    _require(tuple(out.shape) == tuple(a.shape) and all(m > 0 and n % m == 0 for n, m in zip(a.shape, b.shape)),
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


# ---- UNARY (SILU, SIGMOID, SOFTPLUS, EXP) ---------------------------------------------------------------------------


UNARY_KINDS = ("SILU", "SIGMOID", "SOFTPLUS", "EXP")


@triton.jit
def unary_f32(x, KIND: tl.constexpr):
    """The reference's expression of each kind (reference.UNARY), operation for operation."""
    if KIND == "SILU":
        y = silu_f32(x)
    elif KIND == "SIGMOID":
        y = tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + exp_f32(-x))
    elif KIND == "SOFTPLUS":
        y = tl.where(x > 20.0, x, log_f32(1.0 + exp_f32(x)))
    else:  # EXP
        y = exp_f32(x)
    return y


@triton.jit
def _unary_kernel(x_ptr, y_ptr, n, ne0, ne1, ne2, x_s0, x_s1, x_s2, x_s3, y_s0, y_s1, y_s2, y_s3,
                  KIND: tl.constexpr, BLOCK: tl.constexpr):
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
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    i0, r = idx % ne0, idx // ne0
    g = tl.load(g_ptr + i0 * g_s0 + _row_offset(r, ne1, ne2, g_s1, g_s2, g_s3), mask=mask)
    u = tl.load(u_ptr + i0 * u_s0 + _row_offset(r, ne1, ne2, u_s1, u_s2, u_s3), mask=mask)
    tl.store(y_ptr + i0 * y_s0 + _row_offset(r, ne1, ne2, y_s1, y_s2, y_s3), silu_f32(g) * u, mask=mask)


def glu(kind: str, a: torch.Tensor, b: torch.Tensor | None, swapped: bool, out: torch.Tensor) -> None:
    """GLU ``kind`` (SWIGLU: silu(gate) * up, SILU's expression then one multiply, as reference.swiglu) into
    ``out``, f32, any strides. Split form (``b`` given): gate a, up b, same shape. One source: each row of a holds
    the gate then the up half (exchanged when ``swapped``), ``out`` ne0 = a ne0 // 2. One program per ELT_BLOCK
    output elements."""
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
    _swiglu_kernel[_grid(out.numel())](
        a, b, out, out.numel(), out.shape[3], out.shape[2], out.shape[1], *_strides(a), *_strides(b),
        *_strides(out), BLOCK=ELT_BLOCK, **LAUNCH)


# ---- L2_NORM and RMS_NORM ------------------------------------------------------------------------------------------


@triton.jit
def _row_norm_kernel(x_ptr, y_ptr, n_rows, ne0, ne1, ne2, eps,
                     x_s1, x_s2, x_s3,          # x rows are contiguous (nb0 == 4)
                     y_s0, y_s1, y_s2, y_s3,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, RMS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < ne0)[None, :]
    x = tl.load(x_ptr + _row_offset(rows, ne1, ne2, x_s1, x_s2, x_s3)[:, None] + cols[None, :], mask=mask, other=0.0)
    if RMS:
        y = rms_scale_rows(x, ne0, eps)
    else:
        y = l2_scale_rows(x, eps)
    tl.store(y_ptr + _row_offset(rows, ne1, ne2, y_s1, y_s2, y_s3)[:, None] + cols[None, :] * y_s0, y, mask=mask)


def _row_norm(x: torch.Tensor, eps: float, out: torch.Tensor, op: str) -> None:
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    if x.numel() == 0:
        return
    xs = _strides(x)
    _require(xs[0] == 1, f"{op} needs contiguous rows")
    _require(tuple(out.shape) == tuple(x.shape), f"{op} output shape {tuple(out.shape)} != {tuple(x.shape)}")
    block_r, block_d = l2_tile(x.shape[3])
    _row_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        x, out, n_rows, x.shape[3], x.shape[2], x.shape[1], f32(eps), xs[1], xs[2], xs[3], *_strides(out),
        BLOCK_R=block_r, BLOCK_D=block_d, RMS=op == "RMS_NORM", **LAUNCH)


def l2_norm(x: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """L2_NORM of each row (along ne0) of ``x`` (nb0 == 4, rows anywhere) into ``out`` (same shape, any strides)."""
    _row_norm(x, eps, out, "L2_NORM")


def rms_norm(x: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """RMS_NORM of each row (along ne0) of ``x`` (nb0 == 4, rows anywhere) into ``out`` (same shape, any strides;
    ``out`` may be ``x``: a program reads its rows before it writes them). One launch, L2_NORM's tile."""
    _row_norm(x, eps, out, "RMS_NORM")


# ---- SCALE ----------------------------------------------------------------------------------------------------------


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, ne0, ne1, ne2, scale, bias, x_s0, x_s1, x_s2, x_s3, y_s0, y_s1, y_s2, y_s3,
                  HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
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


# ---- GDN_CONV_CHAIN (fused) ----------------------------------------------------------------------------------------


@triton.jit
def _gdn_conv_chain_kernel(st_ptr, ids_ptr, x_ptr, w_ptr, y_ptr, q_ptr, k_ptr, table_ptr,
                           n_rows, H_k, n_l2, eps, scale, head_n,  # q/k norm: L2 (eps), or RMS (eps/S, then scale)
                           st_s1,           # states [(dc-1)*C, R]: a row holds dc-1 steps per channel, channel-major
                           x_s0, x_s1,      # x [n_t, C] (the projection, transposed)
                           w_s0, w_s1,      # w [dc, C]
                           y_s0, y_s1,      # y [C, n_t] (the SiLU output)
                           qk_s1, qk_s2,    # q, k [S, H_k, n_t]: contiguous rows, same strides
                           tile_off, tile_sc, tile_sch,  # the shared row (TILE_N > 0)
                           D_CONV: tl.constexpr, S: tl.constexpr, N_T: tl.constexpr, COLUMNS: tl.constexpr,
                           TILE_C0: tl.constexpr, TILE_N: tl.constexpr, WHOLE_ROWS: tl.constexpr,
                           L2_ROWS: tl.constexpr, RMS: tl.constexpr):
    # One program per head of S channels, one thread per channel: the CONCAT row of a channel (dc-1 state columns,
    # then N_T tokens) lives in registers as a tuple, so every tap, window and tile column is picked at compile time.
    head = tl.program_id(0)
    i = tl.arange(0, S)
    ch = head * S + i

    # Every read first: the writes below may land on what was read, within this program's channels (a snapshot
    # row on the gathered row, the SiLU output on token columns of the projection).
    w = ()
    for j in tl.static_range(D_CONV):
        w = w + (tl.load(w_ptr + ch * w_s1 + j * w_s0),)
    st = st_ptr + tl.load(ids_ptr).to(tl.int64) * st_s1 + ch * (D_CONV - 1)
    cat = ()
    for c in tl.static_range(D_CONV - 1):
        cat = cat + (tl.load(st + c),)
    for t in tl.static_range(N_T):
        cat = cat + (tl.load(x_ptr + t * x_s0 + ch * x_s1),)
    # per-window destinations (table rows [offset, channel stride, step stride]); loaded now: a load after the
    # stores below would wait for them (it may alias them), one more round trip on the critical path
    offsets = ()
    for r in tl.static_range(len(COLUMNS)):
        offsets = offsets + (tl.load(table_ptr + r),)
    ys = ()
    for t in tl.static_range(N_T):
        win = ()
        for j in tl.static_range(D_CONV):
            win = win + (cat[t + j],)
        ys = ys + (silu_f32_unrolled(conv_dot(win, w)),)
    tl.debug_barrier()  # every thread's reads happen before any thread's writes

    for t in tl.static_range(N_T):
        tl.store(y_ptr + ch * y_s0 + t * y_s1, ys[t])
    for r in tl.static_range(len(COLUMNS)):  # window r = CONCAT columns COLUMNS[r] .. +dc-2
        if WHOLE_ROWS:  # llama.cpp's cache rows: [C, dc-1] contiguous
            dst, s_step = st_ptr + offsets[r] + ch * (D_CONV - 1), 1
        else:
            dst = st_ptr + offsets[r] + ch * tl.load(table_ptr + n_rows + r)
            s_step = tl.load(table_ptr + 2 * n_rows + r)
        for s in tl.static_range(D_CONV - 1):
            tl.store(dst + s * s_step, cat[COLUMNS[r] + s])
    # the shared row of overlapping windows (matcher rule 5b): columns TILE_C0 .. +TILE_N-1, each stored once
    for c in tl.static_range(TILE_N):
        tl.store(st_ptr + tile_off + ch * tile_sch + (TILE_C0 + c) * tile_sc, cat[TILE_C0 + c])

    if head < n_l2:  # a q or a k head
        # The L2 tree sums a row within a thread; the rows are spread one channel per thread here. Read them back
        # from y (this program's writes, visible to it after a barrier) as a [tokens, S] tile instead: its loads
        # are 16-byte vectors, tokens go to warps and the tree's first levels stay within a thread.
        tl.debug_barrier()
        tok = tl.arange(0, L2_ROWS)[:, None]
        mask = tl.broadcast_to(tok < N_T, [L2_ROWS, S])
        y = tl.load(y_ptr + (head * S + i[None, :]) * y_s0 + tok * y_s1, mask=mask, other=0.0)
        o_ptr = tl.where(head < H_k, q_ptr + head * qk_s1, k_ptr + (head - H_k) * qk_s1)
        if RMS:  # upstream's RMS_NORM then SCALE: the unfused kernels' expressions, in their order
            qk = rms_scale_rows(y, head_n, eps) * scale
        else:
            qk = l2_scale_rows(y, eps)
        tl.store(o_ptr + tok * qk_s2 + i[None, :], qk, mask=mask)


def _offset(states: torch.Tensor, v: torch.Tensor) -> int:
    """Element offset of view ``v`` from ``states`` (both views of the cache buffer)."""
    _require(v.untyped_storage().data_ptr() == states.untyped_storage().data_ptr(),
             "destinations must be cache views")
    return v.storage_offset() - states.storage_offset()


_chain_tables: dict[tuple, torch.Tensor] = {}


def _chain_table(states: torch.Tensor, wins: list[torch.Tensor]) -> torch.Tensor:
    """int32 [offsets from ``states``, channel strides, step strides] of the per-window destinations, on the
    device, built once per distinct table: a later run (or its CUDA-graph capture) then does no host->device copy."""
    vals = ([_offset(states, v) for v in wins] + [v.stride(0) for v in wins] + [v.stride(1) for v in wins]) or [0]
    _require(all(-2**31 <= v < 2**31 for v in vals), "cache offsets must fit in int32")
    key = (states.device, *vals)
    table = _chain_tables.get(key)
    if table is None:
        table = _chain_tables[key] = torch.tensor(vals, dtype=torch.int32, device=states.device)
    return table


def _tile_args(states, wins, columns, tile, d_conv) -> tuple[tuple, int, int]:
    """The kernel's shared-row arguments (offset of CONCAT column 0 from ``states``, step stride, channel stride),
    its first column and its column count; zeros without a tile."""
    if not tile:
        return (0, 0, 0), 0, 0
    idx = tile["windows"]
    s_ch, s_col = wins[idx[0]].stride()
    off = _offset(states, wins[idx[0]]) - columns[idx[0]] * s_col
    first, n = tile["first"], tile["n_cols"]
    # rule 5b, re-checked on the real views: every window is columns column .. +dc-2 of the one shared row
    _require(all(wins[j].stride() == (s_ch, s_col) and _offset(states, wins[j]) == off + columns[j] * s_col
               and first <= columns[j] <= first + n - (d_conv - 1) for j in idx), "windows are not one shared row")
    return (off, s_col, s_ch), first, n


def chain_warps(S: int) -> int:
    """Warps of the fused chain: one thread per channel of a head (H200: 4 warps for S = 128 beat 2 and 8, and
    beat spreading a long verify's tokens over more warps, docs/performance.md)."""
    return min(max(S // 32, 1), 8)


def chain_launch(n_t: int, S: int, num_warps: int | None = None) -> tuple[dict, int]:
    """The fused chain's launch shape for n_t tokens and heads of S channels: (its L2_ROWS constexpr, num_warps);
    ``num_warps`` overrides chain_warps (a benchmark's variants)."""
    num_warps = num_warps or chain_warps(S)
    return dict(L2_ROWS=max(triton.next_power_of_2(n_t), num_warps)), num_warps  # at least a row per warp


def gdn_conv_chain(states, ids, x, w, rows, columns, eps: float, out, q_out, k_out, l2_separate: bool = False,
                   tile: dict | None = None, num_warps: int | None = None, norm: str = "l2",
                   qk_scale: float = 1.0) -> None:
    """GDN_CONV_CHAIN of one sequence (semantics: :func:`reference.gdn_conv_chain_ref`) in one launch (three, or
    five in the RMS form, with ``l2_separate``). ``norm``: the q/k normalisation, "l2" (L2_NORM(eps)) or "rms"
    (RMS_NORM(eps) then SCALE(qk_scale), upstream's form), computed by the same helpers as the unfused kernels.

    states torch (1,1,R,(dc-1)*C), ids int32 (1 element), x (1,1,C,n_t) any strides, w (1,1,C,dc); rows: the
    destinations, views into the storage of ``states`` of C*(dc-1) elements that view as [C, dc-1] (channel, step):
    a whole cache row (1,1,1,(dc-1)*C) or a window (1,1,C,dc-1) of any strides; row r gets window columns
    columns[r] .. columns[r]+dc-2. ``tile`` (the node's op_params["tile"], matcher rule 5b): the rows
    tile["windows"] are windows of one shared row, written once column by column (tile["first"] ..
    +tile["n_cols"]-1); the other rows (or all, without it) are written window by window.
    Writes out (1,1,n_t,C), q_out and k_out (1,n_t,H_k,S).

    The token count, the window columns and the tile's columns are compile-time constants (they are static
    properties of the graph node): one compile per (n_t, columns) of a model, e.g. 16 for llama.cpp's verify step
    at 1..16 tokens. In exchange every register index is static (H200, T=8: 3.6 -> 2.3 us, docs/performance.md).

    One program per head of S channels reads all its inputs, then writes, so within its channels anything may alias:
    a row the gathered row, ``out`` the projection (same layout, shifted by whole tokens). Across programs nothing
    may: q_out and k_out (written by the q/k head programs) must not overlap the projection unless ``l2_separate``,
    where a second launch (the L2_NORM kernel) computes them from ``out`` once the first has read the projection.
    """
    n_t, C, d_conv = x.shape[3], x.shape[2], w.shape[3]
    H_k, S = q_out.shape[2], q_out.shape[3]
    _require(norm in ("l2", "rms"), f"q/k norm {norm!r} is not l2 or rms")
    _require(S & (S - 1) == 0 and C % S == 0 and C >= 2 * H_k * S,
             f"head size {S} must be a power of two dividing {C}")
    _require(1 <= n_t <= CHAIN.max_tokens, f"1..{CHAIN.max_tokens} tokens")
    _require(1 <= len(rows) == len(columns) <= CHAIN.max_rows, f"1..{CHAIN.max_rows} snapshot rows")
    _require(all(0 <= c <= n_t for c in columns), "window columns lie in 0..n_t")
    _require(states.stride(3) == 1, "cache rows must be contiguous")
    wins = [row.view(C, d_conv - 1) for row in rows]
    qs, xs, ws, ys = _strides(q_out), _strides(x), _strides(w), _strides(out)
    _require(qs == _strides(k_out) and qs[0] == 1 and ys[0] == 1,
             "q and k share strides; q, k, out rows contiguous")
    tile_args, first, n_cols = _tile_args(states, wins, columns, tile, d_conv)
    per = [j for j in range(len(rows)) if not tile or j not in tile["windows"]]
    shape, num_warps = chain_launch(n_t, S, num_warps)
    _gdn_conv_chain_kernel[(C // S,)](
        states, ids, x, w, out, q_out, k_out, _chain_table(states, [wins[j] for j in per]),
        len(per), H_k, 0 if l2_separate else 2 * H_k, f32(eps), f32(qk_scale), S, states.stride(2),
        xs[0], xs[1], ws[0], ws[1], ys[0], ys[1], qs[1], qs[2], *tile_args,
        D_CONV=d_conv, S=S, N_T=n_t, COLUMNS=tuple(columns[j] for j in per), TILE_C0=first, TILE_N=n_cols,
        WHOLE_ROWS=all(wins[j].stride() == (d_conv - 1, 1) for j in per), RMS=norm == "rms", **shape,
        **{**LAUNCH, "num_warps": num_warps})
    if l2_separate:
        heads = out[0, 0].unflatten(-1, (-1, S))[None]  # the q/k head views L2_NORM reads: (1, n_t, C/S, S)
        for part, dst in ((heads[:, :, :H_k], q_out), (heads[:, :, H_k:2 * H_k], k_out)):
            if norm == "rms":
                rms_norm(part, eps, dst)
                scale(dst, qk_scale, 0.0, dst)
            else:
                l2_norm(part, eps, dst)


# ---- MUL_MAT (mat-vec) ----------------------------------------------------------------------------------------------


@triton.jit
def _store_y(y_ptr, acc, rows, row_mask, cols, col_mask, ne1, ne2, y_s0, y_s1, y_s2, y_s3):
    y = y_ptr + _row_offset(cols, ne1, ne2, y_s1, y_s2, y_s3)[None, :] + rows[:, None] * y_s0
    tl.store(y, acc, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _mat_vec(w_ptr, y_ptr, rows, row_mask, x_ptr, K, N, ne1, ne2, w_s1, x_s1, x_s2, x_s3,
             y_s0, y_s1, y_s2, y_s3, ws_ptr, cnt_ptr, tile, s,
             COLS: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr, SPLIT_K: tl.constexpr):
    """y[rows] = w[rows]·x. With SPLIT_K > 1 this program sums K slice ``s`` only, into the workspace slot of its
    (product, row block) ``tile``; the program that draws the tile's last ticket adds the slices up (see
    :class:`MatVecTile`)."""
    cols = tl.arange(0, COLS)
    col_mask = cols < N
    x_cols = _row_offset(cols, ne1, ne2, x_s1, x_s2, x_s3)
    if SPLIT_K == 1:
        acc = matvec_cols(w_ptr, w_s1, rows, row_mask, x_ptr, x_cols, col_mask, K, BLOCK_K, DOT)
        _store_y(y_ptr, acc, rows, row_mask, cols, col_mask, ne1, ne2, y_s0, y_s1, y_s2, y_s3)
    else:
        # equal slices of whole K steps (the last one short or empty), so every slice runs the same code
        k_len = tl.cdiv(K, BLOCK_K * SPLIT_K) * BLOCK_K
        k0 = s * k_len
        acc = matvec_cols(w_ptr + k0, w_s1, rows, row_mask, x_ptr + k0, x_cols, col_mask, tl.minimum(k_len, K - k0),
                          BLOCK_K, DOT)
        PART: tl.constexpr = rows.shape[0] * COLS
        # the tile's SPLIT_K partials lie side by side, each a packed [BLOCK_M, COLS] (masked rows and columns are 0)
        part = ws_ptr + tile * (SPLIT_K * PART) + tl.arange(0, rows.shape[0])[:, None] * COLS + cols[None, :]
        tl.store(part + s * PART, acc)
        # Triton's scalar atomic is one thread's: a CTA barrier first, so the release covers every thread's stores
        # (it broadcasts the ticket through shared memory behind a barrier, so every thread's loads follow the acquire)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            # the slices in their order, whichever program finishes last: the bytes do not depend on the schedule.
            # .cg: read at L2, never a line this SM's L1 kept from an earlier launch
            total = tl.load(part, cache_modifier=".cg")
            for j in tl.static_range(1, SPLIT_K):
                total += tl.load(part + j * PART, cache_modifier=".cg")
            _store_y(y_ptr, total, rows, row_mask, cols, col_mask, ne1, ne2, y_s0, y_s1, y_s2, y_s3)
            tl.store(cnt_ptr + tile, 0)  # zero for the next launch (and the next CUDA-graph replay)


@triton.jit
def _mul_mat_vec_kernel(w_ptr, y_ptr, w2_ptr, y2_ptr, x_ptr, M, K, N, ne1, ne2,
                        w_s1,                  # w, w2 [K, M], contiguous rows
                        x_s1, x_s2, x_s3,      # x [K, ne1, ne2, ne3], contiguous rows, N = ne1*ne2*ne3 columns
                        y_s0, y_s1, y_s2, y_s3,
                        ws_ptr, cnt_ptr,       # split-K partials (f32) and tickets (i32); None when SPLIT_K == 1
                        b2, r2, r3,            # batches (grid axis 2: x's ne2 * ne3, 1 unbatched): ne2, broadcasts
                        w_b2, w_b3, x_b2, x_b3, y_b2, y_b3,  # the batch strides (0 unbatched)
                        BLOCK_M: tl.constexpr, COLS: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                        SPLIT_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    # grid axis 1: product-major, then K slice (size 1, or 2 for a pair, when SPLIT_K == 1)
    product, s = tl.program_id(1) // SPLIT_K, tl.program_id(1) % SPLIT_K
    # grid axis 2: the batch (i2, i3) of a batched MUL_MAT, whose weight matrix is (i2 // r2, i3 // r3) as ggml's
    batch = tl.program_id(2)
    i2, i3 = batch % b2, batch // b2
    w_off = (i2 // r2).to(tl.int64) * w_b2 + (i3 // r3).to(tl.int64) * w_b3
    x_ptr += i2.to(tl.int64) * x_b2 + i3.to(tl.int64) * x_b3
    y_off = i2.to(tl.int64) * y_b2 + i3.to(tl.int64) * y_b3
    # (batch, product, row block): its workspace slot and ticket
    tile = (batch * (tl.num_programs(1) // SPLIT_K) + product) * tl.num_programs(0) + tl.program_id(0)
    if product == 0:
        _mat_vec(w_ptr + w_off, y_ptr + y_off, rows, row_mask, x_ptr, K, N, ne1, ne2, w_s1, x_s1, x_s2, x_s3,
                 y_s0, y_s1, y_s2, y_s3, ws_ptr, cnt_ptr, tile, s, COLS, BLOCK_K, DOT, SPLIT_K)
    else:  # the pair's second product
        _mat_vec(w2_ptr + w_off, y2_ptr + y_off, rows, row_mask, x_ptr, K, N, ne1, ne2, w_s1, x_s1, x_s2, x_s3,
                 y_s0, y_s1, y_s2, y_s3, ws_ptr, cnt_ptr, tile, s, COLS, BLOCK_K, DOT, SPLIT_K)


class MatVecTile(NamedTuple):
    """One mat-vec launch shape: BLOCK_M weight rows per program, COLS (the padded column count, a constexpr: one
    compile per power of two, so a 1-column product does not pay for 16), BLOCK_K per step, the DOT form, warps, and
    ``split_k``, the K slices per row block.

    split_k = 1: one program per row block sums all of K and stores y (no workspace, no atomics). split_k = S > 1
    (a power of two) fills the GPU when the row blocks alone do not: S programs per row block, each summing one of
    S equal K slices (whole BLOCK_K steps, :func:`matvec_cols` over the sub-range) into an f32 workspace slot, then
    drawing a ticket on the block's counter (an acq_rel atomic add). The program that draws the last ticket, whichever
    it is, adds the S partials in the fixed order 0..S-1 in f32, stores y and zeroes the counter. One launch, and
    bytes that depend on (shape, type, tile) only: run to run, and a pair's product against its single mat-vec. The
    workspace (:func:`_split_workspace`) is shared by all launches on a device, so they must run on one stream in
    order, as the executor's do."""

    block_m: int
    cols: int
    block_k: int
    dot: bool   # tensor cores instead of CUDA-core FMAs: see matvec_cols
    warps: int
    split_k: int = 1


def mat_vec_tile(M: int, N: int, K: int, wtype: str) -> MatVecTile:
    """The tile for an M-row, N-column product over K of ``wtype`` ("f32", "f16", "bf16") weights: a function of the
    shape and type alone, so both products of a pair (one launch, one tile) are byte-identical to their single
    mat-vecs.

    Chosen from H200 timings (``benchmarks/tune_matvec.py``; the sweeps and tables in docs/performance.md). Thin
    outputs (alpha/beta: 32 rows): one row per program with K in few steps up to 4 columns; from 8 columns two rows
    per program and K split 8 ways (the column loads, not the weight, bound them). Up to 2 columns (4 for f32 and
    f16) the FMA form reads at memory speed with 4-8 rows per program (one column of up to 1024 rows only with two
    rows and K steps of 2048, as the thin products); beyond, the FMA form is bound by its arithmetic and the
    tensor-core form wins (from 1024 rows; below, the FMA form throughout), in K steps of 64 (128 for bf16 below
    4096 rows). Its row blocks alone leave most of the 132 SMs idle, so it splits K (:func:`_split`: a few hundred
    programs) below the lm head for bf16 and up to 8192 rows for f32. f16 weights take f32's tiles (not timed
    apart). With fusion on, FFN gate / up and attention k / v run only as pairs (twice the programs of one
    product): their bf16 tiles, and the f32 tile of k / v, were timed as pairs."""
    cols = triton.next_power_of_2(N)
    if M <= 256:
        if cols >= 8:
            return MatVecTile(2, cols, 512, False, 4, _split(K, 512, 8))
        return MatVecTile(1, cols, min(triton.next_power_of_2(K), max(256, 8192 // cols)), False, 8)
    if wtype == "bf16":
        if cols >= 4 and M > 65536:  # the lm head fills the GPU unsplit
            return MatVecTile(128, 16, 64, True, 4)
        # FFN gate / up (12288), qkv and attention q+gate (8192), z / ssm_out / attention o / FFN down (4096)
        if cols >= 4 and M >= 4096:
            return MatVecTile(128, 16, 64, True, 8, _split(K, 64, 4 if M >= 8192 else 8))
        if cols >= 4 and M >= 1024:  # attention k / v
            return MatVecTile(128, 16, 128, True, 8, _split(K, 128, 8))
    elif cols >= 8 and M >= 8192:
        return MatVecTile(64, 16, 64, True, 4, _split(K, 64, 1 if M > 8192 else 2))
    elif cols >= 8 and M >= 1024:  # (attention k / v, 1024 rows: 8 slices, timed as the pair)
        return MatVecTile(64, 16, 64, True, 4, _split(K, 64, 4 if M >= 4096 else 8))
    small = M <= 1024  # (an accumulator of 4 x 16 x 512 would spill: 16 columns take K steps of 256)
    if small and cols == 1:  # one column of few rows: the thin products' shape, two rows and K in long steps
        return MatVecTile(2, 1, min(triton.next_power_of_2(K), 2048), False, 8)
    return MatVecTile(4 if small else 8, cols, 512 if cols <= 2 or small and cols <= 8 else 256, False, 4)


def _split(K: int, block_k: int, want: int) -> int:
    """K slices of a row block: ``want`` (a power of two), but never more slices than K steps (the launcher
    requires a power of two)."""
    return min(want, 1 << max(triton.cdiv(K, block_k).bit_length() - 1, 0))  # (K = 0: one empty slice, y = 0)


WTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

# The split-K workspace of each device: (partials f32, tickets i32). The tickets are zeroed once, here; every launch
# leaves them zero again. Shared by all launches on the device, so it assumes they run on one stream in order (the
# executor's case). Grown (never shrunk) when a launch needs more; an outgrown pair stays alive in _RETIRED, since a
# captured CUDA graph keeps its addresses. Growing allocates, which CUDA-graph capture forbids: the first launch of
# a shape must come before capture (the executor warms up first).
_SPLIT_WORKSPACE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = []


def _split_workspace(device: torch.device, partials: int, tickets: int) -> tuple[torch.Tensor, torch.Tensor]:
    ws = _SPLIT_WORKSPACE.get(device)
    if ws is not None and ws[0].numel() >= partials and ws[1].numel() >= tickets:
        return ws
    _require(device.type != "cuda" or not torch.cuda.is_current_stream_capturing(),
             f"mul_mat_vec: the split-K workspace would grow (to {partials} partials) inside CUDA-graph capture; "
             "launch the graph's mat-vecs once before capturing it")
    _require(partials < 2 ** 31, f"mul_mat_vec: a split-K workspace of {partials} partials overflows i32 offsets")
    if ws is not None:
        _RETIRED.append(ws)
        partials, tickets = max(partials, 2 * ws[0].numel()), max(tickets, 2 * ws[1].numel())
    ws = (torch.empty(partials, dtype=torch.float32, device=device),
          torch.zeros(tickets, dtype=torch.int32, device=device))
    _SPLIT_WORKSPACE[device] = ws
    return ws


def _mat_vecs(products, x: torch.Tensor, tile: MatVecTile | None = None) -> None:
    """Launch [(w, out)] or [(w_a, out_a), (w_b, out_b)]: grid axis 1 picks the product (and the K slice). One
    kernel and one tile for both, so each product of a pair is byte-identical to the single mat-vec of its weight.
    A weight with batch dimensions (attention's K and V views) is a batched product: grid axis 2 runs x's batches,
    each against the weight matrix ggml's broadcast gives it. ``tile``: a benchmark's override of
    :func:`mat_vec_tile`."""
    (w, out), (w2, out2) = products[0], products[-1]
    M, K = w.shape[-2], w.shape[-1]
    batched = w.shape[0] * w.shape[1] > 1
    N = mat_vec_columns(w.shape[0] * w.shape[1], x.shape[::-1])
    for v, y in products:
        _require(v.shape == w.shape and v.dtype == w.dtype and v.stride() == w.stride() and y.stride() == out.stride(),
                 "the products of a pair need weights and outputs of one shape, type and layout")
    _require(w.stride(-1) == 1 and (batched or w.numel() == M * K),
             "mul_mat_vec needs weight matrices with contiguous rows")
    _require(not batched or len(products) == 1, "mul_mat_vec: a pair of batched products")
    _require(not batched or x.shape[1] % w.shape[1] == 0 and x.shape[0] % w.shape[0] == 0,
             f"mul_mat_vec: weight batches {tuple(w.shape[:2])} do not broadcast over {tuple(x.shape[:2])}")
    _require(w.dtype in WTYPES and x.dtype == torch.float32, f"mul_mat_vec of {w.dtype} weights and {x.dtype} columns")
    _require(1 <= N <= MAT_VEC_COLS and x.stride(-1) == 1, f"mul_mat_vec takes 1..{MAT_VEC_COLS} contiguous columns")
    _require(x.shape[3] == K and out.shape[3] == M and (out.shape[:3] == x.shape[:3] if batched else
                                                           out.numel() == M * N),
             f"mul_mat_vec: columns of {x.shape[3]} for K {K}, output rows of {out.shape[3]} for M {M}")
    t = tile or mat_vec_tile(M, N, K, WTYPES[w.dtype])
    _require(t.split_k >= 1 and t.split_k & (t.split_k - 1) == 0, f"mul_mat_vec: split_k {t.split_k} is not 2^n")
    blocks, batches = triton.cdiv(M, t.block_m), x.shape[0] * x.shape[1] if batched else 1
    ws = cnt = None
    if t.split_k > 1:
        tiles = blocks * len(products) * batches
        ws, cnt = _split_workspace(w.device, tiles * t.split_k * t.block_m * t.cols, tiles)
    xs, ys = _strides(x), _strides(out)
    if batched:  # columns are x's ne1 alone; ne2 / ne3 are the batches
        cols_x, cols_y = (N, 1, xs[1], 0, 0), (ys[0], ys[1], 0, 0)
        batch = (x.shape[1], x.shape[1] // w.shape[1], x.shape[0] // w.shape[0], w.stride(1), w.stride(0),
                 xs[2], xs[3], ys[2], ys[3])
    else:
        cols_x, cols_y = (x.shape[2], x.shape[1], xs[1], xs[2], xs[3]), ys
        batch = (1, 1, 1, 0, 0, 0, 0, 0, 0)
    _mul_mat_vec_kernel[(blocks, len(products) * t.split_k, batches)](
        w, out, w2, out2, x, M, K, N, *cols_x[:2], w.stride(-2), *cols_x[2:], *cols_y, ws, cnt, *batch,
        BLOCK_M=t.block_m, COLS=t.cols, BLOCK_K=t.block_k, DOT=t.dot, SPLIT_K=t.split_k,
        **{**LAUNCH, "num_warps": t.warps})


def mul_mat_vec(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
    """MUL_MAT for few columns: w ne [K, M] (f32/f16/bf16, torch (..., M, K) with unit leading dims, contiguous rows),
    x f32 ne [K, N1, N2, N3] with N1*N2*N3 <= 16 columns, out f32 ne [M, N1, N2, N3]; or batched, as attention's
    KQ and KQV: w ne [K, M, W2, W3] (any batch strides, contiguous rows), x ne [K, N1, B2, B3] with N1 <= 16 and
    W2 | B2, W3 | B3, out ne [M, N1, B2, B3]."""
    _mat_vecs([(w, out)], x)


def mul_mat_vec_pair(w_a: torch.Tensor, w_b: torch.Tensor, x: torch.Tensor, out_a: torch.Tensor,
                     out_b: torch.Tensor) -> None:
    """MUL_MAT_VEC_PAIR: out_a = w_a·x and out_b = w_b·x (same weight shape, type and strides; outputs of one layout)
    in one launch of the mul_mat_vec kernel, so each product is byte-identical to mul_mat_vec of its weight alone."""
    _mat_vecs([(w_a, out_a), (w_b, out_b)], x)


# ---- ROPE -----------------------------------------------------------------------------------------------------------


@triton.jit
def _rope_stream(k, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr, IMROPE: tl.constexpr):
    """The position stream (t 0, h 1, w 2, e 3) pair k rotates by: reference._mrope_stream's sector rule."""
    sector = k % (S0 + S1 + S2 + S3)
    if IMROPE:
        stream = tl.where((sector % 3 == 1) & (sector < 3 * S1), 1,
                          tl.where((sector % 3 == 2) & (sector < 3 * S2), 2,
                                   tl.where((sector % 3 == 0) & (sector < 3 * S0), 0, 3)))
    else:
        stream = tl.where(sector >= S0 + S1 + S2, 3,
                          tl.where(sector >= S0 + S1, 2, tl.where(sector >= S0, 1, 0)))
    return stream


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, ff_ptr, y_ptr, n_rows, ne0, ne1, ne2, n_tok,
                 x_s1, x_s2, x_s3, y_s1, y_s2, y_s3,
                 theta_scale, freq_scale, ext_factor, corr0, corr_den, mscale,
                 N_DIMS: tl.constexpr, N_OFFS: tl.constexpr, NORMAL: tl.constexpr, MROPE: tl.constexpr,
                 IMROPE: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
                 HAS_FF: tl.constexpr, YARN: tl.constexpr, BLOCK_R: tl.constexpr, HALF_B: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    HALF: tl.constexpr = N_DIMS // 2
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    r64 = r.to(tl.int64)  # (row offsets in int64)
    i1, i2, i3 = r64 % ne1, r64 // ne1 % ne2, r64 // (ne1 * ne2)  # head, token, ne3
    x_row = i1 * x_s1 + i2 * x_s2 + i3 * x_s3
    y_row = i1 * y_s1 + i2 * y_s2 + i3 * y_s3
    k = tl.arange(0, HALF_B)
    kmask = k < HALF
    m2 = rmask[:, None] & kmask[None, :]
    if MROPE:
        stream = _rope_stream(k, S0, S1, S2, S3, IMROPE)
    else:
        stream = k * 0
    theta = tl.load(pos_ptr + stream[None, :] * n_tok + i2[:, None], mask=m2, other=0).to(tl.float32)
    for j in range(1, HALF):  # θ_k = p·s·s·…·s, k multiplications in order: ggml-cpu's rope cache
        theta = tl.where(k[None, :] >= j, theta * theta_scale, theta)
    if HAS_FF:
        theta = tl.math.div_rn(theta, tl.load(ff_ptr + k, mask=kmask, other=1.0)[None, :])
    t = theta * freq_scale
    if YARN:
        y = tl.math.div_rn(k.to(tl.float32) - corr0, corr_den)
        ramp = (1.0 - tl.minimum(1.0, tl.maximum(0.0, y))) * ext_factor
        t = t * (1.0 - ramp)[None, :] + theta * ramp[None, :]
    c, s = cos_sin_f64(t.to(tl.float64))
    c = c.to(tl.float32) * mscale
    s = s.to(tl.float32) * mscale
    if NORMAL:
        d0 = N_OFFS + 2 * k
        d1 = d0 + 1
    else:
        d0 = N_OFFS + k
        d1 = d0 + HALF
    x0 = tl.load(x_ptr + x_row[:, None] + d0[None, :], mask=m2, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + x_row[:, None] + d1[None, :], mask=m2, other=0.0).to(tl.float32)
    d = tl.arange(0, BLOCK_D)
    rest = rmask[:, None] & ((d < N_OFFS) | ((d >= N_OFFS + N_DIMS) & (d < ne0)))[None, :]
    kept = tl.load(x_ptr + x_row[:, None] + d[None, :], mask=rest, other=0.0)  # (every load before any store)
    ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + y_row[:, None] + d0[None, :], (x0 * c - x1 * s).to(ty), mask=m2)
    tl.store(y_ptr + y_row[:, None] + d1[None, :], (x0 * s + x1 * c).to(ty), mask=m2)
    tl.store(y_ptr + y_row[:, None] + d[None, :], kept.to(ty), mask=rest)


ROPE_ROWS = 16  # rows (head x token) per program


def rope(x: torch.Tensor, pos: torch.Tensor, ff: torch.Tensor | None, out: torch.Tensor, *, n_dims: int, mode: int,
         n_ctx_orig: int, freq_base: float, freq_scale: float, ext_factor: float, attn_factor: float,
         beta_fast: float, beta_slow: float, sections=(0, 0, 0, 0), n_offs: int = 0) -> None:
    """ROPE into ``out`` (semantics and parameters: :func:`reference.rope`), one launch: each program rotates
    ROPE_ROWS rows, making their angles as ggml-cpu's rope cache does (the reference's arithmetic, rounding for
    rounding; cos and sin in double), and copies the rest of each row. x and out f32 or f16, rows contiguous."""
    _require(mode in ref.ROPE_IMPLEMENTED, f"ROPE mode {mode} is not implemented")
    n3, n2, n1, ne0 = x.shape
    _require(n_dims % 2 == 0 and n_offs % 2 == 0 and 0 <= n_offs and n_offs + n_dims <= ne0,
             f"ROPE: n_dims {n_dims}, n_offs {n_offs} do not fit rows of {ne0}")
    _require(x.stride(-1) == 1 and out.stride(-1) == 1 and out.shape == x.shape, "ROPE: rows must be contiguous")
    mrope = bool(mode & ref.ROPE_MROPE)
    _require(pos.is_contiguous() and pos.numel() == (4 if mrope else 1) * n2, "ROPE: positions do not fit")
    _alias_ok("ROPE", out, x)
    c = ref.rope_scalars(n_dims, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow)
    xs, ys = _strides(x), _strides(out)
    rows = n1 * n2 * n3
    s0, s1, s2, s3 = (int(v) for v in sections)
    _rope_kernel[(triton.cdiv(rows, ROPE_ROWS),)](
        x, pos, ff if ff is not None else x, out, rows, ne0, n1, n2, n2, xs[1], xs[2], xs[3], ys[1], ys[2], ys[3],
        c["theta_scale"], freq_scale, ext_factor, c["corr0"], c["corr_den"], c["mscale"],
        N_DIMS=n_dims, N_OFFS=n_offs, NORMAL=mode == ref.ROPE_NORMAL, MROPE=mrope, IMROPE=mode == ref.ROPE_IMROPE,
        S0=s0, S1=s1, S2=s2, S3=s3, HAS_FF=ff is not None, YARN=ext_factor != 0.0, BLOCK_R=ROPE_ROWS,
        HALF_B=triton.next_power_of_2(max(1, n_dims // 2)), BLOCK_D=triton.next_power_of_2(ne0), **LAUNCH)


# ---- GATED_DELTA_NET ------------------------------------------------------------------------------------------------


@triton.jit
def _gdn_inputs(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, t, seq, h, H_k, i, col, cmask, strides):
    """Token t's q, k (as a column), v, decay and beta for head h."""
    qk_s1, qk_s2, qk_s3, v_s1, v_s2, v_s3, g_s0, g_s1, g_s2, g_s3, b_s1, b_s2, b_s3 = strides
    qk = seq * qk_s3 + t * qk_s2 + (h % H_k) * qk_s1
    q = tl.load(q_ptr + qk + i)
    kk = tl.load(k_ptr + qk + i)[:, None]
    v = tl.load(v_ptr + seq * v_s3 + t * v_s2 + h * v_s1 + col, mask=cmask, other=0.0)
    gate = tl.exp(tl.load(g_ptr + seq * g_s3 + t * g_s2 + h * g_s1 + i * g_s0))
    beta = tl.load(b_ptr + seq * b_s3 + t * b_s2 + h * b_s1)
    return q, kk, v, gate, beta


@triton.jit
def _gdn_step(st, q, kk, v, gate, beta, scale, o_ptrs, snap_ptrs, cmask, slot, K):
    """One token of the recurrence on a [S, BLOCK_V] state slice: stores its scores and, into snapshot ``slot``
    (slot 0 = the state after the last token; slots >= K are not written), the new slice; returns the slice."""
    st = st * gate[:, None]
    delta = (v - tl.sum(st * kk, axis=0)) * beta
    st = st + kk * delta[None, :]
    tl.store(o_ptrs, tl.sum(st * q[:, None], axis=0) * scale, mask=cmask)
    tl.store(snap_ptrs, st, mask=cmask[None, :] & (slot < K))
    return st


@triton.jit
def _gdn_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr,
                n_t, n_s, H_v, H_k, K, scale,
                qk_s1, qk_s2, qk_s3,        # q, k [S, H_k, n_t, n_s], contiguous rows, same strides
                v_s1, v_s2, v_s3,           # v    [S, H_v, n_t, n_s], contiguous rows
                g_s0, g_s1, g_s2, g_s3,     # g    [1 or S, H_v, n_t, n_s]; g_s0 = 0 for one gate per head
                b_s1, b_s2, b_s3,           # beta [1, H_v, n_t, n_s]
                st_s1, st_s2, st_s3,        # state [S, S, H_v, n_s]: (i0=i, i1=col) = S[i][col]
                S: tl.constexpr, BLOCK_V: tl.constexpr, N_T: tl.constexpr):
    cb, h, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i = tl.arange(0, S)                               # key index: tile rows
    col = cb * BLOCK_V + tl.arange(0, BLOCK_V)        # value index: tile columns
    cmask = col < S
    tile = col[None, :] * st_s1 + i[:, None]          # state-layout offsets of the [S, BLOCK_V] slice
    st = tl.load(s_ptr + seq * st_s3 + h * st_s2 + tile, mask=cmask[None, :], other=0.0)
    n_scores = S * H_v * n_t * n_s
    slot_size = S * S * H_v * n_s
    snap_ptrs = o_ptr + n_scores + (seq * H_v + h) * S * S + tile
    o_ptrs = o_ptr + (seq * n_t * H_v + h) * S + col
    strides = (qk_s1, qk_s2, qk_s3, v_s1, v_s2, v_s3, g_s0, g_s1, g_s2, g_s3, b_s1, b_s2, b_s3)
    if N_T > 0:  # a verify's few tokens, unrolled: every token's inputs loaded before the first store (a load
        # after a store that may alias it waits for it: one memory round trip per token otherwise)
        qs, ks, vs, gates, betas = (), (), (), (), ()
        for t in tl.static_range(N_T):
            q, kk, v, gate, beta = _gdn_inputs(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, t, seq, h, H_k, i, col, cmask,
                                               strides)
            qs, ks, vs, gates, betas = qs + (q,), ks + (kk,), vs + (v,), gates + (gate,), betas + (beta,)
        for t in tl.static_range(N_T):
            slot = N_T - 1 - t
            st = _gdn_step(st, qs[t], ks[t], vs[t], gates[t], betas[t], scale, o_ptrs + t * H_v * S,
                           snap_ptrs + slot * slot_size, cmask, slot, K)
    else:  # a prompt's many tokens
        for t in range(n_t):
            q, kk, v, gate, beta = _gdn_inputs(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, t, seq, h, H_k, i, col, cmask,
                                               strides)
            slot = n_t - 1 - t
            st = _gdn_step(st, q, kk, v, gate, beta, scale, o_ptrs + t * H_v * S, snap_ptrs + slot * slot_size,
                           cmask, slot, K)


def gated_delta_net(q, k, v, g, beta, state, K: int, out: torch.Tensor, block_v: int = GDN_BLOCK_V,
                    num_warps: int = GDN_WARPS, unrolled: bool = True) -> None:
    """GATED_DELTA_NET into ``out`` (contiguous, ne [S*H_v, n_t*n_s + K*S*n_s]); see the reference for semantics.
    One program per (value-column block, v-head, seq) keeps its [S, block_v] state slice in registers. Up to
    MAX_UNROLLED_T tokens the token loop is unrolled (one compile per n_t; ``unrolled=False`` keeps the loop): the
    same steps in the same order either way, so the bytes do not depend on it."""
    n_s, n_t, H_v, S = v.shape
    _require(S & (S - 1) == 0, f"head size {S} must be a power of two")
    _require(out.is_contiguous(), "the GDN output must be contiguous")
    qs, ks, vs, gs, bs, ss = (_strides(t) for t in (q, k, v, g, beta, state))
    _require(qs == ks and qs[0] == vs[0] == 1 and ss[0] == 1, "q, k share strides; q, k, v, state rows contiguous")
    _alias_ok("GATED_DELTA_NET", out, q, k, v, g, beta, state, same_ok=False)  # (another program reads them all)
    g_s0 = gs[0] if g.shape[3] == S else 0
    block_v = min(block_v, S)
    _gdn_kernel[(triton.cdiv(S, block_v), H_v, n_s)](
        q, k, v, g, beta, state, out, n_t, n_s, H_v, q.shape[2], K, gdn_scale(S),
        qs[1], qs[2], qs[3], vs[1], vs[2], vs[3], g_s0, gs[1], gs[2], gs[3], bs[1], bs[2], bs[3],
        ss[1], ss[2], ss[3], S=S, BLOCK_V=block_v, N_T=n_t if unrolled and n_t <= MAX_UNROLLED_T else 0,
        **{**LAUNCH, "num_warps": num_warps})


# ---- launch sizes (for cost estimates) -------------------------------------------------------------------------------


def programs(node) -> list[tuple[str, int, int]]:
    """The Triton programs one execution of graph node ``node`` (a :class:`gdnpass.ir.Tensor`) launches under
    :data:`gdnpass.kernels.backends.TRITON_BACKEND`, from the launchers' own block sizes: ``[(kernel, programs,
    steps)]``, ``steps`` being each program's loop trip count (tokens for ssm_conv, gdn and chain; K blocks for
    mat_vec; 1 otherwise). Empty for nodes that run on torch (MUL_MATs of over 16 columns), for the attention
    ops (:func:`gdnpass.kernels.backends.programs` adds triton_attention's) or nodes that launch nothing. Pure:
    reads shapes only."""
    from gdnpass.ir import Op, Unary, runs_kernel
    from gdnpass.kernels.limits import runs_as_mat_vec

    if not runs_kernel(node):
        return []
    op, ne = node.op, node.ne
    blocks = triton.cdiv(node.nelements, ELT_BLOCK)  # the elementwise and data-movement kernels: one per block
    if op is Op.UNARY:
        kind = Unary(node.op_params["kind"]).value
        return [(kind.lower(), blocks, 1)] if kind in UNARY_KINDS else []
    if op is Op.GLU:
        return [("swiglu", blocks, 1)] if node.op_params.get("kind") == "SWIGLU" else []
    if op in (Op.SCALE, Op.ADD, Op.MUL, Op.CONCAT, Op.GET_ROWS):
        return [(op.value.lower(), blocks, 1)]
    if op in (Op.CPY, Op.CONT):
        return [("cpy", blocks, 1)]
    if op is Op.SET_ROWS:
        rows = node.src[0]
        return [("set_rows", rows.ne[1] * rows.ne[2] * rows.ne[3] * triton.cdiv(rows.ne[0], ELT_BLOCK), 1)]
    if op in (Op.L2_NORM, Op.RMS_NORM):
        block_r, _ = l2_tile(ne[0])
        return [(op.value.lower(), triton.cdiv(ne[1] * ne[2] * ne[3], block_r), 1)]
    if op is Op.SSM_CONV:
        C, n_t, n_s = ne[0], ne[1], ne[2]
        return [(f"ssm_conv{node.src[1].ne[0]}", n_s * triton.cdiv(C, CONV_BLOCK_C), n_t)]
    if op in (Op.MUL_MAT, Op.MUL_MAT_VEC_PAIR):
        w, x = node.src[0], node.src[1]
        batches = x.ne[2] * x.ne[3] if w.ne[2] * w.ne[3] != 1 else 1  # attention's batched KQ / KQV
        K, M, N = w.ne[0], w.ne[1], mat_vec_columns(w.ne[2] * w.ne[3], x.ne)
        if not runs_as_mat_vec(M, N):
            return []  # torch's matmul
        t = mat_vec_tile(M, N, K, w.type.value[0])
        return [("mat_vec", triton.cdiv(M, t.block_m) * t.split_k * batches * (2 if op is Op.MUL_MAT_VEC_PAIR else 1),
                 triton.cdiv(K, t.block_k * t.split_k))]
    if op is Op.ROPE:
        return [("rope", triton.cdiv(ne[1] * ne[2] * ne[3], ROPE_ROWS), 1)]
    if op is Op.GATED_DELTA_NET:
        v = node.src[2]  # ne [S, H_v, n_t, n_s]
        S, H_v, n_t, n_s = v.ne
        return [("gdn", triton.cdiv(S, min(GDN_BLOCK_V, S)) * H_v * n_s, n_t)]
    if op is Op.GDN_CONV_CHAIN:
        p = node.op_params
        C, n_t, S = node.ne[0], int(p["n_tokens"]), int(p["head_dim"])
        out = [(f"chain{p['d_conv']}", C // S, n_t)]
        if p.get("l2_separate"):
            block_r, _ = l2_tile(S)
            out.append(("l2_norm", 2 * triton.cdiv(n_t * int(p["n_k_heads"]), block_r), 1))
        return out
    return []
