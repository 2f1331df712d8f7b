"""Trip graphs of the mat-vec pair's rules (tests/patterns/test_rules.py runs them, with every registered pattern's):
the alpha/beta products of the small planned verify graph (tests/support/surgery.py), one mutation per rule that
breaks that rule and no other; for every hazard a graph where forcing the rewrite past it corrupts bytes, but one.

``between.writes-destination`` refuses writes to A's product between A and B, which no forced rewrite can turn into
a difference (``p_write_a_between``, ``corrupts=False``); its B half is the hazard. ``pair.alias`` is a race between
the programs of one Triton launch: its proof runs the mat-vec kernels, single and paired, in the interpreter.
"""

from __future__ import annotations

from gdnpass import ops
from gdnpass.ir import DType, Flag, Graph, Op
from gdnpass.kernels import backends
from gdnpass.patterns.mat_vec_pair import MatVecPair
from support.surgery import IDS, chain, feed_layer_output, insert_after, insert_before, planned
from support.trips import Trip

CHECK = dict(ids=IDS)  # check_fusion's keywords for the force proofs


def alpha_beta(g: Graph) -> tuple:
    mm = {n.src[0].name.split(".")[-2]: n for n in g.nodes if n.op is Op.MUL_MAT}
    return mm["ssm_alpha"], mm["ssm_beta"]


def p_different_src1(g, a, b):  # B reads a copy of x
    b.src[1] = insert_before(g, b, ops.cont(a.src[1]))


def p_type(g, a, b):
    b.src[0].type = DType.BF16


def p_x_type(g, a, b):  # the weights agree, x is f16
    a.src[1].type = DType.F16


def p_flags(g, a, b):
    b.flags |= Flag.OUTPUT


def p_b_over_x(g, a, b):  # gallocr-style reuse gone wrong: B's product on x's first bytes
    b.offset = a.src[1].base.offset


def p_write_b_between(g, a, b):  # a node between A and B writes B's block (B overwrote it, unfused)
    x = a.src[1]
    insert_after(g, a, ops.cont(ops.view_1d(x, b.nelements, 0)), offset=b.offset)


def p_write_a_between(g, a, b):
    """The same over A's block (the pair fusion test's old graph): a conservative refusal. The pair writes A at A's own
    position, as the unfused graph did, so a node between clobbers A in both graphs alike and forcing changes no
    byte: the A half of between.writes-destination protects nothing (writes-input, consistently, leaves w_a out)."""
    x = a.src[1]
    insert_after(g, a, ops.cont(ops.view_1d(x, a.nelements, 0)), offset=a.offset)


def p_write_x_between(g, a, b):
    insert_after(g, a, ops.scale(a.src[1], 2.0, inplace=True))


def p_read_b_between(g, a, b):  # reads B's block before B ran, feeding the layer output
    stale = ops.new_tensor("stale", DType.F32, (b.nelements,), buffer="arena")
    stale.offset = b.offset
    feed_layer_output(g, chain(g), insert_after(g, a, ops.exp(stale)))


# ---- the table -------------------------------------------------------------------------------------------------------


TRIPS = [
    Trip("pair.different-src1", p_different_src1),
    Trip("pair.type", p_type),
    Trip("pair.type", p_x_type, name="x"),
    Trip("pair.n-cols", config=dict(n_tokens=17)),
    Trip("pair.flags", p_flags),
    Trip("pair.alias", p_b_over_x, kernels="triton-pair"),
    Trip("between.writes-destination", p_write_b_between, name="b"),
    Trip("between.writes-destination", p_write_a_between, name="a", corrupts=False),
    Trip("between.writes-input", p_write_x_between),
    Trip("between.reads-destination-early", p_read_b_between),
]


def candidate(t: Trip | None = None, mutate: bool = True):
    """(graph, pattern, anchor) of a trip case (None: the plain graph); ``mutate=False``: the same graph unmutated."""
    g = planned(**(t.config if t else {}))
    pattern = MatVecPair()
    a, b = alpha_beta(g)
    if t is not None and mutate and t.mutate:
        t.mutate(g, a, b)
    anchor = next(p for p in pattern.candidates(g) if p[0] is a)
    return g, pattern, anchor


TORCH, TRITON = backends.TORCH_BACKEND, backends.TRITON_BACKEND


def _small(op):
    """The Triton kernel of ``op`` for products of at most 32 rows (alpha/beta), torch for the others (the FFN's
    192-row products take seconds in the interpreter)."""
    tri, ref = TRITON[op], TORCH[op]

    def adapter(node, views, out):
        (tri if node.ne[0] <= 32 else ref)(node, views, out)

    return adapter


def kernels(t: Trip) -> dict | None:
    """The kernel table of a force proof: torch, or with the Triton mat-vec kernels (in the interpreter on a
    CPU), single and paired alike (the paired kernel is byte-identical to the single one, not to torch's)."""
    if t.kernels == "torch":
        return backends.TORCH_BACKEND  # (named: on a GPU the executor's default is Triton)
    if t.kernels == "triton-pair":
        return {**TORCH, Op.MUL_MAT: _small(Op.MUL_MAT), Op.MUL_MAT_VEC_PAIR: _small(Op.MUL_MAT_VEC_PAIR)}
    raise KeyError(t.kernels)
