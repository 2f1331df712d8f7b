"""Torch reference of ggml's quantized block formats: :func:`dequantize`, bit for bit ggml-quants.c's
``dequantize_row_*`` (the Triton mat-vec kernels read these blocks; this is their reference).

The layouts, as ggml-common.h defines them (``DType.size`` bytes per block, ``DType.block`` elements; little-endian
f16 fields; offsets in bytes, QK_K = 256 for the K-quants):

- ``block_q8_0`` (32 elements): ``d`` f16 [0, 2), ``qs`` 32 int8 [2, 34). ``y[j] = qs[j] * d``.
- ``block_q4_K`` (8 sub-blocks of 32): ``d`` f16 [0, 2), ``dmin`` f16 [2, 4), ``scales`` [4, 16), ``qs`` 128 bytes of
  nibbles [16, 144). The 12 scale bytes hold 8 6-bit scales and 8 6-bit mins (get_scale_min_k4): sub-block
  j < 4 has scale ``s[j] & 63`` and min ``s[j+4] & 63``; j >= 4 has scale ``(s[j+4] & 15) | (s[j-4] >> 6) << 4``
  and min ``(s[j+4] >> 4) | (s[j] >> 6) << 4`` (the top two bits of bytes 0-7 are the high bits of sub-blocks
  4-7's scales and mins). Each 32 bytes of ``qs`` feed two sub-blocks: their low nibbles the even one, their high
  nibbles the odd one. ``y = (d * scale) * q - (dmin * min)``.
- ``block_q5_K``: as q4_K with ``qh`` 32 bytes [16, 48) before ``qs`` [48, 176): bit j of ``qh[l]`` is the fifth
  bit (+16) of element l of sub-block j.
- ``block_q6_K`` (16 groups of 16): ``ql`` 128 bytes of low nibbles [0, 128), ``qh`` 64 bytes of high 2-bit pairs
  [128, 192), ``scales`` 16 int8 [192, 208), ``d`` f16 [208, 210) last. Each half of 128 elements takes 64 bytes
  of ``ql`` and 32 of ``qh``: element ``32*k + l`` (k < 4, l < 32) has low nibble of ``ql[l + 32*(k & 1)]`` (the
  low one for k < 2, the high one after) and high bits ``(qh[l] >> 2k) & 3``; q is that 6-bit value - 32, and
  element e of the block is ``(d * scales[e // 16]) * q``.

The f32 operations are ggml's, in ggml's order. Every product in them is exact in f32 (an f16 scale has 11
significant bits, a sub-block scale (6-bit, or q6_K's int8) at most 7, a quant at most 7 (q8_0's int8; 5 for q5_K
and q6_K): 23 bits at most, q6_K's ``d * sc * q``), so q8_0 and q6_K never round, and the one rounding of q4_K and
q5_K is the subtraction of ``dmin * m``: neither the association of the products nor a fused multiply-add (which
ggml's C may or may not be compiled with) changes a bit.
"""

from __future__ import annotations

from typing import Callable

import torch

from gdnpass.errors import KernelError
from gdnpass.ir import DType

K_SCALE_SIZE = 12  # ggml-common.h: the packed 6-bit scales and mins of q4_K / q5_K


def _split(blocks: torch.Tensor, dtype: DType, *widths: int) -> list[torch.Tensor]:
    """The block's fields, in order, from their byte widths (which must add up to the block's size)."""
    assert sum(widths) == dtype.size, (dtype, widths)
    return list(torch.split(blocks, widths, dim=-1))


def _f16(b: torch.Tensor) -> torch.Tensor:
    """A little-endian f16 field [..., 2] (uint8) as float32 [..., 1]."""
    hi = b[..., 1:].view(torch.int8).to(torch.int16)  # sign-extended: hi * 256 + lo stays in int16's range
    return (hi * 256 + b[..., :1].to(torch.int16)).view(torch.float16).float()


