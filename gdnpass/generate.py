"""The speculative loop, end to end: prefill, then draft -> verify -> accept -> roll back, until N tokens.

It runs a whole qwen35 model (a GGUF file, or a preset with generated weights) through the pipeline, as llama.cpp's
``examples/speculative-simple`` drives a context (pinned commit 0c1e570):

* **prefill**: the prompt but its last token, in ubatches of ``n_ubatch`` split as llama.cpp's
  ``split_equal(n_ubatch, sequential, n_keep_tail = n_rs_seq + 1)`` splits them (the last ``1 + n_rs_seq`` tokens
  never straddle two ubatches), asking for no logits (their lm head has no columns); every ubatch graph has the
  context's ``1 + n_rs_seq`` snapshot planes, as in llama.cpp, where ``n_rs_seq`` is a context parameter and not a
  property of a batch;
* **a step**: the drafter proposes up to K tokens, fewer near the end of the context or of N
  (:func:`gdnpass.drafters.draft_budget`); one ubatch of ``n_t = drafts + 1`` tokens (the last sampled token
  first) is verified with logits for every token; the greedy prefix is accepted (row i's argmax must equal draft i;
  the first mismatch, or the row after the last draft, gives the bonus token: :func:`gdnpass.drafters.accept_greedy`):
  ``accepted + 1`` tokens are generated;
* **roll back** as llama.cpp does, ``llama_memory_seq_rm(mem, seq, p0 = n_past, -1)`` (:meth:`Engine.seq_rm`): the
  recurrent memory remembers ``rs_idx = cell.pos - (p0 - 1) = n_t - 1 - accepted`` and the next ubatch's
  ``rs_s_copy`` reads plane ``r = rs_idx`` (once: the index is then reset to 0); the KV cache frees the rejected
  positions' cells, which the next ubatch's KQ mask no longer shows and its SET_ROWS overwrite.

Memory is planned as llama.cpp plans it: one reserve plan of the worst-case graph (``n_ubatch`` tokens, every KV
cell), and each ubatch graph bound to it slot by slot (:func:`gdnpass.pipeline.run` with ``reserve``). Graphs are
cached per (width n_t, KV bucket n_kv: llama.cpp pads the used cells to 256), the pass runs on each once; all of
them share one set of buffers (weights, the recurrent and KV caches, the arena), as llama.cpp's graphs share the
model, its memory and its compute buffer. On CUDA each graph can be captured once as a CUDA graph and replayed.

A step is lean (:class:`Engine.verify`): the inputs are written into a page-locked host copy of the input buffer and
go over in one asynchronous copy; the greedy sampler's argmax (and, when asked, the top-2 logits) run on the device,
inside the CUDA graph (:class:`GreedyHead`); only those few numbers come back, in the one wait of the step. The
logits themselves are copied to the host only when asked (``hash_logits`` for ``--check``, ``keep_logits``).

Which plane holds what is tracked (:class:`Planes`): after a ubatch of ``n_t`` tokens from state position ``s0``,
conv plane p holds the state after ``s0 + max(0, n_t - p)`` tokens (planes >= n_t: the clamped pre-state), ssm plane
p the state after ``s0 + n_t - p`` tokens for p < n_t; ssm planes >= n_t were not written and are stale. Each
ubatch checks that the plane it reads holds the state of the current history at ``n_past`` in both caches
(:class:`StalePlane` otherwise: a bug). ``Settings.poison`` makes the check physical: before each ubatch every plane
but the one read is NaN and every freed KV cell is garbage, so reading anything else changes the logits.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Collection, Sequence

import numpy as np
import torch

from gdnpass import pipeline
from gdnpass.drafters import Drafter, NoDraft, accept_greedy, draft_budget
from gdnpass.errors import GdnpassError, GraphError, ResourceError
from gdnpass.ir import Graph
from gdnpass.models.hparams import MAX_RS_SEQ, MAX_UBATCH, ModelShape, VerifyConfig, default_ids, get_model
from gdnpass.models.inputs import InputWriter

KV_PAD = 256  # llama.cpp pads n_ctx and n_kv to 256 cells (llama-context.cpp, llama_kv_cache::get_n_kv)


class StalePlane(GdnpassError):
    """A ubatch was about to read a rollback plane that does not hold the current history's state (a loop bug)."""


def _pad(n: int, to: int = KV_PAD) -> int:
    return (n + to - 1) // to * to


def n_kv_for(used: int, kv_size: int) -> int:
    """llama_kv_cache::get_n_kv for one sequence: the used cells (this ubatch's included) padded to 256."""
    return min(kv_size, max(KV_PAD, _pad(used)))


