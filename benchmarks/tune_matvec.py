"""Sweep the mat-vec tile (tiles.MatVecTile) over qwen3.5-9b's product shapes, on the GPU, and print the best
tile per (weight type, shape, columns) with its share of the read bandwidth measured in the same process
(gdnpass.bench.ceilings) and the time a streaming read of its bytes takes (``bench.matvec.read_us``: at 33 MB the
launch's ramp and tail alone keep a read from the bandwidth).

    python benchmarks/tune_matvec.py [--wtypes bf16,f32] [--shapes 4096x4096,...] [--cols 8,16] [--pair]
                                     [--budget-s 420] [--deep] [--procs 16] [--regs 128,152]

This is how :func:`gdnpass.kernels.tiles.mat_vec_tile` was chosen; ``bench.py`` measures the chosen tiles.
Method: every candidate is compiled first by ``--procs`` worker processes (into Triton's disk cache), checked
against cuBLAS's f32 product, captured as a CUDA graph of one launch per copy of the weights (enough copies that
each launch reads its weights from memory, as in a forward: ``gdnpass.bench.matvec.rotation``), and then all
candidates of a case are replayed under one torch.profiler session: medians of the profiler's kernel durations, as
``gdnpass.bench.timing.kernel_us`` (captured with programmatic dependent launch off, since 2026-12-06's fifth
session: under it each launch's duration counted its wait for the one before).
``--deep`` adds pipeline depths 2-5, evict-first weight loads and longer K steps to the candidates (thousands of
tiles: keep ``--procs`` x the largest shape's operands under the GPU's memory; the lm head at 16 processes ran out).
``--pair`` times MUL_MAT_VEC_PAIR's launch (two weights of the shape, one x) instead: with fusion on, FFN gate/up
and attention k/v only ever run as pairs, and a pair has twice the programs of its products.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch
import triton

from gdnpass.bench import ceilings
from gdnpass.bench.matvec import (DTYPES, QUANTIZED, column_counts, operands, product_shapes, read_us, rotation,
                                  shape_list)
from gdnpass.kernels import triton_matvec as mv
from gdnpass.kernels.triton_core import programmatic_launch

SHAPES = [(p.M, p.K) for p in product_shapes("qwen3.5-9b") if 256 < p.M < 100_000]  # but the thin and the lm head
COLS = (2, 4, 8, 16)
TOLERANCE = 1e-4  # max |y - ref| / max |ref| against cuBLAS's f32 product (tensor-core sums are not f32 rounding)


def candidates(N: int, M: int, K: int, sms: int = 132, deep: bool = False, wt: str = "bf16", products: int = 1,
               regs: tuple[int, ...] = ()):
    cols = 1 << (N - 1).bit_length()
    if wt in QUANTIZED:  # the tensor-core form (matvec_cols_q: columns padded to 8 or 16), a K-quant block per step,
        # split to fill the GPU (on 2026-12-04 it beat the dp4a form it replaced at every shape and width)
        # each uncapped, with the production tile's register cap (MatVecTile.regs), if it has one, and with ``regs``';
        # in the production tile's pipeline depth (Q8_0's 2, the K-quants' 3), or with --deep 2-4
        made = mv.mat_vec_tile(M, N, K, wt, products)
        forms = ((32, 4), (64, 4), (128, 4), (128, 8))
        caps = sorted({0, made.regs, *regs})
        widths = sorted({max(8, cols), max(16, cols)})
        for (bm, w), st, cap, c in itertools.product(forms, (2, 3, 4) if deep else (made.stages,), caps, widths):
            if bm <= max(16, M):
                for s in (1, 2, 4, 8, 16):
                    if s * 256 <= K and (s == 1 or triton.cdiv(M, bm) * s <= 8 * sms):
                        yield mv.MatVecTile(bm, c, 256, True, w, s, st, regs=cap)
        return
    dcols = max(4, cols) if wt == "bf16" else 16  # the tensor-core form's padded columns (bf16: its terms x 4)
    if M <= 256:  # the thin products: one row per program, or a few rows with K split over many programs
        for bk, w in itertools.product((1024, 2048, 4096), (4, 8, 16)):
            if cols * bk <= 32768:
                yield mv.MatVecTile(1, cols, bk, False, w)
        for bm, bk, s in itertools.product((1, 2, 4, 8), (128, 256, 512), (4, 8, 16, 32)):
            if bm * cols * bk <= 16384 and s * bk <= K:
                yield mv.MatVecTile(bm, cols, bk, False, 4, s)
        if N >= 2:
            for bk, s in itertools.product((64, 128, 256), (1, 4, 8, 16, 32)):
                if s * bk <= K:
                    yield mv.MatVecTile(min(M, 64), dcols, bk, True, 4, s)
        return
    # (Triton's pipeline depth, num_stages 2-6, was swept too on 2026-12-01 and never beat its default 3)
    tiles = [mv.MatVecTile(bm, cols, bk, False, 4) for bm, bk in itertools.product((2, 4, 8), (256, 512))
             if bm * cols * bk <= 8192]
    if deep:  # the pipeline depth and the L2 policy, and longer K steps per row (more bytes of a row per request)
        tiles += [mv.MatVecTile(bm, cols, bk, False, w, 1, st, ev) for bm, bk, w, st, ev in itertools.product(
            (2, 4, 8, 16), (256, 512, 1024), (4, 8), (2, 4, 5), (False, True)) if bm * cols * bk <= 8192]
    if M <= 1024:  # few rows: K in one or two long steps, as the thin tiles (on 2026-12-02 these won at one
        # column only: 2 rows, K steps of 2048)
        tiles += [mv.MatVecTile(bm, cols, bk, False, 8) for bm, bk in itertools.product((1, 2), (1024, 2048, 4096))
                  if bm * cols * bk <= 32768]
    if N >= 2:
        tiles += [mv.MatVecTile(bm, dcols, bk, True, w) for bm, bk, w in itertools.product((32, 64, 128), (64, 128),
                                                                                          (4, 8))]
        if M >= 4096:  # wider row blocks or shorter K steps: more bytes per program in flight, or more steps
            tiles += [mv.MatVecTile(bm, dcols, bk, True, w) for bm, bk, w in ((256, 64, 8), (256, 32, 8), (128, 32, 4),
                                                                           (128, 32, 8), (256, 128, 8))]
        if deep:  # longer K steps (a row's bytes in fewer, larger requests), pipeline depth, L2 policy; shared
            # memory per stage (weights + activations) under ~200 KB in all
            tiles += [mv.MatVecTile(bm, dcols, bk, True, w, 1, st, ev) for bm, bk, w, st, ev in itertools.product(
                (32, 64, 128), (128, 256), (4, 8), (2, 3, 4, 5), (False, True))
                if st * (bm * bk * 4 + bk * 16 * 4) <= 200_000]
    for t in tiles:
        yield t
        # split-K where the row blocks alone leave SMs idle (under two programs per SM), each slice a whole K step
        if M >= 1024 and triton.cdiv(M, t.block_m) < 2 * sms:
            for s in (2, 4, 8, 16):
                if s * t.block_k <= K:
                    yield t._replace(split_k=s)


def products(wt: str, M: int, K: int, N: int, pair: bool):
    """[(w, y)] or a pair's [(w, y), (w2, y2)] (two weights: one would be half read from L2), and x."""
    w, x, y = operands(wt, M, K, N)
    if not pair:
        return [(w, y)], x
    w2, _, y2 = operands(wt, M, K, N, seed=1)
    return [(w, y), (w2, y2)], x


