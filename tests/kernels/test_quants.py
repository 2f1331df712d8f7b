"""gdnpass.kernels.quants.dequantize, bit for bit: against ggml's own to_float (ggml-python) and gguf-py's numpy
dequantize, on blocks ggml's quantizer made from f32 rows and on random bytes; batched and strided inputs; errors."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from gdnpass.errors import KernelError
from gdnpass.ir import DType
from gdnpass.kernels.quants import DECOMPOSE, F16_FIELDS, dequantize, file_rows, held_rows, random_blocks

TYPES = list(DECOMPOSE)
ROWS, BLOCKS = 12, 4  # rows of ROWS x 4 blocks each


def _ggml_type(dtype: DType) -> int:
    import ggml
    return getattr(ggml, f"GGML_TYPE_{dtype.name}")


def _ggml_quantize(x: np.ndarray, dtype: DType) -> np.ndarray:
    """ggml_quantize_chunk (no importance matrix: the type's reference quantizer) of f32 rows."""
    import ggml
    rows, n = x.shape
    out = np.zeros((rows, dtype.row_bytes(n)), np.uint8)
    size = ggml.ggml_quantize_chunk(_ggml_type(dtype), x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                    out.ctypes.data_as(ctypes.c_void_p), 0, rows, n, None)
    assert size == out.nbytes
    return out


def _ggml_dequantize(raw: np.ndarray, dtype: DType) -> np.ndarray:
    """The type traits' to_float (ggml-quants.c's dequantize_row_*) over all the blocks of ``raw``."""
    import ggml
    raw = np.ascontiguousarray(raw)
    y = np.empty(raw.shape[:-1] + (raw.shape[-1] // dtype.size * dtype.block,), np.float32)
    ggml.ggml_get_type_traits(_ggml_type(dtype)).contents.to_float(
        raw.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), y.size)
    return y


def _blocks(dtype: DType, kind: str) -> np.ndarray:
    """uint8 [ROWS, BLOCKS * size]. ``real``: ggml's quantizer on seeded normal rows, some with outliers, two all
    zero, one tiny. ``random``: random bytes (every quant bit pattern is legal) with finite random f16 fields."""
    rng = np.random.default_rng(34 + TYPES.index(dtype))
    if kind == "real":
        pytest.importorskip("ggml")
        x = rng.standard_normal((ROWS, BLOCKS * dtype.block)).astype(np.float32)
        x[1:4].flat[rng.integers(0, 3 * x.shape[1], 12)] *= 50.0  # outliers
        x[4] = 0.0
        x[5, : dtype.block] = 0.0  # one all-zero block in a row of others
        x[6] *= 1e-6
        x[7] = np.abs(x[7])  # all positive: the K-quants' mins at zero
        return _ggml_quantize(x, dtype)
    raw = rng.integers(0, 256, (ROWS, BLOCKS, dtype.size), dtype=np.uint8)
    scale = np.exp2(rng.integers(-24, 12, (ROWS, BLOCKS, 1)))  # subnormal to large
    f16 = (rng.standard_normal((ROWS, BLOCKS, len(F16_FIELDS[dtype]))) * scale).astype(np.float16)
    f16[0, 0] = 0.0
    f16[0, 1] = np.float16(6e-8)  # subnormal
    for i, off in enumerate(F16_FIELDS[dtype]):
        raw[..., off:off + 2] = f16[..., i:i + 1].view(np.uint8)
    assert np.isfinite(f16).all()
    return raw.reshape(ROWS, -1)


def _same_bits(ours: torch.Tensor, ref: np.ndarray) -> None:
    ref = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    diff = (ours.view(torch.int32) != ref.view(torch.int32)).nonzero()
    assert diff.numel() == 0, f"{len(diff)} elements differ, first at {diff[0].tolist()}"


@pytest.mark.parametrize("kind", ["real", "random"])
@pytest.mark.parametrize("dtype", TYPES, ids=lambda t: t.label)
def test_matches_ggml_to_float(dtype, kind):
    pytest.importorskip("ggml")
    raw = _blocks(dtype, kind)
    _same_bits(dequantize(torch.from_numpy(raw), dtype), _ggml_dequantize(raw, dtype))


@pytest.mark.parametrize("kind", ["real", "random"])
@pytest.mark.parametrize("dtype", TYPES, ids=lambda t: t.label)
def test_matches_gguf_quants(dtype, kind):
    raw = _blocks(dtype, kind)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[dtype.name])
    _same_bits(dequantize(torch.from_numpy(raw), dtype), ref)


@pytest.mark.parametrize("dtype", TYPES, ids=lambda t: t.label)
def test_batched_and_strided(dtype, device):
    raw = torch.from_numpy(_blocks(dtype, "random"))
    rows = dequantize(raw, dtype)
    assert rows.shape == (ROWS, BLOCKS * dtype.block)
    one_by_one = torch.stack([dequantize(r, dtype) for r in raw])
    assert torch.equal(rows.view(torch.int32), one_by_one.view(torch.int32))

    batched = dequantize(raw.to(device).view(3, 2, 2, -1), dtype).cpu()
    assert torch.equal(batched.view(torch.int32), rows.view(3, 2, 2, -1).view(torch.int32))

    every_other = raw[::2]  # row stride twice the row
    assert torch.equal(dequantize(every_other, dtype).view(torch.int32), rows[::2].view(torch.int32))

    odd = torch.zeros(ROWS, raw.shape[1] + 1 + dtype.size, dtype=torch.uint8)  # odd offset and row stride
    odd[:, 1:1 + raw.shape[1]] = raw
    view = odd[:, 1 + dtype.size: 1 + raw.shape[1]]  # blocks 1.. of each row
    assert not view.is_contiguous()
    assert torch.equal(dequantize(view, dtype).view(torch.int32), rows[:, dtype.block:].view(torch.int32))

    assert dequantize(raw[:, :0], dtype).shape == (ROWS, 0)


Q4, Q8 = DType.Q4_K, DType.Q8_0


@pytest.mark.parametrize("dtype, shape, bad", [
    (Q4, (3, Q4.size + 1), f"q4_k bytes must be uint8 [..., n_blocks * {Q4.size}], got torch.uint8 (3, {Q4.size + 1})"),
    (Q8, (Q8.size * 2,), f"q8_0 bytes must be uint8 [..., n_blocks * {Q8.size}], got torch.int8 ({Q8.size * 2},)"),
    (DType.F32, (2, 8), "f32 is not a block type (q8_0, q4_k, q5_k, q6_k); bytes torch.uint8 (2, 8)"),
])
def test_errors(dtype, shape, bad):
    raw = torch.zeros(shape, dtype=torch.uint8)
    if dtype == DType.Q8_0:
        raw = raw.view(torch.int8)
    with pytest.raises(KernelError) as e:
        dequantize(raw, dtype)
    assert str(e.value) == f"dequantize: {bad}"


@pytest.mark.parametrize("dtype", TYPES, ids=lambda t: t.label)
def test_held_rows_move_the_files_bytes_within_each_row(dtype):
    """held_rows (what gdnpass's buffers hold): Q8_0's rows split, element k's quant at byte k and group g's f16
    scale at byte K + 2g; Q6_K's in four planes, block b's ql at 128b, qh at K/2 + 64b, scales at 3K/4 + 16b, d at
    13K/16 + 2b; every byte of the row kept and file_rows undoing it; every other type's rows as they are. Batched,
    on views, and (Q8_0) for a row of 3 blocks (K not a multiple of 256)."""
    raw = torch.from_numpy(_blocks(dtype, "random"))
    held = held_rows(raw, dtype)
    assert held.shape == raw.shape and torch.equal(file_rows(held, dtype), raw)
    assert torch.equal(held.sort(-1).values, raw.sort(-1).values)  # the same bytes, moved within the row
    if dtype not in (DType.Q8_0, DType.Q6_K):
        assert held is raw
        return
    blocks, K = raw.view(ROWS, BLOCKS, dtype.size), BLOCKS * dtype.block
    # (the plane's start in the row, its bytes a block, the field's offset in a block), ggml-common.h's fields
    planes = ([(0, 32, 2), (K, 2, 0)] if dtype is DType.Q8_0 else
              [(0, 128, 0), (K // 2, 64, 128), (3 * K // 4, 16, 192), (13 * K // 16, 2, 208)])
    for g in (0, 1, BLOCKS - 1):
        for start, width, field in planes:
            at = start + width * g
            assert torch.equal(held[:, at:at + width], blocks[:, g, field:field + width]), (g, field)
    assert torch.equal(held_rows(raw.view(3, 2, 2, -1), dtype), held.view(3, 2, 2, -1))
    assert torch.equal(held_rows(raw[::2], dtype), held[::2])
    if dtype is DType.Q8_0:
        three = raw[:, :3 * dtype.size]
        assert torch.equal(file_rows(held_rows(three, dtype), dtype), three)
        assert torch.equal(held_rows(three, dtype)[:, 96:], three.view(ROWS, 3, -1)[:, :, :2].reshape(ROWS, 6))


@pytest.mark.parametrize("dtype", TYPES, ids=lambda t: t.label)
def test_random_blocks_differ_in_every_f16_field(dtype):
    """The synthetic weights' f16 fields (d, and dmin where the type has one) take a value a block, so a kernel that
    read another block's or another group's scale differs from the reference (every block's were once the same, and
    such a kernel passed); their values still about the asked standard deviation."""
    g = torch.Generator().manual_seed(0)
    raw = random_blocks(ROWS, BLOCKS * 256, dtype, g, 0.05)
    blocks = raw.view(ROWS, -1, dtype.size)
    for off in F16_FIELDS[dtype]:
        field = blocks[..., off:off + 2].contiguous().view(torch.float16).flatten()
        assert field.unique().numel() > field.numel() // 2, (dtype.label, off)
    assert 0.02 < float(dequantize(raw, dtype).std()) < 0.1
