"""The MTP drafter: the model's own multi-token-prediction head drafting for the speculative loop (issue 35).

llama.cpp's ``common_speculative_impl_draft_mtp`` (common/speculative.cpp, pinned commit 0c1e570) for qwen35's one
MTP block, driven as ``examples/speculative-simple`` drives it, re-written from its behaviour:

* **its own context**: the head runs in an MTP context (``LLAMA_CONTEXT_TYPE_MTP``: the target's ``n_ctx``, no
  rollback planes) whose memory is a KV cache of the MTP block alone; here a second
  :class:`~gdnpass.engine.Engine` with ``Settings.mtp`` (the graphs of :func:`gdnpass.models.builder.build_mtp`);
* **process** (after every target batch, the prompt's included): the head decodes the same tokens at the same
  positions, no outputs; token k is paired with the target's ``h_nextn`` row of token k - 1, the batch's first
  token with ``pending_h`` (zeros at the start); the target's rows are kept (``verify_h``) and the last one becomes
  ``pending_h``;
* **draft** (``pos0`` = n_past): step 1 decodes the last sampled token at ``pos0`` with ``pending_h``, then each
  drafted token at ``pos0 + i`` with the head's own ``h_nextn`` output of the step before; the draft token is the
  row's argmax (llama.cpp's draft sampler is top-k 10, whose first candidate is the argmax, and ``p_min`` is 0 by
  default, so it never stops early); then the head's cache is cut back to ``pos0``
  (``llama_memory_seq_rm(ctx_dft, pos_max_tgt + 1, -1)`` before the verify);
* **accept(n)**: ``pending_h`` = the verify's row ``n`` (the target's hidden state of the last accepted token),
  and the head's cache is cut back to the new n_past, as the loop's ``llama_memory_seq_rm(ctx_dft, n_past, -1)``:
  the head keeps what ``process`` wrote for the accepted tokens.

The loop calls these hooks (:func:`gdnpass.generate.generate`: a drafter with ``needs_h`` gets ``reset``,
``process`` and ``accept``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from gdnpass.engine import Engine, Model, Settings, split_ubatches
from gdnpass.errors import GdnpassError


def has_head(model: Model) -> str | None:
    """Why ``model`` cannot draft with an MTP head (None: it can)."""
    n = model.shape.nextn_predict_layers
    if n == 1:
        return None
    what = model.gguf.path if model.gguf is not None else f"preset {model.name!r}"
    if n == 0:
        return (f"{what} has no MTP block (qwen35.nextn_predict_layers is absent or 0); write one with "
                "`python -m gdnpass.models.gguf_write PRESET FILE --mtp 1`")
    return f"{what} has {n} MTP blocks; llama.cpp's qwen35 MTP drafter runs exactly one"


class MtpDrafter:
    """Drafts with ``model``'s MTP head in its own context of the target's ``settings`` (the same n_ctx, n_ubatch,
    device, fusion, poison), no rollback planes."""

    name = "mtp"
    needs_h = True  # the loop hands it the target's h_nextn rows of every batch

    def __init__(self, model: Model, settings: Settings) -> None:
        why = has_head(model)
        if why:
            raise GdnpassError(f"--draft mtp: {why}")
        self.head = Engine(model, dataclasses.replace(settings, mtp=True, draft_max=0, n_rs_seq=0,
                                                      n_ubatch=settings.ubatch, margins=False))
        self.n_embd = model.shape.n_embd
        self.reset()

    def reset(self) -> None:
        """A new sequence: an empty head cache, ``pending_h`` zeros."""
        self.head.reset()
        self.pending = np.zeros(self.n_embd, np.float32)
        self.verify_h = np.zeros((0, self.n_embd), np.float32)

    def process(self, tokens: Sequence[int], pos0: int, h: np.ndarray) -> None:
        """The target decoded ``tokens`` at ``pos0``.. with ``h_nextn`` rows ``h`` (n, n_embd): the head decodes them
        too (in its ubatches, no outputs), token k paired with row k - 1 and the first with ``pending_h``."""
        if not len(tokens):
            return
        self._at(pos0)
        rows = np.concatenate([self.pending[None], h[:-1]])
        for a, b in split_ubatches(len(tokens), self.head.s.ubatch):
            self.head.verify(tokens[a:b], logits=False, h=rows[a:b])
        self.verify_h, self.pending = h, h[-1]

    def draft(self, history: Sequence[int], id_last: int, n_max: int) -> list[int]:
        pos0 = len(history)
        self._at(pos0)
        out: list[int] = []
        tok, h = id_last, self.pending
        for i in range(n_max):
            v = self.head.verify([tok], h=h[None], n_out=1)
            if v.nonfinite:
                raise GdnpassError(f"MTP head: the logits of draft step {i} (position {pos0 + i}) are not finite")
            tok = v.ids[0]
            out.append(tok)
            if i + 1 < n_max:
                h = self.head.h_nextn()[-1]
        self.head.seq_rm(pos0)  # the draft's own cells go before the verify (process rewrites them)
        return out

    def _at(self, pos0: int) -> None:
        """The head's cache must hold exactly the positions before ``pos0`` (what process wrote for the accepted
        tokens): a batch at ``pos0`` then sees what llama.cpp's MTP context sees."""
        if self.head.n_past != pos0:
            raise GdnpassError(f"MTP head: its cache holds {self.head.n_past} positions, the batch starts at {pos0} "
                               "(a loop bug)")

    def accept(self, n_accepted: int, n_past: int) -> None:
        """The verify accepted ``n_accepted`` drafts; the target now holds ``n_past`` positions."""
        if len(self.verify_h):
            self.pending = self.verify_h[min(n_accepted, len(self.verify_h) - 1)]
        if not self.head.seq_rm(n_past):
            raise GdnpassError(f"MTP head: llama_memory_seq_rm refused the rollback to {n_past} (a loop bug)")


__all__ = ["MtpDrafter", "has_head"]
