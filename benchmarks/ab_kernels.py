"""The fused chain and the SiLU kernels of other git revisions next to the working tree's, in one process: each
revision's ``gdnpass/kernels/triton_ops.py`` is loaded as a module of its own, every variant is timed in turn
(rounds in the order A B .., then reversed, then again; medians of profiler kernel durations over CUDA-graph
replays, bench.kernel_us), and every variant's output bytes are compared with the first's.

    python benchmarks/ab_kernels.py --base 2213063 [--base REV ..] [--tokens 1,4,8,16]

``--base`` also takes a file (a ``triton_ops.py`` written out beforehand), for a machine whose copy of the tree has
no git history, as the device host's: ``git show REV:gdnpass/kernels/triton_ops.py > .ab/REV.py`` here, then
``--base .ab/REV.py`` there (with ``.ab`` carried).

The working tree is the last column. A revision's module must take the same launch arguments as the working
tree's (``gdn_conv_chain``, ``unary``, ``glu``).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")

from bench import chain_bytes, chain_operands, copy_us, kernel_us  # noqa: E402

from gdnpass.kernels import triton_ops  # noqa: E402

SOURCE = "gdnpass/kernels/triton_ops.py"
RMS = dict(norm="rms", qk_scale=128 ** -0.5)  # upstream's q/k form at S = 128


def revision_module(rev: str, folder: Path):
    """triton_ops.py as of ``rev`` (a git revision, or a file holding it), imported as its own module (Triton keys
    its compiles by source, so the two revisions' kernels stay apart)."""
    if rev.endswith(".py"):
        try:
            text = Path(rev).read_text()
        except OSError as e:
            raise SystemExit(f"ab_kernels: --base {rev}: {e.strerror}")
    else:
        try:
            text = subprocess.run(["git", "show", f"{rev}:{SOURCE}"], check=True, capture_output=True,
                                  text=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit(f"ab_kernels: --base {rev}: {getattr(e, 'stderr', '').strip() or 'git show failed'}")
    name = "triton_ops_" + "".join(c if c.isalnum() else "_" for c in Path(rev).stem)
    path = folder / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
                    help="a git revision, or a .py file of triton_ops, to compare (repeatable)")
    ap.add_argument("--tokens", default="1,4,8,16", help="token counts of the chain rows (rows = tokens)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ab_kernels: needs a CUDA device (it times kernels)")
    tokens = [int(t) for t in a.tokens.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        variants = {rev: revision_module(rev, Path(folder)) for rev in a.base}
        variants["tree"] = triton_ops
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
