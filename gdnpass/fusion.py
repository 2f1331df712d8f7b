"""The fusion pass: run the matchers on a planned graph, apply the legal rewrites, report everything.

The patterns and their order come from the registry (:mod:`gdnpass.patterns`). Enabled by ``GDN_FUSION=1`` (unset or
``0`` leaves the graph unchanged); ``fuse(graph, enabled=True|False)`` forces it either way. The pipeline is build ->
``prepare`` (reorder for fusion, as ggml-cuda's graph_optimize) -> plan -> ``fuse``. Fusion is decided on the *unfused*
plan, as ggml-cuda decides it: a fused node keeps the memory the plan gave to the tensors it writes. Matches of one
pattern are all decided on the same graph state, then applied (they never share a node); patterns run in order, so a
later pattern sees the earlier rewrites.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from gdnpass.ir import Graph, GraphError, arena_buffer
from gdnpass.patterns import matchers
from gdnpass.patterns.common import Context, Refusal, decide, fmt_range

ENV = "GDN_FUSION"

# the default pattern set, the registry's in its order: a plain list, composable with +
PATTERNS: list = matchers()


def prepare(graph: Graph, enabled: bool | None = None, patterns: list | None = None) -> int:
    """The graph-optimize step, before planning (ggml-cuda's graph_optimize): patterns may reorder nodes so that
    fusable ones end up adjacent. A no-op when fusion is off. Returns the number of nodes moved."""
    if not (env_enabled() if enabled is None else enabled):
        return 0
    if arena_buffer(graph) is not None:
        raise GraphError("prepare() must run before the memory plan (it reorders nodes)")
    return sum(p.prepare(graph) for p in (PATTERNS if patterns is None else patterns) if hasattr(p, "prepare"))


def env_enabled() -> bool:
    v = os.environ.get(ENV, "0").strip()
    if v not in ("0", "1", ""):
        raise GraphError(f"{ENV} must be 0 or 1, is {v!r}")
    return v == "1"


@dataclass
class Applied:
    pattern: str
    layer: int | None
    node: str            # the fused node's name
    anchor: str          # the node whose position it took
    replaced: list[str]  # names of the nodes it replaced


@dataclass
class FusionReport:
    enabled: bool
    between: str = "narrow"
    applied: list[Applied] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    seconds: float = 0.0

    def counts(self) -> dict[str, dict[str, int]]:
        """{pattern: {"applied": n, <rule>: n, ...}}."""
        out: dict[str, dict[str, int]] = {}
        for a in self.applied:
            d = out.setdefault(a.pattern, {"applied": 0})
            d["applied"] += 1
        for r in self.refused:
            d = out.setdefault(r.pattern, {"applied": 0})
            d[r.rule] = d.get(r.rule, 0) + 1
        return out

    def summary(self) -> str:
        if not self.enabled:
            return f"fusion off ({ENV} unset or 0): graph unchanged"
        parts = []
        for pat, d in self.counts().items():
            refused = ", ".join(f"{k} {v}" for k, v in d.items() if k != "applied")
            parts.append(f"{pat}: {d['applied']} applied" + (f", refused: {refused}" if refused else ""))
        return "; ".join(parts) or "no candidates"

    def to_json(self) -> dict:
        return {
            "enabled": self.enabled,
            "between": self.between,
            "applied": [dict(pattern=a.pattern, layer=a.layer, node=a.node, anchor=a.anchor, replaced=a.replaced)
                        for a in self.applied],
            "refused": [dict(pattern=r.pattern, layer=r.layer, node=r.node.name, rule=r.rule, reason=r.reason,
                             ranges=[fmt_range(x) for x in r.ranges] if r.ranges else None) for r in self.refused],
        }


def fuse(graph: Graph, enabled: bool | None = None, patterns: list | None = None, between: str = "narrow",
         force: bool = False) -> FusionReport:
    """Rewrite ``graph`` in place. ``enabled=None`` reads GDN_FUSION.

    ``force=True`` applies every candidate that only *hazard* rules refuse (the negative control the tests use to
    show that a refused rewrite really corrupts bytes; the refusal is still reported). Never use it for anything else.
    """
    if between not in ("narrow", "broad"):
        raise GraphError(f"between must be 'narrow' or 'broad', is {between!r}")
    on = env_enabled() if enabled is None else enabled
    report = FusionReport(enabled=on, between=between, nodes_before=len(graph.nodes))
    if not on:
        report.nodes_after = len(graph.nodes)
        return report
    if arena_buffer(graph) is None:
        raise GraphError("graph has no memory plan: fusion is decided on the plan (run gdnpass.alloc.plan first)")
    t0 = time.perf_counter()
    for pattern in PATTERNS if patterns is None else patterns:
        ctx = Context(graph, between)
        decisions = [d for d in (decide(pattern, graph, anchor, ctx, force) for anchor in pattern.candidates(graph))
                     if d is not None]
        report.refused += [d.refusal for d in decisions if d.refusal is not None]
        rewrites = []
        for m in (d.match for d in decisions if d.match is not None):
            fused = pattern.rewrite(graph, m)
            rewrites.append((m.removed, fused, m.anchor))
            report.applied.append(Applied(m.pattern, m.layer, fused.name, m.anchor.name, [t.name for t in m.removed]))
        graph.replace(rewrites)
    report.nodes_after = len(graph.nodes)
    report.seconds = time.perf_counter() - t0
    return report
