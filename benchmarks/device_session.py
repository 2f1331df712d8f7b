"""Everything the GPU host is for, in three parts that each fit one 10-minute device call; a short table last.

    python benchmarks/device_session.py --part 1 [--source .llama-src] [--out DIR]
    python benchmarks/device_session.py --part 2|3 [--out DIR]

Part 1 (issue 18, then the mat-vec tiles): the whole qwen3.5-9b verify, ours off / on next to upstream llama.cpp
built with CUDA (``bench.py --quick --only whole,upstream``; the CUDA build alone takes 3-4 minutes on a fresh
host), then a tile sweep of the products still under target (``tune_matvec.py``).
Part 2 (issue 16): bench.py's per-op, mat-vec, chain, dedup and pair tables and our whole verify, compute-sanitizer
memcheck and racecheck over every kernel (``sanitize.py``), then the kernel test files compiled.
Part 3: the 800-case exactness sweep in both hint modes, in parallel (``warm_compile.py``: the check of
``test_sweep_gpu_all_800``, which takes over 250 s per mode in one pytest process), then the other GPU tests
(``pytest -m gpu``, the sweep test left out).

Each step runs in its own process group with a time limit (a step that runs out is reported, the next one still
runs); its output goes to the terminal and to ``DIR/<step>.log`` (``$OUT`` by default, the device tool's folder), the
bench's numbers to ``DIR/<step>.json``. Run it from the repository root with ``PYTHONPATH=.``; carry ``.llama-src``
(``gdnpass llama-build --pack .llama-src``) and the gguf wheel for part 1 (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PY = sys.executable


def steps(part: int, source: str | None, out: Path) -> list[tuple[str, list[str], int]]:
    """(name, command, seconds allowed) of one part; the limits add up to under 9 minutes."""
    if part == 1:
        return [
            ("whole-upstream", [PY, "benchmarks/bench.py", "--quick", "--only", "whole,upstream",
                                *(["--source", source] if source else []), "--json", str(out / "whole-upstream.json")],
             400),
            ("tune-matvec", [PY, "benchmarks/tune_matvec.py", "--wtypes", "bf16,f32", "--shapes", "1024x4096",
                             "--cols", "1,4,8,16", "--budget-s", "100"], 130),
        ]
    if part == 3:
        return [
            # (2026-12-02: 95 s for one hint mode; the pytest sweep, serial, ran out of 290 s in its second mode)
            ("sweep", [PY, "benchmarks/warm_compile.py", "--hints", "both"], 300),
            ("gpu-tests", [PY, "-m", "pytest", "-q", "-x", "-m", "gpu", "-k", "not sweep_gpu_all_800", "tests/"], 120),
        ]
    sanitizer = "compute-sanitizer"
    return [
        ("bench-kernels", [PY, "benchmarks/bench.py", "--quick", "--only", "ops,matvec,chain,dedup,pair,whole",
                           "--json", str(out / "bench-kernels.json")], 150),  # (measured 74 s with whole: ours only)
        ("memcheck", [sanitizer, "--tool", "memcheck", "--error-exitcode", "3", PY, "benchmarks/sanitize.py"], 40),
        # (racecheck: 0 hazards in ~70 s on 2026-12-01 night; 2026-12-02, out of time at 80 s: its child ran to 120)
        ("racecheck", [sanitizer, "--tool", "racecheck", "--error-exitcode", "3", PY, "benchmarks/sanitize.py"], 180),
        ("kernel-tests", [PY, "-m", "pytest", "-q", "-x", "tests/test_kernels.py", "tests/test_triton_ops.py",
                          "tests/test_triton_attention.py"], 160),
    ]


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # the whole group ended between the limit and the timer's cancel
        pass


def run(name: str, cmd: list[str], limit: float, out: Path) -> tuple[str, int | None, float, str]:
    """One step: (name, exit status or None when it ran out of time, seconds, its last line that says something)."""
    t0 = time.perf_counter()
    lines: list[str] = []
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    except FileNotFoundError as e:
        return name, 127, 0.0, f"cannot start: {e}"
    # the step's whole process group: compute-sanitizer's or a pool's children would otherwise run on, holding the
    # output pipe open (a step that hangs silently is stopped too)
    timer = threading.Timer(limit, _kill_group, (proc.pid,))
    timer.start()
    with open(out / f"{name}.log", "w") as log:
        for line in proc.stdout:  # type: ignore[union-attr]
            print(line, end="", flush=True)
            log.write(line)
            lines.append(line.rstrip())
    rc = proc.wait()
    timer.cancel()
    secs = time.perf_counter() - t0
    said = next((x for x in reversed(lines) if x.strip() and not x.startswith(" ")), "")
    return name, None if secs >= limit else rc, secs, said[:100]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", type=int, choices=(1, 2, 3), required=True)
    p.add_argument("--source", help="part 1: a folder `gdnpass llama-build --pack` wrote")
    p.add_argument("--out", default=os.environ.get("OUT") or "device-session", help="logs and JSON (default: $OUT)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [run(name, cmd, limit, out) for name, cmd, limit in steps(a.part, a.source, out)]
    print(f"\n## device session, part {a.part}")
    print("step | status | seconds | last line")
    for name, rc, secs, said in results:
        status = "ran out of time" if rc is None else "ok" if rc == 0 else f"exit {rc}"
        print(f"{name:15s} | {status:15s} | {secs:6.0f} | {said}")
    return 0 if all(rc == 0 for _, rc, _, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