def compile_case(case) -> int:
    """Worker: launch every tile of a case once (its compile lands in Triton's disk cache); the count refused."""
    with programmatic_launch(False):  # (the launch option is part of a kernel's compile key: time_case's launches)
        return _compile_case(case)


def _compile_case(case) -> int:
    wt, M, K, N, pair, tiles = case
    prods, x = products(wt, M, K, N, pair)
    refused = 0
    for t in tiles:
        try:
            mv._mat_vecs(prods, x, t, dtype=QUANTIZED.get(wt))
        except Exception:  # noqa: BLE001 - a tile the compiler refuses (registers, shared memory)
            refused += 1
    torch.cuda.synchronize()
    return refused


def time_case(wt: str, M: int, K: int, N: int, pair: bool, tiles, reps: int = 10) -> list[tuple]:
    """(tile, median us, rel err) of each tile that compiles, is within TOLERANCE and (split-K) deterministic; every
    launch, checks and captures alike, with programmatic dependent launch off (durations without waits, as
    ``timing.kernel_us``; the option is part of the compile key, so the checks compile what the capture replays)."""
    with programmatic_launch(False):
        return _time_case(wt, M, K, N, pair, tiles, reps)


def _time_case(wt: str, M: int, K: int, N: int, pair: bool, tiles, reps: int) -> list[tuple]:
    from torch.profiler import ProfilerActivity, profile

    from gdnpass.kernels.quants import file_rows, mul_mat_q

    prods, x = products(wt, M, K, N, pair)
    q = QUANTIZED.get(wt)  # (a block type's weights are held rows: quants.mul_mat_q takes the file's)
    refs = [mul_mat_q(file_rows(w, q), x, q)[0, 0] if q else x[0, 0] @ w[0, 0].float().t() for w, _ in prods]
    # the launches a replay makes: one per copy of the weights, so each reads its weights from memory (matvec.rotation)
    n_copies = rotation(sum(w.numel() * w.element_size() for w, _ in prods))
    rotated = [prods] + [[(w.clone(), y) for w, y in prods] for _ in range(n_copies - 1)]
    graphs, kept = [], []
    for t in tiles:
        for _, y in prods:
            y.fill_(float("nan"))  # an element the tile leaves unwritten fails the check below
        try:
            mv._mat_vecs(prods, x, t, dtype=q)
        except Exception:  # noqa: BLE001
            continue
        err = max(((y[0, 0] - ref).abs().max() / ref.abs().max()).item() for (_, y), ref in zip(prods, refs))
        first = [y.clone() for _, y in prods]
        mv._mat_vecs(prods, x, t, dtype=q)  # again: the slice order of a split-K tile must not vary
        if not err <= TOLERANCE or not all(torch.equal(f.view(torch.int32), y.view(torch.int32))
                                           for f, (_, y) in zip(first, prods)):
            print(f"  {t}: WRONG or NOT DETERMINISTIC (rel err {err:.2e})", flush=True)
            continue
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for ps in rotated:
                mv._mat_vecs(ps, x, t, dtype=q)
        graphs.append(g)
        kept.append((t, err))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for g in graphs:
            for _ in range(reps):
                g.replay()
        torch.cuda.synchronize()
    # (the mat-vec's own kernels: a quantized product's launch is its activations' pre-pass, then the mat-vec)
    ks = [e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
          and "mul_mat_vec" in e.name]
    per = reps * n_copies
    if len(ks) != per * len(graphs):
        raise RuntimeError(f"{len(ks)} kernels for {len(graphs)} graphs of {n_copies} launches x {reps} replays")
    return [(t, statistics.median(ks[i * per:(i + 1) * per]), err) for i, (t, err) in enumerate(kept)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--wtypes", default="bf16", help="comma-separated weight types: bf16, f16, f32 or block types "
                                                    "(q8_0, q4_k, q5_k, q6_k; default bf16)")
    p.add_argument("--shapes", type=shape_list, help="rows x K list, e.g. 8192x4096,4096x12288 (default: SHAPES)")
    p.add_argument("--cols", type=column_counts, help="column counts 1..16, e.g. 4,8 (default: 2,4,8,16)")
    p.add_argument("--procs", type=int, default=16, help="compile worker processes")
    p.add_argument("--pair", action="store_true", help="time the pair's launch (two weights of each shape)")
    p.add_argument("--json", help="write every tile's time to this file (not only each case's best three)")
    p.add_argument("--deep", action="store_true", help="also the pipeline depths, evict-first weight loads and longer "
                                                       "K steps")
    p.add_argument("--regs", type=lambda v: tuple(int(r) for r in v.split(",")), default=(),
                   help="block types: register caps to try besides none and the production tile's, e.g. 128,152")
    a = p.parse_args()
    wtypes = a.wtypes.split(",")
    if not set(wtypes) <= {*DTYPES, *QUANTIZED}:
        p.error(f"--wtypes: {a.wtypes!r} is not a list of {', '.join([*DTYPES, *QUANTIZED])}")
    t_end = time.time() + a.budget_s
    shapes, cols = a.shapes or SHAPES, a.cols or COLS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n_w = 2 if a.pair else 1  # the products a launch runs
    cases = [(wt, M, K, N, list(dict.fromkeys([mv.mat_vec_tile(M, N, K, wt, n_w),
                                               *candidates(N, M, K, sms, a.deep, wt, n_w, a.regs)])))
             for wt, (M, K), N in itertools.product(wtypes, shapes, cols)]
    start = time.time()
    # one case's tiles are spread over all workers (round robin), so a big case does not wait on one process
    jobs = [(wt, M, K, N, a.pair, tiles[i::a.procs]) for wt, M, K, N, tiles in cases for i in range(a.procs)]
    with mp.get_context("spawn").Pool(a.procs) as pool:
        refused = sum(pool.map(compile_case, jobs, chunksize=1))
    print(f"{sum(len(c[4]) for c in cases)} tiles of {len(cases)} cases compiled in {time.time() - start:.0f} s "
          f"({refused} refused)", flush=True)
    ceil = ceilings.measure()
    print("\n".join(ceilings.report(ceil)), flush=True)
    bw = ceil.read_GBps
    print(f"read bandwidth {bw:.0f} GB/s; target 85% = {0.85 * bw:.0f} GB/s", flush=True)
    rows = []
    for wt, M, K, N, tiles in cases:
        if time.time() > t_end:
            print("budget spent: stopping the sweep", flush=True)
            break
        timed = time_case(wt, M, K, N, a.pair, tiles)
        if not timed:
            continue
        default = dict((t, us) for t, us, _ in timed).get(tiles[0], float("nan"))
        wbytes = M * QUANTIZED[wt].row_bytes(K) if wt in QUANTIZED else M * K * DTYPES[wt].itemsize
        nbytes = n_w * (wbytes + N * M * 4) + N * K * 4
        pure = read_us(nbytes)  # a streaming read of as many bytes: what this size allows, ramp and tail included
        rows += [dict(wtype=wt, M=M, K=K, N=N, pair=a.pair, tile=list(t), us=us, GBps=nbytes / (us * 1e3),
                      read_us=pure, default=t == tiles[0]) for t, us, _ in timed]
        for t, us, err in sorted(timed, key=lambda r: r[1])[:3]:
            gbps = nbytes / (us * 1e3)
            print(f"{wt:>5}{'x2' if a.pair else ''} {M:>6}x{K:<6} N={N:<2} {us:7.2f} us {gbps:6.0f} GB/s "
                  f"({gbps / bw:4.0%}; a read of its bytes {pure:.2f} us) {t} err {err:.1e}  default {default:7.2f} us",
                  flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(read_GBps=bw, ceilings=dataclasses.asdict(ceil), tiles=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
