"""The deduplicated snapshot window (seed 003): per-window vs one-tile store of the fused conv-chain node, qwen3.5-9b
shapes (C 8192, d_conv 4), one layer, timed side by side; the tile's bytes checked equal to the per-window path's.

    PYTHONPATH=. python benchmarks/tune_dedup.py [--model NAME]

Rows: T tokens and n_rs_seq + 1 snapshot planes (plane 0 always a conv-cache row). "rows": every plane a cache row
(the dense layout); "dedup": planes 1..n_rs_seq windows of one shared row, written window by window (the node without
its tile) or as one tile. Without a GPU it runs the same byte checks in the Triton interpreter and prints no times.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gdnpass.bench.chain import fused_chain  # noqa: E402  (after TRITON_INTERPRET: it defines Triton kernels)
from gdnpass.bench.timing import graph_time_us, node_runner  # noqa: E402

GPU = torch.cuda.is_available()
CASES = [(1, 0), (1, 1), (8, 7), (8, 8), (16, 15)]  # (T, n_rs_seq): rows = T, and rows = T + 1 (the whole shared row)


def without_tile(n):
    m = copy.copy(n)
    m.op_params = {k: v for k, v in n.op_params.items() if k != "tile"}
    return m


def same_bytes(ex, a, b) -> bool:
    """Run a, then b, from the same starting bytes: every buffer ends identical."""
    start = ex.snapshot()
    outs = []
    for fn in (a, b):
        ex.restore(start)
        fn()
        outs.append(ex.snapshot())
    ex.restore(start)
    return all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])


def timed(fn) -> float:
    return graph_time_us(fn) if GPU else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3.5-9b")
    a = p.parse_args()
    import triton

    print(f"# {torch.cuda.get_device_name() if GPU else 'CPU (interpreter)'}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, triton {triton.__version__}; {a.model}; us per fused node (CUDA-graph median)")
    print(" T rows | rows layout | dedup per-window | dedup tile | tile cols | snapshot bytes per-window -> tile "
          "| same")
    for T, n_rs in CASES:
        ex_rows, n_rows = fused_chain(a.model, T, n_rs, "rows")
        dense = timed(node_runner(ex_rows, n_rows))
        del ex_rows
        ex, n = fused_chain(a.model, T, n_rs, "dedup")
        tile = n.op_params.get("tile")
        tiled, per_window = node_runner(ex, n), node_runner(ex, without_tile(n))
        t_per = timed(per_window)
        if tile is None:  # no snapshot plane, or one window alone: nothing shared, no tile
            print(f"{T:2d} {n_rs + 1:4d} | {dense:11.2f} | {t_per:16.2f} | {'-':>10} | {'-':>9} | {'-':>34} | -",
                  flush=True)
            continue
        t_tile = timed(tiled)
        C, dc = n.ne[0], n.op_params["d_conv"]
        per_b, tile_b = 4 * C * (dc - 1) * n_rs, 4 * C * tile["n_cols"]
        print(f"{T:2d} {n_rs + 1:4d} | {dense:11.2f} | {t_per:16.2f} | {t_tile:10.2f} | {tile['n_cols']:4d} of "
              f"{triton.next_power_of_2(tile['n_cols']):2d} | {per_b:15d} -> {tile_b:15d} | "
              f"{same_bytes(ex, tiled, per_window)}", flush=True)
        del ex
    return 0


if __name__ == "__main__":
    sys.exit(main())
