"""The deduplicated snapshot window (seed 003) at batch: the fused conv-chain node of S sequences x T tokens in each
snapshot layout, next to seed 003's per-token-store baseline and its figures; fused vs unfused checked byte for byte
before anything is timed.

    PYTHONPATH=. python benchmarks/tune_dedup.py [--model qwen3.5-27b] [--seqs 1,8,64,128] [--tokens 4,8,16]
                                                 [--state f32|bf16-bytes] [--json OUT.json]

Per (S, T): one layer of the model, S sequences of T tokens, T - 1 rollback planes (T windows a sequence, as the
seed's verify of T tokens), each sequence gathering plane 1 of its cell. Layouts (docs/performance.md, "Deduplicated
snapshot window"): "rows", every plane a cache row (llama.cpp's; the seed's dense window), and the same node with
its q/k norms in launches of their own ("rows, norm apart": gdnpass.bench.chain.norm_apart); "dedup", planes 1..T-1
windows of one shared channel-major row a sequence (MambaPool's), stored once as a tile (the seed's change);
"per-token", that node without its tile, each window stored with d_conv - 1 element stores (the seed's kernel before
its change); "dedup-t", the shared row time-major (MambaPool's axis-0 layout seen transposed), as a tile. Times: us
per call of the fused node (and of the unfused chain, its kernels summed), profiler kernel durations of one call
captured as a CUDA graph, median of 20 replays (gdnpass.bench.timing.kernel_us: the seed's method). ``--state
bf16-bytes``: gdnpass's chain (as llama.cpp's recurrent cache) is f32 only; this runs it at half the model's heads,
the bytes a bf16 state of the model's C would move (gdnpass.bench.chain.half_channels). The seed's points (S, T) =
(1, 8), (64, 8), (128, 8), (128, 16) run first; ``--json`` is rewritten after every case. Exit status 1 when a case
is not byte-identical (it is then not timed).

Without a GPU the same path runs in the Triton interpreter at tiny sizes (default tiny-dc4-h64, S 1,3, T 2,4): every
byte check, no times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gdnpass.bench.chain import SEED_003, bench_dedup_seqs, half_channels, seqs_cases  # noqa: E402  (after
# TRITON_INTERPRET: it defines Triton kernels)


def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def line(r: dict, differ: list[str]) -> str:
    """A case's table row."""
    seed = SEED_003.get((r["S"], r["T"]))
    return (f"{r['S']:3d} {r['T']:2d} | {r['C']:5d} | {r['rows unfused']:7.2f} / {r['dedup unfused']:7.2f} / "
            f"{r['dedup-t unfused']:7.2f} ({r['rows unfused kernels']}) | {r['rows']:6.2f} | {r['norm-apart']:6.2f} | "
            f"{r['per-token']:6.2f} | "
            f"{r['dedup']:6.2f} | {r['dedup-t']:6.2f} | {r['dedup'] / r['rows']:4.2f} | "
            f"{r['dedup-t'] / r['rows']:4.2f} | {r['dedup'] / r['per-token']:4.2f} | "
            f"{r['rows bytes']} -> {r['dedup bytes']} | {'NO: ' + ', '.join(differ) if differ else 'yes'} | "
            + (f"{seed[1] / seed[0]:4.2f}, {seed[1] / seed[2]:4.2f}" if seed else "-"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3.5-27b" if GPU else "tiny-dc4-h64",
                   help="a preset (qwen3.5-27b: C 10240, the seed's dim; qwen3.5-9b: C 8192)")
    p.add_argument("--seqs", type=ints, default=[1, 8, 64, 128] if GPU else [1, 3], help="sequences S, 1..128")
    p.add_argument("--tokens", type=ints, default=[4, 8, 16] if GPU else [2, 4], help="tokens T, 2..16")
    p.add_argument("--state", choices=("f32", "bf16-bytes"), default="f32",
                   help="bf16-bytes: f32 at half the heads, the bytes of a bf16 state (see the docstring)")
    p.add_argument("--json", help="write every case's numbers to this file")
    a = p.parse_args()
    bad = [f"--seqs {s}" for s in a.seqs if not 1 <= s <= 128] + [f"--tokens {t}" for t in a.tokens if not 2 <= t <= 16]
    if bad:
        p.error(f"{', '.join(bad)}: S is 1..128, T 2..16 (T - 1 >= 1 rollback planes)")
    import triton

    from gdnpass.errors import GdnpassError
    from gdnpass.models.hparams import get_model

    try:
        model = half_channels(a.model) if a.state == "bf16-bytes" else get_model(a.model)
        cases = seqs_cases(a.seqs, a.tokens)
        rows = bench_dedup_seqs(model, cases)
        out = dict(gpu=torch.cuda.get_device_name() if GPU else None, torch=torch.__version__,
                   triton=triton.__version__, state=a.state, cases=[])
        print(f"# {out['gpu'] or 'CPU (Triton interpreter: byte checks only, no times)'}, torch {torch.__version__}, "
              f"triton {triton.__version__}; {a.model}{', half the heads (bf16-bytes)' if a.state != 'f32' else ''}; "
              "us per call (profiler kernel durations of a CUDA-graph replay, median of 20)")
        print(" S  T |   C | unfused rows / dedup / dedup-t (kernels) | rows | rows, norm apart | per-token | dedup | "
              "dedup-t | "
              "dedup/rows | dedup-t/rows | dedup/per-token | bytes rows -> dedup | identical | "
              "seed 003 after/before, after/dense")
        ok = True
        for r in rows:
            differ = [k for k in ("rows", "norm-apart", "dedup", "dedup-t", "per-token") if not r[f"{k} identical"]]
            ok &= not differ
            print(line(r, differ), flush=True)
            out["cases"].append(r)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(out, f, indent=1)
    except GdnpassError as e:
        print(f"tune_dedup: {e}", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
