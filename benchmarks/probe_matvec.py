"""Each product's chosen tile (tiles.mat_vec_tile) launched twice, the first a warm-up, for ncu:

    ncu -k regex:_mul_mat_vec --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats \\
        python benchmarks/probe_matvec.py --wtype bf16 --shapes 12288x4096,248320x4096 --cols 4

profiles every launch: read every second one. ``--launch-skip 1 --launch-count 1`` profiles only the first
(shape, columns)'s second launch. It prints each (shape, columns)'s tile.
"""

from __future__ import annotations

import argparse

import torch

from gdnpass.bench.matvec import DTYPES, column_counts, operands, shape_list
from gdnpass.kernels import triton_matvec as mv


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--shapes", type=shape_list, required=True, help="rows x K list, e.g. 12288x4096,248320x4096")
    p.add_argument("--cols", type=column_counts, default=[4], help="column counts 1..16 (default 4)")
    a = p.parse_args()
    for (M, K) in a.shapes:
        for N in a.cols:
            w, x, y = operands(a.wtype, M, K, N)
            for _ in range(2):
                mv.mul_mat_vec(w, x, y)
            torch.cuda.synchronize()
            print(f"{a.wtype} {M}x{K} N={N}: {mv.mat_vec_tile(M, N, K, a.wtype)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
