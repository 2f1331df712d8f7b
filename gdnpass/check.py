"""Fused vs unfused, byte for byte: the product's promise, as one reusable check.

The same executor runs the graph twice from the same starting bytes: first unfused, then (after the pass rewrote
the graph in place) fused. Compared are the tensors the rewrite writes or feeds (SiLU output, q/k L2 outputs,
mat-vec products), the layer outputs, and the whole caches; intermediates are read just before their last reader
(see ``Executor.run(probes=...)``), caches at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gdnpass.fusion import FusionReport, fuse
from gdnpass.ir import Graph, Tensor, buffer_role
from gdnpass.models.fill import fill
from gdnpass.patterns import watched as pattern_watches
from gdnpass.runtime import Executor


@dataclass
class Compared:
    name: str
    identical: bool
    nbytes: int
    first_diff: int | None = None  # byte offset of the first difference
    values: tuple | None = None    # (unfused, fused) element at that offset, as floats

    def to_json(self) -> dict:
        d = {"tensor": self.name, "identical": self.identical, "bytes": self.nbytes}
        if not self.identical:
            d.update(first_differing_byte=self.first_diff, unfused=self.values[0], fused=self.values[1])
        return d


@dataclass
class CheckResult:
    report: FusionReport
    compared: list[Compared] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return all(c.identical for c in self.compared)

    def to_json(self) -> dict:
        return {"identical": self.identical, "fusion": self.report.to_json(),
                "tensors": [c.to_json() for c in self.compared]}


def watched(graph: Graph) -> list[Tensor]:
    """What the fused graph must reproduce: every output a registered pattern's record asks to compare (its
    ``watch``: the chain's SiLU and q/k norms, the mat-vec products, ...), the layer outputs, and where the graph
    comes fused already (a pattern that takes fused nodes, gdn_gates, checked alone), its fused nodes' primary
    outputs."""
    fused = [n.view_src for n in graph.nodes if n.op.is_fused and n.view_src is not None]
    return [n for n in graph.nodes if pattern_watches(n) or n.name.startswith("l_out")] + fused


def interior(graph: Graph, probes: list[Tensor]) -> set[int]:
    """The uids of the ``probes`` the rewrites removed from ``graph`` and no fused node writes: a pattern's interior
    (the MUL of an RMS_NORM+MUL+ADD, say), which its confinement rule proved only the removed nodes read."""
    kept = {n.uid for n in graph.nodes}
    written = {t.uid for n in graph.nodes if n.op.is_fused for t in (n.view_src, *n.outs) if t is not None}
    return {t.uid for t in probes if t.uid not in kept and t.uid not in written}


def unwatched(graph: Graph, report: FusionReport, probes: list[Tensor]) -> list[str]:
    """What the fused nodes of ``report`` write that the check would not compare (neither a probe nor in a cache),
    as sentences naming the pattern: its record's ``watch`` misses an output. (Empty for every registered pattern;
    the check refuses to pass without comparing what fusion changed.)"""
    seen = {t.uid for t in probes}
    pattern = {a.node: a.pattern for a in report.applied}
    out = []
    for n in graph.nodes:
        if n.name in pattern and n.op.is_fused:
            for t in [n.view_src, *n.outs]:
                if t.uid not in seen and not (t.base.buffer and buffer_role(graph, t.base.buffer) == "cache"):
                    out.append(f"{pattern[n.name]}: {n.name!r} writes {t.name!r}, which its record's watch misses")
    return out


def written_part(graph: Graph) -> dict[int, int]:
    """{uid: bytes} of the primary outputs that a fused node writes only the head of: GATED_DELTA_NET_CACHE writes its
    op's scores, not the snapshot slots the absorbed CPY read (its confinement rules prove nothing else reads them).
    A fused node is a packed view at offset 0 of its primary output (``FusedOp.validate``)."""
    out = {}
    for n in graph.nodes:
        if n.op.is_fused and n.view_src is not None and n.nbytes < n.view_src.nbytes:
            if not (n.is_contiguous() and n.view_src.is_contiguous()):
                raise RuntimeError(f"{n.name!r} writes part of {n.view_src.name!r}, not a packed head of it")
            out[n.view_src.uid] = n.nbytes
    return out


def _compare(name: str, a: torch.Tensor, b: torch.Tensor, nbytes: int | None = None) -> Compared:
    """Byte for byte; ``nbytes``: only the first so many (:func:`written_part`)."""
    ab, bb = (t.contiguous().view(torch.uint8).reshape(-1)[:nbytes] for t in (a, b))
    if torch.equal(ab, bb):
        return Compared(name, True, ab.numel())
    first = int((ab != bb).nonzero()[0])
    es = a.element_size()
    i = first // es
    return Compared(name, False, ab.numel(), first, (float(a.reshape(-1)[i]), float(b.reshape(-1)[i])))


def memory_needed(graph: Graph, device: str = "cpu") -> dict[str, int]:
    """What :func:`check_fusion` holds besides the graph's buffers (for the executor's memory check): the snapshot
    of every buffer it restores before the fused run, and, on the CPU (where they live too), the copies of the caches
    and of the watched tensors it compares."""
    need = {"the check's snapshot of every buffer": sum(graph.buffers.values())}
    if torch.device(device).type == "cpu":
        need["the check's copies of caches and watched tensors"] = (
            sum(t.nbytes for t in watched(graph))
            + sum(t.nbytes for t in graph.leafs if t.buffer and buffer_role(graph, t.buffer) == "cache"))
    return need


def check_fusion(graph: Graph, device: str = "cpu", backend: str | None = None, seed: int = 0,
                 ids: list[int] | None = None, between: str = "narrow", force: bool = False,
                 patterns: list | None = None, progress=None, weights=None,
                 extra: dict[str, int] | None = None) -> CheckResult:
    """Run ``graph`` (planned, unfused) unfused then fused from identical inputs; the graph is left fused.
    ``weights(executor)``, if given, writes the weights after the seeded fill (a model file's, say); ``extra`` is
    the memory that needs besides the buffers (counted with :func:`memory_needed` before anything is allocated).
    The unfused run is the plainest: every quantized product quantizes its own activations; the fused one runs as
    the executor does, its pre-passes shared and made by their producers (gdnpass.prepasses), so the check
    compares those too."""
    probes = watched(graph)
    ex = Executor(graph, device=device, backend=backend, extra={**(extra or {}), **memory_needed(graph, device)})
    fill(ex, seed=seed, ids=ids)
    if weights is not None:
        weights(ex)
    start = ex.snapshot()
    sharing, ex.share_pre_passes = ex.share_pre_passes, False
    unfused = ex.run_probed(probes, progress=progress)
    ex.share_pre_passes = sharing
    caches = [(t, ex.read(t)) for t in graph.leafs if t.buffer and buffer_role(graph, t.buffer) == "cache"]
    report = fuse(graph, enabled=True, between=between, force=force, patterns=patterns)
    missed = unwatched(graph, report, probes)
    if missed:  # a pattern's bug: the check would pass without comparing what the rewrite changed
        raise RuntimeError("check_fusion would not compare what fusion writes: " + "; ".join(missed[:3]))
    ex.restore(start)
    del start
    gone = interior(graph, probes)  # computed by the unfused graph only: nothing reads them any more
    unfused = [a for t, a in zip(probes, unfused) if t.uid not in gone]
    probes = [t for t in probes if t.uid not in gone]
    fused = ex.run_probed(probes, progress=progress)
    res = CheckResult(report)
    part = written_part(graph)
    for t, a, b in zip(probes, unfused, fused):
        res.compared.append(_compare(t.name, a, b, part.get(t.uid)))
    for t, before in caches:
        res.compared.append(_compare(t.name, before, ex.read(t)))
    return res
