"""The compute-graph IR, in ggml's vocabulary.

A :class:`Tensor` is a ggml_tensor: ``ne[0]`` is the fastest dimension, ``nb`` are byte strides, ``op``/``src``/``op_params``
say how it is computed, ``view_src`` is always the *base* tensor and ``view_offs`` the absolute byte offset into it.
A :class:`Graph` holds ``nodes`` in execution order and ``leafs`` (op NONE), and :meth:`Graph.expand` reproduces
``ggml_build_forward_expand`` (DFS post-order, src[0] first, each tensor once).

Memory is described by ``buffer`` and ``offset`` on base tensors: ``buffer`` names one of the graph's buffers, and
each buffer has a role (:class:`BufferSpec`, :func:`buffer_role`). gdnpass's own graphs use four buffers named after
their roles: leafs in ``weights``, ``cache`` and ``input``, computed tensors in the ``arena`` (role ``compute``) once
:mod:`gdnpass.alloc` has planned it. A graph captured from llama.cpp names its own (its compute buffer holds the graph
inputs as well as the computed tensors). A view has no memory of its own; :func:`byte_range` resolves it through its
base.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import networkx as nx

from gdnpass.errors import GraphError

GGML_MAX_DIMS = 4


class DType(enum.Enum):
    """A ggml type: ``size`` is ggml_type_size (the bytes of one block), ``block`` ggml_blck_size (the elements of
    one block: 1 for the plain types). The quantized types are ggml's block formats (ggml-common.h): a row of
    ``ne[0]`` elements is ``ne[0] / block`` blocks of ``size`` bytes, held as the file has them but for
    :data:`HELD_SPLIT`'s."""

    F32 = ("f32", 4)
    F16 = ("f16", 2)
    BF16 = ("bf16", 2)
    I32 = ("i32", 4)
    I64 = ("i64", 8)  # llama.cpp's KV-cache row indices (SET_ROWS)
    Q8_0 = ("q8_0", 34, 32)     # an f16 scale, 32 int8
    Q4_K = ("q4_k", 144, 256)   # f16 d and dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of nibbles
    Q5_K = ("q5_k", 176, 256)   # as Q4_K, plus 32 bytes of fifth bits
    Q6_K = ("q6_k", 210, 256)   # 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, an f16 d

    def __init__(self, label: str, size: int, block: int = 1) -> None:
        self.label = label  # plain attributes, not properties: the pass reads ``size`` for every byte range
        self.size = size
        self.block = block

    @property
    def is_quantized(self) -> bool:
        return self.block > 1

    def row_bytes(self, n: int) -> int:
        """ggml_row_size: the bytes of ``n`` elements (a multiple of ``block``)."""
        return self.size * n // self.block

    @classmethod
    def parse(cls, s: str) -> "DType":
        for t in cls:
            if s.lower() in (t.label, t.name.lower()):
                return t
        raise GraphError(f"unknown type {s!r} (expected one of {', '.join(t.label for t in cls)})")


# The block types whose rows gdnpass holds moved (gdnpass.kernels.quants.held_rows, docs/quantized.md): the same
# bytes, each row in planes, one a field of the block, as (offset, bytes) in the block, in the order the row holds
# them: every block's quants, then every block's scales. A plane's part of a block then lies at the same 16-byte
# alignment wherever the row does, which the file's blocks of 34 and 210 bytes do not give. A view takes whole rows.
HELD_SPLIT: dict[DType, tuple[tuple[int, int], ...]] = {
    DType.Q8_0: ((2, 32), (0, 2)),                           # qs, d
    DType.Q6_K: ((0, 128), (128, 64), (192, 16), (208, 2)),  # ql, qh, scales, d
}


