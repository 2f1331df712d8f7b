"""What every matcher shares: the Match/Refusal values and byte-range helpers over the memory plan.

A matcher is a plain object with a ``name``, ``candidates(graph)`` (the anchor nodes it looks at) and
``match(graph, anchor, ctx) -> Match | Refusal | None`` (None: not this pattern at all). A refusal is a value,
never an exception: it names the rule (a short stable string such as ``cpy-run.row-written-twice``), the node at
fault and, for aliasing rules, the two byte ranges that collide. ``rewrite(graph, match)`` builds the fused node.
Legality is decided on byte ranges of the plan, as ggml-cuda decides it, never on tensor identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from gdnpass.ir import Graph, Tensor, byte_range, inputs, outputs, ranges_overlap

Range = tuple[str, int, int]  # (buffer, lo, hi)


@dataclass
class Match:
    pattern: str
    anchor: Tensor                 # the fused node runs at this node's position
    layer: int | None
    captures: dict                 # named captures (tensors or lists of tensors)
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
class Context:
    """Per-pass state a matcher may use: the current node positions and use counts, and the between-check flavour."""

    graph: Graph
    between: str = "narrow"  # "narrow": the seed's rules; "broad": no in-between node touches any chain buffer
    check_hazards: bool = True  # False only for fuse(force=True), the negative control
    pos: dict[int, int] = field(default_factory=dict)
    use_counts: dict[int, int] = field(default_factory=dict)
    _users: dict[int, list[Tensor]] = field(default_factory=dict)
    _ranges: dict[int, Range | None] = field(default_factory=dict)

    def refresh(self) -> None:
        """Index the graph once per pattern (positions, ggml use counts, users), so matching stays linear."""
        self.pos, self.use_counts, self._users, self._ranges = {}, {}, {}, {}
        for i, n in enumerate(self.graph.nodes):
            self.pos[n.uid] = i
            seen = set()
            for s in n.src:
                if s is None:
                    continue
                self.use_counts[s.uid] = self.use_counts.get(s.uid, 0) + 1  # one use per src slot, as ggml counts
                if s.uid not in seen:
                    seen.add(s.uid)
                    self._users.setdefault(s.uid, []).append(n)

    def uses(self, t: Tensor) -> int:
        return self.use_counts.get(t.uid, 0)

    def users(self, t: Tensor) -> list[Tensor]:
        """Nodes reading ``t`` through a src slot, in execution order."""
        return self._users.get(t.uid, [])

    def ranges(self, ts: Iterable[Tensor]) -> list[tuple[Range, Tensor]]:
        """The byte ranges of tensors, skipping empty ones (they touch nothing); memoised for this graph state."""
        out = []
        for t in ts:
            if t is None:
                continue
            r = self._ranges.get(t.uid)
            if r is None:
                r = self._ranges[t.uid] = None if t.is_empty else byte_range(t)
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
