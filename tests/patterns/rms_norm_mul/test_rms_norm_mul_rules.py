"""RMS_NORM_MUL's rules, each tripped alone on a small graph (trips.py), each hazard shown to corrupt bytes when the
rewrite is forced past it; the plain graph, its in-place chain and the joined ADD fused byte-identically on the
torch references and on the Triton kernels (the interpreter, without a GPU)."""

import pytest

from gdnpass.check import check_fusion
from gdnpass.errors import KernelError
from gdnpass.fusion import fuse
from gdnpass.ir import Flag, Op
from gdnpass.kernels import backends
from gdnpass.patterns.common import HAZARD, STRUCTURAL, Context, refusal_names, violations
from gdnpass.patterns.rms_norm_mul import RmsNormMul, kernel
from patterns.rms_norm_mul.trips import TRIPS, Trip, build, candidate, nodes
from support.graphs import triton_for

RULES = RmsNormMul().rules(Context(build()))
KIND = {name: r.kind for r in RULES for name in r.refusals}
OPS = (Op.RMS_NORM, Op.MUL, Op.ADD, Op.RMS_NORM_MUL)


class Only:
    """The pattern restricted to one candidate."""

    def __init__(self, pattern, anchor):
        self._pattern, self._anchor = pattern, anchor

    def candidates(self, graph):
        return [self._anchor]

    def __getattr__(self, name):
        return getattr(self._pattern, name)


def kernels(t: Trip):
    return None if t.kernels == "torch" else triton_for(OPS)


@pytest.mark.parametrize("rule", refusal_names(RULES))
def test_every_rule_has_a_trip_graph(rule):
    assert any(t.rule == rule for t in TRIPS), f"no trip graph for {rule}: add one to trips.TRIPS"


@pytest.mark.parametrize("t", TRIPS, ids=[t.id for t in TRIPS])
def test_each_rule_trips_alone(t):
    if t.mutate:  # unmutated, the same config's candidate is legal
        g, p, anchor = candidate(t, mutate=False)
        assert violations(p, g, anchor, Context(g)) == []
    g, p, anchor = candidate(t)
    assert violations(p, g, anchor, Context(g)) == [t.rule]
    before = list(g.nodes)
    report = fuse(g, enabled=True, patterns=[Only(p, anchor)])
    assert [r.rule for r in report.refused] == [t.rule], [r.describe() for r in report.refused]
    assert not report.applied and g.nodes == before
    if KIND[t.rule] == HAZARD:
        assert report.refused[0].ranges is not None  # the two colliding byte ranges


@pytest.mark.parametrize("t", [t for t in TRIPS if KIND[t.rule] == HAZARD], ids=lambda t: t.id)
def test_forcing_a_hazard_corrupts_bytes(t, monkeypatch, device):
    if t.kernels == "triton" and device == "cuda":
        pytest.skip("a race between the programs of one launch: the interpreter runs them in order, so it shows there "
                    "every time; on the GPU both programs may read before either writes")
    def check(force, mutate=True):
        g, p, anchor = candidate(t, mutate)
        return check_fusion(g, device, patterns=[Only(p, anchor)], force=force, backend=kernels(t))

    refused = check(force=False)
    assert [r.rule for r in refused.report.refused] == [t.rule] and refused.identical
    if t.kernels == "triton":  # the launcher's own guard refuses the overlap too (a second line of defence) ...
        with pytest.raises(KernelError, match="overlaps an input other than element for element"):
            check(force=True)
        monkeypatch.setattr(kernel, "_alias_ok", lambda *a, **k: None)  # ... so run the kernel without it
    forced = check(force=True)
    assert len(forced.report.applied) == 1
    assert [c.name for c in forced.compared if not c.identical], "forced past the rule, still byte-identical"
    clean = check(force=False, mutate=False)  # control: the same kernels fuse the unmutated graph identically
    assert len(clean.report.applied) == 1 and clean.identical


def test_structural_rules_first_and_the_hazards_need_the_plan():
    kinds = [r.kind for r in RULES]
    assert kinds == sorted(kinds, key=[STRUCTURAL, HAZARD].index) and set(kinds) == {STRUCTURAL, HAZARD}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("config", [{}, dict(add=True)], ids=["mul", "mul+add"])
def test_fuses_byte_identically(config, backend, device):
    """The plain graph is an in-place chain (norm over its input, MUL over the norm): the case rule 8 allows."""
    g = build(**config)
    n = nodes(g)
    last = n["attn_norm_res-0" if config else "attn_norm-0"]
    assert n["norm-0"].offset == n["pre"].offset and last.offset == n["pre"].offset  # gallocr's in-place chain
    res = check_fusion(g, device, backend=None if backend == "torch" else triton_for(OPS))
    assert [a.pattern for a in res.report.applied] == ["rms_norm_mul"] and res.identical
    fused = next(x for x in g.nodes if x.op is Op.RMS_NORM_MUL)
    assert fused.view_src is last and len(fused.src) == (3 if config else 2)
    assert {c.name for c in res.compared} == {last.name, "l_out-0"}  # (with the ADD, the MUL is interior)


def test_the_add_joins_only_when_it_alone_reads_the_mul():
    g = build(add=True)
    mul = nodes(g)["attn_norm-0"]
    p = RmsNormMul()
    assert p.capture(g, nodes(g)["norm-0"], Context(g)).add is not None
    mul.flags |= Flag.OUTPUT  # now the host may read the MUL
    c = p.capture(g, nodes(g)["norm-0"], Context(g))
    assert c.add is None and c.last is mul  # RMS_NORM+MUL, the ADD stays (as ggml-cuda falls back to two ops)
    assert violations(p, g, nodes(g)["norm-0"], Context(g)) == []


def test_launches_and_cost():
    g = build(add=True)
    before = sum(1 for n in g.nodes if n.op in (Op.RMS_NORM, Op.MUL, Op.ADD))
    fuse(g, enabled=True, patterns=[RmsNormMul()])
    (fused,) = [n for n in g.nodes if n.op is Op.RMS_NORM_MUL]
    assert before == 3 and not [n for n in g.nodes if n.op in (Op.RMS_NORM, Op.MUL, Op.ADD)]
    assert backends.programs(fused) == [("rms_norm_mul", 2, 1)]  # 12 rows of 64: two programs of 8 rows
