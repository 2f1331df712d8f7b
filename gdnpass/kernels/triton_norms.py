"""Triton kernels of the row reductions: L2_NORM and RMS_NORM (one kernel, a tile of whole rows per program, the row
sums a fixed tree, :func:`gdnpass.kernels.triton_core.sum_sq_rows`, which the fused chain's q/k normalisation
shares) and SUM_ROWS (a row per thread, summed in double in ggml's order). Conventions:
:mod:`gdnpass.kernels.triton_core`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnpass.kernels.reference import f32
from gdnpass.kernels.triton_core import (LAUNCH, _alias_ok, _require, _row_offset, _strides, l2_scale_rows,
                                         rms_scale_rows, wait_for_previous_kernels)

L2_TILE = 512       # elements per L2 tile: [L2_TILE // BLOCK_D, BLOCK_D] rows (see l2_tile)
# (GDN_CONV_CHAIN's L2 sums are a fixed tree, so its tile and warps may differ from L2_NORM's: the bytes do not)


def l2_tile(ne0: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D) of the L2 tile for rows of ne0 elements."""
    block_d = triton.next_power_of_2(ne0)
    return max(1, L2_TILE // block_d), block_d


# ---- L2_NORM and RMS_NORM ------------------------------------------------------------------------------------------


@triton.jit
def _row_norm_kernel(x_ptr, y_ptr, n_rows, ne0, ne1, ne2, eps,
                     x_s1, x_s2, x_s3,          # x rows are contiguous (nb0 == 4)
                     y_s0, y_s1, y_s2, y_s3,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, RMS: tl.constexpr):
    wait_for_previous_kernels()
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


# ---- SUM_ROWS -------------------------------------------------------------------------------------------------------

SUM_ROWS_BLOCK = 128  # rows per program: one a thread


@triton.jit
def _sum_rows_kernel(x_ptr, y_ptr, n_rows, ne0, ne1, ne2, x_s0, x_s1, x_s2, x_s3, y_s1, y_s2, y_s3,
                     BLOCK_R: tl.constexpr):
    """Each row's sum as ggml_vec_sum_f32 makes it (the reference's order): from 0.0, element by element, in double,
    rounded once to f32 at the end."""
    wait_for_previous_kernels()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    on = rows < n_rows
    x_row = x_ptr + _row_offset(rows, ne1, ne2, x_s1, x_s2, x_s3).to(tl.int64)
    acc = tl.zeros([BLOCK_R], tl.float64)
    for k in range(0, ne0):
        acc += tl.load(x_row + k * x_s0, mask=on, other=0.0).to(tl.float64)
    tl.store(y_ptr + _row_offset(rows, ne1, ne2, y_s1, y_s2, y_s3), acc.to(tl.float32), mask=on)


def sum_rows(x: torch.Tensor, out: torch.Tensor) -> None:
    """SUM_ROWS of each row (along ne0) of f32 ``x`` (any strides) into ``out`` (ne0 1, x's other dims, any strides):
    bit for bit :func:`gdnpass.kernels.reference.sum_rows` (a double sum in ggml's order, rounded once)."""
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    if n_rows == 0:
        return
    _require(x.dtype == out.dtype == torch.float32 and tuple(out.shape) == (*x.shape[:3], 1),
             f"SUM_ROWS of {x.dtype} {tuple(x.shape)} into {out.dtype} {tuple(out.shape)}")
    _alias_ok("SUM_ROWS", out, x, same_ok=False)
    ys = _strides(out)
    _sum_rows_kernel[(triton.cdiv(n_rows, SUM_ROWS_BLOCK),)](
        x, out, n_rows, x.shape[3], x.shape[2], x.shape[1], *_strides(x), ys[1], ys[2], ys[3],
        BLOCK_R=SUM_ROWS_BLOCK, **LAUNCH)


# ---- launch sizes (for cost estimates) ------------------------------------------------------------------------------


def programs(node) -> list[tuple[str, int, int]]:
    """:func:`gdnpass.kernels.backends.programs` for L2_NORM and RMS_NORM (one step per program) and SUM_ROWS (steps:
    the row's elements); empty for other ops. Pure: reads shapes only."""
    from gdnpass.ir import Op

    op, ne = node.op, node.ne
    if op is Op.SUM_ROWS:
        return [("sum_rows", triton.cdiv(ne[1] * ne[2] * ne[3], SUM_ROWS_BLOCK), node.src[0].ne[0])]
    if op in (Op.L2_NORM, Op.RMS_NORM):
        block_r, _ = l2_tile(ne[0])
        return [(op.value.lower(), triton.cdiv(ne[1] * ne[2] * ne[3], block_r), 1)]
    return []
