"""Trip graphs of the gdn_state_gather rules (tests/patterns/test_rules.py runs them, with every registered pattern's):
the small planned verify graph (tests/support/surgery.py: one layer, n_t 4, two cells; the force proofs' ids gather
row 7, plane 3 of cell 1: a row past the snapshot rows' span, so that the unfused GDN's own overlap guard, which
compares spans, takes scores there) with its GDN and snapshot CPY fused into a GATED_DELTA_NET_CACHE (the pattern this one
takes its node from), then one mutation per rule that breaks that rule and no other; for every hazard a graph where
forcing the rewrite past it corrupts bytes.

``gather.output-overlaps-input`` is a race between the programs of one Triton launch (a program storing its scores
over the state slice a later program gathers): its proof runs the GDN kernel, plain and fused, in the interpreter,
with the launcher's own overlap guard switched off (``unguard``).
"""

from __future__ import annotations

from gdnpass import ops
from gdnpass.fusion import fuse
from gdnpass.ir import DType, Flag, Graph, Op, Tensor, byte_range
from gdnpass.kernels import backends
from gdnpass.kernels import triton_ssm
from gdnpass.patterns.gdn_state_cache import GdnStateCache
from gdnpass.patterns.gdn_state_gather import GdnStateGather
from support.graphs import triton_for
from support.surgery import chain, feed_layer_output, insert_after, planned
from support.trips import Trip, fresh

IDS = [7]  # the row the force proofs gather (module docstring)
CHECK = dict(ids=IDS)  # check_fusion's keywords for the force proofs


def prepared(**config) -> Graph:
    """The planned graph with the cache fusion applied (its GATED_DELTA_NET_CACHE is this pattern's candidate)."""
    g = planned(**config)
    fuse(g, enabled=True, patterns=[GdnStateCache()])
    return g


def parts(g: Graph) -> dict:
    """The GDN node, the RESHAPE it reads as its state, the GET_ROWS under it, the cache rows and the ids."""
    gdn = next(n for n in g.nodes if n.op is Op.GATED_DELTA_NET_CACHE)
    view = gdn.src[5]
    get_rows = view.src[0]
    return dict(gdn=gdn, view=view, get_rows=get_rows, rows=get_rows.src[0], ids=get_rows.src[1])


def _row_offset(p: dict) -> int:
    """The cache-buffer offset of the row the ids gather (IDS[0])."""
    rows = p["rows"]
    return rows.base.offset + rows.view_offs + IDS[0] * rows.nb[1]


# ---- one mutation per rule ------------------------------------------------------------------------------------------


def m_gathered_f16(g):
    """The gathered rows in f16 (a converting GET_ROWS)."""
    t = parts(g)["get_rows"]
    t.type = DType.F16
    t.nb = tuple(n // 2 for n in t.nb)


def m_gathered_output(g):
    parts(g)["get_rows"].flags |= Flag.OUTPUT


def m_row_written_between(g):
    """Right after the GET_ROWS, a node writes other bytes (a row's worth of an arena tensor of its own) over the
    gathered row of the cache (unfused the GET_ROWS has copied it by then)."""
    p = parts(g)
    other = ops.new_tensor("other-row", DType.F32, (p["get_rows"].ne[0],), buffer="arena")
    fresh(g, other)
    g.leafs.append(other)
    insert_after(g, p["get_rows"], ops.scale(other, 2.0), offset=_row_offset(p), buffer="cache")


def m_scores_over_the_row(g):
    """The GDN's output on the gathered row, a program's slice in (1024 elements): head 0's first program stores its
    scores where the next program, which runs after it in the interpreter, gathers its state slice (unfused the
    GET_ROWS copied the row before the GDN runs: harmless)."""
    p = parts(g)
    out = p["gdn"].view_src.base
    out.buffer, out.offset = "cache", _row_offset(p) + 4 * 1024
    g.buffers["cache"] = max(g.buffers["cache"], out.offset + out.nbytes)  # (its unwritten slots past the cache)


def m_gathered_read_between(g):
    """Right after the GET_ROWS, a node reads the gathered rows' bytes through a tensor of its own (an arena leaf at
    their offset: no graph edge), feeding the layer output: fused, nothing writes those bytes any more."""
    p = parts(g)
    t = p["get_rows"]
    at = fresh(g, t)
    alias = Tensor(name="gathered-bytes", type=DType.F32, ne=t.ne, nb=t.nb, buffer="arena", offset=at)
    g.leafs.append(alias)
    feed_layer_output(g, chain(g), insert_after(g, t, ops.scale(alias, 1.0)))


def m_snapshots_off_the_rows(g):
    """The snapshot rows moved 1.5 cache rows on: slot 3 starts half a row (one head) into the gathered row 7, so the
    program of head 0 stores its state into head 1's slice of row 7, which the program of head 1, after it in the
    interpreter, gathers (unfused the GET_ROWS copied row 7 first: harmless)."""
    p = parts(g)
    dst = p["gdn"].outs[0]
    dst.view_offs += 3 * p["rows"].nb[1] // 2
    g.buffers["cache"] = max(g.buffers["cache"], byte_range(dst)[2])


def m_gathered_read_later(g):
    """The gathered rows on fresh bytes, and after the GDN a node reading them through a tensor of its own (an arena
    leaf at their offset: no graph edge), feeding the layer output."""
    p = parts(g)
    t = p["get_rows"]
    at = fresh(g, t)
    alias = Tensor(name="gathered-bytes", type=DType.F32, ne=t.ne, nb=t.nb, buffer="arena", offset=at)
    g.leafs.append(alias)
    feed_layer_output(g, chain(g), insert_after(g, p["gdn"], ops.scale(alias, 1.0)))


TRIPS = [
    Trip("gather.state", m_gathered_f16),
    Trip("scope.one-sequence", config=dict(n_seqs=2, mem_size=3)),
    Trip("gathered-state.user-count", m_gathered_output),
    Trip("gather.between", m_row_written_between),
    Trip("gather.between", m_gathered_read_between, name="reader"),
    Trip("gather.output-overlaps-input", m_scores_over_the_row, kernels="triton"),
    Trip("gather.output-overlaps-input", m_snapshots_off_the_rows, kernels="triton", name="off-rows"),
    Trip("gathered-state.read-later", m_gathered_read_later),
]


def candidate(t: Trip | None = None, mutate: bool = True):
    """(graph, pattern, anchor) of a trip case (None: the plain graph); ``mutate=False``: unmutated."""
    g = prepared(**(t.config if t else {}))
    if t is not None and mutate and t.mutate:
        t.mutate(g)
    return g, GdnStateGather(), parts(g)["gdn"]


def kernels(t: Trip) -> dict:
    """The kernel table of a force proof: the torch references (named: on a GPU the default would be Triton), or the
    GDN kernels, plain and fused, on Triton."""
    return backends.TORCH_BACKEND if t.kernels == "torch" else triton_for((Op.GATED_DELTA_NET_CACHE, Op.GET_ROWS))


def unguard(t: Trip, monkeypatch) -> None:
    """Forcing rule 5's overlap: the launcher refuses it too (a second line of defence), so the proof runs the kernel
    without its guard."""
    if t.kernels == "triton":
        monkeypatch.setattr(triton_ssm, "_alias_ok", lambda *a, **k: None)
