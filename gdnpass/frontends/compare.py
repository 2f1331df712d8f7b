"""Structural comparison of two graphs, tensors named by position (used by the tests and the example).

Nothing here needs ggml: it compares any two :class:`gdnpass.ir.Graph` s, e.g. an import and gdnpass's own build.
"""

from __future__ import annotations

import struct

from gdnpass.ir import Graph, GraphError, Op, Tensor


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


# ---------------------------------------------------------------------------------------------------------------------
# one layer of two graphs (our builder's GDN layer vs llama.cpp's, whose graphs differ around it)
# ---------------------------------------------------------------------------------------------------------------------


def layer_nodes(graph: Graph, il: int) -> list[Tensor]:
    """Layer ``il``'s nodes by position: everything after the layer's input (``inpL``, the second source of its
    ``attn_residual-<il>``) up to its output ``l_out-<il>``. Names alone would not do: llama.cpp leaves many nodes
    unnamed and shares the s_copy views between layers, but both graphs compute a layer between the same two nodes."""
    pos = {n.uid: i for i, n in enumerate(graph.nodes)}
    try:
        end = next(i for i, n in enumerate(graph.nodes) if n.name == f"l_out-{il}")
        res = next(n for n in graph.nodes if n.name == f"attn_residual-{il}")
    except StopIteration:
        raise GraphError(f"layer {il}: no 'l_out-{il}' / 'attn_residual-{il}' node (not a layer of this graph)") from None
    inp = res.src[1] if len(res.src) > 1 else None
    start = pos[inp.uid] + 1 if inp is not None and inp.uid in pos else 0
    return graph.nodes[start:end + 1]


def layer_signature(graph: Graph, il: int, use_counts: dict[int, int] | None = None) -> list[tuple]:
    """Per node of :func:`layer_nodes`: (op, type, ne, nb, op_params, view_src, view_offs, srcs, flags, uses).

    References name nodes of the layer by position (``n<k>``), the layer input ``input``, leafs by name (weights
    ``blk.<il>.*``, caches ``cache_?_l<il>`` and inputs are named alike in both graphs), a view made outside the layer
    by what it views, anything else ``ext:<name>``.
    ``uses`` is ggml's use count (``use_counts`` by uid, default :meth:`Graph.use_counts`)."""
    nodes = layer_nodes(graph, il)
    counts = graph.use_counts() if use_counts is None else use_counts
    where = {t.uid: f"n{k}" for k, t in enumerate(nodes)}
    res = next(n for n in nodes if n.name == f"attn_residual-{il}")
    if len(res.src) > 1 and res.src[1] is not None:
        where.setdefault(res.src[1].uid, "input")
    leafs = {t.uid for t in graph.leafs}

    def ref(t: Tensor | None) -> str | None:
        if t is None:
            return None
        if t.uid in where:
            return where[t.uid]
        if t.uid in leafs:
            return t.name
        if t.op is Op.VIEW and t.view_src is not None:  # a view shared with other layers (the s_copy views)
            return f"view of {ref(t.view_src)} at {t.view_offs} {tuple(t.ne)}"
        return f"ext:{t.name}"

    return [(n.op.value, n.type.label, tuple(n.ne), tuple(n.nb), tuple(sorted(_norm_params(n).items())),
             ref(n.view_src), n.view_offs, tuple(ref(s) for s in n.src), int(n.flags), counts.get(n.uid, 0))
            for n in nodes]


def diff_layers(ours: Graph, theirs: Graph, il: int, *, our_uses=None, their_uses=None, limit: int = 10) -> list[str]:
    """Readable differences between layer ``il`` of two graphs (empty: node for node the same)."""
    a = layer_signature(ours, il, our_uses)
    b = layer_signature(theirs, il, their_uses)
    na, nb_ = layer_nodes(ours, il), layer_nodes(theirs, il)
    out: list[str] = []
    if len(a) != len(b):
        out.append(f"layer {il}: {len(a)} nodes vs {len(b)}")
    fields = ("op", "type", "ne", "nb", "op_params", "view_src", "view_offs", "src", "flags", "uses")
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            bad = [f"{f}: {p!r} vs {q!r}" for f, p, q in zip(fields, x, y) if p != q]
            out.append(f"layer {il} node {k} ({na[k].name!r} / {nb_[k].name!r}): " + "; ".join(bad))
        if len(out) >= limit:
            break
    return out
