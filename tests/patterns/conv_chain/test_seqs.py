"""The conv chain of a verify ubatch of several sequences (issue 37 item 2), through the real pipeline: the builder's
graph of S sequences x T tokens (``VerifyConfig(n_seqs=S)``, llama.cpp's split_equal ubatch), prepared, planned and
fused by gdnpass.pipeline, then run unfused and fused from the same bytes (``check_fusion``) with the row ids
llama.cpp's ``s_copy`` can hold:

- "own": each sequence gathers plane 0 of its own cell, the row its plane 0 writes;
- "swap": sequence i gathers plane 0 of cell i+1, the row sequence i+1 writes (find_slot's cell swaps);
- "rollback": sequence i gathers plane i+1 (mod K) of cell i+1 (mod S): a rolled-back sequence, reading a plane
  another sequence writes this ubatch.

On the torch references, and on the Triton kernels of the chain's ops (the interpreter here; compiled on a GPU, where
the gpu tests run 128 sequences of 8 tokens). The fused kernel's own tests: test_fused_kernel.py; the rules' trip
graphs: trips.py; llama.cpp's own graphs of 2 and 3 sequences: tests/frontends/llama/test_referee_seqs.py.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from gdnpass.check import check_fusion
from gdnpass.ir import Op
from gdnpass.kernels import triton_ssm
from gdnpass.models import VerifyConfig, default_ids
from gdnpass.patterns.conv_chain import ConvChain
from gdnpass.pipeline import PassOptions, run
from support.graphs import CHAIN, CHAIN_OPS, assert_identical, triton_for

MODES = ("own", "swap", "rollback")
INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (the gpu tests run compiled)")


def row_ids(cfg: VerifyConfig, mode: str) -> list[int]:
    """``s_copy`` of ``cfg``'s S sequences in ``mode`` (see the module's docstring): plane p of cell c is row
    p * cells + c."""
    S, K, cells = cfg.n_seqs, cfg.n_rs_seq + 1, cfg.cells
    if mode == "own":
        return default_ids(cfg)
    plane = (lambda i: 0) if mode == "swap" else (lambda i: (i + 1) % K)
    return [plane(i) * cells + cfg.kv_head + (i + 1) % S for i in range(S)]


def graph(S: int, T: int, n_rs: int, model: str = "tiny-dc4-h64", **kw):
    cfg = VerifyConfig(model, T, n_rs, n_layers=1, n_seqs=S, **kw)
    return cfg, run(cfg, PassOptions(fusion=True), fuse_now=False).graph


def check(S, T, n_rs, mode, backend=None, patterns=CHAIN, device="cpu", **kw):
    cfg, g = graph(S, T, n_rs, **kw)
    res = check_fusion(g, device, backend=backend, ids=row_ids(cfg, mode), patterns=patterns)
    return g, res


# S in {1, 2, 3, 8} x T in {1, 4, 7} x n_rs_seq in {0, 3}, the ids modes in turn
TORCH_CASES = [(S, T, n_rs, MODES[i % 3]) for i, (S, T, n_rs) in
               enumerate(itertools.product((1, 2, 3, 8), (1, 4, 7), (0, 3)))]


@pytest.mark.parametrize("S,T,n_rs,mode", TORCH_CASES, ids=[f"{S}x{T}-rs{r}-{m}" for S, T, r, m in TORCH_CASES])
def test_several_sequences_fuse_byte_identically(S, T, n_rs, mode):
    g, res = check(S, T, n_rs, mode)
    assert_identical(res, compared=["conv_output_silu-0", "cache_r_l0"])
    (node,) = [n for n in g.nodes if n.op is Op.GDN_CONV_CHAIN]
    assert node.ne[2] == S


TRITON_CASES = [(2, 1, 0, "swap"), (2, 4, 3, "rollback"), (3, 4, 3, "swap"), (3, 7, 0, "own"), (3, 1, 3, "rollback"),
                (8, 4, 3, "rollback"), (5, 2, 1, "swap")]


@INTERPRETER
@pytest.mark.parametrize("S,T,n_rs,mode", TRITON_CASES, ids=[f"{S}x{T}-rs{r}-{m}" for S, T, r, m in TRITON_CASES])
def test_several_sequences_fuse_byte_identically_on_triton(S, T, n_rs, mode):
    """The chain's ops on Triton (in the interpreter), unfused and fused; the rest of the graph on torch."""
    _, res = check(S, T, n_rs, mode, backend=triton_for(CHAIN_OPS), qk_norm="l2" if S == 3 else "rms")
    assert_identical(res, compared=["conv_output_silu-0", "cache_r_l0"])


