"""The values llama.cpp sets on a verify graph's inputs (the ``set_input`` of each llm_graph_input, llama-graph.cpp).

For a built graph (``graph.meta["config"]``), :class:`InputWriter` writes every input leaf's contents as llama.cpp
would set them for one ubatch of ``n_tokens`` tokens of each of its ``n_seqs`` sequences, each after its own
``n_past`` tokens: the token ids, the M-RoPE positions, the output rows, the KV cells the ubatch writes (each
sequence in its own KV stream), the causal KQ mask, and ``rs_s_copy``
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
    element count.

    A ubatch of ``n_seqs`` sequences holds ``n_tokens`` tokens of each, sequence after sequence (llama.cpp's
    split_equal order); sequence j of the ubatch (id ``seq0 + j``) has its own KV stream, in whose cells the
    positions sit one for one (a stream holds one sequence, rolled back by freeing its tail cells), and its own
    first position ``n_past[j]``."""

    def __init__(self, cfg: VerifyConfig) -> None:
        self.cfg = cfg
        n_t = self.n_t = cfg.n_tokens * cfg.n_seqs
        self.sizes = {"rs_s_copy": len(default_ids(cfg))}
        if not cfg.whole:
            return
        if cfg.n_seqs > 1 and cfg.kv_unified:  # (one stream shared: find_slot interleaves the sequences' cells)
            raise GraphError("config field 'kv_unified': the inputs of several sequences are written for a KV stream "
                             "per sequence (llama.cpp's default), not for one unified stream")
        m = cfg.shape
        self.offset = np.tile(np.arange(cfg.n_tokens), cfg.n_seqs)  # row r: token offset within its sequence
        # row r's first cell of its stream: stream (seq0 + its sequence) of kv_size cells
        stream = np.repeat(np.arange(cfg.n_seqs) + cfg.stream0, cfg.n_tokens)
        self.stream_cell = stream * cfg.kv_size
        self.out_ids = np.arange(n_t - cfg.outputs, n_t)  # the rows whose logits are asked for: the last
        # a transposed V cache (no flash attention), one element per row: element e of a token in cell c of stream s
        # goes to s * kv_size * n_e + e * kv_size + c
        n_e = m.head_count_kv * m.value_length
        self.v_rows = None if cfg.flash_attn else \
            (self.stream_cell[:, None] * n_e + cfg.kv_size * np.arange(n_e)[None, :])
        # causal mask [n_kv, n_t / n_stream, 1, n_stream], one row per token: token i of a sequence (position
        # n_past + i) sees its stream's cell j iff j - i <= n_past
        self.cell_minus_token = np.arange(cfg.n_kv)[None, :] - self.offset[:, None]
        self.sizes.update({"inp_tokens": n_t, "inp_pos": 4 * n_t, "out_ids": cfg.outputs, "attn_inp_k_idxs": n_t,
                           "attn_inp_v_idxs": n_t * (1 if cfg.flash_attn else n_e),
                           "attn_inp_kq_mask": self.cell_minus_token.size})

    def write(self, out: dict[str, np.ndarray], tokens: Sequence[int], n_past: int | Sequence[int],
              ids: Sequence[int]) -> None:
        """Write the inputs of a ubatch of ``tokens`` (sequence after sequence) at positions ``n_past``.. (one per
        sequence of the ubatch, or one for all) reading ``ids`` (``rs_s_copy``) into ``out`` (name -> flat array;
        inputs the graph lacks may be absent)."""
        if "rs_s_copy" in out:  # (the MTP head has no recurrent memory)
            out["rs_s_copy"][...] = ids
        if not self.cfg.whole:
            return
        n_t = self.n_t
        if isinstance(n_past, (int, np.integer)):
            past = n_past
        else:
            if len(n_past) != self.cfg.n_seqs:
                raise GraphError(f"a ubatch of {self.cfg.n_seqs} sequences takes {self.cfg.n_seqs} first positions, "
                                 f"not {len(n_past)}")
            past = np.repeat(np.asarray(n_past, dtype=np.int64), self.cfg.n_tokens)
        out["inp_tokens"][...] = tokens
        # llm_graph_input_pos for 4 positions per token (M-RoPE): text tokens have t = h = w = pos, the 4th is 0;
        # the buffer holds all tokens' first position, then all second ones, ...
        pos = out["inp_pos"]
        np.add(self.offset, past, out=pos[:n_t])
        pos[n_t:3 * n_t].reshape(2, n_t)[...] = pos[:n_t]
        pos[3 * n_t:] = 0
        out["out_ids"][...] = self.out_ids
        np.add(self.stream_cell, pos[:n_t], out=out["attn_inp_k_idxs"])
        if "attn_inp_v_idxs" in out:
            if self.v_rows is None:
                out["attn_inp_v_idxs"][...] = out["attn_inp_k_idxs"]
            else:
                out["attn_inp_v_idxs"].reshape(self.v_rows.shape)[...] = self.v_rows + pos[:n_t, None]
        if "attn_inp_kq_mask" in out:
            see = self.cell_minus_token <= (past if np.ndim(past) == 0 else past[:, None])
            out["attn_inp_kq_mask"].reshape(see.shape)[...] = np.where(see, 0.0, NEG_INF)


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
