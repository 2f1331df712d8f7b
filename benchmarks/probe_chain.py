"""Where the fused conv chain's time goes: the node timed with a stage left out (method: time variants that leave one
stage out and take differences), at qwen3.5-9b size. The stage-less variant computes wrong results on purpose; it
only places time. (The snapshot rows cannot be left out this way any more: their columns are compile-time constants.)

    python benchmarks/probe_chain.py              # the table
    python benchmarks/probe_chain.py --once 4     # one warm launch at T = rows = 4 (to run under ncu)
"""

from __future__ import annotations

import argparse

import torch
import triton

from gdnpass.bench.chain import chain_operands
from gdnpass.bench.ceilings import empty_us
from gdnpass.bench.timing import graph_time_us
from gdnpass.kernels import triton_ssm as ssm


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
    args = chain_operands(T, rows)["args"]
    return lambda: ssm.gdn_conv_chain(*args)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--once", type=int, help="run T = rows = ONCE a few times and exit (for ncu)")
    a = ap.parse_args()
    real = ssm._gdn_conv_chain_kernel
    if a.once:
        fn = problem(a.once, a.once)
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return 0
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}; empty kernel {empty_us():.2f} us (profiler)")
    variants = {"full": {}, "no L2": dict(n_l2=0)}
    print("T rows | " + " | ".join(variants))
    for T in (1, 4, 8, 16):
        fn = problem(T, T)
        times = []
        for over in variants.values():
            ssm._gdn_conv_chain_kernel = Override(real, **over) if over else real
            times.append(f"{graph_time_us(fn):6.2f}")
        ssm._gdn_conv_chain_kernel = real
        print(f"{T:2d} {T:4d} | " + " | ".join(times), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
