"""The quantized mat-vec of whichever ``gdnpass`` is imported, timed at qwen3.5-9b's shapes (the lm head's included):
per launch over rotated weight copies (gdnpass.bench.matvec), profiler kernel time of a CUDA-graph replay (the
activations' pre-pass included; captured with programmatic dependent launch off, by the imported package's own
switch, so an older revision is timed as the tree is), median of three, with a hash of the output's bytes. Two
revisions are compared by running it twice on one machine, once with a revision's package first on PYTHONPATH
(``mkdir -p .ab/REV && git archive REV gdnpass | tar -x -C .ab/REV``): equal hashes mean equal bytes.

    PYTHONPATH=.ab/4a8be37 python benchmarks/probe_quant.py --qtypes q6_k     # then the working tree's:
    PYTHONPATH=. python benchmarks/probe_quant.py --qtypes q6_k
    PYTHONPATH=. python benchmarks/probe_quant.py --cols32      # one launch of 32 columns vs two of 16, bytes compared
    PYTHONPATH=. python benchmarks/probe_quant.py --qtypes q4_k,q6_k,bf16 --early 0,4,16 --cols 4
        # each production tile asking the L2 for its first steps before its wait (MatVecTile.early), bytes compared
    PYTHONPATH=. python benchmarks/probe_quant.py --qtypes q4_k,q8_0 --vary cols=8,16 --cols 4
        # any one MatVecTile field varied the same way (cols: the sum's width, 8 or 16; stages; block_m; regs)

(2026-12-06, H100: Q6_K's one dot a group against 4a8be37's two; 32-column launches: docs/performance.md.)
"""

from __future__ import annotations

import argparse
import hashlib

import torch

import gdnpass
from gdnpass.bench.matvec import QUANTIZED, operands, quantized_weight, rotation
from gdnpass.bench.timing import kernel_us
from gdnpass.kernels import triton_matvec as mv
from gdnpass.kernels.triton_core import programmatic_launch

SHAPES = ((12288, 4096), (4096, 12288), (4096, 4096), (248320, 4096))


def per_launch_us(fn, launches: int) -> float:
    with programmatic_launch(False):  # (a revision's own kernel_us may predate its switching it off)
        return sorted(kernel_us(fn)[0] for _ in range(3))[1] / launches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qtypes", default="q6_k", help="block types, comma-separated (default q6_k)")
    ap.add_argument("--cols32", action="store_true", help="one 32-column launch against two of 16 instead")
    ap.add_argument("--early", help="the production tiles asking the L2 for this many K steps before their wait "
                                    "instead, comma-separated (bf16 allowed in --qtypes)")
    ap.add_argument("--vary", help="FIELD=V1,V2,...: the production tiles with one MatVecTile field set to each value "
                                   "instead (early, cols, stages, block_m, regs, split_k)")
    ap.add_argument("--cols", default="1,4,16", help="column counts (default 1,4,16)")
    a = ap.parse_args()
    if a.early and a.vary:
        raise SystemExit("probe_quant: --early is --vary early=...: give one of them")
    if a.vary and "=" not in a.vary:
        raise SystemExit(f"probe_quant: --vary {a.vary!r}: FIELD=V1,V2,... (e.g. cols=8,16)")
    if a.early or a.vary:
        field, values = ("early", a.early) if a.early else a.vary.split("=", 1)
        if field not in mv.MatVecTile._fields:
            raise SystemExit(f"probe_quant: --vary: {field!r} is not one of MatVecTile's fields "
                             f"({', '.join(mv.MatVecTile._fields)})")
        return sweep_field(a.qtypes.split(","), field, [int(v) for v in values.split(",")],
                           [int(v) for v in a.cols.split(",")])
    unknown = set(a.qtypes.split(",")) - set(QUANTIZED)
    if unknown:
        raise SystemExit(f"probe_quant: --qtypes: {', '.join(sorted(unknown))} unknown")
    if not torch.cuda.is_available():
        raise SystemExit("probe_quant: needs a CUDA device (it times kernels)")
    print(f"# {torch.cuda.get_device_name()}; gdnpass from {gdnpass.__file__}")
    for wt in (QUANTIZED[t] for t in a.qtypes.split(",")):
        for M, K in SHAPES:
            w = quantized_weight(wt, M, K)
            ws = [w] + [w.clone() for _ in range(rotation(w.numel()) - 1)]
            for n in (32,) if a.cols32 else [int(v) for v in a.cols.split(",")]:
                x = torch.randn(1, 1, n, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n))
                y, y2 = torch.empty(1, 1, n, M, device="cuda"), torch.empty(1, 1, n, M, device="cuda")
                us = per_launch_us(lambda: [mv.mul_mat_vec(v, x, y, wt) for v in ws], len(ws))
                if not a.cols32:
                    digest = hashlib.sha1(y.cpu().numpy().tobytes()).hexdigest()[:10]
                    print(f"{wt.label} {M}x{K} n={n}: {us:8.1f} us  {digest}", flush=True)
                    continue
                halves = per_launch_us(lambda: [mv.mul_mat_vec(v, x[:, :, c:c + 16], y2[:, :, c:c + 16], wt)
                                                for v in ws for c in (0, 16)], len(ws))
                same = torch.equal(y.view(torch.int32), y2.view(torch.int32))
                print(f"{wt.label} {M}x{K} 32 columns: one launch {us:8.1f} us, two of 16 {halves:8.1f} us "
                      f"({us / halves:.2f}x), bytes {'equal' if same else 'DIFFER'}", flush=True)
            del w, ws
    return 0


def sweep_field(wtypes: list[str], field: str, values: list[int], cols: list[int]) -> int:
    """Each production tile timed with its ``field`` set to each of ``values`` (early: the K steps asked of the L2
    before its wait, 0 none), serial launches (so what it costs or saves a launch alone), output bytes compared."""
    if not torch.cuda.is_available():
        raise SystemExit("probe_quant: needs a CUDA device (it times kernels)")
    print(f"# {torch.cuda.get_device_name()}; MatVecTile.{field} in {values}; us per launch (bytes: same / DIFFER)")
    for wt in wtypes:
        for M, K in SHAPES:
            w = operands(wt, M, K, 1)[0]
            ws = [w] + [w.clone() for _ in range(rotation(w.numel() * w.element_size()) - 1)]
            dtype = QUANTIZED.get(wt)
            for n in cols:
                x = torch.randn(1, 1, n, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n))
                tile, ys, times = mv.mat_vec_tile(M, n, K, wt), [], []
                for v in values:
                    y = torch.empty(1, 1, n, M, device="cuda")
                    t = tile._replace(**{field: v})
                    times.append(per_launch_us(lambda: [mv._mat_vecs([(v, y)], x, t, dtype=dtype) for v in ws],
                                               len(ws)))
                    ys.append(y)
                same = all(torch.equal(ys[0].view(torch.int32), y.view(torch.int32)) for y in ys)
                print(f"{wt} {M}x{K} n={n} {tile}: " + " | ".join(f"{v} {t:.1f}" for v, t in zip(values, times))
                      + f"  bytes {'same' if same else 'DIFFER'}", flush=True)
            del w, ws
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
