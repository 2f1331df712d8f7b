"""Model shapes and the verify-step configuration: what the builder (:mod:`gdnpass.models.builder`) builds.

:class:`ModelShape` holds a model's hparams (the GGUF ``qwen35.*`` keys of a whole model: the GDN layers, the
full-attention layers, the vocabulary; :mod:`gdnpass.models.gguf_write` writes and reads them), :data:`PRESETS` the
known shapes, :class:`VerifyConfig` one speculative-verify ubatch (tokens, rollback planes, cells, snapshot layout),
:func:`default_ids` the ``s_copy`` input llama.cpp would set for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Callable, Sequence

from gdnpass.ir import DType, GraphError

MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS (llama-hparams.h): it asserts block_count <= this
MAX_SEQS = 256    # llama.cpp's LLAMA_MAX_SEQ (llama-cparams.h): sequences, and so recurrent cells, of a context
MAX_EXPERTS = 1024  # llama.cpp's LLAMA_MAX_EXPERTS (llama-hparams.h): it asserts expert_count <= this


@dataclass(frozen=True)
class ModelShape:
    """A qwen35 model's hyperparameters, as its GGUF file gives them.

    The GDN fields come first (what the verify builder needs); the rest complete a whole model, named after their
    ``qwen35.<key>`` GGUF keys (``attention.head_count`` -> ``head_count``, ``rope.dimension_sections`` ->
    ``rope_dimension_sections``). The GDN fields map to GGUF keys too: ``n_embd`` = embedding_length, ``n_layer`` =
    block_count, ``n_ff`` = feed_forward_length, ``eps`` = attention.layer_norm_rms_epsilon, and the ``ssm.*`` keys are
    the ``ssm_*`` properties below (conv_kernel = d_conv, state_size = head_dim, group_count = n_k_heads,
    time_step_rank = n_v_heads, inner_size = value_dim). The defaults are Qwen3.5-9B's (see PRESETS)."""

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
    # the rest of a whole model (GGUF qwen35.* keys); the full-attention layers' q projection is 2 * head_count *
    # key_length wide (queries and their output gate), as llama.cpp's qwen35 loader reads it
    vocab_size: int = 248320            # qwen35.vocab_size (the token embedding's rows)
    context_length: int = 262144        # qwen35.context_length (n_ctx_train)
    head_count: int = 16                # qwen35.attention.head_count
    head_count_kv: int = 4              # qwen35.attention.head_count_kv
    key_length: int = 256               # qwen35.attention.key_length (attention head size; = value_length)
    value_length: int = 256             # qwen35.attention.value_length
    rope_dimension_count: int = 64      # qwen35.rope.dimension_count (rotary dims: partial_rotary_factor*key_length)
    rope_dimension_sections: tuple[int, int, int, int] = (11, 11, 10, 0)  # qwen35.rope.dimension_sections (pairs)
    rope_freq_base: float = 1e7         # qwen35.rope.freq_base
    tie_embeddings: bool = False        # no output.weight: the output projection is token_embd (llama.cpp's fallback)
    # qwen35.nextn_predict_layers: MTP (NextN) blocks after the trunk's n_layer, blk.<n_layer>.. (block_count counts
    # them too); each is a full-attention block with its nextn.* tensors (docs/mtp.md)
    nextn_predict_layers: int = 0
    # the mixture-of-experts FFN of arch qwen35moe (0 experts: the dense FFN of qwen35), as llama.cpp's qwen35moe
    # loader reads it (src/models/qwen35moe.cpp): n_expert routed experts (expert_count) of width n_ff_exp
    # (expert_feed_forward_length), n_expert_used of them per token (expert_used_count), and one shared expert of
    # width n_ff_shexp (expert_shared_feed_forward_length) behind a sigmoid gate, in every layer (MTP blocks too)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0

    @property
    def arch(self) -> str:
        """The GGUF architecture (``general.architecture``, the prefix of every hparam key): qwen35moe with experts."""
        return "qwen35moe" if self.n_expert else "qwen35"

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def block_count(self) -> int:
        """qwen35.block_count: the trunk's layers and the MTP blocks after them."""
        return self.n_layer + self.nextn_predict_layers

    @property
    def mtp_layer(self) -> int:
        """The block index of the (first) MTP block: llama.cpp's ``hparams.n_layer()``."""
        return self.n_layer

    @property
    def ssm_conv_kernel(self) -> int:
        return self.d_conv

    @property
    def ssm_state_size(self) -> int:
        return self.head_dim

    @property
    def ssm_group_count(self) -> int:
        return self.n_k_heads

    @property
    def ssm_time_step_rank(self) -> int:
        return self.n_v_heads

    @property
    def ssm_inner_size(self) -> int:
        return self.value_dim

    @property
    def attn_layers(self) -> list[int]:
        """The full-attention layers (the complement of :attr:`gdn_layers`)."""
        gdn = set(self.gdn_layers)
        return [i for i in range(self.n_layer) if i not in gdn]

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

    def problems(self, key: Callable[[str], str] = str) -> list[str]:
        """What llama.cpp's qwen35 loader or graph, or gdnpass's builder, could not take in this shape, one phrase per
        problem (empty: a buildable shape). ``key(field)`` names a field in the phrases (read_shape passes the GGUF
        key: ``qwen35.attention.head_count_kv``). The one list of these rules: :meth:`check`, the GGUF writer's
        ``check_shape`` and reader's ``read_shape`` and a graph file's recorded model all apply it."""
        m, k = self, key
        ints = [f.name for f in fields(self) if f.type in ("int", int)]
        bad = [f"{k(f)} must be an integer, is {getattr(m, f)!r}" for f in ints
               if not isinstance(getattr(m, f), int) or isinstance(getattr(m, f), bool)]
        bad += [f"{k(f)} must be a number, is {getattr(m, f)!r}" for f in ("eps", "rope_freq_base")
                if not isinstance(getattr(m, f), (int, float)) or isinstance(getattr(m, f), bool)]
        secs = m.rope_dimension_sections
        if not (isinstance(secs, (tuple, list)) and len(secs) == 4
                and all(isinstance(x, int) and not isinstance(x, bool) for x in secs)):
            bad.append(f"{k('rope_dimension_sections')} must be 4 integers, is {secs!r}")
        if bad:  # (the rules below do arithmetic on the values)
            return bad
        p = [f"{k(f)} must be >= 1, is {getattr(m, f)}" for f in (
            "n_embd", "n_layer", "n_k_heads", "n_v_heads", "head_dim", "head_count", "head_count_kv", "key_length",
            "value_length", "vocab_size", "context_length", "full_attention_interval") if getattr(m, f) < 1]
        if m.n_layer > MAX_LAYERS:
            p.append(f"{k('n_layer')} {m.n_layer} is more than llama.cpp's LLAMA_MAX_LAYERS ({MAX_LAYERS})")
        if m.nextn_predict_layers < 0:
            p.append(f"{k('nextn_predict_layers')} must be >= 0, is {m.nextn_predict_layers}")
        elif m.n_layer <= MAX_LAYERS < m.block_count:
            p.append(f"{k('n_layer')} {m.n_layer} + {k('nextn_predict_layers')} {m.nextn_predict_layers} MTP blocks "
                     f"is more than llama.cpp's LLAMA_MAX_LAYERS ({MAX_LAYERS})")
        p += _moe_problems(m, k)
        if m.d_conv < 2:
            p.append(f"{k('d_conv')} must be >= 2 (a convolution over past tokens), is {m.d_conv}")
        if m.n_ff < 0:
            p.append(f"{k('n_ff')} must be >= 0 (0: 3 * n_embd), is {m.n_ff}")
        for f in ("eps", "rope_freq_base"):
            if not (math.isfinite(getattr(m, f)) and getattr(m, f) > 0):
                p.append(f"{k(f)} must be a finite number > 0, is {getattr(m, f)}")
        if m.key_length != m.value_length:
            p.append(f"{k('key_length')} {m.key_length} != {k('value_length')} {m.value_length} (llama.cpp asserts "
                     "them equal)")
        if m.head_count >= 1 and m.head_count_kv >= 1 and m.head_count % m.head_count_kv:
            p.append(f"{k('head_count')} {m.head_count} is not a multiple of {k('head_count_kv')} "
                     f"{m.head_count_kv}")
        if m.n_k_heads >= 1 and m.n_v_heads % m.n_k_heads:
            p.append(f"{k('n_v_heads')} {m.n_v_heads} is not a multiple of {k('n_k_heads')} {m.n_k_heads}")
        r = m.rope_dimension_count
        if r % 2 or not 0 < r <= m.key_length:
            p.append(f"{k('rope_dimension_count')} {r} must be even and 1..{k('key_length')} {m.key_length}")
        # qwen35 always ropes with interleaved M-RoPE (GGML_ROPE_TYPE_IMROPE), whose CPU kernel asserts a non-empty
        # section among the first three; for text (all position components equal) the split changes nothing
        if any(s < 0 for s in secs) or 2 * sum(secs) != r or not any(secs[:3]):
            p.append(f"{k('rope_dimension_sections')} {list(secs)} must be 4 counts of rotary pairs summing to "
                     f"{k('rope_dimension_count')}/2 = {r // 2}, one of the first three > 0")
        return p

    def check(self) -> None:
        """Raise :class:`GraphError` (one line, every problem) unless the shape is buildable (:meth:`problems`)."""
        p = self.problems()
        if p:
            raise GraphError(f"model {self.name!r}: {'; '.join(p)}")

    def first_layers(self, n: int) -> "ModelShape":
        """The model cut after its first ``n`` layers, in its own pattern: attention layers count (qwen3.5-9b's first
        4 are GDN 0, 1, 2 and attention 3), the embedding, output norm and lm head stay. A cut model has no MTP block
        (it sits after the last layer: blk.<n_layer>)."""
        if not 1 <= n <= self.n_layer:
            raise GraphError(f"{self.name} has {self.n_layer} layers: cannot take the first {n}")
        return self if n == self.n_layer else replace(self, n_layer=n, nextn_predict_layers=0)


