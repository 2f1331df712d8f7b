"""llama.cpp itself as the referee: its own verify graph, captured, against our builder and our planner (issue 15).

Real llama.cpp (the pinned commit, ggml + libllama at -O0, built once per machine by ``gdnpass.frontends.llama.build``
into the user's cache; about 2.5 min the first time) runs tiny random qwen35 models written here with ``gguf``. For
two shapes and T = 4 tokens with n_rs_seq 0 and 3:

- our builder's GDN layers equal llama.cpp's node for node: ops, order, shapes, strides, views, op params, ggml's
  use counts;
- our planner, given llama.cpp's worst-case reserve graph, reproduces the byte offset of every tensor of the compute
  buffer in the verify graph, through the reserve plan bound slot by slot (llama.cpp never plans the verify graph
  itself), and the compute buffer's size;
- the pass fuses every GDN layer of the captured graph in upstream's q/k form, on llama.cpp's own plan.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gdnpass import alloc, fusion, ops, serialize
from gdnpass.errors import LlamaError
from gdnpass.frontends.compare import diff_layers, layer_nodes, signature
from gdnpass.frontends.llama import build, capture as cap_mod
from gdnpass.frontends.llama.worker import PINNED_TENSOR, Refused, check_layout
from gdnpass.ir import Op
from gdnpass.models import VerifyConfig, build_verify_graph, get_model
from gdnpass.models.fill import fill
from gdnpass.models.gguf_write import write_gguf
from support.referee import assert_graph_equals_capture, assert_plan_equals_capture, logits_from_llama_state

SHAPES = ("tiny-qwen35", "tiny-qwen35-b")
RS_SEQ = (0, 3)
T = 4
N_UBATCH = 8  # > n_rs_seq + 1 (llama.cpp asserts it); the reserve graph has 8 tokens


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    return {s: write_gguf(s, d / f"{s}.gguf", wtype="f32", seed=1) for s in SHAPES}


_CAPTURES: dict[tuple, cap_mod.Capture] = {}


def captured(llama, gguf_files, shape: str, rs: int, **kw) -> cap_mod.Capture:
    """One capture per (shape, n_rs_seq, settings) for the whole session; callers get their own copy."""
    key = (shape, rs, tuple(sorted(kw.items())))
    if key not in _CAPTURES:
        s = cap_mod.Settings(n_tokens=T, n_rs_seq=rs, n_ubatch=N_UBATCH, n_batch=N_UBATCH, **kw)
        _CAPTURES[key] = cap_mod.capture(gguf_files[shape], s, install=llama)
    return copy.deepcopy(_CAPTURES[key])


def ours(shape: str, rs: int):
    return build_verify_graph(VerifyConfig(model=shape, n_tokens=T, n_rs_seq=rs, wtype="f32", ab_wtype="f32"))


CASES = [(s, r) for s in SHAPES for r in RS_SEQ]
IDS = [f"{s}-rs{r}" for s, r in CASES]


# ---- the capture itself ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,rs", CASES, ids=IDS)
def test_capture_is_a_valid_graph_with_llama_cpp_s_plan(llama, gguf_files, shape, rs):
    c = captured(llama, gguf_files, shape, rs)
    g = c.verify
    ops.validate(g)  # every node re-derived by our shape rules: ne, nb, views as llama.cpp made them
    alloc.check_plan(g)  # llama.cpp's offsets: no two live tensors share bytes
    m = get_model(shape)
    assert sorted({n.layer for n in g.nodes if n.op is Op.GATED_DELTA_NET}) == m.gdn_layers
    assert g.meta["llama"]["commit"] == build.COMMIT
    assert g.meta["llama"]["settings"]["n_rs_seq"] == rs and g.meta["llama"]["settings"]["n_tokens"] == T
    assert g.meta["llama"]["reallocated"] is False and g.meta["llama"]["same_topology_as_reserve"]
    assert not [n for n in g.nodes if n.op is Op.OPAQUE], "every op of a qwen35 verify graph is modelled"
    # ggml's own use counts equal ours on every tensor of the graph
    assert c.use_counts == g.use_counts()


def test_capture_file_round_trip(llama, gguf_files, tmp_path):
    c = captured(llama, gguf_files, "tiny-qwen35", 3)
    path = tmp_path / "captured.json"
    serialize.save(c.verify, path)
    back = serialize.load(path)
    assert signature(back) == signature(c.verify)
    assert [(t.buffer, t.offset) for t in back.tensors()] == [(t.buffer, t.offset) for t in c.verify.tensors()]
    assert back.meta["llama"]["commit"] == build.COMMIT


def test_flash_attention_off_imports_the_soft_max_form(llama, gguf_files):
    c = captured(llama, gguf_files, "tiny-qwen35", 3, flash_attn="off")
    ops.validate(c.verify)
    got = [n.op for n in c.verify.nodes]
    assert Op.SOFT_MAX in got and Op.FLASH_ATTN_EXT not in got
    assert c.verify.meta["llama"]["flash_attn"] == "off"


def test_a_ggml_assert_is_one_line(llama, gguf_files):
    """n_ubatch must exceed n_rs_seq + 1: llama.cpp aborts the process; the capture says why in one line."""
    s = cap_mod.Settings(n_tokens=T, n_rs_seq=3, n_ubatch=4, n_batch=4, n_prompt=3)
    with pytest.raises(LlamaError) as e:
        cap_mod.capture(gguf_files["tiny-qwen35"], s, install=llama)
    msg = str(e.value)
    assert "\n" not in msg and "GGML_ASSERT(n_ubatch > n_keep_tail)" in msg and "n_rs_seq + 1" in msg


def test_layout_mismatch_is_refused_before_any_read():
    probe = {"tensor": {**PINNED_TENSOR.__dict__, "src": 160}, "graph": {}}
    with pytest.raises(Refused, match=r"ggml_tensor of this build differs .*src is 160, expected 152"):
        check_layout(probe, None)


# ---- our builder, node for node -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,rs", CASES, ids=IDS)
def test_builder_gdn_layers_equal_llama_cpp_s(llama, gguf_files, shape, rs):
    c = captured(llama, gguf_files, shape, rs)
    mine = ours(shape, rs)
    gdn = get_model(shape).gdn_layers
    for il in gdn:
        got = diff_layers(mine, c.verify, il, their_uses=c.use_counts)
        if il == gdn[-1]:
            # The one named difference: our builder makes the GDN layers only (the whole model is issue 17), so its
            # last layer's output is the graph's OUTPUT with no reader; llama.cpp's feeds the next (attention) layer.
            k = len(layer_nodes(mine, il)) - 1
            assert got == [f"layer {il} node {k} ('l_out-{il}' / 'l_out-{il}'): flags: 18 vs 16; uses: 0 vs 2"]
        else:
            assert got == [], il


@pytest.mark.parametrize("flash", ["on", "off"])
@pytest.mark.parametrize("shape,rs", CASES, ids=IDS)
def test_whole_builder_graph_equals_llama_cpp_s(llama, gguf_files, shape, rs, flash):
    """The whole forward (token embedding, GDN and attention layers, output norm, out_ids rows, lm head): llama.cpp's
    graph node for node (op, type, ne, nb, op params, views, sources by position, flags) and leaf for leaf, with ggml's
    use counts. Leafs are compared without their buffers (ours keeps inputs in an input buffer, llama.cpp in its
    compute buffer) and the leaf no node reads (inp_embd) by name only: the capture never sees it."""
    c = captured(llama, gguf_files, shape, rs, flash_attn=flash)
    assert c.verify.meta["llama"]["flash_attn"] == flash
    mine = build_verify_graph(VerifyConfig(model=shape, n_tokens=T, n_rs_seq=rs, wtype="f32", ab_wtype="f32",
                                           whole=True, flash_attn=flash == "on"))
    ops.validate(mine)
    assert_graph_equals_capture(mine, c)


def test_tied_embeddings_are_one_leaf_as_in_llama_cpp(llama, tmp_path):
    """A file without output.weight: llama.cpp's loader gives the lm head the token_embd tensor itself (one leaf read
    by GET_ROWS and by the head's MUL_MAT); so does our builder, and the weights are held (and loaded) once."""
    import dataclasses

    from gdnpass.models.gguf_model import open_model

    tied = dataclasses.replace(get_model("tiny-qwen35"), name="tiny-qwen35-tied", tie_embeddings=True)
    path = write_gguf(tied, tmp_path / "tied.gguf", wtype="f32", seed=1)
    s = cap_mod.Settings(n_tokens=T, n_rs_seq=3, n_ubatch=N_UBATCH, n_batch=N_UBATCH)
    c = cap_mod.capture(path, s, install=llama)
    model = open_model(path)
    mine = model.build(model.config(n_tokens=T, n_rs_seq=3))
    assert signature(mine) == signature(c.verify)
    assert [t.name for t in mine.leafs] == [t.name for t in c.verify.leafs]
    assert [t.name for t in mine.leafs].count("token_embd.weight") == 1
    head = mine.find("result_output")
    assert head.src[0] is mine.find("model.input_embed").src[0]


