"""Where the fused conv chain's time goes: the node timed with a stage left out (method: time variants that leave one
stage out and take differences), at qwen3.5-9b size. The stage-less variant computes wrong results on purpose; it
only places time. (The snapshot rows cannot be left out this way any more: their columns are compile-time constants.)

    python benchmarks/probe_chain.py              # the table
    python benchmarks/probe_chain.py --once 4     # one warm launch at T = rows = 4 (to run under ncu)
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")

from bench import graph_time_us  # noqa: E402

from gdnpass.kernels import triton_ops as tri  # noqa: E402

C, S, H_k, DC = 8192, 128, 16, 4


class Override:
    """Stands in for the chain kernel: launches it with some scalar arguments replaced (n_l2=0: no L2 heads), so the
    product code runs unchanged around it."""

    def __init__(self, kernel, **values):
        self.kernel, self.values = kernel, values
        self.index = {name: i for i, name in enumerate(kernel.arg_names)}

    def __getitem__(self, grid):
        def launch(*args, **kw):
            args = list(args)
            for name, v in self.values.items():
                args[self.index[name]] = v
            return self.kernel[grid](*args, **kw)
        return launch


def problem(T: int, rows: int):
    """The chain's operands as llama.cpp lays them out: rows in a cache of 2*rows cells, the gathered row one of them."""
    cache = torch.randn(1, 1, 2 * rows, (DC - 1) * C, device="cuda")
    ids = torch.tensor([1], dtype=torch.int32, device="cuda")
    x = torch.randn(1, 1, T, C, device="cuda").transpose(2, 3)
    w = torch.randn(1, 1, C, DC, device="cuda")
    dst = [cache[:, :, 2 * r:2 * r + 1] for r in range(rows)]
    cols = [max(0, T - s) for s in range(rows - 1, -1, -1)]
    out = torch.empty(1, 1, T, C, device="cuda")
    q, k = torch.empty(1, T, H_k, S, device="cuda"), torch.empty(1, T, H_k, S, device="cuda")
    return lambda: tri.gdn_conv_chain(cache, ids, x, w, dst, cols, 1e-6, out, q, k)


@triton.jit
def _empty(x_ptr):
    pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--once", type=int, help="run T = rows = ONCE a few times and exit (for ncu)")
    a = ap.parse_args()
    real = tri._gdn_conv_chain_kernel
    if a.once:
        fn = problem(a.once, a.once)
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return 0
    x = torch.empty(1, device="cuda")
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}; empty kernel "
          f"{graph_time_us(lambda: _empty[(1,)](x)):.2f} us")
    variants = {"full": {}, "no L2": dict(n_l2=0)}
    print("T rows | " + " | ".join(variants))
    for T in (1, 4, 8, 16):
        fn = problem(T, T)
        times = []
        for over in variants.values():
            tri._gdn_conv_chain_kernel = Override(real, **over) if over else real
            times.append(f"{graph_time_us(fn):6.2f}")
        tri._gdn_conv_chain_kernel = real
        print(f"{T:2d} {T:4d} | " + " | ".join(times), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
