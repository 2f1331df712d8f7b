"""The values llama.cpp sets on a verify graph's inputs (the ``set_input`` of each llm_graph_input, llama-graph.cpp).

For a built graph (``graph.meta["config"]``), :func:`input_values` gives every input leaf's contents as llama.cpp
would set them for one ubatch of ``n_tokens`` tokens of sequence 0 after ``n_past`` tokens: the token ids, the
M-RoPE positions, the output rows, the KV cells the ubatch writes, the causal KQ mask, and ``rs_s_copy``
(:func:`gdnpass.models.hparams.default_ids`). The executor's fill and the generate loop's every ubatch use them;
other leafs are seeded random.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from gdnpass.models.hparams import VerifyConfig, default_ids

NEG_INF = float("-inf")


def input_values(cfg: VerifyConfig, seed: int = 0, ids: list[int] | None = None,
                 tokens: Sequence[int] | None = None, n_past: int | None = None) -> dict[str, np.ndarray]:
    """Input leaf name -> flat values (ggml's element order). ``tokens``: the ubatch's token ids (default: ids
    drawn from ``seed``); ``ids``: ``rs_s_copy`` (default: plane 0 of the ubatch's own cells); ``n_past``: the
    ubatch's first position (default: the config's)."""
    n_t = cfg.n_tokens * cfg.n_seqs
    out: dict[str, np.ndarray] = {"rs_s_copy": np.asarray(ids if ids is not None else default_ids(cfg), np.int64)}
    if not cfg.whole:
        return out
    m, p0 = cfg.shape, cfg.n_past if n_past is None else n_past
    if tokens is None:  # reproducible in the seed, inside the vocabulary
        tokens = [zlib.crc32(f"{seed}:tok:{i}".encode()) % m.vocab_size for i in range(n_t)]
    out["inp_tokens"] = np.asarray(tokens, np.int64)
    # llm_graph_input_pos for 4 positions per token (M-RoPE): text tokens have t = h = w = pos, the 4th is 0;
    # the buffer holds all tokens' first position, then all second ones, ...
    pos = np.arange(p0, p0 + n_t, dtype=np.int64)
    out["inp_pos"] = np.concatenate([pos, pos, pos, np.zeros(n_t, np.int64)])
    out["out_ids"] = np.arange(n_t - cfg.outputs, n_t, dtype=np.int64)  # the rows whose logits are asked for: the last
    # the ubatch's tokens go to cells p0 .. p0 + n_t - 1 (a fresh, unfragmented cache of one sequence)
    out["attn_inp_k_idxs"] = pos
    if cfg.flash_attn:
        out["attn_inp_v_idxs"] = pos
    else:  # a transposed V cache, one element per row: element e of token i goes to e * kv_size + its cell
        n_e = m.head_count_kv * m.value_length
        out["attn_inp_v_idxs"] = (pos[:, None] + cfg.kv_size * np.arange(n_e)[None, :]).reshape(-1)
    # causal mask [n_kv, n_t]: token i (position p0 + i) sees cells 0 .. p0 + i
    cells = np.arange(cfg.n_kv)
    out["attn_inp_kq_mask"] = np.where(cells[None, :] <= pos[:, None], 0.0, NEG_INF).astype(np.float32).reshape(-1)
    return out
