"""A MUL_MAT_VEC_PAIR whose two products only a SwiGLU reads (Qwen3.5's FFN gate / up), the GLU run in the pair's
own launch, which then writes the GLU's output and neither product.

    PAIR(w_gate, x, w_up) writes gate, up                      PAIR(w_gate, x, w_up; glu) writes y
    y = GLU(SWIGLU, gate, up)                         ->

The pair's programs store their partial sums into the split workspace and draw one ticket a row block for both
products; the program that draws the last adds each product's slices as the single product does and stores
silu(gate)·up, the GLU kernel's expression (``triton_matvec.mul_mat_vec_pair_glu``). One launch fewer a layer, and the
two products never reach memory. The fused node runs at the pair's place: it writes the GLU's output early.

Legality rules, in the order they run (the bracketed name is what a refusal reports; structural 1-4, hazards 5-7):
 1. [pair-glu.type] the products and y are f32, and the pair's weights a plain type (f32, f16, bf16) or a block
    type whose y a Q8_0 product reads (ffn_down): the fused node can then hand y on as that product's q8_1
    activations (``gdnpass.prepasses``: its groups of 32 lie in the pair's row blocks), one launch fewer. For any
    other reader the GLU writes y quantized itself (a K-quant reader's q8_K blocks span 256 rows, 4 row blocks):
    fused, the reader's pre-pass would take the GLU's launch, and nothing is saved.
 2. [pair-glu.tile] the pair runs as the mat-vec (1..MAT_VEC_COLS columns: the GEMM has no such epilogue) on a tile
    that splits K (``kernels.tiles.mat_vec_tile``): its programs already meet in the workspace, the epilogue adds only
    the shared ticket. On an unsplit tile every program pays a round trip and a ticket, which cost more than the
    GLU's launch (the H100 probe of the sixteenth session, docs/performance.md: faster than the two launches on every
    split tile, slower on every unsplit one).
 3. [pair-glu.layout] y lies as the products do (the same shape and strides): the kernel stores it where it would
    store a product.
 4. [pair-product.user-count] the products and the pair node are read by the GLU alone and are not OUTPUT
    (``patterns.common.confined``).
 5. [pair-glu.output-overlaps-input] y overlaps none of x and the two weights: a program stores its rows of y while
    other programs still read them.
 6. [pair-glu.between] no node between the pair and the GLU reads or writes y's bytes (the fused node writes y at
    the pair's place, before them) or reads the products' bytes (never written now).
 7. [pair-glu.product-read-later] no node after the GLU reads the products' bytes before a node writes them again:
    the fused node never writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdnpass.ir import DType, Graph, Op, Tensor
from gdnpass.kernels.limits import MAT_VEC_COLS, runs_as_mat_vec
from gdnpass.kernels.tiles import mat_vec_tile
from gdnpass.patterns.common import (HAZARD, Capture, Clause, Context, Match, Why, between, collision, confined,
                                     first_collision, read_before_written, rule)
from gdnpass.patterns.mat_vec_pair.record import OP as PAIR_OP
from gdnpass.patterns.mat_vec_pair.record import glu_of

NAME = "pair_glu"


@dataclass
class PairGluCapture(Capture):
    pair: Tensor      # the MUL_MAT_VEC_PAIR node (a view of its first product)
    glu: Tensor       # the GLU node, y
    swapped: bool     # the gate is the second product

    ROLES = (("pair-product", ("pair", "a", "b")),)

    @property
    def a(self) -> Tensor:
        return self.pair.view_src

    @property
    def b(self) -> Tensor:
        return self.pair.outs[0]

    @property
    def x(self) -> Tensor:
        return self.pair.src[1]

    @property
    def weights(self) -> list[Tensor]:
        return [self.pair.src[0], self.pair.src[2]]

    # ---- what the rewrite does (patterns.common.Capture) -----------------------------------------------------------
    @property
    def anchor(self) -> Tensor:
        return self.pair

    def removed(self) -> list[Tensor]:
        return [self.pair, self.glu]

    def written(self) -> list[Tensor]:
        return [self.glu]

    def span(self, ctx: Context) -> tuple[int, int, int]:
        """The pair .. the GLU; the fused node runs at the pair."""
        at = ctx.pos[self.pair.uid]
        return at, at, ctx.pos[self.glu.uid]


def _reader(ctx: Context, pair: Tensor) -> tuple[Tensor, bool] | None:
    """The SWIGLU node of two sources that reads the pair's products, one each (and whether the gate is the second
    product), or None."""
    a, b = pair.view_src, pair.outs[0]
    for n in ctx.users(a):
        if n.op is Op.GLU and n.op_params.get("kind") == "SWIGLU" and len(n.src) == 2:
            gate, up = n.src[::-1] if n.op_params.get("swapped") else n.src
            if (gate, up) in ((a, b), (b, a)):
                return n, gate is b
    return None


def _hands_on(ctx: Context, y: Tensor) -> bool:
    """Whether a product of Q8_0 weights reads ``y`` as its activations (the q8_1 groups a fused node hands on)."""
    from gdnpass.prepasses import PRODUCTS  # (prepasses imports the patterns' scopes)

    return any(n.op.value in PRODUCTS and len(n.src) > 1 and n.src[1] is y and n.src[0].type is DType.Q8_0
               for n in ctx.users(y))


@rule("pair-glu.type")
def _type(c: PairGluCapture, ctx):
    w = c.weights[0]
    if w.type.is_quantized and not _hands_on(ctx, c.glu):  # (a pair's weights are a type the mat-vec reads)
        return Why(c.pair, f"{w.name!r} is {w.type.label} and no Q8_0 product reads {c.glu.name!r}: only a Q8_0 "
                           f"reader's activations can be handed on, where the fused node saves the GLU's launch")
    for t in (c.a, c.b, c.glu):
        if t.type is not DType.F32:
            return Why(t, f"{t.name!r} is {t.type.label}: the epilogue computes SwiGLU in f32")


@rule("pair-glu.tile")
def _tile(c: PairGluCapture, ctx):
    cols = c.x.ne[1] * c.x.ne[2] * c.x.ne[3]
    if not runs_as_mat_vec(c.a.ne[0], cols):
        return Why(c.pair, f"{cols} columns: the pair runs as the GEMM (the mat-vec takes 1..{MAT_VEC_COLS}), which "
                           f"has no SwiGLU epilogue")
    w = c.weights[0]
    tile = mat_vec_tile(w.ne[1], cols, w.ne[0], w.type.label, products=2)
    if tile.split_k == 1:
        return Why(c.pair, f"the pair's tile at {cols} columns of {w.ne[1]} x {w.ne[0]} {w.type.label} does not split "
                           f"K: there the epilogue's round trip costs more than the GLU's launch")


@rule("pair-glu.layout")
def _layout(c: PairGluCapture, ctx):
    if c.glu.ne != c.a.ne or c.glu.nb != c.a.nb:
        return Why(c.glu, f"{c.glu.name!r} ne {list(c.glu.ne)} nb {list(c.glu.nb)} does not lie as the products "
                          f"({list(c.a.ne)}, {list(c.a.nb)}): the kernel stores it where it would store them")


@rule("pair-glu.output-overlaps-input", HAZARD)
def _output_overlaps_input(c: PairGluCapture, ctx):
    hit = first_collision(ctx.ranges([c.glu]), ctx.ranges([c.x, *c.weights]))
    if hit:
        return collision(c.glu, f"{c.glu.name!r} overlaps {hit[3].name!r}, which other programs of the launch read "
                                f"while one stores y", hit)


_between = between(
    "pair-glu.between",
    Clause("after", "rw", lambda c: [c.glu], "{node} touches the bytes of {hit}, which the fused node writes before "
                                             "it"),
    Clause("after", "r", lambda c: [c.a, c.b], "{node} reads the bytes of {hit}, which the fused node never writes"),
)


@rule("pair-glu.product-read-later", HAZARD)
def _product_read_later(c: PairGluCapture, ctx):
    return read_before_written(ctx, ctx.ranges([c.a, c.b]), ctx.pos[c.glu.uid], ctx.ranges([c.glu]))


RULES = (_type, _tile, _layout, confined(PairGluCapture), _output_overlaps_input, _between, _product_read_later)


class PairGlu:
    name = NAME

    def rules(self, ctx: Context) -> tuple:
        return RULES

    def candidates(self, graph: Graph) -> list[Tensor]:
        """Every MUL_MAT_VEC_PAIR that still stores its products."""
        return [n for n in graph.nodes if n.op is PAIR_OP and glu_of(n) is None]

    def capture(self, graph: Graph, pair: Tensor, ctx: Context) -> PairGluCapture | None:
        """The pair and the SwiGLU of its products; None when no GLU reads them so."""
        found = _reader(ctx, pair)
        return PairGluCapture(pair, *found) if found else None

    def plan(self, c: PairGluCapture, ctx: Context) -> None:
        return None  # one variant

    def rewrite(self, graph: Graph, m: Match) -> Tensor:
        """The pair node again, writing y (the pass puts it in place of ``m.removed``)."""
        c = m.capture
        params = dict(c.pair.op_params, glu="SWIGLU", swapped=c.swapped)
        params["replaced"] = [*c.pair.op_params.get("replaced", [c.pair.name]), c.glu.name]
        return Tensor(name=f"{c.pair.name.split(')-')[0]}+swiglu)-{c.pair.name.rsplit('-', 1)[-1]}", type=DType.F32,
                      ne=c.glu.ne, nb=c.glu.nb, op=PAIR_OP, op_params=params, src=list(c.pair.src), outs=[],
                      view_src=c.glu, view_offs=0, layer=m.layer)


__all__ = ["NAME", "PairGlu", "PairGluCapture"]
