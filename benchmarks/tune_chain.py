"""Launch variants of the fused conv chain (warps per head) at qwen3.5-9b size, timed side by side next to one copy
kernel moving the chain's bytes; every variant's output checked byte-identical to the first variant's. Method:
profiler kernel durations of CUDA-graph replays (gdnpass.bench.timing.kernel_us), medians.

    python benchmarks/tune_chain.py
"""

import argparse

import torch
import triton

from gdnpass.bench.chain import chain_bytes, chain_operands
from gdnpass.bench.floors import copy_us
from gdnpass.bench.timing import kernel_us
from gdnpass.kernels import triton_ssm as ssm

WARPS = (2, 4, 8)
RMS = dict(norm="rms", qk_scale=128 ** -0.5)  # upstream's q/k form at S = 128 (the eps of chain_operands)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}; default {ssm.chain_warps(128)} warps")
    print("T rows | copy | " + " | ".join(f"{w} warps" for w in WARPS))
    for T in (1, 2, 4, 8, 16):
        ref, times = None, []
        for w in WARPS:
            ops = chain_operands(T, T, seed=T)  # the same starting bytes for every variant
            run = lambda: ssm.gdn_conv_chain(*ops["args"], num_warps=w, **RMS)  # noqa: E731
            run()
            got = [ops[name].clone() for name in ("out", "q", "k", "cache")]
            ref = ref or got
            same = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(ref, got))
            times.append(f"{kernel_us(run)[0]:6.2f}{'' if same else ' DIFF'}")
        print(f"{T:2d} {T:4d} | {copy_us(chain_bytes(T, T)):5.2f} | " + " | ".join(times), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
