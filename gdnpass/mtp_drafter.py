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

Where the loop runs on the GPU, it stays there (issue 35): the hidden-state rows go device to device into the head's
input (the target's ``h_nextn`` rows, ``pending_h``, the head's own row: :meth:`gdnpass.engine.Engine.h_rows`), each
draft step's token is the step before's argmax copied on the device into the next step's token input, and the draft
reaches the verify's token input the same way (:class:`DeviceDraft`). Nothing of the head is waited for: its
ubatches are queued ahead of the verify, whose one wait brings the draft's ids to the host with the verify's
tokens, so a step has the one host round trip of an n-gram step.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from gdnpass.engine import Engine, Model, Settings, split_ubatches
from gdnpass.errors import GdnpassError
from gdnpass.models.hparams import MAX_RS_SEQ


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


@dataclasses.dataclass
class DeviceDraft:
    """A draft whose tokens are still on the device, queued behind the head's graphs that pick them: the verify
    copies them into its token input there (``Engine.decode_batch(on_device=...)``) and the host reads them
    (:meth:`tolist`) after the step's one wait, from copies queued behind them. Each draft row's largest logit
    comes along: a NaN or +inf one is an error naming the draft step. Valid until the drafter's next draft."""

    ids: torch.Tensor        # (n,) int64 where the head runs
    host_ids: torch.Tensor   # their copies on the host (page-locked on CUDA), and of each row's largest logit
    host_top: torch.Tensor
    copied: object           # torch.cuda.Event after the copies (None on the CPU: they are done)
    pos0: int

    def __len__(self) -> int:
        return self.ids.numel()

    def tolist(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()  # (after the step's wait: done already)
        bad = np.flatnonzero(~np.isfinite(self.host_top.numpy()))
        if bad.size:
            raise GdnpassError(f"MTP head: the logits of draft step {bad[0]} (position {self.pos0 + bad[0]}) are not "
                               "finite")
        return self.host_ids.tolist()


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
        dev, pin = torch.device(settings.device), settings.device.startswith("cuda")
        self.pending = torch.zeros(model.shape.n_embd, dtype=torch.float32, device=dev)  # pending_h
        self.step_h = torch.zeros(1, model.shape.n_embd, dtype=torch.float32, device=dev)  # a draft step's h_nextn
        self.verify_h: torch.Tensor | None = None  # the last target batch's rows (a view of its memory, until accept)
        # a draft's tokens and each row's largest logit, where the head runs and their host copies
        self.ids = torch.zeros(MAX_RS_SEQ, dtype=torch.int64, device=dev)
        self.top = torch.zeros(MAX_RS_SEQ, dtype=torch.float32, device=dev)
        self.host_ids = torch.zeros(MAX_RS_SEQ, dtype=torch.int64, pin_memory=pin)
        self.host_top = torch.zeros(MAX_RS_SEQ, dtype=torch.float32, pin_memory=pin)
        self.reset()

    def reset(self) -> None:
        """A new sequence: an empty head cache, ``pending_h`` zeros."""
        self.head.reset()
        self.pending.zero_()
        self.verify_h = None

    def process(self, tokens: Sequence[int], pos0: int, h: torch.Tensor) -> None:
        """The target decoded ``tokens`` at ``pos0``.. with ``h_nextn`` rows ``h`` (n, n_embd), where the target
        runs (:meth:`Engine.h_rows`): the head decodes them too (in its ubatches, no outputs, queued), token k paired
        with row k - 1 and the first with ``pending_h``. ``h`` must stay valid until :meth:`accept`."""
        if not len(tokens):
            return
        self._at(pos0)
        h = torch.as_tensor(h, device=self.pending.device)
        rows = torch.cat([self.pending[None], h[:-1]])
        for a, b in split_ubatches(len(tokens), self.head.s.ubatch):
            self.head.launch(tokens[a:b], logits=False, h=rows[a:b])
        self.verify_h = h
        self.pending.copy_(h[-1])

    def draft(self, history: Sequence[int], id_last: int, n_max: int) -> DeviceDraft | list[int]:
        """``n_max`` one-token steps of the head, queued: step i + 1's token is step i's argmax and its hidden state
        step i's ``h_nextn`` row, both copied on the device."""
        pos0 = len(history)
        self._at(pos0)
        if n_max <= 0:
            return []
        if n_max > MAX_RS_SEQ:
            raise GdnpassError(f"MTP head: a draft of {n_max} tokens; a verify takes at most {MAX_RS_SEQ}")
        tok, h = None, self.pending[None]
        for i in range(n_max):
            slot = self.head.launch([id_last if i == 0 else 0], h=h, n_out=1, on_device=tok)
            # (copied out at once: the next step may run this graph again, or capture a new one, whose warm-up run
            # overwrites the head's arena)
            self.ids[i:i + 1].copy_(slot.head.ids)
            self.top[i:i + 1].copy_(slot.head.top[:, 0])
            self.step_h.copy_(self.head.h_rows())
            tok, h = self.ids[i:i + 1], self.step_h
        self.head.seq_rm(pos0)  # the draft's own cells go before the verify (process rewrites them)
        self.host_ids[:n_max].copy_(self.ids[:n_max], non_blocking=True)
        self.host_top[:n_max].copy_(self.top[:n_max], non_blocking=True)
        copied = None
        if self.ids.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        return DeviceDraft(self.ids[:n_max], self.host_ids[:n_max], self.host_top[:n_max], copied, pos0)

    def _at(self, pos0: int) -> None:
        """The head's cache must hold exactly the positions before ``pos0`` (what process wrote for the accepted
        tokens): a batch at ``pos0`` then sees what llama.cpp's MTP context sees."""
        if self.head.n_past != pos0:
            raise GdnpassError(f"MTP head: its cache holds {self.head.n_past} positions, the batch starts at {pos0} "
                               "(a loop bug)")

    def accept(self, n_accepted: int, n_past: int) -> None:
        """The verify accepted ``n_accepted`` drafts; the target now holds ``n_past`` positions."""
        if self.verify_h is not None and len(self.verify_h):
            self.pending.copy_(self.verify_h[min(n_accepted, len(self.verify_h) - 1)])
        self.verify_h = None  # (a view of the target's memory: its next ubatch overwrites it)
        if not self.head.seq_rm(n_past):
            raise GdnpassError(f"MTP head: llama_memory_seq_rm refused the rollback to {n_past} (a loop bug)")


__all__ = ["DeviceDraft", "MtpDrafter", "has_head"]
