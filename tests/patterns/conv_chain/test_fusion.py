"""The conv-chain fusion: exactness sweep, out-of-scope graphs run unchanged, the 9B DFlash graphs, GDN_FUSION, the
fused graph's validation and serialisation, run --check. (The refusal rules: trips.py, run by
tests/patterns/test_rules.py, and test_conv_chain_rules.py.)"""

import json

import pytest
import torch

from gdnpass import ops
from gdnpass.alloc import plan
from gdnpass.check import check_fusion
from gdnpass.fusion import env_enabled, fuse, prepare
from gdnpass.ir import GraphError, Op
from gdnpass.models import VerifyConfig, build_verify_graph, default_ids
from gdnpass.sweep import SEED_CASES, SWEEP, run_case
from support.graphs import CHAIN, CHAIN_OPS, assert_identical, planned, triton_for


# CI: all 800 on the torch path, planned without the pre-plan hints (so some chains take the l2_separate path);
# both forms through the interpreter on a subset.
@pytest.mark.parametrize("case", range(len(SWEEP)))
def test_sweep_torch_path_is_byte_identical(case):
    assert_identical(run_case(case, hints=False)[1])


TRITON_SUBSET = [0, 37, 81, 122, 163, 204, 246, 287, 329, 371, 399]
TRITON_SUBSET += [len(SEED_CASES) + c for c in TRITON_SUBSET[1::3]]  # the L2 form too


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (on a GPU the gpu sweep covers Triton)")
@pytest.mark.parametrize("case", TRITON_SUBSET)
def test_sweep_triton_interpreter_is_byte_identical(case):
    """The chain's ops on Triton (in the interpreter), unfused and fused; the rest of the graph on torch."""
    assert_identical(run_case(case, hints=case % 2 == 0, backend=triton_for(CHAIN_OPS))[1])


@pytest.mark.gpu
@pytest.mark.parametrize("hints", [True, False], ids=["with-hints", "without-hints"])
def test_sweep_gpu_all_800(hints):
    """All 800 cases (400 per q/k form) through the compiled Triton kernels, planned with the allocator hints (one
    launch per chain) and without them (the q/k outputs may then land on the projection: the later-launch path,
    l2_separate)."""
    separate = 0
    for case in range(len(SWEEP)):
        g, result = run_case(case, hints, device="cuda")
        assert_identical(result)
        separate += any(n.op_params.get("l2_separate") for n in g.nodes)
    assert (separate == 0) if hints else separate > 0
    print(f"\n{len(SWEEP)}/{len(SWEEP)} byte-identical on the GPU ({'with' if hints else 'without'} hints, "
          f"{separate} l2_separate)")


# (one graph per refusal rule that trips it alone and the forced-rewrite proofs: trips.py, run by
# tests/patterns/test_rules.py; the broad/narrow between-checks and the negative controls: test_conv_chain_rules.py)


@pytest.mark.parametrize("cfg_kw,rule", [(dict(n_seqs=129, mem_size=129), "scope.n-seqs"),
                                         (dict(n_tokens=17), "scope.n-tokens")])
def test_129_sequences_and_17_tokens_run_unchanged(cfg_kw, rule):
    cfg = VerifyConfig(**{"model": "tiny-dc4-h64", "n_tokens": 4, "n_rs_seq": 3, "n_layers": 2, **cfg_kw})
    g = build_verify_graph(cfg)
    plan(g)
    nodes = list(g.nodes)
    res = check_fusion(g, patterns=CHAIN, ids=default_ids(cfg))
    assert {r.rule for r in res.report.refused} == {rule} and len(res.report.refused) == 2
    assert g.nodes == nodes and res.identical


