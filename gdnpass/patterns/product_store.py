"""What a product's store epilogue asks, whatever runs in it: the facts mul_mat_add (the residual ADD) and
mul_mat_chain (an elementwise chain) share. Both replace a MUL_MAT ``p`` (and one view of it) with a node that runs
the single mat-vec's or GEMM's kernel at a later node's place, runs that node's work on each f32 sum as it stores it
(``triton_matvec.Epilogue``) and never writes ``p``. Their captures are :class:`ProductCapture` s; each pattern
names the rules these checks make (its rule block). Pure Python.
"""

from __future__ import annotations

from gdnpass.ir import DType, Op, Tensor
from gdnpass.kernels import limits
from gdnpass.kernels.limits import GEMM_WEIGHTS, MAT_VEC_COLS, runs_in_one_launch
from gdnpass.patterns.common import Capture, Clause, Context, Why, collision, first_collision, read_before_written
from gdnpass.patterns.record import need

_VIEWS = (Op.RESHAPE, Op.VIEW)


def product_of(t: Tensor) -> Tensor | None:
    """The MUL_MAT ``t`` is, or is a view of (one RESHAPE or VIEW); None otherwise."""
    if t.op is Op.MUL_MAT:
        return t
    if t.op in _VIEWS and t.view_src is not None and t.view_src.op is Op.MUL_MAT and t.src[0] is t.view_src:
        return t.view_src
    return None


class ProductCapture(Capture):
    """A capture whose fused node runs MUL_MAT ``mm`` (a dataclass field of the subclass, as ``view``: the view of it
    the reader reads, or None) with an epilogue, the work of the node that reads the product (:attr:`epilogue`): the
    rewrite and the operands the checks below read."""

    mm: Tensor
    view: Tensor | None

    @property
    def epilogue(self) -> Tensor:
        """The node reading the product whose work the store runs (the ADD, the chain): the subclass's."""
        raise NotImplementedError

    # ---- what the rewrite does (patterns.common.Capture): the fused node replaces the product, its view and the
    # epilogue's node, at that node's place
    @property
    def anchor(self) -> Tensor:
        return self.epilogue

    def removed(self) -> list[Tensor]:
        return [t for t in (self.mm, self.view, self.epilogue) if t is not None]

    def span(self, ctx: Context) -> tuple[int, int, int]:
        """MUL_MAT .. the epilogue's node, where the fused node runs."""
        at = ctx.pos[self.epilogue.uid]
        return ctx.pos[self.mm.uid], at, at

    # ---- the operands ----------------------------------------------------------------------------------------------
    @property
    def w(self) -> Tensor:
        return self.mm.src[0]

    @property
    def x(self) -> Tensor:
        return self.mm.src[1]

    @property
    def cols(self) -> int:
        return self.x.ne[1] * self.x.ne[2] * self.x.ne[3]


def fits(t: Tensor, rows: int, cols: int) -> bool:
    """The kernel's scope for what its store writes and reads besides the product (the output, an addend, a side
    operand): packed, the product's ``rows`` x ``cols`` elements in any shape (the kernel addresses them as the
    product's [rows, cols]: a packed reshape's elements lie in the same order)."""
    return t.is_contiguous() and t.nelements == rows * cols


# ---- the matchers' checks (each pattern's rules call them) ---------------------------------------------------------


def whole_product(c) -> Why | None:
    """The reader reads the whole product in its element order: the MUL_MAT's output, or one packed view of it."""
    v = c.view
    if v is not None and (v.view_offs != 0 or not v.is_contiguous() or v.nelements != c.mm.nelements):
        return Why(v, f"{v.name!r} (ne {list(v.ne)}, nb {list(v.nb)}, at byte {v.view_offs}) is not all of "
                      f"{c.mm.name!r} in its element order")
    return None


def readable(c) -> Why | None:
    """A weight the mat-vec reads, f32 columns."""
    if not limits.mat_vec_weight(c.w.type):
        return Why(c.w, f"{c.w.name!r} is {c.w.type.label}: the mat-vec does not read that type")
    if c.x.type is not DType.F32:
        return Why(c.x, f"{c.x.name!r} is {c.x.type.label}: the mat-vec's columns are f32")
    return None


def one_launch(c) -> Why | None:
    """One launch of a single matrix, the mat-vec's or the GEMM's, whose store runs the epilogue."""
    w = c.w
    if not runs_in_one_launch(w.type, w.ne[2] * w.ne[3], w.ne[1], c.cols):
        return Why(c.mm, f"{c.cols} columns of a {w.type.label} {list(w.ne)} weight: not one launch of a single "
                         f"matrix (the mat-vec: 1..{MAT_VEC_COLS} columns; the GEMM: more, {'/'.join(GEMM_WEIGHTS)})")
    return None


def writes_input(at: str) -> Clause:
    """The between-clause: no node between the product and ``at`` writes x or the weight, which the fused node
    reads there."""
    return Clause("before", "w", lambda c: [c.x, c.w], "{node} writes {hit}, which the fused node reads at " + at)


def over_input(c, ctx: Context, out: Tensor, at: Tensor) -> Why | None:
    """``out`` overlaps x or the weight: a program stores its rows while other programs still read all of x."""
    hit = first_collision(ctx.ranges([out]), ctx.ranges([c.x, c.w]))
    if hit:
        return collision(at, f"{out.name!r} overlaps {hit[3].name!r}, which other programs still read", hit)
    return None


def product_read(c, ctx: Context, at: int, operands: list[Tensor]) -> Why | None:
    """The product's bytes read where the fused node at index ``at`` has them unwritten: by one of its own
    ``operands`` (the addend, a side: the product itself or a view of it), by a node in between (the capture's span),
    or by a later node before one writes them again (what the fused node writes, ``c.written()``, does)."""
    product = ctx.ranges([c.mm])
    hit = first_collision(ctx.ranges(operands), product)
    if hit:
        return collision(c.anchor, f"the fused node reads {hit[3].name!r}, the bytes of {c.mm.name!r}, which it "
                                   f"never writes", hit)
    for b in c.between(ctx):
        hit = first_collision(b.reads, product)
        if hit:
            return collision(b.node, f"{b.node.name!r} reads the bytes of {c.mm.name!r}, which the fused node never "
                                     f"writes", hit)
    return read_before_written(ctx, product, at, ctx.ranges(c.written()))


# ---- the records' check --------------------------------------------------------------------------------------------


def check_product(n: Tensor, out: Tensor, sides: list[Tensor]) -> None:
    """A fused node's product (sources w, x) runs as one launch whose store writes ``out`` and reads ``sides``, each
    f32 and in the kernel's scope (:func:`fits`), in ``out``'s shape."""
    w, x = n.src[:2]
    M, cols = w.ne[1], x.ne[1] * x.ne[2] * x.ne[3]
    need(w.ne[0] == x.ne[0] and limits.runs_in_one_launch(w.type, w.ne[2] * w.ne[3], M, cols), n,
         f"{cols} columns of a {w.type.label} {w.ne[:2]} weight: not one launch of a single matrix")
    need(limits.mat_vec_weight(w.type) and x.type is DType.F32, n,
         f"weight {w.type.label} and x {x.type.label}: the mat-vec takes f32/f16/bf16 or ggml block weights and f32 "
         "columns")
    for t in (out, *sides):
        need(t.type is DType.F32 and fits(t, M, cols) and t.ne == out.ne, n,
             f"{t.name!r} must be f32, packed, {M} x {cols} in the output's shape {out.ne}; is {t.type.label} {t.ne}")
