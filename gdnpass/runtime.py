"""The executor: every buffer is one torch uint8 tensor, every tensor a strided view of it, nodes run in order.

Because tensors really alias (as the plan says), a rewrite that breaks the plan's liveness really corrupts bytes:
the exactness tests compare what this executor leaves in memory, not what an idealised evaluator would compute. It
invents no data: a graph's leafs are filled by :func:`gdnpass.models.fill.fill` (seeded values, llama.cpp's inputs)
or loaded from a model file.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable

import torch

from gdnpass import prepasses
from gdnpass.errors import KernelError, ResourceError
from gdnpass.ir import (HELD_SPLIT, DType, Graph, GraphError, Op, Tensor, arena_buffer, inputs, op_label,
                        runs_kernel)

# a quantized type's view is its bytes (uint8): a row of ne[0] elements is ne[0] / block blocks of size bytes
TORCH_DTYPES = {DType.F32: torch.float32, DType.F16: torch.float16, DType.BF16: torch.bfloat16, DType.I32: torch.int32,
                DType.I64: torch.int64, **{t: torch.uint8 for t in DType if t.is_quantized}}

Kernel = Callable[[Tensor, list, torch.Tensor], None]


def canonical_device(d: torch.device | str) -> torch.device:
    """``d`` with its index spelled out, so that two names of one device compare equal: "cuda" is the current CUDA
    device (where torch allocates for it); a CPU's index does not matter ("cpu:0" is "cpu")."""
    d = torch.device(d)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if d.type == "cpu" else d


def backend_for(device: str, backend: str | dict | None) -> dict:
    """The op -> kernel table: torch references on the CPU, Triton kernels for the arithmetic ops on CUDA; a table
    itself (a dict, e.g. torch with the Triton kernels of a few ops, as the interpreter tests use) as it is."""
    from gdnpass.kernels import backends

    if isinstance(backend, dict):
        return backend
    name = backend or ("triton" if device.startswith("cuda") else "torch")
    if name == "torch":
        return backends.TORCH_BACKEND
    if name == "triton":
        return backends.TRITON_BACKEND
    raise GraphError(f"unknown backend {name!r} (expected torch or triton)")


