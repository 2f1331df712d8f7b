"""A ggml session: contexts, backend buffers, gallocr and the CPU backend; reading and writing tensors; running the
graph whole or node by node, with the torch reference as the other side (:meth:`GgmlSession.referee`)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gdnpass.frontends.ggml.importer import Imported, ggml_type, import_ggml, lib, pointer, read_tensor
from gdnpass.frontends.structs import record_dtype
from gdnpass.ir import DType, GraphError, Tensor, op_label, runs_kernel
from gdnpass.kernels.backends import TORCH_BACKEND

_TORCH = {DType.F32: torch.float32, DType.F16: torch.float16, DType.BF16: torch.bfloat16, DType.I32: torch.int32,
          DType.I64: torch.int64}


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
        t = self.g.ggml_new_tensor_4d(self.leaf_ctx[buffer], ggml_type(dtype), *ne)
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
        c = read_tensor(t)
        base = pointer(c.view_src) if c.view_src is not None else t
        if not read_tensor(base).data:
            raise GraphError(f"read {c.name!r}: no memory yet (call allocate() first)")
        n = int(g.ggml_nbytes(base))
        dtype = record_dtype(c)
        if dtype not in _TORCH:  # (a block type's bytes would need quants.held_rows / file_rows at the boundary)
            raise GraphError(f"read {c.name!r}: {dtype.label} tensors are not read from a ggml session")
        es = dtype.size
        if n == 0 or any(x == 0 for x in c.ne):
            return torch.empty(tuple(reversed(c.ne)), dtype=_TORCH[dtype])
        buf = torch.empty(n, dtype=torch.uint8)
        g.ggml_backend_tensor_get(base, ctypes.c_void_p(buf.data_ptr()), 0, n)
        typed = buf.view(_TORCH[dtype])
        strides = tuple(x // es for x in reversed(c.nb))
        return typed.as_strided(tuple(reversed(c.ne)), strides, c.view_offs // es).clone()

    def write(self, t, value: torch.Tensor) -> None:
        """Set a contiguous ggml tensor (a leaf) from ``value`` (same element count and dtype)."""
        c = read_tensor(t)
        dtype = record_dtype(c)
        n = int(self.g.ggml_nbytes(t))
        v = value.detach().to("cpu").contiguous()
        if dtype not in _TORCH:  # (as read: a block type's held rows are not ggml's)
            raise GraphError(f"write {c.name!r}: {dtype.label} tensors are not written to a ggml session")
        if v.dtype != _TORCH[dtype] or v.numel() * v.element_size() != n:
            raise GraphError(f"write {c.name!r}: {v.dtype} x {v.numel()} does not fill {n} bytes of {dtype.label}")
        if c.view_src is not None:
            raise GraphError(f"write {c.name!r}: only base tensors can be written")
        if not c.data or not c.buffer:
            raise GraphError(f"write {c.name!r}: no memory yet (call allocate() first)")
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
    """``want`` (gdnpass) vs ``got`` (ggml), elementwise in f32 (NaNs must coincide; equal values, equal infinities
    among them, differ by 0: a slot neither side writes keeps its old bytes, which may be an infinity in both)."""
    a, b = want.to(torch.float32), got.to(torch.float32)
    if a.shape != b.shape:
        raise GraphError(f"node {n.name!r}: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}")
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return NodeCheck(i, n.name, _label(n), False, float("inf"), float("inf"), a.numel())
    ok = ~nan_a
    exact = bool(torch.equal(a[ok], b[ok]))
    d = torch.where(a[ok] == b[ok], 0.0, (a[ok] - b[ok]).abs())  # (inf - inf would be NaN)
    max_abs = float(d.max()) if d.numel() else 0.0
    big = b[ok].abs() > 1e-6
    max_rel = float((d[big] / b[ok].abs()[big]).max()) if bool(big.any()) else 0.0
    return NodeCheck(i, n.name, _label(n), exact, max_abs, max_rel, a.numel())


_label = op_label


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
