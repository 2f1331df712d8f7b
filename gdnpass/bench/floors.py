"""The floor the fused chain's data dependencies set: Triton copies of its bytes, plain, after a dependent load, and
with a norm per block (the card's bandwidths are gdnpass.bench.ceilings'). A Triton copy kernel, not ``copy_``:
torch's device copy captured in a CUDA graph timed 1.6x slower under the profiler than by CUDA events (issue 32). The
floor kernels run in the Triton interpreter too (tests/bench/test_floors_revisions.py checks them against torch);
timing them needs a GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnpass.bench.timing import kernel_us


@triton.jit
def _floor_copy_kernel(src_ptr, dst_ptr, off_ptr, n, BLOCK: tl.constexpr, GATHER: tl.constexpr, NORM: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    base = tl.multiple_of(tl.load(off_ptr), 16) if GATHER else 0  # (so the loads stay 16-byte vectors)
    x = tl.load(src_ptr + base + i, mask=i < n, other=0.0)
    if NORM:
        x = x * tl.math.rsqrt(tl.sum(x * x) + 1e-6)
    tl.store(dst_ptr + i, x, mask=i < n)


FLOOR_BLOCK = 1024  # elements per program of the floor kernels (4 warps: two 16-byte vectors per thread)


def floor_copy(src: torch.Tensor, dst: torch.Tensor, off: torch.Tensor, gather: bool, norm: bool) -> None:
    """dst = src[o : o + len(dst)] (f32, flat), o = ``off`` (an int64 tensor of a multiple of 16) when ``gather``,
    else 0; with ``norm``, each block of FLOOR_BLOCK elements scaled by 1 / sqrt(its Σx² + 1e-6). The kernels of
    :func:`gather_copy_us`."""
    grid = (triton.cdiv(dst.numel(), FLOOR_BLOCK),)
    _floor_copy_kernel[grid](src, dst, off, dst.numel(), BLOCK=FLOOR_BLOCK, GATHER=gather, NORM=norm, num_warps=4)


def gather_copy_us(nbytes: int) -> tuple[float, float, float]:
    """The floor the fused chain's two dependencies set, us: a Triton copy of ``nbytes``; the same copy with its
    source offset read from device memory first (the chain reads the cache cell id before the gathered row); and
    that, with each program's block scaled by its root sum of squares before the store (the chain's q/k norm needs
    a head's SiLU outputs from all its threads)."""
    return tuple(copy_us(nbytes, *v) for v in ((False, False), (True, False), (True, True)))


def copy_us(nbytes: int, gather: bool = False, norm: bool = False) -> float:
    """A Triton copy kernel moving ``nbytes`` (read + written; :func:`floor_copy`), as the profiler times it in a
    CUDA graph."""
    a = torch.randn(max(1, nbytes // 8), device="cuda")
    b, off = torch.empty_like(a), torch.zeros(1, dtype=torch.int64, device="cuda")  # (offset 0: the same bytes)
    return kernel_us(lambda: floor_copy(a, b, off, gather, norm))[0]
