"""Every named legality rule of every registered pattern (gdnpass.patterns.REGISTRY): documented, tripped alone, and
(for hazards) needed. Each pattern's trip graphs live in its test folder, ``tests/patterns/<folder>/trips.py``
(``<folder>``: its matcher's package; what the module holds: tests/support/trips.py); these tests are the same for
every pattern, and a pattern that lacks a part fails them.

1. The rule block of each matcher's docstring names exactly the rules the code runs, in the order it runs them (per
   between-mode, ``Pattern.modes``: ``patterns.common.rule_block_problems``), structural rules before hazards.
2. For every refusal name of every between-mode, a trip graph: the pattern's small graph with one mutation that
   breaks that rule and no other (``violations(...) == [rule]``), and ``fuse`` refuses the candidate naming that
   rule and leaves the graph unchanged. A registered pattern without a trips module fails
   ``test_every_registered_pattern_has_its_trip_graphs``; a rule without a trip graph fails
   ``test_every_rule_has_a_trip_graph``.
3. For every hazard rule, forcing the rewrite past it on its graph really corrupts bytes (``check_fusion(force=True)``
   is not identical) while the unforced run refuses and stays identical, and the same kernels fuse the unmutated
   graph identically. A hazard without such a graph fails ``test_every_hazard_has_a_corruption_proof``.

Finding (3): the torch references of the fused ops compute every result before writing any output, so an overlap of
a fused node's outputs with its own inputs (``alias.output-overlaps-input``, ``pair.alias``,
``rms-mul.output-overlaps-input``) cannot change a byte there; those hazards are races between the programs of one
Triton launch. Their proofs run the Triton kernels of the ops involved (fused and unfused) in the interpreter, the
rest of the graph on torch: the interpreter runs programs one after another, so a program that writes over what a
later program reads corrupts it, as on the GPU (where it may or may not: on CUDA these proofs skip).

The pattern-specific rule tests (the chain's between-modes, the broad/narrow checks, its scope; the pair's
different-src1; the RMS_NORM_MUL launcher's guard) are in each pattern's test folder.
"""

from __future__ import annotations

import dataclasses

import pytest

from gdnpass.check import check_fusion
from gdnpass.fusion import fuse
from gdnpass.patterns import REGISTRY
from gdnpass.patterns.common import HAZARD, STRUCTURAL, Context, Rule, rule_block, rule_block_problems, violations
from support.trips import (BETWEEN, Only, Trip, folder, kinds, rule_names, rules, trips, trips_of, trips_problems,
                           uncovered)

PATTERNS = {p.name: p for p in REGISTRY}
KIND = {p.name: kinds(p) for p in REGISTRY}


def _by_pattern(cases):
    """pytest params of (pattern name, case), with ids "pattern:case"."""
    return [pytest.param(n, c, id=f"{n}:{c.id if isinstance(c, Trip) else c}") for n, c in cases]


RULES = _by_pattern((p.name, r) for p in REGISTRY for r in rule_names(p.matcher(), p.modes))
HAZARD_RULES = _by_pattern((p.name, r) for p in REGISTRY for r in rule_names(p.matcher(), p.modes)
                           if KIND[p.name][r] == HAZARD)
TRIPS = _by_pattern((p.name, t) for p in REGISTRY for t in trips(p))
HAZARDS = _by_pattern((p.name, t) for p in REGISTRY for t in trips(p) if KIND[p.name].get(t.rule) == HAZARD)
TRITON_HAZARDS = _by_pattern((p.name, t) for p in REGISTRY for t in trips(p)
                             if KIND[p.name].get(t.rule) == HAZARD and t.kernels != "torch")
MODES = [pytest.param(p.name, m, id=f"{p.name}-{m}") for p in REGISTRY for m in p.modes]

