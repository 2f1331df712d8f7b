"""Drafters for the speculative loop (:mod:`gdnpass.generate`): who proposes the tokens a verify step checks.

A drafter is called once per step as ``draft(history, id_last, n_max)``: ``history`` is every token already in the
target's memory (the prompt but its last token, then the accepted tokens), ``id_last`` the token sampled last (the
verify's first token, not in memory yet), ``n_max`` the most tokens the loop takes; it returns up to ``n_max`` draft
tokens (possibly none: the step is then a one-token decode). These are the arguments llama.cpp's
``common_speculative_draft`` hands its implementations (``dp.prompt``, ``dp.id_last``, ``dp.n_max``) in
``examples/speculative-simple``.

* :class:`NgramSimple`: llama.cpp's n-gram prompt lookup, ``common_ngram_simple_draft`` (``common/ngram-map.cpp`` at
  the pinned commit 0c1e570), with its two parameters (``size_n`` = ``--spec-ngram-size-n``, default 12; ``size_m``
  = ``--spec-ngram-size-m``, default 48) and behaviour, re-written from its description below;
* :class:`Planted`: for tests, the true greedy continuation (from a plain decode) with one wrong token placed so
  that a chosen number of drafts is accepted at each step, and drafts of chosen lengths: every acceptance
  0..K, short drafts and one-token decodes occur where a test wants them;
* :class:`NoDraft`: never drafts (plain one-token greedy decode through the same loop).

The model's own MTP head (:class:`gdnpass.mtp_drafter.MtpDrafter`, torch) lives apart; a drafter like it, with
``needs_h``, also gets the loop's ``reset()``, ``process(tokens, pos0, h)`` and ``accept(accepted, n_past)`` hooks
(llama.cpp's ``common_speculative_process`` / ``common_speculative_accept``).

The loop's own rules live here too, once, for both loops that run them (gdnpass's :func:`gdnpass.generate.generate`
and the llama.cpp referee loop in :mod:`gdnpass.frontends.llama.worker`):

* :func:`draft_budget`: how many draft tokens a step may verify;
* :func:`accept_greedy` (with :func:`first_argmax`): which tokens a verify generates under a greedy sampler;
* :func:`ngram_defaults`: the n-gram drafter's sizes for a given K when the user names none.

No torch here: llama.cpp's worker runs in a process without torch and imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from gdnpass.errors import GdnpassError


# ---------------------------------------------------------------------------------------------------------------------
# the loop's rules (shared by gdnpass's loop and the llama.cpp referee loop)
# ---------------------------------------------------------------------------------------------------------------------


def draft_budget(draft_max: int, n_ctx: int, n_past: int, n_predict: int, n_generated: int) -> int:
    """The most draft tokens one step may verify (the drafter's ``n_max``): ``draft_max`` (K), capped so that

    * the step fits the context: the verify of ``id_last`` and d drafts fills cells ``n_past .. n_past + d``, and
      when every draft is accepted the bonus token (the next step's ``id_last``) needs cell ``n_past + d + 1``, so
      ``d <= n_ctx - n_past - 2``;
    * the step never generates past ``n_predict``: it generates ``accepted + 1 <= d + 1`` tokens, so
      ``d <= n_predict - n_generated - 1``.

    Never negative: 0 means the step is a one-token decode."""
    return max(0, min(draft_max, n_ctx - n_past - 2, n_predict - n_generated - 1))


def first_argmax(row: Sequence[float]) -> int:
    """The index of the largest value, the first one of equal maxima (as ``torch.argmax`` picks), for a row of
    finite logits in plain Python."""
    return max(range(len(row)), key=row.__getitem__)


def accept_greedy(draft: Sequence[int], row_argmax: Callable[[int], int]) -> list[int]:
    """The tokens one verify generates with a greedy sampler (``common_sampler_sample_and_accept_n``): the verify
    decoded ``[id_last, *draft]`` with logits for every row; row i's argmax is the token after row i's input. Draft i
    is accepted while row i's argmax equals it; the first row that disagrees, or the row after the last draft, gives
    one more token (the bonus). Returns ``1 + accepted`` ids; the accepted drafts are ``len(ids) - 1``.

    ``row_argmax(i)`` is row i's argmax (e.g. ``argmaxes.__getitem__`` for a list, or :func:`first_argmax` of a row
    read on demand). It is called once per row, in order, for rows ``0 .. accepted`` only, so a caller may also
    record each generated token's row (its margin, its bytes) inside it."""
    ids = []
    for i in range(len(draft) + 1):
        tok = int(row_argmax(i))
        ids.append(tok)
        if i == len(draft) or tok != int(draft[i]):
            break
    return ids


def ngram_defaults(draft_max: int) -> tuple[int, int]:
    """``(size_n, size_m)`` of :class:`NgramSimple` for K = ``draft_max`` when the user names neither:

    * ``size_m = K``: ngram-simple's draft is at most ``size_m`` tokens (llama.cpp's ``--spec-ngram-size-m`` is its
      draft maximum), and the loop takes at most K anyway;
    * ``size_n = min(12, K)``: 12 is llama.cpp's default, but a draft of ``copy <= size_m`` tokens is dropped when
      ``copy < size_n``, so ``size_n`` larger than ``size_m`` would never draft.

    Both at least 1 (K = 0 drafts nothing anyway, and the sizes must be >= 1)."""
    return max(1, min(12, draft_max)), max(1, draft_max)


# ---------------------------------------------------------------------------------------------------------------------
# drafters
# ---------------------------------------------------------------------------------------------------------------------


class Drafter(Protocol):
    name: str

    def draft(self, history: Sequence[int], id_last: int, n_max: int) -> list[int]: ...


@dataclass
class NoDraft:
    """Never drafts: every step decodes the one sampled token."""

    name: str = "none"

    def draft(self, history: Sequence[int], id_last: int, n_max: int) -> list[int]:
        return []


@dataclass
class NgramSimple:
    """llama.cpp's ``common_ngram_simple_draft``: look up the last ``size_n`` tokens (the history's last
    ``size_n - 1`` and ``id_last``) earlier in the history, newest match first, and propose the ``size_m`` tokens that
    followed it.

    What the C++ does, step by step (``tokens`` = history, ``cur_len`` its length):

    1. no draft unless ``cur_len > size_n + size_m + 1``;
    2. the pattern is ``tokens[cur_len - size_n + 1:] + [id_last]``;
    3. search start positions ``j = cur_len - size_n - 1`` down to 1 (position 0 is never a match: it stands for
       "none") for ``tokens[j:j + size_n] == pattern``; the first (newest) match wins;
    4. ``copy = min(size_m, cur_len - (j + size_n))``; no draft if ``copy < size_n``;
    5. the draft is ``tokens[j + size_n : j + size_n + copy]``.

    The loop then truncates the draft to its ``n_max`` (``common_speculative_draft`` truncates to ``dp.n_max``)."""

    size_n: int = 12
    size_m: int = 48
    name: str = "ngram"

    def __post_init__(self) -> None:
        if self.size_n < 1 or self.size_m < 1:
            raise GdnpassError(f"ngram sizes must be >= 1, are n={self.size_n}, m={self.size_m}")

    def draft(self, history: Sequence[int], id_last: int, n_max: int) -> list[int]:
        return ngram_simple_draft(self.size_n, self.size_m, history, id_last)[:max(0, n_max)]


def ngram_simple_draft(size_n: int, size_m: int, tokens: Sequence[int], sampled: int) -> list[int]:
    """``common_ngram_simple_draft(config{size_n, size_m}, tokens, sampled)`` (see :class:`NgramSimple`)."""
    cur_len = len(tokens)
    if cur_len <= size_n + size_m + 1:
        return []
    pattern = list(tokens[cur_len - size_n + 1:]) + [sampled]
    match = 0
    for j in range(cur_len - size_n - 1, 0, -1):
        if list(tokens[j:j + size_n]) == pattern:
            match = j
            break
    if match == 0:
        return []
    copy = min(size_m, cur_len - (match + size_n))
    if copy < size_n:
        return []
    return list(tokens[match + size_n: match + size_n + copy])


@dataclass
class Planted:
    """Proposes the true greedy continuation ``truth`` (the tokens a plain greedy decode generates after the prompt)
    with a mistake planted so that exactly ``accept[i]`` drafts are accepted at step i, in drafts of ``lengths[i]``
    tokens (both schedules repeat cyclically; a length is capped by the loop's ``n_max``, an acceptance by the
    length). A mistake is the true token + 1 (mod ``vocab``): never the token the model picks.

    It knows where the loop stands from the history's length: ``len(history) + 1 - n_prompt`` tokens generated so
    far, so the next true tokens are ``truth[that:]``. Past the end of ``truth`` (or after the loop has diverged from
    it) the proposals are simply wrong and accepted as the model decides."""

    truth: Sequence[int]
    n_prompt: int
    vocab: int
    accept: Sequence[int]
    lengths: Sequence[int] = ()
    name: str = "planted"
    step: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not self.accept:
            raise GdnpassError("planted drafter: the acceptance schedule is empty")
        if any(a < 0 for a in self.accept) or any(n < 0 for n in self.lengths):
            raise GdnpassError("planted drafter: acceptances and lengths must be >= 0")

    def planned(self, i: int, n_max: int) -> tuple[int, int]:
        """(draft length, accepted drafts) step ``i`` is planned to have under the loop's ``n_max``."""
        n = min(n_max, self.lengths[i % len(self.lengths)] if self.lengths else n_max)
        return n, min(n, self.accept[i % len(self.accept)])

    def draft(self, history: Sequence[int], id_last: int, n_max: int) -> list[int]:
        n, a = self.planned(self.step, n_max)
        self.step += 1
        done = len(history) + 1 - self.n_prompt
        nxt = list(self.truth[done: done + n])
        nxt += [(nxt[-1] if nxt else id_last) for _ in range(n - len(nxt))]  # past the truth: anything
        if a < n:
            nxt[a] = (nxt[a] + 1) % self.vocab
        return nxt


def cycle_schedule(k: int) -> list[int]:
    """An acceptance schedule in which every acceptance 0..k occurs: all, none, then 1 .. k-1."""
    return [k, 0, *range(1, k)] if k > 0 else [0]


def seq_schedule(schedule: Sequence[int], seq: int) -> list[int]:
    """Sequence ``seq``'s schedule among several: ``schedule`` started at its entry ``seq`` (cyclically), so that
    sequences drafting in one step accept different counts there (``gdnpass generate`` with several prompts,
    ``benchmarks/seqs_bench.py``)."""
    k = seq % len(schedule)
    return [*schedule[k:], *schedule[:k]]


def from_spec(spec: dict, n_prompt: int, vocab: int) -> Drafter:
    """A drafter from its plain description, the form llama.cpp's worker takes one in (the same drafter on both
    sides of a comparison): {"kind": "none"}, {"kind": "ngram", "size_n", "size_m"} or {"kind": "planted", "truth",
    "accept", "lengths" (optional)}, for a sequence whose prompt has ``n_prompt`` tokens."""
    kind = spec.get("kind")
    if kind == "ngram":
        return NgramSimple(spec["size_n"], spec["size_m"])
    if kind == "planted":
        return Planted(spec["truth"], n_prompt, vocab, spec["accept"], spec.get("lengths", ()))
    if kind == "none":
        return NoDraft()
    raise GdnpassError(f"drafter kind {kind!r}: expected none, ngram or planted")

