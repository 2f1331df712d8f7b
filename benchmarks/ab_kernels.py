"""The fused chain and the SiLU kernels of other git revisions next to the working tree's, in one process: each
revision's ``gdnpass`` package is loaded as a package of its own (a copy whose imports of ``gdnpass`` name the copy,
so its kernels call its own helpers), every variant is timed in turn (rounds in the order A B .., then reversed, then
again; medians of profiler kernel durations over CUDA-graph replays, gdnpass.bench.timing.kernel_us), and every
variant's output bytes are compared with the first's.

    python benchmarks/ab_kernels.py --base 2213063 [--base REV ..] [--tokens 1,4,8,16]

``--base`` also takes a folder holding a revision's ``gdnpass`` package, for a machine whose copy of the tree has no
git history, as the device host's: ``mkdir -p .ab/REV && git archive REV gdnpass | tar -x -C .ab/REV`` here, then
``--base .ab/REV`` there (with ``.ab`` carried).

The working tree is the last column. The launchers compared (``gdn_conv_chain``, ``unary``, ``glu``) are looked up
where a revision's layout keeps them (``gdnpass.bench.revisions.LAUNCHERS``: the kernel family modules, or an older
revision's single ``kernels/triton_ops.py``) and must take the working tree's arguments; a revision without them is
refused in one line.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from gdnpass.bench.chain import chain_bytes, chain_operands
from gdnpass.bench.floors import copy_us
from gdnpass.bench.revisions import launchers, revision_module
from gdnpass.bench.timing import kernel_us

RMS = dict(norm="rms", qk_scale=128 ** -0.5)  # upstream's q/k form at S = 128


def compare(variants: dict, make) -> str:
    """One table row's cells, the variants' medians then whether their bytes agree: ``make(module)`` gives
    (launch, output tensors) for one variant's own operands."""
    runs, outputs = {}, {}
    for tag, module in variants.items():
        launch, outs = make(module)
        launch()
        torch.cuda.synchronize()
        runs[tag], outputs[tag] = launch, [t.clone() for t in outs]
    first = outputs[next(iter(outputs))]
    same = all(torch.equal(a.view(torch.int32), b.view(torch.int32))
               for outs in outputs.values() for a, b in zip(first, outs))
    tags = list(variants)
    times = {t: [] for t in tags}
    for tag in tags + tags[::-1] + tags:
        times[tag].append(kernel_us(runs[tag])[0])
    cells = " | ".join(f"{statistics.median(times[t]):6.2f}" for t in tags)
    return f"{cells} | {'identical' if same else 'DIFFER'}"


def seeded(shape, seed: int, n: int = 1) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(*shape, device="cuda", generator=g) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", action="append", required=True,
                    help="a git revision, or a folder holding its gdnpass package, to compare (repeatable)")
    ap.add_argument("--tokens", default="1,4,8,16", help="token counts of the chain rows (rows = tokens)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ab_kernels: needs a CUDA device (it times kernels)")
    tokens = [int(t) for t in a.tokens.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        variants = {rev: revision_module(rev, Path(folder)) for rev in a.base}
        variants["tree"] = launchers("gdnpass", None, "tree")
        print(f"# {torch.cuda.get_device_name()}; profiler kernel us, medians of 3 rounds; bytes vs {a.base[0]}")
        print("what               | copy | " + " | ".join(variants) + " | bytes")
        for T in tokens:
            def chain(module, T=T):
                ops = chain_operands(T, T, seed=T)  # the same starting bytes for every variant
                outs = [ops[k] for k in ("out", "q", "k", "cache")]
                return (lambda: module.gdn_conv_chain(*ops["args"], **RMS)), outs
            print(f"{f'chain rms T={T}':18s} | {copy_us(chain_bytes(T, T)):4.2f} | {compare(variants, chain)}",
                  flush=True)
        for T in (4, 16):
            def silu(module, T=T):
                (x,) = seeded((1, 1, T, 8192), T)
                y = torch.empty_like(x)
                return (lambda: module.unary("SILU", x, y)), [y]

            def swiglu(module, T=T):
                g, u = seeded((1, 1, T, 12288), T, 2)
                y = torch.empty_like(g)
                return (lambda: module.glu("SWIGLU", g, u, False, y)), [y]
            for label, make in ((f"SILU 8192x{T}", silu), (f"SWIGLU 12288x{T}", swiglu)):
                print(f"{label:18s} |    - | {compare(variants, make)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
