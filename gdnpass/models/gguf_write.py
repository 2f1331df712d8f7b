"""Write a :class:`~gdnpass.models.hparams.ModelShape` as a qwen35 GGUF model file with random weights, and read the
shape of a qwen35 GGUF file back.

:func:`write_gguf` writes what llama.cpp's qwen35 loader (src/models/qwen35.cpp at 0c1e570, ``load_arch_hparams`` /
``load_arch_tensors``) asks for: the ``qwen35.*`` hparams, a vocabulary (by default a small real byte-level BPE
tokenizer, Qwen's kind, trained on ``bpe_corpus.txt`` and padded to the shape's vocab_size: :func:`bpe_vocab`; or,
with ``tokenizer="none"``, none at all: token ids are fed directly) and every tensor of the trunk, under llama.cpp's
names and shapes. The weights are random but tame (matrices uniform with std 0.02, norms near 1, ``ssm_a`` in
[-1, -0.1], ``ssm_dt.bias`` small), so a forward stays finite at any depth; the same shape, type and seed give the
same bytes. Tensors are generated and written in chunks, so a full-size shape (qwen3.5-9b: 18 GB in bf16) needs
little memory.

:func:`read_shape` reads only a file's header (its metadata and tensor infos, through :class:`gguf.GGUFReader`)
and maps the keys back to a :class:`ModelShape`; write -> read gives the shape written (:data:`GGUF_KEYS` is the one
mapping both use). :func:`open_reader` is a ``GGUFReader`` that reads long arrays (a 248k-token vocabulary) in about a
second rather than half a minute. See docs/gguf.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from gdnpass import tokenizer as tok
from gdnpass.errors import GdnpassError
from gdnpass.models.gguf_read import GGML_MAX_DIMS, _INTS, GgufError, _gguf, _Header, open_reader  # noqa: F401 (re-exported)
from gdnpass.models.hparams import MAX_LAYERS, ModelShape, get_model

ARCH = "qwen35"
MOE_ARCH = "qwen35moe"  # Qwen3.5's MoE models: the same trunk, a mixture-of-experts FFN (ModelShape.n_expert > 0)
ARCHS = (ARCH, MOE_ARCH)
WTYPES = ("f32", "f16", "bf16", "q8_0")
Q8_0_BLOCK = (32, 34)  # Q8_0: 32 values per block of 34 bytes (an f16 scale, 32 int8)
_CHUNK = 1 << 23  # elements generated and written at a time


# ---- the metadata: ModelShape field (or property) <-> qwen35.* key -------------------------------------------------
# (GGUF key without the "qwen35." prefix, ModelShape attribute, value type, required when reading); the GDN fields
# keep their builder names and map to their keys here.
GGUF_KEYS: tuple[tuple[str, str, str, bool], ...] = (
    ("context_length", "context_length", "u32", True),
    ("embedding_length", "n_embd", "u32", True),
    ("block_count", "block_count", "u32", True),  # n_layer + nextn_predict_layers
    ("feed_forward_length", "ffn_dim", "u32", True),
    ("vocab_size", "vocab_size", "u32", False),
    ("attention.head_count", "head_count", "u32", True),
    ("attention.head_count_kv", "head_count_kv", "u32", False),
    ("attention.key_length", "key_length", "u32", False),
    ("attention.value_length", "value_length", "u32", False),
    ("attention.layer_norm_rms_epsilon", "eps", "f32", True),
    ("rope.dimension_count", "rope_dimension_count", "u32", False),
    ("rope.dimension_sections", "rope_dimension_sections", "i32[4]", True),
    ("rope.freq_base", "rope_freq_base", "f32", False),
    ("ssm.conv_kernel", "ssm_conv_kernel", "u32", True),
    ("ssm.state_size", "ssm_state_size", "u32", True),
    ("ssm.group_count", "ssm_group_count", "u32", True),
    ("ssm.time_step_rank", "ssm_time_step_rank", "u32", True),
    ("ssm.inner_size", "ssm_inner_size", "u32", True),
    ("full_attention_interval", "full_attention_interval", "u32", False),
)
# the expert keys a qwen35moe file adds (llama.cpp reads expert_count and expert_used_count in load_hparams for
# every arch, the widths in qwen35moe's load_arch_hparams; both widths optional there, defaulted in load_arch_tensors
# to feed_forward_length / expert_used_count and feed_forward_length: read_shape applies those defaults)
MOE_KEYS: tuple[tuple[str, str, str, bool], ...] = (
    ("expert_count", "n_expert", "u32", True),
    ("expert_used_count", "n_expert_used", "u32", True),
    ("expert_feed_forward_length", "n_ff_exp", "u32", False),
    ("expert_shared_feed_forward_length", "n_ff_shexp", "u32", False),
)


def shape_keys(shape: ModelShape) -> tuple[tuple[str, str, str, bool], ...]:
    """The hparam keys of ``shape``'s arch (without the arch prefix), in writing order."""
    return GGUF_KEYS + (MOE_KEYS if shape.is_moe else ())


_FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}  # gguf.LlamaFileType ALL_F32, MOSTLY_F16, _BF16, _Q8_0


def gguf_metadata(shape: ModelShape) -> dict[str, Any]:
    """The ``<arch>.*`` key/values :func:`write_gguf` writes for ``shape`` (full key names, in writing order; arch
    qwen35, or qwen35moe for a shape with experts)."""
    a = shape.arch
    out = {f"{a}.{key}": (list(getattr(shape, attr)) if typ.endswith("]") else getattr(shape, attr))
           for key, attr, typ, _ in shape_keys(shape)}
    if shape.nextn_predict_layers:  # (only when there are MTP blocks: a trunk-only file's bytes are unchanged)
        out[f"{a}.nextn_predict_layers"] = shape.nextn_predict_layers
    return out


# GGUF key (without "qwen35.") of each ModelShape field, for messages about a file (GGUF_KEYS names some fields by
# the properties that alias them: ffn_dim is n_ff, ssm_conv_kernel is d_conv, ...)
_ALIASES = {"block_count": "n_layer", "ffn_dim": "n_ff", "ssm_conv_kernel": "d_conv", "ssm_state_size": "head_dim",
            "ssm_group_count": "n_k_heads", "ssm_time_step_rank": "n_v_heads"}
NEXTN_KEY = f"{ARCH}.nextn_predict_layers"  # the MTP blocks after the trunk (written when there are any)


def field_keys(arch: str = ARCH) -> dict[str, str]:
    """ModelShape field -> its full GGUF key in a file of ``arch``."""
    return {_ALIASES.get(attr, attr): f"{arch}.{key}" for key, attr, _, _ in GGUF_KEYS + MOE_KEYS} | \
        {"nextn_predict_layers": f"{arch}.nextn_predict_layers"}


FIELD_KEYS = field_keys(ARCH)


def check_shape(shape: ModelShape) -> None:
    """Raise :class:`GgufError` if llama.cpp's qwen35 (qwen35moe) loader or graph could not take ``shape``
    (:meth:`ModelShape.problems`, the one list of those rules)."""
    problems = shape.problems()
    if problems:
        raise GgufError(f"model {shape.name!r} cannot be a {shape.arch} GGUF: {'; '.join(problems)}")


# ---- the tokenizer: a small real byte-level BPE, Qwen's kind -------------------------------------------------------
TOKENIZERS = ("bpe", "none")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen's first three, control tokens
MAX_MERGES = 512  # the trainer's cap; bpe_corpus.txt has 385 pairs seen at least twice
CORPUS = Path(__file__).with_name("bpe_corpus.txt")


@dataclasses.dataclass(frozen=True)
class BpeVocab:
    """A vocabulary :func:`write_gguf` writes: token texts (byte-level), their llama_token_type, the merges
    ("left right", by rank) and the special ids."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    eos: int  # <|endoftext|>: also bos and pad, as in Qwen's files (add_bos_token false)
    im_start: int
    eot: int  # <|im_end|>

    @property
    def n_bpe(self) -> int:
        """Tokens the BPE can produce: the 256 bytes and the merges' results."""
        return self.eos


