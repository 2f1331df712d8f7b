"""The mat-vec pair (alpha/beta; FFN gate/up): exactness per weight type, scope, the reorder, the candidates. (One
graph per refusal rule: trips.py, run by tests/patterns/test_rules.py.)"""

import pytest
import torch

from gdnpass.alloc import plan
from gdnpass.check import check_fusion
from gdnpass.fusion import fuse, prepare
from gdnpass.ir import Op
from gdnpass.patterns.mat_vec_pair import MatVecPair
from gdnpass.models import VerifyConfig, build_verify_graph, default_ids
from support.graphs import triton_for

PAIR = [MatVecPair()]


def planned(n_t=4, ab_wtype="f32", reorder=True, **kw):
    cfg = VerifyConfig("tiny-dc4-h64", n_t, 3, **{"n_layers": 1, "ab_wtype": ab_wtype, **kw})
    g = build_verify_graph(cfg)
    if reorder:
        prepare(g, enabled=True)
    plan(g)
    return cfg, g


def alpha_beta(g):
    mm = {n.src[0].name.split(".")[-2]: n for n in g.nodes if n.op is Op.MUL_MAT}
    return mm["ssm_alpha"], mm["ssm_beta"]


@pytest.mark.parametrize("wtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("n_t", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17])
def test_pair_is_byte_identical_in_scope(n_t, wtype):
    """alpha/beta (32 rows) pair at 1..16 columns (the mat-vec); at 17 the GEMM's for f16 / bf16 weights, out of
    scope for f32 ones (torch's matmul). (FFN up/gate pair only up to 8.)"""
    cfg, g = planned(n_t, wtype)
    res = check_fusion(g, ids=default_ids(cfg), patterns=PAIR, seed=n_t)
    ab = [a for a in res.report.applied if "ssm_alpha" in a.replaced[0]]
    if n_t <= 16 or wtype != "f32":
        assert len(ab) == 1
        assert res.identical, [c.to_json() for c in res.compared if not c.identical]
        assert {"blk.0.ssm_alpha.weight * attn_norm-0", "blk.0.ssm_beta.weight * attn_norm-0"} <= {
            c.name for c in res.compared}
    else:
        assert not ab and "pair.n-cols" in {r.rule for r in res.report.refused}


def is_alpha_beta(n) -> bool:
    """The alpha/beta products, single or paired: the tiny FFN's and projections' products would add ~900
    interpreter programs a run (the pair kernel's bytes at other shapes and tiles: tests/kernels/test_kernels.py)."""
    return any(w in n.src[0].name for w in ("ssm_alpha", "ssm_beta"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (the GPU run uses device cuda)")
@pytest.mark.parametrize("n_t", [1, 4, 8])  # the thin tiles of 1, 4 and 8 columns
def test_pair_through_triton_interpreter(n_t):
    cfg, g = planned(n_t, "bf16")
    table = triton_for((Op.MUL_MAT, Op.MUL_MAT_VEC_PAIR), where=is_alpha_beta)
    res = check_fusion(g, ids=default_ids(cfg), patterns=PAIR, backend=table)
    assert [a for a in res.report.applied if "ssm_alpha" in a.replaced[0]] and res.identical
    assert {"blk.0.ssm_alpha.weight * attn_norm-0", "blk.0.ssm_beta.weight * attn_norm-0"} <= {
        c.name for c in res.compared}


def test_every_gdn_layer_of_qwen35_9b_pairs_alpha_beta():
    cfg = VerifyConfig("qwen3.5-9b", 8, 7, dflash=True)
    g = build_verify_graph(cfg)
    prepare(g, enabled=True)
    plan(g)
    r = fuse(g, enabled=True, patterns=PAIR)
    ab = [a for a in r.applied if "ssm_alpha" in a.replaced[0] and "ssm_beta" in a.replaced[1]]
    assert len(ab) == 24 and {a.layer for a in ab} == set(cfg.layer_ids())


def test_without_the_reorder_gallocr_gives_beta_alphas_block():
    _, g = planned(reorder=False)
    a, b = alpha_beta(g)
    assert a.offset == b.offset  # alpha dies at its first reader; beta gets the freed block
    r = fuse(g, enabled=True, patterns=PAIR)
    assert "pair.alias" in {x.rule for x in r.refused}


# (the refusal rules, one graph each that trips it alone, and the forced-rewrite proofs: trips.py, run by
# tests/patterns/test_rules.py; the pair's own rule tests: test_mat_vec_pair_rules.py)


def test_candidates_pair_products_of_one_input_first():
    """An attention layer's Q (with its gate) has the FFN gate/up's weight shape in tiny-qwen35: the candidates pair
    gate with up (one input), not Q with gate (which the rules would refuse, leaving up unpaired)."""
    cfg = VerifyConfig("tiny-qwen35", 4, 3, whole=True)
    g = build_verify_graph(cfg)
    il = cfg.shape.attn_layers[0]
    q, gate, up = (next(n for n in g.nodes if n.op is Op.MUL_MAT and n.layer == il and f".{w}." in n.src[0].name)
                   for w in ("attn_q", "ffn_gate", "ffn_up"))
    assert q.src[0].ne == gate.src[0].ne == up.src[0].ne  # the case in question: one group of three
    pairs = MatVecPair().candidates(g)
    assert (gate, up) in pairs and not any(q in p for p in pairs)
    prepare(g, enabled=True)
    plan(g)
    report = fuse(g, enabled=True, patterns=PAIR)
    assert not report.refused, [(r.rule, r.node.name) for r in report.refused]
    assert any(n.op is Op.MUL_MAT_VEC_PAIR and n.layer == il and "ffn_gate" in n.name for n in g.nodes)