def split_ubatches(n: int, n_ubatch: int, n_keep_tail: int = 0) -> list[tuple[int, int]]:
    """The ubatches (start, end) llama.cpp's ``split_equal(n_ubatch, true, n_keep_tail)`` makes of one sequence of
    ``n`` tokens: ``n_ubatch`` at a time, except that a ubatch that would leave fewer than ``n_keep_tail`` (but some)
    tokens behind takes them all when they fit, else leaves exactly ``n_keep_tail`` of them for the next one."""
    if n_keep_tail and n_ubatch <= n_keep_tail:
        raise GraphError(f"n_ubatch {n_ubatch} must be greater than n_rs_seq + 1 = {n_keep_tail} "
                         "(llama.cpp asserts n_ubatch > n_keep_tail)")
    out, i = [], 0
    while i < n:
        j = min(n, i + n_ubatch)
        if n_keep_tail and 0 < n - j < n_keep_tail:
            j = n if n - i <= n_ubatch else n - n_keep_tail
        out.append((i, j))
        i = j
    return out


# ---------------------------------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Model:
    """A whole qwen35 model: a GGUF file's (shape, tensor types and weights from the file) or a preset's (weights
    generated by :meth:`gdnpass.runtime.Executor.fill` from ``seed``, in ``wtype``)."""

    shape: ModelShape
    name: str
    gguf: object | None = None   # gdnpass.models.gguf_model.GgufModel
    wtype: str = "bf16"
    ab_wtype: str = "f32"
    seed: int = 0

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Model":
        from gdnpass.models.gguf_model import open_model

        m = open_model(path)
        return cls(m.shape, Path(path).name, gguf=m)

    @classmethod
    def preset(cls, name: str | ModelShape, wtype: str = "bf16", ab_wtype: str = "f32", seed: int = 0) -> "Model":
        shape = get_model(name)
        return cls(shape, shape.name, wtype=wtype, ab_wtype=ab_wtype, seed=seed)

    def config(self, **kw) -> VerifyConfig:
        if self.gguf is not None:
            return self.gguf.config(**kw)
        return VerifyConfig(model=self.shape, whole=True, wtype=self.wtype, ab_wtype=self.ab_wtype, **kw)

    def build(self, cfg: VerifyConfig) -> Graph:
        if self.gguf is not None:
            return self.gguf.build(cfg)
        from gdnpass.models import build_verify_graph

        return build_verify_graph(cfg)

    def describe(self) -> str:
        m = self.shape
        return (f"{self.name} ({m.n_layer} layers: GDN {m.gdn_layers}, attention {m.attn_layers}; vocab "
                f"{m.vocab_size})" + ("" if self.gguf is not None else f", generated {self.wtype} weights"))


