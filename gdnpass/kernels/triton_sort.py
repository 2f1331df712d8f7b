"""Triton kernel of ARGSORT (the expert FFN's router: ``ggml_argsort_top_k`` is a DESC argsort and a view of its
first k): a tile of whole rows per program, each row sorted in registers by a bitonic network (``tl.sort``) on
64-bit keys that make the reference's stable order a plain total order. Conventions:
:mod:`gdnpass.kernels.triton_core`.

The keys and the network are the exactness core's :func:`~gdnpass.kernels.triton_core.argsort_rows` (the fused
router, MOE_ROUTER, sorts with it too): (value, i) as one int64, so the keys are distinct and any correct sorting
network gives the one order of :func:`gdnpass.kernels.reference.argsort`: ascending or descending values, equal ones
in index order. The sorted keys' low halves are the indices: the bytes are the reference's everywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnpass.kernels.limits import ARGSORT_MAX_ROW
from gdnpass.kernels.triton_core import (LAUNCH, _alias_ok, _require, _row_offset, _strides, argsort_rows,
                                         wait_for_previous_kernels)

SORT_TILE = 2048    # keys per program at most: up to SORT_TILE // BLOCK_N rows (a row of ARGSORT_MAX_ROW: one)


def sort_tile(ne0: int, n_rows: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_N) of the ARGSORT tile for ``n_rows`` rows of ne0 elements (BLOCK_N: a power of two, the
    network's). Any tile sorts to the same bytes (the keys are distinct)."""
    block_n = triton.next_power_of_2(max(ne0, 2))
    return max(1, min(SORT_TILE // block_n, triton.next_power_of_2(n_rows))), block_n


def sort_stages(ne0: int) -> int:
    """The bitonic network's compare-and-swap stages for rows of ne0 elements."""
    n = sort_tile(ne0, 1)[1].bit_length() - 1
    return n * (n + 1) // 2


@triton.jit
def _argsort_kernel(x_ptr, y_ptr, n_rows, ne0, ne1, ne2, x_s1, x_s2, x_s3, y_s0, y_s1, y_s2, y_s3,
                    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DESC: tl.constexpr):
    wait_for_previous_kernels()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < ne0)[None, :]
    x = tl.load(x_ptr + _row_offset(rows, ne1, ne2, x_s1, x_s2, x_s3)[:, None] + cols[None, :], mask=mask, other=0.0)
    idx = argsort_rows(x, mask, cols, DESC)
    tl.store(y_ptr + _row_offset(rows, ne1, ne2, y_s1, y_s2, y_s3)[:, None] + cols[None, :] * y_s0, idx, mask=mask)


def argsort_refusal(x: torch.Tensor, out: torch.Tensor) -> str | None:
    """Why the kernel does not sort ``x`` into ``out``, or None: rows longer than :data:`ARGSORT_MAX_ROW` (the whole
    row is in registers; the torch reference runs them, backends._tri_argsort)."""
    if x.shape[3] > ARGSORT_MAX_ROW:
        return f"ARGSORT: rows of {x.shape[3]} elements (the kernel sorts up to {ARGSORT_MAX_ROW} in registers)"
    return None


def argsort(x: torch.Tensor, order: int, out: torch.Tensor) -> None:
    """ARGSORT of each row (along ne0) of f32 ``x`` (contiguous rows, anywhere) into i32 ``out`` (same shape, any
    strides): ascending (``order`` 0) or descending (1), equal values in index order (semantics
    :func:`gdnpass.kernels.reference.argsort`); rows of up to :data:`ARGSORT_MAX_ROW` elements."""
    if x.numel() == 0:
        return
    why = argsort_refusal(x, out)
    _require(why is None, why or "")
    _require(order in (0, 1), f"ARGSORT order {order} is not 0 (ASC) or 1 (DESC)")
    _require(x.dtype == torch.float32 and out.dtype == torch.int32 and tuple(out.shape) == tuple(x.shape),
             f"ARGSORT of {x.dtype} {tuple(x.shape)} into {out.dtype} {tuple(out.shape)}")
    xs = _strides(x)
    _require(xs[0] == 1, "ARGSORT needs contiguous rows")
    _alias_ok("ARGSORT", out, x, same_ok=False)
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    block_r, block_n = sort_tile(x.shape[3], n_rows)
    _argsort_kernel[(triton.cdiv(n_rows, block_r),)](
        x, out, n_rows, x.shape[3], x.shape[2], x.shape[1], xs[1], xs[2], xs[3], *_strides(out),
        BLOCK_R=block_r, BLOCK_N=block_n, DESC=order == 1, **LAUNCH)


# ---- launch sizes (for cost estimates) ------------------------------------------------------------------------------


def programs(node) -> list[tuple[str, int, int]]:
    """:func:`gdnpass.kernels.backends.programs` for ARGSORT (steps: the network's stages times the tile's keys in
    256s, what the interpreter's time follows); empty for rows the torch reference sorts, and for other ops. Pure:
    reads shapes only."""
    from gdnpass.ir import Op

    ne = node.ne
    if node.op is not Op.ARGSORT or ne[0] > ARGSORT_MAX_ROW:
        return []
    n_rows = ne[1] * ne[2] * ne[3]
    block_r, block_n = sort_tile(ne[0], n_rows)
    return [("argsort", triton.cdiv(n_rows, block_r), sort_stages(ne[0]) * triton.cdiv(block_r * block_n, 256))]
