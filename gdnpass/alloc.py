"""A gallocr-compatible memory planner (ggml-alloc.c), run on the *unfused* graph.

What it reproduces, because fusion legality is decided on exactly this plan:

- one arena, a best-fit free list (``ggml_dyn_tallocr``): the smallest free block that fits among all but the last
  block, else the last block, which grows; ties go to the later block; freed blocks merge with their neighbours;
- sizes rounded up to the alignment;
- liveness from ``n_children`` (src slots) and ``n_views`` (view nodes on a base): a tensor is freed when both reach
  zero, a view's release is a release of its base; OUTPUT tensors are never freed; external memory is never freed;
- in-place reuse only for the ops ggml allows (:data:`gdnpass.opspec.INPLACE_OPS`: each op spec's ``can_inplace``,
  and an OPAQUE node's ``can_inplace``): the node takes its parent's block when the parent is arena-owned, not
  OUTPUT, has the same layout and this node is its only consumer;
- NONE nodes in the node list are allocator hints (ggml-backend's dependency nodes): their sources count as
  children, so a hint keeps tensors alive up to its position, and the hint itself is never allocated.

Leafs: those in the ``weights`` / ``cache`` / ``input`` buffers of a gdnpass-built graph are laid out by a simple
aligned bump allocator per buffer, except in a buffer laid out before planning (``Graph.placed``: a model's weights,
shared by the trunk's and the MTP head's contexts), whose leafs keep their offsets; a leaf already placed in another
named buffer (a llama.cpp capture's model, KV or recurrent buffer) keeps its place; a leaf with no buffer is a graph
input gallocr allocates in the arena, as ggml does (all such leafs first, in leaf order, then INPUT-flagged nodes and
sources in node order; freed after their last use).

:func:`bind` models what llama.cpp does with the plan: gallocr plans the worst-case (reserve) graph once and binds its
offsets to every later graph of the same topology whose tensors fit, node by node and source slot by source slot;
otherwise it re-plans that graph itself (``ggml_gallocr_needs_realloc``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gdnpass.ir import Flag, Graph, GraphError, Op, Tensor, arena_buffer, byte_range, inputs, same_layout, written
from gdnpass.opspec import INPLACE_OPS

DEFAULT_ALIGNMENT = 128  # ggml-cuda's buffer alignment; ggml's CPU buffers use 32 (TENSOR_ALIGNMENT)
MAX_ALIGNMENT = 4096     # a page: more than any ggml backend asks (CPU 32, CUDA 128, Vulkan's offset alignment)
_HUGE = 1 << 62          # ggml starts with one free block of SIZE_MAX/2


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class _Block:
    offset: int
    size: int


class DynAllocator:
    """ggml_dyn_tallocr: best-fit allocation over a free list, the last block being the growable tail."""

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.blocks: list[_Block] = [_Block(0, _HUGE)]
        self.max_size = 0

    def alloc(self, size: int, who: str) -> int:
        size = _align(size, self.alignment)
        best, best_size = -1, None
        for i, b in enumerate(self.blocks[:-1]):
            if b.size >= size and (best_size is None or b.size <= best_size):
                best, best_size = i, b.size
        if best < 0:
            if self.blocks[-1].size < size:
                raise GraphError(f"tensor {who!r}: arena exhausted allocating {size} bytes")
            best = len(self.blocks) - 1
        b = self.blocks[best]
        offset = b.offset
        b.offset += size
        b.size -= size
        if b.size == 0:
            del self.blocks[best]
        self.max_size = max(self.max_size, offset + size)
        return offset

    def free(self, offset: int, size: int) -> None:
        # a zero-size tensor's free still goes through the merge search (and may insert an empty block), as in ggml
        size = _align(size, self.alignment)
        for i, b in enumerate(self.blocks):
            if b.offset + b.size == offset:  # grows an earlier block; maybe bridges to the next
                b.size += size
                if i + 1 < len(self.blocks) and b.offset + b.size == self.blocks[i + 1].offset:
                    b.size += self.blocks[i + 1].size
                    del self.blocks[i + 1]
                return
            if offset + size == b.offset:    # grows a later block downward; maybe bridges to the previous
                b.offset = offset
                b.size += size
                if i > 0 and self.blocks[i - 1].offset + self.blocks[i - 1].size == b.offset:
                    self.blocks[i - 1].size += b.size
                    del self.blocks[i]
                return
        i = 0
        while i < len(self.blocks) and self.blocks[i].offset < offset:
            i += 1
        self.blocks.insert(i, _Block(offset, size))


@dataclass
class _Info:
    n_children: int = 0
    n_views: int = 0
    allocated: bool = False  # arena-owned and currently holding memory (gallocr's hash node ``allocated``)
    owned: bool = False      # arena-owned at some point (the tensor's memory comes from this plan)


@dataclass
class Plan:
    """The result of planning: sizes per buffer, plus a log of arena events for debugging and tests."""

    buffers: dict[str, int]
    alignment: int
    events: list[tuple[int, str, str, int]] = field(default_factory=list)  # (node index, 'alloc'|'inplace'|'free', name, offset)


def plan(graph: Graph, alignment: int = DEFAULT_ALIGNMENT, arena_name: str = "arena") -> Plan:
    """Assign ``buffer``/``offset`` to every base tensor of ``graph`` (in place) and return the plan.

    ``arena_name`` is gallocr's buffer: ``arena`` in gdnpass-built graphs, ``compute`` in llama.cpp captures."""
    events: list[tuple[int, str, str, int]] = []
    inputs_ = [t for t in graph.leafs if t.view_src is None and t.buffer in (None, arena_name)]
    for t in inputs_:
        t.buffer, t.offset = None, None
    bufs = _place_leafs(graph, alignment)
    arena = DynAllocator(alignment)
    info: dict[int, _Info] = {}

    def inf(t: Tensor) -> _Info:
        return info.setdefault(t.uid, _Info())

    for n in graph.nodes:
        if n.view_src is None and n.buffer not in (None, arena_name):
            raise GraphError(f"node {n.name!r}: computed tensors cannot live in buffer {n.buffer!r}")
        n.buffer, n.offset = (None, None) if n.view_src is None else (n.buffer, n.offset)

    def allocate(i: int, n: Tensor) -> None:
        st = inf(n)
        # views, hint nodes (views too) and leafs with memory of their own are never allocated here
        if n.view_src is not None or st.owned or (n.is_leaf and n.buffer is not None):
            return
        st.allocated = st.owned = True
        if n.op in INPLACE_OPS or (n.op is Op.OPAQUE and n.op_params.get("can_inplace")):
            for p in n.src:
                # gallocr's is_own(parent) is its hash node's ``allocated``: views and external tensors never qualify
                # (so ggml's view-parent branch cannot fire and is not reproduced here)
                if p is None or not inf(p).allocated:
                    continue
                if p.flags & Flag.OUTPUT or not same_layout(n, p):
                    continue
                ps = inf(p)
                if ps.n_children == 1 and ps.n_views == 0:
                    n.buffer, n.offset = arena_name, p.offset
                    ps.allocated = False  # the child now owns the block; the parent must not free it
                    events.append((i, "inplace", n.name, n.offset))
                    return
        n.buffer, n.offset = arena_name, arena.alloc(n.nbytes, n.name)
        events.append((i, "alloc", n.name, n.offset))

    def free(i: int, t: Tensor) -> None:
        st = inf(t)
        if not st.allocated or (t.flags & Flag.OUTPUT):
            return
        st.allocated = False
        arena.free(t.offset, t.nbytes)
        events.append((i, "free", t.name, t.offset))

    # graph inputs without memory first, in leaf order (ggml_gallocr_alloc_graph_impl: "allocate leafs")
    for t in inputs_:
        allocate(-1, t)
    # count children and views; INPUT nodes and sources next, in node order
    for i, n in enumerate(graph.nodes):
        if n.view_src is not None and n.op is not Op.NONE:  # NONE nodes are allocator hints, not views (as ggml)
            inf(n.view_src).n_views += 1
        if n.flags & Flag.INPUT:
            allocate(i, n)
        for s in n.src:
            if s is not None:
                inf(s).n_children += 1
                if s.flags & Flag.INPUT:
                    allocate(i, s)

    for i, n in enumerate(graph.nodes):
        for p in n.src:  # parents: only inputs can still be unallocated here
            if p is not None:
                allocate(i, p)
        allocate(i, n)
        for p in n.src:
            if p is None:
                continue
            ps = inf(p)
            ps.n_children -= 1
            if ps.n_children == 0 and ps.n_views == 0:
                if p.view_src is not None:
                    vs = inf(p.view_src)
                    vs.n_views -= 1
                    if vs.n_views == 0 and vs.n_children == 0:
                        free(i, p.view_src)
                else:
                    free(i, p)

    bufs[arena_name] = arena.max_size
    graph.buffers = bufs
    graph.alignment = alignment
    return Plan(bufs, alignment, events)