class Executor:
    """Runs a planned graph on ``device``. ``backend`` picks the kernel table (default: by device).

    ``buffers`` (name -> uint8 tensor on ``device``) hands the executor existing buffers instead of new ones: several
    graphs over one model (the generate loop's verify widths) share its weights, caches and, bound to one reserve
    plan, its arena, as llama.cpp's graphs share its model, memory and compute buffer. Each must hold at least the
    graph's size of that buffer; the others are allocated. ``extra`` (what -> bytes): memory the caller will need
    besides the buffers, counted in the memory check (:func:`check_memory`). ``share_pre_passes``: a quantized
    product whose activations an earlier product's pre-pass, or their producer, left in the workspace reads them
    there (:mod:`gdnpass.prepasses`; the same bytes either way, one launch fewer)."""

    def __init__(self, graph: Graph, device: str = "cpu", backend: str | None = None,
                 buffers: dict[str, torch.Tensor] | None = None, extra: dict[str, int] | None = None,
                 share_pre_passes: bool = True) -> None:
        self.arena = arena_buffer(graph)
        if self.arena is None:
            raise GraphError("graph has no memory plan: run gdnpass.alloc.plan(graph) first")
        self.graph = graph
        self.device = torch.device(device)
        self.kernels = backend_for(device, backend)
        shared = dict(buffers or {})
        for name, t in shared.items():
            if name not in graph.buffers:
                raise GraphError(f"shared buffer {name!r}: the graph has no such buffer ({', '.join(graph.buffers)})")
            if t.dtype is not torch.uint8 or t.dim() != 1:
                raise GraphError(f"shared buffer {name!r}: must be a 1-D uint8 tensor on {self.device}, is a "
                                 f"{t.dim()}-D {t.dtype} tensor")
            # the full device, index included: a buffer on cuda:1 under an executor on cuda:0 would hand its kernels
            # another GPU's memory
            if canonical_device(t.device) != canonical_device(self.device):
                raise GraphError(f"shared buffer {name!r}: is on {t.device}, the executor runs on "
                                 f"{canonical_device(self.device)}")
            if t.numel() < _pad(graph.buffers[name]):
                raise GraphError(f"shared buffer {name!r} has {t.numel()} bytes, the graph needs "
                                 f"{_pad(graph.buffers[name])}")
        # before allocating: a 4 TB plan is refused, not attempted (``extra``: see check_memory)
        check_memory(graph, self.device, shared=shared, extra=extra)
        # pad so that any dtype view of the byte buffer is well formed
        self.buffers = {name: shared[name] if name in shared else
                        torch.empty(_pad(size), dtype=torch.uint8, device=self.device)
                        for name, size in graph.buffers.items()}
        self._typed: dict[tuple[str, DType], torch.Tensor] = {}
        self._views: dict[int, torch.Tensor] = {}
        self._cuda_graph = None
        self.share_pre_passes = share_pre_passes and self._triton_products()
        self._plan: tuple[tuple[int, ...], prepasses.Plan] | None = None

    @property
    def pre_passes(self) -> prepasses.Plan | None:
        """The pre-pass plan of the graph's nodes as they are now (None: every product runs its own): planned again
        whenever the nodes changed since (a rewrite after the executor was made, as check_fusion's)."""
        if not self.share_pre_passes:
            return None
        nodes = tuple(n.uid for n in self.graph.nodes)
        if self._plan is None or self._plan[0] != nodes:
            self._plan = nodes, prepasses.plan(self.graph)
        return self._plan[1]

    @contextlib.contextmanager
    def node_context(self, n: Tensor, plan: prepasses.Plan | None = None):
        """What node ``n``'s kernel runs inside: skipping its pre-pass, producing its output quantized, or both (a
        pair that hands its output on), as ``plan`` (default: :attr:`pre_passes`) says; else nothing."""
        plan = plan if plan is not None else self.pre_passes
        with contextlib.ExitStack() as stack:
            if plan is not None and n.uid in plan.shared:
                stack.enter_context(prepasses.skipping())
            if plan is not None and n.uid in plan.producing:
                stack.enter_context(prepasses.producing(plan.producing[n.uid]))
            yield

    def _triton_products(self) -> bool:
        """Whether the products and the producer run on the Triton kernels, which fill the activation workspace (a
        table that runs some on torch could leave the workspace unfilled where the plan says it is)."""
        from gdnpass.kernels.backends import TRITON_BACKEND

        ops = (*prepasses.PRODUCTS, "MUL_MAT_ID", *prepasses.PRODUCERS)
        return all(self.kernels.get(Op[o]) is TRITON_BACKEND.get(Op[o]) for o in ops)

    # ---- memory ---------------------------------------------------------------------------------------------------
    def view(self, t: Tensor) -> torch.Tensor:
        """The 4-D torch view (ne3, ne2, ne1, ne0) of ``t`` in its planned memory."""
        v = self._views.get(t.uid)
        if v is None:
            v = self._views[t.uid] = self._make_view(t)
        return v

    def view_in(self, t: Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """``t``'s view in another byte tensor laid out like its buffer (e.g. a host staging copy of the inputs)."""
        return self._make_view(t, buffer)

    def _make_view(self, t: Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """``t``'s 4-D view; a quantized tensor's is its rows' bytes, (ne3, ne2, ne1, row bytes)."""
        base = t.base
        if base.buffer not in self.buffers or base.offset is None:
            raise GraphError(f"tensor {t.name!r}: no memory in this plan (buffer {base.buffer!r})")
        es = 1 if t.type.is_quantized else t.type.size
        off = base.offset + t.view_offs
        if off % es or any(nb % es for nb in t.nb):
            raise GraphError(f"tensor {t.name!r}: offset/strides are not multiples of its element size {es}")
        ne, nb = t.ne, t.nb
        if t.type.is_quantized:
            if t.ne[0] % t.type.block or t.nb[0] != t.type.size:
                raise GraphError(f"tensor {t.name!r}: a {t.type.label} row must be whole blocks packed in order "
                                 f"(ne0 {t.ne[0]}, nb0 {t.nb[0]})")
            if t.type in HELD_SPLIT and (base.type is not t.type or t.ne[0] != base.ne[0] or t.view_offs % base.nb[1]):
                raise GraphError(f"tensor {t.name!r}: a view of {t.type.name} rows must take them whole (ne0 "
                                 f"{t.ne[0]} of {base.ne[0]}, offset {t.view_offs}): gdnpass holds them split, "
                                 f"their scales after their K quants")
            ne, nb = (t.type.row_bytes(t.ne[0]), *t.ne[1:]), (1, *t.nb[1:])
        if buffer is None:
            buffer = self.buffers[base.buffer]
            key = (base.buffer, t.type)
            typed = self._typed.get(key)
            if typed is None:
                typed = self._typed[key] = buffer.view(TORCH_DTYPES[t.type])
        else:
            typed = buffer.view(TORCH_DTYPES[t.type])
        if not t.is_empty and off + t.nbytes > buffer.numel():
            raise GraphError(f"tensor {t.name!r}: bytes [{off}, {off + t.nbytes}) run past buffer {base.buffer!r}")
        return typed.as_strided(tuple(reversed(ne)), tuple(b // es for b in reversed(nb)), off // es)

    def read(self, t: Tensor | str) -> torch.Tensor:
        """A copy of a tensor's current contents, on the CPU."""
        if isinstance(t, str):
            t = self.graph.find(t)
        return self.view(t).detach().to("cpu", copy=True)

    def bytes_of(self, t: Tensor) -> bytes:
        """The raw bytes of a base tensor or a contiguous view (for byte-for-byte comparisons)."""
        return self.read(t).contiguous().view(torch.uint8).numpy().tobytes()

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.buffers.items()}

    def restore(self, snap: dict[str, torch.Tensor]) -> None:
        for k, v in snap.items():
            self.buffers[k].copy_(v)

    # ---- execution ------------------------------------------------------------------------------------------------
    def run(self, progress: Callable[[int, int], None] | None = None,
            probes: Iterable[Tensor] = ()) -> dict[str, torch.Tensor]:
        """Execute every node in order (or replay the captured CUDA graph).

        ``probes``: tensors to copy out while they are still valid, i.e. just before the last kernel that reads
        them (an intermediate's block is reused afterwards); a tensor nobody reads is copied at the end. Returns
        {name: CPU copy}.
        """
        probes = list(probes)
        return {t.name: v for t, v in zip(probes, self.run_probed(probes, progress))}

    def run_probed(self, probes: list[Tensor], progress: Callable[[int, int], None] | None = None) \
            -> list[torch.Tensor]:
        """:meth:`run`, returning the probes' CPU copies in ``probes``' order (names may repeat)."""
        if self._cuda_graph is not None:
            if probes:
                raise GraphError("probes are not available when replaying a captured CUDA graph")
            self._cuda_graph.replay()
            return []
        nodes = self.graph.nodes
        fns = [self._kernel(n) if runs_kernel(n) else None for n in nodes]  # refused before anything runs
        plan = self.pre_passes
        at = probe_points(self.graph, probes)
        captured: dict[int, torch.Tensor] = {}
        for i, (n, fn) in enumerate(zip(nodes, fns)):
            for t in at.get(i, ()):
                captured[id(t)] = self.read(t)
            if fn is not None:
                try:
                    with self.node_context(n, plan):
                        fn(n, [self.view(s) if s is not None else None for s in [*n.src, *n.outs]], self.view(n))
                except KernelError as e:  # (a row id outside the rows, say: name the node)
                    raise KernelError(f"node {n.name!r}: {e}") from None
            if progress is not None:
                progress(i + 1, len(nodes))
        for t in at.get(len(nodes), ()):
            captured[id(t)] = self.read(t)
        return [captured[id(t)] for t in probes]

    def _kernel(self, n: Tensor):
        from gdnpass.kernels.backends import kernel

        fn = kernel(self.kernels, n)
        if fn is None:
            raise GraphError(f"node {n.name!r}: gdnpass cannot execute {op_label(n)} (it models the op: validates, "
                             f"saves, plans and dumps it, but has no kernel for it)")
        return fn

    def capture(self, pdl: bool | None = None) -> None:
        """Capture one whole run as a CUDA graph (:func:`capture_cuda_graph`); later ``run`` calls replay it."""
        if self.device.type != "cuda":
            raise GraphError("CUDA-graph capture needs device cuda")
        self._cuda_graph = capture_cuda_graph(self.run, self.graph, pdl)

    def timed_run(self) -> float:
        """Seconds for one ``run``, synchronised."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.run()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def capture_cuda_graph(run, graph: Graph, pdl: bool | None = None, pool=None) -> torch.cuda.CUDAGraph:
    """``run`` (the launches of ``graph``'s nodes) captured as a CUDA graph (in memory pool ``pool``), after a
    warm-up run that compiles its kernels outside the capture; both with programmatic dependent launch or serially
    (where supported; ``pdl`` None: as :func:`programmatic_launch_pays` says of ``graph``), since the launch option
    is part of a kernel's compile key."""
    from gdnpass.kernels.triton_core import programmatic_launch

    with programmatic_launch(programmatic_launch_pays(graph) if pdl is None else pdl):
        run()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            run()
    return g


def programmatic_launch_pays(graph: Graph) -> bool:
    """Whether ``graph`` is captured with programmatic dependent launch (triton_core: where the GPU supports it): where
    its products read plain types, not where one reads a block type (has an activation pre-pass). Measured, the 9B
    verify, fusion on (docs/performance.md, 2026-12-06 and -07): bf16 6% faster with it (H100); the real Q4_K_M file
    4-6% slower on the H100 and on the H200 (the RMS_NORM_MULs before the products end 3 us later each), its Q8_0 file
    0.4-1% slower (H100). (A bf16 GEMM's terms fill the workspace too, and are no block type.)"""
    return not any(prepasses.fills_workspace(n) and n.src[0].type.is_quantized for n in graph.nodes)


def probe_points(graph: Graph, probes: list[Tensor]) -> dict[int, list[Tensor]]:
    """node index -> tensors to read just before that node runs (the last node after the tensor's writer that reads
    its bytes), or len(nodes) for the end. Only readers after the writer count: a CPY lists its destination among
    its sources, and a read there would take the bytes from before the copy."""
    at: dict[int, list[Tensor]] = {}
    for t in probes:
        lo, hi = t.view_offs, t.view_offs + t.nbytes
        writer = next((i for i, n in enumerate(graph.nodes) if n is t or any(o is t for o in n.outs)), -1)
        last = len(graph.nodes)
        for i, n in enumerate(graph.nodes[writer + 1:], writer + 1):
            if runs_kernel(n) and any(s.base is t.base and s.view_offs < hi and lo < s.view_offs + s.nbytes
                                      for s in inputs(n)):
                last = i
        at.setdefault(last, []).append(t)
    return at


def _pad(n: int) -> int:
    return max(16, (n + 15) // 16 * 16)


# ---------------------------------------------------------------------------------------------------------------------
# memory available
# ---------------------------------------------------------------------------------------------------------------------


def available_bytes(device: torch.device) -> int | None:
    """Memory a plan may use on ``device``: free GPU memory and what torch has cached unused (CUDA), else MemAvailable (psutil if installed, else
    /proc/meminfo); None where it cannot be known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # what torch's caching allocator holds but no tensor uses (a freed executor's buffers) is ours to take too
        return int(free) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _size(n: int) -> str:
    for unit, k in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.2f} {unit}"
    return f"{n} B"


def check_memory(graph: Graph, device: torch.device, available: int | None = None, shared: Iterable[str] = (),
                 extra: dict[str, int] | None = None) -> None:
    """Refuse (:class:`ResourceError`, one line) a plan whose buffers exceed the memory available on ``device``,
    naming the buffer sizes and the largest tensors. Buffers in ``shared`` exist already and are not counted;
    ``extra`` (what -> bytes) is memory the run needs besides the buffers (a check's snapshot of every buffer, the
    temporary copies of a weight being loaded)."""
    shared = set(shared)
    extra = {k: v for k, v in (extra or {}).items() if v}
    need = sum(_pad(s) for k, s in graph.buffers.items() if k not in shared) + sum(extra.values())
    have = available_bytes(device) if available is None else available
    if have is None or need <= have:
        return
    bases = {id(t.base): t.base for t in graph.tensors() if t.base.buffer is not None and not t.base.is_empty}
    big = sorted(bases.values(), key=lambda t: t.nbytes, reverse=True)[:3]
    where = "free GPU memory" if device.type == "cuda" else "available RAM"
    raise ResourceError(
        f"the memory plan needs {_size(need)} ("
        + ", ".join(f"{k} {_size(v)}" for k, v in [*graph.buffers.items(), *extra.items()])
        + f") but {where} on {device} is {_size(have)}; largest tensors: "
        + ", ".join(f"{t.name!r} {_size(t.nbytes)} ({t.buffer})" for t in big))
