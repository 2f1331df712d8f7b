"""The matcher vocabulary every pattern shares: the anatomy, rules, captures, the generic rules, Match / Refusal.

A pattern has one anatomy, in four steps::

    candidates(graph)          the anchor nodes it looks at
    capture(graph, anchor)     a typed :class:`Capture`: the named nodes of one candidate (None: not this pattern)
    rules                      a tuple of named rules, each a small function (capture, ctx) -> Why | None
    plan(capture, ctx)         the kernel variant of a legal match; rewrite(capture, plan) builds the fused node

A rule is *structural* (the subgraph is the pattern, inside the kernel's scope, its uses confined) or a *hazard*
(moving the subgraph's reads and writes to one position is safe on this memory plan). Rules run in order and the
first that says why not is the refusal: a value, never an exception, naming the rule (a short stable string such as
``cpy-run.row-written-twice``), the node at fault and, for aliasing rules, the two byte ranges that collide. Later
rules may assume that earlier ones held. ``force`` (the negative control of the tests) skips the hazard rules.
Legality is decided on byte ranges of the plan, as ggml-cuda decides it, never on tensor identity.

What is generic lives here, derived from the rewrite rather than written per pattern:

- a :class:`Capture` says what the rewrite removes (:meth:`Capture.removed`) and what the fused node writes
  (:meth:`Capture.written`, its primary output first); the rest of the removed nodes are the subgraph's *interior*;
- :func:`confined`, ggml's ``ggml_can_fuse_subgraph`` condition: every interior node is read only by removed nodes
  and is not OUTPUT. A capture names the *role* of each interior node (:attr:`Capture.ROLES`), and a refusal is
  named after it (``concat.user-count``); interior nodes whose uses a structural rule already pins as part of the
  pattern's shape are listed in :attr:`Capture.SHAPED`, with that rule;
- :func:`between`, the nodes in between: every kernel node inside the span the capture declares
  (:meth:`Capture.span`: first node, fused position, last node) that the rewrite does not remove, with the byte
  ranges it reads and writes, checked against byte ranges the pattern names, before or after the fused position;
- :class:`Context`, the per-pass index (positions, :class:`gdnpass.ir.Uses`, memoised byte ranges);
- :func:`rule_block` / :func:`rule_block_problems`: a matcher module opens with its legality rules as one numbered
  block, the bracketed names in the order the code runs them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable

from gdnpass.ir import Flag, Graph, Tensor, Uses, byte_range, inputs, outputs, ranges_overlap, runs_kernel

Range = tuple[str, int, int]  # (buffer, lo, hi)

STRUCTURAL = "structural"
HAZARD = "hazard"


@dataclass(frozen=True)
class Why:
    """What a rule says when it refuses: the node at fault, a sentence, and for aliasing rules the colliding ranges.
    ``rule``: the refusal's name when the rule reports several (the generic :func:`confined` names the node's role)."""

    node: Tensor
    reason: str
    ranges: tuple[Range, Range] | None = None
    rule: str | None = None


@dataclass(frozen=True)
class Rule:
    name: str
    kind: str                                      # STRUCTURAL or HAZARD
    check: Callable[[Any, "Context"], Why | None]
    names: tuple[str, ...] = ()                    # the refusal names of a rule that reports several (else its name)

    @property
    def refusals(self) -> tuple[str, ...]:
        """The names a refusal by this rule may carry, in the order the rule checks them."""
        return self.names or (self.name,)


def rule(name: str, kind: str = STRUCTURAL) -> Callable[[Callable], Rule]:
    """Decorator: a check function becomes a named Rule."""
    return lambda fn: Rule(name, kind, fn)


def refusal_names(rules: Iterable[Rule]) -> list[str]:
    """Every name a refusal by ``rules`` may carry, in the order they run (what a rule block lists)."""
    return [n for r in rules for n in r.refusals]


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
        refusal = Refusal(pattern.name, why.rule or r.name, why.node, why.reason, cap.layer, why.ranges)
        if r.kind == STRUCTURAL or not force:
            return Decision(None, refusal)
        break
    removed = cap.removed()
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
        why = r.check(cap, ctx)
        if why is not None:
            out.append(why.rule or r.name)
            if r.kind == STRUCTURAL:
                break
    return out


@dataclass
class Context:
    """Per-pass state a matcher may use: the current node positions and use index, and the between-check flavour."""

    graph: Graph
    between: str = "narrow"  # "narrow": the seed's rules; "broad": no in-between node touches any chain buffer
    pos: dict[int, int] = field(default_factory=dict)
    _uses: Uses | None = None
    _ranges: dict[int, Range | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Index the graph state: positions now, the use index on first use (the pair needs none)."""
        self.pos = {n.uid: i for i, n in enumerate(self.graph.nodes)}
        self._uses, self._ranges = None, {}

    @property
    def use_index(self) -> Uses:
        if self._uses is None:
            self._uses = Uses(self.graph.nodes)
        return self._uses

    def uses(self, t: Tensor) -> int:
        """ggml's use count of ``t`` (one per src slot)."""
        return self.use_index.count(t)

    def users(self, t: Tensor) -> list[Tensor]:
        """Nodes reading ``t`` through a src slot, in execution order."""
        return self.use_index.users(t)

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