def test_quantized_file_structure_equals_llama_cpp_s(llama, tmp_path):
    """A Q8_0 file (every projection, the token embedding and the lm head): structure (llama.cpp's CPU path quantizes
    the activations to Q8_0 blocks too, which gdnpass does not model, so its logits are not compared here). Node for
    node, our builder's graph of the file equals llama.cpp's, the quantized weights on both sides Q8_0 leafs of the
    same strides (gdnpass holds the file's blocks as llama.cpp does; no f32 stand-ins)."""
    from gdnpass.models.gguf_model import open_model

    path = write_gguf("tiny-qwen35", tmp_path / "q8.gguf", wtype="q8_0", seed=1)
    s = cap_mod.Settings(n_tokens=T, n_rs_seq=3, n_ubatch=N_UBATCH, n_batch=N_UBATCH)
    c = cap_mod.capture(path, s, install=llama)
    model = open_model(path)
    assert model.dequantized == [] and c.verify.meta["llama"]["dequantized"] == {}
    assert sum(t == "Q8_0" for t in model.types.values()) == 33
    mine = model.build(model.config(n_tokens=T, n_rs_seq=3))
    ops.validate(c.verify)
    assert signature(mine) == signature(c.verify)
    unseen = set(c.verify.meta["llama"]["unseen_leafs"])  # (inp_embd: by name, as in the test above)
    leaf = lambda t: (t.name,) if t.name in unseen else (t.name, t.type, t.ne, t.nb, int(t.flags))  # noqa: E731
    assert [leaf(t) for t in mine.leafs] == [leaf(t) for t in c.verify.leafs]  # (buffers differ by design)
    assert sum(t.type.label == "q8_0" for t in c.verify.leafs) == 33
    # fused vs unfused on llama.cpp's graph, byte for byte (seeded weights: random Q8_0 blocks)
    from gdnpass.check import check_fusion

    out = check_fusion(c.verify)
    assert out.identical and sum(a.pattern == "gdn_conv_chain" for a in out.report.applied) == 3


