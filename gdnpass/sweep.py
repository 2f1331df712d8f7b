"""The exactness sweep: a product-level validation table of conv-chain cases, like ggml's test-backend-ops cases.

It is seed 000's validation of the fused GDN conv chain, re-run here: n_t 1..16 x n_rs_seq {0, 2, 3, 7, 15} x
5 model shapes (400 cases), the gathered conv-state row alternating between one of the rows the chain writes (its
own cell) and one it does not (the other cell); each case must run byte-identical fused and unfused.

Used by tests/test_fusion.py (all 400 on the torch path, a subset through the Triton interpreter, all 400 compiled on
a GPU) and by benchmarks/warm_compile.py (compiles the GPU cases' kernels in parallel ahead of the GPU test).
"""

import itertools

from gdnpass.alloc import plan
from gdnpass.check import check_fusion
from gdnpass.fusion import prepare
from gdnpass.matchers.conv_chain import ConvChain
from gdnpass.models import VerifyConfig, build_verify_graph, default_ids

CHAIN = [ConvChain()]

SWEEP_SHAPES = ["tiny-dc3-h32", "tiny-dc4-h64", "tiny-dc5-h128", "tiny-dc4-h32", "tiny-dc4-h128"]
SWEEP = list(itertools.product(range(1, 17), [0, 2, 3, 7, 15], SWEEP_SHAPES))  # the seed's 400 cases


def sweep_ids(cfg, case):
    """Alternate the read row between one of the written rows (own cell) and an unwritten one (the other cell)."""
    if case % 2 == 0:
        return default_ids(cfg, read_plane=min(1, cfg.n_rs_seq))
    return default_ids(cfg, read_plane=cfg.n_rs_seq, src_cell=1)


def sweep_case_gpu(case: int, hints: bool = True):
    """One sweep case through the compiled kernels (also benchmarks/warm_compile.py): (fused graph, CheckResult)."""
    n_t, n_rs, model = SWEEP[case]
    cfg = VerifyConfig(model, n_t, n_rs, n_layers=1, mem_size=2)
    g = build_verify_graph(cfg)
    prepare(g, enabled=hints, patterns=CHAIN)
    plan(g)
    return g, check_fusion(g, patterns=CHAIN, device="cuda", ids=sweep_ids(cfg, case), seed=case)
