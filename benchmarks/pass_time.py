"""The fusion pass's own CPU time on the 24-layer qwen3.5-9b verify graph (T=8, 7 snapshot rows, DFlash taps): min
and median of ``--runs`` calls of ``fuse()``, each on a freshly built and planned graph, with the registry's first
``--patterns`` patterns (default: all). It uses only what every revision since the pattern registry and before it
has (``pipeline.run``, ``fusion.PATTERNS``), so the same script times an older package side by side:

    git archive 3675eca gdnpass | tar -x -C /tmp/old        # the package of another revision
    PYTHONPATH=/tmp/old python benchmarks/pass_time.py --patterns 2
    PYTHONPATH=. python benchmarks/pass_time.py --patterns 2

One JSON line. No GPU needed; run the variants on one quiet host, interleaved (docs/performance.md, issue 31).
"""

import argparse
import json
import statistics
import time

from gdnpass import pipeline
from gdnpass.fusion import PATTERNS, fuse
from gdnpass.models import VerifyConfig
from gdnpass.pipeline import PassOptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--patterns", type=int, default=len(PATTERNS), help="the registry's first K patterns")
    p.add_argument("--runs", type=int, default=15)
    a = p.parse_args()
    if not 1 <= a.patterns <= len(PATTERNS) or a.runs < 1:
        p.error(f"--patterns must be 1..{len(PATTERNS)} and --runs >= 1")
    cfg = VerifyConfig("qwen3.5-9b", 8, 7, dflash=True)
    times = []
    for _ in range(a.runs):
        g = pipeline.run(cfg, PassOptions(fusion=True), fuse_now=False).graph
        t0 = time.perf_counter()
        report = fuse(g, enabled=True, patterns=PATTERNS[:a.patterns])
        times.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps(dict(patterns=[x.name for x in PATTERNS[:a.patterns]], min_ms=round(min(times), 2),
                          median_ms=round(statistics.median(times), 2), nodes=len(g.nodes),
                          summary=report.summary())))


if __name__ == "__main__":
    main()
