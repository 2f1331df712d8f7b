"""Import a ``ggml_cgraph`` into a :class:`gdnpass.ir.Graph` (see the package docstring for the conventions).

The struct reading is :mod:`gdnpass.frontends.structs`', shared with the llama.cpp capture: :func:`read_tensor` reads
one ``struct ggml_tensor`` through :func:`layout` (ggml 0.15.3's, taken from ggml-python's ctypes mirror and checked
against the library's ``ggml_tensor_overhead()``), and :func:`~gdnpass.frontends.structs.to_graph` turns the records
into a Graph. What is ggml-python's own here: the pointers, :func:`graph_lists` / :func:`_hash_slot` (its
``ggml_cgraph`` mirror) and the naming convention that places leafs (:func:`leaf_buffer`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from gdnpass import ops
from gdnpass.frontends.structs import Names, TensorLayout, TensorStruct, check_size, read_reachable, to_graph
from gdnpass.frontends.structs import read_tensor as _read_at
from gdnpass.ir import DType, Flag, Graph, GraphError, Tensor

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

_GGML_TYPE = {t: f"GGML_TYPE_{t.name}" for t in DType}


def ggml_type(dtype: DType) -> int:
    """ggml's ``enum ggml_type`` value for a DType."""
    return getattr(lib(), _GGML_TYPE[dtype])


# ---------------------------------------------------------------------------------------------------------------------
# reading ggml's structs (ggml 0.15.3, through ggml-python's ctypes structures)
# ---------------------------------------------------------------------------------------------------------------------


_LAYOUT: TensorLayout | None = None
_NAMES: Names | None = None
GGML_OBJECT_SIZE = 32  # sizeof(struct ggml_object), private to ggml.c


def layout() -> TensorLayout:
    """ggml 0.15.3's ``struct ggml_tensor``, from ggml-python's ctypes mirror, checked against the library's size."""
    global _LAYOUT
    if _LAYOUT is None:
        T = lib().ggml_tensor
        f = lambda name: getattr(T, name).offset  # noqa: E731
        lay = TensorLayout(size=ctypes.sizeof(T), type=f("type"), buffer=f("buffer"), ne=f("ne"), nb=f("nb"),
                           op=f("op"), op_params=f("op_params"), n_op_params=getattr(T, "op_params").size // 4,
                           flags=f("flags"), src=f("src"), n_src=getattr(T, "src").size // 8, view_src=f("view_src"),
                           view_offs=f("view_offs"), data=f("data"), name=f("name"), name_len=getattr(T, "name").size)
        check_size(lay, int(lib().ggml_tensor_overhead()), GGML_OBJECT_SIZE, "ggml-python")
        _LAYOUT = lay
    return _LAYOUT


def names() -> Names:
    global _NAMES
    if _NAMES is None:
        g = lib()
        _NAMES = Names(type_name=lambda v: g.ggml_type_name(v).decode(), op_name=lambda v: g.ggml_op_name(v).decode(),
                       unary_name=lambda v: g.ggml_unary_op_name(v).decode(),
                       glu_name=lambda v: g.ggml_glu_op_name(v).decode())
    return _NAMES


def pointer(a: int):
    """The ggml-python pointer of a tensor address."""
    return ctypes.cast(a, ctypes.POINTER(lib().ggml_tensor))


def read_tensor(p) -> TensorStruct:
    """One ``struct ggml_tensor`` (a ggml-python pointer), with the pointer kept in ``ptr``."""
    c = _read_at(addr(p), layout(), names())
    c.ptr = p
    return c


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
    node_addrs, leaf_addrs = [addr(p) for p in nodes_p], [addr(p) for p in leafs_p]
    # every tensor the lists reach through src/view_src (ggml puts all of them in one of the lists; be safe anyway)
    structs = read_reachable(leaf_addrs + node_addrs, layout(), names())
    nodes = [structs[a] for a in node_addrs]

    def place(c: TensorStruct, t: Tensor) -> None:
        t.buffer = by_name.get(t.name) or by_ctx.get(c.addr) or leaf_buffer(t.name, c.flags, c.addr in compute_ctx)

    asm = to_graph(structs, node_addrs, leaf_addrs, place=place)
    tensors = asm.tensors
    graph = asm.graph
    ptrs = {t.uid: pointer(a) for a, t in tensors.items()}

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
