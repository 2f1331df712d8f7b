"""Structural comparison of two graphs, tensors named by position (used by the tests and the example).

Nothing here needs ggml: it compares any two :class:`gdnpass.ir.Graph` s, e.g. an import and gdnpass's own build.
"""

from __future__ import annotations

import struct

from gdnpass.ir import Graph, Op, Tensor


def _norm_params(t: Tensor) -> dict:
    """op_params as ggml holds them: floats rounded to f32, tuples for lists, ``inplace`` only where it is true
    (SCALE always records it, as gdnpass.ops.scale does)."""
    out: dict = {}
    for k, v in t.op_params.items():
        if isinstance(v, float):
            v = struct.unpack("<f", struct.pack("<f", v))[0]
        out[k] = tuple(v) if isinstance(v, list) else v
    if t.op is Op.SCALE:
        out["inplace"] = bool(out.get("inplace", False))
    elif out.get("inplace") is False:
        del out["inplace"]
    return out


def signature(graph: Graph) -> list[tuple]:
    """Per node: (op, type, ne, nb, op_params, view_src, view_offs, srcs, flags), tensors named by their position
    (``n<i>`` for nodes, ``l<i>`` for leafs): two graphs with equal signatures are the same DAG in the same order."""
    where = {t.uid: f"l{i}" for i, t in enumerate(graph.leafs)}
    where.update({t.uid: f"n{i}" for i, t in enumerate(graph.nodes)})

    def ref(t: Tensor | None) -> str | None:
        return None if t is None else where.get(t.uid, f"?{t.name}")

    return [(n.op.value, n.type.label, tuple(n.ne), tuple(n.nb), tuple(sorted(_norm_params(n).items())),
             ref(n.view_src), n.view_offs, tuple(ref(s) for s in n.src), int(n.flags))
            for n in graph.nodes]


def leaf_signature(graph: Graph) -> list[tuple]:
    """Per leaf: (name, type, ne, nb, buffer, flags)."""
    return [(t.name, t.type.label, tuple(t.ne), tuple(t.nb), t.buffer, int(t.flags)) for t in graph.leafs]


def diff_graphs(ours: Graph, theirs: Graph, limit: int = 10) -> list[str]:
    """Readable differences between two graphs' structure (empty: identical node order, wiring and leafs)."""
    out: list[str] = []
    if len(ours.nodes) != len(theirs.nodes):
        out.append(f"node count {len(ours.nodes)} vs {len(theirs.nodes)}")
    for i, (a, b) in enumerate(zip(signature(ours), signature(theirs))):
        if a != b:
            fields = ("op", "type", "ne", "nb", "op_params", "view_src", "view_offs", "src", "flags")
            bad = [f"{f}: {x!r} vs {y!r}" for f, x, y in zip(fields, a, b) if x != y]
            out.append(f"node {i} ({ours.nodes[i].name!r} / {theirs.nodes[i].name!r}): " + "; ".join(bad))
        if len(out) >= limit:
            return out
    la, lb = leaf_signature(ours), leaf_signature(theirs)
    if la != lb:
        first = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
        out.append(f"leafs differ (count {len(la)} vs {len(lb)}), first at leaf {first}")
    return out
