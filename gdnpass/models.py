"""Model shape presets and the GDN verify-forward graph builder.

The builder mirrors llama.cpp's qwen35 ``build_layer_attn_linear`` (with ``build_conv_state``, ``build_rs`` and
``build_recurrent_attn`` from delta-net-base / llama-graph) call for call: tensors are *created* in the same order
and ``Graph.expand`` is called at the same points, so node order, in-between nodes and use counts come out as
``ggml_build_forward_expand`` would make them. Only the GDN sub-layer of each linear-attention layer is built
(attn_norm -> GDN -> ssm_out -> residual); the FFN and the full-attention layers sit outside the fused pattern.
Qwen3-Next presets reuse this structure with Qwen3-Next shapes (its fused qkvz/ba projections are not modelled).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from gdnpass import ops
from gdnpass.ir import DType, Flag, Graph, GraphError, Tensor
from gdnpass.ops import cb


@dataclass(frozen=True)
class ModelShape:
    name: str
    n_embd: int
    n_layer: int          # all decoder layers; every ``full_attention_interval``-th one is full attention
    n_k_heads: int        # H_k = ssm_n_group
    n_v_heads: int        # H_v = ssm_dt_rank
    head_dim: int         # S = ssm_d_state = head_v_dim
    d_conv: int = 4
    n_ff: int = 0         # FFN width (0: 3 * n_embd)
    full_attention_interval: int = 4
    eps: float = 1e-6

    @property
    def ffn_dim(self) -> int:
        return self.n_ff or 3 * self.n_embd

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """C = 2*key_dim + value_dim."""
        return 2 * self.key_dim + self.value_dim

    @property
    def n_embd_r(self) -> int:
        return (self.d_conv - 1) * self.conv_channels

    @property
    def n_embd_s(self) -> int:
        return self.head_dim * self.head_dim * self.n_v_heads

    @property
    def gdn_layers(self) -> list[int]:
        k = self.full_attention_interval
        return [i for i in range(self.n_layer) if (i + 1) % k != 0] if k > 0 else list(range(self.n_layer))


PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in [
        # shapes from HF configs (reference/kernels-and-matchers.md A4)
        ModelShape("qwen3.5-9b", n_embd=4096, n_layer=32, n_k_heads=16, n_v_heads=32, head_dim=128, n_ff=12288),
        ModelShape("qwen3.5-4b", n_embd=2560, n_layer=32, n_k_heads=16, n_v_heads=32, head_dim=128, n_ff=9216),
        ModelShape("qwen3.5-27b", n_embd=5120, n_layer=64, n_k_heads=16, n_v_heads=48, head_dim=128, n_ff=17408),
        # Qwen3-Next's FFN is a mixture of experts; a dense FFN of the shared expert's width stands in for it
        ModelShape("qwen3-next-80b", n_embd=2048, n_layer=48, n_k_heads=16, n_v_heads=32, head_dim=128, n_ff=512),
        # small shapes for tests and the exactness sweep: d_conv 3-5, head size 32-128
        ModelShape("tiny-dc3-h32", n_embd=64, n_layer=4, n_k_heads=2, n_v_heads=4, head_dim=32, d_conv=3),
        ModelShape("tiny-dc4-h64", n_embd=64, n_layer=4, n_k_heads=1, n_v_heads=2, head_dim=64, d_conv=4),
        ModelShape("tiny-dc5-h128", n_embd=64, n_layer=4, n_k_heads=1, n_v_heads=1, head_dim=128, d_conv=5),
        ModelShape("tiny-dc4-h32", n_embd=96, n_layer=4, n_k_heads=2, n_v_heads=2, head_dim=32, d_conv=4),
        ModelShape("tiny-dc4-h128", n_embd=64, n_layer=4, n_k_heads=1, n_v_heads=2, head_dim=128, d_conv=4),
    ]
}


def get_model(name: str | ModelShape) -> ModelShape:
    if isinstance(name, ModelShape):
        return name
    try:
        return PRESETS[name]
    except KeyError:
        raise GraphError(f"unknown model {name!r} (known: {', '.join(PRESETS)})") from None


# Where the conv-state snapshot planes 1..n_rs_seq go (plane 0, the live state the next ubatch gathers, is always a
# whole row of the conv cache ``cache_r``):
#   rows     one cache_r row per plane (llama.cpp): plane s of cell i is row s*cells + i;
#   dedup    one row per cell of ``cache_w`` ne [W*C, cells], W = n_t + d_conv - 2 columns per channel, channel-major:
#            concat column c (c = 0..W-1) of channel ch at element ch*W + c. Plane s's window, concat columns
#            max(0, n_t - s) .. +d_conv-2, is the view ne [d_conv-1, C] nb [4, 4W] at column max(0, n_t - s), so
#            planes overlap and share columns (sglang's MambaPool, vLLM's widened state). The planes write columns
#            max(0, n_t - n_rs_seq) .. W-1 (W-1 = n_t + d_conv - 3: plane 1's last); columns before stay untouched.
#            With n_rs_seq >= n_t, planes n_t..n_rs_seq all hold the pre-ubatch window at column 0: the same bytes
#            at the same address, which is what makes the overlap safe (the matcher's rule 5b);
#   dedup-t  the same row time-major ([C, W] per cell: concat column c of channel ch at element c*C + ch), each window
#            a TRANSPOSE of a [C, d_conv-1] view, nb [4C, 4]: MambaPool's axis-0 layout seen transposed.
# cache_r keeps all its 1 + n_rs_seq planes in every layout: one s_copy id (rs_idx*mem_size + cell) gathers the conv
# and the ssm state alike, so the planes of cache_r are where a rollback (a copy of the accepted window out of
# cache_w, as sglang's scatter; not part of this graph) puts the state the next ubatch reads.
SNAPSHOT_LAYOUTS = ("rows", "dedup", "dedup-t")


@dataclass(frozen=True)
class VerifyConfig:
    """One speculative-verify ubatch: ``n_tokens`` tokens of each of ``n_seqs`` sequences."""

    model: str
    n_tokens: int
    n_rs_seq: int = 0          # rollback snapshot planes beyond plane 0
    n_layers: int | None = None  # GDN layers to build (None: all of the preset's)
    n_seqs: int = 1
    dflash: bool = False       # flag the drafter's hidden-state taps OUTPUT
    mem_size: int | None = None  # recurrent cells (None: just the n_seqs + n_rs_extra cells this ubatch uses)
    kv_head: int = 0           # first cell of this ubatch
    rs_z: int = -1             # the cell build_rs zeroes (-1: none, as in a verify of running sequences)
    n_rs_extra: int = 0        # the "extra" rows build_rs moves (n_rs - n_seqs)
    ffn: bool = True           # build each layer's FFN sub-block too (it shapes the arena the chain is planned in)
    share_weights: bool = False  # one set of weights for all layers (same graph and plan, a fraction of the memory)
    wtype: str = "bf16"        # type of the large projections (qkv, z, ssm_out, FFN)
    ab_wtype: str = "f32"      # type of the alpha/beta mat-vec weights
    snapshot_layout: str = "rows"  # conv snapshot planes 1..n_rs_seq: "rows", "dedup" or "dedup-t" (SNAPSHOT_LAYOUTS)

    def check(self) -> None:
        m = get_model(self.model)
        _need(1 <= self.n_tokens <= 64, "n_tokens", f"must be 1..64, is {self.n_tokens}")
        _need(0 <= self.n_rs_seq <= 15, "n_rs_seq", f"must be 0..15, is {self.n_rs_seq}")
        _need(self.n_seqs >= 1, "n_seqs", f"must be >= 1, is {self.n_seqs}")
        n_gdn = len(m.gdn_layers)
        _need(self.n_layers is None or 1 <= self.n_layers <= n_gdn, "n_layers",
              f"must be 1..{n_gdn} for {m.name}, is {self.n_layers}")
        _need(self.n_rs_extra >= 0, "n_rs_extra", f"must be >= 0, is {self.n_rs_extra}")
        _need(self.cells >= self.kv_head + self.n_seqs + self.n_rs_extra, "mem_size",
              f"{self.cells} cells cannot hold kv_head {self.kv_head} + {self.n_seqs + self.n_rs_extra} used cells")
        _need(-1 <= self.rs_z < self.cells, "rs_z", f"must be -1..{self.cells - 1}, is {self.rs_z}")
        _need(self.snapshot_layout in SNAPSHOT_LAYOUTS, "snapshot_layout",
              f"must be one of {', '.join(SNAPSHOT_LAYOUTS)}, is {self.snapshot_layout!r}")
        for f in ("wtype", "ab_wtype"):
            _need(DType.parse(getattr(self, f)) is not DType.I32, f, "weights cannot be i32")

    @property
    def cells(self) -> int:
        return self.mem_size if self.mem_size is not None else self.kv_head + self.n_seqs + self.n_rs_extra

    @property
    def shape(self) -> ModelShape:
        return get_model(self.model)

    def layer_ids(self) -> list[int]:
        ids = self.shape.gdn_layers
        return ids[: self.n_layers] if self.n_layers else ids

    def dflash_taps(self) -> list[int]:
        """The GDN layers whose outputs a DFlash drafter reads: up to five, spread over the stack.

        (The last layer's output is the graph output anyway.)"""
        ids = self.layer_ids()[:-1]
        if not self.dflash or not ids:
            return []
        n = min(5, len(ids))
        return sorted({ids[round(i * (len(ids) - 1) / max(1, n - 1))] for i in range(n)})


def _need(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise GraphError(f"config field {field!r}: {msg}")


class _LayerBuilder:
    """The llama.cpp graph context for one forward: ctx0 + gf + the recurrent-memory input."""

    def __init__(self, cfg: VerifyConfig, graph: Graph) -> None:
        self.cfg, self.m, self.gf = cfg, cfg.shape, graph
        self.rows = cfg.cells * (1 + cfg.n_rs_seq)  # rows of each recurrent cache (rollback planes x cells)
        self.shared: dict[str, Tensor] = {}
        n_rs = cfg.n_seqs + cfg.n_rs_extra
        # build_inp_rs: one s_copy input and its two views, shared by all layers
        self.s_copy = ops.new_tensor("inp_s_copy", DType.I32, (n_rs,), buffer="input", flags=Flag.INPUT, layer=-1)
        self.s_copy_main = ops.view_1d(self.s_copy, cfg.n_seqs, 0, "inp_s_copy_main")
        self.s_copy_extra = ops.view_1d(self.s_copy, cfg.n_rs_extra, cfg.n_seqs * 4, "inp_s_copy_extra")

    def weight(self, name: str, il: int, type_: DType, ne) -> Tensor:
        if not self.cfg.share_weights:
            return ops.new_tensor(f"blk.{il}.{name}", type_, ne, buffer="weights", flags=Flag.NONE, layer=il)
        if name not in self.shared:
            self.shared[name] = ops.new_tensor(f"blk.*.{name}", type_, ne, buffer="weights", flags=Flag.NONE, layer=-1)
        return self.shared[name]

    # llama-graph.cpp build_rs
    def build_rs(self, s: Tensor, state_size: int, il: int) -> Tensor:
        cfg = self.cfg
        states = ops.reshape(s, state_size, s.ne[1])
        z = cfg.rs_z >= 0
        state_zero = ops.view_1d(states, state_size * z, cfg.rs_z * states.nb[1] * z)
        self.gf.expand(ops.scale(state_zero, 0.0, inplace=True))
        output_states = ops.get_rows(states, self.s_copy_main)
        self.gf.expand(output_states)
        states_extra = ops.get_rows(states, self.s_copy_extra)
        dst = ops.view_1d(s, state_size * cfg.n_rs_extra, (cfg.kv_head + cfg.n_seqs) * state_size * s.type.size)
        self.gf.expand(ops.cpy(states_extra, dst))
        return output_states

    # delta-net-base.cpp build_conv_state
    def build_conv_state(self, conv_states_all: Tensor, qkv_mixed: Tensor, il: int) -> Tensor:
        cfg, m = self.cfg, self.m
        dc, C, n_s = m.d_conv, m.conv_channels, cfg.n_seqs
        conv_states = cb(self.build_rs(conv_states_all, m.n_embd_r, il), "conv_states", il)
        conv_states = cb(ops.reshape(conv_states, dc - 1, C, n_s), "conv_states_reshaped", il)
        qkv_t = cb(ops.transpose(qkv_mixed), "qkv_mixed_transposed", il)
        conv_input = cb(ops.concat(conv_states, qkv_t, 0), "conv_input", il)
        K = cfg.n_rs_seq + 1
        for t in range(1, K + 1):
            # plane s_slot gets the window after n_t - s_slot tokens (clamped to the pre-ubatch state)
            s_idx = max(0, conv_input.ne[0] - conv_states.ne[0] - K + t)
            s_slot = K - t
            window = ops.view_3d(conv_input, dc - 1, C, n_s, conv_input.nb[1], conv_input.nb[2], 4 * s_idx,
                                 f"conv_state_last.s{s_slot}-{il}")
            self.gf.expand(ops.cpy(window, self.conv_snapshot_dst(conv_states_all, s_slot, s_idx, il)))
        return conv_input

    def conv_snapshot_dst(self, conv_states_all: Tensor, s: int, col: int, il: int) -> Tensor:
        """Where plane ``s`` (its window at concat column ``col``) goes: see SNAPSHOT_LAYOUTS."""
        cfg, m = self.cfg, self.m
        dc, C, n_s, name = m.d_conv, m.conv_channels, cfg.n_seqs, f"conv_state_update.s{s}-{il}"
        if s == 0 or cfg.snapshot_layout == "rows":
            row = conv_states_all.nb[1]
            return ops.view_2d(conv_states_all, m.n_embd_r, n_s, row, (s * cfg.cells + cfg.kv_head) * row, name)
        W = cfg.n_tokens + dc - 2
        key = f"cache_w_l{il}"  # one per layer, created at its first use (after cache_r: rows-layout leafs unchanged)
        if key not in self.shared:
            self.shared[key] = ops.new_tensor(key, DType.F32, (W * C, cfg.cells), buffer="cache", layer=il)
        w = self.shared[key]
        cell = cfg.kv_head * w.nb[1]
        if cfg.snapshot_layout == "dedup":
            return ops.view_3d(w, dc - 1, C, n_s, 4 * W, w.nb[1], cell + 4 * col, name)
        return ops.transpose(ops.view_3d(w, C, dc - 1, n_s, 4 * C, w.nb[1], cell + 4 * C * col, name))

    # delta-net-base.cpp build_recurrent_attn (fused GATED_DELTA_NET, K snapshot slots when n_rs_seq > 0)
    def build_recurrent_attn(self, ssm_states_all, q, k, v, g, b, s, il: int) -> Tensor:
        cfg, m = self.cfg, self.m
        S, H, n_t, n_s = m.head_dim, m.n_v_heads, cfg.n_tokens, cfg.n_seqs
        K = cfg.n_rs_seq + 1
        gdn = cb(ops.gated_delta_net(q, k, v, g, b, s, K), "gdn_out", il)
        output = cb(ops.view_4d(gdn, (S, H, n_t, n_s), 4 * S, 4 * S * H, 4 * S * H * n_t, 0), "attn_output", il)
        D = S * S * H
        score_bytes = 4 * S * H * n_t * n_s
        row_size = ssm_states_all.nb[1]
        if cfg.n_rs_seq == 0:
            new_state = cb(ops.view_4d(gdn, (S, S, H, n_s), 4 * S, 4 * S * S, 4 * D, score_bytes), "new_state", il)
            dst = ops.view_2d(ssm_states_all, m.n_embd_s, n_s, row_size, cfg.kv_head * row_size, f"ssm_state_update-{il}")
            self.gf.expand(ops.cpy(new_state, dst))
        else:
            n_written = min(n_t, K)  # the op writes the last min(n_t, K) snapshots
            src = ops.view_3d(gdn, D, n_s, n_written, 4 * D, 4 * D * n_s, score_bytes, f"gdn_snapshots-{il}")
            dst = ops.view_3d(ssm_states_all, D, n_s, n_written, row_size, cfg.cells * row_size,
                              cfg.kv_head * row_size, f"ssm_state_update-{il}")
            self.gf.expand(ops.cpy(src, dst))
        return output

    # qwen35.cpp: post-attention norm, build_ffn(SILU, PAR) and the FFN residual
    def build_ffn(self, cur: Tensor, il: int) -> Tensor:
        m, wt = self.m, DType.parse(self.cfg.wtype)
        ffn_residual = cur
        x = ops.mul(ops.rms_norm(cur, m.eps), self.weight("post_attention_norm.weight", il, DType.F32, (m.n_embd,)))
        x = cb(x, "attn_post_norm", il)
        up = ops.mul_mat(self.weight("ffn_up.weight", il, wt, (m.n_embd, m.ffn_dim)), x)
        gate = ops.mul_mat(self.weight("ffn_gate.weight", il, wt, (m.n_embd, m.ffn_dim)), x)
        x = ops.mul(ops.silu(gate), up)  # (newer llama.cpp: one fused GLU op; same buffers up to in-place reuse)
        x = cb(ops.mul_mat(self.weight("ffn_down.weight", il, wt, (m.ffn_dim, m.n_embd)), x), "ffn_out", il)
        return ops.add(x, ffn_residual)

    # qwen35.cpp build_layer_attn_linear
    def build_layer_attn_linear(self, cur: Tensor, il: int) -> Tensor:
        cfg, m = self.cfg, self.m
        n_t, n_s, C, H_v = cfg.n_tokens, cfg.n_seqs, m.conv_channels, m.n_v_heads
        wt, abt = DType.parse(cfg.wtype), DType.parse(cfg.ab_wtype)
        E = m.n_embd

        # build_qkvz
        qkv_mixed = ops.mul_mat(self.weight("attn_qkv.weight", il, wt, (E, C)), cur)
        qkv_mixed = cb(ops.reshape(qkv_mixed, C, n_t, n_s), "linear_attn_qkv_mixed", il)
        z = cb(ops.mul_mat(self.weight("attn_gate.weight", il, wt, (E, m.value_dim)), cur), "z", il)

        beta = ops.mul_mat(self.weight("ssm_beta.weight", il, abt, (E, H_v)), cur)
        beta = cb(ops.reshape(beta, 1, H_v, n_t, n_s), "beta", il)
        beta = cb(ops.sigmoid(beta), "beta_sigmoid", il)
        alpha = ops.mul_mat(self.weight("ssm_alpha.weight", il, abt, (E, H_v)), cur)
        alpha = cb(ops.reshape(alpha, H_v, n_t, n_s), "alpha", il)
        alpha_biased = ops.add(alpha, self.weight("ssm_dt.bias", il, DType.F32, (H_v,)))
        alpha_softplus = cb(ops.softplus(alpha_biased), "a_softplus", il)
        gate = cb(ops.mul(alpha_softplus, self.weight("ssm_a", il, DType.F32, (H_v,))), "gate", il)
        gate = ops.reshape(gate, 1, H_v, n_t, n_s)

        conv_states_all = ops.new_tensor(f"cache_r_l{il}", DType.F32, (m.n_embd_r, self.rows), buffer="cache", layer=il)
        ssm_states_all = ops.new_tensor(f"cache_s_l{il}", DType.F32, (m.n_embd_s, self.rows), buffer="cache", layer=il)
        conv_kernel = self.weight("ssm_conv1d.weight", il, DType.F32, (m.d_conv, C))

        conv_input = self.build_conv_state(conv_states_all, qkv_mixed, il)
        state = self.build_rs(ssm_states_all, m.n_embd_s, il)
        state = cb(ops.reshape(state, m.head_dim, m.head_dim, H_v, n_s), "state_predelta", il)

        conv_out = cb(ops.ssm_conv(conv_input, conv_kernel), "conv_output_raw", il)
        conv_silu = cb(ops.silu(conv_out), "conv_output_silu", il)
        S, H_k = m.head_dim, m.n_k_heads
        nb1 = 4 * C
        q_conv = cb(ops.view_4d(conv_silu, (S, H_k, n_t, n_s), 4 * S, nb1, nb1 * n_t, 0), "q_conv", il)
        k_conv = cb(ops.view_4d(conv_silu, (S, H_k, n_t, n_s), 4 * S, nb1, nb1 * n_t, 4 * S * H_k), "k_conv", il)
        v_conv = cb(ops.view_4d(conv_silu, (S, H_v, n_t, n_s), 4 * S, nb1, nb1 * n_t, 4 * 2 * S * H_k), "v_conv", il)
        q_conv = cb(ops.l2_norm(q_conv, m.eps), "q_conv_predelta", il)
        k_conv = cb(ops.l2_norm(k_conv, m.eps), "k_conv_predelta", il)
        # fused GDN broadcasts k-heads itself (h % H_k): no REPEAT nodes

        output = self.build_recurrent_attn(ssm_states_all, q_conv, k_conv, v_conv, gate, beta, state, il)

        z_2d = ops.reshape(z, S, H_v, n_t, n_s)
        normalized = ops.mul(ops.rms_norm(output, m.eps), self.weight("ssm_norm.weight", il, DType.F32, (S,)))
        attn_out_norm = ops.mul(normalized, ops.silu(z_2d))
        final_output = cb(ops.reshape(attn_out_norm, m.value_dim, n_t, n_s), "final_output", il)
        cur = cb(ops.mul_mat(self.weight("ssm_out.weight", il, wt, (m.value_dim, E)), final_output),
                 "linear_attn_out", il)
        return ops.reshape(cur, E, n_t * n_s)


def build_verify_graph(cfg: VerifyConfig) -> Graph:
    """The verify forward of ``cfg``'s GDN layers, in llama.cpp's node order, unplanned."""
    cfg.check()
    m = cfg.shape
    graph = Graph()
    b = _LayerBuilder(cfg, graph)
    inpL = ops.new_tensor("inp_embd", DType.F32, (m.n_embd, cfg.n_tokens * cfg.n_seqs), buffer="input",
                          flags=Flag.INPUT, layer=-1)
    taps = set(cfg.dflash_taps())
    for il in cfg.layer_ids():
        inpSA = inpL
        normed = ops.rms_norm(inpL, m.eps)
        normed.layer = il  # its source belongs to the previous layer
        cur = ops.mul(normed, b.weight("attn_norm.weight", il, DType.F32, (m.n_embd,)))
        cur = cb(cur, "attn_norm", il)
        graph.expand(cur)
        cur = b.build_layer_attn_linear(cur, il)
        cur = cb(ops.add(cur, inpSA), "attn_residual", il)
        if cfg.ffn:
            cur = b.build_ffn(cur, il)
        cur = cb(cur, "l_out", il)
        if il in taps:
            ops.set_output(cur)  # a DFlash drafter reads this hidden state
        inpL = cur
    graph.expand(ops.set_output(inpL))
    graph.meta = {"builder": "verify", "config": asdict(cfg), "model": asdict(m), "layers": cfg.layer_ids(),
                  "dflash_taps": sorted(taps), "ids": default_ids(cfg)}
    return graph


def default_ids(cfg: VerifyConfig, read_plane: int = 0, src_cell: int | None = None) -> list[int]:
    """s_copy values: sequence s reads plane ``read_plane`` of cell ``src_cell + s`` (default: its own cell).

    ``s_copy(i) = rs_idx*mem_size + src0`` (llm_graph_input_rs::set_input). Reading plane 0 of the ubatch's own cell
    makes the read row one of the written rows; ``src_cell`` elsewhere makes it not.
    """
    if not 0 <= read_plane <= cfg.n_rs_seq:
        raise GraphError(f"read_plane must be 0..{cfg.n_rs_seq}, is {read_plane}")
    base = cfg.kv_head if src_cell is None else src_cell
    if not 0 <= base + cfg.n_seqs + cfg.n_rs_extra - 1 < cfg.cells:
        raise GraphError(f"src_cell {base} is outside the {cfg.cells} cells")
    n_rs = cfg.n_seqs + cfg.n_rs_extra
    return [read_plane * cfg.cells + base + i for i in range(n_rs)]