def _moe_problems(m: ModelShape, k: Callable[[str], str]) -> list[str]:
    """The expert fields' rules: what llama.cpp's load_hparams asserts (expert_used_count 1..expert_count, at most
    LLAMA_MAX_EXPERTS experts) and what its qwen35moe tensors need (widths >= 1); a dense shape has none of them."""
    moe = ("n_expert_used", "n_ff_exp", "n_ff_shexp")
    if m.n_expert == 0:
        return [f"{k(f)} must be 0 without experts ({k('n_expert')} 0), is {getattr(m, f)}" for f in moe
                if getattr(m, f)]
    p = [] if 1 <= m.n_expert <= MAX_EXPERTS else \
        [f"{k('n_expert')} must be 0..{MAX_EXPERTS} (llama.cpp's LLAMA_MAX_EXPERTS), is {m.n_expert}"]
    if not 1 <= m.n_expert_used <= max(m.n_expert, 1):
        p.append(f"{k('n_expert_used')} must be 1..{k('n_expert')} {m.n_expert}, is {m.n_expert_used}")
    p += [f"{k(f)} must be >= 1, is {getattr(m, f)}" for f in ("n_ff_exp", "n_ff_shexp") if getattr(m, f) < 1]
    return p


# The released models' values are their HF configs' (text_config of Qwen/Qwen3.5-9B, -4B, -27B: hidden_size,
# num_hidden_layers, intermediate_size, num_attention_heads / num_key_value_heads, head_dim 256, linear_* for the GDN
# heads, vocab_size 248320, max_position_embeddings 262144, rms_norm_eps 1e-6, rope_parameters {rope_theta 1e7,
# partial_rotary_factor 0.25 -> 64 of 256 dims rotate, mrope_interleaved, mrope_section [11, 11, 10]},
# tie_word_embeddings below 9B only), as transformers' Qwen3_5TextConfig defaults (= 9B) and public copies of the
# configs give them (vLLM's qwen3_5 config; slime's scripts/models/qwen3.5-27B.sh), mapped to GGUF keys as llama.cpp's
# converter maps them (conversion/qwen.py at 0c1e570: Qwen3NextModel.set_gguf_parameters writes rope.dimension_count =
# head_dim * partial_rotary_factor; _Qwen35MRopeMixin pads the sections to 4, default [11, 11, 10, 0]).
# Qwen3-Next-80B-A3B: 16 / 2 heads of 256, the same rope base and partial rotation, vocab 151936, plain RoPE.
# GDN shapes also in reference/kernels-and-matchers.md A4.
_QWEN35 = dict(vocab_size=248320, context_length=262144, key_length=256, value_length=256, rope_dimension_count=64,
               rope_dimension_sections=(11, 11, 10, 0), rope_freq_base=1e7)
