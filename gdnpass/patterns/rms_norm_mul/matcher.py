"""RMS_NORM, then MUL by a weight (and ADD), fused into one RMS_NORM_MUL node: ggml-cuda's rms_norm fusion.

    n = RMS_NORM(x); y = MUL(n, w) [; z = ADD(y, a)]      ->      RMS_NORM_MUL(x, w [, a]) writes y [z]

Qwen3.5 has three per GDN layer (the attention norm, the gated output norm, the post-attention norm), four per
attention layer (with the q and k head norms) and the output norm. The node runs at the RMS_NORM's position and
writes the last node's memory; the norm (and the MUL, when the ADD joins) is never written. As in ggml-cuda, which
tries the three ops first and falls back to two, the ADD joins when it is the next node, reads the MUL (the MUL's
only reader, not OUTPUT), is no view and has the MUL's shape, f32 operands and an addend of contiguous rows that
repeats into the rows (or has their shape when the MUL is its src1); otherwise the pattern is RMS_NORM+MUL.

Legality rules, in the order they run (the bracketed name is what a refusal reports; structural 1-7, hazards 8-9):
 1. [rms-mul.adjacent] the MUL is the node right after the RMS_NORM (ggml_can_fuse: consecutive nodes, each
    reading the one before), so no node runs in between.
 2. [rms-mul.views] neither is a view (an in-place op): the fused node is a view of the MUL's own memory, and ggml's
    ggml_node_has_n_uses refuses a viewed norm.
 3. [rms-mul.type] x, the norm, the weight and the product are f32 (the kernel's and ggml-cuda's scope).
 4. [rms-mul.shape] the product has the norm's shape and the weight repeats into it as ggml broadcasts; the same
    shape when the norm is the MUL's src1 (ggml-cuda does not broadcast then).
 5. [rms-mul.contiguous-rows] x and the weight have contiguous rows (nb0 = 4: the kernel reads whole rows).
 6. [scope.row-size] rows of 1..ROW_MAX elements (the record's scope: one program holds whole rows).
 7. [rms-norm.user-count] the norm is read by the MUL alone and is not OUTPUT (``patterns.common.confined``).
 8. [rms-mul.output-overlaps-input] the output overlaps x, the weight or the addend only element for element (an
    in-place chain): a program writes its rows only after reading them, so any other overlap lets one program
    overwrite rows another has yet to read (ggml-cuda's ggml_cuda_check_fusion_memory_ranges).
 9. [rms-mul.interior-read-later] no later node reads the bytes of the norm (or of the MUL the ADD absorbed)
    before a node writes them again: the fused node never writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdnpass.ir import DType, Flag, Graph, Op, Tensor
from gdnpass.opspec.shapes import can_repeat
from gdnpass.patterns.common import (HAZARD, Capture, Context, Match, Why, collision, confined, first_collision,
                                     read_before_written, rule, same_elements)
from gdnpass.patterns.rms_norm_mul.record import RECORD
from gdnpass.patterns.rms_norm_mul.scope import ROW_MAX

NAME = "rms_norm_mul"
row_fits = RECORD.scope  # the kernel's limits


def _other(node: Tensor, t: Tensor) -> tuple[Tensor, bool]:
    """(the other source of binary ``node``, whether ``t`` is its src0)."""
    return (node.src[1], True) if node.src[0] is t else (node.src[0], False)


@dataclass
class NormCapture(Capture):
    norm: Tensor
    mul: Tensor
    add: Tensor | None  # the ADD that joins (see the module docstring), or None

    ROLES = (("rms-norm", ("norm",)),)
    SHAPED = (("the MUL when the ADD joins: the ADD its only reader, not OUTPUT", "the capture (else no ADD)"),)

    # ---- what the rewrite does (patterns.common.Capture) -----------------------------------------------------------
    @property
    def anchor(self) -> Tensor:
        return self.norm

    def removed(self) -> list[Tensor]:
        return [self.norm, self.mul] + ([self.add] if self.add is not None else [])

    def written(self) -> list[Tensor]:
        """The last node's output: the fused node's only one."""
        return [self.last]

    def shaped(self) -> list[Tensor]:
        return [self.mul] if self.add is not None else []

    def span(self, ctx: Context) -> tuple[int, int, int]:
        """RMS_NORM .. the last node; the fused node runs at the RMS_NORM (rule 1: nothing in between)."""
        return ctx.pos[self.norm.uid], ctx.pos[self.norm.uid], ctx.pos[self.last.uid]

    # ---- the operands ----------------------------------------------------------------------------------------------
    @property
    def last(self) -> Tensor:
        return self.add if self.add is not None else self.mul

    @property
    def x(self) -> Tensor:
        return self.norm.src[0]

    @property
    def w(self) -> Tensor:
        return _other(self.mul, self.norm)[0]

    @property
    def norm_first(self) -> bool:
        return self.mul.src[0] is self.norm

    @property
    def addend(self) -> Tensor | None:
        return None if self.add is None else _other(self.add, self.mul)[0]

    @property
    def add_first(self) -> bool:
        return self.add is not None and self.add.src[1] is self.mul


def _add_joins(mul: Tensor, nxt: Tensor | None, ctx: Context) -> bool:
    """Whether ``nxt`` is an ADD that joins the MUL (the module docstring's conditions)."""
    if nxt is None or nxt.op is not Op.ADD or mul not in nxt.src[:2] or nxt.view_src is not None:
        return False
    addend, mul_first = _other(nxt, mul)
    return (ctx.users(mul) == [nxt] and ctx.uses(mul) == 1 and not mul.flags & Flag.OUTPUT and nxt.ne == mul.ne
            and nxt.type is addend.type is DType.F32 and addend.has_contiguous_rows()
            and (can_repeat(addend, mul) if mul_first else addend.ne == mul.ne))


@rule("rms-mul.adjacent")
def _adjacent(c: NormCapture, ctx):
    at = ctx.pos[c.norm.uid]
    if ctx.pos[c.mul.uid] != at + 1:
        between = ctx.graph.nodes[at + 1]
        return Why(between, f"{between.name!r} runs between {c.norm.name!r} and its MUL {c.mul.name!r}")


@rule("rms-mul.views")
def _views(c: NormCapture, ctx):
    for t in (c.norm, c.mul):
        if t.view_src is not None:
            return Why(t, f"{t.name!r} is a view of {t.view_src.name!r} (an in-place op)")


@rule("rms-mul.type")
def _type(c: NormCapture, ctx):
    for t in (c.x, c.norm, c.w, c.mul):
        if t.type is not DType.F32:
            return Why(t, f"{t.name!r} is {t.type.label}: the kernel is f32")


@rule("rms-mul.shape")
def _shape(c: NormCapture, ctx):
    if c.mul.ne != c.norm.ne or not (can_repeat(c.w, c.norm) if c.norm_first else c.w.ne == c.norm.ne):
        return Why(c.mul, f"{c.mul.name!r} {c.mul.ne}: the weight {c.w.ne} does not "
                          f"{'repeat into' if c.norm_first else 'have the shape of'} the norm {c.norm.ne}")


@rule("rms-mul.contiguous-rows")
def _contiguous_rows(c: NormCapture, ctx):
    for t in (c.x, c.w):
        if not t.has_contiguous_rows():
            return Why(t, f"{t.name!r} has rows of stride nb0 = {t.nb[0]}: the kernel reads contiguous rows")


@rule("scope.row-size")
def _row_size(c: NormCapture, ctx):
    if not row_fits(c.x.ne[0]):
        return Why(c.norm, f"rows of {c.x.ne[0]} elements: outside the kernel's 1..{ROW_MAX}")


@rule("rms-mul.output-overlaps-input", HAZARD)
def _output_overlaps_input(c: NormCapture, ctx):
    srcs = [t for t in (c.x, c.w, c.addend) if t is not None]
    hit = first_collision(ctx.ranges([c.last]), ctx.ranges(srcs))
    if hit and not same_elements(c.last, hit[3]):
        return collision(c.last, f"{c.last.name!r} overlaps {hit[3].name!r}, not element for element", hit)


@rule("rms-mul.interior-read-later", HAZARD)
def _interior_read_later(c: NormCapture, ctx):
    return read_before_written(ctx, ctx.ranges(c.interior()), ctx.pos[c.last.uid], ctx.ranges(c.written()))


RULES = (_adjacent, _views, _type, _shape, _contiguous_rows, _row_size, confined(NormCapture),
         _output_overlaps_input, _interior_read_later)


class RmsNormMul:
    name = NAME

    def rules(self, ctx: Context) -> tuple:
        return RULES

    def candidates(self, graph: Graph) -> list[Tensor]:
        """Every RMS_NORM (the fused chain's q/k norms are gone by now: it runs first)."""
        return [n for n in graph.nodes if n.op is Op.RMS_NORM]

    def capture(self, graph: Graph, norm: Tensor, ctx: Context) -> NormCapture | None:
        """The norm, the first MUL reading it, and the ADD after that MUL when it joins; None when no MUL reads the
        norm (an RMS_NORM+SCALE, say: not this pattern)."""
        mul = next((u for u in ctx.users(norm) if u.op is Op.MUL and norm in u.src[:2]), None)
        if mul is None:
            return None
        at = ctx.pos[mul.uid]
        nxt = graph.nodes[at + 1] if at + 1 < len(graph.nodes) else None
        return NormCapture(norm, mul, nxt if _add_joins(mul, nxt, ctx) else None)

    def plan(self, c: NormCapture, ctx: Context) -> None:
        return None  # one variant

    def rewrite(self, graph: Graph, m: Match) -> Tensor:
        """The fused node for ``m`` (the pass puts it in place of ``m.removed``)."""
        c = m.capture
        (primary,) = c.written()
        params = {"eps": c.norm.op_params["eps"], "norm_first": c.norm_first}
        if c.add is not None:
            params["add_first"] = c.add_first
        return Tensor(name=f"rms_norm_mul({primary.name})", type=DType.F32, ne=primary.ne, nb=primary.nb,
                      op=RECORD.op, op_params={**params, "replaced": [t.name for t in c.removed()]},
                      src=[c.x, c.w] + ([c.addend] if c.add is not None else []), view_src=primary, view_offs=0,
                      layer=m.layer)