class Op(enum.Enum):
    NONE = "NONE"
    VIEW = "VIEW"
    RESHAPE = "RESHAPE"
    TRANSPOSE = "TRANSPOSE"
    PERMUTE = "PERMUTE"
    CONT = "CONT"
    CPY = "CPY"
    GET_ROWS = "GET_ROWS"
    SET_ROWS = "SET_ROWS"
    CONCAT = "CONCAT"
    SCALE = "SCALE"
    ADD = "ADD"
    MUL = "MUL"
    UNARY = "UNARY"
    GLU = "GLU"
    RMS_NORM = "RMS_NORM"
    L2_NORM = "L2_NORM"
    MUL_MAT = "MUL_MAT"
    SOFT_MAX = "SOFT_MAX"
    ROPE = "ROPE"
    FLASH_ATTN_EXT = "FLASH_ATTN_EXT"
    SSM_CONV = "SSM_CONV"
    GATED_DELTA_NET = "GATED_DELTA_NET"
    # the expert FFN's ops (qwen35moe's build_moe_ffn, issue 36)
    ARGSORT = "ARGSORT"
    SUM_ROWS = "SUM_ROWS"
    CLAMP = "CLAMP"
    DIV = "DIV"
    MUL_MAT_ID = "MUL_MAT_ID"
    # an op gdnpass does not model (imported from ggml): kept with its shape and strides, never fused or executed
    OPAQUE = "OPAQUE"
    # The fused ops (GDN_CONV_CHAIN, MUL_MAT_VEC_PAIR, ...) are members too, added by :func:`fused_op` when their
    # pattern's folder is imported (gdnpass.patterns, the registry): adding a pattern touches no IR file.

    @property
    def is_fused(self) -> bool:
        return self in FUSED_OPS


class Unary(enum.Enum):
    """UNARY kinds (op_params ``kind``), named as ``ggml_unary_op_name`` names them; ggml's numbering of the pinned
    llama.cpp is :mod:`gdnpass.frontends.decode`'s. XIELU is left out: it carries four float parameters, so a XIELU
    node stays OPAQUE."""

    ABS = "ABS"
    SGN = "SGN"
    NEG = "NEG"
    STEP = "STEP"
    TANH = "TANH"
    ELU = "ELU"
    RELU = "RELU"
    SIGMOID = "SIGMOID"
    GELU = "GELU"
    GELU_QUICK = "GELU_QUICK"
    SILU = "SILU"
    HARDSWISH = "HARDSWISH"
    HARDSIGMOID = "HARDSIGMOID"
    EXP = "EXP"
    EXPM1 = "EXPM1"
    SOFTPLUS = "SOFTPLUS"
    GELU_ERF = "GELU_ERF"
    FLOOR = "FLOOR"
    CEIL = "CEIL"
    ROUND = "ROUND"
    TRUNC = "TRUNC"


class Glu(enum.Enum):
    """GLU kinds (op_params ``kind``), as ``ggml_glu_op_name`` names them. SWIGLU_OAI also carries ``alpha`` and
    ``limit``, SWIGLU_CLAMP ``limit``."""

    REGLU = "REGLU"
    GEGLU = "GEGLU"
    SWIGLU = "SWIGLU"
    SWIGLU_OAI = "SWIGLU_OAI"
    GEGLU_ERF = "GEGLU_ERF"
    GEGLU_QUICK = "GEGLU_QUICK"
    SWIGLU_CLAMP = "SWIGLU_CLAMP"


class Prec(enum.Enum):
    """enum ggml_prec: the accumulator precision a node asks for (op_params ``prec`` of MUL_MAT and FLASH_ATTN_EXT,
    set by ``ggml_prec_set_acc``; llama.cpp asks F32 for attention)."""

    UNDEFINED = "UNDEFINED"
    F32 = "F32"
    BF16 = "BF16"
    F16 = "F16"
    Q8 = "Q8"
    Q4 = "Q4"


class Flag(enum.IntFlag):
    NONE = 0
    INPUT = 1
    OUTPUT = 2
    PARAM = 4
    COMPUTE = 16


# The ops the fusion pass creates, one per registered pattern (filled by :func:`fused_op`). A fused node is a view of
# its primary output (as a CPY is a view of its destination) and lists the other tensors it writes in ``outs``.
FUSED_OPS: set[Op] = set()


def fused_op(name: str) -> Op:
    """The :class:`Op` member of the fused op ``name``, added on first call (a pattern's record declares its op with
    it; ``Op.NAME``, ``Op("NAME")`` and ``Op["NAME"]`` then find it like any member). Idempotent; a base op's name is
    refused."""
    member = Op._value2member_map_.get(name)
    if member is not None:
        if member not in FUSED_OPS:
            raise GraphError(f"{name} is a base op, not a fused op")
        return member
    if not name.isidentifier() or not name.isupper():
        raise GraphError(f"fused op name {name!r} must be an upper-case identifier, as ggml names ops")
    member = object.__new__(Op)
    member._name_, member._value_ = name, name
    Op._member_map_[name] = member
    Op._value2member_map_[name] = member
    Op._member_names_.append(name)
    type.__setattr__(Op, name, member)
    FUSED_OPS.add(member)
    return member

