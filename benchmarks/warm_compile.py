"""Run the GPU sweep (gdnpass/sweep.py, as tests/patterns/conv_chain/test_fusion.py::test_sweep_gpu_all_800 does:
every case unfused vs fused, byte for byte, planned with and without the allocator hints) in parallel processes: it
compiles the sweep's kernels into Triton's disk cache, so that `pytest -m gpu` then loads them, and it checks each
case as the test does.
The fused chain compiles once per (n_t, window columns) of a model; the sweep's 400 cases need about as many
compiles, one after another in a single pytest process (over 250 s per hint mode on the H200).

    python benchmarks/warm_compile.py [--procs 16] [--hints both|on|off]
"""

import argparse
import multiprocessing as mp
import time

MODES = {"both": (True, False), "on": (True,), "off": (False,)}


def run_cases(cases: list[tuple[int, bool]]) -> list[tuple[int, bool]]:
    from gdnpass.sweep import run_case  # each worker imports torch and CUDA itself

    return [(case, hints) for case, hints in cases if not run_case(case, hints, device="cuda")[1].identical]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=16)
    ap.add_argument("--hints", choices=MODES, default="both", help="plan with the allocator hints, without, or both")
    a = ap.parse_args()
    from gdnpass.sweep import SWEEP
    start = time.time()
    work = [(case, hints) for hints in MODES[a.hints] for case in range(len(SWEEP))]
    slices = [work[i::a.procs] for i in range(a.procs)]
    with mp.get_context("spawn").Pool(a.procs) as pool:
        bad = sum(pool.map(run_cases, slices), [])
    print(f"{len(SWEEP)} sweep cases x {len(MODES[a.hints])} hint modes compiled and checked in "
          f"{time.time() - start:.0f} s; not identical (case, hints): {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
