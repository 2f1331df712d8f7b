"""Sweep the GEMM's tile (tiles.GemmTile: MUL_MAT of over 16 columns of a bf16 weight) over qwen3.5-9b's
product shapes at several sequences' widths, on the GPU, next to the production tile, the torch reference it replaced
and cuBLAS; print the best tile per (shape, columns) with its share of the read bandwidth.

    python benchmarks/tune_gemm.py [--shapes 12288x4096,...] [--cols 32,64,128] [--budget-s 300] [--json FILE]

This is how :func:`gdnpass.kernels.tiles.gemm_tile` is to be chosen (its tiles are untimed until then).
Method: each candidate is checked first (every element written, within the mat-vec's tensor-core tolerance of a
float64 product on sampled rows, the same bytes on a second run), then timed as ``gdnpass.bench.timing.kernel_us``
times a launch: profiler kernel durations of a CUDA-graph replay, median of 10, over enough copies of the weight that
each launch reads it from memory (``gdnpass.bench.matvec.rotation``), per launch. The columns "torch ref" (the f32
conversion of the weight and an f32 matmul: what ran before the GEMM) and "cuBLAS bf16" (``torch.mm`` of bf16
operands: x rounded to bf16, so not the same product; a speed reference only) are timed the same way.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from gdnpass.bench import ceilings
from gdnpass.bench.matvec import product_shapes, rotation, shape_list
from gdnpass.bench.timing import kernel_us
from gdnpass.kernels import reference as ref
from gdnpass.kernels import triton_matvec as mv

SHAPES = [(p.M, p.K) for p in product_shapes("qwen3.5-9b") if p.M > 256]  # the lm head among them
COLS = (32, 64, 128)  # 8, 16 and 32 sequences of 4 tokens (K = 3)
RTOL = 1e-4  # tests/kernels/test_gemm.py's RTOL: the tensor cores' accumulation does not round to nearest
SAMPLED_ROWS = 4096  # rows checked against float64 (an lm head's f64 copy would take 8 GB)


def candidates(N: int):
    """Row blocks x K steps x warps x pipeline depth (five shapes around the sweep of 2026-12-06's best), x column
    tiles x K slices: under ~200 KB of shared memory for the pipeline's stages (the bf16 weight tile and x's three
    bf16 term tiles); ~40 a width, each compiled once (M, N and K are no compile-time constants), ~1-2 s each."""
    shapes = ((64, 128, 4, 4), (64, 64, 4, 3), (32, 128, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3))
    for (bm, bk, w, st), bn, split in itertools.product(shapes, (32, 64), (1, 2, 4, 8)):
        if bn <= max(32, N) and st * (bm * bk * 2 + 3 * bk * bn * 2) <= 200_000:
            yield mv.GemmTile(bm, bn, bk, w, st, split)


def wide_columns(text: str) -> list[int]:
    """--cols: comma-separated column counts over 16."""
    try:
        cols = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of column counts") from None
    if any(c <= 16 for c in cols):
        raise argparse.ArgumentTypeError(f"{text!r}: the GEMM takes over 16 columns (1-16 are the mat-vec's: "
                                         "tune_matvec.py)")
    return cols


def check(w, x, tile) -> str | None:
    """Why ``tile`` is not usable (None if it is): refused, an element unwritten, off the f64 product, or bytes that
    vary run to run."""
    M = w.shape[-2]
    y = torch.full((1, 1, x.shape[2], M), float("nan"), device=x.device)
    try:
        mv.mul_mat_gemm(w, x, y, tile)
    except Exception as e:  # noqa: BLE001 - a tile the compiler refuses (registers, shared memory)
        return f"refused ({type(e).__name__})"
    rows = torch.linspace(0, M - 1, min(M, SAMPLED_ROWS), device=x.device).long()
    want = x.double()[0, 0] @ w[0, 0, rows].double().t()
    got = y[0, 0][:, rows].double()
    if torch.isnan(y).any():
        return "an element unwritten"
    err = ((got - want).abs().max() / want.abs().max()).item()
    if err > RTOL:
        return f"rel err {err:.2e}"
    again = torch.empty_like(y)
    mv.mul_mat_gemm(w, x, again, tile)
    if not torch.equal(again.view(torch.int32), y.view(torch.int32)):
        return "not deterministic"
    return None


def per_launch_us(fn_of_weight, weights) -> float:
    return kernel_us(lambda: [fn_of_weight(w) for w in weights], reps=10)[0] / len(weights)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=shape_list, help="rows x K list, e.g. 12288x4096,4096x12288 (default: the 9B's)")
    p.add_argument("--cols", type=wide_columns, default=list(COLS), help="column counts over 16 (default 32,64,128)")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting new cases after this (default 300)")
    p.add_argument("--json", help="write every tile's time to this file")
    a = p.parse_args()
    cols = a.cols
    if not torch.cuda.is_available():
        raise SystemExit("tune_gemm: no CUDA GPU here (the GEMM's CPU checks: tests/kernels/test_gemm.py)")
    t_end = time.time() + a.budget_s
    ceil = ceilings.measure()
    print("\n".join(ceilings.report(ceil)), flush=True)
    bw = ceil.read_GBps
    rows, out = [], []
    for (M, K), N in itertools.product(a.shapes or SHAPES, cols):
        if time.time() > t_end:
            print(f"budget spent: {M}x{K} at {N} columns and after not measured", flush=True)
            break
        torch.manual_seed(0)
        w0 = (torch.randn(1, 1, M, K, device="cuda") / 64).bfloat16()
        x = torch.randn(1, 1, N, K, device="cuda")
        y = torch.empty(1, 1, N, M, device="cuda")
        weights = [w0] + [w0.clone() for _ in range(rotation(w0.numel() * 2) - 1)]
        prod = mv.gemm_tile(M, N, K, "bf16")
        timed = []
        for t in dict.fromkeys([prod, *candidates(N)]):
            why = check(w0, x, t)
            if why is not None:
                print(f"  {M}x{K} {N} cols {t}: {why}", flush=True)
                continue
            timed.append((per_launch_us(lambda w, t=t: mv.mul_mat_gemm(w, x, y, t), weights), t))
        xb = x[0, 0].bfloat16()
        cublas = per_launch_us(lambda w: torch.mm(xb, w[0, 0].t()), weights)
        before = per_launch_us(lambda w: y.copy_(ref.mul_mat(w, x)), weights[:2])
        timed.sort(key=lambda r: r[0])
        best_us, best = timed[0]
        prod_us = next(us for us, t in timed if t == prod) if any(t == prod for _, t in timed) else float("nan")
        gbps = lambda us: (M * K * 2 + N * K * 4 + N * M * 4) / (us * 1e3)  # noqa: E731 - bytes a launch must move
        rows.append(f"{M:6d}x{K:<5d} {N:4d} | {before:9.1f} | {cublas:7.1f} | {prod_us:7.1f} | {best_us:7.1f} "
                    f"({100 * gbps(best_us) / bw:3.0f}%) | {best.block_m}x{best.block_n}x{best.block_k} "
                    f"w{best.warps} s{best.stages} k/{best.split_k}")
        print(rows[-1], flush=True)
        out.append(dict(M=M, K=K, N=N, torch_ref_us=before, cublas_bf16_us=cublas, production=prod._asdict(),
                        production_us=prod_us, tiles=[dict(t._asdict(), us=us) for us, t in timed]))
        del weights, w0
        torch.cuda.empty_cache()
    print(f"\n# {torch.cuda.get_device_name()}, read bandwidth {bw:.0f} GB/s; us per launch (profiler, CUDA graph)")
    print("  rows x K    cols | torch ref | cuBLAS bf16 | production | best (% of read BW) | tile")
    print("\n".join(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), read_GBps=bw, cases=out), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
