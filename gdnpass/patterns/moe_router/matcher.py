"""The expert FFN's router, SOFT_MAX -> DESC ARGSORT (its top-k view) -> GET_ROWS -> SUM_ROWS -> CLAMP -> DIV, fused
into one MOE_ROUTER node (upstream ggml-cuda's topk_moe fusion).

    p = SOFT_MAX(l); o = ARGSORT(p, DESC); k = VIEW(o)[:n_used]; w = GET_ROWS(RESHAPE(p), k)
    s = SUM_ROWS(RESHAPE(w)); c = CLAMP(s); y = DIV(RESHAPE(w), c)       ->      MOE_ROUTER(l) writes y and o

build_moe_ffn's softmax gating with norm_w (qwen35moe): six launches a MoE layer, each reading back what the one
before wrote. The node runs at the DIV's position and writes the DIV's memory and the ARGSORT's (all of it: the
top-k view and the MUL_MAT_IDs read its head); the probabilities, the gathered weights and their sum are never
written. The top-k VIEW, which stood before the DIV, follows the fused node (``Graph.replace``: a view touches no
byte).

Legality rules, in the order they run (the bracketed name is what a refusal reports; structural 1-7, hazards 8-10):
 1. [moe-router.soft-max] the SOFT_MAX is no view, has no mask and no sinks, scale 1 and max_bias 0 (the kernel's
    SOFT_MAX), and its logits and probabilities are f32 [n_expert, n_t] with contiguous rows.
 2. [moe-router.argsort] the ARGSORT is DESC, no view, i32 of the probabilities' shape with contiguous rows, and the
    top-k view is its first n_used elements of each row (offset 0, its rows).
 3. [moe-router.gather] the GET_ROWS takes the top k of the probabilities viewed as [1, n_expert, n_t] (packed, at
    offset 0) into packed f32 [1, n_used, n_t], no view, read as [n_used, n_t] through one packed view.
 4. [moe-router.normalise] the SUM_ROWS reads that view; the CLAMP reads the sum (a NaN bound is no CLAMP); the DIV
    divides that view by the clamped sum into packed f32 [n_used, n_t]; none of them a view.
 5. [scope.router-size] 2..ARGSORT_MAX_ROW experts (a program sorts a whole row in registers), 1..all of them used
    (the record's scope).
 6. [moe-probs.user-count] the probabilities and their view are read only by the ARGSORT and the GET_ROWS, and are
    not OUTPUT (``patterns.common.confined``).
 7. [moe-weights.user-count] the gathered weights, their view, the sum and the clamped sum are read only inside the
    router and are not OUTPUT (``patterns.common.confined``; the SUM_ROWS and the CLAMP are their role's nodes too).
 8. [between.writes-input] no node between the SOFT_MAX and the DIV writes the logits, or reads or writes the
    ARGSORT's or the DIV's bytes: the fused node reads the logits and writes both at the DIV.
 9. [moe-router.output-overlaps-input] the ARGSORT's and the DIV's bytes do not overlap, and overlap the logits
    only where no tile of rows stores over the logits of a tile after it (``scope.serial_safe``): the kernel then
    runs as one program walking the tiles in order (the plan: ``serial``), where one program a tile would store its
    rows while other programs still read theirs. gallocr puts the DIV in the logits from 8 tokens on.
10. [moe-router.interior-read-later] no later node reads the bytes of the probabilities, the gathered weights or
    the sums before a node writes them again: the fused node never writes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gdnpass.ir import DType, Graph, Op, Tensor
from gdnpass.kernels.limits import ARGSORT_MAX_ROW, soft_max_tile
from gdnpass.patterns.common import (HAZARD, Capture, Clause, Context, Match, Why, between, collision, confined,
                                     first_collision, read_before_written, rule)
from gdnpass.patterns.moe_router.record import RECORD
from gdnpass.patterns.moe_router.scope import serial_safe

NAME = "moe_router"
fits = RECORD.scope  # the kernel's scope
_VIEWS = (Op.RESHAPE, Op.VIEW)


def _user(ctx: Context, t: Tensor, ops: tuple, slot: int | None = 0) -> Tensor | None:
    """The first node reading ``t`` whose op is one of ``ops`` (in source slot ``slot``, None: any)."""
    return next((u for u in ctx.users(t) if u.op in ops and (slot is None and t in u.src or
                                                               slot is not None and u.src[slot] is t)), None)


def _packed(t: Tensor, ne: tuple) -> bool:
    return t.ne == ne and t.is_contiguous()


@dataclass
class RouterCapture(Capture):
    soft_max: Tensor
    argsort: Tensor
    topk: Tensor       # the top-k VIEW of the ARGSORT (not removed: the MUL_MAT_IDs read it)
    probs_view: Tensor  # the GET_ROWS' src0: a view of the probabilities
    get_rows: Tensor
    w_view: Tensor     # the weights as [n_used, n_t]: what the SUM_ROWS and the DIV read
    sum: Tensor
    clamp: Tensor
    div: Tensor

    ROLES = (("moe-probs", ("soft_max", "probs_view")), ("moe-weights", ("get_rows", "w_view", "sum", "clamp")))

    # ---- what the rewrite does (patterns.common.Capture) -----------------------------------------------------------
    @property
    def anchor(self) -> Tensor:
        return self.div

    def removed(self) -> list[Tensor]:
        return [self.soft_max, self.probs_view, self.argsort, self.get_rows, self.w_view, self.sum, self.clamp,
                self.div]

    def written(self) -> list[Tensor]:
        """The DIV's output (the primary), then the ARGSORT's."""
        return [self.div, self.argsort]

    def span(self, ctx: Context) -> tuple[int, int, int]:
        """SOFT_MAX .. DIV; the fused node runs at the DIV."""
        at = ctx.pos[self.div.uid]
        return ctx.pos[self.soft_max.uid], at, at

    # ---- the operands ----------------------------------------------------------------------------------------------
    @property
    def logits(self) -> Tensor:
        return self.soft_max.src[0]

    @property
    def n_expert(self) -> int:
        return self.soft_max.ne[0]

    @property
    def n_t(self) -> int:
        return self.soft_max.ne[1]

    @property
    def n_used(self) -> int:
        return self.topk.ne[0]


@rule("moe-router.soft-max")
def _soft_max(c: RouterCapture, ctx):
    s, p = c.soft_max, c.soft_max.op_params
    if s.view_src is not None or any(t is not None for t in s.src[1:]):
        return Why(s, f"{s.name!r} is a view or has a mask or sinks: the kernel's SOFT_MAX has neither")
    if p.get("scale") != 1.0 or p.get("max_bias", 0.0) != 0.0:
        return Why(s, f"{s.name!r} has scale {p.get('scale')}, max_bias {p.get('max_bias')}: the kernel's are 1, 0")
    for t in (c.logits, s):
        if t.type is not DType.F32 or t.ne[2:] != (1, 1) or not t.has_contiguous_rows():
            return Why(t, f"{t.name!r} is {t.type.label} {list(t.ne)}, nb0 {t.nb[0]}: the kernel reads f32 "
                          "[n_expert, n_t] rows")


@rule("moe-router.argsort")
def _argsort(c: RouterCapture, ctx):
    a, k = c.argsort, c.topk
    if a.op_params.get("order") != 1 or a.view_src is not None or a.type is not DType.I32 \
            or a.ne != c.soft_max.ne or not a.has_contiguous_rows():
        return Why(a, f"{a.name!r} (order {a.op_params.get('order')}, {a.type.label} {list(a.ne)}): not the DESC "
                      "argsort of the probabilities into contiguous rows")
    if k.view_offs != 0 or k.ne[1:] != a.ne[1:] or k.nb[:2] != a.nb[:2]:
        return Why(k, f"{k.name!r} (ne {list(k.ne)}, nb {list(k.nb)}, at byte {k.view_offs}) is not the head of "
                      f"each row of {a.name!r}")


@rule("moe-router.gather")
def _gather(c: RouterCapture, ctx):
    v, g, w = c.probs_view, c.get_rows, c.w_view
    if v.view_src is not c.soft_max or v.view_offs != 0 or not _packed(v, (1, c.n_expert, c.n_t, 1)) \
            or not c.soft_max.is_contiguous():
        return Why(g, f"{g.name!r} reads {v.name!r}, not the packed probabilities as [1, {c.n_expert}, {c.n_t}]")
    if g.view_src is not None or g.type is not DType.F32 or not _packed(g, (1, c.n_used, c.n_t, 1)) \
            or w.view_offs != 0 or not _packed(w, (c.n_used, c.n_t, 1, 1)):
        return Why(g, f"{g.name!r} {list(g.ne)} read as {w.name!r} {list(w.ne)}: not packed f32 [1, {c.n_used}, "
                      f"{c.n_t}] read as [{c.n_used}, {c.n_t}]")


@rule("moe-router.normalise")
def _normalise(c: RouterCapture, ctx):
    s, cl, d = c.sum, c.clamp, c.div
    if s.src[0] is not c.w_view or cl.op is not Op.CLAMP or cl.src[0] is not s \
            or any(math.isnan(cl.op_params.get(b, math.nan)) for b in ("min", "max")):
        return Why(d, f"{d.name!r} divides by {cl.name!r}, not a CLAMP of the weights' SUM_ROWS")
    for t in (s, cl, d):
        if t.view_src is not None or t.type is not DType.F32:
            return Why(t, f"{t.name!r} is a view or {t.type.label}: the kernel writes f32 of its own")
    if not _packed(d, (c.n_used, c.n_t, 1, 1)):
        return Why(d, f"{d.name!r} ne {list(d.ne)}, nb {list(d.nb)}: the kernel writes packed [{c.n_used}, {c.n_t}]")


@rule("scope.router-size")
def _router_size(c: RouterCapture, ctx):
    if not fits(c.n_expert, c.n_used):
        return Why(c.soft_max, f"{c.n_used} of {c.n_expert} experts: outside the kernel's 2..{ARGSORT_MAX_ROW} "
                               "experts, 1..all used")


_between = between(
    "between.writes-input",
    Clause("before", "w", lambda c: [c.logits], "{node} writes {hit}, which the fused node reads at the DIV"),
    Clause("before", "rw", lambda c: [c.argsort, c.div], "{node} touches {hit}, which the fused node writes at the DIV"))


def _serial_safe(c: RouterCapture, ctx: Context) -> bool:
    """Whether one program walking the tiles in order may store the outputs where the plan put them."""
    (logits, _), = ctx.ranges([c.logits])
    outs = [r for r, _ in ctx.ranges([c.argsort, c.div])]
    return serial_safe(logits[1:], [r[1:] for r in outs], c.logits.nb[1], (c.argsort.nb[1], c.div.nb[1]),
                       soft_max_tile(c.n_expert)[0], c.n_t)


@rule("moe-router.output-overlaps-input", HAZARD)
def _output_overlaps_input(c: RouterCapture, ctx):
    hit = first_collision(ctx.ranges([c.div]), ctx.ranges([c.argsort]))
    if hit:
        return collision(c.div, f"{c.div.name!r} overlaps {c.argsort.name!r}: both are the fused node's outputs", hit)
    hit = first_collision(ctx.ranges([c.argsort, c.div]), ctx.ranges([c.logits]))
    if hit and not _serial_safe(c, ctx):
        return collision(hit[1], f"{hit[1].name!r} overlaps {hit[3].name!r}, and a tile's stores reach the logits of "
                                 "a tile after it", hit)


@rule("moe-router.interior-read-later", HAZARD)
def _interior_read_later(c: RouterCapture, ctx):
    return read_before_written(ctx, ctx.ranges(c.interior()), ctx.pos[c.div.uid], ctx.ranges(c.written()))


RULES = (_soft_max, _argsort, _gather, _normalise, _router_size, confined(RouterCapture), _between,
         _output_overlaps_input, _interior_read_later)


class MoeRouter:
    name = NAME

    def rules(self, ctx: Context) -> tuple:
        return RULES

    def candidates(self, graph: Graph) -> list[Tensor]:
        """Every SOFT_MAX (attention's, without flash attention, has no ARGSORT reader: not this pattern)."""
        return [n for n in graph.nodes if n.op is Op.SOFT_MAX]

    def capture(self, graph: Graph, soft_max: Tensor, ctx: Context) -> RouterCapture | None:
        """Follow the router's readers from the SOFT_MAX; None where one of its nodes is missing (not a router)."""
        argsort = _user(ctx, soft_max, (Op.ARGSORT,))
        topk = argsort and next((u for u in ctx.users(argsort) if u.op is Op.VIEW and u.view_src is argsort), None)
        get_rows = topk and _user(ctx, topk, (Op.GET_ROWS,), 1)
        w_view = get_rows and _user(ctx, get_rows, _VIEWS)
        sum_ = w_view and _user(ctx, w_view, (Op.SUM_ROWS,))
        div = w_view and _user(ctx, w_view, (Op.DIV,))
        if not (sum_ and div) or div.src[1] is None or get_rows.src[0] is None:
            return None
        return RouterCapture(soft_max, argsort, topk, get_rows.src[0], get_rows, w_view, sum_, div.src[1], div)

    def plan(self, c: RouterCapture, ctx: Context) -> bool:
        """Serial (one program walking the tiles) where an output overlaps the logits (rule 9 proved it safe)."""
        return bool(first_collision(ctx.ranges([c.argsort, c.div]), ctx.ranges([c.logits])))

    def rewrite(self, graph: Graph, m: Match) -> Tensor:
        """The fused node for ``m``: a view of the DIV's output, writing the ARGSORT's too (the pass puts it in place
        of ``m.removed``)."""
        c = m.capture
        primary, order = c.written()
        return Tensor(name=f"moe_router({primary.name})", type=DType.F32, ne=primary.ne, nb=primary.nb, op=RECORD.op,
                      op_params={"n_used": c.n_used, "serial": m.plan, "min": c.clamp.op_params["min"],
                                 "max": c.clamp.op_params["max"], "replaced": [t.name for t in c.removed()]},
                      src=[c.logits], outs=[order], view_src=primary, view_offs=0, layer=m.layer)