# ---------------------------------------------------------------------------------------------------------------------
# settings, planes
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The loop's context settings (llama_context_params and the speculative parameters) and how it executes."""

    draft_max: int = 4              # K: most draft tokens per step (llama.cpp's --draft-max)
    n_rs_seq: int | None = None     # rollback planes (None: K, as llama.cpp's tools set it from draft.n_max)
    n_ubatch: int | None = None     # None: max(16, n_rs_seq + 2)
    n_ctx: int = 256                # padded to 256 (kv_size)
    flash_attn: bool = True
    device: str = "cpu"
    backend: str | dict | None = None
    fusion: bool = False
    alignment: int = 128
    between: str = "narrow"
    cuda_graphs: bool = False       # capture each graph once as a CUDA graph, replay it (device cuda)
    poison: bool = False            # NaN in every plane a ubatch must not read, garbage in freed KV cells
    check_planes: bool = True       # refuse (StalePlane) to read a plane that does not hold the current state
    margins: bool = False           # also bring each row's top-2 logit margin to the host (the divergence rule)

    @property
    def rs_seq(self) -> int:
        return self.draft_max if self.n_rs_seq is None else self.n_rs_seq

    @property
    def ubatch(self) -> int:
        return self.n_ubatch if self.n_ubatch is not None else max(16, self.rs_seq + 2)

    @property
    def kv_size(self) -> int:
        return _pad(self.n_ctx)

    def check(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise GraphError(f"generate setting {msg}")
        need(0 <= self.draft_max <= MAX_RS_SEQ, f"draft_max must be 0..{MAX_RS_SEQ} (a verify has 1..{MAX_RS_SEQ + 1} "
             f"tokens), is {self.draft_max}")
        need(0 <= self.rs_seq <= MAX_RS_SEQ, f"n_rs_seq must be 0..{MAX_RS_SEQ}, is {self.rs_seq}")
        need(self.rs_seq >= self.draft_max, f"n_rs_seq {self.rs_seq} cannot roll back {self.draft_max} rejected drafts "
             "(llama_memory_seq_rm refuses a rollback beyond n_rs_seq)")
        need(self.draft_max + 1 <= self.ubatch <= MAX_UBATCH,
             f"n_ubatch must be {self.draft_max + 1}..{MAX_UBATCH} (a verify of K + 1 tokens is one ubatch), "
             f"is {self.ubatch}")
        need(self.rs_seq == 0 or self.ubatch > self.rs_seq + 1,
             f"n_ubatch {self.ubatch} must be greater than n_rs_seq + 1 = {self.rs_seq + 1} (llama.cpp asserts it)")
        need(self.n_ctx >= 2, f"n_ctx must be >= 2, is {self.n_ctx}")
        need(not self.cuda_graphs or self.device.startswith("cuda"), "cuda_graphs needs device cuda")

    def options(self) -> pipeline.PassOptions:
        return pipeline.PassOptions(fusion=self.fusion, alignment=self.alignment, between=self.between)


class Planes:
    """What each rollback plane of the sequence's recurrent cell holds: the number of tokens of the current history
    its state comes after (conv and ssm separately), or None where it is stale (never written, or written by a
    ubatch whose tokens were later rejected and not rewritten since)."""

    def __init__(self, n_rs_seq: int) -> None:
        self.n = n_rs_seq + 1
        self.reset()

    def reset(self) -> None:
        self.conv: list[int | None] = [0] + [None] * (self.n - 1)  # a new sequence: plane 0, zeroed
        self.ssm: list[int | None] = list(self.conv)

    def require(self, r: int, pos: int) -> None:
        if not 0 <= r < self.n:
            raise StalePlane(f"plane {r} does not exist (1 + n_rs_seq = {self.n} planes)")
        if self.conv[r] != pos or self.ssm[r] != pos:
            raise StalePlane(f"a ubatch at n_past {pos} would read plane {r}, which holds conv state "
                             f"{_what(self.conv[r])} and ssm state {_what(self.ssm[r])}")

    def advance(self, s0: int, n_t: int) -> None:
        """After a ubatch of ``n_t`` tokens from the state after ``s0`` tokens."""
        self.conv = [s0 + max(0, n_t - p) for p in range(self.n)]
        self.ssm = [s0 + n_t - p if p < n_t else None for p in range(self.n)]


def _what(p: int | None) -> str:
    return "stale" if p is None else f"after {p} tokens"


# ---------------------------------------------------------------------------------------------------------------------
# the engine: a llama.cpp context of one sequence over gdnpass graphs
# ---------------------------------------------------------------------------------------------------------------------

# the inputs llama.cpp's set_input writes for every ubatch (gdnpass.models.inputs.input_values gives their values)
INPUTS = ("inp_tokens", "inp_pos", "out_ids", "attn_inp_k_idxs", "attn_inp_v_idxs", "attn_inp_kq_mask", "rs_s_copy")


def _flat(view: np.ndarray, name: str) -> np.ndarray:
    """A contiguous input's flat view (a reshape that would copy would lose the writes)."""
    if not view.flags.c_contiguous:
        raise GraphError(f"input {name!r} is not contiguous: the loop writes its inputs in place")
    return view.reshape(-1)


class GreedyHead:
    """The greedy sampler's reading of a ubatch's logits, done on the device: each output row's argmax (the first of
    equal maxima, as llama.cpp's greedy sampler and ``torch.argmax`` pick it), its largest logit (a NaN or +inf row
    is an error, not a token) and, when asked, its second largest (the top-2 margin of the divergence rule). Only
    these few numbers cross to the host, never the (rows, vocab) logits; :meth:`compute` is part of the ubatch's
    CUDA graph."""

    def __init__(self, logits: torch.Tensor, margins: bool) -> None:
        self.logits = logits  # (rows, vocab): a view of result_output
        self.margins = margins
        n, dev = logits.shape[0], logits.device
        pin = dev.type == "cuda"  # page-locked host copies: the device writes them without a staging copy
        self.ids = torch.empty(n, dtype=torch.int64, device=dev)
        self.top = torch.empty(n, 2, dtype=logits.dtype, device=dev)  # [max, second] (second only with margins)
        self.top_ids = torch.empty(n, 2, dtype=torch.int64, device=dev)
        self.ids_host = torch.empty(n, dtype=torch.int64, pin_memory=pin)
        self.top_host = torch.empty(n, 2, dtype=logits.dtype, pin_memory=pin)
        self._ids, self._top = self.ids_host.numpy(), self.top_host.numpy()  # (read through numpy: cheaper)

    def compute(self) -> None:
        torch.argmax(self.logits, dim=-1, out=self.ids)
        if self.margins:
            torch.topk(self.logits, 2, dim=-1, out=(self.top, self.top_ids))
        else:
            torch.amax(self.logits, dim=-1, out=self.top[:, 0])

    def fetch(self) -> tuple[list[int], list[float] | None, list[int]]:
        """Each row's greedy token, its top-1 minus top-2 logit in float64 (None unless asked), and the rows whose
        largest logit is not finite: two small copies, one wait."""
        self.ids_host.copy_(self.ids, non_blocking=True)
        self.top_host.copy_(self.top, non_blocking=True)
        if self.ids.device.type == "cuda":
            torch.cuda.current_stream(self.ids.device).synchronize()
        top = self._top.astype(np.float64)
        bad = np.flatnonzero(~np.isfinite(top[:, 0])).tolist()
        margins = (top[:, 0] - top[:, 1]).tolist() if self.margins else None
        return self._ids.tolist(), margins, bad


@dataclass
class Slot:
    """One cached graph: width n_t, KV bucket n_kv, n_out rows of logits (n_t for a verify, 0 for a prefill); bound
    to the reserve plan, fused (or not) once, captured once as a CUDA graph (with its greedy head) when asked."""

    n_t: int
    n_kv: int
    n_out: int
    cfg: VerifyConfig
    graph: Graph
    executor: object
    report: object
    reallocated: bool
    writer: InputWriter              # what llama.cpp's set_input writes, for this graph
    inputs: dict[str, np.ndarray]    # input name -> the flat numpy view it is written through (host stage on CUDA)
    stage: "Stage | None"            # CUDA: the inputs' bytes on the host, copied over in one go per ubatch
    logits: object                   # the result_output tensor
    head: GreedyHead | None
    cuda_graph: object = None
    runs: int = 0


@dataclass
class Stage:
    """A page-locked host copy of a graph's input buffer: every input is written there, then bytes [lo, hi) (the
    span of the inputs llama.cpp sets) go to the device in one asynchronous copy, ordered before the graph on the
    stream, so writing the inputs never waits for the device."""

    host: torch.Tensor
    device: torch.Tensor
    lo: int
    hi: int
    copied: object  # torch.cuda.Event: the last copy out of ``host`` has been done

    def push(self) -> None:
        self.device[self.lo:self.hi].copy_(self.host[self.lo:self.hi], non_blocking=True)
        self.copied.record()


@dataclass
class Verdict:
    """What one verify ubatch hands back to the host: each row's greedy token and, when asked, its top-2 margin.
    :meth:`logits` copies the logits themselves, while they are still there (until the next ubatch)."""

    ids: list[int]
    margins: list[float] | None
    nonfinite: list[int]  # rows whose largest logit is NaN or +inf
    slot: Slot
    engine: "Engine"
    ubatch: int

    def logits(self) -> torch.Tensor:
        """A (rows, vocab) float32 copy of the logits on the CPU."""
        if self.engine.ubatches != self.ubatch:
            raise GraphError("these logits were overwritten by a later ubatch: read them before the next decode")
        return self.slot.executor.read(self.slot.logits).reshape(self.slot.n_out, self.engine.vocab)


class Engine:
    """One sequence's context: the model's buffers, the reserve plan, the cached ubatch graphs, and llama.cpp's
    memory bookkeeping (the recurrent cell's position, its pending rollback index, the used KV cells)."""

    def __init__(self, model: Model, settings: Settings = Settings()) -> None:
        settings.check()
        self.model, self.s = model, settings
        self.kv_size = settings.kv_size
        self.n_rs = settings.rs_seq
        self.options = settings.options()
        self.vocab = model.shape.vocab_size
        self.reserve = pipeline.reserve_plan(model.build(self._config(settings.ubatch, self.kv_size)), self.options)
        self.slots: dict[tuple[int, int, int], Slot] = {}
        self.shared: dict[str, torch.Tensor] = {}
        self._layout: dict[str, tuple] | None = None
        self.planes = Planes(self.n_rs)
        self.cell_pos = -1   # the recurrent cell's position: the last token its state has seen
        self.rs_idx = 0      # llama_memory_recurrent::rs_idx[seq]: the plane the next ubatch reads
        self.kv_used = 0     # KV cells 0 .. kv_used-1 hold this sequence's positions
        self.ubatches = 0
        self._synced = True  # the stream has been waited for since the last staged input copy

    def _config(self, n_t: int, n_kv: int, n_out: int | None = None) -> VerifyConfig:
        return self.model.config(n_tokens=n_t, n_rs_seq=self.n_rs, kv_size=self.kv_size, n_kv=n_kv,
                                 flash_attn=self.s.flash_attn, n_outputs=n_out)

    @property
    def n_past(self) -> int:
        return self.cell_pos + 1

    # ---- graphs ---------------------------------------------------------------------------------------------------
    def slot(self, n_t: int, n_kv: int, n_out: int | None = None) -> Slot:
        """The graph of a ubatch of ``n_t`` tokens over ``n_kv`` cells with ``n_out`` rows of logits (default: all):
        built, bound, fused and (with ``cuda_graphs``) captured the first time."""
        n_out = n_t if n_out is None else n_out
        key = (n_t, n_kv, n_out)
        if key in self.slots:
            return self.slots[key]
        from gdnpass.runtime import Executor

        cfg = self._config(n_t, n_kv, n_out)
        res = pipeline.run(self.model.build(cfg), self.options, reserve=self.reserve)
        g = res.graph
        layout = {t.name: (t.buffer, t.offset, t.nbytes) for t in g.leafs if t.buffer in ("weights", "cache")}
        shared = dict(self.shared)
        if res.binding.reallocated:  # (never for a reserve of n_ubatch tokens; then this graph has its own arena)
            shared.pop("arena", None)
        if self._layout is not None and layout != self._layout:
            raise GraphError(f"graph n_t={n_t} n_kv={n_kv} lays out weights or caches unlike the first graph")
        loading = self._layout is None and self.model.gguf is not None and self.s.device == "cpu"
        # (the weights are read one at a time through a host copy: on the CPU that copy shares the plan's memory)
        extra = {"loading a weight": self.model.gguf.load_extra_bytes(g)} if loading else None
        ex = Executor(g, device=self.s.device, backend=self.s.backend, buffers=shared or None, extra=extra)
        if self._layout is None:
            self._layout = layout
            self._init_memory(ex, g)
            self.shared = {k: ex.buffers[k] for k in ("weights", "cache", "arena") if k in ex.buffers}
        leafs = {t.name: t for t in g.leafs if t.name in INPUTS}
        stage = self._stage(ex, list(leafs.values())) if ex.device.type == "cuda" else None
        inputs = {n: _flat((ex.view_in(t, stage.host) if stage else ex.view(t)).numpy(), n) for n, t in leafs.items()}
        logits = g.find("result_output")
        head = GreedyHead(ex.view(logits).reshape(n_out, self.vocab), self.s.margins) if n_out else None
        slot = Slot(n_t, n_kv, n_out, cfg, g, ex, res.report, res.binding.reallocated, InputWriter(cfg), inputs,
                    stage, logits, head)
        self.slots[key] = slot
        if self.s.cuda_graphs:
            self._capture(slot)
        return slot

    @staticmethod
    def _stage(ex, leafs: list) -> Stage:
        where = {t.base.buffer for t in leafs}
        if where != {"input"}:
            raise GraphError(f"the graph's inputs lie in buffers {sorted(where)}, not in one input buffer")
        lo = min(t.base.offset + t.view_offs for t in leafs)
        hi = max(t.base.offset + t.view_offs + t.nbytes for t in leafs)
        dev = ex.buffers["input"]
        return Stage(torch.zeros(dev.numel(), dtype=torch.uint8, pin_memory=True), dev, lo, hi, torch.cuda.Event())

    def _forward(self, slot: Slot) -> None:
        """The device work of one ubatch: the graph's nodes, then the greedy head."""
        slot.executor.run()
        if slot.head is not None:
            slot.head.compute()

    def _capture(self, slot: Slot) -> None:
        """Capture the ubatch's device work as one CUDA graph; the caches are kept as they were (the capture's
        warm-up run, which compiles the kernels, writes them)."""
        keep = self.shared["cache"].clone()
        self._write_inputs(slot, [0] * slot.n_t, 0, 0)
        self._forward(slot)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._forward(slot)
        slot.cuda_graph = graph
        self.shared["cache"].copy_(keep)

    def _init_memory(self, ex, g: Graph) -> None:
        if self.model.gguf is None:
            ex.fill(seed=self.model.seed)  # the preset's weights (and seeded caches, zeroed below)
        else:
            ex.buffers[ex.arena].fill_(0xFF)
            self.model.gguf.load_weights(ex, g)
        for name in ("cache", "input"):
            ex.buffers[name].zero_()

    def warm(self, widths: Sequence[int], n_kv: int | None = None) -> None:
        """Build (and capture) the verify graphs of these widths ahead of time (a benchmark's warm-up)."""
        for n_t in widths:
            self.slot(n_t, n_kv or n_kv_for(n_t, self.kv_size))

    # ---- memory ---------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """A new sequence: zeroed recurrent state and KV cache, no pending rollback."""
        if "cache" in self.shared:
            self.shared["cache"].zero_()
        self.planes.reset()
        self.cell_pos, self.rs_idx, self.kv_used = -1, 0, 0

    def seq_rm(self, p0: int) -> bool:
        """``llama_memory_seq_rm(mem, 0, p0, -1)`` on the hybrid memory: the recurrent part first (it may refuse;
        then nothing changes), then the KV cells from ``p0`` on. A partial removal of the recurrent state is a
        rollback to the plane that holds the state after ``p0`` tokens: at most ``n_rs_seq`` back, single use (a
        pending rollback refuses another)."""
        if p0 <= 0:
            self.reset()
            return True
        if p0 <= self.cell_pos:
            rollback = self.cell_pos - (p0 - 1)
            if self.rs_idx != 0 or not 1 <= rollback <= self.n_rs:
                return False
            self.rs_idx, self.cell_pos = rollback, p0 - 1
        if p0 < self.kv_used:
            if self.s.poison:
                self._poison_kv(p0, self.kv_used)
            self.kv_used = p0
        return True

    def caches(self, slot: Slot | None = None) -> dict[str, torch.Tensor]:
        """name -> the view of every cache leaf (cache_r_l*, cache_s_l*, cache_k_l*, cache_v_l*)."""
        # (before any ubatch ran, e.g. after a one-token prompt's empty prefill: the width-1 graph's views)
        slot = slot or next(iter(self.slots.values()), None) or self.slot(1, n_kv_for(max(1, self.n_past),
                                                                                      self.kv_size))
        return {t.name: slot.executor.view(t) for t in slot.graph.leafs if t.name.startswith("cache_")}

    def state(self, plane: int | None = None) -> dict[str, torch.Tensor]:
        """A copy of the recurrent state in ``plane`` (default: the one the next ubatch reads) of every GDN layer:
        {cache_r_l<il>: conv row, cache_s_l<il>: ssm row}."""
        r = self.rs_idx if plane is None else plane
        return {n: v.reshape(-1, v.shape[-1])[r].detach().to("cpu", copy=True)
                for n, v in self.caches().items() if n.startswith(("cache_r_", "cache_s_"))}

    def _poison_planes(self, keep: int) -> None:
        for n, v in self.caches().items():
            if n.startswith(("cache_r_", "cache_s_")):
                rows = v.reshape(-1, v.shape[-1])
                for p in range(self.n_rs + 1):
                    if p != keep:
                        rows[p].fill_(float("nan"))

    def _poison_kv(self, c0: int, c1: int) -> None:
        """Garbage (finite: a masked cell is weighted by exactly 0) in the freed cells c0..c1-1."""
        for n, v in self.caches().items():
            if n.startswith(("cache_k_", "cache_v_")):
                flat = v.reshape(-1)
                if self.s.flash_attn or n.startswith("cache_k_"):
                    flat.view(self.kv_size, -1)[c0:c1].fill_(1000.0)
                else:  # a transposed V cache: element e of cell c at e * kv_size + c
                    flat.view(-1, self.kv_size)[:, c0:c1].fill_(1000.0)

    # ---- one ubatch -----------------------------------------------------------------------------------------------
    def _write_inputs(self, slot: Slot, tokens: Sequence[int], s0: int, plane: int) -> None:
        """What llama.cpp's set_input writes for a ubatch of sequence 0 at positions s0.. reading ``plane``."""
        if slot.stage is not None and not self._synced:
            slot.stage.copied.synchronize()  # the last ubatch's copy out of the host stage is done
        slot.writer.write(slot.inputs, tokens, s0, default_ids(slot.cfg, plane))
        if slot.stage is not None:
            slot.stage.push()
            self._synced = False

    def verify(self, tokens: Sequence[int], check: bool | None = None, logits: bool = True) -> Verdict | None:
        """``llama_decode`` of one ubatch of sequence 0, with logits for every token (``logits``) or none (a
        prefill's ubatch). It reads plane ``rs_idx`` (then 0 again, as ``s_copy`` resets it). Returns each row's
        greedy token (and top-2 margin with ``Settings.margins``); nothing else waits for the device."""
        n_t = len(tokens)
        if not 1 <= n_t <= self.s.ubatch:
            raise GraphError(f"a ubatch has 1..{self.s.ubatch} tokens, not {n_t}")
        bad = [t for t in tokens if not 0 <= int(t) < self.vocab]
        if bad:
            raise GdnpassError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})")
        s0 = self.n_past
        if s0 + n_t > self.kv_size:
            raise ResourceError(f"the context is full: {s0} + {n_t} tokens do not fit n_ctx {self.kv_size}")
        r, self.rs_idx = self.rs_idx, 0
        if self.s.check_planes if check is None else check:
            self.planes.require(r, s0)
        slot = self.slot(n_t, n_kv_for(s0 + n_t, self.kv_size), n_t if logits else 0)
        if self.s.poison:
            self._poison_planes(keep=r)
        self._write_inputs(slot, tokens, s0, r)
        if slot.cuda_graph is not None:
            slot.cuda_graph.replay()
        else:
            self._forward(slot)
        slot.runs += 1
        self.ubatches += 1
        self.planes.advance(s0, n_t)
        self.cell_pos, self.kv_used = s0 + n_t - 1, s0 + n_t
        if slot.head is None:
            return None
        verdict = Verdict(*slot.head.fetch(), slot, self, self.ubatches)
        self._synced = True  # (fetch waited for the stream: every staged copy is done)
        return verdict

    def decode(self, tokens: Sequence[int], check: bool | None = None) -> torch.Tensor:
        """:meth:`verify`, returning the (n_t, vocab) float32 logits on the CPU."""
        return self.verify(tokens, check).logits()

    def prefill(self, tokens: Sequence[int]) -> int:
        """Decode ``tokens`` in llama.cpp's ubatches, asking for no logits (as llama.cpp's prefill does); returns how
        many ubatches."""
        parts = split_ubatches(len(tokens), self.s.ubatch, self.n_rs + 1 if self.n_rs else 0)
        for a, b in parts:
            self.verify(tokens[a:b], logits=False)
        return len(parts)


