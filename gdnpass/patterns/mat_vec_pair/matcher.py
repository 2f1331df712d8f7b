"""Two MUL_MATs sharing their input (Qwen3.5's alpha/beta projections), fused into one MUL_MAT_VEC_PAIR node.

    A = MUL_MAT(w_a, x)  ...  B = MUL_MAT(w_b, x)      ->      PAIR(w_a, x, w_b) writes A and B at A's position

Candidates are MUL_MATs of one layer whose weights have the same shape, paired in node order. The fused node
writes B's product early (at A's position) and reads B's weight and x early; the rules protect those moves.

Legality rules, in the order they run (the bracketed name is what a refusal reports; structural 1-4, hazards 5-6):
 1. [pair.different-src1] both read the same src1 tensor.
 2. [pair.type] both weights have the same type (one the mat-vec reads: f32, f16, bf16 or a block type) and x is
    f32.
 3. [pair.n-cols] each weight is one matrix and the product runs as one launch of the Triton mat-vec or GEMM
    unfused (``kernels.limits.runs_in_one_launch``: 1..MAT_VEC_COLS columns, or more of f16 / bf16 weights), so the
    pair, that kernel with a second product on its grid, is byte-identical to the two products.
 4. [pair.flags] B is not an INPUT/OUTPUT tensor (OUTPUT may be read by the host at any point).
 5. [pair.alias] B's product overlaps nothing the pair reads (x, the weights) nor A's product.
 6. Nodes in between (``patterns.common.between``: every kernel node after A and before B), on byte ranges of the
    plan:
    - [between.writes-destination] none may write A's or B's product;
    - [between.writes-input] none may write x or B's weight;
    - [between.reads-destination-early] none may read B's product (it now holds B's value early).

No use confinement: the rewrite removes only A and B, and the fused node writes both (``patterns.common.confined``
has no interior node to check).

``prepare`` is the graph-optimize step that runs before planning (as ggml-cuda's graph_optimize reorders nodes so
that fusable ones are adjacent): it moves B to just after A when B's inputs are ready there, which leaves no node
in between and keeps A alive while B is allocated. Without it, gallocr may give B the block A's product vacated
(A dies at its first reader), and rule 6 then refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdnpass.ir import DType, Flag, Graph, Op, Tensor
from gdnpass.kernels import limits
from gdnpass.kernels.limits import GEMM_WEIGHTS, MAT_VEC_COLS
from gdnpass.patterns.common import (HAZARD, Capture, Clause, Context, Match, Why, between, collision, first_collision,
                                     rule)
from gdnpass.patterns.mat_vec_pair.record import RECORD

NAME = "mul_mat_vec_pair"
runs_in_one_launch = RECORD.scope  # the kernels' limits


@dataclass
class PairCapture(Capture):
    a: Tensor
    b: Tensor

    # ---- what the rewrite does (patterns.common.Capture) -----------------------------------------------------------
    @property
    def anchor(self) -> Tensor:
        return self.a

    def removed(self) -> list[Tensor]:
        return [self.a, self.b]

    def written(self) -> list[Tensor]:
        """A's product (the fused node's primary output), then B's."""
        return [self.a, self.b]

    def span(self, ctx: Context) -> tuple[int, int, int]:
        """A .. B; the fused node runs at A."""
        return ctx.pos[self.a.uid], ctx.pos[self.a.uid], ctx.pos[self.b.uid]

    @property
    def w_a(self) -> Tensor:
        return self.a.src[0]

    @property
    def w_b(self) -> Tensor:
        return self.b.src[0]

    @property
    def x(self) -> Tensor:
        return self.a.src[1]

    @property
    def cols(self) -> int:
        x = self.x
        return x.ne[1] * x.ne[2] * x.ne[3]


@rule("pair.different-src1")
def _same_src1(c: PairCapture, ctx):
    if c.b.src[1] is not c.x:
        return Why(c.b, f"{c.a.name!r} reads {c.x.name!r} but {c.b.name!r} reads {c.b.src[1].name!r}")


@rule("pair.type")
def _types(c: PairCapture, ctx):
    wa, wb = c.w_a, c.w_b
    if wa.type is not wb.type or not limits.mat_vec_weight(wa.type) or c.x.type is not DType.F32:
        return Why(c.b, f"weight types {wa.type.label}/{wb.type.label} (x {c.x.type.label}) do not pair")