# Ops that create no data (ggml_cuda_is_view_or_noop, minus the "empty" case handled by Tensor.is_empty).
VIEW_OPS = frozenset({Op.NONE, Op.VIEW, Op.RESHAPE, Op.TRANSPOSE, Op.PERMUTE})

# What a buffer holds. weights: the model (ggml usage WEIGHTS); cache: state kept across graph runs (KV cache,
# recurrent states); input: graph inputs only, set before each run; compute: the buffer a gallocr-style planner
# lays computed tensors out in (llama.cpp's compute buffer, which also holds the graph inputs; gdnpass's arena).
BUFFER_ROLES = ("weights", "cache", "input", "compute")
BUFFER_USAGES = ("any", "weights", "compute")  # enum ggml_backend_buffer_usage


@dataclass(frozen=True)
class BufferSpec:
    """What a buffer is (its size is ``Graph.buffers[name]``, which the planner sets)."""

    role: str                    # one of BUFFER_ROLES
    backend: str | None = None   # ggml_backend_buffer_name, e.g. "CPU" (a captured graph's)
    usage: str | None = None     # one of BUFFER_USAGES (a captured graph's)


# gdnpass's own buffers: a graph needs no spec for these names (graph files of version 1 know only these)
DEFAULT_BUFFERS = {"weights": BufferSpec("weights"), "cache": BufferSpec("cache"), "input": BufferSpec("input"),
                   "arena": BufferSpec("compute")}

_ids = itertools.count()


@dataclass(eq=False, repr=False)
class Tensor:
    name: str
    type: DType
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    op: Op = Op.NONE
    op_params: dict = field(default_factory=dict)
    src: list["Tensor"] = field(default_factory=list)
    outs: list["Tensor"] = field(default_factory=list)  # other tensors the node writes (a fused node's extra outputs)
    view_src: "Tensor | None" = None
    view_offs: int = 0
    flags: Flag = Flag.NONE
    buffer: str | None = None   # base tensors only: which buffer holds the bytes
    offset: int | None = None   # base tensors only: byte offset inside that buffer
    layer: int | None = None    # the model layer that built it (for reports); -1 for graph-wide tensors
    uid: int = field(default_factory=lambda: next(_ids))

    # ---- shape ----------------------------------------------------------------------------------------------------
    @property
    def nelements(self) -> int:
        n = 1
        for x in self.ne:
            n *= x
        return n

    @property
    def nbytes(self) -> int:
        """ggml_nbytes: the span from the first to one past the last element, through the strides."""
        if any(x == 0 for x in self.ne):
            return 0
        if self.type.block > 1:  # a block type: the first row's blocks, then the strides of the others
            return self.type.row_bytes(self.ne[0]) + sum((self.ne[i] - 1) * self.nb[i] for i in range(1, GGML_MAX_DIMS))
        return self.type.size + sum((self.ne[i] - 1) * self.nb[i] for i in range(GGML_MAX_DIMS))

    @property
    def n_dims(self) -> int:
        for i in range(GGML_MAX_DIMS - 1, 0, -1):
            if self.ne[i] != 1:
                return i + 1
        return 1

    @property
    def is_empty(self) -> bool:
        return any(x == 0 for x in self.ne)

    def is_contiguous(self) -> bool:
        """ggml_is_contiguous: elements packed in ne order (dimensions of size 1 may have any stride)."""
        return is_contiguous_n(self, 0)

    def has_contiguous_rows(self) -> bool:
        return self.nb[0] == self.type.size

    # ---- views and memory -----------------------------------------------------------------------------------------
    @property
    def is_view(self) -> bool:
        return self.view_src is not None

    @property
    def base(self) -> "Tensor":
        return self.view_src if self.view_src is not None else self

    @property
    def is_leaf(self) -> bool:
        return self.op is Op.NONE

    def __repr__(self) -> str:
        ne = ",".join(str(x) for x in self.ne)
        return f"<{self.op.value} {self.name!r} {self.type.label} [{ne}]>"


def contiguous_strides(type_: DType, ne: Iterable[int]) -> tuple[int, int, int, int]:
    ne = tuple(ne)
    nb = [type_.size, type_.row_bytes(ne[0])]
    for i in range(2, GGML_MAX_DIMS):
        nb.append(nb[-1] * ne[i - 1])
    return tuple(nb)  # type: ignore[return-value]


