"""ggml as the referee of our IR, op semantics and memory plan (issue 8).

Three pieces, all on ggml's CPU backend through ggml-python (0.0.45, which bundles ggml 0.15.3):

* :func:`from_ggml` imports a ``ggml_cgraph`` into a :class:`gdnpass.ir.Graph`: every node and leaf in ggml's
  order, with ggml's names, types, ``ne``/``nb``, decoded op params, ``view_src``/``view_offs``, flags and sources.
  The result is validated with :meth:`Graph.validate` (our shape rules re-derive every node), so a node ggml builds
  but our rules reject is a :class:`~gdnpass.ir.GraphError` naming that node.
* :class:`GgmlVerifyBuilder` / :func:`build_ggml_verify_graph` / :func:`build_ggml_gdn_layer` build the GDN verify
  graph of :mod:`gdnpass.models` with real ggml calls, call for call and ``ggml_build_forward_expand`` for
  ``Graph.expand``, so node order and use counts come from ggml itself. :func:`build_ggml_conv_chain` builds the
  conv chain alone with the projection as an input (every cache byte is then a copy, comparable bit for bit).
* :class:`GgmlSession` owns the ggml contexts, the weight/cache/input backend buffers, gallocr and the CPU backend;
  :meth:`GgmlSession.referee` runs the graph one node at a time and checks each node against the torch reference
  (:mod:`gdnpass.kernels`) fed with ggml's own inputs of that node.

Buffers of imported leafs (see :func:`leaf_buffer`), first match wins:

1. ``buffers[name]`` (a tensor name), then ``buffers[ctx]`` (a ggml context pointer: all tensors created in it);
2. a leaf created in the compute context ``ctx`` (if given) is ``input``: that is where llama.cpp makes its inputs;
3. the name: ``cache_*`` is ``cache``; ``inp_*`` or the INPUT flag is ``input``; anything else is ``weights``.

Computed tensors get no buffer (plan them with :func:`gdnpass.alloc.plan`). What gallocr decided is kept in
``graph.meta["ggml"]["arena_offsets"]``: per node, its data pointer minus the base of its gallocr buffer (``None``
for views and for nodes without data), so the two plans can be compared node by node.

Layers: a name ending in ``-<il>`` (llama.cpp's ``cb``) gives the layer; leafs ``blk.<il>.*`` and ``cache_?_l<il>``
too; ``inp_*`` and ``blk.*.*`` are -1; any other node inherits from its sources as :mod:`gdnpass.ops` does.

ggml ops we do not model raise :class:`GraphError` naming the node and the op (or become ``Op.OPAQUE`` nodes, once
:mod:`gdnpass.ir` has that op). Binding bug worked around here: ggml-python 0.0.45 declares the return type of
``ggml_backend_cpu_buffer_type``, ``ggml_backend_alloc_buffer`` and ``ggml_backend_cpu_buffer_from_ptr`` as a
Python ``int`` NewType, which ctypes treats as a 32-bit C int; the pointer is truncated and the next call segfaults
whenever the heap lies above 4 GiB. :func:`lib` resets those return types to ``c_void_p``.
"""

from __future__ import annotations

import ctypes
import re
import struct
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from gdnpass.ir import DType, Flag, Graph, GraphError, Op, Tensor, Unary, runs_kernel

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
            import ggml as _g  # the top-level ggml-python package, not this module
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


def _addr(p) -> int:
    """The address of a ggml pointer (0 for NULL)."""
    return ctypes.cast(p, ctypes.c_void_p).value or 0


def _name(t) -> str:
    return t.contents.name.decode(errors="replace")


_DTYPES = {"f32": DType.F32, "f16": DType.F16, "bf16": DType.BF16, "i32": DType.I32}
_GGML_TYPE = {DType.F32: "GGML_TYPE_F32", DType.F16: "GGML_TYPE_F16", DType.BF16: "GGML_TYPE_BF16",
              DType.I32: "GGML_TYPE_I32"}
_TORCH = {DType.F32: torch.float32, DType.F16: torch.float16, DType.BF16: torch.bfloat16, DType.I32: torch.int32}
_UNARY_KINDS = frozenset(u.value for u in Unary)
# ggml_op_can_inplace (ggml-alloc.c, ggml 0.15.3): the ops gallocr may place over a dying parent
_GGML_INPLACE_OPS = frozenset({"FILL", "SCALE", "DIAG_MASK_ZERO", "DIAG_MASK_INF", "ADD", "ADD_ID", "ADD1", "SUB", "MUL",
                               "DIV", "SQR", "SQRT", "LOG", "UNARY", "ROPE", "ROPE_BACK", "SILU_BACK", "RMS_NORM",
                               "RMS_NORM_BACK", "SOFT_MAX", "SOFT_MAX_BACK"})
_FLAG_MASK = int(Flag.INPUT | Flag.OUTPUT | Flag.PARAM | Flag.COMPUTE)  # ggml's LOSS flag (8) has no counterpart

# ggml ops that are exactly one of ours (same name, same semantics); NONE is a leaf (or a dependency hint node)
_EXACT_OPS = {op.value: op for op in (Op.VIEW, Op.RESHAPE, Op.TRANSPOSE, Op.PERMUTE, Op.CONT, Op.CPY, Op.GET_ROWS,
                                      Op.CONCAT, Op.SCALE, Op.ADD, Op.MUL, Op.UNARY, Op.RMS_NORM, Op.L2_NORM,
                                      Op.MUL_MAT, Op.SSM_CONV, Op.GATED_DELTA_NET)}


