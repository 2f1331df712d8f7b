"""Torch reference of ggml's quantized block formats: :func:`dequantize`, bit for bit ggml-quants.c's
``dequantize_row_*`` (the Triton mat-vec kernels read these blocks; this is their reference). Every function here
takes the blocks as ggml's file has them; gdnpass's buffers hold them as :func:`held_rows` gives them (Q8_0's rows
split), which :func:`file_rows` undoes.

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

from typing import Callable, NamedTuple

import torch

from gdnpass.errors import KernelError
from gdnpass.ir import HELD_SPLIT, DType

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


class Parts(NamedTuple):
    """A block type's values as ``scale * q - offset`` per group of ``S`` elements (ggml's order of operations):
    q the integer quants [..., groups, S] (int16), scale and offset f32 [..., groups] (offset None: none). The
    mat-vec reads weights in this form (:func:`mul_mat_q`)."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None


def _q8_0(blocks: torch.Tensor) -> Parts:
    d, qs = _split(blocks, DType.Q8_0, 2, DType.Q8_0.block)
    return Parts(qs.view(torch.int8).to(torch.int16).unsqueeze(-2), _f16(d), None)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """get_scale_min_k4 for j = 0..7: the 12 packed bytes [..., 12] -> scales, mins [..., 8] (uint8)."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([a & 63, (c & 15) | ((a >> 6) << 4)], dim=-1)
    m = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=-1)
    return sc, m


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """q4_K / q5_K quants: 4 x 32 bytes [..., 128] -> 8 sub-blocks of 32 [..., 8, 32]: low nibbles, then high."""
    return _bits(qs.unflatten(-1, (-1, 32)), [0, 4], 15).flatten(-3, -2)


def _k_affine(d: torch.Tensor, dmin: torch.Tensor, scales: torch.Tensor, q: torch.Tensor) -> Parts:
    """``d1 * q - m1`` with ``d1 = d * sc``, ``m1 = dmin * m`` per sub-block of 32."""
    sc, m = _scale_min_k4(scales)
    return Parts(q.to(torch.int16), _f16(d) * sc.float(), _f16(dmin) * m.float())


def _q4_k(blocks: torch.Tensor) -> Parts:
    n = DType.Q4_K.block
    d, dmin, scales, qs = _split(blocks, DType.Q4_K, 2, 2, K_SCALE_SIZE, n // 2)
    return _k_affine(d, dmin, scales, _nibbles(qs))


def _q5_k(blocks: torch.Tensor) -> Parts:
    n = DType.Q5_K.block
    d, dmin, scales, qh, qs = _split(blocks, DType.Q5_K, 2, 2, K_SCALE_SIZE, n // 8, n // 2)
    return _k_affine(d, dmin, scales, _nibbles(qs) | (_bits(qh, list(range(8)), 1) << 4))


def _q6_k(blocks: torch.Tensor) -> Parts:
    n = DType.Q6_K.block
    ql, qh, scales, d = _split(blocks, DType.Q6_K, n // 2, n // 4, n // 16, 2)
    ql = ql.unflatten(-1, (-1, 2, 32))                      # [..., half, 2, 32]
    lo = torch.cat([ql & 15, ql >> 4], dim=-2)              # [..., half, k = 0..3, 32]
    hi = _bits(qh.unflatten(-1, (-1, 32)), [0, 2, 4, 6], 3)  # [..., half, k, 32]
    q = ((lo | (hi << 4)).to(torch.int16) - 32).reshape(*blocks.shape[:-1], n // 16, 16)
    return Parts(q, _f16(d) * scales.view(torch.int8).float(), None)


DECOMPOSE: dict[DType, Callable[[torch.Tensor], Parts]] = {
    DType.Q8_0: _q8_0, DType.Q4_K: _q4_k, DType.Q5_K: _q5_k, DType.Q6_K: _q6_k,
}


def parts(raw: torch.Tensor, dtype: DType) -> Parts:
    """:class:`Parts` of ``dtype`` bytes [..., n_blocks * dtype.size] (the checks of :func:`dequantize`): groups
    over all blocks, [..., groups, S]."""
    fn = DECOMPOSE.get(dtype)
    if fn is None:
        raise KernelError(f"dequantize: {dtype.label} is not a block type ({', '.join(t.label for t in DECOMPOSE)}); "
                          f"bytes {raw.dtype} {tuple(raw.shape)}")
    if raw.dtype != torch.uint8 or raw.dim() == 0 or raw.shape[-1] % dtype.size:
        raise KernelError(f"dequantize: {dtype.label} bytes must be uint8 [..., n_blocks * {dtype.size}], got "
                          f"{raw.dtype} {tuple(raw.shape)}")
    p = fn(raw.unflatten(-1, (-1, dtype.size)))
    flat = (lambda t: t.flatten(-2, -1))  # noqa: E731  (blocks x groups -> groups)
    return Parts(p.q.flatten(-3, -2), flat(p.scale), None if p.offset is None else flat(p.offset))


def dequantize(raw: torch.Tensor, dtype: DType) -> torch.Tensor:
    """ggml's dequantize_row of ``dtype`` over the last dim: uint8 [..., n_blocks * dtype.size] (any device; the
    last dim contiguous) -> float32 [..., n_blocks * dtype.block]."""
    q, scale, offset = parts(raw, dtype)
    v = scale.unsqueeze(-1) * q.float()
    return (v if offset is None else v - offset.unsqueeze(-1)).flatten(-2)


def held_rows(raw: torch.Tensor, dtype: DType) -> torch.Tensor:
    """The bytes gdnpass holds for ``dtype`` rows given as ggml's file has them (uint8 [..., row bytes]): a held-split
    type's rows in planes (:data:`~gdnpass.ir.HELD_SPLIT`), one a block field, every block's in order (Q8_0: its
    quants, element k's at byte k, then its f16 scales, group g's at byte K + 2g; Q6_K: ql, qh, the scales, d, block
    b's at 128b, K/2 + 64b, 3K/4 + 16b and 13K/16 + 2b); every other type's as they are. The same bytes, moved within
    each row, so every block's part of a plane lies on 16 bytes where the row does: the file's 34- and 210-byte
    blocks put every other group's quants 2 bytes off a word, which the mat-vec could only load 16 bits at a time and
    either move through shared memory (Q8_0) or wait on in its step, uncopied ahead (Q6_K; docs/quantized.md).
    ggml-cpu repacks Q8_0 for its kernels likewise (``block_q8_0x4``: scales apart from quants). The kernels, the
    reference ops and the executor's weights take held rows; :func:`file_rows` undoes it for ggml's own functions here
    (:func:`dequantize`, :func:`mul_mat_q`, ...), which take the file's."""
    return _moved(raw, dtype, held=True)


def file_rows(raw: torch.Tensor, dtype: DType) -> torch.Tensor:
    """ggml's bytes of ``dtype`` rows that gdnpass holds (:func:`held_rows`)."""
    return _moved(raw, dtype, held=False)


def _moved(raw: torch.Tensor, dtype: DType, held: bool) -> torch.Tensor:
    """:func:`held_rows` (``held``) or :func:`file_rows`: one new tensor, no temporaries (a weight of gigabytes is
    moved on the host as it loads), each plane copied between its fields of the blocks and its span of the row."""
    if dtype not in HELD_SPLIT:
        return raw
    out = torch.empty_like(raw, memory_format=torch.contiguous_format)
    n = raw.shape[-1] // dtype.size
    file, planes = (raw, out) if held else (out, raw)
    blocks, at = file.unflatten(-1, (n, dtype.size)), 0
    for off, width in HELD_SPLIT[dtype]:
        field, plane = blocks[..., off:off + width], planes[..., at:at + n * width].unflatten(-1, (n, width))
        plane.copy_(field) if held else field.copy_(plane)
        at += n * width
    return out


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
    # each block's fields times its own factor in [0.5, 1.5): a kernel that took another block's scale is then wrong
    factor = 0.5 + torch.rand(blocks.shape[:2] + (1,), generator=generator)
    for off in fields:
        field = blocks[..., off:off + 2].contiguous().view(torch.float16)
        blocks[..., off:off + 2] = (field.float() * factor).half().view(torch.uint8)
    return raw


# ---- the product with quantized weights --------------------------------------------------------------------------

X_GROUP = 32  # the activations' quantization group (llama.cpp's q8_1 block)


def _quotient(c: float, t: torch.Tensor) -> torch.Tensor:
    """c / t in t's type, one IEEE division as C's ``c / t`` (torch's ``c / t`` is ``t.reciprocal() * c``: two
    roundings, one ulp off now and then)."""
    return torch.full_like(t, c) / t


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations [..., K] (K a multiple of 32) quantized per group of 32 as llama.cpp's q8_1 blocks: d = amax / 127,
    q = roundf(x * (127 / amax)) (halves away from zero; 0 where amax is 0; llama.cpp's CUDA path divides by d,
    its CPU path multiplies by 1 / d: one ulp apart at most) and the group's sum s = Σx (f32). A Q8_0 product's
    activations (the kernel's: :func:`gdnpass.kernels.triton_matvec._quantize_x_kernel`). Returns q [..., groups, 32] (int16),
    d, s [..., groups]."""
    g = x.float().unflatten(-1, (-1, X_GROUP))
    amax = g.abs().amax(-1)
    d = amax / 127
    v = g * _quotient(127, torch.where(amax > 0, amax, 1.0)).unsqueeze(-1)
    t = v.trunc()
    f = v - t
    q = t + torch.where(f >= 0.5, 1.0, torch.where(f <= -0.5, -1.0, 0.0))
    q = torch.where(amax.unsqueeze(-1) > 0, q, 0.0)
    return q.to(torch.int16), d, g.sum(-1)


def quantize_x_ggml_cpu(x: torch.Tensor, dtype: DType) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations as ggml-cpu quantizes them for a ``dtype`` weight (its vec_dot type; the pinned llama.cpp's
    x86 AVX2 build): Q8_0 weights take q8_0 blocks of 32 (d = f16(amax / 127); q = round-to-even(x * (127 / amax))),
    the K-quants q8_K blocks of 256 (quantize_row_q8_K_ref: iscale = -127 / max with max the element of the largest
    magnitude, q = min(127, round-to-even(iscale * x)), d = 1 / iscale; the K-quant products' kernel's too:
    :func:`gdnpass.kernels.triton_matvec._quantize_x_kernel`). Returns q [..., K] (int16) and d per element
    [..., K] (f64)."""
    xf = x.float()  # (torch.round: half to even, as ggml-cpu's nearest_int and _mm256_round_ps)
    if dtype is DType.Q8_0:
        n = DType.Q8_0.block
        g = xf.unflatten(-1, (-1, n))
        amax = g.abs().amax(-1)
        d = (amax / 127).half().double()
        inv = torch.where(amax > 0, _quotient(127, torch.where(amax > 0, amax, 1.0)), 0.0)
        q = torch.round(g * inv.unsqueeze(-1))
        return q.flatten(-2).to(torch.int16), d.repeat_interleave(n, dim=-1)
    g = xf.unflatten(-1, (-1, DType.Q4_K.block))
    at = g.abs().argmax(-1, keepdim=True)  # (the first of equal magnitudes, as ggml's strict >)
    mx = torch.gather(g, -1, at).squeeze(-1)
    iscale = torch.where(mx != 0, _quotient(-127, torch.where(mx != 0, mx, 1.0)), 0.0)
    q = torch.clamp(torch.round(g * iscale.unsqueeze(-1)), max=127)
    d = torch.where(mx != 0, _quotient(1, torch.where(mx != 0, iscale, 1.0)), 0.0).double()
    return q.flatten(-2).to(torch.int16), d.repeat_interleave(DType.Q4_K.block, dim=-1)


def mul_mat_q(w: torch.Tensor, x: torch.Tensor, dtype: DType, *, cpu: bool = False,
              rows_per_chunk: int = 4096) -> torch.Tensor:
    """MUL_MAT of a quantized weight: w the weight's bytes (..., M, row bytes) of one matrix, x f32 (..., K)
    columns. Per group of the weight (:func:`parts`: ``scale * q - offset``) the integer dot of its quants with the
    quantized activations', times both scales, minus the weight's offset times the activations' group sum.
    gdnpass's scheme (the reference of the mat-vec's :func:`~gdnpass.kernels.triton_matvec.matvec_cols_q`): Q8_0
    weights take llama.cpp's CUDA mmvq scheme (:func:`quantize_x`: q8_1 groups of 32, the offsets against the exact
    sums Σx, though Q8_0 has none), the K-quants ggml-cpu's (:func:`quantize_x_ggml_cpu`: q8_K blocks of 256, the
    offsets against the quantized sums, as its bsums), which lets the kernel add a block's group dots up in int32;
    ``cpu``: ggml-cpu's for every type (the referee's arithmetic; Q8_0's q8_0 blocks round d to f16). Sums in f64,
    one rounding to f32 at the end (the kernels sum in f32: they agree to f32 summation accuracy). Returns
    (..., N, M) f32 like ``reference.mul_mat``."""
    q, scale, offset = parts(w.reshape(-1, w.shape[-1]), dtype)       # [M, G, S], [M, G]
    S = q.shape[-1]
    x2 = x.reshape(-1, x.shape[-1])
    if cpu or dtype is not DType.Q8_0:
        qx, dx = quantize_x_ggml_cpu(x2, dtype)                       # [N, K], [N, K]
        qx, dx = qx.reshape(qx.shape[0], -1, S).double(), dx.reshape(dx.shape[0], -1, S)[..., 0]
        sx = dx * qx.sum(-1)                                          # [N, G]: d times the quants' sum
    else:
        qx, dx, sx = quantize_x(x2)                                   # [N, K/32, 32], [N, K/32]
        qx = qx.reshape(qx.shape[0], -1, S).double()                  # [N, G, S]
        dx = dx.double().repeat_interleave(X_GROUP // S, dim=-1)      # [N, G]
        sx = sx.double()
    out = []
    for m0 in range(0, q.shape[0], rows_per_chunk):
        qm, am = q[m0:m0 + rows_per_chunk].double(), scale[m0:m0 + rows_per_chunk].double()
        dots = torch.einsum("mgs,ngs->nmg", qm, qx)                    # exact: small integers
        y = (dots * am.unsqueeze(0) * dx.unsqueeze(1)).sum(-1)
        if offset is not None:
            y = y - (offset[m0:m0 + rows_per_chunk].double().unsqueeze(0) * sx.unsqueeze(1)).sum(-1)
        out.append(y)
    return torch.cat(out, dim=-1).float().reshape(*x.shape[:-1], q.shape[0])
