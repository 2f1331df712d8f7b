"""GATED_DELTA_NET_CACHE beyond its rule tests (tests/patterns/test_rules.py): the fused graph byte-identical to the
unfused one at the shapes a verify takes (one token without rollback: a 2-D destination; fewer tokens than slots;
as many; several sequences), on the torch references and on the Triton kernels; what the fused node is."""

import pytest

from gdnpass import pipeline
from gdnpass.check import check_fusion
from gdnpass.ir import Op
from gdnpass.kernels.backends import programs
from gdnpass.models import VerifyConfig
from gdnpass.patterns.gdn_state_cache import GdnStateCache
from support.graphs import triton_for

CASES = [(1, 0), (2, 5), (4, 3)]  # (tokens, n_rs_seq): K = n_rs_seq + 1 slots, min(tokens, K) written


def _graph(n_t: int, rs: int, n_seqs: int = 1):
    cfg = VerifyConfig("tiny-dc4-h32", n_t, rs, n_layers=2, ffn=False, n_seqs=n_seqs)
    return pipeline.run(cfg, pipeline.PassOptions(fusion=True), fuse_now=False).graph


@pytest.mark.parametrize("n_t,rs", CASES, ids=[f"T{t}-rs{r}" for t, r in CASES])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_fused_graph_is_byte_identical(n_t, rs, kernels, device):
    g = _graph(n_t, rs)
    table = None if kernels == "torch" else triton_for((Op.GATED_DELTA_NET, Op.GATED_DELTA_NET_CACHE))
    res = check_fusion(g, device=device, backend=table or "torch", patterns=[GdnStateCache()])
    assert [a.pattern for a in res.report.applied] == ["gdn_state_cache"] * 2, res.report.summary()
    assert res.identical, [c for c in res.compared if not c.identical]
    names = {c.name for c in res.compared}
    assert {"gdn_out-0", "gdn_out-1", "cache_s_l0", "cache_s_l1"} <= names  # the scores and the cache rows


@pytest.mark.parametrize("S,ids", [(2, [1, 0]), (3, [5, 0, 7])], ids=["2-swap", "3-rollback"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_several_sequences_are_byte_identical(S, ids, kernels, device):
    """A verify of S sequences (issue 37): the destination holds a state row per sequence and slot, and each
    sequence's states land in its own rows, whichever rows the ids gathered (sequences swapped; 3: rolled back to
    planes 1 and 2 of other cells). The GDN reads the gathered state (the ssm GET_ROWS's copy in the arena), never
    the cache, so no ids can alias what the fused node writes: the pattern takes several sequences as it is."""
    g = _graph(4, 3, S)
    table = None if kernels == "torch" else triton_for((Op.GATED_DELTA_NET, Op.GATED_DELTA_NET_CACHE))
    res = check_fusion(g, device=device, backend=table or "torch", ids=ids, patterns=[GdnStateCache()])
    assert [a.pattern for a in res.report.applied] == ["gdn_state_cache"] * 2, res.report.summary()
    assert res.identical, [c for c in res.compared if not c.identical]
    assert {"gdn_out-1", "cache_s_l0", "cache_s_l1"} <= {c.name for c in res.compared}


def test_the_fused_node_is_a_view_of_the_scores_writing_the_cache_rows():
    g = _graph(4, 3)
    gdn = next(n for n in g.nodes if n.op is Op.GATED_DELTA_NET)
    want = programs(gdn)
    from gdnpass.fusion import fuse

    fuse(g, enabled=True, patterns=[GdnStateCache()])
    (n, _) = [x for x in g.nodes if x.op is Op.GATED_DELTA_NET_CACHE]
    S, H_v, n_t, n_s = n.src[2].ne
    assert n.view_src is gdn and n.ne == (S * H_v, n_t * n_s, 1, 1) and n.nbytes < gdn.nbytes
    (cpy,) = n.outs
    assert cpy.op is Op.CPY and cpy.base.buffer == "cache" and cpy.ne == (S * S * H_v, n_s, 4, 1)
    assert programs(n) == want  # GATED_DELTA_NET's own kernel and grid
    assert not any(x.op is Op.CPY and x.src[0].view_src is gdn for x in g.nodes)
