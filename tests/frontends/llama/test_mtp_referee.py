"""llama.cpp as the referee of the MTP head (issue 35, items 1 and 2): the pinned llama.cpp loads gdnpass's GGUF files
with an MTP block, and the graph its MTP context computes (LLAMA_CONTEXT_TYPE_MTP, ctx_other = the target, driven
as common/speculative.cpp's MTP drafter drives it) equals gdnpass's builder node for node, its memory plan offset for
offset, its logits within the f32 bound.

Each capture decodes an 8-token prompt through the target and the MTP context, then 4 verify tokens through the
target and records the MTP context's batch of the same tokens (each with the target's hidden state of the token
before); about 0.2 s each on the -O0 build.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from gdnpass import alloc, ops
from gdnpass.frontends.compare import leaf_signature, signature
from gdnpass.frontends.llama import capture as cap_mod
from gdnpass.models import PRESETS
from gdnpass.models.gguf_model import open_model
from gdnpass.models.gguf_write import write_gguf

T, PROMPT, N_UBATCH = 4, 8, 8
A = dataclasses.replace(PRESETS["tiny-qwen35"], name="tiny-qwen35-mtp", nextn_predict_layers=1)
B = dataclasses.replace(PRESETS["tiny-qwen35-b"], name="tiny-qwen35-b-mtp", nextn_predict_layers=1)
N_OUT = {"all": T, "last": 1, "none": 0}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """a: tiny-qwen35 + one MTP block (the writer's nextn tensors: the head's own norm, the trunk's embedding and lm
    head); full: every optional nextn tensor (its own embedding and lm head); tied: no output.weight and no optional
    tensor (the head reads output_norm and token_embd twice); b: tiny-qwen35-b's shape in bf16."""
    d = tmp_path_factory.mktemp("mtp")
    return {"a": write_gguf(A, d / "a.gguf", seed=1, tokenizer="none"),
            "full": write_gguf(A, d / "full.gguf", seed=1, tokenizer="none",
                               nextn=("embed_tokens", "shared_head_head", "shared_head_norm")),
            "tied": write_gguf(dataclasses.replace(A, tie_embeddings=True), d / "tied.gguf", seed=1,
                               tokenizer="none", nextn=()),
            "b": write_gguf(B, d / "b.gguf", seed=1, tokenizer="none", wtype="bf16")}


_CAPTURES: dict[tuple, cap_mod.Capture] = {}


def captured(llama, path: Path, **kw) -> cap_mod.Capture:
    key = (path, tuple(sorted(kw.items())))
    if key not in _CAPTURES:
        s = cap_mod.Settings(n_tokens=T, n_rs_seq=3, n_ubatch=N_UBATCH, n_batch=N_UBATCH, n_prompt=PROMPT, mtp=True,
                             **kw)
        _CAPTURES[key] = cap_mod.capture(path, s, install=llama)
    return copy.deepcopy(_CAPTURES[key])


def ours(path: Path, outputs: str = "all", flash: bool = True):
    model = open_model(path)
    n_out = None if outputs == "all" else N_OUT[outputs]
    return model, model.build(model.mtp_config(n_tokens=T, n_past=PROMPT, flash_attn=flash, n_outputs=n_out))


CASES = [("a", "all", "on"), ("a", "last", "on"), ("a", "none", "on"), ("a", "all", "off"), ("full", "all", "on"),
         ("tied", "last", "on"), ("b", "all", "on")]


@pytest.mark.parametrize("which,outputs,flash", CASES, ids=["-".join(c) for c in CASES])
def test_mtp_graph_equals_llama_cpp_s_node_for_node(llama, files, which, outputs, flash):
    """llama.cpp's MTP context's graph: a valid graph with llama.cpp's plan, and our builder's equal node for node
    (op, type, ne, nb, op params, views, sources by position, flags), leaf for leaf (names, types, strides, flags:
    ggml's own name of the unnamed token leaf too; buffers differ by design: ours keeps inputs in an input buffer,
    llama.cpp in its compute buffer) and in ggml's use counts."""
    c = captured(llama, files[which], mtp_outputs=outputs, flash_attn=flash)
    g = c.verify
    st = g.meta["llama"]["settings"]
    assert st["mtp"]["n_layer_nextn"] == 1 and st["mtp"]["n_outputs"] == N_OUT[outputs]
    assert st["n_rs_seq"] == 0 and st["mtp"]["n_rs_seq_target"] == 3  # (the MTP context has no snapshot planes)
    assert g.meta["llama"]["same_topology_as_reserve"] and not g.meta["llama"]["reallocated"]
    ops.validate(g)
    alloc.check_plan(g)
    assert c.use_counts == g.use_counts()
    _, mine = ours(files[which], outputs, flash == "on")
    ops.validate(mine)
    assert signature(mine) == signature(g)
    drop_buffer = lambda rows: [r[:4] + r[5:] for r in rows]  # noqa: E731
    assert drop_buffer(leaf_signature(mine)) == drop_buffer(leaf_signature(g))
    pos = lambda gr, counts: [counts.get(t.uid, 0) for t in [*gr.leafs, *gr.nodes]]  # noqa: E731
    assert pos(mine, mine.use_counts()) == pos(g, c.use_counts)
    assert mine.meta["token_input"] in g.meta["input_bytes"]  # (llama.cpp set that leaf's bytes: the token ids)