@dataclass
class Binding:
    """How :func:`bind` placed a graph: on the reserve plan, or (as gallocr then does) on a plan of its own."""

    reallocated: bool
    why: str | None = None    # the first reason gallocr re-plans (ggml_gallocr_needs_realloc's)


def bind(reserve: Graph, graph: Graph, arena_name: str = "arena") -> Binding:
    """Place ``graph`` as gallocr places a graph after reserving ``reserve`` (a *planned* graph): when both have the
    same numbers of nodes and leafs and every tensor of ``graph`` that needs memory fits the reserve tensor in the
    same slot (node i, node i's source j, leaf i), take the reserve's offsets slot by slot; otherwise plan ``graph``
    itself. Slots are positions, not names: the two graphs need only the same topology."""
    for t in [*graph.leafs, *graph.nodes]:
        if t.view_src is None and t.buffer == arena_name:
            t.buffer, t.offset = None, None
    pairs: list[tuple[Tensor, Tensor]] = []
    why = None
    if len(reserve.nodes) != len(graph.nodes):
        why = f"the graph has {len(graph.nodes)} nodes, the reserve graph {len(reserve.nodes)}"
    elif len(reserve.leafs) != len(graph.leafs):
        why = f"the graph has {len(graph.leafs)} leafs, the reserve graph {len(reserve.leafs)}"
    else:
        for r, t in zip(reserve.nodes, graph.nodes):
            pairs.append((t, r))
            pairs += [(ts, rs) for ts, rs in zip(t.src, r.src) if ts is not None and rs is not None]
        pairs += list(zip(graph.leafs, reserve.leafs))
        for t, r in pairs:  # ggml_gallocr_node_needs_realloc
            if t.view_src is not None or t.buffer is not None:
                continue
            if r.view_src is not None or r.buffer != arena_name:
                why = f"{t.name!r} needs memory but its reserve slot {r.name!r} has none in {arena_name}"
            elif t.nbytes > r.nbytes:
                why = f"{t.name!r} needs {t.nbytes} bytes, its reserve slot {r.name!r} has {r.nbytes}"
            if why:
                break
    if why:
        plan(graph, reserve.alignment, arena_name)
        return Binding(True, why)
    for t, r in pairs:
        if t.view_src is None and t.buffer is None and r.view_src is None and r.buffer == arena_name:
            t.buffer, t.offset = arena_name, r.offset
    graph.alignment = reserve.alignment
    return Binding(False)