def _dtype(t) -> DType:
    label = lib().ggml_type_name(t.contents.type).decode()
    if label not in _DTYPES:
        raise GraphError(f"tensor {_name(t)!r}: ggml type {label} is not modelled (gdnpass has f32, f16, bf16, i32)")
    return _DTYPES[label]


def _ggml_type(dtype: DType) -> int:
    return getattr(lib(), _GGML_TYPE[dtype])


def _f32(i: int) -> float:
    return struct.unpack("<f", struct.pack("<i", i))[0]


# ---------------------------------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------------------------------


def _op_params(op: Op, c) -> dict:
    """ggml's int32 op_params of one tensor, decoded into gdnpass's keys (see gdnpass.ops)."""
    p = list(c.op_params)
    inplace = bool(c.view_src)
    if op is Op.VIEW:
        return {"offset": (p[0] & 0xFFFFFFFF) | ((p[1] & 0xFFFFFFFF) << 32)}  # a size_t
    if op is Op.PERMUTE:
        return {"axes": tuple(p[:4])}
    if op is Op.TRANSPOSE:
        return {"axes": (1, 0, 2, 3)}  # ggml stores none; gdnpass.ops.transpose records the swap
    if op is Op.CONCAT:
        return {"dim": p[0]}
    if op is Op.SCALE:
        return {"s": _f32(p[0]), "b": _f32(p[1]), "inplace": inplace}
    if op is Op.UNARY:
        return {"kind": lib().ggml_unary_op_name(p[0]).decode(), **({"inplace": True} if inplace else {})}
    if op in (Op.RMS_NORM, Op.L2_NORM):
        return {"eps": _f32(p[0]), **({"inplace": True} if inplace else {})}
    if op in (Op.ADD, Op.MUL):
        return {"inplace": True} if inplace else {}
    if op is Op.GATED_DELTA_NET:
        return {"K": p[0]}
    return {}


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
    """The naming convention for leafs that ``buffers`` does not place (see the module docstring)."""
    if in_ctx:
        return "input"
    if name.startswith("cache_"):
        return "cache"
    if name.startswith("inp_") or flags & int(Flag.INPUT):
        return "input"
    return "weights"


def _ctx_tensors(ctx) -> set[int]:
    g = lib()
    out, t = set(), g.ggml_get_first_tensor(ctx)
    while t:
        out.add(_addr(t))
        t = g.ggml_get_next_tensor(ctx, t)
    return out


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


def _hash_slot(cg, addr: int) -> int | None:
    """ggml_hash_find on the graph's visited set (linear probing from (addr >> 4) % size)."""
    hs = cg.visited_hash_set
    size = hs.size
    i = h = (addr >> 4) % size
    while True:
        used = bool(hs.used[i >> 5] & (1 << (i & 31)))
        if not used:
            return None
        if _addr(hs.keys[i]) == addr:
            return i
        i = (i + 1) % size
        if i == h:
            return None


def ggml_use_counts(cgraph, imported: Imported) -> dict[int, int]:
    """ggml's own use counts (``cgraph->use_counts``, read through its hash table), keyed by Tensor.uid; zeros left out
    (the shape of :meth:`Graph.use_counts`)."""
    cg = cgraph.contents
    out: dict[int, int] = {}
    for t in imported.graph.tensors():
        slot = _hash_slot(cg, _addr(imported.ptrs[t.uid]))
        if slot is None:
            raise GraphError(f"tensor {t.name!r} is not in the ggml graph's hash set")
        n = cg.use_counts[slot]
        if n:
            out[t.uid] = n
    return out


