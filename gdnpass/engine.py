"""A llama.cpp context of one or several sequences over gdnpass graphs: the engine the speculative loop
(:mod:`gdnpass.generate`) decodes its ubatches with.

Memory is planned as llama.cpp plans it: one reserve plan of the worst-case graph (``n_ubatch`` tokens of every
sequence, every KV cell), and each ubatch graph bound to it slot by slot (:func:`gdnpass.pipeline.run` with
``reserve``). Graphs are cached per (width n_t, KV bucket n_kv: llama.cpp pads the used cells to 256, rows of
logits, the ubatch's sequences), the pass runs on each once; all of them share one set of buffers (weights, the
recurrent and KV caches, the arena), as llama.cpp's graphs share the model, its memory and its compute buffer; the
weights buffer is the model's (:meth:`Model.weights`), shared by every context of the model, the MTP head's
included. On CUDA each graph can be captured once as a CUDA graph and replayed.

Several sequences (``Settings.n_seqs``, llama.cpp's ``n_seq_max``) each have a recurrent cell (its 1 + n_rs_seq
planes) and a KV stream (llama.cpp's default, not ``kv_unified``). A batch of their tokens is split into ubatches
as llama.cpp's ``split_equal`` splits it (:func:`split_equal`): equal token counts per sequence, consecutive
sequence ids; each sequence of a ubatch reads its own plane and writes its own cell and stream
(:meth:`Engine.decode_batch`).

A ubatch is lean (:meth:`Engine.verify`, :meth:`Engine.decode_batch`): the inputs are written into a page-locked
host copy of the input buffer and go over in one asynchronous copy; the greedy sampler's argmax (and, when asked,
the top-2 logits) run on the device, inside the CUDA graph (:class:`GreedyHead`); only those few numbers come back,
in the one wait of the step (a batch of several ubatches queues them all, then waits once). The logits themselves
are copied to the host only when asked (:meth:`Verdict.logits`). :meth:`Engine.launch` queues a ubatch without
waiting at all, leaving its greedy head's outputs on the device; inputs that are on the device already (hidden-state
rows, a draft's token ids: ``h`` as a torch tensor, ``on_device``) are copied there, behind the staged copy.

The memory bookkeeping is llama.cpp's, per sequence (:class:`SeqMemory`): ``llama_memory_seq_rm``
(:meth:`Engine.seq_rm`) makes the recurrent memory remember ``rs_idx[seq] = cell.pos - (p0 - 1)``, the plane the
sequence's next ubatch reads through ``rs_s_copy`` (once), and frees its KV cells from ``p0`` on. Which plane holds
what is tracked (:class:`Planes`): after a ubatch of ``n_t`` tokens from
state position ``s0``, conv plane p holds the state after ``s0 + max(0, n_t - p)`` tokens (planes >= n_t: the
clamped pre-state), ssm plane p the state after ``s0 + n_t - p`` tokens for p < n_t; ssm planes >= n_t were not
written and are stale. Each ubatch checks that the plane each of its sequences reads holds the state of its
current history at its ``n_past`` in both caches (:class:`StalePlane` otherwise: a bug). ``Settings.poison`` makes
the check physical: before each ubatch every plane of its sequences' cells but the one read is NaN and every freed
KV cell is garbage, so reading anything else changes the logits.

With ``Settings.mtp`` the engine is an MTP context instead (``LLAMA_CONTEXT_TYPE_MTP``, docs/mtp.md): the MTP head's
graphs over a KV cache of the MTP block alone (no recurrent memory, so ``seq_rm`` frees any tail and no plane is
tracked), each ubatch taking the hidden-state rows paired with its tokens. Every ubatch's ``h_nextn`` rows, the
trunk's or the head's, are at hand where they are (:meth:`Engine.h_rows`): what an MTP drafter pairs its tokens
with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from gdnpass import pipeline
from gdnpass.errors import GdnpassError, GraphError, ResourceError
from gdnpass.ir import Graph
from gdnpass.models.fill import fill
from gdnpass.models.hparams import (MAX_RS_SEQ, MAX_SEQS, MAX_UBATCH, ModelShape, VerifyConfig, default_ids,
                                    get_model)
from gdnpass.models.inputs import InputWriter

Rows = np.ndarray | torch.Tensor  # hidden-state rows: on the host, or where the engine runs (a torch tensor)

KV_PAD = 256  # llama.cpp pads n_ctx and n_kv to 256 cells (llama-context.cpp, llama_kv_cache::get_n_kv)


class StalePlane(GdnpassError):
    """A ubatch was about to read a rollback plane that does not hold the current history's state (a loop bug)."""


def _pad(n: int, to: int = KV_PAD) -> int:
    return (n + to - 1) // to * to


def n_kv_for(used: int, kv_size: int) -> int:
    """llama_kv_cache::get_n_kv for one sequence: the used cells (this ubatch's included) padded to 256."""
    return min(kv_size, max(KV_PAD, _pad(used)))


@dataclass(frozen=True)
class Part:
    """One ubatch of a batch: ``n_t`` tokens of each of the sequences ``seq0 .. seq0 + n_seqs - 1``, from token
    ``starts[j]`` of sequence ``seq0 + j``'s own list on."""

    seq0: int
    n_t: int
    starts: tuple[int, ...]

    @property
    def n_seqs(self) -> int:
        return len(self.starts)

    @property
    def seqs(self) -> range:
        return range(self.seq0, self.seq0 + self.n_seqs)


