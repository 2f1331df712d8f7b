"""The one GDN verify-forward builder, written against a constructor facade.

The builder mirrors llama.cpp's qwen35 ``build_layer_attn_linear`` (with ``build_conv_state``, ``build_rs`` and
``build_recurrent_attn`` from delta-net-base / llama-graph) call for call: tensors are *created* in the same order
and ``expand`` (``ggml_build_forward_expand``) is called at the same points, so node order, in-between nodes and use
counts come out as ggml makes them. Only the GDN sub-layer of each linear-attention layer and its FFN are built
(attn_norm -> GDN -> ssm_out -> residual -> FFN); the full-attention layers sit outside the fused pattern.
Qwen3-Next presets reuse this structure with Qwen3-Next shapes (its fused qkvz/ba projections are not modelled).

The builder never constructs a tensor itself: it calls a :class:`Facade`, which speaks ggml's vocabulary. Two
implement it: :class:`gdnpass.models.ir_facade.IrFacade` (gdnpass.ops constructors, a :class:`gdnpass.ir.Graph`) and
:class:`gdnpass.frontends.ggml.facade.GgmlFacade` (real ggml calls on a ``GgmlSession``). Both graphs therefore come
from the same code, and tests/frontends/ggml/test_referee.py checks they are the same graph.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Protocol

from gdnpass.ir import DType
from gdnpass.models.hparams import VerifyConfig, default_ids, dflash_target_layers, qk_rms_params

F32 = DType.F32
IMROPE = 40  # GGML_ROPE_TYPE_IMROPE: qwen35's rope type (llama_model_rope_type)


class Facade(Protocol):
    """The ggml constructors the builder needs. ``T`` is whatever tensor handle the implementation uses.

    Views take ggml's arguments (ne, then nb[1..], then the byte offset); a name is set afterwards with
    :meth:`set_name`, as llama.cpp does. ``il`` on :meth:`new_tensor` and :meth:`set_layer` tag a layer where the
    implementation keeps one (gdnpass does; ggml does not, and its importer reads layers back from the names)."""

    def new_tensor(self, buffer: str, name: str, type_: DType, ne, *, input: bool = False, il: int = -1) -> Any: ...
    def ne(self, t) -> tuple[int, int, int, int]: ...
    def nb(self, t) -> tuple[int, int, int, int]: ...
    def view_1d(self, a, ne0: int, offset: int) -> Any: ...
    def view_2d(self, a, ne0: int, ne1: int, nb1: int, offset: int) -> Any: ...
    def view_3d(self, a, ne0: int, ne1: int, ne2: int, nb1: int, nb2: int, offset: int) -> Any: ...
    def view_4d(self, a, ne0: int, ne1: int, ne2: int, ne3: int, nb1: int, nb2: int, nb3: int, offset: int) -> Any: ...
    def reshape_2d(self, a, ne0: int, ne1: int) -> Any: ...
    def reshape_3d(self, a, ne0: int, ne1: int, ne2: int) -> Any: ...
    def reshape_4d(self, a, ne0: int, ne1: int, ne2: int, ne3: int) -> Any: ...
    def transpose(self, a) -> Any: ...
    def concat(self, a, b, dim: int) -> Any: ...
    def get_rows(self, a, b) -> Any: ...
    def cpy(self, a, b) -> Any: ...
    def scale(self, a, s: float) -> Any: ...
    def scale_inplace(self, a, s: float) -> Any: ...
    def add(self, a, b) -> Any: ...
    def mul(self, a, b) -> Any: ...
    def mul_mat(self, a, b) -> Any: ...
    def rms_norm(self, a, eps: float) -> Any: ...
    def l2_norm(self, a, eps: float) -> Any: ...
    def silu(self, a) -> Any: ...
    def swiglu_split(self, a, b) -> Any: ...
    def permute(self, a, *axes: int) -> Any: ...
    def cont_2d(self, a, ne0: int, ne1: int) -> Any: ...
    def rope_multi(self, a, pos, n_dims: int, sections, mode: int, n_ctx_orig: int, freq_base: float) -> Any: ...
    def set_rows(self, a, b, c) -> Any: ...
    def flash_attn_ext_f32(self, q, k, v, mask, scale: float) -> Any: ...
    def mul_mat_f32(self, a, b) -> Any: ...
    def soft_max_ext(self, a, mask, scale: float) -> Any: ...
    def sigmoid(self, a) -> Any: ...
    def softplus(self, a) -> Any: ...
    def ssm_conv(self, sx, c) -> Any: ...
    def argsort_top_k(self, a, k: int) -> Any: ...
    def src(self, t, i: int) -> Any: ...
    def sum_rows(self, a) -> Any: ...
    def clamp(self, a, lo: float, hi: float) -> Any: ...
    def div(self, a, b) -> Any: ...
    def mul_mat_id(self, a, b, ids) -> Any: ...
    def gated_delta_net(self, q, k, v, g, beta, state, K: int) -> Any: ...
    def set_name(self, t, name: str) -> Any: ...
    def set_layer(self, t, il: int) -> Any: ...
    def set_output(self, t) -> Any: ...
    def expand(self, t) -> None: ...


class VerifyBuilder:
    """llama.cpp's graph context for one verify forward (ctx0 + gf + the recurrent-memory input), on facade ``f``."""

    def __init__(self, f: Facade, cfg: VerifyConfig, weight_types: dict[str, DType] | None = None) -> None:
        cfg.check()
        self.f, self.cfg, self.m = f, cfg, cfg.shape
        self.types = weight_types or {}  # a model file's tensor types, by name (default: cfg.wtype / ab_wtype / f32)
        self.rows = cfg.cells * (1 + cfg.n_rs_seq)  # rows of each recurrent cache (rollback planes x cells)
        self.shared: dict[str, Any] = {}
        n_rs = cfg.n_seqs + cfg.n_rs_extra
        # llama-graph.cpp build_inp_rs: one s_copy input and its two views, shared by all layers
        self.s_copy = f.new_tensor("input", "rs_s_copy", DType.I32, (n_rs,), input=True)
        self.s_copy_main = f.set_name(f.view_1d(self.s_copy, cfg.n_seqs, 0), "rs_s_copy_main")
        self.s_copy_extra = f.set_name(f.view_1d(self.s_copy, cfg.n_rs_extra, cfg.n_seqs * 4), "rs_s_copy_extra")

    # ---- helpers --------------------------------------------------------------------------------------------------
    def cb(self, t, name: str, il: int):
        """llama.cpp's cb(): name a tensor ``name-il`` (and tag it with its layer)."""
        self.f.set_name(t, f"{name}-{il}" if il >= 0 else name)
        return self.f.set_layer(t, il)

    def weight(self, name: str, il: int, type_: DType, ne):
        """Layer ``il``'s ``blk.<il>.<name>``; with ``share_weights`` one ``blk.*.<name>`` for every layer."""
        if not self.cfg.share_weights:
            full = f"blk.{il}.{name}"
            return self.f.new_tensor("weights", full, self.types.get(full, type_), ne, il=il)
        if name not in self.shared:
            self.shared[name] = self.f.new_tensor("weights", f"blk.*.{name}", type_, ne)
        return self.shared[name]

    def recurrent_caches(self, il: int):
        """The layer's conv and ssm state caches (llama-memory-recurrent's r_l / s_l)."""
        m, f = self.m, self.f
        conv_states_all = f.new_tensor("cache", f"cache_r_l{il}", F32, (m.n_embd_r, self.rows), il=il)
        ssm_states_all = f.new_tensor("cache", f"cache_s_l{il}", F32, (m.n_embd_s, self.rows), il=il)
        return conv_states_all, ssm_states_all

    # ---- llama-graph.cpp build_rs ---------------------------------------------------------------------------------
    def build_rs(self, s, state_size: int, il: int):
        """llm_graph_context::build_rs: zero the rs_z row, gather the sequences' states, move the extra rows."""
        f, cfg = self.f, self.cfg
        states = f.reshape_2d(s, state_size, f.ne(s)[1])
        z = int(cfg.rs_z >= 0)  # no row to zero: an empty view (llama.cpp keeps the node)
        state_zero = f.view_1d(states, state_size * z, cfg.rs_z * f.nb(states)[1] * z)
        f.expand(f.scale_inplace(state_zero, 0.0))
        output_states = f.get_rows(states, self.s_copy_main)
        f.expand(output_states)
        states_extra = f.get_rows(states, self.s_copy_extra)
        row = f.nb(s)[1]
        dst = f.view_2d(s, state_size, cfg.n_rs_extra, row, (cfg.kv_head + cfg.n_seqs) * row)
        f.expand(f.cpy(states_extra, dst))
        return output_states

    # ---- delta-net-base.cpp build_conv_state ----------------------------------------------------------------------
    def build_conv_state(self, conv_states_all, qkv_mixed, il: int):
        """build_conv_state: the conv input (old window ++ projection) and the 1 + n_rs_seq snapshot CPYs."""
        f, cfg, m = self.f, self.cfg, self.m
        dc, C, n_s = m.d_conv, m.conv_channels, cfg.n_seqs
        conv_states = self.cb(self.build_rs(conv_states_all, m.n_embd_r, il), "conv_states", il)
        conv_states = self.cb(f.reshape_3d(conv_states, dc - 1, C, n_s), "conv_states_reshaped", il)
        qkv_t = self.cb(f.transpose(qkv_mixed), "qkv_mixed_transposed", il)
        conv_input = self.cb(f.concat(conv_states, qkv_t, 0), "conv_input", il)
        ne, nb = f.ne(conv_input), f.nb(conv_input)
        K = cfg.n_rs_seq + 1
        for t in range(1, K + 1):
            # plane s_slot gets the window after n_t - s_slot tokens (clamped to the pre-ubatch state)
            s_idx = max(0, ne[0] - f.ne(conv_states)[0] - K + t)
            s_slot = K - t
            window = f.set_name(f.view_3d(conv_input, dc - 1, C, n_s, nb[1], nb[2], 4 * s_idx),
                                f"conv_state_last.s{s_slot}-{il}")
            f.expand(f.cpy(window, self.conv_snapshot_dst(conv_states_all, s_slot, s_idx, il)))
        return conv_input

    def conv_snapshot_dst(self, conv_states_all, s: int, col: int, il: int):
        """Where plane ``s`` (its window at concat column ``col``) goes: see hparams.SNAPSHOT_LAYOUTS."""
        f, cfg, m = self.f, self.cfg, self.m
        dc, C, n_s, name = m.d_conv, m.conv_channels, cfg.n_seqs, f"conv_state_update.s{s}-{il}"
        if s == 0 or cfg.snapshot_layout == "rows":
            row = f.nb(conv_states_all)[1]
            return f.set_name(f.view_2d(conv_states_all, m.n_embd_r, n_s, row, (s * cfg.cells + cfg.kv_head) * row),
                              name)
        W = cfg.n_tokens + dc - 2
        key = f"cache_w_l{il}"  # one per layer, created at its first use (after cache_r: rows-layout leafs unchanged)
        if key not in self.shared:
            self.shared[key] = f.new_tensor("cache", key, F32, (W * C, cfg.cells), il=il)
        w = self.shared[key]
        cell = cfg.kv_head * f.nb(w)[1]
        if cfg.snapshot_layout == "dedup":
            return f.set_name(f.view_3d(w, dc - 1, C, n_s, 4 * W, f.nb(w)[1], cell + 4 * col), name)
        return f.transpose(f.set_name(f.view_3d(w, C, dc - 1, n_s, 4 * C, f.nb(w)[1], cell + 4 * C * col), name))

    # ---- qwen35.cpp build_layer_attn_linear, from build_conv_state to the q/k norms -------------------------------
    def build_conv_chain(self, qkv_mixed, conv_states_all, ssm_states_all, conv_kernel, il: int):
        """The conv chain and the ssm build_rs between its CPYs and SSM_CONV; returns (silu, q, k, v, state)."""
        f, cfg, m = self.f, self.cfg, self.m
        n_t, n_s, C = cfg.n_tokens, cfg.n_seqs, m.conv_channels
        S, H_k, H_v = m.head_dim, m.n_k_heads, m.n_v_heads
        conv_input = self.build_conv_state(conv_states_all, qkv_mixed, il)
        state = self.build_rs(ssm_states_all, m.n_embd_s, il)
        state = self.cb(f.reshape_4d(state, S, S, H_v, n_s), "state_predelta", il)

        conv_out = self.cb(f.ssm_conv(conv_input, conv_kernel), "conv_output_raw", il)
        conv_silu = self.cb(f.silu(conv_out), "conv_output_silu", il)
        nb1 = 4 * C
        q_conv = self.cb(f.view_4d(conv_silu, S, H_k, n_t, n_s, 4 * S, nb1, nb1 * n_t, 0), "q_conv", il)
        k_conv = self.cb(f.view_4d(conv_silu, S, H_k, n_t, n_s, 4 * S, nb1, nb1 * n_t, 4 * S * H_k), "k_conv", il)
        v_conv = self.cb(f.view_4d(conv_silu, S, H_v, n_t, n_s, 4 * S, nb1, nb1 * n_t, 4 * 2 * S * H_k), "v_conv", il)
        q_conv = self.cb(self.build_gdn_l2_norm(q_conv), "q_conv_predelta", il)
        k_conv = self.cb(self.build_gdn_l2_norm(k_conv), "k_conv_predelta", il)
        # fused GDN broadcasts k-heads itself (h % H_k): no REPEAT nodes
        return conv_silu, q_conv, k_conv, v_conv, state

    def build_gdn_l2_norm(self, x):
        """The q/k normalisation (``cfg.qk_norm``, hparams.QK_NORMS). "rms" is upstream's models.h
        ``build_gdn_l2_norm``: ``ggml_scale(ggml_rms_norm(x, eps/n), 1.0f/sqrtf(n))``, n = ne0 (the head size), so
        the RMS_NORM is created before its SCALE (and q's pair before k's); "l2" the fork's one L2_NORM(x, eps)."""
        f, eps = self.f, self.m.eps
        if self.cfg.qk_norm == "l2":
            return f.l2_norm(x, eps)
        rms_eps, s = qk_rms_params(eps, f.ne(x)[0])
        return f.scale(f.rms_norm(x, rms_eps), s)

    # ---- delta-net-base.cpp build_recurrent_attn ------------------------------------------------------------------
    def build_recurrent_attn(self, ssm_states_all, q, k, v, g, b, s, il: int):
        """build_recurrent_attn: fused GATED_DELTA_NET (K snapshot slots when n_rs_seq > 0) and its state CPY."""
        f, cfg, m = self.f, self.cfg, self.m
        S, H, n_t, n_s = m.head_dim, m.n_v_heads, cfg.n_tokens, cfg.n_seqs
        K = cfg.n_rs_seq + 1
        gdn = self.cb(f.gated_delta_net(q, k, v, g, b, s, K), "gdn_out", il)
        output = self.cb(f.view_4d(gdn, S, H, n_t, n_s, 4 * S, 4 * S * H, 4 * S * H * n_t, 0), "attn_output", il)
        D = S * S * H
        score_bytes = 4 * S * H * n_t * n_s
        row_size = f.nb(ssm_states_all)[1]
        if cfg.n_rs_seq == 0:
            new_state = self.cb(f.view_4d(gdn, S, S, H, n_s, 4 * S, 4 * S * S, 4 * D, score_bytes), "new_state", il)
            dst = f.set_name(f.view_2d(ssm_states_all, m.n_embd_s, n_s, row_size, cfg.kv_head * row_size),
                             f"ssm_state_update-{il}")
            f.expand(f.cpy(new_state, dst))
        else:
            n_written = min(n_t, K)  # the op writes the last min(n_t, K) snapshots
            src = f.set_name(f.view_3d(gdn, D, n_s, n_written, 4 * D, 4 * D * n_s, score_bytes), f"gdn_snapshots-{il}")
            dst = f.set_name(f.view_3d(ssm_states_all, D, n_s, n_written, row_size, cfg.cells * row_size,
                                       cfg.kv_head * row_size), f"ssm_state_update-{il}")
            f.expand(f.cpy(src, dst))
        return output

    # ---- qwen35.cpp: post-attention norm, build_ffn(SILU, PAR) and the FFN residual -------------------------------
    def build_ffn(self, cur, il: int):
        """llm_build_qwen35's FFN block: attn_post_norm, build_ffn (gate/up/down, SILU, PAR), residual; qwen35moe's
        (llm_build_qwen35moe's build_layer_ffn) is the expert FFN and its gated shared expert instead."""
        f, m = self.f, self.m
        ffn_residual = cur
        x = f.mul(f.rms_norm(cur, m.eps), self.weight("post_attention_norm.weight", il, F32, (m.n_embd,)))
        x = self.cb(x, "attn_post_norm", il)
        if m.is_moe:
            x = self.cb(self.build_moe_ffn(x, il), "ffn_out", il)
        else:
            x = self.dense_ffn(x, il, "", m.ffn_dim)
        return f.add(x, ffn_residual)

    def dense_ffn(self, x, il: int, suffix: str, width: int):
        """llama-graph's build_ffn(up, gate, down, LLM_FFN_SILU, LLM_FFN_PAR) of ``ffn_{up,gate,down}<suffix>``
        (the dense FFN, or qwen35moe's shared expert with suffix ``_shexp``)."""
        f, m, wt = self.f, self.m, DType.parse(self.cfg.wtype)
        up = self.cb(f.mul_mat(self.weight(f"ffn_up{suffix}.weight", il, wt, (m.n_embd, width)), x), "ffn_up", il)
        gate = self.cb(f.mul_mat(self.weight(f"ffn_gate{suffix}.weight", il, wt, (m.n_embd, width)), x), "ffn_gate",
                       il)
        x = self.cb(f.swiglu_split(gate, up), "ffn_swiglu", il)
        return self.cb(f.mul_mat(self.weight(f"ffn_down{suffix}.weight", il, wt, (width, m.n_embd)), x), "ffn_out", il)

    # ---- llama-graph.cpp build_moe_ffn as qwen35moe calls it, and its shared expert ---------------------------------
    MOE_WEIGHT_SUM_MIN = 6.103515625e-5  # build_moe_ffn clamps the weight sum to the smallest normal f16, max INFINITY

    def build_moe_ffn(self, cur, il: int):
        """qwen35moe's build_layer_ffn: build_moe_ffn(softmax gating, norm_w, no weight scale: qwen35moe's loader
        reads no expert_weights_scale, and no swiglu_clamp_exp) on the separate gate / up stacks, plus the shared
        expert (build_ffn of the ``_shexp`` weights) times sigmoid(ffn_gate_inp_shexp · cur), summed."""
        f, m, wt = self.f, self.m, DType.parse(self.cfg.wtype)
        n_exp, n_used, n_t = m.n_expert, m.n_expert_used, f.ne(cur)[1]
        logits = self.cb(f.mul_mat(self.weight("ffn_gate_inp.weight", il, F32, (m.n_embd, n_exp)), cur),
                         "ffn_moe_logits", il)
        probs = self.cb(f.soft_max_ext(logits, None, 1.0), "ffn_moe_probs", il)
        selected = f.argsort_top_k(probs, n_used)  # [n_used, n_t]: a view of a DESC ARGSORT, most probable first
        self.cb(f.src(selected, 0), "ffn_moe_argsort", il)
        selected = self.cb(selected, "ffn_moe_topk", il)
        weights = self.cb(f.get_rows(f.reshape_3d(probs, 1, n_exp, n_t), selected), "ffn_moe_weights", il)
        weights = f.reshape_2d(weights, n_used, n_t)  # norm_w: the selected probabilities normalised to sum 1
        total = self.cb(f.sum_rows(weights), "ffn_moe_weights_sum", il)
        total = self.cb(f.clamp(total, self.MOE_WEIGHT_SUM_MIN, math.inf), "ffn_moe_weights_sum_clamped", il)
        weights = self.cb(f.div(weights, total), "ffn_moe_weights_norm", il)
        weights = f.reshape_3d(weights, 1, n_used, n_t)
        f.expand(weights)  # ("call early so that topk-moe can be used")
        x = f.reshape_3d(cur, m.n_embd, 1, n_t)
        stack = lambda w, ne: self.weight(w, il, wt, ne)  # noqa: E731
        up = self.cb(f.mul_mat_id(stack("ffn_up_exps.weight", (m.n_embd, m.n_ff_exp, n_exp)), x, selected),
                     "ffn_moe_up", il)
        gate = self.cb(f.mul_mat_id(stack("ffn_gate_exps.weight", (m.n_embd, m.n_ff_exp, n_exp)), x, selected),
                       "ffn_moe_gate", il)
        x = self.cb(f.swiglu_split(gate, up), "ffn_moe_swiglu", il)
        experts = self.cb(f.mul_mat_id(stack("ffn_down_exps.weight", (m.n_ff_exp, m.n_embd, n_exp)), x, selected),
                          "ffn_moe_down", il)
        experts = self.cb(f.mul(experts, weights), "ffn_moe_weighted", il)
        f.expand(experts)
        nb = f.nb(experts)
        views = [f.view_2d(experts, m.n_embd, n_t, nb[2], i * nb[1]) for i in range(n_used)]
        for v in views:  # ("order the views before the adds")
            f.expand(v)
        moe_out = views[0]
        for v in views[1:]:
            moe_out = f.add(moe_out, v)
            f.expand(moe_out)
        if n_used == 1:  # (build_moe_ffn avoids returning a non-contiguous tensor)
            moe_out = f.cont_2d(moe_out, m.n_embd, n_t)
        moe_out = self.cb(moe_out, "ffn_moe_out", il)
        shexp = self.cb(self.dense_ffn(cur, il, "_shexp", m.n_ff_shexp), "ffn_shexp", il)
        shared_gate = self.cb(f.mul_mat(self.weight("ffn_gate_inp_shexp.weight", il, F32, (m.n_embd,)), cur),
                              "shared_expert_gate", il)
        shared_gate = self.cb(f.sigmoid(shared_gate), "shared_expert_gate_sigmoid", il)
        shexp = self.cb(f.mul(shexp, shared_gate), "ffn_shexp_gated", il)
        return f.add(moe_out, shexp)

    # ---- qwen35.cpp build_layer_attn, llama-graph.cpp build_attn / build_attn_mha (flash attention) ----------------
    def build_layer_attn(self, cur, il: int):
        """A full-attention layer: the Q+gate projection, per-head q/k RMS norms, IMROPE, K/V into the F16 KV cache
        by SET_ROWS (I64 row ids), attention over n_kv cells (FLASH_ATTN_EXT with the F16 KQ mask, or with flash
        attention off MUL_MAT + SOFT_MAX + MUL_MAT over a transposed V cache), the sigmoid gate, wo."""
        f, cfg, m = self.f, self.cfg, self.m
        hd, H, Hkv, n_t = m.key_length, m.head_count, m.head_count_kv, cfg.n_tokens * cfg.n_seqs
        wt, E = DType.parse(cfg.wtype), m.n_embd
        q_full = self.cb(f.mul_mat(self.weight("attn_q.weight", il, wt, (E, 2 * hd * H)), cur), "Qcur_full", il)
        k = self.cb(f.mul_mat(self.weight("attn_k.weight", il, wt, (E, hd * Hkv)), cur), "Kcur", il)
        v = self.cb(f.mul_mat(self.weight("attn_v.weight", il, wt, (E, hd * Hkv)), cur), "Vcur", il)
        q = self.cb(f.view_3d(q_full, hd, H, n_t, 4 * hd * 2, 4 * hd * 2 * H, 0), "Qcur_reshaped", il)
        q = self.cb(f.mul(self.cb(f.rms_norm(q, m.eps), "norm", il), self.weight("attn_q_norm.weight", il, F32, (hd,))),
                    "Qcur_normed", il)
        k = f.reshape_3d(k, hd, Hkv, n_t)
        k = self.cb(f.mul(self.cb(f.rms_norm(k, m.eps), "norm", il), self.weight("attn_k_norm.weight", il, F32, (hd,))),
                    "Kcur_normed", il)
        gate = f.view_3d(q_full, hd, H, n_t, 4 * hd * 2, 4 * hd * 2 * H, 4 * hd)
        gate = self.cb(f.cont_2d(gate, hd * H, n_t), "gate_reshaped", il)
        v = f.reshape_3d(v, hd, Hkv, n_t)
        rope = dict(n_dims=m.rope_dimension_count, sections=m.rope_dimension_sections, mode=IMROPE,
                    n_ctx_orig=m.context_length, freq_base=m.rope_freq_base)
        q = self.cb(f.rope_multi(q, self.inp_pos, **rope), "Qcur", il)
        k = self.cb(f.rope_multi(k, self.inp_pos, **rope), "Kcur", il)
        v = self.cb(v, "Vcur", il)
        # build_attn: q, v, k expanded in this order, then the cache stores (llama_kv_cache::cpy_k / cpy_v)
        f.expand(q)
        f.expand(v)
        f.expand(k)
        k_cache, v_cache = self.kv_caches(il)
        k_idxs, v_idxs, kq_mask = self.attn_inputs()
        n_kv_e, row, kv, ns, nsc = hd * Hkv, 2 * hd * Hkv, cfg.kv_size, cfg.n_stream, cfg.kv_streams
        # cpy_k / cpy_v: the row ids are global over the streams, so several streams are stored as one 2-D cache
        k_rows = f.reshape_2d(k_cache, n_kv_e, kv * nsc) if nsc > 1 else k_cache
        f.expand(f.set_rows(k_rows, f.view_2d(k, n_kv_e, n_t, f.nb(k)[2], 0), k_idxs))
        if cfg.flash_attn:  # cpy_v: V rows like K's
            v_rows = f.reshape_2d(v_cache, n_kv_e, kv * nsc) if nsc > 1 else v_cache
            f.expand(f.set_rows(v_rows, f.view_2d(v, n_kv_e, n_t, f.nb(v)[2], 0), v_idxs))
        else:  # cpy_v of a transposed V cache: one element per row, v_idxs has n_t * n_embd_v_gqa ids
            v_el = f.reshape_2d(f.reshape_2d(v, n_kv_e, n_t), 1, n_kv_e * n_t)
            f.expand(f.set_rows(f.reshape_2d(v_cache, 1, n_kv_e * kv * nsc), v_el, v_idxs))
        # get_k / get_v: [hd, Hkv, n_kv, ns] views of the ubatch's streams s0.. (a transposed V: [n_kv, Hkv, hd, ns])
        s0 = cfg.stream0
        k_view = f.view_4d(k_cache, hd, Hkv, cfg.n_kv, ns, 2 * hd, row, row * kv, row * kv * s0)
        if cfg.flash_attn:
            v_view = f.view_4d(v_cache, hd, Hkv, cfg.n_kv, ns, 2 * hd, row, row * kv, row * kv * s0)
        else:
            v_view = f.view_4d(v_cache, cfg.n_kv, Hkv, hd, ns, 2 * kv * hd, 2 * kv, 2 * kv * n_kv_e,
                               2 * kv * n_kv_e * s0)
        # build_attn_mha: q as ns streams of n_t/ns tokens, permuted to [hd, n_t/ns, H, ns]; flash attention, or
        # KQ, softmax, KQV
        nbq, n_ts = f.nb(q), n_t // ns
        q = f.permute(f.view_4d(q, hd, H, n_ts, ns, nbq[1], nbq[2], nbq[2] * n_ts, 0), 0, 2, 1, 3)
        k_p, v_p, scale = f.permute(k_view, 0, 2, 1, 3), f.permute(v_view, 0, 2, 1, 3), 1.0 / math.sqrt(float(hd))
        if cfg.flash_attn:
            out = f.flash_attn_ext_f32(q, k_p, v_p, kq_mask, scale)
            ne = f.ne(out)
            cur = f.reshape_2d(out, ne[0] * ne[1], ne[2] * ne[3])
        else:
            kq = self.cb(f.mul_mat_f32(k_p, q), "kq", il)  # ggml_prec_set_acc(kq, F32)
            kq = self.cb(f.soft_max_ext(kq, kq_mask, scale), "kq_soft_max", il)
            kqv = self.cb(f.mul_mat(v_p, kq), "kqv", il)
            ne = f.ne(kqv)
            cur = f.cont_2d(f.permute(kqv, 0, 2, 1, 3), ne[0] * ne[2], ne[1] * ne[3])
        f.expand(cur)  # build_attn_mha ends with this expand (it orders the KQ mask's leaf)
        cur = self.cb(cur, "attn_pregate", il)
        cur = self.cb(f.mul(cur, self.cb(f.sigmoid(gate), "gate_sigmoid", il)), "attn_gated", il)
        return self.cb(f.mul_mat(self.weight("attn_output.weight", il, wt, (hd * H, E)), cur), "attn_output", il)

    def kv_caches(self, il: int):
        """The layer's F16 K and V caches (llama_kv_cache's k_l / v_l, rows of n_embd_k_gqa, kv_size cells per
        stream, a stream per sequence of the context unless unified)."""
        m, cfg = self.m, self.cfg
        ne = (m.key_length * m.head_count_kv, cfg.kv_size, cfg.kv_streams)
        return (self.f.new_tensor("cache", f"cache_k_l{il}", DType.F16, ne, il=il),
                self.f.new_tensor("cache", f"cache_v_l{il}", DType.F16, ne, il=il))

    def attn_inputs(self):
        """build_inp_mem_hybrid's attention inputs, made once: K/V row ids (I64) and the F16 KQ mask
        [n_kv, n_t / n_stream, 1, n_stream]."""
        if not hasattr(self, "_attn_inputs"):
            f, cfg, n_t = self.f, self.cfg, self.cfg.n_tokens * self.cfg.n_seqs
            n_v = n_t if cfg.flash_attn else n_t * self.m.head_count_kv * self.m.value_length  # transposed V: elements
            mask_t = DType.F16 if cfg.flash_attn else F32  # build_attn_inp_kq_mask: F16 for flash attention only
            self._attn_inputs = (f.new_tensor("input", "attn_inp_k_idxs", DType.I64, (n_t,), input=True),
                                 f.new_tensor("input", "attn_inp_v_idxs", DType.I64, (n_v,), input=True),
                                 f.new_tensor("input", "attn_inp_kq_mask", mask_t,
                                              (cfg.n_kv, n_t // cfg.n_stream, 1, cfg.n_stream), input=True))
        return self._attn_inputs

    # ---- qwen35.cpp build_layer_attn_linear -----------------------------------------------------------------------
    def build_layer_attn_linear(self, cur, il: int):
        """llm_build_qwen35::build_layer_attn_linear: projections, conv chain, GDN, gated norm, ssm_out."""
        f, cfg, m = self.f, self.cfg, self.m
        n_t, n_s, C, H_v, S = cfg.n_tokens, cfg.n_seqs, m.conv_channels, m.n_v_heads, m.head_dim
        wt, abt = DType.parse(cfg.wtype), DType.parse(cfg.ab_wtype)
        E = m.n_embd

        # build_qkvz
        qkv_mixed = f.mul_mat(self.weight("attn_qkv.weight", il, wt, (E, C)), cur)
        qkv_mixed = self.cb(f.reshape_3d(qkv_mixed, C, n_t, n_s), "linear_attn_qkv_mixed", il)
        z = self.cb(f.mul_mat(self.weight("attn_gate.weight", il, wt, (E, m.value_dim)), cur), "z", il)

        beta = f.mul_mat(self.weight("ssm_beta.weight", il, abt, (E, H_v)), cur)
        beta = self.cb(f.reshape_4d(beta, 1, H_v, n_t, n_s), "beta", il)
        beta = self.cb(f.sigmoid(beta), "beta_sigmoid", il)
        alpha = f.mul_mat(self.weight("ssm_alpha.weight", il, abt, (E, H_v)), cur)
        alpha = self.cb(f.reshape_3d(alpha, H_v, n_t, n_s), "alpha", il)
        alpha_biased = f.add(alpha, self.weight("ssm_dt.bias", il, F32, (H_v,)))
        alpha_softplus = self.cb(f.softplus(alpha_biased), "a_softplus", il)
        gate = self.cb(f.mul(alpha_softplus, self.weight("ssm_a", il, F32, (H_v,))), "gate", il)
        gate = f.reshape_4d(gate, 1, H_v, n_t, n_s)

        conv_states_all, ssm_states_all = self.recurrent_caches(il)
        conv_kernel = self.weight("ssm_conv1d.weight", il, F32, (m.d_conv, C))
        _, q_conv, k_conv, v_conv, state = self.build_conv_chain(qkv_mixed, conv_states_all, ssm_states_all,
                                                                 conv_kernel, il)

        output = self.build_recurrent_attn(ssm_states_all, q_conv, k_conv, v_conv, gate, beta, state, il)

        z_2d = f.reshape_4d(z, S, H_v, n_t, n_s)
        normalized = f.mul(f.rms_norm(output, m.eps), self.weight("ssm_norm.weight", il, F32, (S,)))
        attn_out_norm = f.mul(normalized, f.silu(z_2d))
        final_output = self.cb(f.reshape_3d(attn_out_norm, m.value_dim, n_t, n_s), "final_output", il)
        cur = self.cb(f.mul_mat(self.weight("ssm_out.weight", il, wt, (m.value_dim, E)), final_output),
                      "linear_attn_out", il)
        return f.reshape_2d(cur, E, n_t * n_s)


def build_verify(f: Facade, cfg: VerifyConfig, weight_types: dict[str, DType] | None = None) -> VerifyBuilder:
    """The verify forward of ``cfg``'s GDN layers on ``f``: llm_build_qwen35's layer loop (attn_norm, the linear
    attention, the residual, the FFN; DFlash taps flagged OUTPUT), then the last hidden state as the output.
    With ``cfg.whole``: the whole forward instead (:func:`build_whole`), with ``cfg.mtp`` the MTP head's
    (:func:`build_mtp`)."""
    if cfg.whole:
        return (build_mtp if cfg.mtp else build_whole)(f, cfg, weight_types)
    b = VerifyBuilder(f, cfg, weight_types)
    m = cfg.shape
    inpL = f.new_tensor("input", "inp_embd", F32, (m.n_embd, cfg.n_tokens * cfg.n_seqs), input=True)
    taps = set(cfg.dflash_taps())
    for il in cfg.layer_ids():
        inpSA = inpL
        normed = b.cb(f.rms_norm(inpL, m.eps), "norm", il)  # build_norm's cb (its source is the previous layer's)
        cur = b.cb(f.mul(normed, b.weight("attn_norm.weight", il, F32, (m.n_embd,))), "attn_norm", il)
        f.expand(cur)
        cur = b.build_layer_attn_linear(cur, il)
        cur = b.cb(f.add(cur, inpSA), "attn_residual", il)
        if cfg.ffn:
            cur = b.build_ffn(cur, il)
        cur = b.cb(cur, "l_out", il)
        if il in taps:
            f.set_output(cur)  # a DFlash drafter reads this hidden state
        inpL = cur
    f.expand(f.set_output(inpL))
    return b


def build_whole(f: Facade, cfg: VerifyConfig, weight_types: dict[str, DType] | None = None) -> VerifyBuilder:
    """llm_build_qwen35 (src/models/qwen35.cpp, 0c1e570) for one ubatch: the token embedding (build_inp_embd), every
    layer in the file's order (GDN or full attention, then the FFN), the output norm (h_nextn), the output rows
    (GET_ROWS by out_ids: every token of a verify is an output, none of a prefill) and the lm head."""
    b = VerifyBuilder(f, cfg, weight_types)
    m, n_t = cfg.shape, cfg.n_tokens * cfg.n_seqs
    wt = DType.parse(cfg.wtype)
    model_weight = lambda name, type_, ne: f.new_tensor("weights", name, b.types.get(name, type_), ne)  # noqa: E731
    # build_inp_embd: both inputs exist; ggml_build_forward_select expands the token path, then the embd leaf
    tokens = f.new_tensor("input", "inp_tokens", DType.I32, (n_t,), input=True)
    embd_in = f.new_tensor("input", "inp_embd", F32, (m.n_embd, n_t), input=True)
    tok_embd = model_weight("token_embd.weight", wt, (m.n_embd, m.vocab_size))
    inpL = b.cb(f.get_rows(tok_embd, tokens), "model.input_embed", -1)
    f.expand(inpL)
    f.expand(embd_in)
    b.inp_pos = f.new_tensor("input", "inp_pos", DType.I32, (n_t * 4,), input=True)  # 4 positions per token (M-RoPE)
    out_ids = f.new_tensor("input", "out_ids", DType.I32, (cfg.outputs,), input=True)
    gdn = set(m.gdn_layers)
    # DFlash: the drafter reads the inputs of the layers after its targets; llama.cpp flags them OUTPUT
    taps = {t + 1 for t in dflash_target_layers(m.n_layer)} if cfg.dflash else set()
    for il in range(m.n_layer):
        if il in taps:
            f.set_output(inpL)  # res->t_layer_inp[il], ggml_set_output
        inpSA = inpL
        cur = b.cb(f.mul(b.cb(f.rms_norm(inpL, m.eps), "norm", il), b.weight("attn_norm.weight", il, F32, (m.n_embd,))),
                   "attn_norm", il)
        f.expand(cur)
        cur = b.build_layer_attn_linear(cur, il) if il in gdn else b.build_layer_attn(cur, il)
        cur = b.cb(f.add(cur, inpSA), "attn_residual", il)
        cur = b.cb(b.build_ffn(cur, il), "l_out", il)
        inpL = cur
    cur = b.cb(f.rms_norm(inpL, m.eps), "norm", -1)
    cur = f.set_output(b.cb(f.mul(cur, model_weight("output_norm.weight", F32, (m.n_embd,))), "h_nextn", -1))
    cur = f.set_output(b.cb(f.get_rows(cur, out_ids), "result_norm", -1))
    # tied embeddings: the loader hands back token_embd itself for the TENSOR_DUPLICATED output when both live in one
    # buffer type, as on the CPU (llama-model-loader.cpp create_tensor): one leaf, one copy of the weights
    head = tok_embd if m.tie_embeddings else model_weight("output.weight", wt, (m.n_embd, m.vocab_size))
    cur = f.set_output(b.cb(f.mul_mat(head, cur), "result_output", -1))
    f.expand(cur)
    return b


# the optional MTP tensors a file written by gdnpass.models.gguf_write holds (gguf_write.NEXTN_OPTIONAL: the graph
# reads what the file has; a build without a file assumes the writer's)
_WRITTEN_NEXTN = ("nextn.shared_head_norm.weight",)


def build_mtp(f: Facade, cfg: VerifyConfig, weight_types: dict[str, DType] | None = None) -> VerifyBuilder:
    """llama_model_qwen35::graph_mtp (src/models/qwen35.cpp, 0c1e570): one ubatch of the MTP head in an MTP context
    (LLAMA_CONTEXT_TYPE_MTP, the graph type LLM_GRAPH_TYPE_DECODER_MTP) with its own KV cache of the one MTP block
    ``il`` = n_layer (``cache_k_l<il>`` / ``cache_v_l<il>``). Inputs: the ubatch's token ids (unnamed in llama.cpp:
    ggml calls the leaf ``leaf_<i>``) and ``mtp_h_input``, the target's ``h_nextn`` rows the caller pairs with them
    (token at position p with the target's hidden state at p - 1), positions, ``out_ids``, the KV inputs.

    The token's embedding (``nextn.embed_tokens``, else ``token_embd``) and the hidden state are each RMS-normed
    (``nextn.enorm`` / ``nextn.hnorm``), concatenated [E + E] and projected back to E (``nextn.eh_proj``); then one
    full-attention block as the trunk's (the attention layer and the FFN of :class:`VerifyBuilder`, block ``il``'s
    weights), the head's norm (``nextn.shared_head_norm``, else ``output_norm``) as ``h_nextn`` (OUTPUT: the next
    draft step's hidden state), the output rows and the lm head (``nextn.shared_head_head``, else the trunk's)."""
    b = VerifyBuilder(f, cfg, weight_types)
    m, n_t, il = cfg.shape, cfg.n_tokens, cfg.shape.mtp_layer
    wt, E = DType.parse(cfg.wtype), m.n_embd
    has = (lambda n: f"blk.{il}.{n}" in b.types) if b.types else (lambda n: n in _WRITTEN_NEXTN)  # noqa: E731
    made: dict[str, Any] = {}

    def model_weight(name: str, type_: DType, ne):  # one leaf per tensor (the tied lm head is token_embd's)
        if name not in made:
            made[name] = f.new_tensor("weights", name, b.types.get(name, type_), ne)
        return made[name]

    tokens = b.tokens = f.new_tensor("input", "", DType.I32, (n_t,), input=True)  # (inp->embd: made, never read)
    emb = b.weight("nextn.embed_tokens.weight", il, wt, (E, m.vocab_size)) if has("nextn.embed_tokens.weight") \
        else model_weight("token_embd.weight", wt, (E, m.vocab_size))
    tok_embd = b.cb(f.get_rows(emb, tokens), "mtp_tok_embd", il)
    h = f.new_tensor("input", "mtp_h_input", F32, (E, n_t), input=True)
    b.inp_pos = f.new_tensor("input", "inp_pos", DType.I32, (n_t * 4,), input=True)
    out_ids = f.new_tensor("input", "out_ids", DType.I32, (cfg.outputs,), input=True)

    def norm(x, weight, name: str, il_: int = il):  # build_norm(LLM_NORM_RMS) and its cb
        return b.cb(f.mul(b.cb(f.rms_norm(x, m.eps), "norm", il_), weight), name, il_)

    h_norm = norm(h, b.weight("nextn.hnorm.weight", il, F32, (E,)), "mtp_hnorm")
    e_norm = norm(tok_embd, b.weight("nextn.enorm.weight", il, F32, (E,)), "mtp_enorm")
    cat = b.cb(f.concat(e_norm, h_norm, 0), "mtp_concat", il)
    cur = b.cb(f.mul_mat(b.weight("nextn.eh_proj.weight", il, wt, (2 * E, E)), cat), "mtp_eh_proj", il)
    inpSA = cur
    cur = norm(cur, b.weight("attn_norm.weight", il, F32, (E,)), "mtp_attn_norm")
    cur = b.cb(b.build_layer_attn(cur, il), "mtp_attn_out", il)
    cur = b.cb(f.add(cur, inpSA), "mtp_attn_residual", il)
    cur = b.cb(b.build_ffn(cur, il), "mtp_post_ffn", il)
    head_norm = b.weight("nextn.shared_head_norm.weight", il, F32, (E,)) if has("nextn.shared_head_norm.weight") \
        else model_weight("output_norm.weight", F32, (E,))
    cur = f.set_output(norm(cur, head_norm, "h_nextn", -1))
    cur = b.cb(f.get_rows(cur, out_ids), "mtp_shared_head_norm", -1)
    if has("nextn.shared_head_head.weight"):
        head = b.weight("nextn.shared_head_head.weight", il, wt, (E, m.vocab_size))
    else:
        head = model_weight("token_embd.weight" if m.tie_embeddings else "output.weight", wt, (E, m.vocab_size))
    cur = f.set_output(b.cb(f.mul_mat(head, cur), "result_output", -1))
    f.expand(cur)
    return b


def build_conv_chain_only(f: Facade, cfg: VerifyConfig) -> VerifyBuilder:
    """One layer's conv chain alone (:meth:`VerifyBuilder.build_conv_chain`), with the projection ``inp_qkv_mixed``
    [C, n_t, n_s] as an input, so every cache byte written is a copy. SILU and both q/k outputs (L2_NORM, or the
    SCALE of the RMS form) are flagged OUTPUT
    (readable after the run)."""
    b = VerifyBuilder(f, cfg)
    m, il = cfg.shape, 0
    qkv = f.new_tensor("input", "inp_qkv_mixed", F32, (m.conv_channels, cfg.n_tokens, cfg.n_seqs), input=True)
    conv_states_all, ssm_states_all = b.recurrent_caches(il)
    conv_kernel = b.weight("ssm_conv1d.weight", il, F32, (m.d_conv, m.conv_channels))
    silu, q, k, _, _ = b.build_conv_chain(qkv, conv_states_all, ssm_states_all, conv_kernel, il)
    for t in (silu, q, k):
        f.set_output(t)
    f.expand(q)
    f.expand(k)
    return b


def verify_meta(cfg: VerifyConfig, builder: str = "verify") -> dict:
    """The ``graph.meta`` of a verify graph (models.fill, reports and dumps read it)."""
    taps = ([t + 1 for t in dflash_target_layers(cfg.shape.n_layer)] if cfg.whole else cfg.dflash_taps()) \
        if cfg.dflash else []
    return {"builder": builder, "config": asdict(cfg), "model": asdict(cfg.shape), "layers": cfg.layer_ids(),
            "dflash_taps": taps, "ids": default_ids(cfg)}
