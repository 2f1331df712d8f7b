"""The conv-chain fusion: exactness sweep, one test per refusal rule, the 9B DFlash graphs, a negative control."""

import json

import pytest
import torch

from gdnpass import ops
from gdnpass.alloc import plan
from gdnpass.check import check_fusion, watched
from gdnpass.fusion import env_enabled, fuse, prepare
from gdnpass.ir import DType, Flag, GraphError, Op
from gdnpass.models import ModelShape, VerifyConfig, build_verify_graph, default_ids
from gdnpass.runtime import Executor
from gdnpass.sweep import SWEEP, sweep_case_gpu, sweep_ids
from support.graphs import CHAIN, assert_identical, planned


@pytest.mark.parametrize("case", range(len(SWEEP)))
def test_sweep_torch_path_is_byte_identical(case):
    n_t, n_rs, model = SWEEP[case]
    cfg, g = planned(model, n_t, n_rs)
    assert_identical(check_fusion(g, patterns=CHAIN, ids=sweep_ids(cfg, case), seed=case))


TRITON_SUBSET = [0, 37, 81, 122, 163, 204, 246, 287, 329, 371, 399]


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (on a GPU the gpu sweep covers Triton)")
@pytest.mark.parametrize("case", TRITON_SUBSET)
def test_sweep_triton_interpreter_is_byte_identical(case):
    n_t, n_rs, model = SWEEP[case]
    cfg, g = planned(model, n_t, n_rs)
    assert_identical(check_fusion(g, patterns=CHAIN, backend="triton", ids=sweep_ids(cfg, case), seed=case))


@pytest.mark.gpu
@pytest.mark.parametrize("hints", [True, False], ids=["with-hints", "without-hints"])
def test_sweep_gpu_all_400(hints):
    """All 400 cases through the compiled Triton kernels, planned with the allocator hints (one launch per chain) and
    without them (the L2 outputs may then land on the projection: the second-launch path, l2_separate)."""
    separate = 0
    for case in range(len(SWEEP)):
        g, result = sweep_case_gpu(case, hints)
        assert_identical(result)
        separate += any(n.op_params.get("l2_separate") for n in g.nodes)
    assert (separate == 0) if hints else separate > 0
    print(f"\n400/400 byte-identical on the GPU ({'with' if hints else 'without'} hints, {separate} l2_separate)")


# ---------------------------------------------------------------------------------------------------------------------
# graph surgery for the rule tests: every mutation breaks exactly one rule of an otherwise fusable chain
# ---------------------------------------------------------------------------------------------------------------------


def chain(g):
    n = {t.name: t for t in g.nodes}
    concat = n["conv_input-0"]
    windows = [w for w in g.nodes if w.op is Op.VIEW and w.view_src is concat]
    cpys = [c for c in g.nodes if c.op is Op.CPY and c.src[0] in windows]
    return dict(concat=concat, gr=n["conv_states-0"], conv=n["conv_output_raw-0"], silu=n["conv_output_silu-0"],
                q=n["q_conv-0"], k=n["k_conv-0"], q_l2=n["q_conv_predelta-0"], k_l2=n["k_conv_predelta-0"],
                cpys=cpys, dsts=[c.src[1] for c in cpys], windows=windows, ids=n["inp_s_copy_main"],
                proj=n["linear_attn_qkv_mixed-0"].base, weight=n["conv_output_raw-0"].src[1],
                cache=concat.src[0].src[0].src[0].base, attn_norm=n["attn_norm-0"])


def insert_after(g, anchor, node, offset=None):
    """Put ``node`` right after ``anchor``; give it arena bytes at ``offset`` (default: past the arena's end)."""
    if node.view_src is None:
        node.buffer = "arena"
        node.offset = g.buffers["arena"] if offset is None else offset
        g.buffers["arena"] = max(g.buffers["arena"], node.offset + node.nbytes)
    g.nodes.insert(g.index(anchor) + 1, node)
    node.flags |= Flag.COMPUTE
    return node