def _place_leafs(graph: Graph, alignment: int) -> dict[str, int]:
    """gdnpass's weights, caches and inputs: each buffer packed in leaf order, aligned, but for a buffer laid out
    before planning (``graph.placed``), whose leafs keep their offsets. Leafs placed elsewhere keep their place (their
    buffer's size is at least their end); leafs without a buffer are the arena's."""
    sizes: dict[str, int] = {"weights": 0, "cache": 0, "input": 0, **graph.placed}
    external: dict[str, int] = {}
    for t in graph.leafs:
        if t.view_src is not None or t.buffer is None:
            continue
        if t.buffer in graph.placed:
            if t.offset is None or t.offset % alignment or t.offset + t.nbytes > graph.placed[t.buffer]:
                raise GraphError(f"leaf {t.name!r}: buffer {t.buffer!r} is laid out before planning "
                                 f"({graph.placed[t.buffer]} bytes), but the leaf's offset {t.offset} is not an "
                                 f"{alignment}-aligned place for its {t.nbytes} bytes in it")
        elif t.buffer in sizes:
            t.offset = sizes[t.buffer]
            sizes[t.buffer] = _align(t.offset + t.nbytes, alignment)
        elif t.offset is not None:
            external[t.buffer] = max(external.get(t.buffer, 0), t.offset + t.nbytes)
        else:
            raise GraphError(f"leaf {t.name!r}: buffer {t.buffer!r} is not one of weights/cache/input and the leaf "
                             "has no offset in it")
    for name, end in external.items():
        sizes[name] = max(end, graph.buffers.get(name, 0))  # a captured buffer keeps its recorded size
    return sizes


