"""Sweep the mat-vec tile (triton_ops.MatVecTile) over qwen3.5-9b's product shapes, on the GPU, and print the best
tile per (weight type, shape, columns) with its bandwidth next to the copy bandwidth measured in the same process.

    python benchmarks/tune_matvec.py [--budget-s 420]

This is how :func:`gdnpass.kernels.triton_ops.mat_vec_tile` was chosen; ``bench.py`` measures the chosen tiles.
Method: profiler kernel durations of CUDA-graph replays (bench.kernel_us), medians.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch
import triton

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")

from bench import MAT_SHAPES, bench_references, kernel_us  # noqa: E402
from gdnpass.kernels import triton_ops as tri  # noqa: E402

SHAPES = [s for s in MAT_SHAPES.values() if 256 < s[0] < 100_000]  # qwen3.5-9b's, but the thin and the lm head
THIN = (32, 4096)
COLS = (2, 4, 8, 16)
TOLERANCE = 1e-4  # max |y - ref| / max |ref| against cuBLAS's f32 product (tensor-core sums are not f32 rounding)


def candidates(N: int, M: int, K: int, sms: int = 132):
    cols = 1 << (N - 1).bit_length()
    if M <= 256:
        for bk, w in itertools.product((1024, 2048, 4096), (4, 8, 16)):
            if cols * bk <= 32768:
                yield tri.MatVecTile(1, cols, bk, False, w)
        return
    tiles = [tri.MatVecTile(bm, cols, bk, False, 4) for bm, bk in itertools.product((4, 8), (256, 512))
             if bm * cols * bk <= 8192]
    if N >= 2:
        tiles += [tri.MatVecTile(bm, 16, bk, True, w) for bm, bk, w in itertools.product((16, 32, 64, 128),
                                                                                          (64, 128, 256), (4, 8))
                  if bm * bk <= 16384 and not (bm == 16 and w == 8)]
    for t in tiles:
        yield t
        # split-K where the row blocks alone leave SMs idle (under two programs per SM), each slice a whole K step
        if M >= 1024 and triton.cdiv(M, t.block_m) < 2 * sms:
            for s in (2, 4, 8):
                if s * t.block_k <= K:
                    yield t._replace(split_k=s)


def _ints(text: str) -> list[int]:
    try:
        v = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not all(1 <= x <= 16 for x in v):
        raise argparse.ArgumentTypeError(f"column counts are 1..16, got {text!r}")
    return v


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(m), int(k)) for m, k in (s.split("x") for s in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxK[,ROWSxK...], e.g. 8192x4096, got {text!r}") from None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--shapes", type=_shapes, help="rows x K list, e.g. 8192x4096,4096x12288 (default: SHAPES)")
    p.add_argument("--cols", type=_ints, help="column counts 1..16, e.g. 4,8 (default: 2,4,8,16)")
    p.add_argument("--focus", action="store_true",
                   help="a smaller grid: tensor-core tiles of 32-128 rows with K steps of 128 and 4 warps only")
    a = p.parse_args()
    shapes, cols = a.shapes or SHAPES, a.cols or COLS
    t_end = time.time() + a.budget_s
    bw = bench_references()["copy_GBps"]
    print(f"copy bandwidth {bw:.0f} GB/s; target 80% = {0.8 * bw:.0f} GB/s", flush=True)
    rows, sms = [], torch.cuda.get_device_properties(0).multi_processor_count
    for wt, (M, K), N in itertools.product((torch.bfloat16,), shapes, cols):
        if time.time() > t_end:
            print("budget spent: stopping the sweep", flush=True)
            break
        w = (torch.randn(1, 1, M, K, device="cuda") / 64).to(wt)
        x = torch.randn(1, 1, N, K, device="cuda")
        y = torch.empty(1, 1, N, M, device="cuda")
        ref = x[0, 0] @ w[0, 0].float().t()
        nbytes = w.numel() * w.element_size() + x.numel() * 4 + y.numel() * 4
        best, d_us, default = None, float("nan"), tri.mat_vec_tile(M, N, K, tri.WTYPES[w.dtype])
        tiles = [t for t in candidates(N, M, K, sms)
                 if not a.focus or not t.dot or (t.block_m >= 32 and t.block_k == 128 and t.warps == 4)]
        for t in dict.fromkeys([default, *tiles]):
            if time.time() > t_end:  # (split-K quadruples some shapes' candidates: stop within the shape too)
                print(f"  budget spent: the rest of {M}x{K} N={N} not measured", flush=True)
                break
            y.fill_(float("nan"))  # an element the tile leaves unwritten fails the check below
            try:
                us = kernel_us(lambda: tri._mat_vecs([(w, y)], x, t), reps=10)[0]
            except Exception as e:  # noqa: BLE001 - a tile the compiler refuses (registers, shared memory)
                print(f"  {t}: {type(e).__name__}", flush=True)
                continue
            err = ((y[0, 0] - ref).abs().max() / ref.abs().max()).item()
            if not err <= TOLERANCE:
                print(f"  {t}: WRONG rel err {err:.2e}", flush=True)
                continue
            if t.split_k > 1:  # the replays' bytes again from an eager launch: the slice order must not vary
                again = y.clone()
                tri._mat_vecs([(w, again)], x, t)
                if not torch.equal(again.view(torch.int32), y.view(torch.int32)):
                    print(f"  {t}: NOT DETERMINISTIC", flush=True)
                    continue
            if t == default:
                d_us = us
            if best is None or us < best[1]:
                best = (t, us, err)
        if best is None:
            continue
        gbps = nbytes / (best[1] * 1e-6) / 1e9
        rows.append((str(wt).split(".")[-1], M, K, N, best, gbps, d_us))
        print(f"{rows[-1][0]:>8} {M:>6}x{K:<6} N={N:<2} best {best[1]:7.2f} us {gbps:6.0f} GB/s ({gbps / bw:4.0%}) "
              f"{best[0]} err {best[2]:.1e}  default {d_us:7.2f} us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
