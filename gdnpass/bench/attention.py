"""FLASH_ATTN_EXT at a verify's shape (qwen3.5-9b's full-attention layer: 16 query heads of 256 over 4 KV heads, an
f16 cache and mask, T query rows), with the KV split as the launcher chooses (``fa_grid``) and unsplit, over the
whole verify's padded KV (256 cells) and a long context: profiler kernel durations of CUDA-graph replays, the variants
in one process."""

from __future__ import annotations

import torch

from gdnpass.bench.timing import kernel_us
from gdnpass.kernels import triton_attention as ta

HEADS, KV_HEADS, D = 16, 4, 256  # qwen3.5-9b's attention layers


def _operands(T: int, n_kv: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, T, HEADS, D, device="cuda", generator=g).permute(0, 2, 1, 3)  # [D, T, H] as the graph's
    k = torch.randn(1, n_kv, KV_HEADS, D, device="cuda", generator=g).half().permute(0, 2, 1, 3)
    v = torch.randn(1, n_kv, KV_HEADS, D, device="cuda", generator=g).half().permute(0, 2, 1, 3)
    mask = torch.zeros(1, 1, T + (-T) % 8, n_kv, device="cuda", dtype=torch.float16)
    out = torch.empty(1, T, HEADS, D, device="cuda")
    return q, k, v, mask, out


def bench_attention(cases=((4, 256), (8, 256), (4, 4096), (8, 4096))) -> list[dict]:
    """[{T, n_kv, split, split_us, unsplit_us, agree}] (agree: the two outputs' max |Δ| / max |out|)."""
    rows = []
    for T, n_kv in cases:
        q, k, v, mask, out = _operands(T, n_kv)
        block_n = ta.fa_tile(D, D)[0]
        _, _, split = ta.fa_grid(T, HEADS, 1, HEADS // KV_HEADS, HEADS // KV_HEADS, n_kv, block_n)
        run = {s: (lambda s=s: ta.flash_attn_ext(q, k, v, mask, None, D ** -0.5, 0.0, 0.0, out, split=s))
               for s in (split, 1)}
        us = {s: kernel_us(fn)[0] for s, fn in run.items()}
        run[split]()
        a = out.clone()
        run[1]()
        agree = float((a - out).abs().max() / out.abs().max())
        rows.append(dict(T=T, n_kv=n_kv, split=split, split_us=us[split], unsplit_us=us[1], agree=agree))
    return rows