@INTERPRETER
@pytest.mark.parametrize("S,T,n_rs,mode,layout", [(3, 4, 3, "rollback", "rows"), (8, 2, 1, "swap", "rows"),
                                                  (3, 4, 3, "rollback", "dedup-t"), (8, 2, 1, "swap", "dedup")])
def test_a_head_over_several_programs_fuses_byte_identically(monkeypatch, S, T, n_rs, mode, layout):
    """A CONCAT tile budget small enough that each head of 64 channels spans 4..64 programs: the last of a head's
    programs to finish normalises its q and k (the ticket), and the bytes are the unfused graph's; in the dedup
    layouts each program stores its channels' part of the shared rows (the tile; one window: window by window)."""
    monkeypatch.setattr(triton_ssm, "CHAIN_TILE", 64)
    assert triton_ssm.chain_block(S, 64, 4, T) <= 16
    _, res = check(S, T, n_rs, mode, backend=triton_for(CHAIN_OPS), snapshot_layout=layout)
    assert_identical(res, compared=["q_conv_predelta-0", "k_conv_predelta-0",
                                    *(["cache_w_l0"] if layout != "rows" else [])])


@INTERPRETER
def test_wide_products_of_several_sequences_run_the_gemm(monkeypatch):
    """8 sequences of 4 tokens: every bf16 MUL_MAT has 32 columns, over the mat-vec's 16, and runs the Triton GEMM
    (a spy on its launcher: each such product once unfused and once fused), with the chain's ops on Triton: fused vs
    unfused byte for byte, the layer's output among the compared. (The pair and MUL_MAT_ADD refuse 32 columns, so
    the products are the same nodes with every pattern on; the other fused records' Triton kernels are not run
    here: the rest of the graph is torch's, which an unfused Triton RMS_NORM would not match.)"""
    from gdnpass.kernels import triton_matvec
    from gdnpass.kernels.limits import mat_vec_columns, runs_as_gemm

    calls = []
    real = triton_matvec.mul_mat_gemm
    monkeypatch.setattr(triton_matvec, "mul_mat_gemm", lambda *a, **kw: (calls.append(a[1].shape), real(*a, **kw)))
    cfg, g = graph(8, 4, 3)
    wide = [n for n in g.nodes if n.op is Op.MUL_MAT
            and runs_as_gemm(n.src[0].type, n.src[0].ne[2] * n.src[0].ne[3], mat_vec_columns(1, n.src[1].ne))]
    assert len(wide) >= 4  # (qkv, z, ssm_out, the FFN's three)
    res = check_fusion(g, backend=triton_for(CHAIN_OPS + (Op.MUL_MAT,)), ids=row_ids(cfg, "rollback"), patterns=CHAIN)
    assert_identical(res, compared=["conv_output_silu-0", "cache_r_l0", "l_out-0"])
    assert len(calls) == 2 * len(wide) and all(s[0] * s[1] * s[2] == 32 for s in calls)


@pytest.mark.parametrize("layout", ["dedup", "dedup-t"])
@pytest.mark.parametrize("S,T,n_rs,mode", [(2, 4, 3, "swap"), (3, 8, 7, "rollback"), (3, 1, 2, "own")])
def test_several_sequences_in_the_snapshot_layouts(layout, S, T, n_rs, mode):
    """Planes 1..n_rs as windows of each sequence's own cache_w row: one shared row a sequence (rule 5b), written
    once as a tile across the sequences, as for one sequence; on torch, and on Triton for the first case."""
    backend = triton_for(CHAIN_OPS) if (S, T) == (2, 4) and not torch.cuda.is_available() else None
    g, res = check(S, T, n_rs, mode, backend=backend, snapshot_layout=layout)
    assert_identical(res, compared=["cache_w_l0", "cache_r_l0"])
    one, _ = check(1, T, n_rs, "own", snapshot_layout=layout)
    (node,), (alone,) = ([n for n in h.nodes if n.op is Op.GDN_CONV_CHAIN] for h in (g, one))
    assert node.op_params.get("tile") == alone.op_params.get("tile") and (n_rs < 2) == ("tile" not in node.op_params)


class PerWindow(ConvChain):
    """The chain pattern with the dedup tile left out: overlapping windows of a shared row stored window by window,
    d_conv - 1 element stores each (the kernel's per-window path; seed 003's kernel before its change, the baseline
    benchmarks/tune_dedup.py times)."""

    def plan(self, c, ctx):
        return replace(super().plan(c, ctx), tile=None)


@INTERPRETER
@pytest.mark.parametrize("layout", ["dedup", "dedup-t"])
@pytest.mark.parametrize("S,T,n_rs,mode,store", [(3, 4, 3, "rollback", "tile"), (3, 4, 3, "rollback", "per-window"),
                                                 (3, 4, 1, "swap", "tile"), (5, 2, 3, "own", "tile")])
