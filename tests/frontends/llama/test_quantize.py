"""llama.cpp's own quantizer (gdnpass.frontends.llama.quantize, ``gdnpass quantize``; issue 34).

Two tiny random qwen35 models, f32, each quantized once per mix by ``llama_model_quantize`` of the pinned libllama:
``tiny-qwen35`` (its GDN ``ssm_out`` rows are 128 long: the K mixes fall back there) and ``tiny_k256()`` (every matrix
row a multiple of 256: no fallback). The files open with gguf, keep the input's tensor names and shapes, keep norms and
1-D tensors F32, and hold exactly the types llama.cpp's mixes choose (pinned: the kernels must support them); llama.cpp
loads and runs a K-quant file. The error paths are one line each, before llama.cpp is built where they can be.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gdnpass.ir import DType

pytest.importorskip("gguf")

from gdnpass.errors import LlamaError  # noqa: E402
from gdnpass.frontends.llama import capture as cap_mod  # noqa: E402
from gdnpass.frontends.llama.quantize import (BASE_TYPES, FTYPES, QK_K, QuantizeResult, quantize,  # noqa: E402
                                              read_tensors, tiny_k256)
from gdnpass.models.gguf_write import write_gguf  # noqa: E402
from support.cli import cli_run, refused  # noqa: E402

MODELS = {"tiny-qwen35": "tiny-qwen35", "k256": tiny_k256()}
MIXES = ("q8_0", "q4_k_m", "q6_k")
# what llama.cpp gives a K-quant row that is not a multiple of 256 (llama-quant.cpp tensor_type_fallback)
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# the tensors q4_k_m raises to Q6_K in a 4-layer qwen35 (layers 0-2 GDN, 3 attention): output.weight, and
# use_more_bits' picks (i >= 7n/8 or i % 3 == 2) of attn_qkv + attn_v (one counter) and of ffn_down
Q4_K_M_Q6_K = {"output.weight", "blk.2.attn_qkv.weight", "blk.3.attn_v.weight", "blk.2.ffn_down.weight",
               "blk.3.ffn_down.weight"}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("quant-in")
    return {k: write_gguf(shape, d / f"{k}.gguf", wtype="f32", seed=1) for k, shape in MODELS.items()}


_DONE: dict[tuple[str, str], QuantizeResult] = {}


@pytest.fixture(scope="module")
def quantized(llama, inputs, tmp_path_factory):
    """(model, mix) -> its QuantizeResult, each quantized once for the module."""
    d = tmp_path_factory.mktemp("quant-out")

    def get(model: str, mix: str) -> QuantizeResult:
        if (model, mix) not in _DONE:
            _DONE[model, mix] = quantize(inputs[model], d / f"{model}-{mix}.gguf", mix, install=llama, threads=2)
        return _DONE[model, mix]
    return get


def is_plain(name: str, ne: tuple[int, ...]) -> bool:
    """A tensor llama.cpp never quantizes: 1-D, a norm, the conv taps, ssm_a / ssm_dt.bias (no .weight suffix)."""
    return len(ne) < 2 or name.endswith("_norm.weight") or "ssm_conv1d" in name or not name.endswith("weight")


def allowed(name: str, ne: tuple[int, ...], mix: str) -> set[str]:
    """The types llama.cpp's ``mix`` may give this tensor."""
    if is_plain(name, ne):
        return {"F32"}
    base = BASE_TYPES[mix]
    if mix == "q8_0":
        return {"Q8_0"}
    if name == "output.weight":
        return {"Q6_K" if ne[0] % QK_K == 0 else "Q8_0"}
    kinds = {base, "Q6_K"} if mix.endswith("_m") else {base, "Q5_K"} if mix == "q4_k_s" else {base}
    return kinds if ne[0] % QK_K == 0 else {FALLBACK[k] for k in kinds}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("mix", MIXES)