def import_ggml(cgraph, ctx=None, *, buffers: dict | None = None, meta: dict | None = None,
                validate: bool = True) -> Imported:
    """:func:`from_ggml` plus the ggml pointers of every tensor and gallocr's offsets (see :class:`Imported`)."""
    g = lib()
    if not cgraph:
        raise GraphError("from_ggml: the graph pointer is NULL")
    cg = cgraph.contents
    buffers = dict(buffers or {})
    by_ctx: dict[int, str] = {}
    by_name: dict[str, str] = {}
    for key, buf in buffers.items():
        if buf not in ("weights", "cache", "input"):
            raise GraphError(f"from_ggml: buffers[{key!r}] is {buf!r}; a leaf lives in weights, cache or input")
        if isinstance(key, str):
            by_name[key] = buf
        else:
            for a in _ctx_tensors(key):
                by_ctx[a] = buf
    compute_ctx = _ctx_tensors(ctx) if ctx is not None else set()

    nodes_p = [cg.nodes[i] for i in range(cg.n_nodes)]
    leafs_p = [cg.leafs[i] for i in range(cg.n_leafs)]
    # every tensor the lists reach through src/view_src (ggml puts all of them in one of the lists; be safe anyway)
    order: list = []
    seen: dict[int, int] = {}
    for p in leafs_p + nodes_p:
        if _addr(p) not in seen:
            seen[_addr(p)] = len(order)
            order.append(p)
    i = 0
    while i < len(order):
        c = order[i].contents
        for s in [*c.src, c.view_src]:
            if s and _addr(s) not in seen:
                seen[_addr(s)] = len(order)
                order.append(s)
        i += 1
    node_set = {_addr(p) for p in nodes_p}
    leaf_set = {_addr(p) for p in leafs_p}
    extra_leafs = []

    tensors: dict[int, Tensor] = {}
    ptrs: dict[int, Any] = {}
    for p in order:
        c = p.contents
        a = _addr(p)
        name = c.name.decode(errors="replace")
        opname = g.ggml_op_name(c.op).decode()
        if opname == "NONE":
            op = Op.NONE
            params = {}
            if a in node_set:  # ggml-backend's dependency node (an allocator hint); gdnpass models it the same way
                params = {"hint": "dependency"}
            elif a not in leaf_set:
                extra_leafs.append(p)
        else:
            op, params = _EXACT_OPS.get(opname), {}
            if op is not None:
                params = _op_params(op, c)
            if op is Op.UNARY and params["kind"] not in _UNARY_KINDS:
                opname, op = f"UNARY({params['kind']})", None
            if op is None:
                if not hasattr(Op, "OPAQUE"):
                    raise GraphError(f"node {name!r}: ggml op {opname} is not modelled by gdnpass (modelled: "
                                     f"{', '.join(sorted(_EXACT_OPS))}; UNARY {', '.join(sorted(_UNARY_KINDS))})")
                # a node gdnpass keeps as ggml made it and never fuses; ``can_inplace`` tells the planner what
                # gallocr would do with it (ggml_op_can_inplace)
                op = Op.OPAQUE  # type: ignore[attr-defined]
                params = {"ggml_op": opname, "ggml_op_params": [int(x) for x in c.op_params],
                          "can_inplace": opname.split("(")[0] in _GGML_INPLACE_OPS}
        t = Tensor(name=name, type=_dtype(p), ne=tuple(int(x) for x in c.ne), nb=tuple(int(x) for x in c.nb),
                   op=op, op_params=params, view_offs=int(c.view_offs), flags=Flag(int(c.flags) & _FLAG_MASK))
        tensors[a] = t
        ptrs[t.uid] = p
    # sources, views, buffers, layers (in list order, so a node's sources already have their layer)
    for p in order:
        c = p.contents
        t = tensors[_addr(p)]
        srcs = list(c.src)
        while srcs and not srcs[-1]:
            srcs.pop()
        t.src = [tensors[_addr(s)] if s else None for s in srcs]
        if c.view_src:
            t.view_src = tensors[_addr(c.view_src)]
    for p in leafs_p + extra_leafs + nodes_p:
        t = tensors[_addr(p)]
        a = _addr(p)
        if t.op is Op.NONE and t.view_src is None and a not in node_set:
            t.buffer = by_name.get(t.name) or by_ctx.get(a) or leaf_buffer(t.name, int(t.flags), a in compute_ctx)
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
    graph.leafs = [tensors[_addr(p)] for p in leafs_p + extra_leafs]
    graph.nodes = [tensors[_addr(p)] for p in nodes_p]
    graph._visited = {t.uid for t in graph.tensors()}

    # gallocr's decisions: data pointer - base of the node's buffer, for nodes that own memory
    offsets: list[int | None] = []
    arena_bufs: set[int] = set()
    for p in nodes_p:
        c = p.contents
        if c.view_src or not c.data or not c.buffer or c.op == 0:
            offsets.append(None)
            continue
        offsets.append(int(c.data) - int(g.ggml_backend_buffer_get_base(c.buffer)))
        arena_bufs.add(int(c.buffer))
    arena_size = None
    if len(arena_bufs) == 1:
        arena_size = int(g.ggml_backend_buffer_get_size(next(iter(arena_bufs))))
    elif len(arena_bufs) > 1:  # e.g. ggml_backend_sched over several buffers: no single arena to compare with
        offsets = [None] * len(offsets)

    graph.meta = dict(meta or {})
    graph.meta.setdefault("builder", "ggml")
    graph.meta["ggml"] = {"version": version(), "n_nodes": cg.n_nodes, "n_leafs": cg.n_leafs,
                          "arena_offsets": offsets, "arena_size": arena_size, "arena_buffers": len(arena_bufs)}
    if validate:
        graph.validate()
    return Imported(graph, ptrs, tensors, offsets, arena_size)


def from_ggml(cgraph, ctx=None, *, buffers: dict | None = None, meta: dict | None = None) -> Graph:
    """A ``ggml_cgraph *`` (ggml-python pointer) as a validated, unplanned :class:`Graph`.

    ``ctx``: the compute context, optional; leafs created in it are inputs (llama.cpp's convention).
    ``buffers``: ``{tensor name or ggml context: 'weights' | 'cache' | 'input'}`` for the leafs; the rest follow the
    naming convention of :func:`leaf_buffer`. ``meta`` is merged into ``graph.meta``.
    """
    return import_ggml(cgraph, ctx, buffers=buffers, meta=meta).graph


# ---------------------------------------------------------------------------------------------------------------------
# a session: contexts, buffers, gallocr, the CPU backend
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class NodeCheck:
    """One node of :meth:`GgmlSession.referee`: the torch reference on ggml's inputs vs ggml's output."""

    index: int
    name: str
    op: str
    exact: bool         # bit-identical (NaN where NaN)
    max_abs: float
    max_rel: float      # max |a-b| / max(|b|, 1e-30) over elements where |b| > 1e-6 (0 if none)
    nelements: int


