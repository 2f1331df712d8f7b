"""The fused chain, the SiLU kernels and the quantized mat-vec of other git revisions next to the working tree's, in
one process: each
revision's ``gdnpass`` package is loaded as a package of its own (a copy whose imports of ``gdnpass`` name the copy,
so its kernels call its own helpers), every variant is timed in turn (rounds in the order A B .., then reversed, then
again; medians of profiler kernel durations over CUDA-graph replays, gdnpass.bench.timing.kernel_us), and every
variant's output bytes are compared with the first's.

    python benchmarks/ab_kernels.py --base 2213063 [--base REV ..] [--tokens 1,4,8,16] [--only chain,quant]

``--base`` also takes a folder holding a revision's ``gdnpass`` package, for a machine whose copy of the tree has no
git history, as the device host's: ``mkdir -p .ab/REV && git archive REV gdnpass | tar -x -C .ab/REV`` here, then
``--base .ab/REV`` there (with ``.ab`` carried).

``--only quant``: the quantized mat-vec (``mul_mat_vec`` with its activations' pre-pass, per launch over rotated
weight copies, as bench.py times products) of each ``--qtypes`` block type at qwen3.5-9b's shapes (the lm head's
included) and 1, 4, 16, 32 columns (a revision that takes at most 16 a launch: two launches, as its MUL_MAT ran
them).

The working tree is the last column. The launchers compared (``gdn_conv_chain``, ``unary``, ``glu``,
``mul_mat_vec``) are looked up where a revision's layout keeps them (``gdnpass.bench.revisions.LAUNCHERS``: the
kernel family modules, or an older revision's single ``kernels/triton_ops.py``) and must take the working tree's
arguments; a revision without them is refused in one line.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from gdnpass.bench.chain import chain_bytes, chain_operands
from gdnpass.bench.floors import copy_us
from gdnpass.bench.matvec import QUANTIZED, quantized_weight, rotation
from gdnpass.bench.revisions import launchers, revision_module
from gdnpass.bench.timing import kernel_us

RMS = dict(norm="rms", qk_scale=128 ** -0.5)  # upstream's q/k form at S = 128


LAUNCHED = {"chain": ("gdn_conv_chain", "unary", "glu"), "quant": ("mul_mat_vec",)}  # what each --only part times
QUANT_SHAPES = ((4096, 4096), (12288, 4096), (4096, 12288), (248320, 4096))  # qwen3.5-9b's products, the lm head's


def compare(variants: dict, make, launches: int = 1) -> str:
    """One table row's cells, the variants' medians (per launch of ``launches`` a call) then whether their bytes
    agree: ``make(module)`` gives (launch, output tensors) for one variant's own operands."""
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
        times[tag].append(kernel_us(runs[tag])[0] / launches)
    cells = " | ".join(f"{statistics.median(times[t]):6.2f}" for t in tags)
    return f"{cells} | {'identical' if same else 'DIFFER'}"


def seeded(shape, seed: int, n: int = 1) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(*shape, device="cuda", generator=g) for _ in range(n)]


def launch_columns(module, w, x, y, dtype) -> int:
    """The columns one launch of ``module``'s quantized mat-vec takes of ``x``: all, or 16 for a revision whose
    mat-vec refuses more (before 32-column launches: its MUL_MAT ran it per 16 columns)."""
    try:
        module.mul_mat_vec(w, x, y, dtype)
    except Exception as e:  # noqa: BLE001 (the revision's own KernelError class)
        if "contiguous columns" not in str(e):
            raise
        return 16
    return x.shape[2]


def quant_rows(variants: dict, qtypes: list[str]) -> None:
    """The quantized mat-vec rows: each block type, shape and column count, over rotated copies of one weight."""
    for wt, (M, K) in ((wt, mk) for wt in qtypes for mk in QUANT_SHAPES):
        dtype = QUANTIZED[wt]
        w = quantized_weight(dtype, M, K)
        ws = [w] + [w.clone() for _ in range(rotation(w.numel()) - 1)]
        for n in (1, 4, 16, 32):
            (x,) = seeded((1, 1, n, K), n)
            y = torch.empty(1, 1, n, M, device="cuda")

            def product(module, ws=ws, x=x, y=y, dtype=dtype, n=n):
                step = launch_columns(module, ws[0], x, y, dtype)
                return (lambda: [module.mul_mat_vec(v, x[:, :, c:c + step], y[:, :, c:c + step], dtype)
                                 for v in ws for c in range(0, n, step)]), [y]
            print(f"{f'{wt} {M}x{K} n={n}':18s} |    - | {compare(variants, product, len(ws))}", flush=True)
        del w, ws


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", action="append", required=True,
                    help="a git revision, or a folder holding its gdnpass package, to compare (repeatable)")
    ap.add_argument("--tokens", default="1,4,8,16", help="token counts of the chain rows (rows = tokens)")
    ap.add_argument("--only", default="chain", help="chain (the chain and SiLU rows), quant, or both")
    ap.add_argument("--qtypes", default="q4_k,q6_k", help="the block types of the quant rows")
    a = ap.parse_args()
    unknown = set(a.only.split(",")) - {"chain", "quant"} | set(a.qtypes.split(",")) - set(QUANTIZED)
    if unknown:
        raise SystemExit(f"ab_kernels: --only / --qtypes: {', '.join(sorted(unknown))} unknown")
    if not torch.cuda.is_available():
        raise SystemExit("ab_kernels: needs a CUDA device (it times kernels)")
    tokens = [int(t) for t in a.tokens.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        names = [n for part, ns in LAUNCHED.items() if part in a.only for n in ns]
        variants = {rev: revision_module(rev, Path(folder), names) for rev in a.base}
        variants["tree"] = launchers("gdnpass", None, "tree", names)
        print(f"# {torch.cuda.get_device_name()}; profiler kernel us, medians of 3 rounds; bytes vs {a.base[0]}")
        print("what               | copy | " + " | ".join(variants) + " | bytes")
        if "quant" in a.only:
            quant_rows(variants, a.qtypes.split(","))
        if "chain" not in a.only:
            return 0
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