# ---- our planner, offset for offset ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,rs", CASES, ids=IDS)
def test_planner_reproduces_llama_cpp_s_offsets(llama, gguf_files, shape, rs):
    """Plan the reserve graph (n_ubatch tokens) as gallocr does, bind it to the verify graph node by node, and
    compare every compute-buffer tensor's offset with the one llama.cpp gave it: no difference at all, which covers
    every tensor the chain rules read (cache-row GET_ROWS, CONCAT, projection, SSM_CONV/SiLU, the norm outputs, the
    ssm-state GET_ROWS)."""
    c = captured(llama, gguf_files, shape, rs)
    compute, _ = assert_plan_equals_capture(c)
    assert len(compute) > 50
    chain = {Op.GET_ROWS, Op.CONCAT, Op.MUL_MAT, Op.SSM_CONV, Op.UNARY, Op.RMS_NORM, Op.SCALE}
    assert {t.op for t in compute} >= chain


def test_bind_replans_a_graph_that_does_not_fit(llama, gguf_files):
    """The other branch of ggml_gallocr_needs_realloc: a graph whose tensor outgrows its reserve slot is planned
    itself."""
    c = captured(llama, gguf_files, "tiny-qwen35", 3)
    alloc.plan(c.reserve, 32, "compute")
    small = next(t for t in c.reserve.nodes if t.op is Op.CONCAT)
    small.ne = (small.ne[0], 1, 1, 1)  # the reserve slot is now smaller than the verify tensor
    b = alloc.bind(c.reserve, c.verify, "compute")
    assert b.reallocated and "needs" in b.why


