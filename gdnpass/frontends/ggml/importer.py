"""Import a ``ggml_cgraph`` into a :class:`gdnpass.ir.Graph` (see the package docstring for the conventions).

The importer touches ggml's structs in one place only: :func:`read_tensor` (one ``struct ggml_tensor``) and
:func:`graph_lists` / :func:`_hash_slot` (``struct ggml_cgraph`` and its visited set), through ggml-python's ctypes
mirrors of ggml 0.15.3. Everything after that works on plain :class:`TensorStruct` records, so another ggml build
(another ``ggml_tensor`` layout) needs another reader, not another importer.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from typing import Any

from gdnpass import ops
from gdnpass.frontends.decode import ir_op
from gdnpass.ir import DType, Flag, Graph, GraphError, Op, Tensor

# ---------------------------------------------------------------------------------------------------------------------
# the library
# ---------------------------------------------------------------------------------------------------------------------

_LIB: Any = None
_POINTER_RESULTS = ("ggml_backend_cpu_buffer_type", "ggml_backend_alloc_buffer", "ggml_backend_cpu_buffer_from_ptr")


def lib():
    """The ``ggml`` module of ggml-python, imported on first use, with the pointer return types fixed."""
    global _LIB
    if _LIB is None:
        try:
            import ggml as _g  # the top-level ggml-python package, not this package
        except ImportError as err:  # pragma: no cover - exercised only without the optional dependency
            raise ImportError("gdnpass.frontends.ggml needs ggml-python: pip install 'ggml-python==0.0.45'") from err
        for name in _POINTER_RESULTS:
            fn = getattr(_g, name, None)
            if fn is not None and hasattr(fn, "restype"):
                fn.restype = ctypes.c_void_p
        _LIB = _g
    return _LIB


def version() -> str:
    return lib().ggml_version().decode()


def addr(p) -> int:
    """The address of a ggml pointer (0 for NULL)."""
    return ctypes.cast(p, ctypes.c_void_p).value or 0


# ---------------------------------------------------------------------------------------------------------------------
# types
# ---------------------------------------------------------------------------------------------------------------------

_DTYPES = {t.label: t for t in DType}  # ggml_type_name spells them as DType's labels
_GGML_TYPE = {t: f"GGML_TYPE_{t.name}" for t in DType}


def dtype_of(type_name: str, tensor_name: str) -> DType:
    """gdnpass's DType for ggml's type name (``ggml_type_name``)."""
    if type_name not in _DTYPES:
        raise GraphError(f"tensor {tensor_name!r}: ggml type {type_name} is not modelled "
                         f"(gdnpass has {', '.join(_DTYPES)})")
    return _DTYPES[type_name]


def ggml_type(dtype: DType) -> int:
    """ggml's ``enum ggml_type`` value for a DType."""
    return getattr(lib(), _GGML_TYPE[dtype])


# ---------------------------------------------------------------------------------------------------------------------
# reading ggml's structs (ggml 0.15.3, through ggml-python's ctypes structures)
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class TensorStruct:
    """The fields of one ``struct ggml_tensor`` the importer and the session read."""

    ptr: Any                # the ggml-python pointer
    addr: int
    name: str
    type_name: str          # ggml_type_name(type): "f32", "bf16", "q8_0", ...
    op_name: str            # ggml_op_name(op): "NONE", "VIEW", "UNARY", ...
    ne: tuple[int, ...]
    nb: tuple[int, ...]
    op_params: list[int]    # the raw int32 words
    flags: int
    view_offs: int
    src: list[Any]          # source pointers, trailing NULL slots dropped (a NULL in between stays None)
    view_src: Any           # pointer or None
    data: int               # 0: no memory
    buffer: int             # ggml_backend_buffer address, 0: none

    @property
    def dtype(self) -> DType:
        return dtype_of(self.type_name, self.name)


def read_tensor(p) -> TensorStruct:
    g = lib()
    c = p.contents
    src = [s if s else None for s in c.src]
    while src and src[-1] is None:
        src.pop()
    return TensorStruct(ptr=p, addr=addr(p), name=c.name.decode(errors="replace"),
                        type_name=g.ggml_type_name(c.type).decode(), op_name=g.ggml_op_name(c.op).decode(),
                        ne=tuple(int(x) for x in c.ne), nb=tuple(int(x) for x in c.nb),
                        op_params=[int(x) for x in c.op_params], flags=int(c.flags), view_offs=int(c.view_offs),
                        src=src, view_src=c.view_src if c.view_src else None, data=int(c.data or 0),
                        buffer=int(c.buffer or 0))


def graph_lists(cgraph) -> tuple[list, list]:
    """``cgraph->nodes`` and ``cgraph->leafs`` (read from the struct: ggml-python has no leaf accessor)."""
    cg = cgraph.contents
    return [cg.nodes[i] for i in range(cg.n_nodes)], [cg.leafs[i] for i in range(cg.n_leafs)]