# ---------------------------------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Step:
    n_t: int          # tokens verified (drafted + 1)
    drafted: int
    accepted: int
    plane: int        # the plane the next ubatch reads after the rollback (n_t - 1 - accepted)
    n_kv: int
    seconds: float
    logits_sha256: str | None = None  # of the step's (n_t, vocab) f32 logits, byte for byte (hash_logits)


@dataclass
class Result:
    prompt: list[int]
    tokens: list[int]
    steps: list[Step]
    draft_max: int
    drafter: str
    prefill_seconds: float = 0.0
    prefill_ubatches: int = 0
    seconds: float = 0.0
    stop: str = "n_predict"  # or "eog": an end-of-generation token was generated
    margins: list[float] = field(default_factory=list)       # per generated token: top-1 minus top-2 logit (margins)
    logits: list[torch.Tensor] = field(default_factory=list)  # per step (keep_logits)
    rows: list[torch.Tensor] = field(default_factory=list)    # per generated token: its logits row (keep_logits)
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # n_past -> state read next

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def accept_rate(self) -> float:
        """llama.cpp's ``n_accept / n_drafted``."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def histogram(self) -> dict[int, int]:
        h = {a: 0 for a in range(self.draft_max + 1)}
        for s in self.steps:
            if s.drafted:
                h[s.accepted] = h.get(s.accepted, 0) + 1
        return h

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else 0.0

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / len(self.steps) if self.steps else 0.0

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "tokens": self.tokens, "drafter": self.drafter, "draft_max": self.draft_max,
                "n_tokens": len(self.tokens), "n_steps": len(self.steps), "n_drafted": self.drafted,
                "n_accepted": self.accepted, "accept_rate": round(self.accept_rate, 6), "stop": self.stop,
                "accepted_per_step": [s.accepted for s in self.steps],
                "acceptance_histogram": {str(k): v for k, v in self.histogram().items()},
                "tokens_per_second": round(self.tokens_per_second, 3), "ms_per_step": round(self.ms_per_step, 4),
                "prefill": {"seconds": round(self.prefill_seconds, 6), "ubatches": self.prefill_ubatches},
                "seconds": round(self.seconds, 6),
                "steps": [{**asdict(s), "seconds": round(s.seconds, 6)} for s in self.steps],
                "margins": [round(m, 7) for m in self.margins]}


def greedy_accept(logits: torch.Tensor, draft: Sequence[int]) -> list[int]:
    """:func:`gdnpass.drafters.accept_greedy` on a verify's (n_t, vocab) logits: 1 + accepted tokens."""
    argmaxes = torch.argmax(logits, dim=-1).tolist()  # per row, the first of equal maxima
    return accept_greedy(draft, argmaxes.__getitem__)


