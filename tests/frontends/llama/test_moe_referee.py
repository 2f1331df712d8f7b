"""llama.cpp as the referee of the qwen35moe forward (issue 36 step 3): the pinned llama.cpp's verify graph of a tiny
random qwen35moe file (tiny-qwen35moe: 8 experts, 2 used, a gated shared expert) against gdnpass's builder.

- the graph: node for node (op, type, ne, nb, op params, views, sources, flags), leaf for leaf, ggml's use counts;
- the plan: llama.cpp's reserve graph planned by gdnpass gives its compute buffer's size, and bound slot by slot to
  the verify graph (llama.cpp's and the builder's) every compute tensor the offset llama.cpp gave it;
- the logits: the builder's graph run from llama.cpp's recorded state (GGML_CPU_BACKEND) within the f32 file's bound
  of tests/frontends/llama/test_referee.py (1e-4), the bf16 file's (2e-2), the Q8_0 file's (1e-2);
- fused vs unfused byte for byte, through ``gdnpass run --gguf --check`` too (torch backend).

Each capture is about a second on the -O0 build.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from gdnpass import alloc, ops, pipeline
from gdnpass.frontends.compare import signature
from gdnpass.frontends.llama import capture as cap_mod
from gdnpass.ir import Op
from gdnpass.models import PRESETS
from gdnpass.models.fill import fill
from gdnpass.models.gguf_model import open_model
from gdnpass.models.gguf_write import write_gguf
from support.referee import assert_graph_equals_capture, assert_plan_equals_capture, logits_from_llama_state

MOE = PRESETS["tiny-qwen35moe"]
T, N_UBATCH = 4, 8
# max |Δ| / max |ref| of the logits, as the dense referee's (LOGITS_TOL there)
LOGITS_TOL = {"f32": 1e-4, "bf16": 2e-2, "q8_0": 1e-2}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("moe")
    return {w: write_gguf(MOE, d / f"moe-{w}.gguf", wtype=w, seed=1) for w in ("f32", "bf16", "q8_0")}


_CAPTURES: dict[tuple, cap_mod.Capture] = {}


def captured(llama, path: Path, rs: int, **kw) -> cap_mod.Capture:
    key = (str(path), rs, tuple(sorted(kw.items())))
    if key not in _CAPTURES:
        s = cap_mod.Settings(n_tokens=T, n_rs_seq=rs, n_ubatch=N_UBATCH, n_batch=N_UBATCH, **kw)
        _CAPTURES[key] = cap_mod.capture(path, s, install=llama)
    return copy.deepcopy(_CAPTURES[key])


def ours(path: Path, rs: int, flash: bool = True, **kw):
    model = open_model(path)
    return model, model.build(model.config(n_tokens=T, n_rs_seq=rs, flash_attn=flash, **kw))


@pytest.mark.parametrize("rs,flash", [(0, "on"), (3, "on"), (3, "off")])
def test_whole_moe_graph_equals_llama_cpp_s(llama, files, rs, flash):
    """The whole qwen35moe forward, every layer's expert FFN included (router, softmax, ARGSORT top-k, the weights'
    GET_ROWS / SUM_ROWS / CLAMP / DIV, MUL_MAT_ID gate, up and down, the weighted views and their ADDs, the shared
    expert and its sigmoid gate): llama.cpp's graph node for node and leaf for leaf, with ggml's use counts."""
    c = captured(llama, files["f32"], rs, flash_attn=flash)
    _, mine = ours(files["f32"], rs, flash == "on")
    ops.validate(mine)
    assert_graph_equals_capture(mine, c)
    n = {op: sum(t.op is op for t in mine.nodes) for op in (Op.ARGSORT, Op.SUM_ROWS, Op.CLAMP, Op.DIV, Op.MUL_MAT_ID)}
    assert n == {Op.ARGSORT: MOE.n_layer, Op.SUM_ROWS: MOE.n_layer, Op.CLAMP: MOE.n_layer, Op.DIV: MOE.n_layer,
                 Op.MUL_MAT_ID: 3 * MOE.n_layer}


@pytest.mark.parametrize("wtype", ["bf16", "q8_0"])
def test_typed_moe_graph_equals_llama_cpp_s(llama, files, wtype):
    """bf16 and Q8_0 files: expert stacks and shared expert of the file's type (Q8_0 blocks held as llama.cpp holds
    them), router and shared gate f32 (the converter's rule)."""
    c = captured(llama, files[wtype], 3)
    _, mine = ours(files[wtype], 3)
    assert signature(mine) == signature(c.verify)
    ids = [t for t in mine.nodes if t.op is Op.MUL_MAT_ID]
    assert {t.src[0].type.label for t in ids} == {wtype}
    assert {t.src[0].type.label for t in mine.nodes if t.name.startswith(("ffn_moe_logits", "shared_expert_gate-"))} \
        == {"f32"}


@pytest.mark.parametrize("rs", [0, 3])
def test_planner_reproduces_llama_cpp_s_moe_offsets(llama, files, rs):
    """llama.cpp's reserve graph planned as gallocr plans it: its compute buffer's size; bound to the verify graph,
    every compute tensor at llama.cpp's offset, and bound to the builder's graph (the same graph, node for node)
    every tensor at the offset llama.cpp gave the tensor in its place (CLAMP over its SUM_ROWS, in place)."""
    c = captured(llama, files["f32"], rs)
    g = c.verify
    compute, theirs = assert_plan_equals_capture(c)
    assert len(compute) > 100 and {Op.ARGSORT, Op.SUM_ROWS, Op.CLAMP, Op.DIV, Op.MUL_MAT_ID} <= {t.op for t in compute}
    clamps = [t for t in g.nodes if t.op is Op.CLAMP]
    assert all(t.offset == t.src[0].offset for t in clamps)  # gallocr put each CLAMP over its SUM_ROWS
    # the builder's graph, bound to the same reserve plan: node i at the offset of llama.cpp's node i
    _, mine = ours(files["f32"], rs)
    b = alloc.bind(c.reserve, mine, "compute")
    assert not b.reallocated, b.why
    want = [theirs.get(t.uid) for t in g.nodes]
    got = [(t.buffer, t.offset) if t.view_src is None else None for t in mine.nodes]
    diff = [(i, t.name, x, y) for i, (t, x, y) in enumerate(zip(mine.nodes, got, want))
            if x is not None and y is not None and y[0] == "compute" and x != y]
    assert diff == [] and sum(x is not None and x[0] == "compute" for x in got) > 150


@pytest.mark.parametrize("wtype,rs,flash", [("f32", 3, "on"), ("f32", 0, "off"), ("bf16", 3, "on"),
                                            ("q8_0", 3, "on")])
def test_moe_logits_match_llama_cpp_s(llama, files, wtype, rs, flash):
    """The builder's whole qwen35moe forward run by gdnpass's executor (GGML_CPU_BACKEND: MUL_MAT_ID rounds its
    activation to a bf16 expert's type as ggml-cpu does) from llama.cpp's state when its verify began, with its
    token ids and the file's weights: logits within LOGITS_TOL of llama.cpp's CPU logits; fused vs unfused
    byte-identical. Measured 2026-12-04: see docs/moe.md."""
    err, out = logits_from_llama_state(llama, files[wtype], T, rs, N_UBATCH, flash)
    print(f"{wtype} rs={rs} flash={flash}: max |Δ| / max |ref| = {err:.3g}")
    assert err <= LOGITS_TOL[wtype], f"{wtype}: max |Δ| / max |ref| = {err:.3g}"
    assert out.identical and any(x.name == "result_output" for x in out.compared)
    assert sum(a.pattern == "gdn_conv_chain" for a in out.report.applied) == len(MOE.gdn_layers)


def test_run_check_and_dump_on_the_moe_file(files, capsys):
    """``gdnpass run --gguf moe.gguf --check``: the whole qwen35moe forward unfused then fused (torch backend),
    byte-identical, every GDN layer fused; ``dump --fuse --explain`` says so and lists the expert FFN."""
    from gdnpass import cli

    assert cli.main(["run", "--gguf", str(files["f32"]), "--tokens", "4", "--rs-seq", "3", "--check", "-q"]) == 0
    out = capsys.readouterr().out
    assert "gdn_conv_chain: 3 applied" in out and " 0 differing" in out and "DIFFERS" not in out, out
    assert "identical  ffn_moe_out-0" in out and "identical  result_output" in out
    # the acceptance line: dump --fuse --explain shows every GDN layer fused, and the expert FFN
    assert cli.main(["dump", "--gguf", str(files["f32"]), "--fuse", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "fusion gdn_conv_chain: applied 3\n" in out and "fusion gdn_state_cache: applied 3\n" in out, out
    assert cli.main(["dump", "--gguf", str(files["f32"]), "--fuse"]) == 0
    out = capsys.readouterr().out  # (each layer's router is one MOE_ROUTER: its CLAMP is inside)
    assert out.count(" MUL_MAT_ID ") == 3 * MOE.n_layer and out.count(" MOE_ROUTER ") == MOE.n_layer
    assert cli.main(["dump", "--gguf", str(files["f32"])]) == 0
    assert "max=inf" in capsys.readouterr().out  # (the unfused CLAMP's bound)


# ---- the MTP block of a qwen35moe file: its FFN is the expert FFN too --------------------------------------------


@pytest.fixture(scope="module")
def mtp_file(tmp_path_factory) -> Path:
    import dataclasses

    shape = dataclasses.replace(MOE, name="tiny-qwen35moe-mtp", nextn_predict_layers=1)
    return write_gguf(shape, tmp_path_factory.mktemp("moe-mtp") / "mtp.gguf", seed=1, tokenizer="none")


def test_mtp_moe_head_equals_llama_cpp_s(llama, mtp_file):
    """llama.cpp's MTP context of a qwen35moe file (llama_model_qwen35moe::graph_mtp: the block's expert FFN and
    shared expert): the builder's MTP head node for node, leaf for leaf (buffers aside), ggml's use counts; the
    reserve plan's size and offsets; its logits from llama.cpp's MTP state within 1e-4 (measured 2026-12-04: see
    docs/moe.md), as tests/frontends/llama/test_mtp_referee.py checks the dense head."""
    import base64

    from gdnpass.frontends.compare import leaf_signature
    from gdnpass.kernels.backends import GGML_CPU_BACKEND
    from gdnpass.runtime import Executor

    s = cap_mod.Settings(n_tokens=T, n_rs_seq=3, n_ubatch=N_UBATCH, n_batch=N_UBATCH, n_prompt=8, mtp=True,
                         record_memory=True)
    c = cap_mod.capture(mtp_file, s, install=llama)
    g = c.verify
    model = open_model(mtp_file)
    mine = model.build(model.mtp_config(n_tokens=T, n_past=8, flash_attn=True))
    ops.validate(mine)
    assert signature(mine) == signature(g) and sum(t.op is Op.MUL_MAT_ID for t in mine.nodes) == 3
    drop_buffer = lambda rows: [r[:4] + r[5:] for r in rows]  # noqa: E731
    assert drop_buffer(leaf_signature(mine)) == drop_buffer(leaf_signature(g))
    pos = lambda gr, counts: [counts.get(t.uid, 0) for t in [*gr.leafs, *gr.nodes]]  # noqa: E731
    assert pos(mine, mine.use_counts()) == pos(g, c.use_counts)
    theirs = {t.uid: (t.buffer, t.offset) for t in g.tensors() if t.view_src is None}
    planned = alloc.plan(c.reserve, g.meta["buffers"]["compute"]["alignment"], "compute")
    assert planned.buffers["compute"] == g.meta["buffers"]["compute"]["size"]
    assert not alloc.bind(c.reserve, g, "compute").reallocated
    compute = [t for t in g.tensors() if t.view_src is None and theirs[t.uid][0] == "compute"]
    assert [(t.name, t.offset, theirs[t.uid][1]) for t in compute if (t.buffer, t.offset) != theirs[t.uid]] == []
    # the logits, from the MTP context's KV cache and the inputs llama.cpp set (token ids, hidden-state rows)
    want = torch.from_numpy(np.frombuffer(c.logits, dtype=np.float32).copy()).reshape(T, c.n_vocab)
    run = pipeline.run(model.build(model.mtp_config(n_tokens=T, n_past=8, flash_attn=True)),
                       pipeline.PassOptions(fusion=False)).graph
    ex = Executor(run, backend=GGML_CPU_BACKEND)
    fill(ex, seed=0)
    model.load_weights(ex, run)
    kv = {t.name: t for t in g.leafs if t.buffer == "kv"}
    for t in run.leafs:
        if t.name in kv:
            raw = c.memory["kv"][kv[t.name].offset: kv[t.name].offset + t.nbytes]
            ex.view(t).view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    rec = g.meta["input_bytes"]
    for name in (run.meta["token_input"], "mtp_h_input"):
        t = run.find(name)
        dtype = {"f32": np.float32, "i32": np.int32}[t.type.label]
        ex.view(t).copy_(torch.from_numpy(np.frombuffer(base64.b64decode(rec[name]), dtype).copy())
                         .reshape(ex.view(t).shape))
    ex.run()
    got = ex.read(run.find("result_output")).reshape(want.shape)
    err = float((got - want).abs().max() / want.abs().max())
    print(f"mtp: max |Δ| / max |ref| = {err:.3g}")
    assert err <= 1e-4, f"max |Δ| / max |ref| = {err:.3g}"
