"""What the benchmarks hold a kernel's time against: an empty Triton kernel and the device copy bandwidth (1 GiB),
one copy kernel moving N bytes, and the floor the fused chain's data dependencies set (Triton copies: plain, after a
dependent load, and with a norm per block). The floor kernels run in the Triton interpreter too
(tests/bench/test_floors_revisions.py checks them against torch); timing them needs a GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnpass.bench.timing import kernel_us


def bench_references() -> dict:
    """The empty Triton kernel's time (us) and the device copy bandwidth (GB/s, 1 GiB of f32 read + written)."""
    @triton.jit
    def _empty(x_ptr):
        pass

    x = torch.empty(1, device="cuda")
    empty = kernel_us(lambda: _empty[(1,)](x))[0]
    n = 1 << 28  # 1 GiB of f32
    a, b = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    copy_us = kernel_us(lambda: b.copy_(a), reps=10)[0]
    return dict(empty_us=empty, copy_GBps=2 * 4 * n / (copy_us * 1e3))


def copy_us(nbytes: int) -> float:
    """One device copy kernel moving ``nbytes`` (read + written)."""
    a = torch.randn(max(1, nbytes // 8), device="cuda")
    b = torch.empty_like(a)
    return kernel_us(lambda: b.copy_(a))[0]


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
    a = torch.randn(max(1, nbytes // 8), device="cuda")
    b, off = torch.empty_like(a), torch.zeros(1, dtype=torch.int64, device="cuda")  # (offset 0: the same bytes)
    return tuple(kernel_us(lambda v=v: floor_copy(a, b, off, *v))[0]
                 for v in ((False, False), (True, False), (True, True)))
