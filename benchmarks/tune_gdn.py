"""Launch variants of the GATED_DELTA_NET kernel (value columns per program x warps, the token loop unrolled or
kept) at qwen3.5-9b size (S 128, 16 k heads, 32 v heads, one sequence, K = T snapshot slots), timed side by side;
the unrolled and the looped form of each tile checked byte-identical. Method: profiler kernel durations of
CUDA-graph replays (gdnpass.bench.timing.kernel_us), medians.

    python benchmarks/tune_gdn.py
"""

import argparse

import torch
import triton

from gdnpass.bench.timing import kernel_us
from gdnpass.kernels import triton_ssm as ssm

S, H_K, H_V = 128, 16, 32
TILES = [(bv, w) for bv in (16, 32, 64) for w in (2, 4, 8)]


def operands(T: int, K: int):
    g = torch.Generator(device="cuda").manual_seed(T)

    def rnd(*shape, lo=-1.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, device="cuda", generator=g)
    q, k = (torch.nn.functional.normalize(rnd(1, T, H_K, S), dim=-1) for _ in range(2))
    return (q, k, rnd(1, T, H_V, S), rnd(1, T, H_V, 1, lo=-2.0, hi=-0.01), rnd(1, T, H_V, 1, lo=0.05),
            0.1 * rnd(1, H_V, S, S), torch.empty(1, 1, T + K * S, S * H_V, device="cuda"))


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}; default block_v {ssm.GDN_BLOCK_V}, "
          f"{ssm.GDN_WARPS} warps, unrolled")
    print("T | " + " | ".join(f"{bv}c x {w}w unrolled / looped" for bv, w in TILES))
    for T in (1, 4, 8, 16):
        *src, out = operands(T, T)
        cells = []
        for bv, w in TILES:
            us, got = [], []
            for unrolled in (True, False):
                run = lambda: ssm.gated_delta_net(*src, T, out, block_v=bv, num_warps=w, unrolled=unrolled)  # noqa: E731
                run()
                got.append(out.clone())
                us.append(kernel_us(run)[0])
            same = torch.equal(got[0].view(torch.int32), got[1].view(torch.int32))
            cells.append(f"{us[0]:6.2f} / {us[1]:6.2f}{'' if same else ' DIFF'}")
        print(f"{T:2d} | " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
