"""The values llama.cpp sets on a verify graph's inputs (the ``set_input`` of each llm_graph_input, llama-graph.cpp).

For a built graph (``graph.meta["config"]``), :func:`input_values` gives every input leaf's contents as llama.cpp
would set them for one verify ubatch of ``n_tokens`` tokens of sequence 0 after ``n_past`` tokens: the token ids,
the M-RoPE positions, the output rows, the KV cells the ubatch writes, the causal KQ mask, and ``rs_s_copy``
(:func:`gdnpass.models.hparams.default_ids`). The executor's fill uses them; other leafs are seeded random.
"""

from __future__ import annotations

import zlib

from gdnpass.models.hparams import VerifyConfig, default_ids

NEG_INF = float("-inf")


def input_values(cfg: VerifyConfig, seed: int = 0, ids: list[int] | None = None) -> dict[str, list]:
    """Input leaf name -> flat values (ggml's element order)."""
    n_t = cfg.n_tokens * cfg.n_seqs
    out: dict[str, list] = {"rs_s_copy": list(ids) if ids is not None else default_ids(cfg)}
    if not cfg.whole:
        return out
    m, p0 = cfg.shape, cfg.n_past
    # token ids: reproducible in the seed, inside the vocabulary
    out["inp_tokens"] = [zlib.crc32(f"{seed}:tok:{i}".encode()) % m.vocab_size for i in range(n_t)]
    # llm_graph_input_pos for 4 positions per token (M-RoPE): text tokens have t = h = w = pos, the 4th is 0;
    # the buffer holds all tokens' first position, then all second ones, ...
    pos = [p0 + i for i in range(n_t)]
    out["inp_pos"] = pos * 3 + [0] * n_t
    out["out_ids"] = list(range(n_t))  # a verify reads every token's logits
    # the ubatch's tokens go to cells p0 .. p0 + n_t - 1 (a fresh, unfragmented cache of one sequence)
    out["attn_inp_k_idxs"] = [p0 + i for i in range(n_t)]
    if cfg.flash_attn:
        out["attn_inp_v_idxs"] = [p0 + i for i in range(n_t)]
    else:  # a transposed V cache, one element per row: element e of token i goes to e * kv_size + its cell
        n_e = m.head_count_kv * m.value_length
        out["attn_inp_v_idxs"] = [e * cfg.kv_size + p0 + i for i in range(n_t) for e in range(n_e)]
    # causal mask [n_kv, n_t]: token i (position p0 + i) sees cells 0 .. p0 + i
    out["attn_inp_kq_mask"] = [0.0 if j <= p0 + i else NEG_INF for i in range(n_t) for j in range(cfg.n_kv)]
    return out