@pytest.mark.parametrize("which,outputs,flash", CASES[:4], ids=["-".join(c) for c in CASES[:4]])
def test_planner_reproduces_the_mtp_context_s_offsets(llama, files, which, outputs, flash):
    """The MTP context's reserve graph (n_ubatch tokens) planned by our gallocr replica and bound to the captured
    graph: every compute-buffer tensor on llama.cpp's offset, the compute buffer of llama.cpp's size."""
    c = captured(llama, files[which], mtp_outputs=outputs, flash_attn=flash)
    g = c.verify
    theirs = {t.uid: (t.buffer, t.offset) for t in g.tensors() if t.view_src is None}
    planned = alloc.plan(c.reserve, g.meta["buffers"]["compute"]["alignment"], "compute")
    assert planned.buffers["compute"] == g.meta["buffers"]["compute"]["size"]
    b = alloc.bind(c.reserve, g, "compute")
    assert not b.reallocated, b.why
    compute = [t for t in g.tensors() if t.view_src is None and theirs[t.uid][0] == "compute"]
    assert len(compute) > 40
    assert [(t.name, t.offset, theirs[t.uid][1]) for t in compute if (t.buffer, t.offset) != theirs[t.uid]] == []


@pytest.mark.parametrize("which,outputs,flash", [("a", "all", "on"), ("a", "last", "off"), ("full", "all", "on")])
def test_mtp_logits_match_llama_cpp_s(llama, files, which, outputs, flash):
    """Our MTP head's graph run by our executor (GGML_CPU_BACKEND) from the state llama.cpp's MTP context held when
    its batch began (its KV cache after the prompt's batch), with the token ids and hidden-state rows llama.cpp set:
    logits within 1e-4 of the largest (the f32 bound of the trunk's referee). Measured 2026-12-04: 5.4e-7 (a),
    3.3e-7 (flash off, last row), 6.7e-6 (full)."""
    import torch

    from gdnpass import pipeline
    from gdnpass.kernels.backends import GGML_CPU_BACKEND
    from gdnpass.models.fill import fill
    from gdnpass.runtime import Executor

    c = captured(llama, files[which], mtp_outputs=outputs, flash_attn=flash, record_memory=True)
    want = torch.from_numpy(np.frombuffer(c.logits, dtype=np.float32).copy()).reshape(N_OUT[outputs], c.n_vocab)
    model, graph = ours(files[which], outputs, flash == "on")
    g = pipeline.run(graph, pipeline.PassOptions(fusion=False)).graph
    ex = Executor(g, backend=GGML_CPU_BACKEND)
    fill(ex, seed=0)  # (inputs as llama.cpp sets them: positions, mask, rows; checked equal to its bytes below)
    model.load_weights(ex, g)
    kv = {t.name: t for t in c.verify.leafs if t.buffer == "kv"}
    il = model.shape.mtp_layer
    assert set(kv) == {f"cache_k_l{il}", f"cache_v_l{il}"}  # (the MTP context's KV cache: the MTP block's alone)
    for t in g.leafs:
        if t.name in kv:
            raw = c.memory["kv"][kv[t.name].offset: kv[t.name].offset + t.nbytes]
            ex.view(t).view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    rec = c.verify.meta["input_bytes"]
    types = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "i64": np.int64}
    for name in (g.meta["token_input"], "mtp_h_input"):  # what the caller gives the head
        t = g.find(name)
        ex.view(t).copy_(torch.from_numpy(np.frombuffer(base64.b64decode(rec[name]), types[t.type.label]).copy())
                         .reshape(ex.view(t).shape))
    for name in ("inp_pos", "attn_inp_k_idxs", "attn_inp_v_idxs", "attn_inp_kq_mask", "out_ids"):
        t = g.find(name)
        theirs = np.frombuffer(base64.b64decode(rec[name]), types[t.type.label]).astype(np.float64)
        assert np.array_equal(ex.read(t).reshape(-1).double().numpy(), theirs), name
    ex.run()
    got = ex.read(g.find("result_output")).reshape(want.shape)
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= 1e-4, f"max |Δ| / max |ref| = {err:.3g}"


def test_the_trunk_of_an_mtp_file_equals_llama_cpp_s(llama, files):
    """A file with an MTP block, captured as a verify (the target alone, the MTP tensors not loaded): llama.cpp's
    trunk graph, and gdnpass's whole builder of the same file equal to it; the MTP block changes neither."""
    s = cap_mod.Settings(n_tokens=T, n_rs_seq=3, n_ubatch=N_UBATCH, n_batch=N_UBATCH)
    c = cap_mod.capture(files["a"], s, install=llama)
    model = open_model(files["a"])
    mine = model.build(model.config(n_tokens=T, n_rs_seq=3))
    assert signature(mine) == signature(c.verify)
    assert not any(t.name.startswith("blk.4.") for t in c.verify.leafs)


def test_capture_mtp_cli_then_run_check(llama, files, tmp_path, capsys):
    """``gdnpass capture --mtp`` writes the MTP context's graph; ``gdnpass run --graph`` executes llama.cpp's own
    MTP graph on its plan and inputs, unfused then fused: byte-identical."""
    from gdnpass import cli

    out = tmp_path / "mtp.json"
    assert cli.main(["capture", "--gguf", str(files["a"]), "--mtp", "--mtp-outputs", "last", "--ubatch", "8",
                     "--tokens", "3", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "MTP ubatch of 3 tokens (1 with logits) in the MTP context" in text, text
    assert cli.main(["run", "--graph", str(out), "--check", "-q"]) == 0
    text = capsys.readouterr().out
    assert "identical  result_output" in text and " 0 differing" in text, text