def arena_tensor(name, nbytes):
    return ops.new_tensor(name, DType.F32, (nbytes // 4,), buffer="arena")


def m_extra_row(g, c):  # a 17th snapshot row
    w = ops.view_3d(c["concat"], *c["windows"][0].ne[:3], c["concat"].nb[1], c["concat"].nb[2], 0)
    cache = c["cache"]
    dst = ops.view_2d(cache, cache.ne[0], 1, cache.nb[1], cache.nb[1] * 1)  # row 1: cell 1, never a snapshot here
    cp = ops.cpy(w, dst)
    last = c["cpys"][-1]
    for t in (cp, dst, w):
        insert_after(g, last, t)


def m_concat_user(g, c):
    insert_after(g, c["concat"], ops.cont(c["concat"]))


def m_gr_user(g, c):
    insert_after(g, c["gr"], ops.cont(c["gr"]))


def m_conv_user(g, c):
    insert_after(g, c["conv"], ops.exp(c["conv"]))


def m_window_column(g, c):
    w = c["windows"][0]
    w.view_offs = 4 * (c["concat"].ne[0] - 2)  # past column n_t


def m_half_row(g, c):
    c["dsts"][0].view_offs += 4


def m_row_twice(g, c):
    c["dsts"][1].view_offs = c["dsts"][0].view_offs


def m_k_geometry(g, c):
    c["k"].view_offs += 4


def m_silu_across_channels(g, c):  # SiLU on the projection, but one element off: other programs' channels
    c["silu"].offset = c["conv"].offset = c["proj"].offset + 4


def m_cache_type(g, c):
    c["cache"].type = DType.F16


def m_write_row_between(g, c):
    insert_after(g, c["concat"], ops.scale(c["dsts"][0], 1.0, inplace=True))


def m_write_ids_between(g, c):
    src = ops.new_tensor("other_ids", DType.I32, (1,), buffer="input")
    src.offset = 4096
    insert_after(g, c["gr"], ops.cpy(src, c["ids"]))


def m_write_weight_between(g, c):
    insert_after(g, c["concat"], ops.scale(c["weight"], 1.0, inplace=True))


def m_write_silu_between(g, c):
    insert_after(g, c["concat"], ops.exp(c["attn_norm"]), offset=c["silu"].offset)


def m_read_silu_between(g, c):
    t = arena_tensor("stale", 256)
    t.offset = c["silu"].offset
    insert_after(g, c["concat"], ops.exp(t))


def m_read_row_between(g, c):
    insert_after(g, c["concat"], ops.cont(c["dsts"][0]))


RULES = [
    ("scope.n-rows", dict(n_rs=15), m_extra_row),
    ("scope.type", {}, m_cache_type),
    ("cpy-run.view-of-concat", {}, m_window_column),
    ("cpy-run.whole-row", {}, m_half_row),
    ("cpy-run.row-written-twice", {}, m_row_twice),
    ("concat.user-count", {}, m_concat_user),
    ("get-rows.user-count", {}, m_gr_user),
    ("ssm-conv.user-count", {}, m_conv_user),
    ("l2.head-geometry", {}, m_k_geometry),
    ("alias.output-overlaps-input", {}, m_silu_across_channels),
    ("between.writes-cache", {}, m_write_row_between),
    ("between.writes-ids", {}, m_write_ids_between),
    ("between.writes-weights", {}, m_write_weight_between),
    ("between.writes-early-output", {}, m_write_silu_between),
    ("between.reads-early-output", {}, m_read_silu_between),
    ("between.reads-cache", {}, m_read_row_between),
]


@pytest.mark.parametrize("rule,kw,mutate", RULES, ids=[r[0] for r in RULES])
def test_each_rule_refuses_what_breaks_it(rule, kw, mutate):
    _, g = planned(**kw)
    assert len(fuse(build_and_plan(**kw), enabled=True, patterns=CHAIN).applied) == 1  # the unmutated chain fuses
    mutate(g, chain(g))
    before = list(g.nodes)
    report = fuse(g, enabled=True, patterns=CHAIN)
    assert [r.rule for r in report.refused] == [rule], [r.describe() for r in report.refused]
    assert not report.applied and g.nodes == before  # a refusal leaves the graph unchanged
    r = report.refused[0]
    assert r.pattern == "gdn_conv_chain" and r.reason and r.node is not None
    if rule.startswith(("between.", "alias.")):
        assert r.ranges is not None  # aliasing refusals name the two colliding byte ranges


def build_and_plan(**kw):
    return planned(**kw)[1]


@pytest.mark.parametrize("model,n_t,n_rs,rule", [
    ("tiny-dc4-h64", 17, 3, "scope.n-tokens"),
    (ModelShape("tiny-dc6", n_embd=64, n_layer=2, n_k_heads=1, n_v_heads=2, head_dim=32, d_conv=6), 4, 3,
     "scope.d-conv"),
])
def test_scope_rules(model, n_t, n_rs, rule):
    _, g = planned(model, n_t, n_rs)
    report = fuse(g, enabled=True, patterns=CHAIN)
    assert [r.rule for r in report.refused] == [rule]


@pytest.mark.parametrize("cfg_kw,rule", [(dict(n_seqs=2, mem_size=2), "scope.n-seqs"), (dict(n_tokens=17), "scope.n-tokens")])
def test_multi_sequence_and_17_tokens_run_unchanged(cfg_kw, rule):
    cfg = VerifyConfig(**{"model": "tiny-dc4-h64", "n_tokens": 4, "n_rs_seq": 3, "n_layers": 2, **cfg_kw})
    g = build_verify_graph(cfg)
    plan(g)
    nodes = list(g.nodes)
    res = check_fusion(g, patterns=CHAIN, ids=default_ids(cfg))
    assert {r.rule for r in res.report.refused} == {rule} and len(res.report.refused) == 2
    assert g.nodes == nodes and res.identical


def test_broad_check_refuses_what_narrow_proves_safe():
    """A node in between that writes the dead projection block: broad refuses, narrow fuses, bytes identical."""
    cfg, g = planned(n_t=4, n_rs=3)
    c = chain(g)
    early = [(t.offset, t.offset + t.nbytes) for t in (c["silu"], c["q_l2"], c["k_l2"])]
    proj = c["proj"]
    free = [o for o in range(proj.offset, proj.offset + proj.nbytes - 255, 256)
            if all(o + 256 <= lo or o >= hi for lo, hi in early)]
    assert free, "the projection block is entirely reused by early outputs in this plan"
    scratch = ops.cont(ops.view_1d(c["attn_norm"], 64, 0))
    insert_after(g, c["cpys"][-1], scratch, offset=free[0])
    g_broad = build_verify_graph(cfg)
    plan(g_broad)
    cb = chain(g_broad)
    insert_after(g_broad, cb["cpys"][-1], ops.cont(ops.view_1d(cb["attn_norm"], 64, 0)), offset=free[0])
    broad = fuse(g_broad, enabled=True, patterns=CHAIN, between="broad")
    assert [r.rule for r in broad.refused] == ["between.touches-chain-buffer"]
    res = check_fusion(g, patterns=CHAIN, ids=default_ids(cfg))
    assert_identical(res)


def run_unfused(graph, ids, seed):
    ex = Executor(graph)
    ex.fill(seed=seed, ids=ids)
    return ex.run(probes=watched(graph))


def test_negative_control_forced_fusion_corrupts_bytes():
    """Force the rewrite past a between-rule: the executor's output really differs, so the tests can see hazards."""
    cfg, g = planned(n_t=4, n_rs=3)
    c = chain(g)
    insert_after(g, c["concat"], ops.exp(c["attn_norm"]), offset=c["silu"].offset)  # scribbles on the SiLU block
    ids = default_ids(cfg)
    # control of the control: unfused, the scribble is harmless (SILU overwrites it later)
    _, clean = planned(n_t=4, n_rs=3)
    want, got = run_unfused(clean, ids, 5), run_unfused(g, ids, 5)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    res = check_fusion(g, patterns=CHAIN, ids=ids, seed=5, force=True)
    assert [r.rule for r in res.report.refused] == ["between.writes-early-output"]
    assert len(res.report.applied) == 1  # forced through
    differing = {x.name for x in res.compared if not x.identical}
    assert {"conv_output_silu-0", "l_out-0"} <= differing


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
    assert r.enabled and len(r.applied) == 1 and len(g.nodes) < n
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