def test_llama_cpp_s_mix(quantized, inputs, model, mix):
    res = quantized(model, mix)
    print(f"{model} {mix}: " + ", ".join(res.summary_lines()))
    for t in res.tensors:
        print(f"  {t.name:34s} {list(t.ne)!s:12s} {t.type}")
    src = read_tensors(inputs[model])
    out = read_tensors(res.dst)  # (opens with gguf)
    assert {t.name: t.ne for t in out} == {t.name: t.ne for t in src} and len(out) == len(src)  # (llama.cpp orders
    # them its own way: output.weight first, then by layer)
    assert out == res.tensors and res.ftype == mix and res.dst.is_file()
    for t in out:
        assert t.type in allowed(t.name, t.ne, mix), t
    k_rows = [t for t in out if not is_plain(t.name, t.ne) and t.ne[0] % QK_K == 0]
    if mix != "q8_0":  # a K mix: every matrix whose rows are a multiple of 256 is a K-quant
        assert k_rows and all(t.type in ("Q4_K", "Q5_K", "Q6_K") for t in k_rows)
    odd = {t.name for t in out if not is_plain(t.name, t.ne) and t.ne[0] % QK_K and t.name != "output.weight"}
    assert {f.name for f in res.fallbacks} == (odd if mix != "q8_0" else set())
    assert odd == ({"blk.0.ssm_out.weight", "blk.1.ssm_out.weight", "blk.2.ssm_out.weight"}
                   if model == "tiny-qwen35" else set())
    assert sum(n for n, _ in res.types.values()) == len(out) and sum(b for _, b in res.types.values()) == res.nbytes
    assert [x.name for x in res.dst.parent.iterdir() if x.name.startswith(".")] == []  # no temporary file left


def test_the_types_the_kernels_must_support(quantized):
    """Each file's set of types, pinned: Q8_0, Q4_K, Q5_K, Q6_K and F32, plus the fallbacks of rows that are not a
    multiple of 256 (tiny-qwen35's ssm_out: Q5_0 under q4_k_m, Q8_0 under q6_k)."""
    types = {(m, x): set(quantized(m, x).types) for m in MODELS for x in MIXES}
    assert types == {("tiny-qwen35", "q8_0"): {"F32", "Q8_0"}, ("k256", "q8_0"): {"F32", "Q8_0"},
                     ("tiny-qwen35", "q4_k_m"): {"F32", "Q4_K", "Q6_K", "Q5_0"},
                     ("k256", "q4_k_m"): {"F32", "Q4_K", "Q6_K"},
                     ("tiny-qwen35", "q6_k"): {"F32", "Q6_K", "Q8_0"}, ("k256", "q6_k"): {"F32", "Q6_K"}}
    for m in MODELS:
        res = quantized(m, "q4_k_m")
        assert {t.name for t in res.tensors if t.type == "Q6_K"} == Q4_K_M_Q6_K
        assert res.type_of("blk.0.ssm_alpha.weight") == res.type_of("blk.0.ssm_beta.weight") == "Q4_K"


def test_llama_cpp_runs_the_k_quant_file(llama, quantized):
    res = quantized("k256", "q4_k_m")
    c = cap_mod.capture(res.dst, cap_mod.Settings(n_tokens=2, n_rs_seq=1, n_ubatch=4, n_batch=4, n_prompt=2),
                        install=llama)
    # the K-quants are held as llama.cpp holds them (no f32 stand-ins): the weights' own blocks in its buffer
    assert c.verify.meta["llama"]["dequantized"] == {}
    assert {t.type for t in c.verify.leafs if t.type.is_quantized} == {DType.Q4_K, DType.Q6_K}


# ---- the command ---------------------------------------------------------------------------------------------------
def test_cli_prints_one_line_per_type(llama, capsys, inputs, tmp_path):
    out = tmp_path / "q.gguf"
    rc, text, _ = cli_run(capsys, "quantize", inputs["tiny-qwen35"], out, "--type", "Q4_K_M", "--threads", "2")
    assert rc == 0, text
    lines = text.splitlines()
    assert lines[0].startswith("gdnpass quantize: tiny-qwen35.gguf -> ") and "(q4_k_m, llama_ftype 15)" in lines[0]
    assert [x.split()[0] for x in lines[1:5]] == ["Q4_K", "Q6_K", "Q5_0", "F32"]
    assert lines[1].startswith("  Q4_K x25 (") and lines[1].endswith("% of bytes)")
    assert "3 fallback(s)" in lines[5] and "Q4_K -> Q5_0 (ne0 128)" in lines[5]
    rc, text, _ = cli_run(capsys, "quantize", inputs["k256"], out, "--type", "q6_k", "--force", "--json")
    doc = json.loads(text)
    assert rc == 0 and doc["type"] == "q6_k" and set(doc["types"]) == {"Q6_K", "F32"} and doc["fallbacks"] == []
    assert doc["tensors"]["blk.0.ssm_norm.weight"] == "F32" and doc["tensors"]["blk.0.ssm_out.weight"] == "Q6_K"


