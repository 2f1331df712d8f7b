"""Reading ggml's structs from memory, parameterised by layout: one reader for every ggml build.

Both front ends read live ``struct ggml_tensor`` / ``struct ggml_cgraph`` memory: the ggml importer (ggml-python's
ggml 0.15.3, in this process) and the llama.cpp capture (the pinned llama.cpp's ggml, in a worker process). Their
structs differ (``GGML_MAX_SRC`` 10 in both today, but ``op_params``, ``flags`` and the trailing fields move between
versions), so the reader takes a :class:`TensorLayout` / :class:`GraphLayout` of byte offsets and never a ctypes
mirror. A layout comes from the build it describes (ggml-python's ctypes structure, or the ``offsetof`` probe compiled
against the vendored headers, see :mod:`gdnpass.frontends.llama.build`) and is checked against the library's own
``ggml_tensor_overhead()`` before the first read (:func:`check_size`).

Everything after :func:`read_tensor` works on plain :class:`TensorStruct` records.
"""

from __future__ import annotations

import ctypes
import re
import struct
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from gdnpass.errors import GraphError

if TYPE_CHECKING:  # the IR is imported lazily: the capture worker runs without it
    from gdnpass.ir import Graph, Tensor


def _layout(cls, d: dict, what: str):
    """A layout dataclass from a probe's {field: offset}, every field required."""
    missing = [f for f in cls.__dataclass_fields__ if f not in d]
    if missing:
        raise GraphError(f"{what} lacks {', '.join(missing)}")
    return cls(**{f: int(d[f]) for f in cls.__dataclass_fields__})


@dataclass(frozen=True)
class TensorLayout:
    """``sizeof(struct ggml_tensor)`` and the ``offsetof`` of each field the reader needs."""

    size: int
    type: int
    buffer: int
    ne: int
    nb: int
    op: int
    op_params: int
    n_op_params: int   # int32 words (GGML_MAX_OP_PARAMS / 4)
    flags: int
    src: int
    n_src: int         # GGML_MAX_SRC
    view_src: int
    view_offs: int
    data: int
    name: int
    name_len: int      # GGML_MAX_NAME

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "TensorLayout":
        return _layout(cls, d, f"{where}: ggml_tensor layout")

    def mismatch(self, other: "TensorLayout") -> str | None:
        """A one-line description of the first field where two layouts differ, or None."""
        for f, v in asdict(self).items():
            if getattr(other, f) != v:
                return f"{f} is {getattr(other, f)}, expected {v}"
        return None


@dataclass(frozen=True)
class GraphLayout:
    """``struct ggml_cgraph`` (ggml-impl.h) and its ``struct ggml_hash_set``: what :func:`read_graph` needs."""

    n_nodes: int
    n_leafs: int
    nodes: int
    leafs: int
    use_counts: int
    hash_size: int     # offsetof(ggml_cgraph, visited_hash_set) + offsetof(ggml_hash_set, size)
    hash_used: int
    hash_keys: int

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "GraphLayout":
        return _layout(cls, d, f"{where}: ggml_cgraph layout")


@dataclass(frozen=True)
class Names:
    """The library's name functions (``ggml_type_name``, ``ggml_op_name``, ``ggml_unary_op_name``,
    ``ggml_glu_op_name``) as Python callables from enum value to str."""

    type_name: Callable[[int], str]
    op_name: Callable[[int], str]
    unary_name: Callable[[int], str]
    glu_name: Callable[[int], str] | None = None


@dataclass
class TensorStruct:
    """The fields of one ``struct ggml_tensor``, as plain values."""

    addr: int
    name: str
    type_name: str          # ggml_type_name(type): "f32", "bf16", "q8_0", ...
    op_name: str            # ggml_op_name(op): "NONE", "VIEW", "UNARY", ...
    ne: tuple[int, ...]
    nb: tuple[int, ...]
    op_params: list[int]    # the raw int32 words
    flags: int
    view_offs: int
    src: list[int | None]   # source addresses, trailing NULL slots dropped (a NULL in between stays None)
    view_src: int | None
    data: int               # 0: no memory
    buffer: int             # ggml_backend_buffer address, 0: none
    sub_name: str | None = None   # the unary / glu op's name for UNARY / GLU nodes
    ptr: Any = field(default=None, repr=False)  # a front end's own handle (ggml-python pointer), if it keeps one

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("ptr")
        return d

    @classmethod
    def from_json(cls, d: dict) -> "TensorStruct":
        d = dict(d)
        d["ne"], d["nb"] = tuple(d["ne"]), tuple(d["nb"])
        return cls(**d)