def generate(engine: Engine, prompt: Sequence[int], drafter: Drafter | None = None, n_predict: int = 32, *,
             eog: Collection[int] = (), keep_logits: bool = False, hash_logits: bool = False,
             record_states: bool = False, progress: Callable[[int, int], None] | None = None,
             on_tokens: Callable[[list[int]], None] | None = None) -> Result:
    """Prefill ``prompt`` (but its last token), then draft / verify / accept / roll back until ``n_predict`` tokens
    or an end-of-generation token (``eog``: generation stops after it, as llama.cpp's speculative-simple stops;
    the rest of that step's tokens are dropped) — llama.cpp's speculative-simple loop with a greedy sampler.

    Per step only the rows' greedy tokens (and, with ``Settings.margins``, their top-2 margins) come to the host.
    ``hash_logits`` adds each step's logits sha256 (what ``--check`` compares), ``keep_logits`` the logits
    themselves; both copy the logits to the host, in the step's time. ``on_tokens(ids)`` gets each step's tokens as
    they are accepted (for streaming)."""
    drafter = drafter or NoDraft()
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise GdnpassError("the prompt is empty: it needs at least one token")
    if n_predict < 1:
        raise GdnpassError(f"-n must be >= 1, is {n_predict}")
    if len(prompt) + n_predict > engine.kv_size:
        raise ResourceError(f"{len(prompt)} prompt + {n_predict} generated tokens do not fit n_ctx {engine.kv_size}")
    eog = frozenset(int(t) for t in eog)
    K = engine.s.draft_max
    res = Result(prompt, [], [], K, drafter.name)
    engine.reset()
    t0 = time.perf_counter()
    res.prefill_ubatches = engine.prefill(prompt[:-1])
    if engine.s.device.startswith("cuda"):
        torch.cuda.synchronize()  # (the prefill's ubatches ask for nothing back: wait for them here, not in step 1)
    res.prefill_seconds = time.perf_counter() - t0
    history, id_last = list(prompt[:-1]), prompt[-1]
    if record_states:
        res.states[len(history)] = engine.state()
    t_loop = time.perf_counter()
    while len(res.tokens) < n_predict and res.stop != "eog":
        t0 = time.perf_counter()
        n_past = len(history)
        budget = draft_budget(K, engine.kv_size, n_past, n_predict, len(res.tokens))
        draft = [int(t) for t in drafter.draft(history, id_last, budget)][:budget]
        verdict = engine.verify([id_last, *draft])
        ids = accept_greedy(draft, verdict.ids.__getitem__)
        if any(r < len(ids) for r in verdict.nonfinite):  # (a row the step's tokens come from)
            raise GdnpassError(f"step {len(res.steps)} (n_past {n_past}): the logits of row "
                               f"{min(verdict.nonfinite)} are not finite (NaN or +inf): no token can be chosen")
        for tok in ids:
            history.append(id_last)
            id_last = tok
        if not engine.seq_rm(len(history)):
            raise GdnpassError(f"llama_memory_seq_rm refused the rollback to {len(history)} (a loop bug)")
        logits = verdict.logits() if keep_logits or hash_logits else None
        digest = hashlib.sha256(logits.numpy().tobytes()).hexdigest() if hash_logits else None
        res.steps.append(Step(len(draft) + 1, len(draft), len(ids) - 1, engine.rs_idx,
                              n_kv_for(n_past + len(draft) + 1, engine.kv_size), time.perf_counter() - t0, digest))
        if verdict.margins is not None:
            res.margins += verdict.margins[:len(ids)]
        if keep_logits:
            res.logits.append(logits)
            res.rows += [logits[i] for i in range(len(ids))]
        if record_states:
            res.states[len(history)] = engine.state()
        stop = next((i for i, tok in enumerate(ids) if tok in eog), None)
        if stop is not None:
            ids, res.stop = ids[:stop + 1], "eog"
        res.tokens += ids
        if on_tokens is not None:
            on_tokens(ids)
        if progress is not None:
            progress(len(res.tokens), n_predict)
    res.seconds = time.perf_counter() - t_loop
    return res