def same_elements(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` are the same elements of the same memory (an in-place op's output and its input): a program
    that reads its elements before it writes them may have its output there."""
    return byte_range(a)[:2] == byte_range(b)[:2] and a.ne == b.ne and a.nb == b.nb and a.type is b.type


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


# ---- the capture ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Between:
    """A kernel node inside a candidate's span that the rewrite does not remove, with the byte ranges it reads and
    writes."""

    node: Tensor
    after: bool   # after the fused position
    reads: list
    writes: list


class Capture:
    """The base of every pattern's typed capture (a dataclass of the candidate's named nodes).

    A subclass says what the rewrite does; the generic rules derive the rest:

    - :attr:`anchor` and :attr:`layer`: where the fused node goes, and the layer it reports;
    - :meth:`removed`: the nodes the fused node replaces (the subgraph), in order, without None;
    - :meth:`written`: the tensors the fused node writes (its primary output first, then ``outs``): they stay
      visible after the rewrite, so users outside the subgraph may read them;
    - :attr:`ROLES`: role name -> the capture attributes holding interior nodes (each a tensor or a list of them):
      :func:`confined` checks their uses and names its refusal ``<role>.user-count``;
    - :attr:`SHAPED`: description -> the structural rule that pins those interior nodes' uses as part of the
      pattern's shape (a window read by exactly one CPY, say); :func:`confined` leaves them to it;
    - :meth:`span`: (first node, fused position, last node) of the rewrite, as node indices: the nodes in between.
    """

    ROLES: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = ()
    SHAPED: ClassVar[tuple[tuple[str, str], ...]] = ()

    @property
    def anchor(self) -> Tensor:
        raise NotImplementedError

    @property
    def layer(self) -> int | None:
        return self.anchor.layer

    def removed(self) -> list[Tensor]:
        raise NotImplementedError

    def written(self) -> list[Tensor]:
        raise NotImplementedError

    def shaped(self) -> list[Tensor]:
        """The interior nodes :attr:`SHAPED`'s rules confine (none by default)."""
        return []

    def span(self, ctx: "Context") -> tuple[int, int, int]:
        raise NotImplementedError

    def between_skip(self) -> Iterable[Tensor]:
        """Nodes inside the span that are not in between although the rewrite keeps them (none by default)."""
        return ()

    # ---- derived --------------------------------------------------------------------------------------------------
    def role_nodes(self) -> list[tuple[str, Tensor]]:
        """(role, node) of every node :attr:`ROLES` names, in its order."""
        out = []
        for role, attrs in self.ROLES:
            for a in attrs:
                v = getattr(self, a)
                out += [(role, t) for t in (v if isinstance(v, list) else [v]) if t is not None]
        return out

    def interior(self) -> list[Tensor]:
        """What the rewrite removes and the fused node does not write."""
        written = {t.uid for t in self.written() if t is not None}
        return [t for t in self.removed() if t.uid not in written]

    def between(self, ctx: "Context") -> list[Between]:
        """The nodes in between (computed once per candidate: every between-rule scans them)."""
        cached = self.__dict__.get("_between")
        if cached is None:
            start, at, end = self.span(ctx)
            skip = {t.uid for t in self.removed()} | {t.uid for t in self.between_skip()}
            cached = self.__dict__["_between"] = [
                Between(n, i > at, ctx.node_reads(n), ctx.node_writes(n))
                for i, n in enumerate(ctx.graph.nodes[start:end + 1], start) if n.uid not in skip and runs_kernel(n)]
        return cached


# ---- the generic rules ----------------------------------------------------------------------------------------------


def confined(capture_type: type[Capture]) -> Rule:
    """Use confinement, ggml's ``ggml_can_fuse_subgraph``: every interior node of the subgraph (removed, not written
    by the fused node) has all its users among the removed nodes and is not OUTPUT. The refusal names the node's
    role, ``<role>.user-count``; an interior node with no role (nor a shape rule) is a bug of the pattern."""
    names = tuple(f"{role}.user-count" for role, _ in capture_type.ROLES)

    def check(c: Capture, ctx: Context):
        removed = {t.uid for t in c.removed()}
        roles = c.role_nodes()
        covered = {t.uid for _, t in roles} | {t.uid for t in c.shaped()}
        stray = [t.name for t in c.interior() if t.uid not in covered]
        if stray:
            raise RuntimeError(f"{type(c).__name__}: interior nodes {stray} have no role (ROLES) and no shape rule "
                               "(SHAPED): their uses would go unchecked")
        for role, t in roles:
            outside = [u for u in ctx.users(t) if u.uid not in removed]
            if outside or t.flags & Flag.OUTPUT:
                why = (f"read by {outside[0].name!r} outside the fused subgraph" if outside else "flagged OUTPUT")
                return Why(t, f"{t.name!r} ({role}) is {why}: the rewrite removes it ({ctx.uses(t)} uses)",
                           rule=f"{role}.user-count")

    return Rule("user-count", STRUCTURAL, check, names)


@dataclass(frozen=True)
class Clause:
    """One thing no node in between may do: on ``side`` ("before", "after" the fused position, or "both"), read,
    write or touch (``access`` "r", "w", "rw") the byte ranges ``targets(capture)``. ``what`` is the refusal's
    sentence, with ``{node}`` (the node in between) and ``{hit}`` (the target it hit)."""

    side: str
    access: str
    targets: Callable[[Any], Iterable[Tensor | None]]
    what: str


def between(name: str, *clauses: Clause) -> Rule:
    """A hazard rule over the nodes in between (:meth:`Capture.between`): the first node, in node order, that breaks
    a clause (in the order given) is the refusal, with the two colliding byte ranges."""

    def check(c: Capture, ctx: Context):
        targets = [ctx.ranges(cl.targets(c)) for cl in clauses]
        for b in c.between(ctx):
            for cl, ts in zip(clauses, targets):
                if cl.side != "both" and (cl.side == "after") is not b.after:
                    continue
                mine = b.writes if cl.access == "w" else b.reads if cl.access == "r" else b.writes + b.reads
                hit = first_collision(mine, ts)
                if hit:
                    return collision(b.node, cl.what.format(node=repr(b.node.name), hit=repr(hit[3].name)), hit)

    return Rule(name, HAZARD, check)


def _minus(piece: Range, w: Range) -> list[Range]:
    """The parts of byte range ``piece`` outside ``w``."""
    buf, lo, hi = piece
    if w[0] != buf or w[2] <= lo or hi <= w[1]:
        return [piece]
    return [r for r in ((buf, lo, w[1]), (buf, w[2], hi)) if r[1] < r[2]]


def read_before_written(ctx: Context, pieces: list[tuple[Range, Tensor]], after: int, written: Iterable = ()) \
        -> Why | None:
    """A hazard check for bytes the fused node leaves unwritten (``pieces``, each with the tensor it belongs to):
    minus the ``written`` ranges, follow them through the nodes after index ``after`` until every byte is written
    again (by a tensor of packed elements: its byte range is all written); the first node that reads a byte still
    unwritten is the refusal."""
    for w, _ in written:
        pieces = [(p, t) for r, t in pieces for p in _minus(r, w)]
    for n in ctx.graph.nodes[after + 1:]:
        if not pieces:
            return None
        if not runs_kernel(n):
            continue
        hit = first_collision(ctx.node_reads(n), pieces)
        if hit:
            return collision(n, f"{n.name!r} reads bytes of {hit[3].name!r}, which the fused node does not write",
                             hit)
        for w, t in ctx.node_writes(n):
            if t.is_contiguous():
                pieces = [(p, s) for r, s in pieces for p in _minus(r, w)]
    return None


# ---- the rule block -------------------------------------------------------------------------------------------------

RULE_NAME = re.compile(r"\[([A-Za-z][\w-]*(?:\.[\w-]+)+)\]")  # [structure.concat], [between.touches-chain-buffer]


def rule_block(doc: str) -> list[str]:
    """The bracketed rule names of a docstring's rule block (from "Legality rules" to the next blank line), in the
    order they are listed. (Shapes such as ``[d_conv-1, C, 1]`` in the block are not names: no dot, spaces.)"""
    start = (doc or "").find("Legality rules")
    if start < 0:
        return []
    end = doc.find("\n\n", start)
    return RULE_NAME.findall(doc[start:] if end < 0 else doc[start:end])


def rule_block_problems(doc: str, modes: dict[str, list[str]]) -> list[str]:
    """What is wrong between a docstring's rule block and the refusal names each mode runs (empty: they agree)."""
    if "Legality rules" not in (doc or ""):
        return ["no 'Legality rules' block in the docstring"]
    listed = rule_block(doc)
    problems = [f"listed twice: {n}" for n in sorted({n for n in listed if listed.count(n) > 1})]
    in_code = {n for names in modes.values() for n in names}
    problems += [f"in the docstring, not in code: {n}" for n in listed if n not in in_code]
    problems += [f"in code, not in the docstring: {n}" for n in sorted(in_code - set(listed))]
    for mode, names in modes.items():
        order = [n for n in listed if n in names]
        if order != [n for n in names if n in listed]:
            problems.append(f"{mode}: docstring order {order} is not the code's {names}")
    return problems
