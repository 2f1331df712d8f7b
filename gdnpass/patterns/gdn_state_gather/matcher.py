"""A one-sequence GATED_DELTA_NET_CACHE reading its starting state straight from the recurrent cache's row: the GET_ROWS
that copied that row into the arena launches no more.

    s = GET_ROWS(cache, ids)                          ->   GATED_DELTA_NET_CACHE(q, k, v, g, beta, cache, ids; gather)
    GATED_DELTA_NET_CACHE(q, k, v, g, beta, reshape(s))

llama.cpp's build_rs gathers each sequence's state row (2 MB a GDN layer of qwen3.5-9b) into the arena, where the GDN
reads it once: a launch, and the row written and read again. The fused node reads the row where the GDN read the
copy, at the GDN's place (later than the GET_ROWS did). Which row is runtime data (the cell's, or after a rollback
another plane's), and it may be one of the rows the node's snapshots overwrite: the kernel's programs each read their
slice of the state before they write that slice of any snapshot, and no other program touches it, so with one
sequence any row is safe, where the snapshot rows lie on the cache's rows. With several, one sequence's row may be
another's snapshot row, which another program writes: refused (the conv chain's kernel is built for that, its
programs owning channels of every sequence; the GDN's programs each own one sequence).

Legality rules, in the order they run (the bracketed name is what a refusal reports; structural 1-3, hazards 4-6):
 1. [gather.state] the GDN's state is a packed RESHAPE of a GET_ROWS's packed output, f32 rows of S*S*H_v elements
    gathered by i32 ids from a tensor with contiguous rows (the cache's rows: the kernel reads row r at r times the
    row stride).
 2. [scope.one-sequence] the verify holds one sequence.
 3. [gathered-state.user-count] the GET_ROWS's output and its RESHAPE are read by the GDN alone and are not OUTPUT
    (``patterns.common.confined``).
 4. [gather.between] no node between the GET_ROWS and the GDN writes the rows' tensor (any row: the one gathered is
    runtime data) or the ids (the fused node reads them at the GDN's place), or touches the GET_ROWS's output bytes
    (never written any more).
 5. [gather.output-overlaps-input] the GDN's scores overlap neither the rows' tensor nor the ids, its snapshot rows
    not the ids, and a snapshot row that overlaps the rows' tensor lies exactly on one of its rows
    (``limits.snapshots_on_whole_rows``): then it is the gathered row only where its slices are the same programs'
    (with rule 2).
 6. [gathered-state.read-later] no node after the GDN reads the GET_ROWS's output bytes before a node writes them
    again: the fused node never writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdnpass.ir import DType, Graph, Op, Tensor, byte_range
from gdnpass.kernels.limits import snapshots_on_whole_rows
from gdnpass.patterns.common import (HAZARD, Capture, Clause, Context, Match, Why, between, collision, confined,
                                     first_collision, read_before_written, rule)
from gdnpass.patterns.gdn_state_cache.matcher import scores_range
from gdnpass.patterns.gdn_state_cache.record import OP as CACHE_OP
from gdnpass.patterns.gdn_state_cache.record import gathers, operands, rebuilt, rewritten

NAME = "gdn_state_gather"


@dataclass
class GatherCapture(Capture):
    gdn: Tensor        # the GATED_DELTA_NET_CACHE node
    view: Tensor       # the RESHAPE of the gathered rows the GDN reads as its state
    get_rows: Tensor   # GET_ROWS(rows, ids)

    ROLES = (("gathered-state", ("view", "get_rows")),)

    # ---- what the rewrite does (patterns.common.Capture) -----------------------------------------------------------
    @property
    def anchor(self) -> Tensor:
        return self.gdn

    def removed(self) -> list[Tensor]:
        return [self.get_rows, self.view, self.gdn]

    def written(self) -> list[Tensor]:
        return rewritten(self.gdn)

    def span(self, ctx: Context) -> tuple[int, int, int]:
        """GET_ROWS .. the GDN; the fused node runs at the GDN."""
        at = ctx.pos[self.gdn.uid]
        return ctx.pos[self.get_rows.uid], at, at

    # ---- the operands ----------------------------------------------------------------------------------------------
    @property
    def rows(self) -> Tensor:
        return self.get_rows.src[0]

    @property
    def ids(self) -> Tensor:
        return self.get_rows.src[1]


@rule("gather.state")
def _state(c: GatherCapture, ctx):
    S, H_v, _, n_s = c.gdn.src[2].ne
    D = S * S * H_v
    g = c.get_rows
    if not (g.type is DType.F32 and c.rows.type is DType.F32 and c.ids.type is DType.I32 and g.is_contiguous()
            and c.view.is_contiguous() and c.view.view_offs == 0 and g.ne[0] == D and g.nelements == D * n_s
            and c.rows.ne[0] == D and c.rows.has_contiguous_rows() and c.rows.nb[1] >= 4 * D
            and c.rows.ne[2] == c.rows.ne[3] == 1):
        return Why(g, f"{g.name!r} ({g.type.label} {list(g.ne)} of {c.rows.name!r} {c.rows.type.label} "
                      f"{list(c.rows.ne)}, ids {c.ids.type.label}) is not f32 rows of {D} gathered by i32 ids from "
                      f"contiguous rows apart from each other, packed, as the GDN's state")


@rule("scope.one-sequence")
def _one_sequence(c: GatherCapture, ctx):
    n_s = c.gdn.src[2].ne[3]
    if n_s != 1:
        return Why(c.gdn, f"{n_s} sequences: one's gathered row may be another's snapshot row, which another program "
                          f"writes")


_between = between(
    "gather.between",
    Clause("before", "w", lambda c: [c.rows, c.ids], "{node} writes {hit}, which the fused node gathers from later"),
    Clause("before", "rw", lambda c: [c.get_rows], "{node} touches the bytes of {hit}, which the fused node never "
                                                   "writes"),
)


def _snapshot_rows(c: GatherCapture) -> list[int]:
    """The plan's byte offset of each snapshot row the node writes (one sequence: a row a slot)."""
    dst = c.gdn.outs[0]
    lo = byte_range(dst)[1]
    return [lo + j * dst.nb[2] for j in range(dst.ne[2])]