# ---------------------------------------------------------------------------------------------------------------------
# 1. the docstring's rule block vs the code
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", PATTERNS)
def test_docstring_lists_the_rules_the_code_runs_in_order(pattern):
    p = PATTERNS[pattern]
    modes = {m: p.refusal_names(m) for m in p.modes}
    assert rule_block_problems(p.rule_doc, modes) == []
    assert len(rule_block(p.rule_doc)) == len({n for names in modes.values() for n in names})


def test_docstring_parser_reads_names_not_shapes():
    doc = ("Legality rules:\n 1. [a.b] x is [d_conv-1, C, 1] and [C, n_t];\n    [c.d-e] y [S, H_k].\n\n"
           "[f.g] after the block")
    assert rule_block(doc) == ["a.b", "c.d-e"]


@pytest.mark.parametrize("pattern,mode", MODES)
def test_structural_rules_run_before_hazards(pattern, mode):
    """``violations`` and ``force`` rely on it: the structural rules first, then the hazards; names unique."""
    rs = rules(PATTERNS[pattern].matcher(), mode)
    kinds_ = [r.kind for r in rs]
    assert set(kinds_) == {STRUCTURAL, HAZARD} and kinds_ == sorted(kinds_, key=[STRUCTURAL, HAZARD].index)
    assert len({r.name for r in rs}) == len(rs)


# ---------------------------------------------------------------------------------------------------------------------
# 2. every rule tripped alone
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_registered_pattern_has_its_trip_graphs(pattern):
    """A registered pattern without tests/patterns/<folder>/trips.py (or one lacking a part) fails here."""
    assert trips_problems(PATTERNS[pattern]) == []


def test_a_pattern_without_trip_graphs_is_caught():
    """Negative control of the test above: a registry entry whose matcher lives in a package without a test folder."""
    p = PATTERNS["mul_mat_vec_pair"]
    elsewhere = type(p.matcher.__name__, (p.matcher,), {"__module__": "gdnpass.patterns.no_such_pattern.matcher"})
    q = dataclasses.replace(p, matcher=elsewhere)
    assert folder(q) == "no_such_pattern" and trips_of(q) is None and trips(q) == []
    assert trips_problems(q) == ["no tests/patterns/no_such_pattern/trips.py (its TRIPS, candidate(), kernels())"]
    assert uncovered(q.matcher(), q.modes, trips(q)) == rule_names(p.matcher(), p.modes)


