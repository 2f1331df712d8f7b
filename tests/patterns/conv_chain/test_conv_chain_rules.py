"""The conv chain's own rule tests, beside the generic ones every registered pattern runs (tests/patterns/
test_rules.py, on this folder's trips.py): its two between-modes, the doctored-docstring negative control, the broad
check against the narrow one, its scope rules and the forced-fusion negative control."""

from __future__ import annotations

import pytest

from gdnpass import ops
from gdnpass.check import check_fusion
from gdnpass.fusion import fuse
from gdnpass.models.fill import fill
from gdnpass.patterns import by_name
from gdnpass.patterns.common import Context, rule_block_problems, violations
from gdnpass.patterns.conv_chain import ConvChain
from gdnpass.patterns.conv_chain import matcher as conv_chain
from patterns.conv_chain.trips import TINY_DC6, TRIPS, candidate, m_write_silu_between
from support.surgery import IDS, insert_after, planned
from support.trips import BETWEEN, Trip

PATTERN = by_name("gdn_conv_chain")
MODES = {m: PATTERN.refusal_names(m) for m in PATTERN.modes}


def test_conv_chain_between_modes():
    """Structure and the alias rule run in both modes; the six narrow between-rules only in narrow, the one broad
    rule only in broad."""
    assert PATTERN.modes == BETWEEN
    narrow, broad = MODES["narrow"], MODES["broad"]
    assert set(narrow) - set(broad) == {r.name for r in conv_chain.NARROW}
    assert set(broad) - set(narrow) == {"between.touches-chain-buffer"}
    assert len(conv_chain.NARROW) == 6 and all(n.startswith("between.") for n in set(narrow) ^ set(broad))
    assert narrow[:len(narrow) - 6] == broad[:-1]  # a common prefix, then the mode's between-rules


def _swap(doc: str, a: str, b: str) -> str:
    return doc.replace(f"[{a}]", "[@@]").replace(f"[{b}]", f"[{a}]").replace("[@@]", f"[{b}]")


@pytest.mark.parametrize("doctor,expect", [
    (lambda d: d.replace("[scope.d-conv] ", ""), "in code, not in the docstring: scope.d-conv"),
    (lambda d: d.replace("[between.touches-chain-buffer]", "[between.touches-chain]"),
     "in the docstring, not in code: between.touches-chain"),
    (lambda d: _swap(d, "between.writes-ids", "between.writes-weights"), "narrow: docstring order"),
    (lambda d: _swap(d, "structure.weight", "structure.state"), "broad: docstring order"),
    (lambda d: d.replace("[cpy-run.whole-row]", "[cpy-run.whole-row] [l2.head-geometry]"),
     "listed twice: l2.head-geometry"),
    (lambda d: d.replace("Legality rules, in the order they run", "Legality rules\n\n"),
     "in code, not in the docstring: structure.concat"),  # the block ends at a blank line
], ids=["dropped", "renamed", "swapped-narrow", "swapped-structure", "duplicated", "block-cut"])
def test_docstring_check_fails_on_a_doctored_docstring(doctor, expect):
    """Negative control: each doctoring of the conv chain's real docstring is caught, with the reason."""
    assert PATTERN.rule_doc == conv_chain.__doc__
    doctored = doctor(conv_chain.__doc__)
    assert doctored != conv_chain.__doc__
    problems = rule_block_problems(doctored, MODES)
    assert any(p.startswith(expect) for p in problems), problems


def test_violations_lists_every_hazard():
    """Negative control of "trips alone": an in-place SCALE of snapshot row 0 after the fused position both writes
    and reads it, and ``violations`` names both hazards (fuse reports the first)."""
    def scale_row(g, c):
        insert_after(g, c["concat"], ops.scale(c["dsts"][0], 2.0, inplace=True))

    g, p, anchor = candidate(Trip("", scale_row))
    assert violations(p, g, anchor, Context(g)) == ["between.writes-cache", "between.reads-cache"]
    assert [r.rule for r in fuse(g, enabled=True, patterns=[p]).refused] == ["between.writes-cache"]