# ---------------------------------------------------------------------------------------------------------------------
# comparisons
# ---------------------------------------------------------------------------------------------------------------------


def differences(a: Result, b: Result) -> list[str]:
    """Where two runs differ, for fused vs unfused: tokens, the steps' widths and accepted counts, and each step's
    logits byte for byte (sha256 of the bytes, or the bytes themselves when both kept them). Empty: identical.
    Runs that recorded neither hashes nor logits cannot be compared byte for byte: that is an error, not a pass."""
    hashed = all(s.logits_sha256 is not None for r in (a, b) for s in r.steps)
    kept = len(a.logits) == len(a.steps) and len(b.logits) == len(b.steps)
    if not (hashed or kept):
        raise GdnpassError("differences: both runs need their logits recorded (generate(..., hash_logits=True) or "
                           "keep_logits=True)")
    out = []
    if a.tokens != b.tokens:
        i = first_divergence(a.tokens, b.tokens)
        out.append(f"tokens differ from token {i}")
    if [(s.n_t, s.accepted) for s in a.steps] != [(s.n_t, s.accepted) for s in b.steps]:
        out.append("steps (widths or accepted counts) differ")
    if hashed:
        for i, (x, y) in enumerate(zip(a.steps, b.steps)):
            if x.logits_sha256 != y.logits_sha256:
                out.append(f"step {i}: logits bytes differ")
                break
    if kept:
        for i, (x, y) in enumerate(zip(a.logits, b.logits)):
            if x.numpy().tobytes() != y.numpy().tobytes():
                out.append(f"step {i}: kept logits bytes differ")
                break
    return out


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length if one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Divergence:
    index: int | None        # first differing token (None: identical)
    margins: tuple[float, float] = (0.0, 0.0)  # both runs' top-2 margins at that token
    tolerance: float = 0.0

    @property
    def ok(self) -> bool:
        """Identical, or the two runs part where both saw a near tie (top-2 margin below the tolerance)."""
        return self.index is None or max(self.margins) < self.tolerance

    def __str__(self) -> str:
        if self.index is None:
            return "identical"
        return (f"first divergence at token {self.index}: top-2 margins {self.margins[0]:.3g} / {self.margins[1]:.3g} "
                f"{'<' if self.ok else '>='} tolerance {self.tolerance:.3g}")


