"""What every matcher shares: the anatomy of a pattern, its rules, and the Match / Refusal values.

A pattern has one anatomy, in four steps::

    candidates(graph)          the anchor nodes it looks at
    capture(graph, anchor)     a typed capture: the named nodes of one candidate (None: not this pattern at all)
    rules                      a tuple of named rules, each a small function (capture, ctx) -> Why | None
    plan(capture, ctx)         the kernel variant of a legal match; rewrite(capture, plan) builds the fused node

A rule is *structural* (the subgraph is the pattern, inside the kernel's scope, its uses confined) or a *hazard*
(moving the subgraph's reads and writes to one position is safe on this memory plan). Rules run in order and the
first that says why not is the refusal: a value, never an exception, naming the rule (a short stable string such as
``cpy-run.row-written-twice``), the node at fault and, for aliasing rules, the two byte ranges that collide. Later
rules may assume that earlier ones held. ``force`` (the negative control of the tests) skips the hazard rules.
Legality is decided on byte ranges of the plan, as ggml-cuda decides it, never on tensor identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from gdnpass.ir import Graph, Tensor, byte_range, inputs, outputs, ranges_overlap

Range = tuple[str, int, int]  # (buffer, lo, hi)

STRUCTURAL = "structural"
HAZARD = "hazard"


@dataclass(frozen=True)
class Why:
    """What a rule says when it refuses: the node at fault, a sentence, and for aliasing rules the colliding ranges."""

    node: Tensor
    reason: str
    ranges: tuple[Range, Range] | None = None


@dataclass(frozen=True)
class Rule:
    name: str
    kind: str                                      # STRUCTURAL or HAZARD
    check: Callable[[Any, "Context"], Why | None]


def rule(name: str, kind: str = STRUCTURAL) -> Callable[[Callable], Rule]:
    """Decorator: a check function becomes a named Rule."""
    return lambda fn: Rule(name, kind, fn)


@dataclass
class Match:
    pattern: str
    anchor: Tensor                 # the fused node runs at this node's position
    layer: int | None
    capture: Any                   # the pattern's typed capture
    plan: Any                      # the kernel variant
    removed: list[Tensor]          # the nodes the fused node replaces
    span: tuple[int, int]          # first and last node index the rewrite reorders

    def __bool__(self) -> bool:
        return True


@dataclass
class Refusal:
    pattern: str
    rule: str
    node: Tensor
    reason: str
    layer: int | None = None
    ranges: tuple[Range, Range] | None = None  # for aliasing rules: the two byte ranges that collide

    def __bool__(self) -> bool:
        return False

    def describe(self) -> str:
        s = f"{self.pattern}: refused by {self.rule} at {self.node.name!r}: {self.reason}"
        if self.ranges:
            s += " [" + " vs ".join(fmt_range(r) for r in self.ranges) + "]"
        return s


@dataclass
class Decision:
    """One candidate: the match to apply (None: leave it), and the refusal to report (None: it was legal)."""

    match: Match | None
    refusal: Refusal | None


def decide(pattern, graph: Graph, anchor, ctx: "Context", force: bool = False) -> Decision | None:
    """Capture, run the rules in order, plan. ``force`` applies a match that only hazard rules refuse (and still
    reports the refusal). None: the anchor is not this pattern at all."""
    cap = pattern.capture(graph, anchor, ctx)
    if cap is None:
        return None
    refusal = None
    for r in pattern.rules(ctx):
        why = r.check(cap, ctx)
        if why is None:
            continue
        refusal = Refusal(pattern.name, r.name, why.node, why.reason, cap.layer, why.ranges)
        if r.kind == STRUCTURAL or not force:
            return Decision(None, refusal)
        break
    removed = pattern.removed(cap)
    pos = [ctx.pos[t.uid] for t in removed if t.uid in ctx.pos]
    m = Match(pattern.name, cap.anchor, cap.layer, cap, pattern.plan(cap, ctx), removed, (min(pos), max(pos)))
    return Decision(m, refusal)


def violations(pattern, graph: Graph, anchor, ctx: "Context") -> list[str]:
    """Every rule the candidate breaks: structural rules up to the first that fails (later ones assume it held),
    then, if all structural rules hold, every hazard rule. For tests: a graph made to trip one rule trips no other."""
    cap = pattern.capture(graph, anchor, ctx)
    if cap is None:
        return []
    out = []
    for r in pattern.rules(ctx):  # (a structural failure ends the loop below; hazards all run)
        if r.check(cap, ctx) is not None:
            out.append(r.name)
            if r.kind == STRUCTURAL:
                break
    return out


@dataclass
class Context:
    """Per-pass state a matcher may use: the current node positions and use counts, and the between-check flavour."""

    graph: Graph
    between: str = "narrow"  # "narrow": the seed's rules; "broad": no in-between node touches any chain buffer
    pos: dict[int, int] = field(default_factory=dict)
    use_counts: dict[int, int] = field(default_factory=dict)
    _users: dict[int, list[Tensor]] = field(default_factory=dict)
    _ranges: dict[int, Range | None] = field(default_factory=dict)
    _indexed: bool = False

    def __post_init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Index the graph state: positions now, ggml use counts and users on first use (the pair needs none)."""
        self.pos = {n.uid: i for i, n in enumerate(self.graph.nodes)}
        self.use_counts, self._users, self._ranges = {}, {}, {}
        self._indexed = False

    def _index_uses(self) -> None:
        for n in self.graph.nodes:
            seen = set()
            for s in n.src:
                if s is None:
                    continue
                self.use_counts[s.uid] = self.use_counts.get(s.uid, 0) + 1  # one use per src slot, as ggml counts
                if s.uid not in seen:
                    seen.add(s.uid)
                    self._users.setdefault(s.uid, []).append(n)
        self._indexed = True

    def uses(self, t: Tensor) -> int:
        if not self._indexed:
            self._index_uses()
        return self.use_counts.get(t.uid, 0)

    def users(self, t: Tensor) -> list[Tensor]:
        """Nodes reading ``t`` through a src slot, in execution order."""
        if not self._indexed:
            self._index_uses()
        return self._users.get(t.uid, [])

    def ranges(self, ts: Iterable[Tensor | None]) -> list[tuple[Range, Tensor]]:
        """The byte ranges of tensors, skipping empty ones (they touch nothing); memoised for this graph state."""
        out = []
        for t in ts:
            if t is None:
                continue
            if t.uid not in self._ranges:
                self._ranges[t.uid] = None if t.is_empty else byte_range(t)
            r = self._ranges[t.uid]
            if r:
                out.append((r, t))
        return out

    def node_reads(self, n: Tensor) -> list[tuple[Range, Tensor]]:
        return self.ranges(inputs(n))

    def node_writes(self, n: Tensor) -> list[tuple[Range, Tensor]]:
        return self.ranges(outputs(n))


def fmt_range(r: Range) -> str:
    return f"{r[0]}[{r[1]:#x}, {r[2]:#x})"


def first_collision(a: list[tuple[Range, Tensor]], b: list[tuple[Range, Tensor]]):
    """The first (range_a, tensor_a, range_b, tensor_b) whose byte ranges overlap, or None."""
    for ra, ta in a:
        for rb, tb in b:
            if ranges_overlap(ra, rb):
                return ra, ta, rb, tb
    return None


def collision(node: Tensor, reason: str, hit) -> Why:
    """A Why for an aliasing rule from :func:`first_collision`'s result."""
    return Why(node, reason, (hit[0], hit[2]))
