"""Trip graphs of the GATED_DELTA_NET_CACHE rules (tests/patterns/test_rules.py runs them, with every registered
pattern's): the GDN and its snapshot CPY of the small planned verify graph (tests/support/surgery.py: one layer,
n_t 4, K 4, two cells), one mutation per rule that breaks that rule and no other; for every hazard a graph where
forcing the rewrite past it corrupts bytes.

``gdn-cache.output-overlaps-input`` is a race between the programs of one Triton launch (a program storing its
states over the state rows a later program reads): its proof runs the GDN kernels, plain and fused, in the
interpreter, with the launcher's own overlap guard switched off (``unguard``).
"""

from __future__ import annotations

from gdnpass import ops
from gdnpass.ir import DType, Flag, Graph, Op
from gdnpass.kernels import backends
from gdnpass.kernels import triton_ssm
from gdnpass.patterns.gdn_state_cache import GdnStateCache
from support.graphs import triton_for
from support.surgery import IDS, chain, feed_layer_output, insert_after, planned
from support.trips import Trip

CHECK = dict(ids=IDS)  # check_fusion's keywords for the force proofs


def parts(g: Graph) -> dict:
    """The GDN, the view of its slots the CPY copies, the CPY and its destination."""
    gdn = next(n for n in g.nodes if n.op is Op.GATED_DELTA_NET)
    cpy = next(n for n in g.nodes if n.op is Op.CPY and n.src[0].view_src is gdn)
    return dict(gdn=gdn, snap=cpy.src[0], cpy=cpy, dst=cpy.src[1])


def _slot_bytes(p: dict) -> int:
    return p["snap"].nb[2]


# ---- one mutation per rule ------------------------------------------------------------------------------------------


def m_view_one_slot_on(g):
    """The CPY copies slots 1..2 of a 2-token GDN (K 4): slot 2 is never written."""
    p = parts(g)
    p["snap"].view_offs += _slot_bytes(p)


def m_destination_f16(g):
    """An f16 cache: the CPY converts (rows of 2-byte elements, contiguous)."""
    d = parts(g)["dst"]
    d.type = DType.F16
    d.nb = (2,) + d.nb[1:]


def m_destination_reshaped(g):
    """The destination as half rows, twice as many (the same bytes, another shape)."""
    p = parts(g)
    for t in (p["dst"], p["cpy"]):
        t.ne = (t.ne[0] // 2, 2 * t.ne[1]) + t.ne[2:]
        t.nb = (t.nb[0], t.nb[1] // 2) + t.nb[2:]


def m_sequences_on_one_row(g):
    """Two sequences whose snapshot rows coincide (a sequence stride of 0): two programs would store one row."""
    p = parts(g)
    for t in (p["dst"], p["cpy"]):
        t.nb = (t.nb[0], 0) + t.nb[2:]


def m_gdn_output(g):
    parts(g)["gdn"].flags |= Flag.OUTPUT


def m_snapshots_output(g):
    parts(g)["snap"].flags |= Flag.OUTPUT


def m_snapshots_read_between(g):
    """A node right after the GDN reads its slots (feeding the layer output)."""
    p = parts(g)
    feed_layer_output(g, chain(g), insert_after(g, p["gdn"], ops.scale(p["snap"], 1.0)))


def m_cache_read_between(g):
    """A node between the GDN and the CPY reads the cache rows the CPY overwrites (unfused: the old rows)."""
    p = parts(g)
    feed_layer_output(g, chain(g), insert_after(g, p["gdn"], ops.scale(p["dst"], 1.0)))


def m_destination_over_state(g):
    """The state the GDN reads moved to fresh arena bytes with room after it, and the destination one head's state
    further on: the program of head 0 stores its states where head 1's program, which runs after it in the
    interpreter, reads its state (unfused, the CPY writes them after the GDN: harmless)."""
    p = parts(g)
    state, S = p["gdn"].src[5], p["gdn"].src[2].ne[0]
    base = state.base
    base.offset = g.buffers["arena"]
    at = state.view_offs + 4 * S * S
    g.buffers["arena"] = base.offset + max(base.nbytes, at + p["dst"].nbytes)
    for t in (p["dst"], p["cpy"]):
        t.view_src, t.view_offs = base, at
        t.nb = (4, 4 * t.ne[0], 4 * t.ne[0] * t.ne[1], 4 * t.ne[0] * t.ne[1] * t.ne[2])


def m_slots_read_later(g):
    """After the CPY, a node reads the slot bytes through a tensor of its own (an arena leaf at their offset: no
    graph edge), feeding the layer output."""
    p = parts(g)
    snap = p["snap"]
    alias = ops.new_tensor("slot-bytes", DType.F32, (64,), buffer="arena")
    alias.offset = snap.view_src.offset + snap.view_offs
    g.leafs.append(alias)
    feed_layer_output(g, chain(g), insert_after(g, p["cpy"], ops.scale(alias, 1.0)))


TRIPS = [
    Trip("gdn-cache.snapshot-view", m_view_one_slot_on, config=dict(n_tokens=2)),
    Trip("gdn-cache.type", m_destination_f16),
    Trip("gdn-cache.destination", m_destination_reshaped),
    Trip("gdn-cache.destination", m_sequences_on_one_row, config=dict(n_seqs=2, mem_size=3), name="sequences"),
    Trip("gdn-out.readers", m_gdn_output),
    Trip("gdn-snapshots.user-count", m_snapshots_output, name="output"),
    Trip("gdn-snapshots.user-count", m_snapshots_read_between, name="reader"),
    Trip("gdn-cache.between", m_cache_read_between),
    Trip("gdn-cache.output-overlaps-input", m_destination_over_state, kernels="triton"),
    Trip("gdn-cache.slots-read-later", m_slots_read_later),
]


def candidate(t: Trip | None = None, mutate: bool = True):
    """(graph, pattern, anchor) of a trip case (None: the plain graph); ``mutate=False``: unmutated."""
    g = planned(**(t.config if t else {}))
    if t is not None and mutate and t.mutate:
        t.mutate(g)
    pattern = GdnStateCache()
    return g, pattern, parts(g)["gdn"]


def kernels(t: Trip) -> dict:
    """The kernel table of a force proof: the torch references (named: on a GPU the default would be Triton), or the
    GDN kernels, plain and fused, on Triton."""
    if t.kernels == "torch":
        return backends.TORCH_BACKEND
    return triton_for((Op.GATED_DELTA_NET, Op.GATED_DELTA_NET_CACHE))


def unguard(t: Trip, monkeypatch) -> None:
    """Forcing rule 7's overlap: the launcher refuses it too (a second line of defence), so the proof runs the kernel
    without its guard."""
    if t.kernels == "triton":
        monkeypatch.setattr(triton_ssm, "_alias_ok", lambda *a, **k: None)
