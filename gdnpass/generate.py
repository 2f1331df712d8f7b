"""The speculative loop, end to end: prefill, then draft -> verify -> accept -> roll back, until N tokens.

It runs a whole qwen35 model (a GGUF file, or a preset with generated weights) on an :class:`~gdnpass.engine.Engine`
(a llama.cpp context of one or several sequences over gdnpass graphs), as llama.cpp's
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
  ``accepted + 1`` tokens are generated; an end-of-generation token ends the loop;
* **roll back** as llama.cpp does, ``llama_memory_seq_rm(mem, seq, p0 = n_past, -1)``
  (:meth:`~gdnpass.engine.Engine.seq_rm`): the next ubatch reads plane ``n_t - 1 - accepted``.

Several sequences (:func:`generate_batch`) each do all of this on their own, in shared batches: the prompts
prefilled in one, then each step one batch of every running sequence's ``[id_last, drafts...]``, split into
ubatches as llama.cpp splits a batch (equal token counts, consecutive sequence ids), each sequence rolling back its
own cell (``llama_memory_seq_rm(mem, s, ...)``); a finished sequence leaves the batch.

A drafter with ``needs_h`` (the MTP head, :class:`gdnpass.mtp_drafter.MtpDrafter`) also gets llama.cpp's
``common_speculative_process`` / ``common_speculative_accept`` hooks: ``process(tokens, pos0, h)`` after every
target batch (the prefill's, as one batch, and each verify's) with the target's ``h_nextn`` rows of every token
(where the target runs: :meth:`~gdnpass.engine.Engine.h_rows`), and ``accept(accepted, n_past)`` after the rollback.
Its draft may still be on the device (:class:`~gdnpass.mtp_drafter.DeviceDraft`): the verify then takes those tokens
there, and the step's one wait brings them to the host.

Then the comparisons the checks and tests make of two runs: :func:`differences` (fused vs unfused, byte for byte)
and :func:`divergence` (the divergence rule, for runs whose arithmetic differs).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Collection, Sequence

import torch

from gdnpass.drafters import Drafter, NoDraft, accept_greedy, draft_budget
from gdnpass.engine import Engine
from gdnpass.errors import GdnpassError, ResourceError
from gdnpass.mtp_drafter import DeviceDraft

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
    ubatch_seqs: int = 1  # sequences in the ubatch that verified this step's tokens (several sequences' steps share)


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
    they are accepted (for streaming). :func:`generate_batch` of one sequence."""
    return generate_batch(engine, [prompt], [drafter], n_predict, eog=eog, keep_logits=keep_logits,
                          hash_logits=hash_logits, record_states=record_states, progress=progress,
                          on_tokens=(lambda seq, ids: on_tokens(ids)) if on_tokens is not None else None)[0]


@dataclass
class _Seq:
    """One sequence's place in the loop."""

    res: Result
    drafter: Drafter
    history: list[int]  # every token in the target's memory
    id_last: int        # the token sampled last (the next verify's first)
    n_predict: int

    @property
    def done(self) -> bool:
        return self.res.stop == "eog" or len(self.res.tokens) >= self.n_predict