@pytest.mark.parametrize("t", [t for t in TRIPS if t.rule.startswith("between.") and t.between == "narrow"],
                         ids=lambda t: t.id)
def test_broad_refuses_every_narrow_between_graph(t):
    """The broad check is broader: what a narrow between-rule refuses, broad refuses too (by its one rule)."""
    g, p, anchor = candidate(t)
    assert violations(p, g, anchor, Context(g, "broad")) == ["between.touches-chain-buffer"]


def test_broad_check_refuses_what_narrow_proves_safe():
    """A node in between that writes the dead projection block: broad refuses, narrow fuses, bytes identical."""
    def scratch(g, c):
        early = [(t.offset, t.offset + t.nbytes) for t in (c["silu"], c["q_l2"], c["k_l2"])]
        proj = c["proj"]
        free = [o for o in range(proj.offset, proj.offset + proj.nbytes - 255, 256)
                if all(o + 256 <= lo or o >= hi for lo, hi in early)]
        assert free, "the projection block is entirely reused by early outputs in this plan"
        insert_after(g, c["cpys"][-1], ops.cont(ops.view_1d(c["attn_norm"], 64, 0)), offset=free[0])

    t = Trip("between.touches-chain-buffer", scratch, between="broad")
    g, p, anchor = candidate(t)
    assert violations(p, g, anchor, Context(g, "broad")) == ["between.touches-chain-buffer"]
    broad = fuse(g, enabled=True, patterns=[p], between="broad")
    assert [r.rule for r in broad.refused] == ["between.touches-chain-buffer"]
    g, p, anchor = candidate(t)
    assert violations(p, g, anchor, Context(g, "narrow")) == []
    res = check_fusion(g, patterns=[p], ids=IDS)
    assert len(res.report.applied) == 1 and res.identical, [c.to_json() for c in res.compared if not c.identical]
    g, p, anchor = candidate(t)  # and forcing it in broad mode changes no byte: broad refused a safe rewrite
    res = check_fusion(g, patterns=[p], ids=IDS, between="broad", force=True)
    assert [r.rule for r in res.report.refused] == ["between.touches-chain-buffer"] and res.identical


@pytest.mark.parametrize("model,n_t,n_rs,rule", [
    ("tiny-dc4-h64", 17, 3, "scope.n-tokens"),
    (TINY_DC6, 4, 3, "scope.d-conv"),
])
def test_scope_rules(model, n_t, n_rs, rule):
    g = planned(model=model, n_tokens=n_t, n_rs_seq=n_rs)
    report = fuse(g, enabled=True, patterns=[ConvChain()])
    assert [r.rule for r in report.refused] == [rule]


def test_negative_control_forced_fusion_corrupts_bytes():
    """Force the rewrite past a between-rule: the executor's output really differs, so the tests can see hazards
    (and, control of the control, unfused the scribble is harmless: SILU overwrites it later)."""
    from gdnpass.check import watched
    from gdnpass.runtime import Executor

    def unfused(g):
        ex = Executor(g)
        fill(ex, seed=5, ids=IDS)
        return ex.run(probes=watched(g))

    t = Trip("between.writes-early-output", m_write_silu_between)
    (clean, _, _), (g, p, _) = candidate(t, mutate=False), candidate(t)
    want, got = unfused(clean), unfused(g)
    assert want.keys() <= got.keys() and all(want[k].equal(got[k]) for k in want)  # (the scribble is watched)
    res = check_fusion(g, patterns=[p], ids=IDS, seed=5, force=True)
    assert [r.rule for r in res.report.refused] == ["between.writes-early-output"]
    assert len(res.report.applied) == 1  # forced through
    assert {"conv_output_silu-0", "l_out-0"} <= {x.name for x in res.compared if not x.identical}