def is_contiguous_n(t: Tensor, n: int) -> bool:
    """ggml_is_contiguous_n: contiguous except that dims >= n+1 ... follows ggml's helper of the same name."""
    next_nb = t.type.size
    if t.ne[0] != t.type.block and t.nb[0] != next_nb:
        return False
    next_nb = t.type.row_bytes(t.ne[0])
    for i in range(1, GGML_MAX_DIMS):
        if t.ne[i] != 1:
            if i > n:
                if t.nb[i] != next_nb:
                    return False
                next_nb *= t.ne[i]
            else:
                # this dimension does not need to be contiguous
                next_nb = t.ne[i] * t.nb[i]
    return True


def same_layout(a: Tensor, b: Tensor) -> bool:
    """ggml_are_same_layout: same type, shape and strides."""
    return a.type is b.type and a.ne == b.ne and a.nb == b.nb


def op_label(n: Tensor) -> str:
    """The op as reports name it: UNARY and GLU show their kind (``UNARY(SILU)``, ``GLU(SWIGLU)``)."""
    if n.op in (Op.UNARY, Op.GLU):
        return f"{n.op.value}({n.op_params.get('kind')})"
    return n.op.value


def runs_kernel(n: Tensor) -> bool:
    """Nodes that launch work: not a view/no-op and not empty (ggml_cuda_is_view_or_noop / ggml_is_empty)."""
    return n.op not in VIEW_OPS and not n.is_empty


def inputs(n: Tensor) -> list[Tensor]:
    """The tensors a node reads."""
    return [s for s in n.src if s is not None]


def outputs(n: Tensor) -> list[Tensor]:
    """The tensors whose memory a node writes: itself (for a view: the viewed bytes), plus ``outs``."""
    return [n, *n.outs]


def written(n: Tensor) -> list[Tensor]:
    """:func:`outputs`, plus the primary output a fused node computes (it is a view of it)."""
    return outputs(n) + ([n.view_src] if n.op.is_fused and n.view_src is not None else [])


def byte_range(t: Tensor) -> tuple[str, int, int]:
    """(buffer, lo, hi): the half-open byte interval ``t`` may touch, as ggml-cuda's fusion range checks see it."""
    base = t.base
    if base.buffer is None or base.offset is None:
        raise GraphError(f"tensor {t.name!r}: no memory assigned yet (plan the graph first)")
    lo = base.offset + t.view_offs
    return base.buffer, lo, lo + t.nbytes


