"""Two thin MUL_MATs sharing their input (Qwen3.5's alpha/beta projections), fused into one MUL_MAT_VEC_PAIR node.

    A = MUL_MAT(w_a, x)  ...  B = MUL_MAT(w_b, x)      ->      PAIR(w_a, x, w_b) writes A and B at A's position

Candidates are MUL_MATs of one layer whose weights have the same shape, paired in node order. The fused node
writes B's product early (at A's position) and reads B's weight and x early; the rules protect those moves.

Legality rules (all must hold; the bracketed name is what a refusal reports):
 1. [pair.different-src1] both read the same src1 tensor.
 2. [pair.type] both weights have the same type (f32, f16 or bf16) and x is f32.
 3. [pair.n-cols] each weight is one matrix and the product runs the Triton mat-vec unfused
    (``kernels.runs_as_mat_vec``: 1..8 columns, or up to 16 for thin products of <= 256 rows, where the H200
    measurement says pairing still pays), so the pair is byte-identical to the two products.
 4. [pair.flags] B is not an INPUT/OUTPUT tensor (OUTPUT may be read by the host at any point).
 5. [pair.alias] B's product overlaps nothing the pair reads (x, the weights) nor A's product.
 6. Nodes in between (every node after A and before B), on byte ranges of the plan:
    - [between.writes-destination] none may write A's or B's product;
    - [between.writes-input] none may write x or B's weight;
    - [between.reads-destination-early] none may read B's product (it now holds B's value early).

``prepare`` is the graph-optimize step that runs before planning (as ggml-cuda's graph_optimize reorders nodes so
that fusable ones are adjacent): it moves B to just after A when B's inputs are ready there, which leaves no node
in between and keeps A alive while B is allocated. Without it, gallocr may give B the block A's product vacated
(A dies at its first reader), and rule 6 then refuses.
"""

from __future__ import annotations

from gdnpass.ir import DType, Flag, Graph, Op, Tensor, runs_kernel
from gdnpass.kernels import runs_as_mat_vec
from gdnpass.matchers.common import Context, Match, Refusal, first_collision

NAME = "mul_mat_vec_pair"


def _cols(x: Tensor) -> int:
    return x.ne[1] * x.ne[2] * x.ne[3]


class MatVecPair:
    name = NAME

    def candidates(self, graph: Graph) -> list[tuple[Tensor, Tensor]]:
        """(A, B): MUL_MATs of one layer with same-shaped weights, paired in node order."""
        groups: dict[tuple, list[Tensor]] = {}
        for n in graph.nodes:
            if n.op is Op.MUL_MAT:
                groups.setdefault((n.layer, n.src[0].ne), []).append(n)
        pairs = []
        for mms in groups.values():
            pairs += list(zip(mms[0::2], mms[1::2]))
        return sorted(pairs, key=lambda p: graph.nodes.index(p[0]))

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

    def match(self, graph: Graph, pair: tuple[Tensor, Tensor], ctx: Context) -> Match | Refusal:
        a, b = pair
        wa, x = a.src
        wb, xb = b.src

        def refuse(rule: str, node: Tensor, reason: str, hit=None) -> Refusal:
            return Refusal(NAME, rule, node, reason, a.layer, (hit[0], hit[2]) if hit else None)

        if xb is not x:
            return refuse("pair.different-src1", b, f"{a.name!r} reads {x.name!r} but {b.name!r} reads {xb.name!r}")
        if wa.type is not wb.type or wa.type not in (DType.F32, DType.F16, DType.BF16) or x.type is not DType.F32:
            return refuse("pair.type", b, f"weight types {wa.type.label}/{wb.type.label} (x {x.type.label}) do not pair")
        cols = _cols(x)
        if not runs_as_mat_vec(wa.ne[1], cols) or wa.ne[2] * wa.ne[3] != 1:
            return refuse("pair.n-cols", b, f"{cols} columns of {wa.ne[1]} rows: outside the mat-vec's scope "
                                            "(1..8 columns, or 9..16 for <= 256 rows)")
        if b.flags & (Flag.OUTPUT | Flag.INPUT):
            return refuse("pair.flags", b, f"{b.name!r} is flagged INPUT/OUTPUT and cannot be computed early")

        if ctx.check_hazards:
            hit = first_collision(ctx.ranges([b]), ctx.ranges([x, wa, wb, a]))
            if hit:
                return refuse("pair.alias", b, f"{b.name!r} overlaps {hit[3].name!r}", hit)
            pos = ctx.pos
            for n in graph.nodes[pos[a.uid] + 1: pos[b.uid]]:
                if not runs_kernel(n):
                    continue
                w, r = ctx.node_writes(n), ctx.node_reads(n)
                for rule, mine, theirs, what in (
                        ("between.writes-destination", w, ctx.ranges([a, b]), "writes a product"),
                        ("between.writes-input", w, ctx.ranges([x, wb]), "writes an input of the pair"),
                        ("between.reads-destination-early", r, ctx.ranges([b]), "reads the second product early")):
                    hit = first_collision(mine, theirs)
                    if hit:
                        return refuse(rule, n, f"{n.name!r} {what} ({hit[3].name!r}) between the pair", hit)
        return Match(NAME, a, a.layer, dict(a=a, b=b, w_a=wa, w_b=wb, x=x), [a, b], (ctx.pos[a.uid], ctx.pos[b.uid]))

    def rewrite(self, graph: Graph, m: Match) -> Tensor:
        """The fused node for ``m`` (the pass puts it in place of ``m.removed``)."""
        a, b = m.captures["a"], m.captures["b"]
        il = m.layer if m.layer is not None else -1
        stem = lambda w: w.name.split(".")[-2] if w.name.startswith("blk.") else w.name  # blk.N.ssm_alpha.weight
        fused = Tensor(name=f"mul_mat_vec_pair({stem(m.captures['w_a'])}+{stem(m.captures['w_b'])})-{il}", type=DType.F32, ne=a.ne, nb=a.nb,
                       op=Op.MUL_MAT_VEC_PAIR, op_params={"n_inputs": 3, "replaced": [a.name, b.name]},
                       src=[m.captures["w_a"], m.captures["x"], m.captures["w_b"], b], view_src=a, view_offs=0,
                       layer=m.layer)
        return fused
