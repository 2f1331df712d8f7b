"""Trip graphs: one small graph per legality rule of a registered pattern that breaks that rule and no other, and for
a hazard rule a graph where forcing the rewrite past it corrupts bytes (tests/patterns/test_rules.py runs them).

Each pattern keeps its own in its test folder, ``tests/patterns/<folder>/trips.py``, where ``<folder>`` is its
matcher's package (:func:`folder`). The module has:

- ``TRIPS``: :class:`Trip` s, at least one per refusal name of every between-mode (``Pattern.modes``);
- ``candidate(t=None, mutate=True) -> (graph, pattern, anchor)``: the trip's graph, planned, mutated unless
  ``mutate=False`` (``t=None``: the plain graph, which fuses), a fresh matcher and the candidate's anchor;
- ``kernels(t)``: the kernel table of a hazard's force proof (the torch references' table, named: on a GPU the
  executor's default is Triton; or Triton kernels for a race between the programs of one launch, which shows
  deterministically only in the interpreter and so skips on CUDA);
- optionally ``CHECK`` (``check_fusion`` keywords, the chain's ``ids``) and ``unguard(t, monkeypatch)`` (switches off
  a launcher's own check that would refuse the forced rewrite before it corrupts anything).

The force proofs run on the test's device.

This module holds what the tests share: the :class:`Trip` record, :class:`Only`, the rule names and kinds of a
registry entry, what a trips module lacks, and the graph edits the trips modules make (:func:`nodes`, :func:`fresh`,
:func:`insert_after`, :func:`planned_graph`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

from gdnpass.ir import Flag, Graph, Tensor
from gdnpass.patterns.common import Context, Rule, refusal_names

BETWEEN = ("narrow", "broad")  # the between-check flavours fuse knows
PARTS = ("TRIPS", "candidate", "kernels")  # what every trips module has


@dataclass(frozen=True)
class Trip:
    """A graph that trips ``rule`` (the bare refusal name) alone: the pattern's graph with ``config``, then
    ``mutate``, decided in between-mode ``between``."""

    rule: str
    mutate: Callable | None = None
    config: dict = field(default_factory=dict)
    between: str = "narrow"
    corrupts: bool = True      # hazards: forcing corrupts bytes (False: a graph the rule refuses but that is safe)
    kernels: str = "torch"     # hazards: the kernels of the force proof (the trips module's ``kernels(t)`` reads it)
    name: str = ""

    @property
    def id(self) -> str:
        return self.rule + (f"[{self.name}]" if self.name else "") + (f"-{self.between}" if self.between != "narrow"
                                                                      else "")


class Only:
    """One pattern restricted to one candidate (so fuse and check_fusion decide that candidate alone)."""

    def __init__(self, pattern, anchor):
        self._pattern, self._anchor = pattern, anchor

    def candidates(self, graph):
        return [self._anchor]

    def __getattr__(self, name):
        return getattr(self._pattern, name)


def folder(p) -> str:
    """The test folder of registry entry ``p``: its matcher's package (gdnpass.patterns.<folder>.matcher)."""
    return p.matcher.__module__.split(".")[2]


def trips_of(p) -> ModuleType | None:
    """``patterns.<folder>.trips`` of registry entry ``p``, or None where there is none."""
    name = f"patterns.{folder(p)}.trips"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):  # not found: no such module
            return None
        raise


def trips_problems(p) -> list[str]:
    """What registry entry ``p``'s trip graphs lack, as sentences (empty: a trips module with every part)."""
    module = trips_of(p)
    if module is None:
        return [f"no tests/patterns/{folder(p)}/trips.py (its TRIPS, candidate(), kernels())"]
    return [f"tests/patterns/{folder(p)}/trips.py has no {part}" for part in PARTS if not hasattr(module, part)]


def trips(p) -> list[Trip]:
    module = trips_of(p)
    return list(getattr(module, "TRIPS", [])) if module is not None else []


def rules(matcher, mode: str = "narrow") -> tuple[Rule, ...]:
    return tuple(matcher.rules(Context(Graph(), mode)))


def rule_names(matcher, modes) -> list[str]:
    """Every refusal name ``matcher`` reports in any of ``modes``, sorted."""
    return sorted({n for m in modes for n in refusal_names(rules(matcher, m))})


def kinds(p) -> dict[str, str]:
    """Refusal name -> STRUCTURAL or HAZARD, over every between-mode of registry entry ``p``."""
    return {name: r.kind for m in p.modes for r in rules(p.matcher(), m) for name in r.refusals}


def uncovered(matcher, modes, trip_list) -> list[str]:
    """The refusal names of ``matcher`` (every mode of ``modes``) that no trip graph of ``trip_list`` covers."""
    return sorted(set(rule_names(matcher, modes)) - {t.rule for t in trip_list})


# ---- graph edits the trips modules share ----------------------------------------------------------------------------


def nodes(g: Graph) -> dict[str, Tensor]:
    return {n.name: n for n in g.nodes}


def fresh(g: Graph, t: Tensor, offset: int | None = None) -> int:
    """Give non-view ``t`` bytes of its own past the arena's end (or at arena ``offset``); returns its offset."""
    t.offset = g.buffers["arena"] if offset is None else offset
    g.buffers["arena"] = max(g.buffers["arena"], t.offset + t.nbytes)
    return t.offset


def spread_columns(g: Graph, t: Tensor) -> None:
    """Non-view f32 ``t`` with its columns (dims 1-3) twice as far apart as its rows need, on bytes of its own: a
    layout no packed kernel store may assume."""
    n0, n1, n2 = t.ne[:3]
    t.nb = (4, 8 * n0, 8 * n0 * n1, 8 * n0 * n1 * n2)
    fresh(g, t)


def insert_after(g: Graph, anchor: Tensor, node: Tensor) -> Tensor:
    node.buffer = "arena"
    fresh(g, node)
    node.flags |= Flag.COMPUTE
    g.nodes.insert(g.index(anchor) + 1, node)
    return node


def planned_graph(last: Tensor, extra_reader: Tensor | None = None) -> Graph:
    """A trip graph ending at ``last``: SCALE ``l_out-0`` of it (the output ``run --check`` compares), with
    ``extra_reader`` an interior node a second output ``l_out-other`` also reads (a user-count trip), planned."""
    from gdnpass import ops
    from gdnpass.alloc import plan

    out = ops.scale(last, 2.0)
    out.name = "l_out-0"
    out.flags |= Flag.OUTPUT
    g = Graph()
    g.expand(out)
    if extra_reader is not None:
        other = ops.scale(extra_reader, 3.0)
        other.name = "l_out-other"
        other.flags |= Flag.OUTPUT
        g.expand(other)
    plan(g)
    return g
