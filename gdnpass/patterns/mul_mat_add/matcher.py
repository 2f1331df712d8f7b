"""A MUL_MAT and the ADD of its product (the residual connection), fused into one MUL_MAT_ADD node.

    p = MUL_MAT(w, x) [; v = RESHAPE(p)]; s = ADD(p or v, r)      ->      MUL_MAT_ADD(w, x, r) writes s

Qwen3.5 adds the residual to the output projection of every layer (ssm_out, through a RESHAPE; attention's o) and
to the FFN's down projection: 64 ADDs of 1.8 us per qwen3.5-9b verify, each reading back a product just written.
The mat-vec (1-16 columns), or the GEMM beyond (several sequences' verify, bf16 / f16 weights), adds r to each
product as it stores it (f32, one rounding, as the ADD). The node runs at the ADD's
position and writes the ADD's memory; the product is never written.

Legality rules, in the order they run (the bracketed name is what a refusal reports; structural 1-6, hazards 7-9):
 1. [mul-mat-add.product] the ADD is no view (an in-place op) and reads the whole product in its element order:
    the MUL_MAT's output itself, or one packed view of all of it.
 2. [mul-mat-add.addend] the ADD's other operand has the sum's shape (no broadcast).
 3. [mul-mat-add.type] the weight is one the mat-vec reads (f32, f16, bf16 or a block type); x, the product, the
    addend and the sum are f32.
 4. [mul-mat-add.n-cols] the weight is one matrix and the product runs as one launch of the Triton mat-vec or
    GEMM unfused (``kernels.limits.runs_in_one_launch``: 1..MAT_VEC_COLS columns, or more of an f16 / bf16
    weight), whose store adds r: the sum holds the unfused product's bytes.
 5. [mul-mat-add.layout] the sum and the addend are packed, as many elements as the product (the record's scope: the
    store addresses them as the product's rows x columns).
 6. [mul-mat.user-count] the product and its view are read by the ADD alone and are not OUTPUT
    (``patterns.common.confined``).
 7. [between.writes-input] no node between the MUL_MAT and the ADD writes x or the weight: the fused node reads
    them at the ADD's place.
 8. [mul-mat-add.output-overlaps-input] the sum overlaps neither x nor the weight, and the addend only element for
    element (in place): a program stores its rows only after reading them, while other programs still read all of
    x.
 9. [mul-mat-add.product-read-later] nothing reads the product's bytes where the fused node leaves them unwritten:
    not the addend (the product itself, ADD(p, p)), no node between the MUL_MAT and the ADD, no later node before a
    node writes them again (a reader through a tensor of its own, an alias, which the user count does not see).

The checks shared with mul_mat_chain (rules 1, 3, 4, 7, 8, 9) are ``patterns.product_store``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdnpass.ir import DType, Graph, Op, Tensor
from gdnpass.patterns.common import (HAZARD, Context, Match, Why, between, collision, confined,
                                     first_collision, rule, same_elements)
from gdnpass.patterns.mul_mat_add.record import RECORD
from gdnpass.patterns.product_store import (ProductCapture, one_launch, over_input, product_of, product_read,
                                            readable, whole_product, writes_input)

NAME = "mul_mat_add"
fits = RECORD.scope  # the kernel's scope


def _operand(add: Tensor, pos: dict[int, int]) -> Tensor | None:
    """The ADD's first operand that is a MUL_MAT node (at a position of the graph) or a view of one."""
    for s in add.src[:2]:
        mm = product_of(s) if s is not None else None
        if mm is not None and mm.uid in pos:
            return s
    return None


@dataclass
class MatAddCapture(ProductCapture):
    mm: Tensor
    view: Tensor | None  # the view of the product the ADD reads, or None (it reads the product)
    add: Tensor

    ROLES = (("mul-mat", ("mm", "view")),)

    # ---- what the rewrite does (patterns.common.Capture; the rest: ProductCapture) ----------------------------------
    @property
    def epilogue(self) -> Tensor:
        return self.add

    def written(self) -> list[Tensor]:
        """The sum: the fused node's only output."""
        return [self.add]

    # ---- the operands ----------------------------------------------------------------------------------------------
    @property
    def read(self) -> Tensor:
        """What the ADD reads of the product: the product or its view."""
        return self.view if self.view is not None else self.mm

    @property
    def r(self) -> Tensor:
        return self.add.src[1] if self.add.src[0] is self.read else self.add.src[0]