@lru_cache(maxsize=1)
def trained_merges() -> tuple[tuple[str, str], ...]:
    """The merges tokenizers' BpeTrainer learns from :data:`CORPUS` under the qwen35 pre-tokenizer (pairs seen at
    least twice, at most :data:`MAX_MERGES`). Deterministic: the trainer breaks ties between equally frequent pairs
    by their ids, which follow its sorted alphabet (checked across processes by tests/test_tokenizer.py)."""
    tk = tok._tokenizers()
    hf = tk.Tokenizer(tk.models.BPE())
    hf.pre_tokenizer = tok.pre_tokenizer("qwen35")
    trainer = tk.trainers.BpeTrainer(vocab_size=256 + MAX_MERGES, min_frequency=2, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator([CORPUS.read_text(encoding="utf-8")], trainer)
    return tuple(tuple(m) for m in json.loads(hf.to_str())["model"]["merges"])  # type: ignore[misc]


def bpe_vocab(vocab_size: int) -> BpeVocab:
    """The byte-level BPE vocabulary of ``vocab_size`` tokens that :func:`write_gguf` writes by default.

    Ids 0..255 are the bytes 0..255 (GPT-2's byte characters), then the tokens the merges make, in merge order, then
    :data:`SPECIAL_TOKENS` (CONTROL), then fillers ``[PAD<id>]`` (UNUSED, as llama.cpp's converter pads Qwen's
    vocabulary: llama.cpp never produces them from text and renders them as nothing). When ``vocab_size`` cannot hold
    every merge (tiny-qwen35's 512: 253 of 385), the merges are cut to the first ones that fit; under 259 (bytes and
    specials) it is a GgufError."""
    merges = trained_merges()
    tokens = list(tok.byte_chars())
    room = vocab_size - len(tokens) - len(SPECIAL_TOKENS)
    if room < 0:
        raise GgufError(f"vocab_size {vocab_size} is too small for the byte-level BPE tokenizer (256 bytes + "
                        f"{len(SPECIAL_TOKENS)} special tokens); write it with tokenizer='none'")
    known, kept = set(tokens), []
    for a, b in merges:
        if a + b not in known:
            if len(tokens) - 256 == room:
                break
            tokens.append(a + b)
            known.add(a + b)
        kept.append(f"{a} {b}")
    n_bpe = len(tokens)
    tokens += SPECIAL_TOKENS
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    n_pad = len(tokens) - n_bpe - len(SPECIAL_TOKENS)
    types = [tok.NORMAL] * n_bpe + [tok.CONTROL] * len(SPECIAL_TOKENS) + [tok.UNUSED] * n_pad
    return BpeVocab(tokens, types, kept, eos=n_bpe, im_start=n_bpe + 1, eot=n_bpe + 2)


def tokenizer_metadata(vocab_size: int, kind: str = "bpe") -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` key/values :func:`write_gguf` writes (``kind`` "bpe" or "none"), in writing order."""
    if kind == "none":
        return {"tokenizer.ggml.model": "none"}
    v = bpe_vocab(vocab_size)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": v.tokens,
            "tokenizer.ggml.token_type": v.types, "tokenizer.ggml.merges": v.merges,
            "tokenizer.ggml.bos_token_id": v.eos, "tokenizer.ggml.eos_token_id": v.eos,
            "tokenizer.ggml.eot_token_id": v.eot, "tokenizer.ggml.padding_token_id": v.eos,
            "tokenizer.ggml.add_bos_token": False}


def _pack_long_arrays(w) -> None:
    """Make GGUFWriter ``w`` pack long arrays of strings or ints in one go (it packs them value by value: 1.5 s for
    a 248k-token vocabulary); the bytes are the same."""
    gguf = _gguf()
    V, pack_val = gguf.GGUFValueType, w._pack_val

    def pack(val, vtype, add_vtype, sub_type=None):
        if vtype == V.ARRAY and sub_type is None and len(val) > 64 and w.endianess == gguf.GGUFEndian.LITTLE:
            head = struct.pack("<I", V.ARRAY) if add_vtype else b""
            if all(type(x) is str for x in val):
                enc = [x.encode() for x in val]
                return head + struct.pack("<IQ", V.STRING, len(val)) + b"".join(
                    struct.pack("<Q", len(b)) + b for b in enc)
            if all(type(x) is int for x in val):  # (GGUFValueType.get_type: a Python int is an INT32)
                return head + struct.pack("<IQ", V.INT32, len(val)) + np.asarray(val, dtype="<i4").tobytes()
        return pack_val(val, vtype, add_vtype, sub_type)

    w._pack_val = pack


# ---- the tensors: llama.cpp's names and shapes, and how each is filled ---------------------------------------------
# A tensor is (name, numpy shape (ne reversed), kind); kind picks the type and the values.
def tensor_plan(shape: ModelShape, nextn: tuple[str, ...] = ("shared_head_norm",)) -> list[tuple[str, tuple[int, ...],
                                                                                                 str]]:
    """Every tensor of the model in writing order: (name, numpy shape = ggml ne reversed, kind), kind one of
    "mat" (a projection, ``wtype``), "ab" (ssm_alpha/beta, ``ab_wtype``), "norm", "conv", "dt", "a", "gate" (the
    router and the shared expert's gate: f32, as llama.cpp's converter keeps FFN_GATE_INP). The trunk,
    then the ``nextn_predict_layers`` MTP blocks (blk.<n_layer>..) as llama.cpp's qwen35 ``load_block_mtp`` reads
    them: a full-attention block and its ``nextn.*`` tensors, with the optional ones named in ``nextn``
    (:data:`NEXTN_OPTIONAL`: ``shared_head_norm``, ``embed_tokens``, ``shared_head_head``; default the head's own
    norm alone)."""
    m = shape
    E, V, F = m.n_embd, m.vocab_size, m.ffn_dim
    qd, kvd = m.head_count * m.key_length, m.head_count_kv * m.key_length
    t: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (V, E), "mat"),
                                                 ("output_norm.weight", (E,), "norm")]
    if not m.tie_embeddings:
        t.append(("output.weight", (V, E), "mat"))

    def attention(b: str) -> list[tuple[str, tuple[int, ...], str]]:
        return [(b + "attn_q.weight", (2 * qd, E), "mat"),  # queries and their sigmoid output gate
                (b + "attn_k.weight", (kvd, E), "mat"),
                (b + "attn_v.weight", (m.head_count_kv * m.value_length, E), "mat"),
                (b + "attn_output.weight", (E, qd), "mat"),
                (b + "attn_q_norm.weight", (m.key_length,), "norm"),
                (b + "attn_k_norm.weight", (m.key_length,), "norm")]

    dense = lambda b: [(b + "ffn_gate.weight", (F, E), "mat"), (b + "ffn_down.weight", (E, F), "mat"),  # noqa: E731
                       (b + "ffn_up.weight", (F, E), "mat")]
    ffn = moe_ffn_tensors(m) if m.is_moe else dense
    gdn = set(m.gdn_layers)
    for il in range(m.n_layer):
        b = f"blk.{il}."
        t += [(b + "attn_norm.weight", (E,), "norm"), (b + "post_attention_norm.weight", (E,), "norm")]
        if il in gdn:
            H = m.n_v_heads
            t += [(b + "attn_qkv.weight", (m.conv_channels, E), "mat"),
                  (b + "attn_gate.weight", (m.value_dim, E), "mat"),
                  (b + "ssm_conv1d.weight", (m.conv_channels, m.d_conv), "conv"),
                  (b + "ssm_dt.bias", (H,), "dt"),
                  (b + "ssm_a", (H,), "a"),  # LLM_TENSOR_SSM_A_NOSCAN: no .weight suffix
                  (b + "ssm_beta.weight", (H, E), "ab"),
                  (b + "ssm_alpha.weight", (H, E), "ab"),
                  (b + "ssm_norm.weight", (m.head_dim,), "norm"),
                  (b + "ssm_out.weight", (E, m.value_dim), "mat")]
        else:
            t += attention(b)
        t += ffn(b)
    for il in range(m.n_layer, m.block_count):  # the MTP blocks: always full attention, then their nextn.* tensors
        b = f"blk.{il}."
        t += [(b + "attn_norm.weight", (E,), "norm"), (b + "post_attention_norm.weight", (E,), "norm"),
              *attention(b), *ffn(b),
              (b + "nextn.eh_proj.weight", (E, 2 * E), "mat"),  # [2E -> E]: the concat of the two normed inputs
              (b + "nextn.enorm.weight", (E,), "norm"),          # the next token's embedding's norm
              (b + "nextn.hnorm.weight", (E,), "norm")]          # the target's hidden state's norm
        t += [(b + f"nextn.{n}.weight", (E,) if n == "shared_head_norm" else (V, E),
               "norm" if n == "shared_head_norm" else "mat") for n in NEXTN_NAMES if n in nextn]
    return t


def moe_ffn_tensors(m: ModelShape) -> Callable[[str], list[tuple[str, tuple[int, ...], str]]]:
    """The FFN tensors of one qwen35moe block (prefix ``blk.N.``), in the order llama.cpp's qwen35moe
    ``load_block_trunk`` creates them, numpy shapes (ne reversed): the router ffn_gate_inp ne [E, n_expert]; the
    experts' ffn_down_exps [n_ff_exp, E, n_expert], ffn_gate_exps and ffn_up_exps [E, n_ff_exp, n_expert] (the
    loader takes a merged ffn_gate_up_exps instead when a file has one; the writer writes them apart, as the
    converter does); the shared expert's gate ffn_gate_inp_shexp [E] (one logit per token) and its
    ffn_gate_shexp / ffn_up_shexp [E, n_ff_shexp], ffn_down_shexp [n_ff_shexp, E]."""
    E, X, Fe, Fs = m.n_embd, m.n_expert, m.n_ff_exp, m.n_ff_shexp
    return lambda b: [(b + "ffn_gate_inp.weight", (X, E), "gate"),
                      (b + "ffn_down_exps.weight", (X, E, Fe), "mat"),
                      (b + "ffn_gate_exps.weight", (X, Fe, E), "mat"),
                      (b + "ffn_up_exps.weight", (X, Fe, E), "mat"),
                      (b + "ffn_gate_inp_shexp.weight", (E,), "gate"),
                      (b + "ffn_gate_shexp.weight", (Fs, E), "mat"),
                      (b + "ffn_up_shexp.weight", (Fs, E), "mat"),
                      (b + "ffn_down_shexp.weight", (E, Fs), "mat")]


# The MTP block's tensors llama.cpp's qwen35 loader marks TENSOR_NOT_REQUIRED, with what its graph takes without them:
# a file may hold them or not (the writer writes shared_head_norm, the head's own final norm, as Qwen3.5's MTP weights
# have one: HF's mtp.norm; embed_tokens and shared_head_head are the trunk's token_embd and lm head when absent)
NEXTN_OPTIONAL = {"nextn.embed_tokens.weight": "token_embd.weight", "nextn.shared_head_head.weight": "output.weight",
                  "nextn.shared_head_norm.weight": "output_norm.weight"}


NEXTN_NAMES = tuple(n.split(".")[1] for n in NEXTN_OPTIONAL)  # their short names, write_gguf(nextn=...)


def optional_tensors(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """The optional MTP tensors a file of ``shape`` may hold (:data:`NEXTN_OPTIONAL`), name -> ggml ne."""
    E, V = shape.n_embd, shape.vocab_size
    ne = {"nextn.embed_tokens.weight": (E, V), "nextn.shared_head_head.weight": (E, V),
          "nextn.shared_head_norm.weight": (E,)}
    return {f"blk.{il}.{n}": ne[n] for il in range(shape.n_layer, shape.block_count) for n in NEXTN_OPTIONAL}


# uniform (lo, hi) per kind: "mat"/"ab" std 0.02 (half-width 0.02*sqrt(3)); norms 1 +- 0.05; the conv taps std ~0.3;
# ssm_a = -exp(A_log) negative, here in [-1, -0.1] (decays exp(softplus(.)*a) that neither vanish nor explode);
# dt_bias small; "gate" (router, shared-expert gate) std ~0.1: router logits of the tiny shapes ~1.6 apart, so
# no two experts are near a tie that a 1e-7 rounding difference could flip
_RANGES = {"mat": (-0.0346, 0.0346), "ab": (-0.0346, 0.0346), "norm": (0.95, 1.05), "conv": (-0.5, 0.5),
           "dt": (-0.1, 0.1), "a": (-1.0, -0.1), "gate": (-0.17, 0.17)}


def _chunks(name: str, n: int, kind: str, seed: int) -> Iterator[np.ndarray]:
    """The f32 values of tensor ``name`` (``n`` elements), in chunks: one PCG64 stream per (seed, name), so a tensor's
    values depend only on the seed, its name and its size."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])))
    lo, hi = _RANGES[kind]
    for start in range(0, n, _CHUNK):
        x = rng.random(min(_CHUNK, n - start), dtype=np.float32)
        x *= np.float32(hi - lo)
        x += np.float32(lo)
        yield x


def _convert(x: np.ndarray, wtype: str) -> np.ndarray:
    if wtype == "f32":
        return x
    if wtype == "f16":
        return x.astype(np.float16)
    if wtype == "q8_0":  # gguf's reference quantizer; a chunk is whole blocks (rows are multiples of 32)
        gguf = _gguf()
        return gguf.quants.quantize(x.reshape(-1, Q8_0_BLOCK[0]), gguf.GGMLQuantizationType.Q8_0)
    # bf16: the high half of each f32 (round toward zero; little-endian: the odd uint16s)
    return x.view(np.uint16)[1::2].copy()


_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def _nbytes(n: int, wtype: str) -> int:
    """Bytes of ``n`` values of ``wtype`` in the file."""
    if wtype == "q8_0":
        return n // Q8_0_BLOCK[0] * Q8_0_BLOCK[1]
    return n * _BYTES[wtype]


def _write_next(w, fout, ahead: deque, types: dict) -> None:
    (name, np_shape, kind), future = ahead.popleft()
    w.write_padding(fout, fout.tell())  # each tensor starts aligned, as write_tensor_data places it
    for x in future.result():
        x.tofile(fout)
    w.write_padding(fout, _nbytes(int(np.prod(np_shape)), types.get(kind, "f32")))


def add_kv(w, key: str, value: Any) -> None:
    """Add one key/value to a ``gguf.GGUFWriter``, typed by its Python type: bool, float (f32), int (u32), str, or a
    list (an array)."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, value)


def write_gguf(shape: ModelShape | str, path: str | os.PathLike, *, wtype: str = "f32", seed: int = 0,
               ab_wtype: str | None = None, tokenizer: str = "bpe", workers: int = min(8, os.cpu_count() or 1),
               nextn: tuple[str, ...] = ("shared_head_norm",)) -> Path:
    """Write ``shape`` (a :class:`ModelShape` or a preset name) as a qwen35 GGUF file at ``path`` and return the path
    (arch qwen35moe, with its expert keys and tensors, for a shape with experts: :attr:`ModelShape.arch`).

    ``wtype`` is the type of the projections and the token embedding / output (``f32``, ``f16``, ``bf16`` or
    ``q8_0``: every such row's length must then be a multiple of 32); ``ab_wtype`` that of ssm_alpha/ssm_beta
    (default: ``wtype``; gdnpass's VerifyConfig defaults are bf16 + f32).
    Norms, ssm_conv1d, ssm_a and ssm_dt.bias are f32, as llama.cpp's converter keeps them. ``tokenizer``: "bpe"
    (default) writes :func:`bpe_vocab` (a small real byte-level BPE with the qwen35 pre-tokenizer, so the file takes
    text; shapes under 259 tokens need "none"), "none" no tokenizer (``tokenizer.ggml.model = "none"``: llama.cpp
    adds vocab_size dummy tokens; feed ids). The file is written
    under a temporary name next to ``path`` and renamed into place, so ``path`` is never left half-written.
    ``workers`` threads generate the tensors (qwen3.5-9b in bf16: ~70 s on one core); the bytes do not depend on it.
    ``nextn``: the optional tensors of each MTP block (``shape.nextn_predict_layers``) to write, of
    :data:`NEXTN_NAMES` (default the head's own norm, ``shared_head_norm``; without ``embed_tokens`` and
    ``shared_head_head`` the head reads the trunk's token embedding and lm head).
    """
    gguf = _gguf()
    shape = get_model(shape) if isinstance(shape, str) else shape
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise GgufError(f"seed must be an integer >= 0 (numpy's SeedSequence takes no negative), is {seed!r}")
    ab_wtype = wtype if ab_wtype is None else ab_wtype
    for field, t in (("wtype", wtype), ("ab_wtype", ab_wtype)):
        if t not in WTYPES:
            raise GgufError(f"{field} {t!r} is not supported (supported: {', '.join(WTYPES)})")
    if tokenizer not in TOKENIZERS:
        raise GgufError(f"tokenizer {tokenizer!r} is not supported (supported: {', '.join(TOKENIZERS)})")
    check_shape(shape)
    nextn = (nextn,) if isinstance(nextn, str) else tuple(nextn)
    bad = [n for n in nextn if n not in NEXTN_NAMES]
    if bad:
        raise GgufError(f"nextn {bad[0]!r} is not an optional MTP tensor (known: {', '.join(NEXTN_NAMES)})")
    tok_kv = tokenizer_metadata(shape.vocab_size, tokenizer)
    plan = tensor_plan(shape, tuple(nextn))
    types = {"mat": wtype, "ab": ab_wtype}
    odd = [(n, np_shape[-1]) for n, np_shape, kind in plan if types.get(kind) == "q8_0" and np_shape[-1] % 32]
    if odd:
        raise GgufError(f"model {shape.name!r} cannot be written in q8_0: the rows of {odd[0][0]} are {odd[0][1]} "
                        "values, not a multiple of 32")
    path = Path(path)
    if path.is_dir():
        raise GgufError(f"cannot write {path}: it is a directory")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")

    arch = shape.arch
    w = gguf.GGUFWriter(None, arch)
    _pack_long_arrays(w)
    w.add_name(shape.name)
    w.add_type("model")
    w.add_file_type(_FILE_TYPE[wtype])
    adders: dict[str, Callable[[str, Any], None]] = {"u32": w.add_uint32, "f32": w.add_float32,
                                                     "i32[4]": lambda k, v: w.add_array(k, [int(x) for x in v])}
    for key, attr, typ, _ in shape_keys(shape):
        v = getattr(shape, attr)
        adders[typ](f"{arch}.{key}", float(v) if typ == "f32" else v)
    if shape.nextn_predict_layers:
        w.add_uint32(f"{arch}.nextn_predict_layers", shape.nextn_predict_layers)
    for key, v in tok_kv.items():
        add_kv(w, key, v)

    raw = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
           "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
    for name, np_shape, kind in plan:
        t = types.get(kind, "f32")
        n = int(np.prod(np_shape))
        w.add_tensor_info(name, np_shape, np.dtype(np.float32), _nbytes(n, t), raw_dtype=raw[t])

    try:
        w.open_output_file(tmp)
    except OSError as e:
        raise GgufError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None and len(w.fout) == 1
        fout = w.fout[0]

        def values(name: str, np_shape, kind: str) -> list[np.ndarray]:
            return [_convert(x, types.get(kind, "f32")) for x in _chunks(name, int(np.prod(np_shape)), kind, seed)]

        # tensors are generated on `workers` threads (numpy's generators fill without the GIL), at most `workers`
        # ahead of the writer, and written in plan order: the bytes are those of a sequential write
        with ThreadPoolExecutor(max(1, workers)) as pool:
            ahead: deque = deque()
            for item in plan:
                ahead.append((item, pool.submit(values, *item)))
                if len(ahead) >= max(1, workers):
                    _write_next(w, fout, ahead, types)
            while ahead:
                _write_next(w, fout, ahead, types)
        w.close()
        os.replace(tmp, path)
    except OSError as e:
        w.close()
        tmp.unlink(missing_ok=True)
        raise GgufError(f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


# ---- the reverse: a file's header -> ModelShape ----------------------------------------------------------------
def _f32_value(x: float) -> float:
    """An f32 read back as the shortest decimal that rounds to it (1e-6, not 9.99999997e-07)."""
    with np.errstate(over="ignore"):
        return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def read_shape(path: str | os.PathLike) -> ModelShape:
    """The :class:`ModelShape` of the qwen35 GGUF file at ``path``, from its header alone.

    Keys llama.cpp treats as optional get llama.cpp's defaults (head_count_kv = head_count, key/value length =
    n_embd / head_count, rope dims = key_length, rope base 1e4, full_attention_interval 4, vocab size = the number
    of tokens). ``n_layer`` is the trunk: block_count less any ``nextn_predict_layers`` (MTP) blocks. The name is
    ``general.name`` (else the file's stem). The metadata is validated as a whole: every key of its type, counts
    positive, block_count within llama.cpp's bound, the layer pattern, the head geometry and finite values
    (:meth:`ModelShape.problems`); a GgufError names the file and the key."""
    path = Path(path)
    return header_shape(open_reader(path), path)[0]


def header_shape(reader, path: Path) -> tuple[ModelShape, int]:
    """(the shape, block_count) of an open reader's header: :func:`read_shape`'s work."""
    h = _Header(reader, path)
    arch = h.text("general.architecture")
    moe = arch == MOE_ARCH
    # llama.cpp reads feed_forward_length optionally; a qwen35 file's dense FFN needs it, a qwen35moe's does not
    needed = [k for k, _, _, req in GGUF_KEYS + (MOE_KEYS if moe else ()) if req
              and not (moe and k == "feed_forward_length")]
    if arch not in ARCHS:
        missing = [k for k in needed if f"{arch}.{k}" not in h.fields]
        h.fail(f"architecture {arch!r}, not {' or '.join(map(repr, ARCHS))}: read_shape reads qwen35 files only"
               + (f" (it lacks {', '.join(f'{arch}.{k}' for k in missing)})" if missing else ""))
    missing = [f"{arch}.{k}" for k in needed if f"{arch}.{k}" not in h.fields]
    if missing:
        h.fail(f"{arch} file lacks {', '.join(missing)}")
    K = f"{arch}."
    n_block = h.count(K + "block_count")
    if not 1 <= n_block <= MAX_LAYERS:
        h.fail(f"{K}block_count must be 1..{MAX_LAYERS} (llama.cpp's LLAMA_MAX_LAYERS), is {n_block}")
    n_mtp = h.count(K + "nextn_predict_layers", 0)
    if n_mtp >= n_block:
        h.fail(f"{K}nextn_predict_layers {n_mtp} leaves no trunk of {K}block_count {n_block} (gdnpass builds the "
               "trunk)")
    n_layer = n_block - n_mtp
    n_embd = h.count(K + "embedding_length", per_layer=n_block)
    n_head = h.count(K + "attention.head_count", per_layer=n_block)
    default_len = n_embd // n_head if n_head else 0
    key_len = h.count(K + "attention.key_length", default_len)
    val_len = h.count(K + "attention.value_length", default_len)
    n_ff = h.count(K + "feed_forward_length", 0 if moe else None, per_layer=n_block)
    if n_ff < 1 and not moe:
        h.fail(f"{K}feed_forward_length must be >= 1, is {n_ff}")
    experts = _expert_fields(h, K, n_ff, n_block) if moe else {}
    tokens = h.array("tokenizer.ggml.tokens", ("STRING",), "strings")
    vocab = h.count(K + "vocab_size")
    if vocab is None:
        if tokens is None:
            h.fail(f"qwen35 file has neither {K}vocab_size nor tokenizer.ggml.tokens")
        vocab = len(tokens)
    elif tokens is not None and len(tokens) != vocab:
        h.fail(f"{K}vocab_size {vocab} != the {len(tokens)} tokens of tokenizer.ggml.tokens")
    interval = h.count(K + "full_attention_interval", 4)
    rec = h.array(K + "attention.recurrent_layers", ("BOOL",) + _INTS, "bools")
    if rec is not None:
        if len(rec) != n_block:
            h.fail(f"{K}attention.recurrent_layers has {len(rec)} entries, block_count is {n_block}")
        if interval < 1 or [bool(x) for x in rec[:n_layer]] != [(i + 1) % interval != 0 for i in range(n_layer)]:
            h.fail(f"{K}attention.recurrent_layers is not every-{interval}th-layer attention; a ModelShape cannot "
                   "hold that pattern")
    S, H_v = h.count(K + "ssm.state_size"), h.count(K + "ssm.time_step_rank")
    inner = h.count(K + "ssm.inner_size")
    if inner != S * H_v:
        h.fail(f"{K}ssm.inner_size {inner} != {K}ssm.state_size {S} * {K}ssm.time_step_rank {H_v} (a ModelShape "
               "derives it)")
    secs = h.array(K + "rope.dimension_sections", _INTS, "integers")
    if len(secs) != 4:
        h.fail(f"{K}rope.dimension_sections has {len(secs)} entries, llama.cpp reads 4")
    shape = ModelShape(
        name=h.text("general.name", path.stem),
        n_embd=n_embd, n_layer=n_layer, n_k_heads=h.count(K + "ssm.group_count"), n_v_heads=H_v, head_dim=S,
        d_conv=h.count(K + "ssm.conv_kernel"), n_ff=n_ff,
        full_attention_interval=interval, eps=_f32_value(h.real(K + "attention.layer_norm_rms_epsilon")),
        vocab_size=vocab, context_length=h.count(K + "context_length"), head_count=n_head,
        head_count_kv=h.count(K + "attention.head_count_kv", n_head, per_layer=n_block),
        key_length=key_len, value_length=val_len,
        rope_dimension_count=h.count(K + "rope.dimension_count", key_len),
        rope_dimension_sections=tuple(int(x) for x in secs),  # type: ignore[arg-type]
        rope_freq_base=_f32_value(h.real(K + "rope.freq_base", 10000.0)),
        tie_embeddings="output.weight" not in {t.name for t in reader.tensors},
        nextn_predict_layers=n_mtp, **experts,
    )
    keys = field_keys(arch)
    problems = shape.problems(lambda f: keys.get(f, f))
    if problems:
        h.fail("; ".join(problems))
    return shape, n_block


def _expert_fields(h: _Header, K: str, n_ff: int, n_block: int) -> dict[str, int]:
    """A qwen35moe header's expert fields, with llama.cpp's defaults for the widths (load_arch_tensors:
    n_ff_exp = feed_forward_length / expert_used_count, n_ff_shexp = feed_forward_length); a file that gives neither
    a width nor feed_forward_length fails naming both keys (llama.cpp would create experts of width 0)."""
    n_expert = h.count(K + "expert_count")
    if n_expert < 1:
        h.fail(f"{K}expert_count must be >= 1 in a qwen35moe file (its every layer routes to experts), is {n_expert}")
    used = h.count(K + "expert_used_count", per_layer=n_block)
    widths = {"n_ff_exp": h.count(K + "expert_feed_forward_length", 0, per_layer=n_block) or
              (n_ff // used if used > 0 else 0),
              "n_ff_shexp": h.count(K + "expert_shared_feed_forward_length", 0) or n_ff}
    keys = {"n_ff_exp": "expert_feed_forward_length", "n_ff_shexp": "expert_shared_feed_forward_length"}
    for f, v in widths.items():
        if v < 1:
            h.fail(f"{K}{keys[f]} is missing or 0 and {K}feed_forward_length does not give it (is {n_ff})")
    return {"n_expert": n_expert, "n_expert_used": used, **widths}


def check_tensors(reader, shape: ModelShape, n_block: int, path: Path) -> None:
    """Every tensor of the file is one :func:`tensor_plan` lists for ``shape`` (the MTP blocks' included) or an
    optional MTP tensor (:func:`optional_tensors`), with llama.cpp's ``ne`` (what ``create_tensor`` checks, and what
    the builder declares), and the plan's required tensors are all there (an MTP block's: all or none).
    GgufError naming the first tensor at fault."""
    optional = optional_tensors(shape)
    plan = {name: tuple(reversed(np_shape)) for name, np_shape, _ in tensor_plan(shape)} | optional
    have = {}
    for t in reader.tensors:
        if t.name in plan:
            have[t.name] = tuple(int(x) for x in t.shape)
        else:
            n_mtp = shape.nextn_predict_layers
            raise GgufError(f"{path}: tensor {t.name!r} is not part of a {shape.arch} model of this header ({shape.n_layer} "
                            f"layers{f', {n_mtp} MTP' if n_mtp else ''})")
    mtp = tuple(f"blk.{il}." for il in range(shape.n_layer, shape.block_count))
    # a file whose MTP blocks hold no tensor at all still has its trunk (llama.cpp loads it without load_mtp, which
    # skips them); the MTP head of such a file cannot be built (GgufModel.build names what it lacks)
    stripped = not any(n.startswith(mtp) for n in have) if mtp else False
    missing = [n for n in plan if n not in have and n not in optional and not (stripped and n.startswith(mtp))]
    if missing:
        raise GgufError(f"{path}: tensor {missing[0]!r} is missing" + (f" (+{len(missing) - 1} more)"
                                                                       if len(missing) > 1 else ""))
    for name, ne in have.items():
        want = plan[name]
        pad = lambda x: tuple(x) + (1,) * (GGML_MAX_DIMS - len(x))  # noqa: E731
        if pad(ne) != pad(want):
            raise GgufError(f"{path}: tensor {name!r} has ne {list(ne)}, the header makes it {list(want)}"
                            + (" (transposed?)" if sorted(ne) == sorted(want) else ""))


def explicit(shape: ModelShape) -> ModelShape:
    """``shape`` with its derived defaults spelled out (``n_ff`` = ffn_dim), as :func:`read_shape` returns it."""
    return dataclasses.replace(shape, n_ff=shape.ffn_dim)


def main(argv: list[str] | None = None) -> int:
    """``python -m gdnpass.models.gguf_write PRESET PATH [--wtype T] [--seed N]``: write one file, print its size."""
    import argparse
    import time

    p = argparse.ArgumentParser(prog="python -m gdnpass.models.gguf_write", description=main.__doc__)
    p.add_argument("model", help="preset name (gdnpass run --help lists them), e.g. tiny-qwen35")
    p.add_argument("path", help="the .gguf file to write")
    p.add_argument("--wtype", default="f32", choices=WTYPES)
    p.add_argument("--ab-wtype", default=None, choices=WTYPES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default="bpe", choices=TOKENIZERS,
                   help="bpe: a small byte-level BPE (the file takes text); none: token ids only")
    p.add_argument("--mtp", type=int, default=None, metavar="N",
                   help="N MTP (NextN) blocks after the trunk (qwen35.nextn_predict_layers; default: the preset's, 0 "
                        "for every preset); llama.cpp's MTP head runs one")
    a = p.parse_args(argv)
    try:
        t0 = time.perf_counter()
        shape = get_model(a.model)
        if a.mtp is not None:
            if a.mtp < 0:
                raise GgufError(f"--mtp {a.mtp}: the number of MTP blocks must be >= 0")
            shape = dataclasses.replace(shape, nextn_predict_layers=a.mtp)
        out = write_gguf(shape, a.path, wtype=a.wtype, seed=a.seed, ab_wtype=a.ab_wtype, tokenizer=a.tokenizer)
    except GdnpassError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (write_gguf removed its temporary file; an existing PATH is untouched)
        print(f"{p.prog}: interrupted", file=sys.stderr)
        return 130
    print(f"{out}: {out.stat().st_size / 2**20:.2f} MiB in {time.perf_counter() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