def _bits(b: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """``(b >> s) & mask`` for each shift s, stacked on a new dim before the last: [..., n] -> [..., len(shifts), n]."""
    s = torch.tensor(shifts, dtype=torch.uint8, device=b.device).view(-1, 1)
    return (b.unsqueeze(-2) >> s) & mask


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qs = _split(blocks, DType.Q8_0, 2, DType.Q8_0.block)
    return qs.view(torch.int8).float() * _f16(d)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """get_scale_min_k4 for j = 0..7: the 12 packed bytes [..., 12] -> scales, mins [..., 8] (uint8)."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([a & 63, (c & 15) | ((a >> 6) << 4)], dim=-1)
    m = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=-1)
    return sc, m


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """q4_K / q5_K quants: 4 x 32 bytes [..., 128] -> 8 sub-blocks of 32 [..., 8, 32]: low nibbles, then high."""
    return _bits(qs.unflatten(-1, (-1, 32)), [0, 4], 15).flatten(-3, -2)


def _k_affine(d: torch.Tensor, dmin: torch.Tensor, scales: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``d1 * q - m1`` with ``d1 = d * sc``, ``m1 = dmin * m`` per sub-block: q [..., 8, 32] -> [..., 256]."""
    sc, m = _scale_min_k4(scales)
    d1 = (_f16(d) * sc.float()).unsqueeze(-1)
    m1 = (_f16(dmin) * m.float()).unsqueeze(-1)
    return (d1 * q.float() - m1).flatten(-2)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = DType.Q4_K.block
    d, dmin, scales, qs = _split(blocks, DType.Q4_K, 2, 2, K_SCALE_SIZE, n // 2)
    return _k_affine(d, dmin, scales, _nibbles(qs))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = DType.Q5_K.block
    d, dmin, scales, qh, qs = _split(blocks, DType.Q5_K, 2, 2, K_SCALE_SIZE, n // 8, n // 2)
    return _k_affine(d, dmin, scales, _nibbles(qs) | (_bits(qh, list(range(8)), 1) << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = DType.Q6_K.block
    ql, qh, scales, d = _split(blocks, DType.Q6_K, n // 2, n // 4, n // 16, 2)
    ql = ql.unflatten(-1, (-1, 2, 32))                      # [..., half, 2, 32]
    lo = torch.cat([ql & 15, ql >> 4], dim=-2)              # [..., half, k = 0..3, 32]
    hi = _bits(qh.unflatten(-1, (-1, 32)), [0, 2, 4, 6], 3)  # [..., half, k, 32]
    q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(*blocks.shape[:-1], n // 16, 16)
    dsc = (_f16(d) * scales.view(torch.int8).float()).unsqueeze(-1)
    return (dsc * q.float()).flatten(-2)


DEQUANTIZE: dict[DType, Callable[[torch.Tensor], torch.Tensor]] = {
    DType.Q8_0: _q8_0, DType.Q4_K: _q4_k, DType.Q5_K: _q5_k, DType.Q6_K: _q6_k,
}


def dequantize(raw: torch.Tensor, dtype: DType) -> torch.Tensor:
    """ggml's dequantize_row of ``dtype`` over the last dim: uint8 [..., n_blocks * dtype.size] (any device; the
    last dim contiguous) -> float32 [..., n_blocks * dtype.block]."""
    fn = DEQUANTIZE.get(dtype)
    if fn is None:
        raise KernelError(f"dequantize: {dtype.label} is not a block type ({', '.join(t.label for t in DEQUANTIZE)}); "
                          f"bytes {raw.dtype} {tuple(raw.shape)}")
    if raw.dtype != torch.uint8 or raw.dim() == 0 or raw.shape[-1] % dtype.size:
        raise KernelError(f"dequantize: {dtype.label} bytes must be uint8 [..., n_blocks * {dtype.size}], got "
                          f"{raw.dtype} {tuple(raw.shape)}")
    blocks = raw.unflatten(-1, (-1, dtype.size))
    return fn(blocks).flatten(-2)


# where each type's f16 fields lie in its block (ggml-common.h): d first (q4_K / q5_K: dmin after it), q6_K's d last
F16_FIELDS: dict[DType, tuple[int, ...]] = {
    DType.Q8_0: (0,), DType.Q4_K: (0, 2), DType.Q5_K: (0, 2), DType.Q6_K: (DType.Q6_K.size - 2,),
}


def random_blocks(rows: int, n: int, dtype: DType, generator: torch.Generator, std: float) -> torch.Tensor:
    """Synthetic weights in ``dtype``'s blocks (uint8 [rows, row bytes] of ``n``-element rows): random quant bits
    (every pattern is legal), the f16 fields set so the values have mean about 0 and standard deviation about
    ``std``. Values are linear in the f16 fields (``d * A - dmin * B``), so the fields are found from one decode
    of A and B: no per-type constants."""
    raw = torch.randint(0, 256, (rows, dtype.row_bytes(n)), dtype=torch.uint8, generator=generator)
    blocks = raw.view(rows, -1, dtype.size)
    fields = F16_FIELDS[dtype]

    def decode(*values: float) -> torch.Tensor:
        for off, v in zip(fields, values):
            blocks[..., off:off + 2] = torch.tensor([v], dtype=torch.float16).view(torch.uint8)
        return dequantize(raw, dtype)

    a = decode(1.0, 0.0)
    b = decode(0.0, -1.0) if len(fields) > 1 else torch.zeros_like(a)
    ratio = float(a.mean() / b.mean()) if len(fields) > 1 else 0.0  # dmin / d: the mean to 0
    d = std / max(float((a - ratio * b).std()), 1e-30)
    decode(d, d * ratio)
    return raw