def split_equal(batch: Sequence[tuple[int, int]], n_ubatch: int, n_keep_tail: int = 0) -> list[Part]:
    """The ubatches llama.cpp's ``llama_batch_allocr::split_equal(n_ubatch, sequential = true, n_keep_tail)`` makes
    of a batch, called until the batch is used up (``llama_memory_hybrid::init_batch`` with a KV stream per
    sequence). ``batch``: (sequence id, tokens) in increasing id order, one sequence's tokens after another's.

    Each ubatch takes, from the first sequence with tokens left, the run of consecutive ids after it (a sequential
    split accepts only ``last + 1``; at most ``n_ubatch + 1`` sequences), then one token of each in turn while every
    one has tokens left and ``(taken + 1) * n_seqs <= n_ubatch``: equal counts, the shortest sequence's. With
    ``n_keep_tail`` (n_rs_seq + 1) it keeps the longest prefix of those sequences that either finish or leave at
    least ``n_keep_tail`` tokens (a sequence's last 1 + n_rs_seq tokens are never split); when the first one
    already fails, it goes alone: completed when that fits ``n_ubatch``, else cut to leave exactly ``n_keep_tail``.
    So sequences of unequal length share a ubatch only as far as equal counts allow (a verify batch of drafts of
    different lengths becomes several ubatches), and a sequence missing from the batch breaks the run."""
    if n_keep_tail and n_ubatch <= n_keep_tail:
        raise GraphError(f"n_ubatch {n_ubatch} must be greater than n_rs_seq + 1 = {n_keep_tail} "
                         "(llama.cpp asserts n_ubatch > n_keep_tail)")
    total = {s: n for s, n in batch if n > 0}
    used = dict.fromkeys(total, 0)
    out = []
    while True:
        left = [s for s in total if used[s] < total[s]]
        if not left:
            return out
        run = [left[0]]
        for s in left[1:]:
            if s != run[-1] + 1 or len(run) > n_ubatch:
                break
            run.append(s)
        rest = lambda k: total[run[k]] - used[run[k]] - take  # noqa: E731 (tokens sequence k would leave)
        take = 0
        while all(rest(k) > 0 for k in range(len(run))):
            take += 1
            if (take + 1) * len(run) > n_ubatch:
                break
        takes = [take] * len(run)
        if n_keep_tail:
            keep = 0
            while keep < len(run) and not 0 < rest(keep) < n_keep_tail:
                keep += 1
            if keep == 0:  # the first sequence alone: to its end when that fits, else leaving n_keep_tail
                r = rest(0)
                takes[0] = take + r if take + r <= n_ubatch else take + r - n_keep_tail
                keep = 1
            run, takes = run[:keep], takes[:keep]
        # (the first sequence alone may take more than the others' equal share: it is then alone)
        out.append(Part(run[0], takes[0], tuple(used[s] for s in run)))
        for s, t in zip(run, takes):
            used[s] += t


def split_ubatches(n: int, n_ubatch: int, n_keep_tail: int = 0) -> list[tuple[int, int]]:
    """:func:`split_equal` of one sequence of ``n`` tokens, as (start, end): ``n_ubatch`` at a time, except that a
    ubatch that would leave fewer than ``n_keep_tail`` (but some) tokens behind takes them all when they fit, else
    leaves exactly ``n_keep_tail`` of them for the next one."""
    return [(p.starts[0], p.starts[0] + p.n_t) for p in split_equal([(0, n)], n_ubatch, n_keep_tail)]


# ---------------------------------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class ModelWeights:
    """A model's weights buffer on one device (llama.cpp's model buffer): every tensor the model's graphs read, the
    trunk's and, when the model has an MTP head, the head's, each at one offset (:meth:`Model.weights`), so that every
    context of the model (the target's and the MTP head's, fusion off and on) binds the same bytes. The first
    context's executor allocates it (its memory check counts it); each weight is loaded once, by the first context
    whose graph reads it."""

    offsets: dict[str, int]  # tensor name -> its offset
    nbytes: dict[str, int]   # tensor name -> its size
    size: int
    buffer: torch.Tensor | None = None
    loaded: set[str] = field(default_factory=set)

    def place(self, graph: Graph) -> Graph:
        """Give ``graph``'s weights their offsets in this buffer (``Graph.placed``: the planner keeps them)."""
        for t in graph.leafs:
            if t.buffer == "weights" and t.view_src is None:
                if self.nbytes.get(t.name) != t.nbytes:
                    raise GraphError(f"weight {t.name!r} ({t.nbytes} bytes) is not one the model's weights buffer "
                                     "holds (its layout is of the trunk's and the MTP head's graphs)")
                t.offset = self.offsets[t.name]
        graph.placed["weights"] = self.size
        return graph