def _cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def read_tensor(addr: int, layout: TensorLayout, names: Names) -> TensorStruct:
    """One ``struct ggml_tensor`` at ``addr``, read through ``layout``."""
    if not addr:
        raise GraphError("read_tensor: NULL tensor pointer")
    raw = ctypes.string_at(addr, layout.size)
    u32 = lambda off: struct.unpack_from("<I", raw, off)[0]       # noqa: E731 - enums are 32-bit
    ptr = lambda off: struct.unpack_from("<Q", raw, off)[0]       # noqa: E731
    type_ = u32(layout.type)
    op = u32(layout.op)
    words = list(struct.unpack_from(f"<{layout.n_op_params}i", raw, layout.op_params))
    src: list[int | None] = [ptr(layout.src + 8 * i) or None for i in range(layout.n_src)]
    while src and src[-1] is None:
        src.pop()
    op_name = names.op_name(op)
    sub = None
    if op_name == "UNARY":
        sub = names.unary_name(words[0])
    elif op_name == "GLU" and names.glu_name is not None:
        sub = names.glu_name(words[0])
    return TensorStruct(
        addr=addr, name=_cstr(raw[layout.name:layout.name + layout.name_len]), type_name=names.type_name(type_),
        op_name=op_name, ne=struct.unpack_from("<4q", raw, layout.ne), nb=struct.unpack_from("<4Q", raw, layout.nb),
        op_params=words, flags=struct.unpack_from("<i", raw, layout.flags)[0],
        view_offs=struct.unpack_from("<Q", raw, layout.view_offs)[0], src=src, view_src=ptr(layout.view_src) or None,
        data=ptr(layout.data), buffer=ptr(layout.buffer), sub_name=sub)


def read_reachable(roots: list[int], layout: TensorLayout, names: Names) -> dict[int, TensorStruct]:
    """Every tensor reachable from ``roots`` through ``src`` and ``view_src``, by address, in discovery order."""
    out: dict[int, TensorStruct] = {}
    todo = list(roots)
    while todo:
        a = todo.pop(0)
        if a in out:
            continue
        c = out[a] = read_tensor(a, layout, names)
        todo += [s for s in [*c.src, c.view_src] if s is not None]
    return out


@dataclass
class GraphStruct:
    """A ``struct ggml_cgraph``: node and leaf addresses in order, and ggml's use count of every tensor it holds."""

    nodes: list[int]
    leafs: list[int]
    use_counts: dict[int, int]  # tensor address -> cgraph->use_counts[hash slot] (zeros left out)