def live_ranges(graph: Graph) -> dict[int, tuple[int, int]]:
    """uid -> (first, last) node index during which an arena base tensor must hold its bytes.

    A tensor is live from the node that computes it to the last node reading it or any view of it. OUTPUT tensors
    stay live to the end. In-place successors are separate tensors sharing the block, so their ranges only touch.
    """
    pos = graph.positions()
    last: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        for s in n.src:
            if s is not None:
                last[s.base.uid] = i
    end = len(graph.nodes) - 1
    out: dict[int, tuple[int, int]] = {}
    for n in graph.nodes:
        if n.view_src is None and n.buffer == "arena":
            first = pos[n.uid]
            out[n.uid] = (first, end if n.flags & Flag.OUTPUT else max(first, last.get(n.uid, first)))
    return out




def check_plan(graph: Graph) -> None:
    """GraphError if two tensors own overlapping bytes while both are live: a plan gallocr never makes, which a
    graph file could still claim (fusion decided on such a plan would be decided on corrupt data).

    A tensor is live from the node that writes it (a fused node writes several) to its last reader; OUTPUT tensors
    to the end; leafs throughout. An in-place successor starts where its parent's life ends, so they only touch."""
    end = len(graph.nodes)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    tensors: dict[int, Tensor] = {}
    for i, n in enumerate(graph.nodes):
        for t in inputs(n):
            last[t.base.uid] = i
        for t in written(n):
            if t.view_src is None:
                first.setdefault(t.uid, i)
                tensors[t.uid] = t
    owners = []
    arena = arena_buffer(graph)
    for t in [*graph.leafs, *tensors.values()]:
        if t.view_src is not None or t.buffer is None or t.offset is None or t.is_empty:
            continue
        if t.is_leaf:  # a graph input gallocr placed in the arena is freed after its last reader, like a node
            span = (-1, last.get(t.uid, -1)) if t.buffer == arena and not t.flags & Flag.OUTPUT else (-1, end)
        else:
            f = first[t.uid]
            span = (f, end if t.flags & Flag.OUTPUT else max(f, last.get(t.uid, f)))
        owners.append((byte_range(t), span, t))
    owners.sort(key=lambda o: (o[0][0], o[0][1]))
    for i, ((buf, lo, hi), (fa, la), a) in enumerate(owners):
        for (buf_b, lo_b, hi_b), (fb, lb), b in owners[i + 1:]:
            if buf_b != buf or lo_b >= hi:
                break  # sorted by (buffer, offset): nothing further overlaps a
            if fa < lb and fb < la:
                raise GraphError(f"plan: {a.name!r} and {b.name!r} share bytes {buf}[{max(lo, lo_b)}, "
                                 f"{min(hi, hi_b)}) while both are live")