@rule("gather.output-overlaps-input", HAZARD)
def _output_overlaps_input(c: GatherCapture, ctx):
    scores = (scores_range(c.gdn.view_src), c.gdn.view_src)
    hit = (first_collision([scores], ctx.ranges([c.rows, c.ids]))
           or first_collision(ctx.ranges(c.gdn.outs), ctx.ranges([c.ids])))
    if hit:
        return collision(c.gdn, f"the GDN's results overlap {hit[3].name!r}, which it now gathers by", hit)
    dst, ((rows, _),) = c.gdn.outs[0], ctx.ranges([c.rows])
    if byte_range(dst)[0] == rows[0] and not snapshots_on_whole_rows(_snapshot_rows(c), dst.nb[0] * dst.ne[0],
                                                                     rows[1:], c.rows.nb[1]):
        hit = first_collision(ctx.ranges([dst]), ctx.ranges([c.rows]))
        return collision(c.gdn, f"its snapshot rows overlap {c.rows.name!r} off its rows: a program would store "
                                f"into a slice another program gathers", hit)


@rule("gathered-state.read-later", HAZARD)
def _read_later(c: GatherCapture, ctx):
    return read_before_written(ctx, ctx.ranges([c.get_rows]), ctx.pos[c.gdn.uid])


RULES = (_state, _one_sequence, confined(GatherCapture), _between, _output_overlaps_input, _read_later)


class GdnStateGather:
    name = NAME

    def rules(self, ctx: Context) -> tuple:
        return RULES

    def candidates(self, graph: Graph) -> list[Tensor]:
        """Every GATED_DELTA_NET_CACHE node that still reads its state from the arena."""
        return [n for n in graph.nodes if n.op is CACHE_OP and not gathers(n)]

    def capture(self, graph: Graph, gdn: Tensor, ctx: Context) -> GatherCapture | None:
        """The GDN, the RESHAPE it reads as its state and the GET_ROWS under it; None when the state is another
        node's (not this pattern)."""
        view = gdn.src[5]
        if view.op is not Op.RESHAPE or not view.src or view.src[0] is None or view.src[0].op is not Op.GET_ROWS:
            return None
        return GatherCapture(gdn, view, view.src[0])

    def plan(self, c: GatherCapture, ctx: Context) -> None:
        return None  # one variant

    def rewrite(self, graph: Graph, m: Match) -> Tensor:
        """The GDN node again, gathering its state from the rows (the pass puts it in place of ``m.removed``)."""
        c = m.capture
        old = c.gdn
        six, _, g_sides, beta_sides = operands(old, old.src)
        six[5] = c.rows
        params = {**old.op_params, "gather": True,
                  "replaced": [*old.op_params.get("replaced", [old.name]), c.get_rows.name, c.view.name]}
        return rebuilt(old, six, c.ids, g_sides, beta_sides, params, m.layer)


__all__ = ["NAME", "GatherCapture", "GdnStateGather"]
