"""Launch variants of the fused conv chain (token groups x warps per group) at qwen3.5-9b size, timed side by side
next to one copy kernel moving the chain's bytes; every variant's output checked byte-identical to the default
launch. Method: profiler kernel durations of CUDA-graph replays (bench.kernel_us), medians.

    python benchmarks/tune_chain.py
"""

import sys

import torch
import triton

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")

from bench import chain_bytes, chain_operands, copy_us, kernel_us  # noqa: E402

from gdnpass.kernels import triton_ops as tri  # noqa: E402

GROUPS, WARPS_PER_GROUP = (1, 2, 4, 8), (2, 4)
RMS = dict(norm="rms", qk_scale=128 ** -0.5)  # upstream's q/k form at S = 128 (the eps of chain_operands)


def main() -> int:
    variants = [(g, w) for g in GROUPS for w in WARPS_PER_GROUP]
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}; default: "
          f"{', '.join(f'T={T} {tri.chain_token_groups(T)} groups' for T in (1, 4, 8, 16))} x "
          f"{tri.chain_warps(128)} warps")
    print("T rows | copy | " + " | ".join(f"{g}g x {w}w" for g, w in variants))
    for T in (1, 2, 4, 8, 16):
        ref, times = None, []
        for g, w in variants:
            if g > T:
                times.append("   -  ")
                continue
            ops = chain_operands(T, T, seed=T)  # the same starting bytes for every variant
            run = lambda: tri.gdn_conv_chain(*ops["args"], num_warps=g * w, groups=g, **RMS)  # noqa: E731
            run()
            got = [ops[name].clone() for name in ("out", "q", "k", "cache")]
            ref = ref or got
            same = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(ref, got))
            times.append(f"{kernel_us(run)[0]:6.2f}{'' if same else ' DIFF'}")
        print(f"{T:2d} {T:4d} | {copy_us(chain_bytes(T, T)):5.2f} | " + " | ".join(times), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