def divergence(a_tokens: Sequence[int], a_margins: Sequence[float], b_tokens: Sequence[int],
               b_margins: Sequence[float], tolerance: float) -> Divergence:
    """The divergence rule: identical tokens up to the first divergence; at it, both runs' top-2 logit margins must
    be below ``tolerance`` (if logits differ by at most d, a divergence needs margins <= 2d: anything else is a
    bug). Token lists of different lengths are compared on their common prefix."""
    n = min(len(a_tokens), len(b_tokens))
    i = first_divergence(a_tokens[:n], b_tokens[:n])
    if i is None:
        return Divergence(None, tolerance=tolerance)
    if len(a_margins) <= i or len(b_margins) <= i:
        raise GdnpassError(f"divergence at token {i}: a run has no top-2 margin there (run it with "
                           "Settings(margins=True))")
    return Divergence(i, (float(a_margins[i]), float(b_margins[i])), tolerance)


def state_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max |a - b| / max |b| over the layers' recurrent states."""
    num = max(float((a[k].double() - b[k].double()).abs().max()) for k in b)
    den = max(float(b[k].double().abs().max()) for k in b)
    return num / den if den else num


__all__ = ["Divergence", "Engine", "GreedyHead", "Model", "Planes", "Result", "Settings", "StalePlane", "Step",
           "Verdict", "differences",
           "divergence", "first_divergence", "generate", "greedy_accept", "n_kv_for", "split_ubatches",
           "state_difference"]
