"""The thin MUL_MAT at qwen3.5-9b's product shapes (:data:`MAT_SHAPES`): the copies of a weight one timing cycles
through so that every launch reads it from memory (:func:`rotation`), seeded operands, the command-line parsers of
shape and column lists the mat-vec scripts share; the chosen tiles against the copy bandwidth, and the alpha/beta pair
against two single mat-vecs."""

from __future__ import annotations

import argparse
import statistics

import torch

from gdnpass.bench.timing import kernel_us
from gdnpass.kernels import triton_matvec as mv

# qwen3.5-9b's product shapes (rows M, inner K): GDN qkv, z/ssm_out/attention output, alpha/beta, attention K/V,
# attention Q with its gate, FFN gate/up, FFN down, lm head
MAT_SHAPES = {"qkv, attn q+gate": (8192, 4096), "z, ssm_out, attn o": (4096, 4096), "attn k, v": (1024, 4096),
              "ffn gate, up": (12288, 4096), "ffn down": (4096, 12288), "lm head": (248320, 4096),
              "alpha, beta": (32, 4096)}

DTYPES = {name: dtype for dtype, name in mv.WTYPES.items()}  # "bf16" -> torch.bfloat16, ...


def rotation(nbytes: int) -> int:
    """How many copies of a weight of ``nbytes`` one timing cycles through, so that every launch reads its weight
    from memory as in a forward (which reads each of its ~16 GB of weights once): together at least twice the L2
    (H200: 50 MB), at most 256 copies. Timing one weight over and over would read one of 8-32 MB from L2."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return min(256, max(1, -(-2 * l2 // nbytes)))


def operands(wt: str, M: int, K: int, N: int, seed: int = 0):
    """(w, x, y) of one product: an M x K weight of type ``wt`` (a :data:`DTYPES` name), N columns of x, y empty."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(1, 1, M, K, device="cuda", generator=g) / 64).to(DTYPES[wt])
    x = torch.randn(1, 1, N, K, device="cuda", generator=g)
    return w, x, torch.empty(1, 1, N, M, device="cuda")


def column_counts(text: str) -> list[int]:
    """``--cols``: comma-separated column counts, 1..16."""
    try:
        v = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not all(1 <= x <= 16 for x in v):
        raise argparse.ArgumentTypeError(f"column counts are 1..16, got {text!r}")
    return v


def shape_list(text: str) -> list[tuple[int, int]]:
    """``--shapes``: ROWSxK[,ROWSxK...]."""
    try:
        return [(int(m), int(k)) for m, k in (s.split("x") for s in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxK[,ROWSxK...], e.g. 8192x4096, got {text!r}") from None


def bench_mat_vec(cols: list[int], ref: dict) -> list[dict]:
    """Every :data:`MAT_SHAPES` product, f32 and bf16 weights, at ``cols`` columns: the chosen tile's median launch
    over the rotated copies, its GB/s and its target (``ref``: :func:`gdnpass.bench.floors.bench_references`)."""
    out = []
    for wt in (torch.float32, torch.bfloat16):
        for name, (M, K) in MAT_SHAPES.items():
            w = (torch.randn(1, 1, M, K, device="cuda") / 64).to(wt)
            ws = [w] + [w.clone() for _ in range(rotation(w.numel() * w.element_size()) - 1)]
            for n in cols:
                x = torch.randn(1, 1, n, K, device="cuda")
                y = torch.empty(1, 1, n, M, device="cuda")
                # the median launch over the copies (each read from memory)
                us = statistics.median(kernel_us(lambda ws=ws: [mv.mul_mat_vec(v, x, y) for v in ws], reps=10)[1])
                nbytes = w.numel() * w.element_size() + x.numel() * 4 + y.numel() * 4
                gbps = nbytes / (us * 1e3)
                big = w.numel() * w.element_size() >= 8 << 20
                target = nbytes / (0.8 * ref["copy_GBps"] * 1e3) if big else \
                    1.2 * (ref["empty_us"] + nbytes / (ref["copy_GBps"] * 1e3))
                out.append(dict(wtype=str(wt).split(".")[-1], name=name, M=M, K=K, cols=n, us=us, GBps=gbps,
                                target_us=target, met=us <= target, tile=mv.mat_vec_tile(M, n, K, mv.WTYPES[w.dtype])))
            del w, ws
    return out


def bench_pair(cols: list[int]) -> list[dict]:
    """The alpha/beta pair (E 4096, M 32), f32 and bf16 weights: two single mat-vec launches vs one pair launch."""
    E, M = 4096, 32
    out = []
    for wt in (torch.float32, torch.bfloat16):
        wa = (torch.randn(1, 1, M, E, device="cuda") / 64).to(wt)
        wb = (torch.randn(1, 1, M, E, device="cuda") / 64).to(wt)
        for n in cols:
            x = torch.randn(1, 1, n, E, device="cuda")
            ya, yb = torch.empty(1, 1, n, M, device="cuda"), torch.empty(1, 1, n, M, device="cuda")
            two = kernel_us(lambda: (mv.mul_mat_vec(wa, x, ya), mv.mul_mat_vec(wb, x, yb)))[0]
            pair = kernel_us(lambda: mv.mul_mat_vec_pair(wa, wb, x, ya, yb))[0]
            out.append(dict(wtype=str(wt).split(".")[-1], cols=n, two=two, pair=pair, ratio=pair / two))
    return out