# ---- the pass on llama.cpp's graph ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,rs", CASES, ids=IDS)
def test_the_pass_fuses_every_gdn_layer_of_the_capture(llama, gguf_files, shape, rs):
    c = captured(llama, gguf_files, shape, rs)
    rep = fusion.fuse(c.verify, enabled=True)
    chains = sorted(a.layer for a in rep.applied if a.pattern == "gdn_conv_chain")
    assert chains == get_model(shape).gdn_layers, [r for r in rep.refused if r.pattern == "gdn_conv_chain"]
    # and every GDN writes its snapshots straight into llama.cpp's own cache rows
    caches = sorted(a.layer for a in rep.applied if a.pattern == "gdn_state_cache")
    assert caches == get_model(shape).gdn_layers, [r for r in rep.refused if r.pattern == "gdn_state_cache"]
    # and every layer's FFN down projection adds its residual as it stores (the layer output, llama.cpp's l_out)
    residuals = sorted(a.layer for a in rep.applied if a.pattern == "mul_mat_add" and a.anchor.startswith("l_out"))
    assert residuals == list(range(get_model(shape).n_layer)), [r for r in rep.refused if r.pattern == "mul_mat_add"]
    fused = [n for n in c.verify.nodes if n.op is Op.GDN_CONV_CHAIN]
    assert all(n.op_params["norm"] == "rms" for n in fused)  # upstream's RMS_NORM + SCALE form
    ops.validate(c.verify)


