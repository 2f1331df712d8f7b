"""The pattern registry (gdnpass.patterns): every registered pattern has every part, each part answers on a graph the
pattern fuses, and what reads the registry (the pass, the IR's fused ops, the loader, the backends, the cost
estimate, run --check) finds each one there. Also the shared matcher vocabulary: the generic confinement rule, the
between-rule over a declared span, ``prepare`` through ``capture``, the one use index, the head-size scope."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from gdnpass import cli, fusion, ir, ops, serialize
from gdnpass.alloc import check_plan
from gdnpass.check import check_fusion, watched
from gdnpass.fusion import fuse
from gdnpass.ir import FUSED_OPS, Graph, GraphError, Op, Uses, buffer_role
from gdnpass.kernels import backends
from gdnpass.models import ModelShape, VerifyConfig
from gdnpass.patterns import REGISTRY, RECORDS, by_name, interpreter_s, record_of
from gdnpass.patterns.common import Context, confined
from gdnpass.patterns.conv_chain import ChainCapture, ConvChain
from gdnpass.pipeline import PassOptions, run

NAMES = [p.name for p in REGISTRY]


# ---- every part, and the registry's readers ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_every_registered_pattern_has_every_part(name):
    assert by_name(name).missing() == []


@pytest.mark.parametrize("broken, says", [
    (lambda p: dataclasses.replace(p, record=dataclasses.replace(p.record, watch=None)), "the record has no watch"),
    (lambda p: dataclasses.replace(p, record=dataclasses.replace(p.record, programs=None)),
     "the record has no programs"),
    (lambda p: dataclasses.replace(p, record=dataclasses.replace(p.record, scope=None)), "the record has no scope"),
    (lambda p: dataclasses.replace(p, record=None), "no record"),
    (lambda p: dataclasses.replace(p, rule_doc="A pattern without its rules."),
     "rule block: no 'Legality rules' block"),
    (lambda p: dataclasses.replace(p, rule_doc=p.rule_doc.replace("[pair.flags] ", "")),
     "rule block: in code, not in the docstring: pair.flags"),
    (lambda p: dataclasses.replace(p, capture=object), "the capture is not a patterns.common.Capture"),
    (lambda p: dataclasses.replace(p, kernel="mul_mat_vec_pair"), "kernel 'mul_mat_vec_pair' is not a dotted name"),
    (lambda p: dataclasses.replace(p, example={}), "no example graph"),
    (lambda p: dataclasses.replace(p, name="pair"), "the matcher's name is 'mul_mat_vec_pair', not 'pair'"),
], ids=["watch", "programs", "scope", "record", "rule-block", "rule-dropped", "capture", "kernel", "example",
        "name"])
def test_a_pattern_lacking_a_part_is_caught(broken, says):
    """Negative control: each part taken away from a real entry is named."""
    problems = broken(by_name("mul_mat_vec_pair")).missing()
    assert any(p.startswith(says) for p in problems), problems


def test_the_registry_is_what_everything_reads():
    assert [type(p).__name__ for p in fusion.PATTERNS] == [p.matcher.__name__ for p in REGISTRY]  # the pass order
    assert set(RECORDS) == FUSED_OPS == {p.record.op for p in REGISTRY}                        # the fused op list
    for p in REGISTRY:
        op = p.record.op
        assert Op(op.value) is op and Op[op.value] is op and getattr(Op, op.value) is op and op.is_fused
        assert record_of(op) is p.record
        assert backends.TORCH_BACKEND[op] is p.record.torch and backends.TRITON_BACKEND[op] is p.record.triton
    with pytest.raises(GraphError, match="not a fused op"):
        record_of(Op.MUL_MAT)
    order = [p.name for p in REGISTRY]  # a pattern taking another's fused nodes runs after it
    assert all(order.index(n) < order.index(p.name) for p in REGISTRY for n in p.needs)


def test_fused_op_names_are_added_once_and_never_over_a_base_op():
    assert ir.fused_op("GDN_CONV_CHAIN") is Op.GDN_CONV_CHAIN
    with pytest.raises(GraphError, match="is a base op"):
        ir.fused_op("MUL_MAT")
    with pytest.raises(GraphError, match="upper-case identifier"):
        ir.fused_op("rms-norm")


def _example(p, **kw):
    """The pattern's example graph, prepared and planned by the pipeline (fused by the patterns whose nodes it takes,
    ``Pattern.needs``), then fused by that pattern alone: (node list before it, graph, report)."""
    g = run(VerifyConfig(**{**p.example, **kw}), PassOptions(fusion=True), fuse_now=False).graph
    fuse(g, enabled=True, patterns=[by_name(n).matcher() for n in p.needs])
    before = list(g.nodes)
    return before, g, fuse(g, enabled=True, patterns=[p.matcher()])


@pytest.mark.parametrize("name", NAMES)
def test_every_part_answers_on_the_example(name):
    """On a graph it fuses: the loader's checks, launches, the interpreter's cost (every kernel it names has a
    cost), the outputs run --check compares (all the fused node writes), the kernel the record names."""
    p = by_name(name)
    before, g, report = _example(p)
    assert report.applied and {a.pattern for a in report.applied} == {name}
    unfused = Graph()
    unfused.nodes, unfused.leafs, unfused.buffers = before, g.leafs, g.buffers
    compared = {t.uid for t in watched(unfused)}
    table = cli.interpreter_table()
    assert set(interpreter_s()) <= set(table)
    made = {a.node for a in report.applied}  # (by name: pair_glu's op is the pair's, whose other nodes stay)
    fused = [n for n in g.nodes if n.op is p.record.op and n.name in made]
    assert len(fused) == len(report.applied)
    for n in fused:
        p.record.validate(n)
        ops.validate_node(n)
        assert p.record.launches(n) >= 1
        progs = backends.programs(n)
        assert progs and all(k.rstrip("0123456789") in table and count >= 1 for k, count, _ in progs), progs
        for t in [n.view_src, *n.outs]:
            assert t.uid in compared or buffer_role(g, t.base.buffer) == "cache", (n.name, t.name)
    assert cli.interpreter_seconds(fused) > 0
    module, _, attr = p.kernel.rpartition(".")
    assert callable(getattr(importlib.import_module(module), attr))
    g2 = serialize.loads(serialize.dumps(g))  # a saved fused graph loads (its record checks every fused node)
    assert [n.op for n in g2.nodes] == [n.op for n in g.nodes]


_SHARED: dict[str, tuple[list[str], dict]] = {}  # each distinct example graph once, with the patterns it is for
for _p in REGISTRY:
    _SHARED.setdefault(repr(sorted(_p.example.items())), ([], _p.example))[0].append(_p.name)
_EXAMPLES = {"+".join(names): example for names, example in _SHARED.values()}
_EXAMPLES["moe_router-8-tokens"] = {**by_name("moe_router").example, "n_tokens": 8}  # gallocr's DIV in the logits


@pytest.mark.parametrize("example", list(_EXAMPLES.values()), ids=list(_EXAMPLES))
def test_the_whole_pass_leaves_an_order_and_a_plan_a_graph_file_keeps(example):
    """Every pattern in pass order on each example graph: every source computed before its reader (a view of what a
    fused node writes follows it: ``Graph.replace``), no two live tensors on the same bytes, and the saved graph
    loads (the loader checks both) with the same nodes."""
    g = run(VerifyConfig(**example), PassOptions(fusion=True)).graph
    assert any(n.op.is_fused for n in g.nodes)
    g.check_order()
    check_plan(g)
    g2 = serialize.loads(serialize.dumps(g))
    assert [(n.op, n.name) for n in g2.nodes] == [(n.op, n.name) for n in g.nodes]


def test_check_refuses_to_pass_without_comparing_what_fusion_wrote(monkeypatch):
    """A record whose ``watch`` misses its outputs would let run --check pass without comparing them: the check
    stops instead, naming the pattern."""
    from gdnpass import check

    monkeypatch.setattr(check, "pattern_watches", lambda n: False)
    g = run(VerifyConfig(**by_name("mul_mat_vec_pair").example), PassOptions(fusion=True), fuse_now=False).graph
    with pytest.raises(RuntimeError, match="mul_mat_vec_pair: .* its record's watch misses"):
        check_fusion(g, patterns=[by_name("mul_mat_vec_pair").matcher()])


# ---- the shared matcher vocabulary ----------------------------------------------------------------------------------


def test_confinement_is_derived_from_the_rewrite():
    """The generic rule checks the interior nodes (removed, not written by the fused node): for the chain, the roles
    the capture names plus the nodes its shape rules pin; nothing else."""
    g = run(VerifyConfig(**by_name("gdn_conv_chain").example), PassOptions(fusion=True), fuse_now=False).graph
    ctx = Context(g)
    (anchor,) = ConvChain().candidates(g)
    c = ConvChain().capture(g, anchor, ctx)
    interior = {t.uid for t in c.interior()}
    assert interior == {t.uid for _, t in c.role_nodes()} | {t.uid for t in c.shaped()}
    assert {t.uid for t in c.written()} == {t.uid for t in [c.silu, c.q.out, c.k.out, *c.dsts]}
    assert [r for r, _ in ChainCapture.ROLES] == ["concat", "get-rows", "ssm-conv", "cpy"]
    assert confined(ChainCapture).refusals == ("concat.user-count", "get-rows.user-count", "ssm-conv.user-count",
                                               "cpy.user-count")

    class Forgetful(ChainCapture):  # a capture that names no role for the CPYs: a bug, not a refusal
        ROLES = ChainCapture.ROLES[:-1]

    forgetful = Forgetful(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)})
    with pytest.raises(RuntimeError, match="have no role"):
        confined(Forgetful).check(forgetful, ctx)


def test_the_between_rules_scan_the_span_the_capture_declares():
    g = run(VerifyConfig(**by_name("gdn_conv_chain").example), PassOptions(fusion=True), fuse_now=False).graph
    ctx = Context(g)
    (anchor,) = ConvChain().candidates(g)
    c = ConvChain().capture(g, anchor, ctx)
    first, at, last = c.span(ctx)
    removed = {t.uid for t in c.removed()}
    between = c.between(ctx)
    assert between and all(first < ctx.pos[b.node.uid] < last and b.node.uid not in removed for b in between)
    assert [b.after for b in between] == [ctx.pos[b.node.uid] > at for b in between]
    assert c.between(ctx) is between  # scanned once per candidate


def test_prepare_finds_the_chains_through_capture(monkeypatch):
    calls = []
    real = ConvChain.capture

    def spy(self, graph, anchor, ctx):
        calls.append(anchor.name)
        return real(self, graph, anchor, ctx)

    monkeypatch.setattr(ConvChain, "capture", spy)
    from gdnpass.models import build_verify_graph

    g = build_verify_graph(VerifyConfig("tiny-dc4-h64", 4, 3, n_layers=2))
    assert ConvChain().prepare(g) == 2 and calls == ["conv_input-0", "conv_input-1"]
    hints = [n for n in g.nodes if n.op is Op.NONE and n.op_params.get("hint")]
    assert [h.name for h in hints] == ["keep_projection-0", "keep_projection-1"]


def test_one_use_index():
    g = run(VerifyConfig("tiny-dc4-h64", 4, 3, n_layers=1), PassOptions(fusion=False)).graph
    uses = Uses(g.nodes)
    ctx = Context(g)
    for t in list(g.tensors())[:200]:
        assert g.use_counts().get(t.uid, 0) == uses.count(t) == ctx.uses(t)
        assert g.users(t) == uses.users(t) == ctx.users(t) == [n for n in g.nodes if any(s is t for s in n.src)]


# ---- the kernel's scope: a head size llama.cpp accepts and the fused kernel does not -------------------------------

TINY_H80 = ModelShape("tiny-h80", n_embd=64, n_layer=2, n_k_heads=1, n_v_heads=1, head_dim=80, d_conv=4)


def test_head_size_80_is_refused_by_name_and_its_graph_saves_and_loads():
    """The finding of issue 31: the matcher fused a head-80 chain the record then refused on load. Now the matcher
    asks the kernel's scope (scope.head-dim), the chain stays unfused, and the saved graph loads."""
    res = run(VerifyConfig(TINY_H80, 4, 3, n_layers=1), PassOptions(fusion=True))
    (refusal,) = [r for r in res.report.refused if r.pattern == "gdn_conv_chain"]
    assert refusal.rule == "scope.head-dim" and "head size 80 is not a power of two" in refusal.reason
    assert not any(n.op is Op.GDN_CONV_CHAIN for n in res.graph.nodes)
    serialize.loads(serialize.dumps(res.graph))


def test_head_size_80_runs_unfused_on_the_triton_kernels(device):
    """...and the unfused graph runs on the Triton backend (GATED_DELTA_NET masks the rows past the head size), within
    the tolerance of its torch reference."""
    import torch

    from gdnpass.models.fill import fill
    from gdnpass.runtime import Executor

    g = run(VerifyConfig(TINY_H80, 2, 1, n_layers=1, ffn=False), PassOptions(fusion=False)).graph
    outs = []
    for backend in ("torch", "triton"):
        ex = Executor(g, device=device, backend=backend)
        fill(ex, seed=3)
        outs.append(ex.run(probes=[g.find("l_out-0")])["l_out-0"])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