def ranges_overlap(a: tuple[str, int, int], b: tuple[str, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2] and a[1] < a[2] and b[1] < b[2]


def one_to_one(*dims: tuple[int, int], elem: int = 4) -> bool:
    """Whether a view of ``dims`` ((byte stride, extent) pairs) of ``elem``-byte elements hits no address twice: in
    increasing order of stride, each stride (a whole number of elements) reaches past everything the dims below it
    span (extent-1 dims aside). Sufficient, not necessary (interleaved layouts are refused)."""
    reach = elem
    for nb, n in sorted(d for d in dims if d[1] > 1):
        if nb < reach or nb % elem:
            return False
        reach = nb * n
    return True


def keep_alive(name: str, *ts: Tensor) -> Tensor:
    """An allocator hint (ggml-backend's dependency node): an empty NONE node whose sources stay allocated until it.

    Placed in the node list after the last node that needs ``ts`` intact; it computes nothing. (A pattern's
    ``prepare`` adds them; :mod:`gdnpass.ops` re-exports it with the other constructors.)"""
    base = ts[0].base
    return Tensor(name=name, type=base.type, ne=(0, 1, 1, 1), nb=contiguous_strides(base.type, (0, 1, 1, 1)),
                  op=Op.NONE, op_params={"hint": "keep-alive"}, src=list(ts), view_src=base, view_offs=0,
                  layer=ts[0].layer)


class Uses:
    """The one use index: ggml's use counts (one use per (node, src slot), ggml_visit_parents_graph) and the users
    of every tensor (the nodes reading it through a src slot, in execution order, each once), from one pass over a
    node list. :meth:`Graph.use_counts`, :meth:`Graph.users` and the matchers' :class:`gdnpass.patterns.common.Context`
    read it."""

    def __init__(self, nodes: Iterable[Tensor]) -> None:
        self.counts: dict[int, int] = {}
        self._users: dict[int, list[Tensor]] = {}
        counts, users = self.counts, self._users
        for n in nodes:
            for s in n.src:
                if s is None:
                    continue
                counts[s.uid] = counts.get(s.uid, 0) + 1
                mine = users.setdefault(s.uid, [])
                if not mine or mine[-1] is not n:  # (nodes come in order: a second slot of n finds n last)
                    mine.append(n)

    def count(self, t: Tensor) -> int:
        return self.counts.get(t.uid, 0)

    def users(self, t: Tensor) -> list[Tensor]:
        return self._users.get(t.uid, [])


# ---------------------------------------------------------------------------------------------------------------------
# Graph
# ---------------------------------------------------------------------------------------------------------------------


class Graph:
    """Nodes in execution order plus leafs, as ggml_cgraph. Metadata (``meta``) records how the graph was built."""

    def __init__(self) -> None:
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self.meta: dict = {}
        self.buffers: dict[str, int] = {}  # buffer name -> size in bytes, set by the planner
        # buffer name -> size of a buffer laid out before planning, its leafs' offsets given (a model's weights, which
        # every context of the model shares, as llama.cpp's model buffer): the planner keeps them
        self.placed: dict[str, int] = {}
        self.buffer_specs: dict[str, BufferSpec] = {}  # buffer name -> role; DEFAULT_BUFFERS' names need none
        self.alignment: int = 0            # arena alignment the plan used (0: not planned)
        self._visited: set[int] = set()

    # ---- construction ---------------------------------------------------------------------------------------------
    def expand(self, t: Tensor) -> None:
        """ggml_build_forward_expand: DFS post-order over src[0], src[1], ...; each tensor visited once."""
        # iterative DFS to survive deep graphs (64 layers x ~80 nodes)
        stack: list[tuple[Tensor, int]] = [(t, 0)]
        while stack:
            node, i = stack.pop()
            if i == 0 and node.uid in self._visited:
                continue
            if i == 0:
                self._visited.add(node.uid)
            if i < len(node.src):
                stack.append((node, i + 1))
                s = node.src[i]
                if s is not None and s.uid not in self._visited:
                    stack.append((s, 0))
                continue
            if node.op is Op.NONE:  # (ggml keeps trainable PARAM leafs as nodes; nothing here trains)
                self.leafs.append(node)
            else:
                node.flags |= Flag.COMPUTE
                self.nodes.append(node)

    # ---- queries --------------------------------------------------------------------------------------------------
    def tensors(self) -> Iterator[Tensor]:
        yield from self.leafs
        yield from self.nodes

    def index(self, t: Tensor) -> int:
        for i, n in enumerate(self.nodes):
            if n is t:
                return i
        raise GraphError(f"tensor {t.name!r} is not a node of this graph")

    def positions(self) -> dict[int, int]:
        """uid -> node index."""
        return {n.uid: i for i, n in enumerate(self.nodes)}

    def use_counts(self) -> dict[int, int]:
        """ggml's use counts: one use per (node, src slot), counted once per node (ggml_visit_parents_graph)."""
        return Uses(self.nodes).counts

    def users(self, t: Tensor) -> list[Tensor]:
        """Nodes that read ``t`` through a src slot, in execution order (a node reading it twice appears once)."""
        return Uses(self.nodes).users(t)

    def dag(self) -> nx.DiGraph:
        """src -> node edges, keyed by uid, with the tensor in attribute ``t`` and the node index in ``pos``."""
        g = nx.DiGraph()
        pos = self.positions()
        for t in self.tensors():
            g.add_node(t.uid, t=t, pos=pos.get(t.uid, -1))
        for n in self.nodes:
            for slot, s in enumerate(n.src):
                if s is not None:
                    g.add_edge(s.uid, n.uid, slot=slot)
        return g

    def find(self, key: str | int) -> Tensor:
        """A node by index or by exact name (first match); GraphError names what was not found."""
        if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
            i = int(key)
            if not 0 <= i < len(self.nodes):
                raise GraphError(f"node index {i} out of range (graph has {len(self.nodes)} nodes)")
            return self.nodes[i]
        for t in self.tensors():
            if t.name == key:
                return t
        raise GraphError(f"no tensor named {key!r} in the graph")

    # ---- checks ---------------------------------------------------------------------------------------------------
    def check_order(self) -> None:
        """Every source is computed before the node that reads it, and the graph is acyclic. Raises GraphError.
        (The shape rules of each node are :func:`gdnpass.ops.validate`'s.)"""
        ready = {t.uid for t in self.leafs}  # tensors whose bytes exist by the time a node runs
        for n in self.nodes:
            for s in inputs(n):
                if s.uid not in ready:
                    raise GraphError(f"node {n.name!r}: src {s.name!r} is not computed before it")
            # a fused node is a view of its primary output, which it computes (like CPY of its destination)
            if n.view_src is not None and n.view_src.uid not in ready and not n.op.is_fused:
                raise GraphError(f"node {n.name!r}: view_src {n.view_src.name!r} is not computed before it")
            ready.update(t.uid for t in written(n))
            if n.view_src is not None:
                ready.add(n.view_src.uid)
        if not nx.is_directed_acyclic_graph(self.dag()):
            raise GraphError("graph has a cycle")

    def replace(self, rewrites: list[tuple[list[Tensor], Tensor, Tensor]]) -> None:
        """Apply rewrites ``(removed, new, at)`` in one pass: each ``new`` takes the position of its ``at`` node and
        the ``removed`` nodes (which may include ``at``) leave the node list.

        A removed node that ``new`` writes (its primary output or one of its ``outs``) is computed at ``new`` from
        now on, so a kept node that reads it, directly or through views, must come after ``new``. A view node that
        stood before (the router's top-k VIEW of the ARGSORT it writes at the DIV) moves to just after ``new``, in
        its order: a view reads and writes no byte, and the plan is made (its only trace there, a read of its base
        in ``alloc.check_plan``'s lifetimes, moves to ``new`` + 1, where ``new`` has just written that base). Any
        other such node would read the bytes before ``new`` writes them: a matcher's bug, GraphError."""
        gone = {t.uid for removed, _, _ in rewrites for t in removed}
        placed = {at.uid: new for _, new, at in rewrites}
        writer = {t.uid: new for _, new, _ in rewrites for t in written(new) if t.uid in gone}  # until placed
        waiting: dict[int, list[Tensor]] = {}  # a new node's uid -> the views that follow it
        out: list[Tensor] = []

        def emit(n: Tensor) -> None:
            out.append(n)
            for t in written(n):
                writer.pop(t.uid, None)
            for v in waiting.pop(n.uid, ()):
                emit(v)

        for n in self.nodes:
            if n.uid in placed:
                emit(placed.pop(n.uid))
            if n.uid in gone:
                continue
            pending = [(s, writer[s.uid]) for s in inputs(n) if s.uid in writer]
            if not pending:
                emit(n)
            elif n.op in VIEW_OPS and n.view_src is not None:
                waiting.setdefault(pending[0][1].uid, []).append(n)
                writer[n.uid] = pending[0][1]  # a view of it waits too
            else:
                s, new = pending[0]
                raise GraphError(f"node {n.name!r} reads {s.name!r} before {new.name!r}, which now writes it")
        if placed:
            raise GraphError(f"cannot place {next(iter(placed.values())).name!r}: its anchor is not a node")
        for _, new, _ in rewrites:
            new.flags |= Flag.COMPUTE
            self._visited.add(new.uid)
        self.nodes = out


# ---------------------------------------------------------------------------------------------------------------------
# buffers by role
# ---------------------------------------------------------------------------------------------------------------------


def buffer_spec(graph: Graph, name: str) -> BufferSpec:
    """The spec of buffer ``name``: the graph's own, else gdnpass's default for that name; GraphError if neither."""
    spec = graph.buffer_specs.get(name) or DEFAULT_BUFFERS.get(name)
    if spec is None:
        raise GraphError(f"buffer {name!r} has no role (give it one in graph.buffer_specs; roles: "
                         f"{', '.join(BUFFER_ROLES)})")
    return spec


def buffer_role(graph: Graph, name: str) -> str:
    return buffer_spec(graph, name).role


def arena_buffer(graph: Graph) -> str | None:
    """The name of the buffer the planner lays computed tensors out in (role compute): ``arena`` in gdnpass's own
    plans, llama.cpp's compute buffer in a captured graph; None while the graph is unplanned (no such buffer sized)."""
    names = [n for n in graph.buffers if buffer_role(graph, n) == "compute"]
    if len(names) > 1:  # ggml_backend_sched over several backends: one gallocr buffer each, not modelled yet
        raise GraphError(f"graph has {len(names)} compute buffers ({', '.join(names)}); gdnpass plans one")
    return names[0] if names else None
