"""GATED_DELTA_NET, then the CPY of its state snapshots into the recurrent cache, fused into one
GATED_DELTA_NET_CACHE node: the op writes the states straight into the cache rows (upstream ggml-cuda's form).

    o = GATED_DELTA_NET(q, k, v, g, beta, s); CPY(view(o, slots), view(cache))   ->   GATED_DELTA_NET_CACHE writes
                                                                                    o's scores and the cache rows

llama.cpp's build_recurrent_attn copies the op's first min(n_t, K) snapshot slots (one slot, the final state, without
rollback) into the cache with one CPY per GDN layer: 2 MB per slot of qwen3.5-9b written by the op, read and written
again by the CPY. The fused node runs at the GDN's position, writes the scores where the op wrote them and the states
where the CPY wrote them; the op's own slots are never written.

Several sequences (a verify ubatch of n_s): the destination holds a state row per sequence and slot, and the kernel
stores each sequence's states into its own rows (any sequence stride). Unlike the conv chain, this fusion moves no
gather: the GDN reads the state the ssm build_rs's GET_ROWS copied into the arena, never the cache, so whichever rows
the runtime ids gather (find_slot's swaps, rollback planes) cannot alias what the fused node writes; rule 7 refuses
any overlap of the destination with the GDN's inputs.

Legality rules, in the order they run (the bracketed name is what a refusal reports; structural 1-5, hazards 6-8):
 1. [gdn-cache.snapshot-view] the CPY copies the op's first min(n_t, K) slots exactly: its source is a packed view
    of the GDN output starting where the scores end, of S*S*H_v x n_s x min(n_t, K) elements (the slots the op
    writes; a slot >= n_t holds whatever was there, which the fused node would not copy).
 2. [gdn-cache.type] the GDN output and the CPY's destination are f32: the CPY is a bit copy.
 3. [gdn-cache.destination] the destination is [S*S*H_v, n_s, min(n_t, K)] with contiguous rows (the kernel's
    scope, ``record.fits``: one state row per sequence, a slot per ne2, any strides between them that keep every
    row apart: rows of different sequences, or slots, never alias).
 4. [gdn-out.readers] the GDN output is not OUTPUT and every other node reading it reads a view that stays inside
    its scores: the fused node writes only those.
 5. [gdn-snapshots.user-count] the snapshot view is read by the CPY alone and is not OUTPUT
    (``patterns.common.confined``).
 6. [gdn-cache.between] no node between the GDN and the CPY reads or writes the destination's bytes (the fused node
    writes them at the GDN's place, before those nodes run) nor writes the slots the CPY would copy.
 7. [gdn-cache.output-overlaps-input] the destination overlaps none of the GDN's inputs and not its scores: a
    program stores its states while others still read theirs (the launcher refuses any overlap too).
 8. [gdn-cache.slots-read-later] no node after the CPY reads the op's own slot bytes before a node writes them
    again: the fused node never writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdnpass.ir import DType, Flag, Graph, Op, Tensor, byte_range
from gdnpass.patterns.common import (HAZARD, Capture, Clause, Context, Match, Why, between, collision, confined,
                                     first_collision, read_before_written, rule)
from gdnpass.patterns.gdn_state_cache.record import RECORD, snapshot_shape

NAME = "gdn_state_cache"
fits = RECORD.scope  # the kernel's scope


def score_bytes(gdn: Tensor) -> int:
    """Bytes of the op's scores, where its snapshot slots begin."""
    S, H_v, n_t, n_s = gdn.src[2].ne
    return 4 * S * H_v * n_t * n_s


def scores_range(gdn: Tensor) -> tuple[str, int, int]:
    """The byte range of the op's scores: all the fused node writes of the GDN output."""
    buf, lo, _ = byte_range(gdn)
    return buf, lo, lo + score_bytes(gdn)


@dataclass
class GdnCacheCapture(Capture):
    gdn: Tensor
    snap: Tensor  # the view of the GDN output the CPY copies
    cpy: Tensor   # its result: a view of the cache destination

    ROLES = (("gdn-snapshots", ("snap",)),)

    # ---- what the rewrite does (patterns.common.Capture) -----------------------------------------------------------
    @property
    def anchor(self) -> Tensor:
        return self.gdn

    def removed(self) -> list[Tensor]:
        return [self.gdn, self.snap, self.cpy]

    def written(self) -> list[Tensor]:
        """The GDN output (its scores, the node's own memory) and the CPY's destination."""
        return [self.gdn, self.cpy]

    def span(self, ctx: Context) -> tuple[int, int, int]:
        """GDN .. CPY; the fused node runs at the GDN."""
        at = ctx.pos[self.gdn.uid]
        return at, at, ctx.pos[self.cpy.uid]

    # ---- the operands ----------------------------------------------------------------------------------------------
    @property
    def K(self) -> int:
        return int(self.gdn.op_params["K"])

    @property
    def dst(self) -> Tensor:
        return self.cpy.src[1]

    @property
    def slots(self) -> int:
        """The slots the op writes: min(n_t, K)."""
        return min(self.gdn.src[2].ne[2], self.K)


