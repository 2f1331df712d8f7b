"""The pipeline, as one call: front end -> prepare -> plan -> fuse.

    source ──> Graph ──> prepare (if fusion is on) ──> plan (if not planned yet) ──> fuse (if fusion is on)

A source is a :class:`~gdnpass.models.VerifyConfig` (the builder), a graph file path (:mod:`gdnpass.serialize`) or a
:class:`~gdnpass.ir.Graph` (any other front end). ``gdnpass run``, ``dump`` and ``check``, the benchmarks and the
tests all go through :func:`run`, so the order of the steps is written down once. Fusion is decided on the
unfused plan, as ggml-cuda decides it; ``prepare`` only runs when fusion is on, so a graph planned with fusion off
is exactly llama.cpp's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gdnpass.alloc import DEFAULT_ALIGNMENT, MAX_ALIGNMENT, Binding, bind, plan
from gdnpass.errors import GraphError
from gdnpass.fusion import FusionReport, env_enabled, fuse, prepare
from gdnpass.ir import Graph, Tensor, arena_buffer
from gdnpass.models import VerifyConfig, build_verify_graph

Source = VerifyConfig | Graph | str | os.PathLike


@dataclass(frozen=True)
class PassOptions:
    """How the pass runs: whether (None: ``GDN_FUSION`` decides), at which arena alignment, which between-check."""

    fusion: bool | None = None
    alignment: int = DEFAULT_ALIGNMENT
    between: str = "narrow"
    hints: bool = True  # False: plan without the patterns' pre-plan step (tests and benchmarks of the fallback)

    def __post_init__(self) -> None:
        if self.alignment < 1 or self.alignment & (self.alignment - 1) or self.alignment > MAX_ALIGNMENT:
            raise GraphError(f"alignment must be a power of two, 1..{MAX_ALIGNMENT}, is {self.alignment}")
        if self.between not in ("narrow", "broad"):
            raise GraphError(f"between must be 'narrow' or 'broad', is {self.between!r}")

    @property
    def enabled(self) -> bool:
        return env_enabled() if self.fusion is None else self.fusion


@dataclass
class Planned:
    """What the pipeline made: the graph (planned; fused when fusion is on), the node list fusion started from, the
    report, and a one-line description of the source."""

    graph: Graph
    source: str
    before: list[Tensor] = field(default_factory=list)
    report: FusionReport | None = None
    binding: Binding | None = None  # with ``reserve``: bound to the reserve plan, or (reallocated) planned itself


def load(source: Source) -> tuple[Graph, str]:
    """The front end: the graph of ``source`` (unplanned unless a file holds a plan) and its description."""
    from gdnpass.serialize import load as load_file  # serialize builds on the IR only: no cycle

    if isinstance(source, VerifyConfig):
        graph = build_verify_graph(source)
        return graph, describe(graph)
    if isinstance(source, Graph):
        return source, source.meta.get("source", "graph")
    if isinstance(source, (str, os.PathLike)):
        return load_file(source), f"graph file {os.fspath(source)}"
    raise GraphError(f"cannot build a graph from a {type(source).__name__}")


def describe(graph: Graph) -> str:
    """A built graph's title: model, layers, widths."""
    c = graph.meta.get("config")
    if not c:
        return graph.meta.get("source", "graph")
    n = len(graph.meta["layers"])
    return (f"{c['model']}, {n} GDN layer{'s' if n != 1 else ''} {graph.meta['layers']}, n_t={c['n_tokens']}, "
            f"n_rs_seq={c['n_rs_seq']}, seqs={c['n_seqs']}, snapshot layout {c['snapshot_layout']}"
            + (f", dflash taps {graph.meta['dflash_taps']}" if c["dflash"] else ""))


def run(source: Source, options: PassOptions = PassOptions(), *, fuse_now: bool = True,
        reserve: Graph | None = None) -> Planned:
    """Build (or read) the graph, prepare it for fusion when fusion is on, plan it unless it has a plan, and fuse it
    when fusion is on and ``fuse_now`` (``check`` fuses later itself, after running the unfused graph).

    ``reserve`` (a graph from :func:`reserve_plan` with the same options): place the graph as llama.cpp places every
    ubatch's graph, on the one plan it reserved at ``n_ubatch`` tokens (:func:`gdnpass.alloc.bind`), not on a plan
    of its own; its weights, caches and inputs are laid out as the reserve's (same topology, same leaf order)."""
    graph, what = load(source)
    on = options.enabled
    binding = None
    if arena_buffer(graph) is None:  # (a captured graph comes with llama.cpp's plan)
        prepare(graph, enabled=on and options.hints)
        if reserve is None:
            plan(graph, options.alignment)
        else:
            binding = _bind(reserve, graph)
    result = Planned(graph, what, list(graph.nodes), binding=binding)
    if fuse_now:
        result.report = fuse(graph, enabled=on, between=options.between)
    return result


def reserve_plan(source: Source, options: PassOptions = PassOptions()) -> Graph:
    """llama.cpp's reserve step: the worst-case graph (``n_ubatch`` tokens, every KV cell), prepared as the graphs
    bound to it will be, and planned. :func:`run` with ``reserve=`` binds each ubatch's graph to it."""
    graph, _ = load(source)
    if arena_buffer(graph) is not None:
        raise GraphError("reserve_plan: the reserve graph is planned already")
    prepare(graph, enabled=options.enabled and options.hints)
    plan(graph, options.alignment)
    return graph


def _bind(reserve: Graph, graph: Graph) -> Binding:
    """Bind ``graph`` (prepared, unplanned) to ``reserve``'s plan: its own leafs packed as plan() packs them, then
    gallocr's slot-by-slot binding. Slots are positions, so the two graphs must have one topology (op by op)."""
    from gdnpass.alloc import _place_leafs

    arena = arena_buffer(reserve)
    if arena is None:
        raise GraphError("reserve graph has no memory plan: make it with reserve_plan()")
    ops = lambda g: [(n.op, len(n.src)) for n in g.nodes]  # noqa: E731
    if ops(graph) != ops(reserve):
        raise GraphError(f"graph and reserve graph differ in topology ({len(graph.nodes)} vs {len(reserve.nodes)} "
                         "nodes): a graph is bound to the reserve plan slot by slot")
    own = _place_leafs(graph, reserve.alignment)
    b = bind(reserve, graph, arena)
    if not b.reallocated:
        graph.buffers = {**own, arena: reserve.buffers[arena]}
    for name in own:
        if name in reserve.buffers and own[name] != reserve.buffers[name] and name != "input":
            raise GraphError(f"graph's {name} buffer ({own[name]} bytes) is not the reserve's ({reserve.buffers[name]})"
                             ": the two cannot share it")
    return b