class GgmlSession:
    """ggml resources for one graph: leaf contexts per buffer (weights / cache / input), the compute context and
    graph, gallocr on the CPU buffer type and the CPU backend. Use as a context manager (or call :meth:`close`)."""

    def __init__(self, n_threads: int = 1, graph_size: int = 16384, max_leafs: int = 4096) -> None:
        g = self.g = lib()
        self._closed = False
        self._fake_leafs = False
        self.backend = g.ggml_backend_cpu_init()
        g.ggml_backend_cpu_set_n_threads(self.backend, n_threads)
        self.buft = g.ggml_backend_cpu_buffer_type()
        ovh = g.ggml_tensor_overhead()
        self.leaf_ctx = {b: g.ggml_init(g.ggml_init_params(mem_size=ovh * max_leafs, mem_buffer=None, no_alloc=True))
                         for b in ("weights", "cache", "input")}
        self.ctx = g.ggml_init(g.ggml_init_params(mem_size=ovh * 4 * graph_size
                                                  + g.ggml_graph_overhead_custom(graph_size, False),
                                                  mem_buffer=None, no_alloc=True))
        self.gf = g.ggml_new_graph_custom(self.ctx, graph_size, False)
        self.leaf_buffers: dict[str, Any] = {}
        self.galloc = None
        self.leafs: dict[str, Any] = {}   # name -> leaf created by new_tensor

    # ---- lifetime -------------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        g = self.g
        if self.galloc is not None:
            g.ggml_gallocr_free(self.galloc)
        for b in self.leaf_buffers.values():
            g.ggml_backend_buffer_free(b)
        for c in self.leaf_ctx.values():
            g.ggml_free(c)
        g.ggml_free(self.ctx)
        g.ggml_backend_free(self.backend)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass

    def __enter__(self) -> "GgmlSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alignment(self) -> int:
        """The CPU buffer type's alignment, which gallocr uses (TENSOR_ALIGNMENT, 32 in ggml 0.15.3)."""
        return int(self.g.ggml_backend_buft_get_alignment(self.buft))

    # ---- building -------------------------------------------------------------------------------------------------
    def new_tensor(self, buffer: str, name: str, dtype: DType, ne, *, input: bool = False):
        """A leaf in the context of ``buffer`` (weights / cache / input); it gets memory in :meth:`allocate`."""
        ne = tuple(int(x) for x in ne) + (1,) * (4 - len(ne))
        t = self.g.ggml_new_tensor_4d(self.leaf_ctx[buffer], _ggml_type(dtype), *ne)
        self.g.ggml_set_name(t, name.encode())
        if input:
            self.g.ggml_set_input(t)
        self.leafs[name] = t
        return t

    def expand(self, t) -> None:
        self.g.ggml_build_forward_expand(self.gf, t)

    def allocate(self, plan_only: bool = False) -> None:
        """Give every leaf context its own backend buffer, then let gallocr plan and allocate the graph.

        ``plan_only``: the leafs get a fake data address instead of memory (gallocr then treats them as external,
        exactly as with real buffers), so a full-size model can be planned without its weights; such a session can
        be planned and imported but not computed."""
        g = self.g
        if plan_only:
            self._fake_leafs = True
            for c in self.leaf_ctx.values():
                t = g.ggml_get_first_tensor(c)
                while t:
                    t.contents.data = 1 << 44  # never dereferenced: gallocr only checks data != NULL
                    t = g.ggml_get_next_tensor(c, t)
        for b, c in self.leaf_ctx.items():
            if plan_only:
                break
            if b not in self.leaf_buffers and g.ggml_get_first_tensor(c):
                buf = g.ggml_backend_alloc_ctx_tensors(c, self.backend)
                if buf:
                    g.ggml_backend_buffer_clear(buf, 0)
                    self.leaf_buffers[b] = buf
        if self.galloc is None:
            self.galloc = g.ggml_gallocr_new(self.buft)
        if not g.ggml_gallocr_alloc_graph(self.galloc, self.gf):
            raise GraphError("ggml_gallocr_alloc_graph failed")

    @property
    def arena_size(self) -> int:
        return int(self.g.ggml_gallocr_get_buffer_size(self.galloc, 0)) if self.galloc is not None else 0

    def import_graph(self, meta: dict | None = None, validate: bool = True) -> Imported:
        """:func:`import_ggml` of this session's graph; leafs are placed by the context they were created in."""
        buffers = {c: b for b, c in self.leaf_ctx.items()}
        return import_ggml(self.gf, self.ctx, buffers=buffers, meta=meta, validate=validate)

    # ---- data -----------------------------------------------------------------------------------------------------
    def read(self, t) -> torch.Tensor:
        """A CPU copy of ggml tensor ``t`` as a torch tensor of shape (ne3, ne2, ne1, ne0), read through its strides."""
        self._check_real()
        g = self.g
        c = t.contents
        base = c.view_src if c.view_src else t
        if not base.contents.data:
            raise GraphError(f"read {_name(t)!r}: no memory yet (call allocate() first)")
        dtype = _dtype(t)
        n = int(g.ggml_nbytes(base))
        es = dtype.size
        ne = tuple(int(x) for x in c.ne)
        if n == 0 or any(x == 0 for x in ne):
            return torch.empty(tuple(reversed(ne)), dtype=_TORCH[dtype])
        buf = torch.empty(n, dtype=torch.uint8)
        g.ggml_backend_tensor_get(base, ctypes.c_void_p(buf.data_ptr()), 0, n)
        typed = buf.view(_TORCH[dtype])
        return typed.as_strided(tuple(reversed(ne)), tuple(int(x) // es for x in reversed(c.nb)),
                                int(c.view_offs) // es).clone()

    def write(self, t, value: torch.Tensor) -> None:
        """Set a contiguous ggml tensor (a leaf) from ``value`` (same element count and dtype)."""
        c = t.contents
        n = int(self.g.ggml_nbytes(t))
        v = value.detach().to("cpu").contiguous()
        if v.dtype != _TORCH[_dtype(t)] or v.numel() * v.element_size() != n:
            raise GraphError(f"write {_name(t)!r}: {v.dtype} x {v.numel()} does not fill {n} bytes of "
                             f"{_dtype(t).label}")
        if c.view_src:
            raise GraphError(f"write {_name(t)!r}: only base tensors can be written")
        if not c.data or not c.buffer:
            raise GraphError(f"write {_name(t)!r}: no memory yet (call allocate() first)")
        self.g.ggml_backend_tensor_set(t, ctypes.c_void_p(v.data_ptr()), 0, n)

    # ---- running --------------------------------------------------------------------------------------------------
    def _check_real(self) -> None:
        if self._fake_leafs:
            raise GraphError("this session was allocated with plan_only=True: its leafs have no memory")
        if self.galloc is None:
            raise GraphError("the graph has no memory yet (call allocate() first)")

    def compute(self) -> None:
        self._check_real()
        status = self.g.ggml_backend_graph_compute(self.backend, self.gf)
        if status != 0:
            raise GraphError(f"ggml_backend_graph_compute failed with status {status}")

    def compute_node(self, i: int) -> None:
        """Run node ``i`` alone (ggml_graph_view), in the memory gallocr gave it."""
        self._check_real()
        view = self.g.ggml_graph_view(self.gf, i, i + 1)
        status = self.g.ggml_backend_graph_compute(self.backend, ctypes.pointer(view))
        if status != 0:
            raise GraphError(f"ggml_backend_graph_compute failed on node {i} with status {status}")

    def referee(self, imported: Imported, on_node: Callable[[NodeCheck], None] | None = None) -> list[NodeCheck]:
        """Run the graph node by node. Before node i, read its sources (and, for GATED_DELTA_NET, its old bytes:
        unwritten snapshot slots keep them) from ggml's memory, run gdnpass's torch reference on them, run node i
        in ggml and compare. Views and empty nodes just run. Leaves ggml's memory as one whole run would."""
        from gdnpass.kernels import TORCH_BACKEND

        nodes = imported.graph.nodes
        if len(nodes) != self.g.ggml_graph_n_nodes(self.gf) or any(
                imported.ptrs.get(n.uid) is None for n in nodes):
            raise GraphError("referee needs the graph as imported from this session (not fused or edited)")
        checks: list[NodeCheck] = []
        for i, n in enumerate(nodes):
            p = imported.ptrs[n.uid]
            if not runs_kernel(n):
                self.compute_node(i)
                continue
            fn = TORCH_BACKEND.get(n.op)
            if fn is None:
                raise GraphError(f"node {n.name!r}: no torch reference for op {n.op.value}")
            src = [self.read(imported.ptrs[s.uid]) if s is not None else None for s in n.src]
            out = self.read(p)  # old bytes
            fn(n, src, out)
            self.compute_node(i)
            got = self.read(p)
            chk = compare(i, n, out, got)
            checks.append(chk)
            if on_node is not None:
                on_node(chk)
        return checks


def compare(i: int, n: Tensor, want: torch.Tensor, got: torch.Tensor) -> NodeCheck:
    """``want`` (gdnpass) vs ``got`` (ggml), elementwise in f32 (NaNs must coincide)."""
    a, b = want.to(torch.float32), got.to(torch.float32)
    if a.shape != b.shape:
        raise GraphError(f"node {n.name!r}: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}")
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return NodeCheck(i, n.name, _label(n), False, float("inf"), float("inf"), a.numel())
    ok = ~nan_a
    exact = bool(torch.equal(a[ok], b[ok]))
    d = (a[ok] - b[ok]).abs()
    max_abs = float(d.max()) if d.numel() else 0.0
    big = b[ok].abs() > 1e-6
    max_rel = float((d[big] / b[ok].abs()[big]).max()) if bool(big.any()) else 0.0
    return NodeCheck(i, n.name, _label(n), exact, max_abs, max_rel, a.numel())


def _label(n: Tensor) -> str:
    return f"UNARY({n.op_params['kind']})" if n.op is Op.UNARY else n.op.value


def pull_leafs(executor, imported: Imported, session: GgmlSession) -> None:
    """Copy every leaf's bytes from ggml into a :class:`gdnpass.runtime.Executor` of the imported graph."""
    for t in imported.graph.leafs:
        if t.view_src is None and not t.is_empty:
            executor.view(t).copy_(session.read(imported.ptrs[t.uid]).reshape(executor.view(t).shape))


def push_leafs(executor, imported: Imported, session: GgmlSession) -> None:
    """Copy every leaf's bytes from an Executor (e.g. after ``fill``) into ggml, so both start from the same data."""
    for t in imported.graph.leafs:
        if t.view_src is None and not t.is_empty:
            session.write(imported.ptrs[t.uid], executor.read(t))


# ---------------------------------------------------------------------------------------------------------------------
# the GDN verify graph, built with ggml (mirrors gdnpass.models call for call)
# ---------------------------------------------------------------------------------------------------------------------


class GgmlVerifyBuilder:
    """llama.cpp's graph context for one verify forward, on a :class:`GgmlSession`: the same tensors, created in the
    same order, and ``ggml_build_forward_expand`` at the points where :mod:`gdnpass.models` calls ``Graph.expand``."""

    def __init__(self, session: GgmlSession, cfg) -> None:
        cfg.check()
        self.s, self.g, self.ctx = session, session.g, session.ctx
        self.cfg, self.m = cfg, cfg.shape
        self.rows = cfg.cells * (1 + cfg.n_rs_seq)
        self.shared: dict[str, Any] = {}
        n_rs = cfg.n_seqs + cfg.n_rs_extra
        # build_inp_rs: one s_copy input and its two views, shared by all layers
        self.s_copy = session.new_tensor("input", "inp_s_copy", DType.I32, (n_rs,), input=True)
        self.s_copy_main = self.name(self.g.ggml_view_1d(self.ctx, self.s_copy, cfg.n_seqs, 0), "inp_s_copy_main")
        self.s_copy_extra = self.name(self.g.ggml_view_1d(self.ctx, self.s_copy, cfg.n_rs_extra, cfg.n_seqs * 4),
                                      "inp_s_copy_extra")

    # ---- ggml helpers ---------------------------------------------------------------------------------------------
    def name(self, t, name: str):
        self.g.ggml_set_name(t, name.encode())
        return t

    def cb(self, t, name: str, il: int):
        return self.name(t, f"{name}-{il}" if il >= 0 else name)

    def weight(self, name: str, il: int, dtype: DType, ne):
        if not self.cfg.share_weights:
            return self.s.new_tensor("weights", f"blk.{il}.{name}", dtype, ne)
        if name not in self.shared:
            self.shared[name] = self.s.new_tensor("weights", f"blk.*.{name}", dtype, ne)
        return self.shared[name]

    # ---- llama-graph.cpp build_rs ---------------------------------------------------------------------------------
    def build_rs(self, s, state_size: int, il: int):
        g, ctx, cfg = self.g, self.ctx, self.cfg
        states = g.ggml_reshape_2d(ctx, s, state_size, s.contents.ne[1])
        z = int(cfg.rs_z >= 0)
        state_zero = g.ggml_view_1d(ctx, states, state_size * z, cfg.rs_z * states.contents.nb[1] * z)
        self.s.expand(g.ggml_scale_inplace(ctx, state_zero, 0.0))
        output_states = g.ggml_get_rows(ctx, states, self.s_copy_main)
        self.s.expand(output_states)
        states_extra = g.ggml_get_rows(ctx, states, self.s_copy_extra)
        dst = g.ggml_view_1d(ctx, s, state_size * cfg.n_rs_extra, (cfg.kv_head + cfg.n_seqs) * state_size * 4)
        self.s.expand(g.ggml_cpy(ctx, states_extra, dst))
        return output_states

    # ---- delta-net-base.cpp build_conv_state ----------------------------------------------------------------------
    def build_conv_state(self, conv_states_all, qkv_mixed, il: int):
        g, ctx, cfg, m = self.g, self.ctx, self.cfg, self.m
        dc, C, n_s = m.d_conv, m.conv_channels, cfg.n_seqs
        conv_states = self.cb(self.build_rs(conv_states_all, m.n_embd_r, il), "conv_states", il)
        conv_states = self.cb(g.ggml_reshape_3d(ctx, conv_states, dc - 1, C, n_s), "conv_states_reshaped", il)
        qkv_t = self.cb(g.ggml_transpose(ctx, qkv_mixed), "qkv_mixed_transposed", il)
        conv_input = self.cb(g.ggml_concat(ctx, conv_states, qkv_t, 0), "conv_input", il)
        row_size = conv_states_all.contents.nb[1]
        K = cfg.n_rs_seq + 1
        ci = conv_input.contents
        for t in range(1, K + 1):
            # plane s_slot gets the window after n_t - s_slot tokens (clamped to the pre-ubatch state)
            s_idx = max(0, ci.ne[0] - conv_states.contents.ne[0] - K + t)
            s_slot = K - t
            window = self.name(g.ggml_view_3d(ctx, conv_input, dc - 1, C, n_s, ci.nb[1], ci.nb[2], 4 * s_idx),
                               f"conv_state_last.s{s_slot}-{il}")
            dst = self.name(g.ggml_view_2d(ctx, conv_states_all, m.n_embd_r, n_s, row_size,
                                           (s_slot * cfg.cells + cfg.kv_head) * row_size),
                            f"conv_state_update.s{s_slot}-{il}")
            self.s.expand(g.ggml_cpy(ctx, window, dst))
        return conv_input

    # ---- delta-net-base.cpp build_recurrent_attn ------------------------------------------------------------------
    def build_recurrent_attn(self, ssm_states_all, q, k, v, gate, b, s, il: int):
        g, ctx, cfg, m = self.g, self.ctx, self.cfg, self.m
        S, H, n_t, n_s = m.head_dim, m.n_v_heads, cfg.n_tokens, cfg.n_seqs
        K = cfg.n_rs_seq + 1
        gdn = self.cb(g.ggml_gated_delta_net(ctx, q, k, v, gate, b, s, K), "gdn_out", il)
        output = self.cb(g.ggml_view_4d(ctx, gdn, S, H, n_t, n_s, 4 * S, 4 * S * H, 4 * S * H * n_t, 0),
                         "attn_output", il)
        D = S * S * H
        score_bytes = 4 * S * H * n_t * n_s
        row_size = ssm_states_all.contents.nb[1]
        if cfg.n_rs_seq == 0:
            new_state = self.cb(g.ggml_view_4d(ctx, gdn, S, S, H, n_s, 4 * S, 4 * S * S, 4 * D, score_bytes),
                                "new_state", il)
            dst = self.name(g.ggml_view_2d(ctx, ssm_states_all, m.n_embd_s, n_s, row_size, cfg.kv_head * row_size),
                            f"ssm_state_update-{il}")
            self.s.expand(g.ggml_cpy(ctx, new_state, dst))
        else:
            n_written = min(n_t, K)
            src = self.name(g.ggml_view_3d(ctx, gdn, D, n_s, n_written, 4 * D, 4 * D * n_s, score_bytes),
                            f"gdn_snapshots-{il}")
            dst = self.name(g.ggml_view_3d(ctx, ssm_states_all, D, n_s, n_written, row_size, cfg.cells * row_size,
                                           cfg.kv_head * row_size), f"ssm_state_update-{il}")
            self.s.expand(g.ggml_cpy(ctx, src, dst))
        return output

    # ---- qwen35.cpp: FFN ------------------------------------------------------------------------------------------
    def build_ffn(self, cur, il: int):
        g, ctx, m = self.g, self.ctx, self.m
        wt = DType.parse(self.cfg.wtype)
        ffn_residual = cur
        x = g.ggml_mul(ctx, g.ggml_rms_norm(ctx, cur, m.eps),
                       self.weight("post_attention_norm.weight", il, DType.F32, (m.n_embd,)))
        x = self.cb(x, "attn_post_norm", il)
        up = g.ggml_mul_mat(ctx, self.weight("ffn_up.weight", il, wt, (m.n_embd, m.ffn_dim)), x)
        gate = g.ggml_mul_mat(ctx, self.weight("ffn_gate.weight", il, wt, (m.n_embd, m.ffn_dim)), x)
        x = g.ggml_mul(ctx, g.ggml_silu(ctx, gate), up)
        x = self.cb(g.ggml_mul_mat(ctx, self.weight("ffn_down.weight", il, wt, (m.ffn_dim, m.n_embd)), x),
                    "ffn_out", il)
        return g.ggml_add(ctx, x, ffn_residual)

    # ---- qwen35.cpp build_layer_attn_linear -----------------------------------------------------------------------
    def build_layer_attn_linear(self, cur, il: int):
        g, ctx, cfg, m = self.g, self.ctx, self.cfg, self.m
        n_t, n_s, C, H_v = cfg.n_tokens, cfg.n_seqs, m.conv_channels, m.n_v_heads
        wt, abt = DType.parse(cfg.wtype), DType.parse(cfg.ab_wtype)
        E = m.n_embd

        qkv_mixed = g.ggml_mul_mat(ctx, self.weight("attn_qkv.weight", il, wt, (E, C)), cur)
        qkv_mixed = self.cb(g.ggml_reshape_3d(ctx, qkv_mixed, C, n_t, n_s), "linear_attn_qkv_mixed", il)
        z = self.cb(g.ggml_mul_mat(ctx, self.weight("attn_gate.weight", il, wt, (E, m.value_dim)), cur), "z", il)

        beta = g.ggml_mul_mat(ctx, self.weight("ssm_beta.weight", il, abt, (E, H_v)), cur)
        beta = self.cb(g.ggml_reshape_4d(ctx, beta, 1, H_v, n_t, n_s), "beta", il)
        beta = self.cb(g.ggml_sigmoid(ctx, beta), "beta_sigmoid", il)
        alpha = g.ggml_mul_mat(ctx, self.weight("ssm_alpha.weight", il, abt, (E, H_v)), cur)
        alpha = self.cb(g.ggml_reshape_3d(ctx, alpha, H_v, n_t, n_s), "alpha", il)
        alpha_biased = g.ggml_add(ctx, alpha, self.weight("ssm_dt.bias", il, DType.F32, (H_v,)))
        alpha_softplus = self.cb(g.ggml_softplus(ctx, alpha_biased), "a_softplus", il)
        gate = self.cb(g.ggml_mul(ctx, alpha_softplus, self.weight("ssm_a", il, DType.F32, (H_v,))), "gate", il)
        gate = g.ggml_reshape_4d(ctx, gate, 1, H_v, n_t, n_s)

        conv_states_all = self.s.new_tensor("cache", f"cache_r_l{il}", DType.F32, (m.n_embd_r, self.rows))
        ssm_states_all = self.s.new_tensor("cache", f"cache_s_l{il}", DType.F32, (m.n_embd_s, self.rows))
        conv_kernel = self.weight("ssm_conv1d.weight", il, DType.F32, (m.d_conv, C))
        return self.build_gdn_core(cur, il, qkv_mixed, z, beta, gate, conv_states_all, ssm_states_all, conv_kernel)

    def build_gdn_core(self, cur, il, qkv_mixed, z, beta, gate, conv_states_all, ssm_states_all, conv_kernel,
                       stop_after_conv: bool = False):
        """From build_conv_state to ssm_out (``stop_after_conv``: return (silu, q, k, v) after the L2 norms)."""
        g, ctx, cfg, m = self.g, self.ctx, self.cfg, self.m
        n_t, n_s, C, H_v = cfg.n_tokens, cfg.n_seqs, m.conv_channels, m.n_v_heads
        wt = DType.parse(cfg.wtype)
        conv_input = self.build_conv_state(conv_states_all, qkv_mixed, il)
        state = self.build_rs(ssm_states_all, m.n_embd_s, il)
        state = self.cb(g.ggml_reshape_4d(ctx, state, m.head_dim, m.head_dim, H_v, n_s), "state_predelta", il)

        conv_out = self.cb(g.ggml_ssm_conv(ctx, conv_input, conv_kernel), "conv_output_raw", il)
        conv_silu = self.cb(g.ggml_silu(ctx, conv_out), "conv_output_silu", il)
        S, H_k = m.head_dim, m.n_k_heads
        nb1 = 4 * C
        q_conv = self.cb(g.ggml_view_4d(ctx, conv_silu, S, H_k, n_t, n_s, 4 * S, nb1, nb1 * n_t, 0), "q_conv", il)
        k_conv = self.cb(g.ggml_view_4d(ctx, conv_silu, S, H_k, n_t, n_s, 4 * S, nb1, nb1 * n_t, 4 * S * H_k),
                         "k_conv", il)
        v_conv = self.cb(g.ggml_view_4d(ctx, conv_silu, S, H_v, n_t, n_s, 4 * S, nb1, nb1 * n_t, 4 * 2 * S * H_k),
                         "v_conv", il)
        q_conv = self.cb(g.ggml_l2_norm(ctx, q_conv, m.eps), "q_conv_predelta", il)
        k_conv = self.cb(g.ggml_l2_norm(ctx, k_conv, m.eps), "k_conv_predelta", il)
        if stop_after_conv:
            return conv_silu, q_conv, k_conv, v_conv, state

        output = self.build_recurrent_attn(ssm_states_all, q_conv, k_conv, v_conv, gate, beta, state, il)

        z_2d = g.ggml_reshape_4d(ctx, z, S, H_v, n_t, n_s)
        normalized = g.ggml_mul(ctx, g.ggml_rms_norm(ctx, output, m.eps),
                                self.weight("ssm_norm.weight", il, DType.F32, (S,)))
        attn_out_norm = g.ggml_mul(ctx, normalized, g.ggml_silu(ctx, z_2d))
        final_output = self.cb(g.ggml_reshape_3d(ctx, attn_out_norm, m.value_dim, n_t, n_s), "final_output", il)
        cur = self.cb(g.ggml_mul_mat(ctx, self.weight("ssm_out.weight", il, wt, (m.value_dim, m.n_embd)),
                                     final_output), "linear_attn_out", il)
        return g.ggml_reshape_2d(ctx, cur, m.n_embd, n_t * n_s)


def build_ggml_gdn_layer(builder: GgmlVerifyBuilder, cur, il: int):
    """One GDN sub-layer (qwen35 ``build_layer_attn_linear``) on ``cur``, with real ggml calls; returns ggml's
    ``linear_attn_out`` reshaped to [n_embd, n_t*n_s]. The configuration (model shape, n_t, n_rs_seq, n_seqs, cells,
    kv_head, rs_z, extra rows, weight types) is ``builder.cfg``, a :class:`gdnpass.models.VerifyConfig`."""
    return builder.build_layer_attn_linear(cur, il)


def build_ggml_verify_graph(cfg, session: GgmlSession | None = None) -> tuple[GgmlSession, GgmlVerifyBuilder]:
    """:func:`gdnpass.models.build_verify_graph` with ggml: the graph is ``session.gf`` (not yet allocated)."""
    s = session or GgmlSession()
    b = GgmlVerifyBuilder(s, cfg)
    g, ctx, m = s.g, s.ctx, cfg.shape
    inpL = s.new_tensor("input", "inp_embd", DType.F32, (m.n_embd, cfg.n_tokens * cfg.n_seqs), input=True)
    taps = set(cfg.dflash_taps())
    for il in cfg.layer_ids():
        inpSA = inpL
        cur = g.ggml_mul(ctx, g.ggml_rms_norm(ctx, inpL, m.eps), b.weight("attn_norm.weight", il, DType.F32,
                                                                          (m.n_embd,)))
        cur = b.cb(cur, "attn_norm", il)
        s.expand(cur)
        cur = build_ggml_gdn_layer(b, cur, il)
        cur = b.cb(g.ggml_add(ctx, cur, inpSA), "attn_residual", il)
        if cfg.ffn:
            cur = b.build_ffn(cur, il)
        cur = b.cb(cur, "l_out", il)
        if il in taps:
            g.ggml_set_output(cur)
        inpL = cur
    g.ggml_set_output(inpL)
    s.expand(inpL)
    return s, b


def build_ggml_conv_chain(cfg, session: GgmlSession | None = None) -> tuple[GgmlSession, GgmlVerifyBuilder]:
    """The conv chain of one layer alone: build_conv_state, the ssm build_rs, SSM_CONV, SILU and the q/k L2 norms,
    with the projection ``inp_qkv_mixed`` [C, n_t, n_s] as an input (so every cache byte written is a copy).
    SILU and both L2 outputs are flagged OUTPUT (readable after the run)."""
    s = session or GgmlSession()
    b = GgmlVerifyBuilder(s, cfg)
    g, m, il = s.g, cfg.shape, 0
    qkv = s.new_tensor("input", "inp_qkv_mixed", DType.F32, (m.conv_channels, cfg.n_tokens, cfg.n_seqs), input=True)
    cache_r = s.new_tensor("cache", f"cache_r_l{il}", DType.F32, (m.n_embd_r, b.rows))
    cache_s = s.new_tensor("cache", f"cache_s_l{il}", DType.F32, (m.n_embd_s, b.rows))
    w = b.weight("ssm_conv1d.weight", il, DType.F32, (m.d_conv, m.conv_channels))
    silu, q, k, v, state = b.build_gdn_core(None, il, qkv, None, None, None, cache_r, cache_s, w,
                                            stop_after_conv=True)
    for t in (silu, q, k):
        g.ggml_set_output(t)
    s.expand(q)
    s.expand(k)
    return s, b


def verify_meta(cfg) -> dict:
    """The graph.meta gdnpass.models gives the same config (so Executor.fill and reports work on imports)."""
    from gdnpass.models import default_ids

    return {"builder": "ggml-verify", "config": asdict(cfg), "model": asdict(cfg.shape), "layers": cfg.layer_ids(),
            "dflash_taps": cfg.dflash_taps(), "ids": default_ids(cfg)}


# ---------------------------------------------------------------------------------------------------------------------
# structural comparison helpers (used by the tests and the example)
# ---------------------------------------------------------------------------------------------------------------------


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


__all__ = [
    "GgmlSession", "GgmlVerifyBuilder", "Imported", "NodeCheck", "build_ggml_conv_chain", "build_ggml_gdn_layer",
    "build_ggml_verify_graph", "compare", "diff_graphs", "from_ggml", "ggml_use_counts", "import_ggml", "leaf_buffer",
    "leaf_signature", "lib", "pull_leafs", "push_leafs", "signature", "verify_meta", "version",
]
