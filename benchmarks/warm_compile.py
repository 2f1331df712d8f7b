"""Compile the kernels of the GPU sweep (gdnpass/sweep.py, run by tests/test_fusion.py::test_sweep_gpu_all_800) in
parallel processes, so that
`pytest -m gpu` then loads them from Triton's disk cache. The fused chain compiles once per (n_t, window columns) of
a model; the sweep's 400 cases need about as many compiles, one after another in a single pytest process.

    python benchmarks/warm_compile.py [--procs 16]
"""

import argparse
import multiprocessing as mp
import sys
import time

sys.path.insert(0, ".")


def run_cases(cases):
    from gdnpass.sweep import run_case  # each worker imports torch and CUDA itself

    return [case for case in cases if not run_case(case, device="cuda")[1].identical]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=16)
    a = ap.parse_args()
    from gdnpass.sweep import SWEEP
    start = time.time()
    slices = [list(range(i, len(SWEEP), a.procs)) for i in range(a.procs)]
    with mp.get_context("spawn").Pool(a.procs) as pool:
        bad = sum(pool.map(run_cases, slices), [])
    print(f"{len(SWEEP)} sweep cases compiled and checked in {time.time() - start:.0f} s; not identical: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