def test_capture_then_dump_explain_cli(llama, gguf_files, tmp_path):
    out = tmp_path / "verify.json"
    env = {**os.environ, "GDNPASS_CACHE": str(build.cache_root())}
    run = lambda *a: subprocess.run([sys.executable, "-m", "gdnpass.cli", *a], capture_output=True, text=True,  # noqa
                                    env=env, timeout=300)
    r = run("capture", "--gguf", str(gguf_files["tiny-qwen35-b"]), "--tokens", "4", "--rs-seq", "3", "--ubatch", "8",
            "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "GDN layers [0, 1, 2, 4, 5, 6]" in r.stdout
    r = run("dump", "--graph", str(out), "--fuse", "--explain")
    assert r.returncode == 0, r.stderr
    assert "fusion gdn_conv_chain: applied 6\n" in r.stdout, r.stdout


def test_run_check_on_a_captured_graph(llama, gguf_files, tmp_path, capsys):
    """``gdnpass run --graph CAPTURE --check``: llama.cpp's own graph and memory plan, executed unfused then fused
    on the inputs llama.cpp set (recorded by the capture: token ids, positions, KQ mask, row ids, rs_s_copy);
    byte-identical."""
    import base64

    import numpy as np

    from gdnpass import cli
    from gdnpass.runtime import Executor

    c = captured(llama, gguf_files, "tiny-qwen35", 3)
    rec = c.verify.meta["input_bytes"]
    assert set(rec) == {"inp_tokens", "inp_pos", "out_ids", "attn_inp_k_idxs", "attn_inp_v_idxs",
                        "attn_inp_kq_mask", "rs_s_copy"}
    tokens = np.frombuffer(base64.b64decode(rec["inp_tokens"]), dtype=np.int32).tolist()
    assert tokens == [x % c.n_vocab for x in cap_mod.Settings().tokens()[1][:T]]
    ex = Executor(c.verify)
    fill(ex, seed=0)
    assert ex.read("inp_tokens").reshape(-1).tolist() == tokens  # the fill takes llama.cpp's inputs
    path = tmp_path / "captured.json"
    serialize.save(c.verify, path)
    assert cli.main(["run", "--graph", str(path), "--check", "-q"]) == 0
    out = capsys.readouterr().out
    assert "gdn_conv_chain: 3 applied" in out and " 0 differing" in out and "DIFFERS" not in out, out
    assert "identical  result_output" in out


# ---- our whole forward's logits against llama.cpp's ----------------------------------------------------------------


# max |Δ| / max |ref| of our logits against llama.cpp's CPU logits, by the file's weight type (issue 17; the
# quantized files: issue 34)
LOGITS_TOL = {"f32": 1e-4, "f16": 2e-2, "bf16": 2e-2, **dict.fromkeys(("q8_0", "q4_k_m", "q5_k_m", "q6_k"), 1e-2)}


@pytest.fixture(scope="session")
def typed_files(tmp_path_factory, gguf_files, llama) -> dict[str, Path]:
    """tiny-qwen35 (seed 1) in each weight type: the f32 file of the other tests, f16 / bf16 and Q8_0 ones (gguf's
    writer), and Q4_K_M, Q5_K_M and Q6_K files from llama.cpp's own quantizer (of tiny-qwen35 with rows of 256:
    every matrix a K-quant; Q4_K + Q6_K, Q5_K + Q6_K, Q6_K)."""
    from gdnpass.frontends.llama.quantize import quantize, tiny_k256

    d = tmp_path_factory.mktemp("typed")
    k256 = write_gguf(tiny_k256(), d / "tiny-k256-f32.gguf", wtype="f32", seed=1)
    return {"f32": gguf_files["tiny-qwen35"],
            **{w: write_gguf("tiny-qwen35", d / f"tiny-qwen35-{w}.gguf", wtype=w, seed=1)
               for w in ("f16", "bf16", "q8_0")},
            **{mix: quantize(k256, d / f"tiny-k256-{mix}.gguf", mix, install=llama, threads=2).dst
               for mix in ("q4_k_m", "q5_k_m", "q6_k")}}


@pytest.mark.parametrize("wtype,rs,flash", [("f32", 0, "on"), ("f32", 3, "on"), ("f32", 3, "off"),
                                            ("f16", 3, "on"), ("f16", 3, "off"), ("bf16", 3, "on"),
                                            ("bf16", 3, "off"), ("q8_0", 3, "on"), ("q4_k_m", 3, "on"),
                                            ("q5_k_m", 3, "on"), ("q6_k", 3, "off"), ("q6_k", 3, "on"),
                                            ("q4_k_m", 3, "off")])
def test_whole_builder_logits_match_llama_cpp_s(llama, typed_files, wtype, rs, flash):
    """Our own whole forward of the model file, run by our executor from the state llama.cpp's memory held when its
    verify began (the prompt's K/V cache and recurrent states, recorded by the capture, copied leaf by leaf), with the
    capture's token ids and the file's weights: its logits against llama.cpp's CPU logits, max |Δ| / max |ref| within
    LOGITS_TOL (1e-4 for the f32 file, 2e-2 for f16 / bf16). Fused vs unfused: byte-identical.

    What GGML_CPU_BACKEND models of ggml-cpu's arithmetic (gdnpass.opspec.adapters.GGML_CPU): MUL_MAT rounds its
    f32 activation to an f16 / bf16 weight's vec_dot type (round to nearest even) before an f32 product;
    FLASH_ATTN_EXT rounds Q to the F16 K cache's type and accumulates V (F16) in f16; RMS_NORM sums its squares in
    double. The F16 KV cache itself is in the graph (SET_ROWS converts K and V to f16, as llama.cpp's does). Not
    modelled: the order of ggml's f32 sums (SIMD lanes, tiles). Those ~1e-7 differences flip an f16 / bf16 rounding
    of an activation now and then, one ulp of that type on one element (node by node against llama.cpp's recorded
    node bytes, the first differences are 1e-6 relative, then 1e-5 after the first flipped roundings), so the f16 /
    bf16 logits agree less closely than the f32 ones. Measured (2026-12-01, this 2-core machine, n_rs_seq 3):
    f32 1.6e-5 / 8.3e-6 (flash on / off), f16 5.1e-4 / 4.8e-4, bf16 1.5e-3 / 1.1e-3; the plain torch backend, which
    rounds nowhere, gives f16 1.1e-3 and bf16 7.1e-3 (and f32 1.9e-4, over the f32 bound).

    Quantized files (issue 34): ggml-cpu quantizes the activation of a quantized product to its vec_dot type (q8_0
    blocks of 32 for Q8_0, q8_K blocks of 256 for the K-quants), which GGML_CPU_BACKEND models
    (quants.quantize_x_ggml_cpu). Measured (2026-12-03): Q8_0 9.8e-8; llama.cpp's own mixes Q4_K_M (Q4_K, Q6_K)
    1.5e-7 / 2.1e-7 (flash on / off), Q5_K_M (Q5_K, Q6_K) 1.2e-7, Q6_K 2.8e-7 / 5.7e-3. The 5.7e-3: an 8-bit
    rounding of an activation flipped by a ~1e-7 difference upstream of it (the f16 files' effect, with a step
    of 1/254 instead of 1/2048), hence the bound 1e-2. llama.cpp's CUDA backend quantizes to q8_1 groups of 32
    (quants.quantize_x), as gdnpass's kernels do for Q8_0: against the CPU's logits that scheme is 3.2e-2 (Q8_0) /
    6.7e-2 (Q4_K_M) apart on these random tiny models, exact f32 activations 4.1e-2 / 4.0e-2, both over the bound:
    the activations' 8-bit rounding, not the weights, is what separates backends on quantized files. For the
    K-quants the kernels take ggml-cpu's q8_K blocks (quants.mul_mat_q: the scheme modelled here)."""
    err, out = logits_from_llama_state(llama, typed_files[wtype], T, rs, N_UBATCH, flash)
    assert err <= LOGITS_TOL[wtype], f"{wtype}: max |Δ| / max |ref| = {err:.3g}"
    assert out.identical and any(c.name == "result_output" for c in out.compared)


@pytest.mark.parametrize("wtype,rs", [("f32", 0), ("f32", 3), ("bf16", 3)])
def test_prompt_then_verify_in_our_executor_match_llama_cpp_s_logits(llama, typed_files, wtype, rs):
    """The whole step in our executor, from nothing but the file: the prompt decoded in llama.cpp's ubatches (its
    split, its n_rs_seq planes, the KV cache filled by our SET_ROWS), then the verify ubatch, by the generate loop's
    engine (gdnpass.engine, the executor with GGML_CPU_BACKEND); its verify logits against llama.cpp's decode of
    the same prompt and verify tokens, within LOGITS_TOL. (The test above starts from llama.cpp's recorded state.)"""
    import numpy as np
    import torch

    from gdnpass.engine import Engine, Model, Settings
    from gdnpass.kernels.backends import GGML_CPU_BACKEND

    path = typed_files[wtype]
    s = cap_mod.Settings(n_tokens=T, n_rs_seq=rs, n_ubatch=N_UBATCH, n_batch=N_UBATCH, flash_attn="on")
    c = cap_mod.capture(path, s, install=llama)
    want = torch.from_numpy(np.frombuffer(c.logits, dtype=np.float32).copy()).reshape(T, c.n_vocab)
    prompt, verify = ([x % c.n_vocab for x in part] for part in s.tokens())
    engine = Engine(Model.from_gguf(path), Settings(draft_max=rs, n_rs_seq=rs, n_ubatch=N_UBATCH,
                                                     n_ctx=s.n_ctx, flash_attn=True, backend=GGML_CPU_BACKEND))
    engine.prefill(prompt)
    got = engine.decode(verify)
    err = float((got - want).abs().max() / want.abs().max())
    print(f"{wtype}, n_rs_seq {rs}: max |Δ| / max |ref| = {err:.3g}")
    assert err <= LOGITS_TOL[wtype], f"{wtype}, n_rs_seq {rs}: max |Δ| / max |ref| = {err:.3g}"
