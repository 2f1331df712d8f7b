"""The mat-vec pair's own rule tests, beside the generic ones every registered pattern runs (tests/patterns/
test_rules.py, on this folder's trips.py)."""

from __future__ import annotations

from gdnpass.alloc import plan
from gdnpass.fusion import fuse
from gdnpass.models import VerifyConfig, build_verify_graph
from gdnpass.patterns.mat_vec_pair import MatVecPair


def test_pair_different_src1_is_reported_for_same_shaped_weights():
    # z and ssm_out have the same weight shape in qwen3.5-9b ([4096, 4096]) but read different inputs
    g = build_verify_graph(VerifyConfig("qwen3.5-9b", 4, 3, n_layers=1))
    plan(g)
    r = fuse(g, enabled=True, patterns=[MatVecPair()])
    assert "pair.different-src1" in {x.rule for x in r.refused}
