"""Kernel launches: what one execution of a node, or of a graph, launches on the Triton kernels, as the executor runs
it (a quantized product's pre-pass counted, or not where :mod:`gdnpass.prepasses` shares it). ``gdnpass run``'s and
``gdnpass dump``'s counts and the benchmarks' node-to-kernel mapping all read these. Pure Python: it loads neither
torch nor Triton.
"""

from __future__ import annotations

from collections import Counter
from typing import Collection, Iterable

from gdnpass import prepasses
from gdnpass.ir import Graph, Op, Tensor, op_label, runs_kernel
from gdnpass.kernels.limits import mul_mat_launches, pre_pass
from gdnpass.patterns import RECORDS


def node_launches(n: Tensor, shared: bool = False) -> int:
    """Kernel launches of one execution of node ``n`` (0 for views and empty nodes); ``shared``: a product that
    skips its activations' pre-pass (:mod:`gdnpass.prepasses`)."""
    if not runs_kernel(n):
        return 0
    if n.op.is_fused:
        count = RECORDS[n.op].launches(n)
    elif n.op is Op.MUL_MAT:
        count = mul_mat_launches(n.src[0], n.src[1])
    elif n.op is Op.MUL_MAT_ID:  # the mat-vec kernel (a quantized expert stack's: after its activations' pre-pass)
        count = 1 + pre_pass(n.src[0].type, "mat_vec")
    else:
        count = 1
    return count - shared


def graph_launches(graph: Graph, shared: Collection[int] | None = None) -> list[tuple[Tensor, int]]:
    """(node, its launches) for the nodes of ``graph`` in order, as the executor runs them: the products in ``shared``
    (uids; default: those of :func:`gdnpass.prepasses.plan`, an executor's own with pre-passes shared) skip their
    pre-pass."""
    shared = prepasses.plan(graph).shared if shared is None else shared
    return [(n, node_launches(n, n.uid in shared)) for n in graph.nodes]


def launches(graph: Graph) -> Counter:
    """Kernel launches per op label (UNARY split by kind) for one execution of ``graph`` on the Triton kernels, as
    the executor runs it by default (its pre-passes shared: :func:`graph_launches`)."""
    c: Counter = Counter()
    for n, k in graph_launches(graph):
        c[op_label(n)] += k
    return +c


def nodes_launches(nodes: Iterable[Tensor]) -> int:
    """The launches of these nodes run in order as a graph (:func:`graph_launches`): a node list before fusion, say."""
    g = Graph()
    g.nodes = list(nodes)
    return sum(k for _, k in graph_launches(g))