@rule("gdn-cache.snapshot-view")
def _snapshot_view(c: GdnCacheCapture, ctx):
    D, n_s, n_w, _ = snapshot_shape(c.gdn.src[2], c.K)
    if c.snap.view_offs != score_bytes(c.gdn) or not c.snap.is_contiguous() or c.snap.nelements != D * n_s * n_w:
        return Why(c.cpy, f"{c.cpy.name!r} copies {c.snap.nelements} elements at byte {c.snap.view_offs} of "
                          f"{c.gdn.name!r}: not its {n_w} written slots ({D * n_s * n_w} packed elements at byte "
                          f"{score_bytes(c.gdn)})")


@rule("gdn-cache.type")
def _type(c: GdnCacheCapture, ctx):
    for t in (c.gdn, c.dst):
        if t.type is not DType.F32:
            return Why(t, f"{t.name!r} is {t.type.label}: the fused node stores f32 states, as a bit copy would")


@rule("gdn-cache.destination")
def _destination(c: GdnCacheCapture, ctx):
    v = c.gdn.src[2]
    if not fits(c.dst, v, c.K):
        return Why(c.dst, f"{c.dst.name!r} ne {list(c.dst.ne)}, nb {list(c.dst.nb[:3])}: the kernel stores "
                          f"{list(snapshot_shape(v, c.K))} with contiguous rows, no two of them overlapping")


@rule("gdn-out.readers")
def _readers(c: GdnCacheCapture, ctx):
    if c.gdn.flags & Flag.OUTPUT:
        return Why(c.gdn, f"{c.gdn.name!r} is flagged OUTPUT: its slots would be left unwritten")
    end = scores_range(c.gdn)[2]
    for u in ctx.users(c.gdn):
        if u is c.snap:
            continue
        if u.view_src is not c.gdn or byte_range(u)[2] > end:
            return Why(u, f"{u.name!r} reads {c.gdn.name!r} beyond its scores: the fused node writes only those")


_between = between(
    "gdn-cache.between",
    Clause("after", "rw", lambda c: [c.cpy], "{node} touches the cache bytes {hit} the fused node writes before it"),
    Clause("after", "w", lambda c: [c.snap], "{node} writes the slot bytes {hit} the CPY would copy"),
)


@rule("gdn-cache.output-overlaps-input", HAZARD)
def _output_overlaps_input(c: GdnCacheCapture, ctx):
    hit = first_collision(ctx.ranges([c.cpy]), ctx.ranges(c.gdn.src) + [(scores_range(c.gdn), c.gdn)])
    if hit:
        return collision(c.cpy, f"the destination {c.dst.name!r} overlaps {hit[3].name!r}", hit)


@rule("gdn-cache.slots-read-later", HAZARD)
def _slots_read_later(c: GdnCacheCapture, ctx):
    return read_before_written(ctx, ctx.ranges([c.snap]), ctx.pos[c.cpy.uid])


RULES = (_snapshot_view, _type, _destination, _readers, confined(GdnCacheCapture), _between,
         _output_overlaps_input, _slots_read_later)


class GdnStateCache:
    name = NAME

    def rules(self, ctx: Context) -> tuple:
        return RULES

    def candidates(self, graph: Graph) -> list[Tensor]:
        return [n for n in graph.nodes if n.op is Op.GATED_DELTA_NET]

    def capture(self, graph: Graph, gdn: Tensor, ctx: Context) -> GdnCacheCapture | None:
        """The GDN and the first CPY that copies a view of its slots (a view at or past the scores' end); None when
        nothing copies them (not this pattern)."""
        for view in ctx.users(gdn):
            if view.view_src is gdn and view.view_offs >= score_bytes(gdn):
                cpy = next((u for u in ctx.users(view) if u.op is Op.CPY and u.src[0] is view), None)
                if cpy is not None:
                    return GdnCacheCapture(gdn, view, cpy)
        return None

    def plan(self, c: GdnCacheCapture, ctx: Context) -> None:
        return None  # one variant

    def rewrite(self, graph: Graph, m: Match) -> Tensor:
        """The fused node for ``m``: a view of the GDN output's scores (the pass puts it in place of
        ``m.removed``)."""
        c = m.capture
        S, H_v, n_t, n_s = c.gdn.src[2].ne
        il = m.layer if m.layer is not None else -1
        return Tensor(name=f"gdn_state_cache-{il}", type=DType.F32, ne=(S * H_v, n_t * n_s, 1, 1),
                      nb=(4, 4 * S * H_v, 4 * S * H_v * n_t * n_s, 4 * S * H_v * n_t * n_s), op=RECORD.op,
                      op_params={"K": c.K, "replaced": [t.name for t in m.removed]}, src=list(c.gdn.src),
                      outs=[c.cpy], view_src=c.gdn, view_offs=0, layer=m.layer)