def _hash_slot(cg, a: int) -> int | None:
    """ggml_hash_find on the graph's visited set (linear probing from (addr >> 4) % size)."""
    hs = cg.visited_hash_set
    size = hs.size
    i = h = (a >> 4) % size
    while True:
        used = bool(hs.used[i >> 5] & (1 << (i & 31)))
        if not used:
            return None
        if addr(hs.keys[i]) == a:
            return i
        i = (i + 1) % size
        if i == h:
            return None


def _ctx_tensors(ctx) -> set[int]:
    g = lib()
    out, t = set(), g.ggml_get_first_tensor(ctx)
    while t:
        out.add(addr(t))
        t = g.ggml_get_next_tensor(ctx, t)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# ops and their parameters
# ---------------------------------------------------------------------------------------------------------------------

_FLAG_MASK = int(Flag.INPUT | Flag.OUTPUT | Flag.PARAM | Flag.COMPUTE)  # ggml's LOSS flag (8) has no counterpart


def _op(c: TensorStruct, is_node: bool) -> tuple[Op, dict]:
    """gdnpass's op and op_params for a ggml tensor (:func:`gdnpass.frontends.decode.ir_op`), the unary and GLU
    kinds named by the library itself (ggml 0.15.3 numbers them as the pinned llama.cpp does, but lacks
    SWIGLU_CLAMP)."""
    g, kind = lib(), c.op_params[0]
    return ir_op(c.op_name, c.op_params,
                 unary_name=g.ggml_unary_op_name(kind).decode() if c.op_name == "UNARY" else None,
                 glu_name=g.ggml_glu_op_name(kind).decode() if c.op_name == "GLU" else None,
                 inplace=c.view_src is not None, is_node=is_node)


# ---------------------------------------------------------------------------------------------------------------------
# leaf buffers and layers
# ---------------------------------------------------------------------------------------------------------------------

_LAYER_SUFFIX = re.compile(r"-(\d+)$")
_LAYER_LEAF = re.compile(r"^blk\.(\d+)\.|^cache_[a-z]+_l(\d+)$")


def _leaf_layer(name: str) -> int | None:
    m = _LAYER_LEAF.match(name)
    if m:
        return int(m.group(1) or m.group(2))
    if name.startswith("inp_") or name.startswith("blk.*."):
        return -1
    return None


def leaf_buffer(name: str, flags: int, in_ctx: bool = False) -> str:
    """The naming convention for leafs that ``buffers`` does not place (see the package docstring)."""
    if in_ctx:
        return "input"
    if name.startswith("cache_"):
        return "cache"
    if name.startswith("inp_") or flags & int(Flag.INPUT):
        return "input"
    return "weights"


# ---------------------------------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Imported:
    """What :func:`import_ggml` returns: the graph plus the tie between its tensors and ggml's."""

    graph: Graph
    ptrs: dict[int, Any]              # Tensor.uid -> ggml tensor pointer
    tensors: dict[int, Tensor]        # ggml address -> Tensor
    arena_offsets: list[int | None]   # per node: gallocr's offset (data - base of its buffer), None for views
    arena_size: int | None            # size of that gallocr buffer (None: not allocated)

    def ptr(self, t: Tensor | str):
        if isinstance(t, str):
            t = self.graph.find(t)
        return self.ptrs[t.uid]


def ggml_use_counts(cgraph, imported: Imported) -> dict[int, int]:
    """ggml's own use counts (``cgraph->use_counts``, read through its hash table), keyed by Tensor.uid; zeros left out
    (the shape of :meth:`Graph.use_counts`)."""
    cg = cgraph.contents
    out: dict[int, int] = {}
    for t in imported.graph.tensors():
        slot = _hash_slot(cg, addr(imported.ptrs[t.uid]))
        if slot is None:
            raise GraphError(f"tensor {t.name!r} is not in the ggml graph's hash set")
        n = cg.use_counts[slot]
        if n:
            out[t.uid] = n
    return out


def _buffer_map(buffers: dict) -> tuple[dict[str, str], dict[int, str]]:
    """``buffers`` split into by-name and by-address (every tensor of a ggml context) placements."""
    by_name: dict[str, str] = {}
    by_ctx: dict[int, str] = {}
    for key, buf in buffers.items():
        if buf not in ("weights", "cache", "input"):
            raise GraphError(f"from_ggml: buffers[{key!r}] is {buf!r}; a leaf lives in weights, cache or input")
        if isinstance(key, str):
            by_name[key] = buf
        else:
            for a in _ctx_tensors(key):
                by_ctx[a] = buf
    return by_name, by_ctx