@dataclass
class Model:
    """A whole qwen35 model: a GGUF file's (shape, tensor types and weights from the file) or a preset's (weights
    generated by :func:`gdnpass.models.fill.fill` from ``seed``, in ``wtype``). Its weights live in one buffer per
    device that all its contexts share (:meth:`weights`)."""

    shape: ModelShape
    name: str
    gguf: object | None = None   # gdnpass.models.gguf_model.GgufModel
    wtype: str = "bf16"
    ab_wtype: str = "f32"
    seed: int = 0
    _weights: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Model":
        from gdnpass.models.gguf_model import open_model

        m = open_model(path)
        return cls(m.shape, Path(path).name, gguf=m)

    @classmethod
    def preset(cls, name: str | ModelShape, wtype: str = "bf16", ab_wtype: str = "f32", seed: int = 0) -> "Model":
        shape = get_model(name)
        return cls(shape, shape.name, wtype=wtype, ab_wtype=ab_wtype, seed=seed)

    def config(self, mtp: bool = False, **kw) -> VerifyConfig:
        """A ubatch of the trunk, or with ``mtp`` of the MTP head (refused, naming the file, without an MTP block)."""
        if self.gguf is not None:
            return self.gguf.mtp_config(**kw) if mtp else self.gguf.config(**kw)
        return VerifyConfig(model=self.shape, whole=True, mtp=mtp, wtype=self.wtype, ab_wtype=self.ab_wtype, **kw)

    def build(self, cfg: VerifyConfig) -> Graph:
        if self.gguf is not None:
            return self.gguf.build(cfg)
        from gdnpass.models import build_verify_graph

        return build_verify_graph(cfg)

    def weights(self, device: str, alignment: int) -> ModelWeights:
        """The model's weights buffer on ``device`` (at ``alignment``), which every context of the model shares. Its
        layout: every weight the trunk's graphs read, in their leaf order (the trunk's own packing), then those of
        the MTP head's graph that the trunk's lack (its block: the embedding and lm head are the trunk's tensors)."""
        from gdnpass.alloc import _align
        from gdnpass.runtime import canonical_device

        key = (canonical_device(device), alignment)
        if key in self._weights:
            return self._weights[key]
        graphs = [self.build(self.config(n_tokens=1))]
        if self.shape.nextn_predict_layers == 1:
            try:
                graphs.append(self.build(self.config(mtp=True, n_tokens=1)))
            except GdnpassError:  # (an MTP block stripped from the file: the trunk runs; the drafter refuses by name)
                pass
        offsets: dict[str, int] = {}
        nbytes: dict[str, int] = {}
        end = 0
        for g in graphs:
            for t in g.leafs:
                if t.buffer == "weights" and t.view_src is None and t.name not in offsets:
                    offsets[t.name], nbytes[t.name] = end, t.nbytes
                    end = _align(end + t.nbytes, alignment)
        w = self._weights[key] = ModelWeights(offsets, nbytes, end)
        return w

    def describe(self) -> str:
        m = self.shape
        return (f"{self.name} ({m.n_layer} layers: GDN {m.gdn_layers}, attention {m.attn_layers}; vocab "
                f"{m.vocab_size}); " + (f"weights {self.gguf.weights_summary()}" if self.gguf is not None
                                        else f"generated {self.wtype} weights"))


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
    mtp: bool = False               # the MTP context (LLAMA_CONTEXT_TYPE_MTP): the head's graphs, a KV cache only
    n_seqs: int = 1                 # sequences (llama_context_params.n_seq_max): a recurrent cell and a KV stream each

    @property
    def rs_seq(self) -> int:
        return self.draft_max if self.n_rs_seq is None else self.n_rs_seq

    @property
    def ubatch(self) -> int:
        """n_ubatch; by default 16, or more where n_rs_seq + 2 (llama.cpp asserts n_ubatch > n_rs_seq + 1) or every
        sequence's K + 1 verify tokens (one ubatch per step when every draft is full) need it."""
        if self.n_ubatch is not None:
            return self.n_ubatch
        return min(MAX_UBATCH, max(16, self.rs_seq + 2, self.n_seqs * (self.draft_max + 1)))

    @property
    def kv_size(self) -> int:
        """KV cells of each sequence's stream: llama.cpp's n_ctx_seq (n_ctx padded to 256, shared by the
        n_seq_max streams, each padded to 256)."""
        return _pad(_pad(self.n_ctx) // self.n_seqs)

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
        need(not self.mtp or self.rs_seq == 0, "mtp: the MTP context has no recurrent memory, so n_rs_seq must be 0 "
             "(common_speculative_init_result sets it so)")
        need(1 <= self.n_seqs <= MAX_SEQS, f"n_seqs must be 1..{MAX_SEQS} (llama.cpp's LLAMA_MAX_SEQ), is "
             f"{self.n_seqs}")
        need(not self.mtp or self.n_seqs == 1, "mtp: the MTP context decodes one sequence")

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

# the inputs llama.cpp's set_input writes for every ubatch (gdnpass.models.inputs.input_values gives their values);
# the MTP head's token ids are an unnamed leaf (graph.meta["token_input"]), and its hidden-state rows the caller's
INPUTS = ("inp_tokens", "inp_pos", "out_ids", "attn_inp_k_idxs", "attn_inp_v_idxs", "attn_inp_kq_mask", "rs_s_copy",
          "mtp_h_input")


def output_node(g: Graph, name: str):
    """The node named ``name``, or the fused node that replaced it (it writes the same bytes)."""
    for t in g.nodes:
        if t.name == name or name in t.op_params.get("replaced", ()):
            return t
    raise GraphError(f"no node named {name!r} (nor a fused node replacing it) in the graph")


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
        self.start()
        if self.ids.device.type == "cuda":
            torch.cuda.current_stream(self.ids.device).synchronize()
        return self.read()

    def start(self) -> None:
        """The two small copies to the host, queued on the stream (:meth:`read` them once it has been waited for)."""
        self.ids_host.copy_(self.ids, non_blocking=True)
        self.top_host.copy_(self.top, non_blocking=True)

    def read(self) -> tuple[list[int], list[float] | None, list[int]]:
        """What :meth:`fetch` returns, from copies :meth:`start` queued and the stream has finished."""
        top = self._top.astype(np.float64)
        bad = np.flatnonzero(~np.isfinite(top[:, 0])).tolist()
        margins = (top[:, 0] - top[:, 1]).tolist() if self.margins else None
        return self._ids.tolist(), margins, bad


@dataclass
class Slot:
    """One cached graph: width n_t (tokens of each sequence), KV bucket n_kv, n_out rows of logits (every row for a
    verify, 0 for a prefill), sequences seq0 .. seq0 + n_seqs - 1; bound to the reserve plan, fused (or not) once,
    captured once as a CUDA graph (with its greedy head) when asked."""

    n_t: int
    n_kv: int
    n_out: int
    seq0: int
    n_seqs: int
    cfg: VerifyConfig
    graph: Graph
    executor: object
    report: object
    reallocated: bool
    writer: InputWriter              # what llama.cpp's set_input writes, for this graph
    inputs: dict[str, np.ndarray]    # input name -> the flat numpy view it was last written through (on CUDA: of a
                                     # host copy of the stage)
    stage: "Stage | None"            # CUDA: the inputs' bytes on the host, copied over in one go per ubatch
    on_device: dict[str, torch.Tensor]  # input name -> its flat torch view in the graph's memory (what stays on the
                                        # device is copied there: the MTP head's hidden-state rows, drafted tokens)
    logits: object                   # the result_output tensor
    h: object                        # the h_nextn tensor [n_embd, n_t] (every row: what an MTP head reads)
    head: GreedyHead | None
    cuda_graph: object = None
    runs: int = 0


STAGE_RING = 2 * (MAX_RS_SEQ + 1)  # most host copies of one graph's inputs in flight (the MTP head's draft steps)


@dataclass
class Stage:
    """Page-locked host copies of a graph's input buffer: every input is written into one, then its bytes [lo, hi)
    (the span of the inputs llama.cpp sets) go to the device in one asynchronous copy, ordered before the graph on
    the stream, so writing the inputs never waits for the device. A copy still in flight is not written again: the
    next free one is taken, a new one made when none is (a ring that grows to as many ubatches of this graph as are
    queued without a wait, as the MTP head's draft steps are), up to STAGE_RING."""

    device: torch.Tensor
    lo: int
    hi: int
    views: Callable[[torch.Tensor], dict[str, np.ndarray]]  # a host copy -> its inputs' flat numpy views
    ring: list[tuple[torch.Tensor, dict[str, np.ndarray], object]] = field(default_factory=list)  # (+ its Event)
    at: int = -1

    def take(self) -> dict[str, np.ndarray]:
        """The views of a host copy free to be written: the next one in the ring whose copy is done (asked, not
        waited for), else a new one, else (the ring full) the next one once its copy is done."""
        nxt = (self.at + 1) % len(self.ring) if self.ring else 0
        if not self.ring or not self.ring[nxt][2].query():
            if len(self.ring) < STAGE_RING:
                host = torch.zeros(self.device.numel(), dtype=torch.uint8, pin_memory=True)
                self.ring.insert(nxt, (host, self.views(host), torch.cuda.Event()))  # (before the oldest)
            else:
                self.ring[nxt][2].synchronize()
        self.at = nxt
        return self.ring[nxt][1]

    def push(self) -> None:
        """Copy the host copy :meth:`take` gave to the device, asynchronously."""
        host, _, copied = self.ring[self.at]
        self.device[self.lo:self.hi].copy_(host[self.lo:self.hi], non_blocking=True)
        copied.record()


@dataclass
class Verdict:
    """What one verify hands back to the host for one sequence: each of its rows' greedy token and, when asked, its
    top-2 margin. :meth:`logits` copies the logits themselves, while they are still there (until the next ubatch),
    or gives the copy made when the ubatch ran (``Engine.decode_batch(..., keep_logits=True)``)."""

    ids: list[int]
    margins: list[float] | None
    nonfinite: list[int]  # rows whose largest logit is NaN or +inf
    slot: Slot
    engine: "Engine"
    ubatch: int
    rows: slice | None = None          # this sequence's rows of the ubatch's logits (None: all)
    kept: torch.Tensor | None = None   # its logits, copied when the ubatch ran

    @staticmethod
    def joined(parts: Sequence["Verdict"]) -> "Verdict":
        """One sequence's verdicts of consecutive ubatches as one (its logits only if every part kept them: the
        earlier ubatches' are overwritten)."""
        rows = [0]
        for v in parts:
            rows.append(rows[-1] + len(v.ids))
        kept = torch.cat([v.kept for v in parts]) if all(v.kept is not None for v in parts) else None
        return Verdict([i for v in parts for i in v.ids],
                       None if parts[0].margins is None else [m for v in parts for m in v.margins],
                       [r0 + r for v, r0 in zip(parts, rows) for r in v.nonfinite], parts[-1].slot, parts[-1].engine,
                       parts[0].ubatch, parts[-1].rows, kept)

    def logits(self) -> torch.Tensor:
        """A (rows, vocab) float32 copy of the logits on the CPU."""
        if self.kept is not None:
            return self.kept
        if self.engine.ubatches != self.ubatch:
            raise GraphError("these logits were overwritten by a later ubatch: read them before the next decode")
        rows = self.slot.executor.read(self.slot.logits).reshape(self.slot.n_out, self.engine.vocab)
        return rows if self.rows is None else rows[self.rows]


@dataclass
class SeqMemory:
    """llama.cpp's memory bookkeeping of one sequence: its recurrent cell's position (the last token its state has
    seen), its pending rollback index (``llama_memory_recurrent::rs_idx[seq]``: the plane its next ubatch reads),
    the used cells of its KV stream (cells 0 .. kv_used - 1 hold its positions) and what its planes hold."""

    planes: Planes
    cell_pos: int = -1
    rs_idx: int = 0
    kv_used: int = 0

    @property
    def n_past(self) -> int:
        return self.cell_pos + 1


class Engine:
    """A context of ``Settings.n_seqs`` sequences: the model's buffers, the reserve plan, the cached ubatch graphs,
    and llama.cpp's memory bookkeeping of each sequence (:class:`SeqMemory`: sequence s has recurrent cell s and KV
    stream s, as a context of n_seq_max sequences with a KV stream each gives them when their first ubatches come in
    sequence order). :meth:`decode_batch` is ``llama_decode`` of a batch of several sequences' tokens (split into
    ubatches as llama.cpp's split_equal splits it); :meth:`verify` / :meth:`prefill` / :meth:`seq_rm` without a
    sequence are sequence 0's. Every engine of a model reads the model's weights buffer on its device
    (:meth:`Model.weights`), as llama.cpp's contexts share their model: none loads a copy of its own."""

    def __init__(self, model: Model, settings: Settings = Settings()) -> None:
        settings.check()
        self.model, self.s = model, settings
        self.kv_size = settings.kv_size
        self.n_rs = settings.rs_seq
        self.n_seqs = settings.n_seqs
        self.options = settings.options()
        self.vocab = model.shape.vocab_size
        self.recurrent = not settings.mtp  # the MTP context's memory is a plain KV cache (llama.cpp: no rs planes)
        # llama_context::sched_reserve: n_ubatch tokens rounded up to a multiple of n_seq_max, every sequence, every
        # KV cell
        n_t = -(-settings.ubatch // self.n_seqs)
        self.weights = model.weights(settings.device, settings.alignment)  # (the model's: shared by its contexts)
        self.reserve = pipeline.reserve_plan(self._build(self._config(n_t, self.kv_size, None, 0, self.n_seqs)),
                                             self.options)
        self.slots: dict[tuple[int, int, int, int, int], Slot] = {}
        self.shared: dict[str, torch.Tensor] = {}
        self._layout: dict[str, tuple] | None = None
        self.mem = [SeqMemory(Planes(self.n_rs)) for _ in range(self.n_seqs)]
        self.ubatches = 0
        self._last: Slot | None = None  # the last ubatch's graph (its h_nextn rows are readable until the next)
        self._pool = None  # the CUDA graphs' memory pool (_capture)

    def _config(self, n_t: int, n_kv: int, n_out: int | None, seq0: int, n_seqs: int) -> VerifyConfig:
        """A ubatch of ``n_t`` tokens of each of sequences seq0 .. seq0 + n_seqs - 1 (their recurrent cells, of the
        context's n_seqs, and their KV streams)."""
        seqs = {} if self.s.mtp else dict(n_seqs=n_seqs, n_seq_max=self.n_seqs, seq0=seq0, mem_size=self.n_seqs,
                                          kv_head=seq0)
        return self.model.config(mtp=self.s.mtp, n_tokens=n_t, n_rs_seq=self.n_rs, kv_size=self.kv_size, n_kv=n_kv,
                                 flash_attn=self.s.flash_attn, n_outputs=n_out, **seqs)

    def _build(self, cfg: VerifyConfig) -> Graph:
        """The graph of ``cfg``, its weights placed in the model's buffer."""
        return self.weights.place(self.model.build(cfg))

    # ---- sequence 0, the one-sequence API -------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return self.mem[0].n_past

    @property
    def rs_idx(self) -> int:
        return self.mem[0].rs_idx

    # ---- graphs ---------------------------------------------------------------------------------------------------
    def slot(self, n_t: int, n_kv: int, n_out: int | None = None, seq0: int = 0, n_seqs: int = 1) -> Slot:
        """The graph of a ubatch of ``n_t`` tokens of each of sequences seq0 .. seq0 + n_seqs - 1 over ``n_kv``
        cells with ``n_out`` rows of logits (default: all): built, bound, fused and (with ``cuda_graphs``) captured
        the first time."""
        n_out = n_t * n_seqs if n_out is None else n_out
        key = (n_t, n_kv, n_out, seq0, n_seqs)
        if key in self.slots:
            return self.slots[key]
        from gdnpass.runtime import Executor

        cfg = self._config(n_t, n_kv, n_out, seq0, n_seqs)
        res = pipeline.run(self._build(cfg), self.options, reserve=self.reserve)
        g = res.graph
        layout = {t.name: (t.buffer, t.offset, t.nbytes) for t in g.leafs if t.buffer in ("weights", "cache")}
        shared = dict(self.shared)
        if res.binding.reallocated:  # (never for a reserve of n_ubatch tokens; then this graph has its own arena)
            shared.pop("arena", None)
        if self.weights.buffer is not None:  # (the model's, which another of its contexts may have made)
            shared["weights"] = self.weights.buffer
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
        names = {**{n: n for n in INPUTS}, g.meta.get("token_input"): "inp_tokens"}
        leafs = {names[t.name]: t for t in g.leafs if t.name in names}
        stage = self._stage(ex, leafs) if ex.device.type == "cuda" else None
        inputs = {} if stage else {n: _flat(ex.view(t).numpy(), n) for n, t in leafs.items()}
        on_device = {n: ex.view(t).reshape(-1) for n, t in leafs.items() if n in ("inp_tokens", "mtp_h_input")}
        logits = g.find("result_output")
        head = GreedyHead(ex.view(logits).reshape(n_out, self.vocab), self.s.margins) if n_out else None
        slot = Slot(n_t, n_kv, n_out, seq0, n_seqs, cfg, g, ex, res.report, res.binding.reallocated,
                    InputWriter(cfg), inputs, stage, on_device, logits, output_node(g, "h_nextn"), head)
        self.slots[key] = slot
        if self.s.cuda_graphs:
            self._capture(slot)
        return slot

    @staticmethod
    def _stage(ex, leafs: dict[str, object]) -> Stage:
        where = {t.base.buffer for t in leafs.values()}
        if where != {"input"}:
            raise GraphError(f"the graph's inputs lie in buffers {sorted(where)}, not in one input buffer")
        lo = min(t.base.offset + t.view_offs for t in leafs.values())
        hi = max(t.base.offset + t.view_offs + t.nbytes for t in leafs.values())
        return Stage(ex.buffers["input"], lo, hi,
                     lambda host: {n: _flat(ex.view_in(t, host).numpy(), n) for n, t in leafs.items()})

    def _forward(self, slot: Slot) -> None:
        """The device work of one ubatch: the graph's nodes, then the greedy head."""
        slot.executor.run()
        if slot.head is not None:
            slot.head.compute()

    def _capture(self, slot: Slot) -> None:
        """Capture the ubatch's device work as one CUDA graph; the caches are kept as they were (the capture's
        warm-up run, which compiles the kernels, writes them; :func:`~gdnpass.runtime.capture_cuda_graph`)."""
        from gdnpass.runtime import capture_cuda_graph

        keep = self.shared["cache"].clone()
        rows = slot.n_t * slot.n_seqs
        self._write_inputs(slot, [0] * rows, 0, [0] * slot.n_seqs,
                           np.zeros((rows, self.model.shape.n_embd), np.float32) if self.s.mtp else None)
        # one memory pool for all of the engine's graphs: they replay one at a time on one stream, and what a capture
        # allocates is a temporary used within that replay (a product over 16 columns of an f32 or batched weight
        # runs torch's matmul; bf16 / f16 ones run the Triton GEMM, which allocates nothing), which a pool per graph
        # would hold once per graph (every input, output and head buffer is allocated before the capture)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        slot.cuda_graph = capture_cuda_graph(lambda: self._forward(slot), slot.executor.graph, pool=self._pool)
        self.shared["cache"].copy_(keep)

    def _init_memory(self, ex, g: Graph) -> None:
        """The first graph's buffers: the weights it reads that no other context of the model loaded, zeroed caches
        and inputs, poison in the arena."""
        w = self.weights
        if w.buffer is None:
            w.buffer = ex.buffers["weights"]
        reads = {t.name for t in g.leafs if t.buffer == "weights" and t.view_src is None}
        if self.model.gguf is None:
            fill(ex, seed=self.model.seed, skip=w.loaded)  # the preset's weights (and seeded caches, zeroed below)
        else:
            ex.buffers[ex.arena].fill_(0xFF)
            self.model.gguf.load_weights(ex, g, skip=w.loaded)
        w.loaded |= reads
        for name in ("cache", "input"):
            ex.buffers[name].zero_()

    def warm(self, widths: Sequence[int], n_kv: int | None = None) -> None:
        """Build (and capture) the one-sequence verify graphs of these widths ahead of time (a benchmark's
        warm-up)."""
        for n_t in widths:
            self.slot(n_t, n_kv or n_kv_for(n_t, self.kv_size))

    # ---- memory ---------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """New sequences: zeroed recurrent states and KV caches, no pending rollback."""
        if "cache" in self.shared:
            self.shared["cache"].zero_()
        self.mem = [SeqMemory(Planes(self.n_rs)) for _ in range(self.n_seqs)]

    def seq_rm(self, p0: int, seq: int = 0) -> bool:
        """``llama_memory_seq_rm(mem, seq, p0, -1)`` on the hybrid memory: the recurrent part first (it may refuse;
        then nothing changes), then the KV cells from ``p0`` on. A partial removal of the recurrent state is a
        rollback to the plane that holds the state after ``p0`` tokens: at most ``n_rs_seq`` back, single use (a
        pending rollback refuses another). ``p0 <= 0`` clears the sequence (a zeroed state, no cells)."""
        m = self.mem[seq]
        if p0 <= 0:
            self._zero_cell(seq)
            self.mem[seq] = SeqMemory(Planes(self.n_rs))
            return True
        if not self.recurrent:  # a KV cache alone: any tail goes
            m.cell_pos = min(m.cell_pos, p0 - 1)
        elif p0 <= m.cell_pos:
            rollback = m.cell_pos - (p0 - 1)
            if m.rs_idx != 0 or not 1 <= rollback <= self.n_rs:
                return False
            m.rs_idx, m.cell_pos = rollback, p0 - 1
        if p0 < m.kv_used:
            if self.s.poison:
                self._poison_kv(seq, p0, m.kv_used)
            m.kv_used = p0
        return True

    def caches(self, slot: Slot | None = None) -> dict[str, torch.Tensor]:
        """name -> the view of every cache leaf (cache_r_l*, cache_s_l*, cache_k_l*, cache_v_l*)."""
        # (before any ubatch ran, e.g. after a one-token prompt's empty prefill: the width-1 graph's views)
        slot = slot or next(iter(self.slots.values()), None) or self.slot(1, n_kv_for(max(1, self.n_past),
                                                                                      self.kv_size))
        return {t.name: slot.executor.view(t) for t in slot.graph.leafs if t.name.startswith("cache_")}

    def _rows(self) -> dict[str, torch.Tensor]:
        """Each recurrent cache as rows: row ``plane * n_seqs + cell`` (cell = sequence)."""
        return {n: v.reshape(-1, v.shape[-1]) for n, v in self.caches().items()
                if n.startswith(("cache_r_", "cache_s_"))}

    def state(self, plane: int | None = None, seq: int = 0) -> dict[str, torch.Tensor]:
        """A copy of sequence ``seq``'s recurrent state in ``plane`` (default: the one its next ubatch reads) of
        every GDN layer: {cache_r_l<il>: conv row, cache_s_l<il>: ssm row}."""
        r = self.mem[seq].rs_idx if plane is None else plane
        return {n: rows[r * self.n_seqs + seq].detach().to("cpu", copy=True) for n, rows in self._rows().items()}

    def _zero_cell(self, seq: int) -> None:
        if "cache" in self.shared and self.recurrent:
            for rows in self._rows().values():
                rows[seq::self.n_seqs].zero_()

    def _poison_planes(self, keep: Mapping[int, int]) -> None:
        """NaN in every plane of the cells ``keep`` names (sequence -> the plane it reads) but the one it reads;
        other sequences' cells are theirs, untouched."""
        for rows in self._rows().values():
            for seq, r in keep.items():
                for p in range(self.n_rs + 1):
                    if p != r:
                        rows[p * self.n_seqs + seq].fill_(float("nan"))

    def _poison_kv(self, seq: int, c0: int, c1: int) -> None:
        """Garbage (finite: a masked cell is weighted by exactly 0) in cells c0..c1-1 of sequence ``seq``'s
        stream."""
        kv = self.kv_size
        for n, v in self.caches().items():
            if n.startswith(("cache_k_", "cache_v_")):
                flat = v.reshape(-1)
                if self.s.flash_attn or n.startswith("cache_k_"):  # rows of cells, stream after stream
                    flat.view(self.n_seqs * kv, -1)[seq * kv + c0:seq * kv + c1].fill_(1000.0)
                else:  # a transposed V cache: element e of cell c of stream s at (s * n_e + e) * kv_size + c
                    flat.view(self.n_seqs, -1, kv)[seq, :, c0:c1].fill_(1000.0)

    # ---- ubatches -------------------------------------------------------------------------------------------------
    def _write_inputs(self, slot: Slot, tokens: Sequence[int], n_past: int | Sequence[int], planes: Sequence[int],
                      h: Rows | None, on_device: Sequence[tuple[int, torch.Tensor]] = ()) -> None:
        """What llama.cpp's set_input writes for a ubatch of the slot's sequences at positions n_past.. (one per
        sequence), each reading its plane (and, for the MTP head, the hidden-state rows ``h`` paired with the
        tokens). Host values go through the stage; a torch ``h`` and the ``on_device`` token ids ((row, ids):
        rows row.. of the token input) are copied where they are, behind the staged copy on the stream."""
        if slot.stage is not None:
            slot.inputs = slot.stage.take()
        slot.writer.write(slot.inputs, tokens, n_past, default_ids(slot.cfg, planes) if self.recurrent else ())
        if isinstance(h, np.ndarray):
            slot.inputs["mtp_h_input"][...] = h.reshape(-1)
        if slot.stage is not None:
            slot.stage.push()
        if isinstance(h, torch.Tensor):
            slot.on_device["mtp_h_input"].copy_(h.reshape(-1), non_blocking=True)
        for row, ids in on_device:
            slot.on_device["inp_tokens"][row:row + len(ids)].copy_(ids, non_blocking=True)

    def _ubatch(self, part: Part, tokens: Sequence[int], logits: bool, check: bool | None,
                h: Rows | None = None, n_out: int | None = None,
                on_device: Sequence[tuple[int, torch.Tensor]] = ()) -> Slot:
        """Run one ubatch (``tokens``: its sequences' tokens, one sequence after another; ``on_device``: (row, ids)
        of rows whose ids are on the device) without waiting for it: each sequence reads its plane ``rs_idx`` (then 0
        again, as ``s_copy`` resets it) at its own positions."""
        n_t, seqs = part.n_t, part.seqs
        mems = [self.mem[s] for s in seqs]
        past = [m.n_past for m in mems]
        for s, p in zip(seqs, past):
            if p + n_t > self.kv_size:
                raise ResourceError(f"the context is full: {p} + {n_t} tokens do not fit n_ctx {self.kv_size}"
                                    + (f" of sequence {s}" if self.n_seqs > 1 else ""))
        planes = [m.rs_idx for m in mems]
        for m in mems:
            m.rs_idx = 0
        if self.recurrent and (self.s.check_planes if check is None else check):
            for m, r in zip(mems, planes):
                m.planes.require(r, m.n_past)
        rows = n_t * part.n_seqs
        slot = self.slot(n_t, max(n_kv_for(p + n_t, self.kv_size) for p in past),
                         (rows if n_out is None else n_out) if logits else 0, part.seq0, part.n_seqs)
        if self.s.poison and self.recurrent:
            self._poison_planes(dict(zip(seqs, planes)))
        self._write_inputs(slot, tokens, past[0] if len(past) == 1 else past, planes, h, on_device)
        if slot.cuda_graph is not None:
            slot.cuda_graph.replay()
        else:
            self._forward(slot)
        slot.runs += 1
        self.ubatches += 1
        self._last = slot
        for m, p in zip(mems, past):
            if self.recurrent:
                m.planes.advance(p, n_t)
            m.cell_pos, m.kv_used = p + n_t - 1, p + n_t
        return slot

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        bad = [t for t in tokens if not 0 <= int(t) < self.vocab]
        if bad:
            raise GdnpassError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})")

    def verify(self, tokens: Sequence[int], check: bool | None = None, logits: bool = True,
               h: Rows | None = None, n_out: int | None = None, seq: int = 0) -> Verdict | None:
        """``llama_decode`` of one ubatch of sequence ``seq``, with logits for every token (``logits``; ``n_out``:
        the last n_out rows only) or none (a prefill's ubatch). It reads plane ``rs_idx`` (then 0 again, as
        ``s_copy`` resets it). The MTP head (``Settings.mtp``) also takes ``h``, the (n_t, n_embd) float32
        hidden-state rows paired with the tokens (numpy on the host, or a torch tensor, copied where it is). Returns
        each row's greedy token (and top-2 margin with ``Settings.margins``); nothing else waits for the device."""
        slot = self.launch(tokens, check, logits, h, n_out, seq)
        return Verdict(*slot.head.fetch(), slot, self, self.ubatches) if slot.head is not None else None

    def launch(self, tokens: Sequence[int], check: bool | None = None, logits: bool = True, h: Rows | None = None,
               n_out: int | None = None, seq: int = 0, on_device: torch.Tensor | None = None) -> Slot:
        """:meth:`verify` without the wait: the ubatch is queued and its slot returned, whose greedy head's outputs
        (``slot.head.ids``, ``slot.head.top``) are on the device until the next ubatch of that graph. ``on_device``:
        the ids of the ubatch's last tokens (int64, on the device: a draft step's token is the step before's
        argmax), for which ``tokens`` holds placeholders."""
        n_t = len(tokens)
        if self.s.mtp != (h is not None) or h is not None and tuple(h.shape) != (n_t, self.model.shape.n_embd):
            raise GraphError(f"the MTP head's ubatch takes hidden-state rows ({n_t}, {self.model.shape.n_embd}) with "
                             "its tokens, and only the MTP head takes them")
        if not 1 <= n_t <= self.s.ubatch:
            raise GraphError(f"a ubatch has 1..{self.s.ubatch} tokens, not {n_t}")
        self._check_tokens(tokens)
        dev = [] if on_device is None else [(n_t - len(on_device), on_device)]
        return self._ubatch(Part(seq, n_t, (0,)), tokens, logits, check, h, n_out, dev)

    def decode_batch(self, batch: Mapping[int, Sequence[int]], logits: bool = True, check: bool | None = None,
                     keep_logits: bool = False, after: Callable[[], None] | None = None,
                     on_device: Mapping[int, torch.Tensor] | None = None) -> dict[int, Verdict]:
        """``llama_decode`` of one batch holding each sequence's tokens (``batch``: sequence -> its tokens, at its
        own next positions; the batch holds them in increasing sequence order, as gdnpass's loop and its llama.cpp
        referee build it), with logits for every token (``logits``) or none (a prefill). The batch is split into
        ubatches as llama.cpp splits it (:func:`split_equal` with n_keep_tail = n_rs_seq + 1), each run without
        waiting; then one wait brings back every row's greedy token. Returns sequence -> its :class:`Verdict` (none
        without logits). ``keep_logits`` copies each ubatch's logits to the host as it runs (a later ubatch of the
        batch reuses their memory); ``after()`` is called after each ubatch (e.g. to read its h_nextn rows).
        ``on_device``: sequence -> the ids of its last tokens, still on the device (int64: a model drafter's draft
        queued behind the graphs that pick it), for which its token list holds placeholders; each ubatch copies
        those of its rows into its token input there."""
        order = sorted(batch)
        if any(not 0 <= s < self.n_seqs for s in order):
            raise GraphError(f"sequence {next(s for s in order if not 0 <= s < self.n_seqs)} is not among the "
                             f"context's {self.n_seqs} (0..{self.n_seqs - 1})")
        for s in order:
            self._check_tokens(batch[s])
        parts = split_equal([(s, len(batch[s])) for s in order], self.s.ubatch, self.n_rs + 1 if self.n_rs else 0)
        ran = []  # per ubatch: part, slot, its logits kept, its number, its head's reading (None: copies queued)
        for i, part in enumerate(parts):
            toks = [int(t) for s, a in zip(part.seqs, part.starts) for t in batch[s][a:a + part.n_t]]
            dev = []  # (row of the ubatch, the device ids of its tokens there)
            for j, (s, a) in enumerate(zip(part.seqs, part.starts)):
                if on_device and s in on_device:
                    d0 = len(batch[s]) - len(on_device[s])  # (the sequence's first token on the device)
                    lo, hi = max(a, d0), min(a + part.n_t, len(batch[s]))
                    if lo < hi:
                        dev.append((j * part.n_t + lo - a, on_device[s][lo - d0:hi - d0]))
            slot = self._ubatch(part, toks, logits, check, on_device=dev)
            kept = slot.executor.read(slot.logits).reshape(slot.n_out, self.vocab) if keep_logits and logits \
                else None
            for k, (p, other, kp, n, got) in enumerate(ran):
                if logits and other is slot and got is None:  # (one graph twice: read its first run's copies)
                    self._wait()
                    ran[k] = (p, other, kp, n, other.head.read())
            if slot.head is not None and i < len(parts) - 1:
                slot.head.start()  # (queued behind the ubatch; the last ubatch's fetch waits for all)
            ran.append((part, slot, kept, self.ubatches, slot.head.fetch() if slot.head and i == len(parts) - 1
                        else None))
            if after is not None:
                after()
        if not logits:
            return {}
        out: dict[int, list[Verdict]] = {}
        for part, slot, kept, n, got in ran:
            ids, margins, bad = got if got is not None else slot.head.read()
            for j, s in enumerate(part.seqs):
                rows = slice(j * part.n_t, (j + 1) * part.n_t)
                out.setdefault(s, []).append(Verdict(ids[rows], margins[rows] if margins is not None else None,
                                                     [r - rows.start for r in bad if rows.start <= r < rows.stop],
                                                     slot, self, n, rows, kept[rows] if kept is not None else None))
        return {s: v[0] if len(v) == 1 else Verdict.joined(v) for s, v in out.items()}

    def _wait(self) -> None:
        """Wait for the device's stream (what the greedy head's fetch waits for)."""
        if self.s.device.startswith("cuda"):
            torch.cuda.current_stream(torch.device(self.s.device)).synchronize()

    def h_rows(self) -> torch.Tensor:
        """The last ubatch's ``h_nextn`` rows where they are, (n_t, n_embd) float32 (a view of the graph's memory:
        on the device, valid until the next ubatch of this context): the trunk's final-normed hidden state of every
        token (llama_set_embeddings_nextn(ctx, true, masked false) makes llama.cpp keep every row), or the MTP
        head's own. What an MTP drafter pairs its tokens with, copied device to device into its head's input."""
        slot = self._last
        if slot is None:
            raise GraphError("no ubatch has run: there are no h_nextn rows to read")
        return slot.executor.view(slot.h).reshape(slot.n_t * slot.n_seqs, self.model.shape.n_embd)

    def decode(self, tokens: Sequence[int], check: bool | None = None) -> torch.Tensor:
        """:meth:`verify`, returning the (n_t, vocab) float32 logits on the CPU."""
        return self.verify(tokens, check).logits()

    def prefill(self, tokens: Sequence[int] | Mapping[int, Sequence[int]], after=None) -> int:
        """Decode ``tokens`` (sequence 0's, or sequence -> tokens) in llama.cpp's ubatches, asking for no logits (as
        llama.cpp's prefill does); returns how many ubatches. ``after()`` is called after each ubatch (e.g. to read
        its h_nextn rows)."""
        before = self.ubatches
        self.decode_batch(tokens if isinstance(tokens, Mapping) else {0: tokens}, logits=False, after=after)
        return self.ubatches - before


__all__ = ["Engine", "GreedyHead", "KV_PAD", "Model", "Part", "Planes", "SeqMemory", "Settings", "Slot", "StalePlane",
           "Verdict", "n_kv_for", "output_node", "split_equal", "split_ubatches"]