@pytest.mark.slow
@pytest.mark.parametrize("n_t,n_rs", [(4, 3), (8, 7)])
def test_qwen35_9b_24_layers_dflash_narrow_fuses_all_and_is_identical(n_t, n_rs):
    """The seed's 9B verify graphs with DFlash taps: every chain (and alpha/beta pair) fuses, bytes identical.

    (Weights are shared between layers to fit the CPU machine: that changes no node, no plan and no byte of the
    comparison, only the size of the weights buffer.)"""
    cfg = VerifyConfig("qwen3.5-9b", n_t, n_rs, dflash=True, share_weights=True)
    graphs = []
    for _ in range(2):
        g = build_verify_graph(cfg)
        prepare(g, enabled=True)
        plan(g)
        graphs.append(g)
    broad = fuse(graphs[1], enabled=True, patterns=CHAIN, between="broad")
    res = check_fusion(graphs[0], ids=default_ids(cfg))
    chains = [a for a in res.report.applied if a.pattern == "gdn_conv_chain"]
    pairs = [a for a in res.report.applied if a.pattern == "mul_mat_vec_pair" and "ssm_alpha" in a.replaced[0]]
    assert len(chains) == 24 and len(pairs) == 24
    bad = [c.to_json() for c in res.compared if not c.identical]
    assert not bad and len(res.compared) > 24 * 4
    print(f"\nqwen3.5-9b n_t={n_t} n_rs={n_rs} dflash: narrow applied 24/24; broad refused {len(broad.refused)}/24")


def test_gdn_fusion_env(monkeypatch):
    _, g = planned()
    n = len(g.nodes)
    monkeypatch.delenv("GDN_FUSION", raising=False)
    assert not fuse(g).enabled and len(g.nodes) == n
    monkeypatch.setenv("GDN_FUSION", "0")
    assert not fuse(g).enabled and len(g.nodes) == n
    monkeypatch.setenv("GDN_FUSION", "1")
    assert env_enabled()
    assert not fuse(g, enabled=False).enabled and len(g.nodes) == n  # the argument wins
    r = fuse(g)
    # one layer, unprepared: its conv chain, its GDN's snapshot CPY and its state's GET_ROWS, the FFN's gate/up pair
    # (alpha/beta alias in this plan, which keeps the GDN's gates out too), the FFN's down projection + residual
    # (ssm_out's residual lands on its x in this plan), its 3 RMS norms, its gate and output gate (elementwise chains),
    # the output gate's chain then run by the z product's store (mul_mat_chain); the FFN's SwiGLU keeps its launch
    # (pair-glu.tile: this FFN's tile does not split K)
    assert r.enabled and sorted(a.pattern for a in r.applied) == ["elementwise_chain"] * 2 + [
        "gdn_conv_chain", "gdn_state_cache", "gdn_state_gather", "mul_mat_add", "mul_mat_chain",
        "mul_mat_vec_pair"] + ["rms_norm_mul"] * 3
    assert len(g.nodes) < n
    monkeypatch.setenv("GDN_FUSION", "yes")
    with pytest.raises(GraphError, match="GDN_FUSION must be 0 or 1"):
        fuse(g)


def test_fused_graph_validates_and_serializes():
    from gdnpass import serialize

    _, g = planned(n_t=8, n_rs=7)
    fuse(g, enabled=True, patterns=CHAIN)
    ops.validate(g)
    (f,) = [n for n in g.nodes if n.op is Op.GDN_CONV_CHAIN]
    assert f.op_params["columns"] == [max(0, 8 - s) for s in range(7, -1, -1)]
    g2 = serialize.loads(serialize.dumps(g))
    ops.validate(g2)
    assert [n.op for n in g2.nodes] == [n.op for n in g.nodes]


def test_run_check_cli_reports_identical_and_exit_codes(capsys, monkeypatch):
    from gdnpass import check, cli

    args = ["run", "--model", "tiny-dc4-h64", "--tokens", "4", "--rs-seq", "3", "--layers", "1", "--check"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "identical  conv_output_silu-0" in out and "identical  cache_r_l0" in out and " 0 differing" in out
    assert cli.main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["identical"] is True and {t["tensor"] for t in doc["tensors"]} >= {"q_conv_predelta-0", "l_out-0"}

    real = check.check_fusion

    def corrupted(graph, **kw):  # the fused run differs in one byte of the SiLU output: exit 1, first byte named
        res = real(graph, **kw)
        silu = next(c for c in res.compared if c.name == "conv_output_silu-0")
        silu.identical, silu.first_diff, silu.values = False, 12, (1.0, 1.5)
        return res

    monkeypatch.setattr(check, "check_fusion", corrupted)
    assert cli.main(args) == 1
    assert "DIFFERS    conv_output_silu-0: first differing byte 12" in capsys.readouterr().out
    assert cli.main(args + ["--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    bad = [t for t in doc["tensors"] if not t["identical"]]
    assert doc["identical"] is False and bad == [{"tensor": "conv_output_silu-0", "identical": False,
                                                  "bytes": bad[0]["bytes"], "first_differing_byte": 12,
                                                  "unfused": 1.0, "fused": 1.5}]
