"""The Triton kernel of ROPE (every mode :func:`gdnpass.kernels.reference.rope` implements): angles made as
ggml-cpu's rope cache makes them, cos and sin in double as torch computes them
(:func:`gdnpass.kernels.triton_core.cos_sin_f64`). Conventions: :mod:`gdnpass.kernels.triton_core`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnpass.kernels import reference as ref
from gdnpass.kernels.triton_core import LAUNCH, _alias_ok, _require, _strides, cos_sin_f64, wait_for_previous_kernels


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
def _rope_kernel(x_ptr, pos_ptr, ff_ptr, y_ptr, ne0, ne1, ne2, n_tok,
                 x_s1, x_s2, x_s3, y_s1, y_s2, y_s3,
                 theta_scale, freq_scale, ext_factor, corr0, corr_den, mscale,
                 N_DIMS: tl.constexpr, N_OFFS: tl.constexpr, NORMAL: tl.constexpr, MROPE: tl.constexpr,
                 IMROPE: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
                 HAS_FF: tl.constexpr, YARN: tl.constexpr, BLOCK_H: tl.constexpr, HALF_B: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Program (token row i2 + ne2·i3, block of BLOCK_H heads): the angles depend on the token only, so they and
    their cos and sin (in double, the costly part) are made once a program, [HALF_B], and shared by its heads."""
    wait_for_previous_kernels()
    HALF: tl.constexpr = N_DIMS // 2
    tok = tl.program_id(0).to(tl.int64)  # (row offsets in int64)
    i2, i3 = tok % ne2, tok // ne2
    i1 = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = i1 < ne1
    x_row = i1.to(tl.int64) * x_s1 + i2 * x_s2 + i3 * x_s3
    y_row = i1.to(tl.int64) * y_s1 + i2 * y_s2 + i3 * y_s3
    k = tl.arange(0, HALF_B)
    kmask = k < HALF
    if MROPE:
        stream = _rope_stream(k, S0, S1, S2, S3, IMROPE)
    else:
        stream = k * 0
    theta = tl.load(pos_ptr + stream * n_tok + i2, mask=kmask, other=0).to(tl.float32)
    for j in range(1, HALF):  # θ_k = p·s·s·…·s, k multiplications in order: ggml-cpu's rope cache
        theta = tl.where(k >= j, theta * theta_scale, theta)
    if HAS_FF:
        theta = tl.math.div_rn(theta, tl.load(ff_ptr + k, mask=kmask, other=1.0))
    t = theta * freq_scale
    if YARN:
        y = tl.math.div_rn(k.to(tl.float32) - corr0, corr_den)
        ramp = (1.0 - tl.minimum(1.0, tl.maximum(0.0, y))) * ext_factor
        t = t * (1.0 - ramp) + theta * ramp
    c, s = cos_sin_f64(t.to(tl.float64))
    c = (c.to(tl.float32) * mscale)[None, :]
    s = (s.to(tl.float32) * mscale)[None, :]
    if NORMAL:
        d0 = N_OFFS + 2 * k
        d1 = d0 + 1
    else:
        d0 = N_OFFS + k
        d1 = d0 + HALF
    m2 = hmask[:, None] & kmask[None, :]
    x0 = tl.load(x_ptr + x_row[:, None] + d0[None, :], mask=m2, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + x_row[:, None] + d1[None, :], mask=m2, other=0.0).to(tl.float32)
    d = tl.arange(0, BLOCK_D)
    rest = hmask[:, None] & ((d < N_OFFS) | ((d >= N_OFFS + N_DIMS) & (d < ne0)))[None, :]
    kept = tl.load(x_ptr + x_row[:, None] + d[None, :], mask=rest, other=0.0)  # (every load before any store)
    ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + y_row[:, None] + d0[None, :], (x0 * c - x1 * s).to(ty), mask=m2)
    tl.store(y_ptr + y_row[:, None] + d1[None, :], (x0 * s + x1 * c).to(ty), mask=m2)
    tl.store(y_ptr + y_row[:, None] + d[None, :], kept.to(ty), mask=rest)


ROPE_HEADS = 16  # heads a program rotates, at most (one token's: they share its angles)


def _heads_block(ne1: int) -> int:
    return min(ROPE_HEADS, triton.next_power_of_2(ne1))


def rope(x: torch.Tensor, pos: torch.Tensor, ff: torch.Tensor | None, out: torch.Tensor, *, n_dims: int, mode: int,
         n_ctx_orig: int, freq_base: float, freq_scale: float, ext_factor: float, attn_factor: float,
         beta_fast: float, beta_slow: float, sections=(0, 0, 0, 0), n_offs: int = 0) -> None:
    """ROPE into ``out`` (semantics and parameters: :func:`reference.rope`), one launch: a program a token and up to
    ROPE_HEADS of its heads, making the token's angles as ggml-cpu's rope cache does (the reference's arithmetic,
    rounding for rounding; cos and sin in double), and copying the rest of each row. x and out f32 or f16, rows
    contiguous."""
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
    s0, s1, s2, s3 = (int(v) for v in sections)
    heads = _heads_block(n1)
    _rope_kernel[(n2 * n3, triton.cdiv(n1, heads))](
        x, pos, ff if ff is not None else x, out, ne0, n1, n2, n2, xs[1], xs[2], xs[3], ys[1], ys[2], ys[3],
        c["theta_scale"], freq_scale, ext_factor, c["corr0"], c["corr_den"], c["mscale"],
        N_DIMS=n_dims, N_OFFS=n_offs, NORMAL=mode == ref.ROPE_NORMAL, MROPE=mrope, IMROPE=mode == ref.ROPE_IMROPE,
        S0=s0, S1=s1, S2=s2, S3=s3, HAS_FF=ff is not None, YARN=ext_factor != 0.0, BLOCK_H=heads,
        HALF_B=triton.next_power_of_2(max(1, n_dims // 2)), BLOCK_D=triton.next_power_of_2(ne0), **LAUNCH)


# ---- launch sizes (for cost estimates) ------------------------------------------------------------------------------


def programs(node) -> list[tuple[str, int, int]]:
    """:func:`gdnpass.kernels.backends.programs` for ROPE (a token's heads, ROPE_HEADS at most, per program, one
    step); empty for other ops. Pure: reads shapes only."""
    from gdnpass.ir import Op

    ne = node.ne
    if node.op is Op.ROPE:
        return [("rope", ne[2] * ne[3] * triton.cdiv(ne[1], _heads_block(ne[1])), 1)]
    return []