def _arena_offsets(nodes: list[TensorStruct]) -> tuple[list[int | None], int | None, int]:
    """gallocr's decisions: per node its data pointer minus the base of its buffer (None for views and nodes without
    data), the size of that buffer, and how many buffers the nodes use."""
    g = lib()
    offsets: list[int | None] = []
    arena_bufs: set[int] = set()
    for c in nodes:
        if c.view_src is not None or not c.data or not c.buffer or c.op_name == "NONE":
            offsets.append(None)
            continue
        offsets.append(c.data - int(g.ggml_backend_buffer_get_base(c.buffer)))
        arena_bufs.add(c.buffer)
    arena_size = None
    if len(arena_bufs) == 1:
        arena_size = int(g.ggml_backend_buffer_get_size(next(iter(arena_bufs))))
    elif len(arena_bufs) > 1:  # e.g. ggml_backend_sched over several buffers: no single arena to compare with
        offsets = [None] * len(offsets)
    return offsets, arena_size, len(arena_bufs)


def import_ggml(cgraph, ctx=None, *, buffers: dict | None = None, meta: dict | None = None,
                validate: bool = True) -> Imported:
    """:func:`from_ggml` plus the ggml pointers of every tensor and gallocr's offsets (see :class:`Imported`)."""
    if not cgraph:
        raise GraphError("from_ggml: the graph pointer is NULL")
    by_name, by_ctx = _buffer_map(dict(buffers or {}))
    compute_ctx = _ctx_tensors(ctx) if ctx is not None else set()

    nodes_p, leafs_p = graph_lists(cgraph)
    # every tensor the lists reach through src/view_src (ggml puts all of them in one of the lists; be safe anyway)
    structs: dict[int, TensorStruct] = {}
    order: list[TensorStruct] = []
    todo = list(leafs_p + nodes_p)
    while todo:
        p = todo.pop(0)
        if addr(p) in structs:
            continue
        c = structs[addr(p)] = read_tensor(p)
        order.append(c)
        todo += [s for s in [*c.src, c.view_src] if s is not None]
    nodes = [structs[addr(p)] for p in nodes_p]
    node_set = {c.addr for c in nodes}
    leaf_set = {addr(p) for p in leafs_p}
    leafs = [structs[a] for a in dict.fromkeys(addr(p) for p in leafs_p)]
    leafs += [c for c in order if c.op_name == "NONE" and c.addr not in node_set and c.addr not in leaf_set]

    tensors: dict[int, Tensor] = {}
    ptrs: dict[int, Any] = {}
    for c in order:
        op, params = _op(c, c.addr in node_set)
        t = Tensor(name=c.name, type=c.dtype, ne=c.ne, nb=c.nb, op=op, op_params=params, view_offs=c.view_offs,
                   flags=Flag(c.flags & _FLAG_MASK))
        tensors[c.addr] = t
        ptrs[t.uid] = c.ptr
    # sources, views (all tensors exist now)
    for c in order:
        t = tensors[c.addr]
        t.src = [tensors[addr(s)] if s is not None else None for s in c.src]
        if c.view_src is not None:
            t.view_src = tensors[addr(c.view_src)]
    # buffers and layers, in list order, so a node's sources already have their layer
    for c in leafs + nodes:
        t = tensors[c.addr]
        if t.op is Op.NONE and t.view_src is None and c.addr not in node_set:
            t.buffer = by_name.get(t.name) or by_ctx.get(c.addr) or leaf_buffer(t.name, int(t.flags),
                                                                                 c.addr in compute_ctx)
            t.layer = _leaf_layer(t.name)
        else:
            m = _LAYER_SUFFIX.search(t.name)
            if m:
                t.layer = int(m.group(1))
            else:
                srcs = [s for s in t.src if s is not None]
                t.layer = next((s.layer for s in srcs if s.layer is not None and s.layer >= 0),
                               srcs[0].layer if srcs else None)

    graph = Graph()
    graph.leafs = [tensors[c.addr] for c in leafs]
    graph.nodes = [tensors[c.addr] for c in nodes]
    graph._visited = {t.uid for t in graph.tensors()}

    offsets, arena_size, n_bufs = _arena_offsets(nodes)
    cg = cgraph.contents
    graph.meta = dict(meta or {})
    graph.meta.setdefault("builder", "ggml")
    graph.meta["ggml"] = {"version": version(), "n_nodes": cg.n_nodes, "n_leafs": cg.n_leafs,
                          "arena_offsets": offsets, "arena_size": arena_size, "arena_buffers": n_bufs}
    if validate:
        ops.validate(graph)
    return Imported(graph, ptrs, tensors, offsets, arena_size)


def from_ggml(cgraph, ctx=None, *, buffers: dict | None = None, meta: dict | None = None) -> Graph:
    """A ``ggml_cgraph *`` (ggml-python pointer) as a validated, unplanned :class:`Graph`.

    ``ctx``: the compute context, optional; leafs created in it are inputs (llama.cpp's convention).
    ``buffers``: ``{tensor name or ggml context: 'weights' | 'cache' | 'input'}`` for the leafs; the rest follow the
    naming convention of :func:`leaf_buffer`. ``meta`` is merged into ``graph.meta``.
    """
    return import_ggml(cgraph, ctx, buffers=buffers, meta=meta).graph