def read_graph(addr: int, layout: GraphLayout) -> GraphStruct:
    if not addr:
        raise GraphError("read_graph: NULL graph pointer")
    i32 = lambda off: ctypes.c_int32.from_address(addr + off).value       # noqa: E731
    p64 = lambda a: ctypes.c_uint64.from_address(a).value                 # noqa: E731
    n_nodes, n_leafs = i32(layout.n_nodes), i32(layout.n_leafs)
    nodes_p, leafs_p = p64(addr + layout.nodes), p64(addr + layout.leafs)
    nodes = [p64(nodes_p + 8 * i) for i in range(n_nodes)]
    leafs = [p64(leafs_p + 8 * i) for i in range(n_leafs)]
    size = p64(addr + layout.hash_size)
    used_p, keys_p, counts_p = p64(addr + layout.hash_used), p64(addr + layout.hash_keys), p64(addr + layout.use_counts)
    # the visited set's bitset (ggml_bitset_t is uint32), keys and the per-slot use counts, read in three copies
    used = struct.unpack(f"<{(size + 31) // 32}I", ctypes.string_at(used_p, 4 * ((size + 31) // 32)))
    keys = struct.unpack(f"<{size}Q", ctypes.string_at(keys_p, 8 * size))
    uses = struct.unpack(f"<{size}i", ctypes.string_at(counts_p, 4 * size))
    counts = {keys[i]: uses[i] for i in range(size) if used[i >> 5] >> (i & 31) & 1 and uses[i]}
    return GraphStruct(nodes, leafs, counts)


def check_size(layout: TensorLayout, tensor_overhead: int, object_size: int, where: str) -> None:
    """Refuse a layout whose size disagrees with the library (``ggml_tensor_overhead() = GGML_OBJECT_SIZE +
    GGML_TENSOR_SIZE``): reading a struct through the wrong offsets would import garbage silently."""
    if tensor_overhead - object_size != layout.size:
        raise GraphError(f"{where}: the library's ggml_tensor is {tensor_overhead - object_size} bytes, the layout "
                         f"describes {layout.size}; this ggml build is not the one the reader was set up for")


# ---------------------------------------------------------------------------------------------------------------------
# records -> gdnpass Graph (shared by the ggml importer and the llama.cpp capture)
# ---------------------------------------------------------------------------------------------------------------------

_LAYER_SUFFIX = re.compile(r"-(\d+)$")
_LAYER_LEAF = re.compile(r"^blk\.(\d+)\.|^cache_[a-z]+_l(\d+)$")
_FLAG_MASK = 1 | 2 | 4 | 16  # INPUT, OUTPUT, PARAM, COMPUTE; ggml's LOSS flag (8) has no counterpart


def leaf_layer(name: str) -> int | None:
    """``blk.<il>.*`` weights and ``cache_?_l<il>`` caches belong to layer il; graph inputs (``inp_*``, llama.cpp's
    ``rs_s_copy``) and shared weights ``blk.*.*`` are -1."""
    m = _LAYER_LEAF.match(name)
    if m:
        return int(m.group(1) or m.group(2))
    if name.startswith(("inp_", "blk.*.")) or name == "rs_s_copy":
        return -1
    return None


def record_dtype(c: TensorStruct):
    """gdnpass's DType for a record's ggml type name (ggml spells the K-quants ``q4_K``); GraphError naming the tensor
    for a type gdnpass lacks (the other quantized types)."""
    from gdnpass.ir import DType

    for t in DType:
        if c.type_name.lower() == t.label:
            return t
    raise GraphError(f"tensor {c.name!r}: ggml type {c.type_name} is not modelled (gdnpass has "
                     f"{', '.join(t.label for t in DType)})")


def record_op(c: TensorStruct, is_node: bool) -> tuple:
    """gdnpass's (Op, op_params) for a record (:func:`gdnpass.frontends.decode.ir_op`), the unary and GLU kinds named
    by the library that made it."""
    from gdnpass.frontends.decode import ir_op

    return ir_op(c.op_name, c.op_params, unary_name=c.sub_name if c.op_name == "UNARY" else None,
                 glu_name=c.sub_name if c.op_name == "GLU" else None, inplace=c.view_src is not None,
                 is_node=is_node)


@dataclass
class Assembled:
    graph: "Graph"
    tensors: dict[int, "Tensor"]   # address -> Tensor


def to_graph(structs: dict[int, TensorStruct], nodes: list[int], leafs: list[int], *,
             place: Callable[[TensorStruct, "Tensor"], None], meta: dict | None = None,
             op_of: Callable[[TensorStruct, bool], tuple] = record_op,
             dtype_of: Callable[[TensorStruct], object] = record_dtype) -> Assembled:
    """A :class:`gdnpass.ir.Graph` of ``nodes`` (addresses, execution order) and ``leafs`` from read records.

    ``op_of(record, is_node)`` gives gdnpass's (Op, op_params); ``dtype_of(record)`` its DType; ``place(record,
    tensor)`` sets a leaf's ``buffer``/``offset`` (computed tensors are left to the planner or to the caller).
    Leaf tensors reached through ``src`` but in neither list are appended to the leafs (ggml puts every leaf in one
    list; a capture sees only nodes). Layers: a name ending in ``-<il>`` (llama.cpp's ``cb``), a leaf's
    :func:`leaf_layer`, else the first source's layer, as :mod:`gdnpass.ops` does."""
    from gdnpass.ir import Flag, Graph, Op, Tensor

    node_set = set(nodes)
    leaf_list = list(dict.fromkeys(leafs))
    seen = node_set | set(leaf_list)
    leaf_list += [a for a, c in structs.items() if c.op_name == "NONE" and a not in seen]
    tensors: dict[int, Tensor] = {}
    for a, c in structs.items():
        op, params = op_of(c, a in node_set)
        tensors[a] = Tensor(name=c.name, type=dtype_of(c), ne=tuple(c.ne), nb=tuple(c.nb), op=op, op_params=params,
                            view_offs=c.view_offs, flags=Flag(c.flags & _FLAG_MASK))
    for a, c in structs.items():
        t = tensors[a]
        t.src = [tensors[s] if s is not None else None for s in c.src]
        if c.view_src is not None:
            t.view_src = tensors[c.view_src]
    for a in leaf_list + nodes:  # list order, so a node's sources already have their layer
        c, t = structs[a], tensors[a]
        if t.op is Op.NONE and t.view_src is None and a not in node_set:
            place(c, t)
            t.layer = leaf_layer(t.name)
            continue
        m = _LAYER_SUFFIX.search(t.name)
        if m:
            t.layer = int(m.group(1))
        else:
            srcs = [s for s in t.src if s is not None]
            t.layer = next((s.layer for s in srcs if s.layer is not None and s.layer >= 0),
                           srcs[0].layer if srcs else None)
    graph = Graph()
    graph.leafs = [tensors[a] for a in leaf_list]
    graph.nodes = [tensors[a] for a in nodes]
    graph._visited = {t.uid for t in graph.tensors()}
    graph.meta = dict(meta or {})
    return Assembled(graph, tensors)