def test_a_quantized_input_is_llama_cpp_s_one_line_refusal(llama, capsys, tmp_path):
    src = write_gguf("tiny-qwen35", tmp_path / "q8.gguf", wtype="q8_0")
    refused(capsys, "quantize", src, tmp_path / "q4.gguf", "--type", "q4_k_m",
            says=("quantize of q8.gguf", "requantizing from type q8_0 is disabled"))
    (tmp_path / "bad.gguf").write_text("not a model\n")
    refused(capsys, "quantize", tmp_path / "bad.gguf", tmp_path / "q4.gguf", "--type", "q4_k_m",
            says=("failed to load model", "invalid magic"))
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bad.gguf", "q8.gguf"]  # nothing half-written
    with pytest.raises(LlamaError, match="requantizing"):
        quantize(src, tmp_path / "q4.gguf", "q6_k", install=llama)


def test_bad_requests_are_refused_before_llama_cpp_is_built(capsys, tmp_path, monkeypatch):
    from gdnpass.frontends.llama import build

    monkeypatch.setattr(build, "ensure", lambda *a, **k: pytest.fail("built llama.cpp before checking the request"))
    src = tmp_path / "in.gguf"
    src.write_bytes(b"GGUF")  # (never read: every request below is refused first)
    out = tmp_path / "out.gguf"
    out.write_text("the user's file\n")
    refused(capsys, "quantize", src, tmp_path / "o.gguf", "--type", "q3_k_m",
            says=("unknown type 'q3_k_m'", "known: " + ", ".join(FTYPES)))
    refused(capsys, "quantize", tmp_path / "typo.gguf", tmp_path / "o.gguf", "--type", "q8_0",
            says=("typo.gguf", "does not exist"))
    refused(capsys, "quantize", tmp_path, tmp_path / "o.gguf", "--type", "q8_0", says=("is not a file",))
    refused(capsys, "quantize", src, out, "--type", "q8_0", says=("out.gguf exists", "--force"))
    refused(capsys, "quantize", src, src, "--type", "q8_0", "--force", says=("is the input file",))
    refused(capsys, "quantize", src, tmp_path / "no" / "o.gguf", "--type", "q8_0", says=("does not exist",))
    refused(capsys, "quantize", src, tmp_path, "--type", "q8_0", "--force", says=("is a directory",))
    refused(capsys, "quantize", src, tmp_path / "o.gguf", "--type", "q8_0", "--threads", "0", says=("--threads",))
    rc, _, err = cli_run(capsys, "quantize", src, tmp_path / "o.gguf")
    assert rc == 2 and "--type" in err  # (argparse: the type is required)
    assert out.read_text() == "the user's file\n" and not (tmp_path / "o.gguf").exists()


def test_generate_runs_a_q4_k_m_file_identically_fused_and_unfused(quantized, capsys):
    """`gdnpass generate --gguf <llama.cpp's Q4_K_M file> --check`: the blocks held as the file has them, the loop's
    tokens, accepted counts and logits bytes identical with fusion off and on; the header says the types' shares. The
    planted drafter drafts (the n-gram one finds nothing to draft in a random model's text, and a verify of one token
    rolls nothing back), so verifies of several tokens and their rollbacks are compared too."""
    res = quantized("k256", "q4_k_m")
    rc, out, err = cli_run(capsys, "generate", "--gguf", res.dst, "--prompt", "The quick brown fox",
                           "--n-predict", "12", "--draft", "planted", "--check")
    assert rc == 0, err
    drafted = re.search(r"n_drafted (\d+), n_accept (\d+)", out)
    assert drafted and int(drafted[1]) > int(drafted[2]), out  # drafts made, and some rolled back
    assert "weights Q4_K x28 (" in out and "Q6_K x5 (" in out, out
    assert "fusion off vs on: identical tokens, accepted counts and logits bytes at every step" in out, out


def test_the_weights_buffer_holds_the_files_tensor_bytes(quantized):
    """Issue 34: a quantized file's weights take their bytes in the file, no more: every weight leaf of the graph
    (Q4_K, Q6_K, F32) is exactly its tensor's bytes, and the weights buffer is their sum up to the alignment."""
    from gdnpass.models.gguf_model import open_model
    from gdnpass.pipeline import PassOptions, run

    model = open_model(quantized("k256", "q4_k_m").dst)
    g = run(model.build(model.config(n_tokens=2, n_rs_seq=1)), PassOptions(fusion=False)).graph
    leafs = [t for t in g.leafs if t.buffer == "weights" and t.view_src is None]
    assert {t.type.label for t in leafs} == {"q4_k", "q6_k", "f32"}
    assert all(t.nbytes == model.nbytes[t.name] for t in leafs)
    file_bytes = sum(model.nbytes[t.name] for t in leafs)
    assert file_bytes <= g.buffers["weights"] <= file_bytes + len(leafs) * g.alignment