def generate_batch(engine: Engine, prompts: Sequence[Sequence[int]], drafters: Sequence[Drafter | None],
                   n_predict: int = 32, *, eog: Collection[int] = (), keep_logits: bool = False,
                   hash_logits: bool = False, record_states: bool = False,
                   progress: Callable[[int, int], None] | None = None,
                   on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Result]:
    """:func:`generate` for several sequences at once, sequence s (``prompts[s]``, ``drafters[s]``) in the engine's
    sequence s (``Settings.n_seqs`` at least ``len(prompts)``): every prompt (but its last token) prefilled in one
    batch, then each step one batch of every running sequence's ``[id_last, drafts...]`` — its own drafts, its own
    budget — decoded with ``Engine.decode_batch`` (llama.cpp's split into ubatches: sequences with equal token counts
    and consecutive ids share one), each sequence accepting its greedy prefix and rolling back on its own
    (``llama_memory_seq_rm(mem, s, n_past_s, -1)``: its next ubatch reads its own plane). A sequence that has
    generated ``n_predict`` tokens or an end-of-generation token leaves the batch. Returns one :class:`Result` per
    sequence; a step's ``seconds`` are the whole batch step's, a result's ``seconds`` the loop's until the sequence
    finished. ``on_tokens(s, ids)`` gets sequence s's tokens of each step as they are accepted. A drafter with
    ``needs_h`` (the MTP head) drafts for one sequence only."""
    n = len(prompts)
    if n != len(drafters):
        raise GdnpassError(f"{n} prompts and {len(drafters)} drafters: one drafter per sequence")
    if not 1 <= n <= engine.n_seqs:
        raise GdnpassError(f"{n} prompts for a context of {engine.n_seqs} sequences (Settings.n_seqs)")
    prompts = [[int(t) for t in p] for p in prompts]
    drafters = [d or NoDraft() for d in drafters]
    if any(not p for p in prompts):
        raise GdnpassError("the prompt is empty: it needs at least one token" if n == 1 else
                           f"prompt {next(i for i, p in enumerate(prompts) if not p)} is empty: it needs at least one "
                           "token")
    if n_predict < 1:
        raise GdnpassError(f"-n must be >= 1, is {n_predict}")
    for p in prompts:
        if len(p) + n_predict > engine.kv_size:
            raise ResourceError(f"{len(p)} prompt + {n_predict} generated tokens do not fit n_ctx {engine.kv_size}"
                                + (" of each sequence" if engine.n_seqs > 1 else ""))
    eog = frozenset(int(t) for t in eog)
    K = engine.s.draft_max
    hooks = any(getattr(d, "needs_h", False) for d in drafters)  # a model drafter: it reads the target's h_nextn rows
    if hooks and n > 1:
        raise GdnpassError(f"drafter {drafters[0].name!r} reads the target's hidden states: it drafts for one "
                           f"sequence, not {n}")
    seqs = [_Seq(Result(p, [], [], K, d.name), d, list(p[:-1]), p[-1], n_predict) for p, d in zip(prompts, drafters)]
    engine.reset()
    if hooks:
        drafters[0].reset()
    t0 = time.perf_counter()
    h_rows: list = []  # (each ubatch's rows, copied where they are before the next ubatch reuses the memory)
    ubatches = engine.prefill({s: q.history for s, q in enumerate(seqs)},
                              after=(lambda: h_rows.append(engine.h_rows().clone())) if hooks else None)
    if hooks and h_rows:  # (llama.cpp hands the drafter the prompt's batch, whatever ubatches decoded it)
        drafters[0].process(seqs[0].history, 0, torch.cat(h_rows))
    if engine.s.device.startswith("cuda"):
        torch.cuda.synchronize()  # (the prefill's ubatches ask for nothing back: wait for them here, not in step 1)
    prefill = time.perf_counter() - t0
    for s, q in enumerate(seqs):
        q.res.prefill_seconds, q.res.prefill_ubatches = prefill, ubatches
        if record_states:
            q.res.states[len(q.history)] = engine.state(seq=s)
    t_loop = time.perf_counter()
    total = n * n_predict
    while any(not q.done for q in seqs):
        t0 = time.perf_counter()
        running = [s for s, q in enumerate(seqs) if not q.done]
        drafts = {}
        for s in running:
            q = seqs[s]
            budget = draft_budget(K, engine.kv_size, len(q.history), n_predict, len(q.res.tokens))
            d = q.drafter.draft(q.history, q.id_last, budget)
            drafts[s] = d if isinstance(d, DeviceDraft) else [int(t) for t in d][:budget]  # (a device draft: n_max)
        queued = {s: d for s, d in drafts.items() if isinstance(d, DeviceDraft)}  # (its tokens on the device)
        verdicts = engine.decode_batch({s: [seqs[s].id_last, *([0] * len(drafts[s]) if s in queued else drafts[s])]
                                        for s in running}, keep_logits=keep_logits or hash_logits,
                                       on_device={s: d.ids for s, d in queued.items()})
        drafts.update({s: d.tolist() for s, d in queued.items()})  # (the step's wait brought them over)
        if hooks:
            drafters[0].process([seqs[0].id_last, *drafts[0]], len(seqs[0].history), engine.h_rows())
        for s in running:
            q, draft, verdict = seqs[s], drafts[s], verdicts[s]
            n_past = len(q.history)
            ids = accept_greedy(draft, verdict.ids.__getitem__)
            if any(r < len(ids) for r in verdict.nonfinite):  # (a row the step's tokens come from)
                raise GdnpassError(f"{f'sequence {s} ' if n > 1 else ''}step {len(q.res.steps)} (n_past {n_past}): "
                                   f"the logits of row {min(verdict.nonfinite)} are not finite (NaN or +inf): no "
                                   "token can be chosen")
            for tok in ids:
                q.history.append(q.id_last)
                q.id_last = tok
            if not engine.seq_rm(len(q.history), seq=s):
                raise GdnpassError(f"llama_memory_seq_rm refused the rollback to {len(q.history)} (a loop bug)")
            if hooks:
                drafters[0].accept(len(ids) - 1, len(q.history))
            logits = verdict.logits() if keep_logits or hash_logits else None
            digest = hashlib.sha256(logits.numpy().tobytes()).hexdigest() if hash_logits else None
            q.res.steps.append(Step(len(draft) + 1, len(draft), len(ids) - 1, engine.mem[s].rs_idx,
                                    verdict.slot.n_kv, time.perf_counter() - t0, digest, verdict.slot.n_seqs))
            if verdict.margins is not None:
                q.res.margins += verdict.margins[:len(ids)]
            if keep_logits:
                q.res.logits.append(logits)
                q.res.rows += [logits[i] for i in range(len(ids))]
            if record_states:
                q.res.states[len(q.history)] = engine.state(seq=s)
            stop = next((i for i, tok in enumerate(ids) if tok in eog), None)
            if stop is not None:
                ids, q.res.stop = ids[:stop + 1], "eog"
            q.res.tokens += ids
            if q.done:
                q.res.seconds = time.perf_counter() - t_loop
            if on_tokens is not None:
                on_tokens(s, ids)
        if progress is not None:
            progress(sum(len(q.res.tokens) if not q.done else n_predict for q in seqs), total)
    return [q.res for q in seqs]


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


__all__ = ["Divergence", "Result", "Step", "differences", "divergence", "first_divergence", "generate",
           "generate_batch", "greedy_accept", "state_difference"]