@rule("mul-mat-add.product")
def _product(c: MatAddCapture, ctx):
    if c.add.view_src is not None:
        return Why(c.add, f"{c.add.name!r} is a view of {c.add.view_src.name!r} (an in-place ADD)")
    return whole_product(c)


@rule("mul-mat-add.addend")
def _addend(c: MatAddCapture, ctx):
    if c.r.ne != c.add.ne:
        return Why(c.add, f"the addend {c.r.name!r} {list(c.r.ne)} is broadcast into {list(c.add.ne)}")


@rule("mul-mat-add.type")
def _type(c: MatAddCapture, ctx):
    why = readable(c)
    if why:
        return why
    for t in (c.mm, c.r, c.add):
        if t.type is not DType.F32:
            return Why(t, f"{t.name!r} is {t.type.label}: the mat-vec's sum is f32")


@rule("mul-mat-add.n-cols")
def _n_cols(c: MatAddCapture, ctx):
    return one_launch(c)


@rule("mul-mat-add.layout")
def _layout(c: MatAddCapture, ctx):
    # (the addend has the sum's shape, rule 2: packed, it fits as the sum does)
    for t, ok in ((c.add, fits(c.add, c.w.ne[1], c.cols)), (c.r, c.r.is_contiguous())):
        if not ok:
            return Why(t, f"{t.name!r} ne {list(t.ne)}, nb {list(t.nb)}: the kernel writes and reads packed "
                          f"{c.w.ne[1]} x {c.cols}")


_between = between("between.writes-input", writes_input("the ADD"))


@rule("mul-mat-add.output-overlaps-input", HAZARD)
def _output_overlaps_input(c: MatAddCapture, ctx):
    why = over_input(c, ctx, c.add, c.add)
    if why:
        return why
    hit = first_collision(ctx.ranges([c.add]), ctx.ranges([c.r]))
    if hit and not same_elements(c.add, c.r):
        return collision(c.add, f"{c.add.name!r} overlaps the addend {c.r.name!r}, not element for element", hit)


@rule("mul-mat-add.product-read-later", HAZARD)
def _product_read_later(c: MatAddCapture, ctx):
    return product_read(c, ctx, ctx.pos[c.add.uid], [c.r])


RULES = (_product, _addend, _type, _n_cols, _layout, confined(MatAddCapture), _between, _output_overlaps_input,
         _product_read_later)


class MatMulAdd:
    name = NAME

    def rules(self, ctx: Context) -> tuple:
        return RULES

    def candidates(self, graph: Graph) -> list[Tensor]:
        """Every ADD with an operand that is a MUL_MAT node of the graph or a view of one (not a product an earlier
        rewrite replaced: the pair's A stays as the memory its node writes)."""
        pos = graph.positions()
        return [n for n in graph.nodes if n.op is Op.ADD and _operand(n, pos) is not None]

    def capture(self, graph: Graph, add: Tensor, ctx: Context) -> MatAddCapture:
        """The ADD's first operand that is a product (or a view of one) and its MUL_MAT."""
        read = _operand(add, ctx.pos)
        mm = product_of(read)
        return MatAddCapture(mm, None if read is mm else read, add)

    def plan(self, c: MatAddCapture, ctx: Context) -> None:
        return None  # one variant

    def rewrite(self, graph: Graph, m: Match) -> Tensor:
        """The fused node for ``m``: a view of the ADD's output (the pass puts it in place of ``m.removed``)."""
        c = m.capture
        return Tensor(name=f"mul_mat_add({c.add.name})", type=DType.F32, ne=c.add.ne, nb=c.add.nb, op=RECORD.op,
                      op_params={"replaced": [t.name for t in c.removed()]}, src=[c.w, c.x, c.r],
                      view_src=c.add, view_offs=0, layer=m.layer)