@pytest.mark.parametrize("pattern,rule", RULES)
def test_every_rule_has_a_trip_graph(pattern, rule):
    """A new rule without a graph that trips it alone fails here."""
    assert any(t.rule == rule for t in trips(PATTERNS[pattern])), \
        f"no trip graph for {pattern}'s {rule}: add one to tests/patterns/{folder(PATTERNS[pattern])}/trips.py"


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_new_rule_without_a_trip_graph_is_caught(pattern):
    """Negative control of the test above: a pattern with one more rule has exactly that rule uncovered."""
    p = PATTERNS[pattern]

    class Extended(p.matcher):
        def rules(self, ctx):
            return tuple(super().rules(ctx)) + (Rule("between.new-hazard", HAZARD, lambda c, ctx: None),)

    assert uncovered(p.matcher(), p.modes, trips(p)) == []
    assert uncovered(Extended(), p.modes, trips(p)) == ["between.new-hazard"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_trip_table_names_only_real_rules(pattern):
    p = PATTERNS[pattern]
    assert {t.rule for t in trips(p)} <= set(rule_names(p.matcher(), p.modes))
    assert all(t.between in BETWEEN for t in trips(p))


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mode", BETWEEN)
def test_the_unmutated_candidates_break_no_rule(pattern, mode):
    g, p, anchor = trips_of(PATTERNS[pattern]).candidate(None)
    assert violations(p, g, anchor, Context(g, mode)) == []


@pytest.mark.parametrize("pattern,t", TRIPS)
def test_each_rule_trips_alone(pattern, t):
    candidate = trips_of(PATTERNS[pattern]).candidate
    if t.mutate:  # the mutation is what breaks the rule: unmutated, the same config's candidate is legal
        g, p, anchor = candidate(t, mutate=False)
        assert violations(p, g, anchor, Context(g, t.between)) == []
    g, p, anchor = candidate(t)
    assert violations(p, g, anchor, Context(g, t.between)) == [t.rule]
    kind = KIND[pattern][t.rule]
    if kind == STRUCTURAL:  # structural rules are the same in both modes
        other = "broad" if t.between == "narrow" else "narrow"
        assert violations(p, g, anchor, Context(g, other)) == [t.rule]
    # fuse: the candidate is refused by that rule, the graph left unchanged
    before = list(g.nodes)
    report = fuse(g, enabled=True, patterns=[Only(p, anchor)], between=t.between)
    assert [r.rule for r in report.refused] == [t.rule], [r.describe() for r in report.refused]
    assert not report.applied and g.nodes == before
    r = report.refused[0]
    assert r.pattern == p.name == pattern and r.reason and r.node is not None
    if kind == HAZARD:
        assert r.ranges is not None  # aliasing refusals name the two colliding byte ranges


# ---------------------------------------------------------------------------------------------------------------------
# 3. forcing a hazard rule's rewrite corrupts bytes
# ---------------------------------------------------------------------------------------------------------------------


def check(pattern: str, t: Trip, force: bool, device: str, mutate: bool = True):
    """``check_fusion`` of trip ``t``'s candidate alone, on its kernels, with the trips module's keywords, on the
    test's device."""
    module = trips_of(PATTERNS[pattern])
    g, p, anchor = module.candidate(t, mutate)
    return check_fusion(g, device, patterns=[Only(p, anchor)], between=t.between, force=force,
                        backend=module.kernels(t), **getattr(module, "CHECK", {}))


def _skip_races_on_cuda(pattern: str, t: Trip, device: str):
    if t.kernels != "torch" and device == "cuda":
        pytest.skip("a race between the programs of one launch: the interpreter runs them in order, so it shows there "
                    "every time; on the GPU both programs may read before either writes")


@pytest.mark.parametrize("pattern,rule", HAZARD_RULES)
def test_every_hazard_has_a_corruption_proof(pattern, rule):
    assert any(t.rule == rule and t.corrupts for t in trips(PATTERNS[pattern])), \
        f"no graph where forcing {pattern} past {rule} corrupts bytes"


@pytest.mark.parametrize("pattern,t", HAZARDS)
def test_forcing_a_hazard_corrupts_bytes(pattern, t, monkeypatch, device):
    _skip_races_on_cuda(pattern, t, device)
    refused = check(pattern, t, False, device)
    assert [r.rule for r in refused.report.refused] == [t.rule] and not refused.report.applied
    assert refused.identical, [c.to_json() for c in refused.compared if not c.identical]
    unguard = getattr(trips_of(PATTERNS[pattern]), "unguard", None)
    if unguard is not None:  # a launcher's own check that would refuse the forced rewrite first
        unguard(t, monkeypatch)
    forced = check(pattern, t, True, device)
    assert [r.rule for r in forced.report.refused] == [t.rule] and len(forced.report.applied) == 1
    differing = [c.name for c in forced.compared if not c.identical]
    if t.corrupts:
        assert differing, "forced past the rule, the fused graph is still byte-identical"
    else:
        assert not differing, differing  # a conservative refusal: see its mutation's docstring
    clean = check(pattern, t, False, device, mutate=False)  # control: these kernels fuse the unmutated candidate
    assert len(clean.report.applied) == 1 and clean.identical, [c.to_json() for c in clean.compared
                                                                 if not c.identical]


@pytest.mark.parametrize("pattern,t", TRITON_HAZARDS)
def test_alias_hazards_are_invisible_to_the_torch_references(pattern, t, device):
    """The finding above: on the torch kernels, forcing past an alias rule changes no byte (the references compute
    everything before writing), which is why the alias proofs need the Triton kernels."""
    res = check(pattern, dataclasses.replace(t, kernels="torch"), True, device)
    assert len(res.report.applied) == 1 and res.identical

