"""A MUL_MAT and the elementwise chain that starts from its product, fused into one MUL_MAT_CHAIN node.

    p = MUL_MAT(w, x) [; v = RESHAPE(p)]; y = ELEMENTWISE_CHAIN(p or v, b1[, b2])
                                                        ->      MUL_MAT_CHAIN(w, x, b1[, b2]) writes y

Qwen3.5's GDN layer gates its normalised output with its z projection, ``MUL(norm, SILU(z))``: an ELEMENTWISE_CHAIN
of a product just written (24 launches of a qwen3.5-9b verify, each reading back 4096 x T floats). The mat-vec (1-16
columns), or the GEMM beyond (f16 / bf16 weights), runs the chain's steps on each sum as it stores it, the very
steps of ELEMENTWISE_CHAIN's kernel (``triton_core.chain_step``): MUL_MAT_ADD's residual store, generalised. The node
runs at the chain's position and writes its memory; the product is never written. It takes ELEMENTWISE_CHAIN nodes
(the elementwise_chain pattern's): a chain that pattern refused keeps its launch.

Legality rules, in the order they run (the bracketed name is what a refusal reports; structural 1-5, hazards 6-8):
 1. [mul-mat-chain.product] the chain's input is the whole product in its element order: the MUL_MAT's output
    itself, or one packed view of all of it.
 2. [mul-mat-chain.type] the weight is one the mat-vec reads (f32, f16, bf16 or a block type) and x is f32 (the
    product and the chain are f32: the chain's own rules).
 3. [mul-mat-chain.n-cols] the weight is one matrix and the product runs as one launch of the Triton mat-vec or GEMM
    unfused (``kernels.limits.runs_in_one_launch``), whose store runs the steps: the output holds the unfused
    product's bytes through them.
 4. [mul-mat-chain.layout] the chain's output is packed, as many elements as the product (the record's scope: the
    store addresses it as the product's rows x columns), and each side operand is packed in the output's shape: the
    store reads a side's element where it writes the output's (no broadcast).
 5. [mul-mat.user-count] / [elt-chain.user-count] the product and its view are read by the chain alone, and the
    chain node by no one, and none is OUTPUT (``patterns.common.confined``).
 6. [between.writes-input] no node between the MUL_MAT and the chain writes x or the weight: the fused node reads
    them at the chain's place.
 7. [mul-mat-chain.output-overlaps-input] the output overlaps neither x nor the weight: a program stores its rows
    while other programs still read all of x. (Over a side operand only element for element: the chain's own
    elt-chain.output-overlaps-input held that on this plan.)
 8. [mul-mat-chain.product-read-later] nothing reads the product's bytes where the fused node leaves them unwritten:
    not a side operand (the product itself: ``MUL(p, SIGMOID(p))``), no node between the MUL_MAT and the chain, no
    later node before a node writes them again (a reader through a tensor of its own, an alias, which the user
    count does not see).

The checks shared with mul_mat_add (rules 1-3, 6-8) are ``patterns.product_store``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdnpass.ir import DType, Graph, Tensor
from gdnpass.patterns.common import HAZARD, Context, Match, Why, between, confined, rule
from gdnpass.patterns.elementwise_chain.record import OP as CHAIN_OP
from gdnpass.patterns.mul_mat_chain.record import RECORD
from gdnpass.patterns.product_store import (ProductCapture, one_launch, over_input, product_of, product_read,
                                            readable, whole_product, writes_input)

NAME = "mul_mat_chain"
fits = RECORD.scope  # the kernel's scope


@dataclass
class MatChainCapture(ProductCapture):
    mm: Tensor
    view: Tensor | None  # the view of the product the chain reads, or None (it reads the product)
    chain: Tensor        # the ELEMENTWISE_CHAIN node

    ROLES = (("mul-mat", ("mm", "view")), ("elt-chain", ("chain",)))

    # ---- what the rewrite does (patterns.common.Capture; the rest: ProductCapture) ----------------------------------
    @property
    def epilogue(self) -> Tensor:
        return self.chain

    def written(self) -> list[Tensor]:
        """The chain's output: the fused node's only one."""
        return [self.out]

    # ---- the operands ----------------------------------------------------------------------------------------------
    @property
    def out(self) -> Tensor:
        return self.chain.view_src

    @property
    def sides(self) -> list[Tensor]:
        return list(self.chain.src[1:])


@rule("mul-mat-chain.product")
def _product(c: MatChainCapture, ctx):
    return whole_product(c)


@rule("mul-mat-chain.type")
def _type(c: MatChainCapture, ctx):
    return readable(c)


@rule("mul-mat-chain.n-cols")
def _n_cols(c: MatChainCapture, ctx):
    return one_launch(c)


@rule("mul-mat-chain.layout")
def _layout(c: MatChainCapture, ctx):
    if not fits(c.out, c.w.ne[1], c.cols):
        return Why(c.out, f"{c.out.name!r} ne {list(c.out.ne)}, nb {list(c.out.nb)}: the kernel writes the packed "
                          f"{c.w.ne[1]} x {c.cols} elements of the product")
    for b in c.sides:
        if b.ne != c.out.ne or not b.is_contiguous():
            return Why(b, f"{b.name!r} ne {list(b.ne)}, nb {list(b.nb)}: the kernel reads a side operand packed in "
                          f"the output's shape {list(c.out.ne)}")


_between = between("between.writes-input", writes_input("the chain"))


@rule("mul-mat-chain.output-overlaps-input", HAZARD)
def _output_overlaps_input(c: MatChainCapture, ctx):
    return over_input(c, ctx, c.out, c.chain)


@rule("mul-mat-chain.product-read-later", HAZARD)
def _product_read_later(c: MatChainCapture, ctx):
    return product_read(c, ctx, ctx.pos[c.chain.uid], c.sides)


RULES = (_product, _type, _n_cols, _layout, confined(MatChainCapture), _between, _output_overlaps_input,
         _product_read_later)


class MatMulChain:
    name = NAME

    def rules(self, ctx: Context) -> tuple:
        return RULES

    def candidates(self, graph: Graph) -> list[Tensor]:
        """Every ELEMENTWISE_CHAIN whose input is a MUL_MAT node of the graph or a view of one."""
        pos = graph.positions()
        return [n for n in graph.nodes if n.op is CHAIN_OP and self._product(n.src[0], pos) is not None]

    @staticmethod
    def _product(t: Tensor, pos: dict[int, int]) -> Tensor | None:
        mm = product_of(t)
        return mm if mm is not None and mm.uid in pos else None

    def capture(self, graph: Graph, chain: Tensor, ctx: Context) -> MatChainCapture:
        read = chain.src[0]
        mm = product_of(read)
        return MatChainCapture(mm, None if read is mm else read, chain)

    def plan(self, c: MatChainCapture, ctx: Context) -> None:
        return None  # one variant

    def rewrite(self, graph: Graph, m: Match) -> Tensor:
        """The fused node for ``m``: a view of the chain's output (the pass puts it in place of ``m.removed``)."""
        c = m.capture
        return Tensor(name=f"mul_mat_chain({c.out.name})", type=DType.F32, ne=c.out.ne, nb=c.out.nb, op=RECORD.op,
                      op_params={"steps": list(c.chain.op_params["steps"]),
                                 "replaced": [c.mm.name, *([c.view.name] if c.view is not None else []),
                                              *c.chain.op_params["replaced"]]},
                      src=[c.w, c.x, *c.sides], view_src=c.out, view_offs=0, layer=m.layer)


__all__ = ["NAME", "MatChainCapture", "MatMulChain"]