@rule("pair.n-cols")
def _n_cols(c: PairCapture, ctx):
    wa = c.w_a
    if not runs_in_one_launch(wa.type, wa.ne[2] * wa.ne[3], wa.ne[1], c.cols):
        return Why(c.b, f"{c.cols} columns of a {wa.type.label} weight of {wa.ne[1]} rows: not one launch of a "
                        f"single matrix (the mat-vec: 1..{MAT_VEC_COLS} columns; the GEMM: more, "
                        f"{'/'.join(GEMM_WEIGHTS)})")


@rule("pair.flags")
def _flags(c: PairCapture, ctx):
    if c.b.flags & (Flag.OUTPUT | Flag.INPUT):
        return Why(c.b, f"{c.b.name!r} is flagged INPUT/OUTPUT and cannot be computed early")


@rule("pair.alias", HAZARD)
def _alias(c: PairCapture, ctx):
    hit = first_collision(ctx.ranges([c.b]), ctx.ranges([c.x, c.w_a, c.w_b, c.a]))
    if hit:
        return collision(c.b, f"{c.b.name!r} overlaps {hit[3].name!r}", hit)


_PAIR = "{node} %s ({hit}) between the pair"

RULES = (
    _same_src1, _types, _n_cols, _flags, _alias,
    between("between.writes-destination", Clause("after", "w", lambda c: [c.a, c.b], _PAIR % "writes a product")),
    between("between.writes-input", Clause("after", "w", lambda c: [c.x, c.w_b],
                                           _PAIR % "writes an input of the pair")),
    between("between.reads-destination-early", Clause("after", "r", lambda c: [c.b],
                                                      _PAIR % "reads the second product early")),
)


class MatVecPair:
    name = NAME

    def rules(self, ctx: Context) -> tuple:
        return RULES

    def candidates(self, graph: Graph) -> list[tuple[Tensor, Tensor]]:
        """(A, B): MUL_MATs of one layer with same-shaped weights, paired in node order, those reading the same
        activation first (an attention layer's Q+gate has the FFN gate/up's weight shape: gate pairs with up, not
        with Q); the rest in node order too, for the rules to judge (and name)."""
        groups: dict[tuple, list[Tensor]] = {}
        for n in graph.nodes:
            if n.op is Op.MUL_MAT:
                groups.setdefault((n.layer, n.src[0].ne), []).append(n)
        pairs = []
        for mms in groups.values():
            by_x: dict[int, list[Tensor]] = {}
            for n in mms:
                by_x.setdefault(n.src[1].uid, []).append(n)
            paired = [p for same in by_x.values() for p in zip(same[0::2], same[1::2])]
            taken = {n.uid for p in paired for n in p}
            rest = [n for n in mms if n.uid not in taken]
            pairs += paired + list(zip(rest[0::2], rest[1::2]))
        pos = graph.positions()
        return sorted(pairs, key=lambda p: pos[p[0].uid])

    def prepare(self, graph: Graph) -> int:
        """Move each candidate's B right after its A when B's inputs are ready there; returns how many moved."""
        moved = 0
        for a, b in self.candidates(graph):
            pos = graph.positions()
            ready = {t.uid for t in graph.leafs} | {n.uid for n in graph.nodes[: pos[a.uid] + 1]}
            if all(s.uid in ready for s in b.src) and pos[b.uid] > pos[a.uid] + 1:
                graph.nodes.remove(b)
                graph.nodes.insert(pos[a.uid] + 1, b)
                moved += 1
        return moved

    def capture(self, graph: Graph, pair: tuple[Tensor, Tensor], ctx: Context) -> PairCapture:
        return PairCapture(*pair)

    def plan(self, c: PairCapture, ctx: Context) -> None:
        return None  # one variant: the mat-vec kernel with a second program row

    def rewrite(self, graph: Graph, m: Match) -> Tensor:
        """The fused node for ``m`` (the pass puts it in place of ``m.removed``)."""
        c = m.capture
        primary, *outs = c.written()
        il = m.layer if m.layer is not None else -1
        stem = lambda w: w.name.split(".")[-2] if w.name.startswith("blk.") else w.name  # blk.N.ssm_alpha.weight
        return Tensor(name=f"mul_mat_vec_pair({stem(c.w_a)}+{stem(c.w_b)})-{il}", type=DType.F32, ne=primary.ne,
                      nb=primary.nb, op=RECORD.op, op_params={"replaced": [c.a.name, c.b.name]},
                      src=[c.w_a, c.x, c.w_b], outs=outs, view_src=primary, view_offs=0, layer=m.layer)
