"""The fusion pass's own CPU time on the 24-layer qwen3.5-9b verify graph (T=8, 7 snapshot rows, DFlash taps): min
and median of ``--runs`` calls of ``fuse()`` (:func:`gdnpass.bench.forward.bench_pass`), with the registry's first
``--patterns`` patterns (default: all). One JSON line; no GPU needed. To time another revision's package side by side
(run the variants on one quiet host, interleaved; docs/performance.md, issue 31):

    git archive 3675eca gdnpass | tar -x -C /tmp/old        # the package of another revision
    PYTHONPATH=/tmp/old python benchmarks/pass_time.py       # (a bench_pass without --patterns: all its patterns)
    PYTHONPATH=. python benchmarks/pass_time.py --patterns 2
"""

import argparse
import json

from gdnpass.bench.forward import bench_pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--patterns", type=int, help="the registry's first K patterns (default: all)")
    p.add_argument("--runs", type=int, default=15)
    a = p.parse_args()
    if a.runs < 1 or a.patterns is not None and a.patterns < 1:
        p.error("--patterns and --runs must be >= 1")
    r = bench_pass(a.runs) if a.patterns is None else bench_pass(a.runs, a.patterns)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}))


if __name__ == "__main__":
    main()
