"""qwen35 GGUF files from a ModelShape (gdnpass.models.gguf_write): the round trip, determinism, the errors, agreement
with the verify builder's weights, and real llama.cpp loading each tiny preset and decoding 4 tokens.

The llama.cpp tests use the pinned build (conftest's ``llama`` fixture: built into the user's cache the first time)
and drive it in a subprocess, since a ggml assert aborts the process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gdnpass.errors import GdnpassError  # noqa: E402
from gdnpass.models import PRESETS, ModelShape, VerifyConfig, build_verify_graph  # noqa: E402
from gdnpass.models.gguf_write import (WTYPES, GgufError, add_kv, check_shape, explicit, gguf_metadata,  # noqa: E402
                                       read_shape, tensor_plan, write_gguf)

TINY = ["tiny-qwen35", "tiny-qwen35-b"]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# ---- round trip ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TINY)
def test_round_trip(tmp_path, name):
    shape = PRESETS[name]
    t0 = time.perf_counter()
    p = write_gguf(shape, tmp_path / f"{name}.gguf")
    assert time.perf_counter() - t0 < 10  # ~0.1 s measured; a generous bound against an accidental slow path
    assert read_shape(p) == explicit(shape) == shape  # the tiny presets spell n_ff out
    n = sum(int(np.prod(s)) for _, s, _ in tensor_plan(shape))
    assert n * 4 < p.stat().st_size < n * 4 + 64 * 1024  # f32 data plus the header and alignment


def test_round_trip_other_fields(tmp_path):
    """Tied embeddings, bf16/f16 weights, a derived n_ff, odd eps / rope base and sections survive the trip."""
    shape = dataclasses.replace(PRESETS["tiny-qwen35"], name="odd", n_ff=0, eps=1e-5, rope_freq_base=5e5,
                                tie_embeddings=True, rope_dimension_sections=(8, 0, 0, 0), d_conv=3,
                                full_attention_interval=2, context_length=128)
    for wt in ("bf16", "f16"):
        p = write_gguf(shape, tmp_path / f"odd-{wt}.gguf", wtype=wt, ab_wtype="f32")
        assert read_shape(p) == explicit(shape)
        r = gguf.GGUFReader(p)
        types = {t.name: t.tensor_type.name for t in r.tensors}
        assert "output.weight" not in types
        assert types["token_embd.weight"] == types["blk.0.attn_qkv.weight"] == wt.upper()
        assert types["blk.0.ssm_alpha.weight"] == types["blk.0.ssm_conv1d.weight"] == types["blk.0.ssm_a"] == "F32"


def test_released_presets_metadata():
    """The released shapes' GGUF keys: Qwen3.5's 25% of 256-dim heads rotate (64 dims, M-RoPE [11, 11, 10, 0])."""
    m9 = gguf_metadata(PRESETS["qwen3.5-9b"])
    assert m9["qwen35.block_count"] == 32 and m9["qwen35.embedding_length"] == 4096
    assert m9["qwen35.feed_forward_length"] == 12288 and m9["qwen35.vocab_size"] == 248320
    assert (m9["qwen35.attention.head_count"], m9["qwen35.attention.head_count_kv"]) == (16, 4)
    assert m9["qwen35.rope.dimension_count"] == 64 and m9["qwen35.rope.dimension_sections"] == [11, 11, 10, 0]
    assert m9["qwen35.ssm.inner_size"] == 4096 and m9["qwen35.ssm.state_size"] == 128
    assert (m9["qwen35.ssm.group_count"], m9["qwen35.ssm.time_step_rank"]) == (16, 32)
    m27 = gguf_metadata(PRESETS["qwen3.5-27b"])
    assert (m27["qwen35.attention.head_count"], m27["qwen35.block_count"], m27["qwen35.ssm.inner_size"]) == \
        (24, 64, 6144)
    for name in PRESETS:  # every preset is a writable qwen35 shape
        check_shape(PRESETS[name])


def test_read_converter_style_header(tmp_path):
    """A header as llama.cpp's converter writes it: no vocab_size (the token list counts), an MTP block on top of the
    trunk (nextn_predict_layers), the layer pattern as attention.recurrent_layers; only the header is read."""
    shape = PRESETS["tiny-qwen35"]
    p = tmp_path / "conv.gguf"
    w = gguf.GGUFWriter(p, "qwen35")
    w.add_name("from-hf")
    for k, v in gguf_metadata(shape).items():
        if k == "qwen35.vocab_size":
            continue
        if k == "qwen35.block_count":
            v += 1
        add_kv(w, k, v)
    w.add_uint32("qwen35.nextn_predict_layers", 1)
    w.add_array("qwen35.attention.recurrent_layers", [(i + 1) % 4 != 0 for i in range(shape.n_layer)] + [False])
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(shape.vocab_size)])
    w.add_tensor("token_embd.weight", np.zeros((2, 2), np.float32))  # the header need not match: not read
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = read_shape(p)
    assert got == dataclasses.replace(shape, name="from-hf", tie_embeddings=True, nextn_predict_layers=1)


# ---- determinism -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wtype", WTYPES)
def test_deterministic(tmp_path, wtype):
    a = write_gguf("tiny-qwen35-b", tmp_path / "a.gguf", wtype=wtype, seed=3, workers=1)
    b = write_gguf("tiny-qwen35-b", tmp_path / "b.gguf", wtype=wtype, seed=3, workers=3)  # threads: same bytes
    c = write_gguf("tiny-qwen35-b", tmp_path / "c.gguf", wtype=wtype, seed=4)
    assert _sha(a) == _sha(b) != _sha(c)
    assert a.stat().st_size == c.stat().st_size


def test_weights_are_tame(tmp_path):
    """Values as documented: norms near 1, ssm_a negative, dt bias small, projections of std ~0.02."""
    r = gguf.GGUFReader(write_gguf("tiny-qwen35", tmp_path / "t.gguf"))
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    assert np.all(t["blk.0.ssm_a"] < 0) and np.all(t["blk.0.ssm_a"] >= -1.0)
    assert np.all(np.abs(t["blk.0.ssm_dt.bias"]) <= 0.1)
    assert np.all(np.abs(t["output_norm.weight"] - 1) <= 0.05)
    assert 0.015 < float(t["blk.0.attn_qkv.weight"].std()) < 0.025
    assert not np.array_equal(t["blk.0.attn_qkv.weight"], t["blk.1.attn_qkv.weight"])


# ---- the builder's weights are the file's -----------------------------------------------------------------------
@pytest.mark.parametrize("name", TINY)
def test_builder_weights_match_file(tmp_path, name):
    """Every weight the verify builder declares (VerifyConfig defaults: bf16 projections, f32 alpha/beta) is a
    tensor of the file with the same ne and type."""
    cfg = VerifyConfig(name, 4, 3)
    r = gguf.GGUFReader(write_gguf(name, tmp_path / "m.gguf", wtype=cfg.wtype, ab_wtype=cfg.ab_wtype))
    file = {t.name: ([int(x) for x in t.shape], t.tensor_type.name.lower()) for t in r.tensors}
    weights = [t for t in build_verify_graph(cfg).leafs if t.buffer == "weights"]
    assert weights
    for w in weights:
        ne = list(w.ne)
        while len(ne) > 1 and ne[-1] == 1:
            ne.pop()
        assert file[w.name] == (ne, w.type.value[0]), w.name


# ---- errors ----------------------------------------------------------------------------------------------------
def _one_line(e: BaseException) -> str:
    s = str(e)
    assert "\n" not in s and s
    return s


def test_errors(tmp_path):
    with pytest.raises(GgufError) as e:
        write_gguf("tiny-qwen35", tmp_path / "q.gguf", wtype="q4_0")
    assert "q4_0" in _one_line(e.value) and "bf16" in str(e.value)
    with pytest.raises(GgufError) as e:
        write_gguf("tiny-qwen35", tmp_path / "no" / "such" / "dir" / "x.gguf")
    assert "cannot write" in _one_line(e.value)
    with pytest.raises(GgufError) as e:
        write_gguf("tiny-qwen35", tmp_path)
    assert "directory" in _one_line(e.value)
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind
    for secs in [(4, 4, 4, 0), (0, 0, 0, 8)]:  # not r/2 pairs; none in the first three (ggml's imrope asserts)
        bad = dataclasses.replace(PRESETS["tiny-qwen35"], rope_dimension_sections=secs)
        with pytest.raises(GgufError) as e:
            write_gguf(bad, tmp_path / "bad.gguf")
        assert "rope_dimension_sections" in _one_line(e.value)
    assert issubclass(GgufError, GdnpassError)


def test_read_errors(tmp_path):
    p = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_uint32("llama.embedding_length", 64)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GgufError) as e:
        read_shape(p)
    msg = _one_line(e.value)
    assert "'llama'" in msg and "qwen35" in msg and "llama.ssm.conv_kernel" in msg
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GgufError) as e:
        read_shape(tmp_path / "junk.gguf")
    _one_line(e.value)
    with pytest.raises(GgufError) as e:
        read_shape(tmp_path / "absent.gguf")
    assert "no such file" in _one_line(e.value)


# ---- real llama.cpp --------------------------------------------------------------------------------------------
@pytest.fixture
def llama_lib(llama) -> dict[str, str]:
    """The environment a subprocess needs to drive the pinned llama.cpp (conftest's ``llama``: built once, cached)."""
    return llama.env()


# Runs in the subprocess: load, make a context of 256 cells, decode argv[2] tokens as one batch, report as JSON.
_DRIVE = r"""
import json, math, sys
import llama_cpp.llama_cpp as L
path, n_tok = sys.argv[1], int(sys.argv[2])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
if not model:
    print(json.dumps({"error": "llama_model_load_from_file failed"})); sys.exit(3)
vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)
cp = L.llama_context_default_params()
cp.n_ctx = cp.n_batch = cp.n_ubatch = 256
cp.n_threads = cp.n_threads_batch = 2
ctx = L.llama_init_from_model(model, cp)
if not ctx:
    print(json.dumps({"error": "llama_init_from_model failed"})); sys.exit(3)
toks = (L.llama_token * n_tok)(*[(37 * i + 5) % n_vocab for i in range(n_tok)])
rc = L.llama_decode(ctx, L.llama_batch_get_one(toks, n_tok))
lg = L.llama_get_logits_ith(ctx, -1)
vals = [lg[i] for i in range(n_vocab)] if rc == 0 else []
print(json.dumps({"n_params": L.llama_model_n_params(model), "n_vocab": n_vocab,
                  "n_layer": L.llama_model_n_layer(model), "rc": rc,
                  "finite": bool(vals) and all(math.isfinite(v) for v in vals),
                  "spread": (max(vals) - min(vals)) if vals else 0.0}))
L.llama_free(ctx)
L.llama_model_free(model)
"""


def _llama_decode(env: dict[str, str], p: Path, n_tokens: int = 4) -> dict:
    proc = subprocess.run([sys.executable, "-c", _DRIVE, str(p), str(n_tokens)], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert "error loading model" not in proc.stderr
    return json.loads(lines[-1])


def _check_decoded(out: dict, shape: ModelShape) -> None:
    assert out["rc"] == 0 and out["finite"] and out["spread"] > 0, out
    assert out["n_vocab"] == shape.vocab_size and out["n_layer"] == shape.n_layer
    # llama.cpp counts each tensor once (a tied output is token_embd again): the plan's elements
    assert out["n_params"] == sum(int(np.prod(s)) for _, s, _ in tensor_plan(shape))


@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("name", TINY)
def test_llama_cpp_loads_and_decodes(tmp_path, llama_lib, name, wtype):
    shape = PRESETS[name]
    _check_decoded(_llama_decode(llama_lib, write_gguf(shape, tmp_path / f"{name}-{wtype}.gguf", wtype=wtype)),
                   shape)


def test_llama_cpp_other_shape(tmp_path, llama_lib):
    """Tied embeddings, d_conv 3, every 2nd layer full attention, one M-RoPE section, f16 with f32 alpha/beta."""
    shape = dataclasses.replace(PRESETS["tiny-qwen35"], name="odd", n_ff=0, d_conv=3, full_attention_interval=2,
                                tie_embeddings=True, rope_dimension_sections=(8, 0, 0, 0), n_layer=6)
    _check_decoded(_llama_decode(llama_lib, write_gguf(shape, tmp_path / "odd.gguf", wtype="f16", ab_wtype="f32")),
                   shape)
