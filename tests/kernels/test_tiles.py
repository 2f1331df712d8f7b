"""The tile table (gdnpass/kernels/tiles.py) against the promises the kernels and the matchers build on: a pair's (or
MUL_MAT_ID's batched) launch sums as its single product does, so a tile's bytes may not depend on how many products
share the launch; every split is a power of two the launcher accepts and no more slices than K has steps; and the
shapes pair_glu's tests and documents rely on split K where they say (the pattern asks the tile: pair-glu.tile).
That tiles.py stays pure Python is tests/test_structure.py's (the matcher imports it at fuse time)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdnpass.bench.matvec import product_shapes
from gdnpass.ir import DType
from gdnpass.kernels.tiles import GEMM_MAX_SPLIT, GEMM_MIN_STEPS, gemm_tile, mat_vec_tile
from gdnpass.models.hparams import get_model
from support.surgery import BASE, SPLIT_FFN

TYPES = ("f32", "f16", "bf16", *(t.label for t in DType if t.is_quantized))
MODELS = ("qwen3.5-9b", "qwen3.5-27b", "qwen3.5-4b", "qwen3.5-35b-a3b", SPLIT_FFN)


def _byte_fields(t):
    """What the sum's bytes may depend on: everything but the speed-only register cap (MatVecTile.regs)."""
    return t._replace(regs=0)


def _check(M: int, N: int, K: int, wtype: str) -> None:
    single = mat_vec_tile(M, N, K, wtype)
    for products in (2, 8, 64):
        assert _byte_fields(mat_vec_tile(M, N, K, wtype, products)) == _byte_fields(single), (M, N, K, wtype, products)
    s = single.split_k
    assert s >= 1 and s & (s - 1) == 0, single
    assert (s - 1) * single.block_k < K, single  # no slice without a K step
    assert single.cols >= N and single.cols & (single.cols - 1) == 0, single


@pytest.mark.parametrize("model", MODELS)
def test_the_models_tiles_do_not_depend_on_the_launchs_products(model):
    shapes = {(p.M, p.K) for p in product_shapes(model)}
    assert shapes
    for (M, K) in shapes:
        for wtype in TYPES:
            if DType.parse(wtype).is_quantized and K % DType.parse(wtype).block:
                continue  # (a block type's K is whole blocks)
            for N in range(1, 17):
                _check(M, N, K, wtype)


@settings(max_examples=300, deadline=None)
@given(M=st.integers(1, 300_000), N=st.integers(1, 16), K=st.integers(1, 40_000),
       wtype=st.sampled_from(("f32", "f16", "bf16")))
def test_any_plain_shape_keeps_the_promises(M, N, K, wtype):
    _check(M, N, K, wtype)


@settings(max_examples=200, deadline=None)
@given(M=st.integers(1, 300_000), N=st.integers(1, 16), blocks=st.integers(1, 80),
       wtype=st.sampled_from([t.label for t in DType if t.is_quantized]))
def test_any_quantized_shape_keeps_the_promises(M, N, blocks, wtype):
    _check(M, N, 256 * blocks, wtype)


@settings(max_examples=200, deadline=None)
@given(M=st.integers(1, 300_000), N=st.integers(17, 4096), K=st.integers(1, 40_000),
       wtype=st.sampled_from(("f16", "bf16")))
def test_the_gemm_splits_k_in_few_slices_of_several_steps(M, N, K, wtype):
    t = gemm_tile(M, N, K, wtype)
    s = t.split_k
    assert s & (s - 1) == 0 and 1 <= s <= GEMM_MAX_SPLIT, t
    assert s == 1 or K // (t.block_k * s) >= GEMM_MIN_STEPS, t


def _ffn_splits(model: str, cols: int, wtype: str = "bf16") -> bool:
    m = get_model(model)
    return mat_vec_tile(m.n_ff, cols, m.n_embd, wtype, products=2).split_k > 1


def test_the_ffn_pairs_split_where_pair_glu_relies_on_it():
    """pair_glu's trip graphs and example (SPLIT_FFN at 8 columns) need a pair that splits, its "unsplit" trip (BASE's
    model) one that does not; docs/patterns.md says the 9B's bf16 pair fuses its GLU at 5-8 columns."""
    assert _ffn_splits(SPLIT_FFN, 8) and not _ffn_splits(BASE["model"], 8)
    assert [c for c in range(1, 17) if _ffn_splits("qwen3.5-9b", c)] == [5, 6, 7, 8]


def test_q8_0_tiles_fill_one_wave_of_its_split_rows():
    """Q8_0's split rows (quants.held_rows) in 64-row blocks of 2 pipeline stages, K split into the most slices whose
    programs fit one wave of Q8_0_WAVE, no register cap: the tiles the H100 probe timed best at the 9B's shapes
    (docs/performance.md, seventeenth session: 12288 rows split 2, 4096 rows split 8, the lm head unsplit); the thin
    alpha / beta products one 32-row block at 8 columns."""
    from gdnpass.kernels.tiles import Q8_0_THIN_ROWS, Q8_0_WAVE

    want = {(12288, 4096): 2, (4096, 12288): 8, (4096, 4096): 8, (248320, 4096): 1}
    for (M, K), split in want.items():
        t = mat_vec_tile(M, 4, K, "q8_0")
        assert (t.block_m, t.stages, t.split_k, t.regs) == (64, 2, split, 0), (M, K, t)
        assert split == 1 or -(-M // 64) * split <= Q8_0_WAVE < -(-M // 64) * split * 2, (M, K, t)
    thin = mat_vec_tile(32, 4, 4096, "q8_0")
    assert (thin.block_m, thin.cols) == (Q8_0_THIN_ROWS, 8), thin
