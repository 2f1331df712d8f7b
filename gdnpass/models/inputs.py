"""The values llama.cpp sets on a verify graph's inputs (the ``set_input`` of each llm_graph_input, llama-graph.cpp).

For a built graph (``graph.meta["config"]``), :class:`InputWriter` writes every input leaf's contents as llama.cpp
would set them for one ubatch of ``n_tokens`` tokens of sequence 0 after ``n_past`` tokens: the token ids, the
M-RoPE positions, the output rows, the KV cells the ubatch writes, the causal KQ mask, and ``rs_s_copy``
(:func:`gdnpass.models.hparams.default_ids`). The executor's fill writes them once (:func:`input_values`); the
generate loop writes them every step, into its staged input buffer, through one writer per graph (what does not
depend on the position is computed once).
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from gdnpass.ir import GraphError
from gdnpass.models.hparams import VerifyConfig, default_ids

NEG_INF = float("-inf")


class InputWriter:
    """Writes one ubatch's inputs of config ``cfg`` into flat arrays (``write``); :attr:`sizes` gives each input's
    element count."""

    def __init__(self, cfg: VerifyConfig) -> None:
        self.cfg = cfg
        n_t = self.n_t = cfg.n_tokens * cfg.n_seqs
        self.sizes = {"rs_s_copy": len(default_ids(cfg))}
        if not cfg.whole:
            return
        if cfg.n_seqs > 1:  # (positions, KV cells and the per-stream mask below are one sequence's)
            raise GraphError(f"config field 'n_seqs': the inputs of a whole forward are written for one sequence, "
                             f"not {cfg.n_seqs} (several sequences' positions, KV cells and masks: issue 37 item 4)")
        m = cfg.shape
        self.tokens = np.arange(n_t)  # token i of the ubatch sits at position n_past + i, in cell n_past + i
        self.out_ids = np.arange(n_t - cfg.outputs, n_t)  # the rows whose logits are asked for: the last
        # a transposed V cache (no flash attention), one element per row: element e of token i goes to
        # e * kv_size + its cell
        n_e = m.head_count_kv * m.value_length
        self.v_rows = self.tokens if cfg.flash_attn else \
            (self.tokens[:, None] + cfg.kv_size * np.arange(n_e)[None, :]).reshape(-1)
        # causal mask [n_kv, n_t]: token i (position n_past + i) sees cell j iff j - i <= n_past
        self.cell_minus_token = (np.arange(cfg.n_kv)[None, :] - self.tokens[:, None]).reshape(-1)
        self.sizes.update({"inp_tokens": n_t, "inp_pos": 4 * n_t, "out_ids": cfg.outputs, "attn_inp_k_idxs": n_t,
                           "attn_inp_v_idxs": self.v_rows.size, "attn_inp_kq_mask": self.cell_minus_token.size})

    def write(self, out: dict[str, np.ndarray], tokens: Sequence[int], n_past: int, ids: Sequence[int]) -> None:
        """Write the inputs of a ubatch of ``tokens`` at positions ``n_past``.. reading ``ids`` (``rs_s_copy``) into
        ``out`` (name -> flat array; inputs the graph lacks may be absent)."""
        if "rs_s_copy" in out:  # (the MTP head has no recurrent memory)
            out["rs_s_copy"][...] = ids
        if not self.cfg.whole:
            return
        n_t = self.n_t
        out["inp_tokens"][...] = tokens
        # llm_graph_input_pos for 4 positions per token (M-RoPE): text tokens have t = h = w = pos, the 4th is 0;
        # the buffer holds all tokens' first position, then all second ones, ...
        pos = out["inp_pos"]
        np.add(self.tokens, n_past, out=pos[:n_t])
        pos[n_t:3 * n_t].reshape(2, n_t)[...] = pos[:n_t]
        pos[3 * n_t:] = 0
        out["out_ids"][...] = self.out_ids
        np.add(self.tokens, n_past, out=out["attn_inp_k_idxs"])
        if "attn_inp_v_idxs" in out:
            np.add(self.v_rows, n_past, out=out["attn_inp_v_idxs"])
        if "attn_inp_kq_mask" in out:
            out["attn_inp_kq_mask"][...] = np.where(self.cell_minus_token <= n_past, 0.0, NEG_INF)


_TYPES = {"attn_inp_kq_mask": np.float32}  # the rest are integers


def input_values(cfg: VerifyConfig, seed: int = 0, ids: list[int] | None = None,
                 tokens: Sequence[int] | None = None, n_past: int | None = None) -> dict[str, np.ndarray]:
    """Input leaf name -> flat values (ggml's element order). ``tokens``: the ubatch's token ids (default: ids
    drawn from ``seed``); ``ids``: ``rs_s_copy`` (default: plane 0 of the ubatch's own cells); ``n_past``: the
    ubatch's first position (default: the config's)."""
    w = InputWriter(cfg)
    if cfg.whole and tokens is None:  # reproducible in the seed, inside the vocabulary
        tokens = [zlib.crc32(f"{seed}:tok:{i}".encode()) % cfg.shape.vocab_size for i in range(w.n_t)]
    out = {name: np.zeros(n, _TYPES.get(name, np.int64)) for name, n in w.sizes.items()}
    w.write(out, tokens, cfg.n_past if n_past is None else n_past, ids if ids is not None else default_ids(cfg))
    return out
