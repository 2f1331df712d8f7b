"""The exactness sweep: a product-level validation table of conv-chain cases, like ggml's test-backend-ops cases.

It is seed 000's validation of the fused GDN conv chain, re-run here in both q/k forms: n_t 1..16 x n_rs_seq
{0, 2, 3, 7, 15} x 5 model shapes (the seed's 400 cases) x {upstream's RMS_NORM + SCALE, the fork's L2_NORM}, the
gathered conv-state row alternating between one of the rows the chain writes (its own cell) and one it does not
(the other cell); each case must run byte-identical fused and unfused.

Used by tests/patterns/conv_chain/test_fusion.py (the torch path and a subset through the Triton interpreter in CI,
all 800 compiled on a GPU) and by benchmarks/warm_compile.py (compiles the GPU cases' kernels in parallel ahead of
the GPU test).
"""

import itertools

from gdnpass import pipeline
from gdnpass.check import CheckResult, check_fusion
from gdnpass.ir import Graph
from gdnpass.patterns.conv_chain import ConvChain
from gdnpass.models import QK_NORMS, VerifyConfig, default_ids

CHAIN = [ConvChain()]

SWEEP_SHAPES = ["tiny-dc3-h32", "tiny-dc4-h64", "tiny-dc5-h128", "tiny-dc4-h32", "tiny-dc4-h128"]
SEED_CASES = list(itertools.product(range(1, 17), [0, 2, 3, 7, 15], SWEEP_SHAPES))  # the seed's 400 cases
SWEEP = [(*c, form) for form in QK_NORMS for c in SEED_CASES]                    # ... in both q/k forms: 800


def config(case: int) -> VerifyConfig:
    n_t, n_rs, model, form = SWEEP[case]
    return VerifyConfig(model, n_t, n_rs, n_layers=1, mem_size=2, qk_norm=form)


def sweep_ids(cfg: VerifyConfig, case: int) -> list[int]:
    """Alternate the read row between one of the written rows (own cell) and an unwritten one (the other cell)."""
    if case % 2 == 0:
        return default_ids(cfg, read_plane=min(1, cfg.n_rs_seq))
    return default_ids(cfg, read_plane=cfg.n_rs_seq, src_cell=1)


def run_case(case: int, hints: bool = True, device: str = "cpu", backend: str | None = None) -> tuple[Graph, CheckResult]:
    """One sweep case through the pipeline (planned with or without the pre-plan hints), then unfused vs fused:
    (the fused graph, the CheckResult)."""
    cfg = config(case)
    g = pipeline.run(cfg, pipeline.PassOptions(fusion=True, hints=hints), fuse_now=False).graph
    return g, check_fusion(g, patterns=CHAIN, device=device, backend=backend, ids=sweep_ids(cfg, case), seed=case)
