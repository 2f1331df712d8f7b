"""Trip graphs of the gdn_gates rules (tests/patterns/test_rules.py runs them, with every registered pattern's): the
small planned verify graph (tests/support/surgery.py: one layer, n_t 4) with its GDN and snapshot CPY fused into a
GATED_DELTA_NET_CACHE and its gate chain into an ELEMENTWISE_CHAIN (the patterns that run before this one), then one
mutation per rule that breaks that rule and no other; for every hazard a graph where forcing the rewrite past it
corrupts bytes.

``gdn-gates.output-overlaps-input`` is a race between the programs of one Triton launch (a program storing its scores
over the alpha product a later program computes its decay from): its proof runs the GDN and elementwise kernels in
the interpreter, with the launcher's own overlap guard switched off (``unguard``).
"""

from __future__ import annotations

from gdnpass import ops
from gdnpass.fusion import fuse
from gdnpass.ir import DType, Flag, Graph, Op, Tensor
from gdnpass.kernels import backends
from gdnpass.kernels import triton_ssm
from gdnpass.patterns.elementwise_chain import ElementwiseChain
from gdnpass.patterns.gdn_gates import GdnGates
from gdnpass.patterns.gdn_state_cache import GdnStateCache
from support.graphs import triton_for
from support.surgery import IDS, chain, feed_layer_output, insert_after, planned
from support.trips import Trip, fresh

CHECK = dict(ids=IDS)  # check_fusion's keywords for the force proofs
OPS = (Op.GATED_DELTA_NET_CACHE, Op.ELEMENTWISE_CHAIN, Op.UNARY)  # the Triton kernels of a "triton" force proof


def prepared(**config) -> Graph:
    """The planned graph with the cache fusion and the chains applied (what this pattern's candidates come from)."""
    g = planned(**config)
    fuse(g, enabled=True, patterns=[GdnStateCache(), ElementwiseChain()])
    return g


def parts(g: Graph) -> dict:
    """The GDN node, the decay's chain node and its input, beta's SIGMOID and its input, the operands."""
    gdn = next(n for n in g.nodes if n.op is Op.GATED_DELTA_NET_CACHE)
    g_op, b_op = gdn.src[3], gdn.src[4]
    chain_node = next(n for n in g.nodes if n.op is Op.ELEMENTWISE_CHAIN and n.view_src is g_op.src[0])
    return dict(gdn=gdn, chain=chain_node, alpha=chain_node.src[0], decay=g_op.src[0], g=g_op, sigmoid=b_op,
                beta=b_op.src[0], ssm_a=chain_node.src[2])


# ---- one mutation per rule ------------------------------------------------------------------------------------------


def m_ssm_a_f16(g):
    """The decay's weight in f16."""
    w = parts(g)["ssm_a"]
    w.type = DType.F16
    w.nb = tuple(n // 2 for n in w.nb)


def m_operand_offset(g):
    """The GDN's decay a view one element into the chain's output: not the chain's element at each index."""
    parts(g)["g"].view_offs += 4


def m_alpha_flat(g):
    """The decay's chain over alpha as one flat row (alpha, the chain and its output [8]: the same packed elements),
    the GDN's operand still [1, H_v, n_t, 1]: the kernel indexes alpha by head and token, which no longer lie so."""
    p = parts(g)
    for t in (p["alpha"], p["chain"], p["decay"]):
        n = t.nelements
        t.ne, t.nb = (n, 1, 1, 1), (4, 4 * n, 4 * n, 4 * n)


def m_beta_tanh(g):
    """beta made by a UNARY kind the kernel does not compute."""
    parts(g)["sigmoid"].op_params["kind"] = "TANH"


def m_beta_output(g):
    parts(g)["sigmoid"].flags |= Flag.OUTPUT


def m_alpha_overwritten_between(g):
    """Right after the chain, a node writes twice alpha over alpha's bytes (unfused alpha is dead by then)."""
    p = parts(g)
    node = ops.scale(p["alpha"], 2.0)
    insert_after(g, p["chain"], node, offset=p["alpha"].base.offset + p["alpha"].view_offs)


def m_scores_over_alpha(g):
    """The GDN's output and the alpha product on the same fresh bytes: head 0's program stores its scores over the
    alpha values head 1's program, which runs after it in the interpreter, computes its decay from (unfused, the
    chain reads alpha before the GDN runs: harmless)."""
    p = parts(g)
    at = fresh(g, p["gdn"].view_src)
    fresh(g, p["alpha"].base, at)


def m_decay_read_later(g):
    """The chain's output on fresh bytes, and after the GDN a node reading them through a tensor of its own (an
    arena leaf at their offset: no graph edge), feeding the layer output."""
    p = parts(g)
    at = fresh(g, p["decay"])
    alias = Tensor(name="decay-bytes", type=DType.F32, ne=p["decay"].ne, nb=p["decay"].nb, buffer="arena", offset=at)
    g.leafs.append(alias)
    feed_layer_output(g, chain(g), insert_after(g, p["gdn"], ops.scale(alias, 1.0)))


TRIPS = [
    Trip("gdn-gates.type", m_ssm_a_f16),
    Trip("gdn-gates.layout", m_operand_offset),
    Trip("gdn-gates.layout", m_alpha_flat, name="input-shape"),
    Trip("scope.gate-steps", m_beta_tanh),
    Trip("gdn-gate.user-count", m_beta_output),
    Trip("gdn-gates.between", m_alpha_overwritten_between),
    Trip("gdn-gates.output-overlaps-input", m_scores_over_alpha, kernels="triton"),
    Trip("gdn-gates.output-read-later", m_decay_read_later),
]


def candidate(t: Trip | None = None, mutate: bool = True):
    """(graph, pattern, anchor) of a trip case (None: the plain graph); ``mutate=False``: unmutated."""
    g = prepared(**(t.config if t else {}))
    if t is not None and mutate and t.mutate:
        t.mutate(g)
    return g, GdnGates(), parts(g)["gdn"]


def kernels(t: Trip) -> dict:
    """The kernel table of a force proof: the torch references (named: on a GPU the default would be Triton), or the
    GDN and elementwise kernels on Triton."""
    return backends.TORCH_BACKEND if t.kernels == "torch" else triton_for(OPS)


def unguard(t: Trip, monkeypatch) -> None:
    """Forcing rule 6's overlap: the launcher refuses it too (a second line of defence), so the proof runs the kernel
    without its guard."""
    if t.kernels == "triton":
        monkeypatch.setattr(triton_ssm, "_alias_ok", lambda *a, **k: None)