def test_several_sequences_in_the_snapshot_layouts_on_triton(layout, S, T, n_rs, mode, store):
    """The chain's ops on Triton (the interpreter) in the dedup layouts: the tile of a sequence count that is no
    power of two (the tile's masked sequences), the same windows stored window by window (each sequence's windows at
    its own sequence stride), one window (no tile), planes past the tokens (windows at column 0, repeated)."""
    patterns = CHAIN if store == "tile" else [PerWindow()]
    g, res = check(S, T, n_rs, mode, backend=triton_for(CHAIN_OPS), patterns=patterns, snapshot_layout=layout)
    assert_identical(res, compared=["cache_w_l0", "cache_r_l0"])
    (node,) = [n for n in g.nodes if n.op is Op.GDN_CONV_CHAIN]
    assert ("tile" in node.op_params) == (store == "tile" and n_rs >= 2)


def test_a_ubatch_after_other_cells():
    """kv_head 2 of 6 cells: the planes' rows, and the ids, past other sequences' cells."""
    for mode in MODES:
        _, res = check(3, 4, 3, mode, mem_size=6, kv_head=2)
        assert_identical(res, compared=["cache_r_l0"])


def test_every_pattern_fuses_several_sequences_and_the_pass_is_exact():
    """The whole pass (every registered pattern, the torch references) on a 2-layer verify of 3 sequences whose ids
    roll back: the chain and GATED_DELTA_NET writing its snapshots into the cache (gdn_state_cache) fuse in every
    layer, and every compared byte is the unfused run's. (gdn_state_cache on Triton at several sequences:
    tests/patterns/gdn_state_cache.)"""
    cfg = VerifyConfig("tiny-dc4-h64", 4, 3, n_layers=2, n_seqs=3)
    g = run(cfg, PassOptions(fusion=True), fuse_now=False).graph
    res = check_fusion(g, ids=row_ids(cfg, "rollback"))
    applied = [a.pattern for a in res.report.applied]
    assert applied.count("gdn_conv_chain") == 2 and applied.count("gdn_state_cache") == 2
    assert_identical(res, applied=len(applied), compared=["cache_r_l0", "cache_s_l1", "l_out-1"])


# ---- on the GPU: 128 sequences of 8 tokens, compiled ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["swap", "rollback"])
def test_128_sequences_of_8_tokens_gpu(mode):
    """One qwen3.5-9b GDN layer (C = 8192, heads of 128) verifying 128 sequences of 8 tokens with 7 rollback
    planes, every pattern on, the compiled Triton kernels: fused vs unfused byte for byte. The chain runs blocks of
    8 channels for all 128 sequences (a head over 16 programs, their tickets)."""
    cfg = VerifyConfig("qwen3.5-9b", 8, 7, n_layers=1, n_seqs=128, share_weights=True)
    g = run(cfg, PassOptions(fusion=True), fuse_now=False).graph
    res = check_fusion(g, "cuda", ids=row_ids(cfg, mode))
    applied = [a.pattern for a in res.report.applied]
    assert applied.count("gdn_conv_chain") == 1 and applied.count("gdn_state_cache") == 1
    assert_identical(res, applied=len(applied), compared=["conv_output_silu-0", "cache_r_l0", "cache_s_l0"])
    assert triton_ssm.chain_launch(8, 128, n_seqs=128)[0]["BLOCK_C"] == 8


@pytest.mark.gpu
@pytest.mark.parametrize("layout,store", [("dedup", "tile"), ("dedup", "per-window"), ("dedup-t", "tile")])
def test_128_sequences_in_the_snapshot_layouts_gpu(layout, store):
    """The dedup layouts at 128 sequences of 8 tokens (qwen3.5-9b, 7 rollback planes, ids rolled back), compiled:
    the tile and the per-window stores (tune_dedup.py's baseline), fused vs unfused byte for byte."""
    cfg = VerifyConfig("qwen3.5-9b", 8, 7, n_layers=1, n_seqs=128, share_weights=True, ffn=False,
                       snapshot_layout=layout)
    g = run(cfg, PassOptions(fusion=True), fuse_now=False).graph
    res = check_fusion(g, "cuda", ids=row_ids(cfg, "rollback"), patterns=CHAIN if store == "tile" else [PerWindow()])
    assert_identical(res, compared=["conv_output_silu-0", "cache_r_l0", "cache_w_l0"])
    (node,) = [n for n in g.nodes if n.op is Op.GDN_CONV_CHAIN]
    assert ("tile" in node.op_params) == (store == "tile")