# The tiny-qwen35* shapes are whole models small enough to write as GGUF files in well under a second that llama.cpp
# loads and runs (gdnpass.models.gguf_write; docs/gguf.md); sections sum to rope_dimension_count / 2.
_TINY = dict(vocab_size=512, context_length=4096)

PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in [
        ModelShape("qwen3.5-9b", n_embd=4096, n_layer=32, n_k_heads=16, n_v_heads=32, head_dim=128, n_ff=12288,
                   head_count=16, head_count_kv=4, **_QWEN35),
        ModelShape("qwen3.5-4b", n_embd=2560, n_layer=32, n_k_heads=16, n_v_heads=32, head_dim=128, n_ff=9216,
                   head_count=16, head_count_kv=4, tie_embeddings=True, **_QWEN35),
        ModelShape("qwen3.5-27b", n_embd=5120, n_layer=64, n_k_heads=16, n_v_heads=48, head_dim=128, n_ff=17408,
                   head_count=24, head_count_kv=4, **_QWEN35),
        # Qwen3-Next's FFN is a mixture of experts; a dense FFN of the shared expert's width stands in for it. It
        # ropes without M-RoPE; as a qwen35 stand-in it keeps Qwen3.5's sections (for text the same rotation)
        ModelShape("qwen3-next-80b", n_embd=2048, n_layer=48, n_k_heads=16, n_v_heads=32, head_dim=128, n_ff=512,
                   head_count=16, head_count_kv=2, vocab_size=151936,
                   **{k: v for k, v in _QWEN35.items() if k != "vocab_size"}),
        # small shapes for tests and the exactness sweep: d_conv 3-5, head size 32-128
        ModelShape("tiny-dc3-h32", n_embd=64, n_layer=4, n_k_heads=2, n_v_heads=4, head_dim=32, d_conv=3),
        ModelShape("tiny-dc4-h64", n_embd=64, n_layer=4, n_k_heads=1, n_v_heads=2, head_dim=64, d_conv=4),
        ModelShape("tiny-dc5-h128", n_embd=64, n_layer=4, n_k_heads=1, n_v_heads=1, head_dim=128, d_conv=5),
        ModelShape("tiny-dc4-h32", n_embd=96, n_layer=4, n_k_heads=2, n_v_heads=2, head_dim=32, d_conv=4),
        ModelShape("tiny-dc4-h128", n_embd=64, n_layer=4, n_k_heads=1, n_v_heads=2, head_dim=128, d_conv=4),
        # tiny-dc4-h64 at n_embd 128 with an FFN of 1024 x 128, whose gate / up pair's tile splits K (two steps of
        # 64) at 2-8 columns in bf16: a shape the pair's SwiGLU epilogue fuses on (pair_glu's rule pair-glu.tile)
        ModelShape("tiny-dc4-h64-ff1024", n_embd=128, n_layer=4, n_k_heads=1, n_v_heads=2, head_dim=64, d_conv=4,
                   n_ff=1024),
        # the same at n_embd 512: its FFN pair's tile splits K in Q8_0 too (two steps of 256), where the pair hands
        # its SwiGLU on as the down product's q8_1 activations (pair_glu's rule pair-glu.type, gdnpass.prepasses)
        ModelShape("tiny-dc4-h64-e512", n_embd=512, n_layer=4, n_k_heads=1, n_v_heads=2, head_dim=64, d_conv=4,
                   n_ff=1024),
        # whole tiny models for llama.cpp captures (GGUF files of 9.6 and 7.4 MiB in f32): layers 3 (and 7) are full
        # attention. a: GDN 2 k-heads / 4 v-heads of 32, attention 4 / 2 KV heads of 64 (16 rotary dims);
        # b: GDN 1 / 2 heads of 64, attention 8 / 1 KV heads of 32 (8 rotary dims), 8 layers
        ModelShape("tiny-qwen35", n_embd=256, n_layer=4, n_k_heads=2, n_v_heads=4, head_dim=32, n_ff=512,
                   head_count=4, head_count_kv=2, key_length=64, value_length=64, rope_dimension_count=16,
                   rope_dimension_sections=(3, 3, 2, 0), **_TINY),
        ModelShape("tiny-qwen35-b", n_embd=128, n_layer=8, n_k_heads=1, n_v_heads=2, head_dim=64, n_ff=384,
                   head_count=8, head_count_kv=1, key_length=32, value_length=32, rope_dimension_count=8,
                   rope_dimension_sections=(2, 1, 1, 0), rope_freq_base=1e6, **_TINY),
        # Qwen3.5-35B-A3B (arch qwen35moe): the published shape as slime's scripts/models/qwen3.5-35B-A3B.sh (THUDM/
        # slime) and transformers' Qwen3_5MoeTextConfig defaults (its docstring: "the Qwen3.5-35B-A3B style
        # configuration") give it: 40 layers of 2048, attention every 4th (16 / 2 heads of 256, 25 % rotary, base
        # 1e7), GDN 16 / 32 heads of 128, d_conv 4, 256 experts of 512 with 8 used per token, one shared expert of
        # 512 (its sigmoid gate: moe-shared-expert-gate), vocab 248320, untied. feed_forward_length (HF's dense
        # intermediate_size, 5632 in the config class) is read by no qwen35moe layer; context as the Qwen3.5 family's
        ModelShape("qwen3.5-35b-a3b", n_embd=2048, n_layer=40, n_k_heads=16, n_v_heads=32, head_dim=128, n_ff=5632,
                   head_count=16, head_count_kv=2, n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512,
                   **_QWEN35),
        # a whole tiny qwen35moe for llama.cpp captures: tiny-qwen35's trunk with 8 experts of 128 (2 used) and a
        # shared expert of 192 (widths unlike each other and n_embd, so a swapped dimension shows)
        ModelShape("tiny-qwen35moe", n_embd=256, n_layer=4, n_k_heads=2, n_v_heads=4, head_dim=32, n_ff=512,
                   head_count=4, head_count_kv=2, key_length=64, value_length=64, rope_dimension_count=16,
                   rope_dimension_sections=(3, 3, 2, 0), n_expert=8, n_expert_used=2, n_ff_exp=128, n_ff_shexp=192,
                   **_TINY),
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

# How q and k are normalised after the conv (issue 14):
#   l2   one L2_NORM(x, eps) per tensor: the seed's fork;
#   rms  upstream llama.cpp's build_gdn_l2_norm (src/models/models.h, 0c1e570), RMS_NORM then SCALE:
#        ggml_scale(ggml_rms_norm(x, eps/n), 1.0f/sqrtf(n)) with n = x->ne[0] (the head size) as a float; the same
#        direction as L2_NORM (x / sqrt(Σx² + eps)), other rounding. Params: qk_rms_params.
# The default is upstream's form; "l2" reproduces the seed (its tests and the seed-reproduction sweep use it).
QK_NORMS = ("l2", "rms")
DEFAULT_QK_NORM = "rms"


def qk_rms_params(eps: float, n: int) -> tuple[float, float]:
    """(RMS_NORM eps, SCALE s) of build_gdn_l2_norm for rows of ``n`` elements, computed as the C code computes them,
    in float32 (``const float n = x->ne[0]``; ``eps/n``; ``1.0f/sqrtf(n)``; eps is ``hparams.f_norm_rms_eps``, a
    float), returned as the f32 values ggml stores in op_params. n = 32, eps = 1e-6: (3.125e-8 in f32,
    1/sqrtf(32) = 0.17677669...)."""
    import numpy as np  # here: building a graph needs no numpy otherwise

    nf = np.float32(n)
    return float(np.float32(eps) / nf), float(np.float32(1.0) / np.sqrt(nf))


MAX_UBATCH = 512  # tokens of each sequence in one ubatch the builder makes (llama.cpp's default n_ubatch)
MAX_RS_SEQ = 15   # rollback planes beyond plane 0 (a verify of up to 16 tokens)


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
    qk_norm: str = DEFAULT_QK_NORM  # q/k normalisation: "l2" (L2_NORM) or "rms" (upstream's RMS_NORM + SCALE)
    # the whole forward (issue 17): token embedding, every layer (full attention too), output norm, lm head
    whole: bool = False
    kv_size: int = 256         # KV cache cells of each stream (llama.cpp: n_ctx_seq, n_ctx / n_stream padded to 256)
    # one KV stream for all sequences (llama_context_params.kv_unified), else one per sequence: llama.cpp's default
    kv_unified: bool = False
    # the context's sequences (llama_context_params.n_seq_max; None: just this ubatch's n_seqs): the KV cache has a
    # stream for each unless unified. The ubatch's sequences are seq0 .. seq0 + n_seqs - 1 (llama.cpp's sequential
    # split_equal takes consecutive ids), and so are its KV streams
    n_seq_max: int | None = None
    seq0: int = 0
    n_kv: int = 256            # cells the attention reads (llama.cpp pads the used cells to 256, at most kv_size)
    flash_attn: bool = True    # FLASH_ATTN_EXT (llama.cpp's CPU "auto"), else MUL_MAT + SOFT_MAX + MUL_MAT
    n_past: int = 0            # tokens in the KV cache before this ubatch (its first position)
    n_outputs: int | None = None  # rows with logits, the ubatch's last (None: every token, as a verify asks; 0: none,
                                  # as llama.cpp's prefill asks: the lm head then has no columns)
    # the MTP head instead of the trunk (issue 35): llama.cpp's LLAMA_CONTEXT_TYPE_MTP graph (qwen35.cpp graph_mtp)
    # of one ubatch, its own KV cache of the one MTP block (whole forward settings: kv_size, n_kv, n_past, n_outputs)
    mtp: bool = False

    def check(self) -> None:
        m = get_model(self.model)
        _need(1 <= self.n_tokens <= MAX_UBATCH, "n_tokens", f"must be 1..{MAX_UBATCH}, is {self.n_tokens}")
        _need(0 <= self.n_rs_seq <= MAX_RS_SEQ, "n_rs_seq", f"must be 0..{MAX_RS_SEQ}, is {self.n_rs_seq}")
        m.check()
        _need(1 <= self.n_seqs <= MAX_SEQS, "n_seqs", f"must be 1..{MAX_SEQS} (llama.cpp's LLAMA_MAX_SEQ), is "
                                                       f"{self.n_seqs}")
        _need(self.n_seqs <= self.seq_max <= MAX_SEQS, "n_seq_max",
              f"must be n_seqs ({self.n_seqs})..{MAX_SEQS}, is {self.n_seq_max}")
        _need(0 <= self.seq0 <= self.seq_max - self.n_seqs, "seq0",
              f"sequences {self.seq0}..{self.seq0 + self.n_seqs - 1} are not all among the context's {self.seq_max}")
        n_gdn = len(m.gdn_layers)
        _need(self.n_layers is None or 1 <= self.n_layers <= n_gdn, "n_layers",
              f"must be 1..{n_gdn} for {m.name}, is {self.n_layers}")
        _need(self.n_rs_extra >= 0, "n_rs_extra", f"must be >= 0, is {self.n_rs_extra}")
        _need(self.kv_head >= 0, "kv_head", f"must be >= 0, is {self.kv_head}")
        _need(self.cells >= self.kv_head + self.n_seqs + self.n_rs_extra, "mem_size",
              f"{self.cells} cells cannot hold kv_head {self.kv_head} + {self.n_seqs + self.n_rs_extra} used cells")
        _need(self.cells <= MAX_SEQS, "mem_size", f"{self.cells} recurrent cells: at most {MAX_SEQS} (one per "
                                                  "sequence, llama.cpp's LLAMA_MAX_SEQ)")
        _need(-1 <= self.rs_z < self.cells, "rs_z", f"must be -1..{self.cells - 1}, is {self.rs_z}")
        _need(self.snapshot_layout in SNAPSHOT_LAYOUTS, "snapshot_layout",
              f"must be one of {', '.join(SNAPSHOT_LAYOUTS)}, is {self.snapshot_layout!r}")
        _need(self.qk_norm in QK_NORMS, "qk_norm", f"must be one of {', '.join(QK_NORMS)}, is {self.qk_norm!r}")
        if self.whole:
            _need(self.n_layers is None, "n_layers", "a whole forward builds every layer (leave n_layers unset)")
            _need(1 <= self.n_kv <= self.kv_size, "n_kv", f"must be 1..kv_size ({self.kv_size}), is {self.n_kv}")
            _need(0 <= self.n_past and self.n_past + self.n_tokens <= self.n_kv, "n_past",
                  f"{self.n_past} + {self.n_tokens} tokens do not fit n_kv {self.n_kv}")
        if self.mtp:
            _need(self.whole, "mtp", "the MTP head is a whole graph of its own (set whole too)")
            _need(m.nextn_predict_layers == 1, "mtp", f"model {m.name!r} has {m.nextn_predict_layers} MTP blocks "
                  "(nextn_predict_layers); llama.cpp's qwen35 MTP graph runs exactly one")
            _need(self.n_seqs == 1, "n_seqs", "the MTP head is built for one sequence")
        n_t = self.n_tokens * self.n_seqs
        _need(self.n_outputs is None or (self.whole and 0 <= self.n_outputs <= n_t), "n_outputs",
              f"must be 0..{n_t} tokens of a whole forward (None: all), is {self.n_outputs}")
        for f in ("wtype", "ab_wtype"):
            _need(DType.parse(getattr(self, f)) is not DType.I32, f, "weights cannot be i32")

    @property
    def outputs(self) -> int:
        """Rows of logits the ubatch computes (the lm head's columns)."""
        return self.n_tokens * self.n_seqs if self.n_outputs is None else self.n_outputs

    @property
    def seq_max(self) -> int:
        """The context's sequences (``n_seq_max``, default: this ubatch's)."""
        return self.n_seqs if self.n_seq_max is None else self.n_seq_max

    @property
    def n_stream(self) -> int:
        """The ubatch's KV streams (llama.cpp's slot_info ``s1 - s0 + 1``): one per sequence unless unified."""
        return 1 if self.kv_unified else self.n_seqs

    @property
    def kv_streams(self) -> int:
        """The KV cache's streams (llama_kv_cache's n_stream): one per sequence of the context unless unified."""
        return 1 if self.kv_unified else self.seq_max

    @property
    def stream0(self) -> int:
        """The ubatch's first KV stream (slot_info's s0)."""
        return 0 if self.kv_unified else self.seq0

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
        """The GDN layers whose outputs a DFlash drafter reads: up to five, spread over the stack. (A whole forward
        flags layer inputs instead, as upstream does: :func:`dflash_target_layers`.)

        (The last layer's output is the graph output anyway.)"""
        ids = self.layer_ids()[:-1]
        if not self.dflash or not ids:
            return []
        n = min(5, len(ids))
        return sorted({ids[round(i * (len(ids) - 1) / max(1, n - 1))] for i in range(n)})


def dflash_target_layers(n_layer: int, n_draft: int = 5) -> list[int]:
    """The target layers whose outputs a DFlash drafter of ``n_draft`` layers reads, by DFlash's published rule
    (sglang's and DFlash's own code): round(1 + i (N - 4) / (D - 1)) for i = 0..D-1, N // 2 for one layer. For 32
    layers and 5: 1, 8, 15, 22, 29. llama.cpp reads them as layer *inputs*: ``t_layer_inp[l + 1]`` (llama-graph.cpp,
    the drafter's ``dflash.target_layers``)."""
    if n_draft == 1:
        return [n_layer // 2]
    return [int(1 + i * (n_layer - 4) / (n_draft - 1) + 0.5) for i in range(n_draft)]


def _need(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise GraphError(f"config field {field!r}: {msg}")


def default_ids(cfg: VerifyConfig, read_plane: int | Sequence[int] = 0, src_cell: int | None = None) -> list[int]:
    """s_copy values: sequence s reads plane ``read_plane`` (one for all, or one per sequence of the ubatch: each
    its own rollback index, llama.cpp's ``rs_idx[seq]``) of cell ``src_cell + s`` (default: its own cell).

    ``s_copy(i) = rs_idx*mem_size + src0`` (llm_graph_input_rs::set_input). Reading plane 0 of the ubatch's own cell
    makes the read row one of the written rows; ``src_cell`` elsewhere makes it not. The extra rows (n_rs_extra)
    read ``read_plane`` when it is one for all, else plane 0.
    """
    planes = [read_plane] * cfg.n_seqs if isinstance(read_plane, int) else list(read_plane)
    if len(planes) != cfg.n_seqs:
        raise GraphError(f"read_plane: {len(planes)} planes for a ubatch of {cfg.n_seqs} sequences")
    bad = [p for p in planes if not 0 <= p <= cfg.n_rs_seq]
    if bad:
        raise GraphError(f"read_plane must be 0..{cfg.n_rs_seq}, is {bad[0]}")
    base = cfg.kv_head if src_cell is None else src_cell
    if not 0 <= base + cfg.n_seqs + cfg.n_rs_extra - 1 < cfg.cells:
        raise GraphError(f"src_cell {base} is outside the {cfg.cells} cells")
    planes += [read_plane if isinstance(read_plane, int) else 0] * cfg.n_rs_extra
    return [p * cfg.cells + base + i for i, p in enumerate(planes)]


# ---- what a graph's meta records for execution (builder.verify_meta writes it; a graph file carries it) -----------
def config_from_meta(meta: dict) -> VerifyConfig | None:
    """The whole-forward :class:`VerifyConfig` a graph's meta records (``meta.config`` with ``whole`` true and its
    ``meta.model``), checked as a built one is; None when the meta records none or not a whole forward (then only
    ``meta.ids`` matters for execution). GraphError, one line naming the meta field, for anything else."""
    c = meta.get("config")
    if c is None:
        return None
    if not isinstance(c, dict):
        raise GraphError(f"meta.config must be an object (a VerifyConfig), not {type(c).__name__}")
    if c.get("whole") is not True:
        return None
    m = meta.get("model")
    if not isinstance(m, dict):
        raise GraphError("meta.model must be an object (the ModelShape of a whole forward's meta.config), not "
                         f"{type(m).__name__}")
    try:
        secs = m.get("rope_dimension_sections")
        shape = ModelShape(**{**m, **({"rope_dimension_sections": tuple(secs)} if isinstance(secs, list) else {})})
        p = shape.problems(lambda f: f"meta.model.{f}")
        if p:
            raise GraphError("; ".join(p))
        cfg = VerifyConfig(**{**c, "model": shape})
        try:
            cfg.check()
        except GraphError as e:  # ("config field 'n_tokens': ...")
            raise GraphError(f"meta.{e}") from None
    except (TypeError, ValueError) as e:  # unknown or missing fields, values of the wrong type (GraphError: raised)
        if isinstance(e, GraphError):
            raise
        raise GraphError(f"meta.config / meta.model do not make a VerifyConfig: {e}") from None
    return cfg


def ids_from_meta(meta: dict) -> list[int] | None:
    """``meta.ids``, the ``rs_s_copy`` values a graph records (:func:`default_ids` for a built one): a list of ints,
    or None when absent; GraphError otherwise."""
    ids = meta.get("ids")
    if ids is not None and not (isinstance(ids, list)
                                and all(isinstance(x, int) and not isinstance(x, bool) for x in ids)):
        raise GraphError(f"meta.ids must be a list of integers (rs_s_copy's row ids), is {ids!r}"[:200])
    return ids


def check_meta(meta: dict) -> None:
    """The meta fields execution reads, checked as it reads them (a graph file's meta is otherwise free-form):
    ``config``/``model`` (:func:`config_from_meta`), ``ids`` (:func:`ids_from_meta`) and ``input_bytes`` (a
    capture's inputs: input name -> base64 text). GraphError, one line naming the field."""
    config_from_meta(meta)
    ids_from_meta(meta)
    rec = meta.get("input_bytes")
    if rec is not None and not (isinstance(rec, dict) and all(isinstance(v, str) for v in rec.values())):
        raise GraphError("meta.input_bytes must be an object of input name -> base64 text")
