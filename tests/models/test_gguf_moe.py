"""qwen35moe files (issue 36): written as llama.cpp's qwen35moe loader reads them, read back with their expert
hparams, every tensor checked; the builder builds the expert FFN."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gdnpass.models import PRESETS, VerifyConfig, build_verify_graph  # noqa: E402
from gdnpass.models.gguf_model import open_model  # noqa: E402
from gdnpass.models.gguf_write import (GgufError, gguf_metadata, moe_ffn_tensors, read_shape, tensor_plan,  # noqa: E402
                                       write_gguf)
from tests.support.gguf_edit import rewrite_gguf  # noqa: E402

MOE = PRESETS["tiny-qwen35moe"]


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    return write_gguf(MOE, tmp_path_factory.mktemp("moe") / "moe.gguf", wtype="f32", seed=1)


def edited(src, dst, **kv):
    """``src`` with the metadata keys in ``kv`` set (None: removed)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name in kv:
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for k, v in kv.items():
        if v is not None:
            w.add_uint32(k, v)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_write_read_round_trip(moe_file):
    """The file is arch qwen35moe with its expert keys; read back it is the shape written."""
    r = gguf.GGUFReader(moe_file)
    assert r.fields["general.architecture"].contents() == "qwen35moe"
    assert not [k for k in r.fields if k.startswith("qwen35.")]
    for key, v in gguf_metadata(MOE).items():
        assert key.startswith("qwen35moe.") and r.fields[key].contents() == pytest.approx(v, rel=1e-7)
    assert int(r.fields["qwen35moe.expert_count"].contents()) == MOE.n_expert
    assert read_shape(moe_file) == MOE
    m = open_model(moe_file)
    assert m.shape == MOE and m.shape.arch == "qwen35moe"


def test_tensors_are_the_loaders(moe_file):
    """Every layer has the router, the three expert stacks and the shared expert with llama.cpp's ne, and no dense
    FFN; the router and the shared gate are f32 (the converter's FFN_GATE_INP rule), the experts the weight type."""
    r = gguf.GGUFReader(moe_file)
    ne = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    types = {t.name: t.tensor_type.name for t in r.tensors}
    E, X, Fe, Fs = MOE.n_embd, MOE.n_expert, MOE.n_ff_exp, MOE.n_ff_shexp
    for il in range(MOE.n_layer):
        b = f"blk.{il}."
        assert ne[b + "ffn_gate_inp.weight"] == [E, X]
        assert ne[b + "ffn_gate_exps.weight"] == ne[b + "ffn_up_exps.weight"] == [E, Fe, X]
        assert ne[b + "ffn_down_exps.weight"] == [Fe, E, X]
        assert ne[b + "ffn_gate_inp_shexp.weight"] == [E]
        assert ne[b + "ffn_gate_shexp.weight"] == ne[b + "ffn_up_shexp.weight"] == [E, Fs]
        assert ne[b + "ffn_down_shexp.weight"] == [Fs, E]
        assert b + "ffn_up.weight" not in ne and b + "ffn_gate.weight" not in ne
    bf = write_gguf(MOE, moe_file.with_name("bf16.gguf"), wtype="bf16")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(bf).tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.ffn_gate_inp_shexp.weight"] == "F32"
    assert types["blk.0.ffn_down_exps.weight"] == types["blk.0.ffn_up_shexp.weight"] == "BF16"


def test_mtp_block_has_the_expert_ffn(tmp_path):
    """llama.cpp's qwen35moe load_block_mtp: the MTP block's FFN is the expert FFN too."""
    shape = dataclasses.replace(MOE, nextn_predict_layers=1)
    names = {n for n, _, _ in tensor_plan(shape)}
    want = {n for n, _, _ in moe_ffn_tensors(shape)(f"blk.{MOE.n_layer}.")}
    assert want <= names and f"blk.{MOE.n_layer}.ffn_up.weight" not in names
    assert read_shape(write_gguf(shape, tmp_path / "mtp.gguf")) == shape


def test_llama_cpp_loads_and_runs_it(llama, moe_file):
    """The referee: llama.cpp loads the file as qwen35moe and decodes a verify ubatch to finite logits, through the
    expert FFN (its graph has MUL_MAT_ID nodes for every layer's gate, up and down)."""
    from gdnpass.frontends.llama import capture as cap_mod
    from gdnpass.ir import Op

    c = cap_mod.capture(moe_file, cap_mod.Settings(n_tokens=4, n_rs_seq=3, n_ubatch=8, n_batch=8), install=llama)
    logits = np.frombuffer(c.logits, dtype=np.float32)
    assert logits.size == 4 * MOE.vocab_size and np.isfinite(logits).all()
    assert c.settings["n_rs_seq"] == 3  # qwen35moe rolls back (llama.cpp clamps it to 0 where it cannot)
    ids = [n for n in c.verify.nodes if n.op is Op.MUL_MAT_ID]
    assert len(ids) == 3 * MOE.n_layer
    assert {n.src[0].name for n in ids} >= {f"blk.{il}.ffn_{w}_exps.weight" for il in range(MOE.n_layer)
                                             for w in ("gate", "up", "down")}


def test_expert_widths_default_as_llama_cpp(moe_file, tmp_path):
    """Without the width keys llama.cpp takes feed_forward_length / expert_used_count and feed_forward_length."""
    p = edited(moe_file, tmp_path / "w.gguf", **{"qwen35moe.expert_feed_forward_length": None,
                                                  "qwen35moe.expert_shared_feed_forward_length": None,
                                                  "qwen35moe.feed_forward_length": 2 * MOE.n_ff_exp})
    s = read_shape(p)
    assert (s.n_ff_exp, s.n_ff_shexp) == (2 * MOE.n_ff_exp // MOE.n_expert_used, 2 * MOE.n_ff_exp)


@pytest.mark.parametrize("kv,msg", [
    ({"qwen35moe.expert_count": 0}, "qwen35moe.expert_count must be >= 1"),
    ({"qwen35moe.expert_count": None}, "lacks qwen35moe.expert_count"),
    ({"qwen35moe.expert_used_count": 9}, "qwen35moe.expert_used_count must be 1..qwen35moe.expert_count 8"),
    ({"qwen35moe.expert_feed_forward_length": None, "qwen35moe.feed_forward_length": None},
     "qwen35moe.expert_feed_forward_length is missing or 0"),
])
def test_bad_expert_keys_are_one_line(moe_file, tmp_path, kv, msg):
    p = edited(moe_file, tmp_path / "bad.gguf", **kv)
    with pytest.raises(GgufError, match=msg) as e:
        open_model(p)
    assert "\n" not in str(e.value) and str(p) in str(e.value)


@pytest.mark.parametrize("name,change,msg", [
    ("blk.2.ffn_down_exps.weight", None, "tensor 'blk.2.ffn_down_exps.weight' is missing"),
    ("blk.1.ffn_gate_exps.weight", lambda a: a.reshape(a.shape[0], a.shape[2], a.shape[1]),
     r"tensor 'blk.1.ffn_gate_exps.weight' has ne \[128, 256, 8\], the header makes it \[256, 128, 8\] \(transposed"),
    ("blk.0.ffn_gate_inp_shexp.weight", lambda a: a[:-1], "tensor 'blk.0.ffn_gate_inp_shexp.weight' has ne"),
])
def test_bad_expert_tensors_are_one_line(moe_file, tmp_path, name, change, msg):
    p = rewrite_gguf(moe_file, tmp_path / "bad.gguf", keep=lambda n: change is not None or n != name,
                     change=lambda n, a: change(a) if n == name else a)
    with pytest.raises(GgufError, match=msg) as e:
        open_model(p)
    assert "\n" not in str(e.value) and str(p) in str(e.value)


def test_a_dense_file_with_expert_tensors_is_refused(tmp_path):
    """A qwen35 header with an expert tensor: not part of that model (the dense loader would not read it)."""
    dense = write_gguf("tiny-qwen35", tmp_path / "d.gguf")
    moe = write_gguf(MOE, tmp_path / "m.gguf")
    extra = {t.name: t for t in gguf.GGUFReader(moe).tensors}["blk.0.ffn_gate_inp.weight"]
    r = gguf.GGUFReader(dense)
    w = gguf.GGUFWriter(tmp_path / "x.gguf", "qwen35")
    for f in r.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in [*r.tensors, extra]:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GgufError, match="'blk.0.ffn_gate_inp.weight' is not part of a qwen35 model"):
        open_model(tmp_path / "x.gguf")


def test_shape_rules_for_experts():
    """Expert fields only with experts; used 1..count; widths >= 1; at most LLAMA_MAX_EXPERTS."""
    assert PRESETS["tiny-qwen35"].problems() == [] and MOE.problems() == []
    bad = {"n_expert_used": dataclasses.replace(PRESETS["tiny-qwen35"], n_expert_used=2),
           "n_ff_shexp": dataclasses.replace(MOE, n_ff_shexp=0),
           "n_expert": dataclasses.replace(MOE, n_expert=2000)}
    for field, shape in bad.items():
        p = shape.problems()
        assert len(p) == 1 and p[0].startswith(field), p
    with pytest.raises(GgufError, match="cannot be a qwen35moe GGUF: n_expert_used must be 1..n_expert 8, is 0"):
        write_gguf(dataclasses.replace(MOE, n_expert_used=0), "/nonexistent/x.gguf")


def test_builder_builds_the_expert_ffn(moe_file):
    """A qwen35moe whole forward builds its expert FFN in every layer (tests/frontends/llama/test_moe_referee.py:
    llama.cpp's graph node for node), never a dense one; the GDN layers alone (no FFN) are the dense model's."""
    from gdnpass.ir import Op

    m = open_model(moe_file)
    g = m.build(m.config(n_tokens=4))
    assert sum(n.op is Op.MUL_MAT_ID for n in g.nodes) == 3 * MOE.n_layer
    assert not [t for t in g.leafs if t.name.endswith(("ffn_up.weight", "ffn_gate.weight", "ffn_down.weight"))]
    g = build_verify_graph(VerifyConfig(model=MOE, n_tokens=4, n_rs_seq=3, ffn=False))
    dense = build_verify_graph(VerifyConfig(model="tiny-qwen35", n_tokens=4, n_rs_seq=3, ffn=False))
    assert [(n.op, n.ne) for n in g.nodes] == [(n.op, n.ne) for n in dense.nodes]


def test_35b_preset_metadata():
    """The Qwen3.5-35B-A3B preset's expert keys (the published config: 256 experts of 512, 8 used, shared 512)."""
    m = gguf_metadata(PRESETS["qwen3.5-35b-a3b"])
    assert (m["qwen35moe.block_count"], m["qwen35moe.embedding_length"]) == (40, 2048)
    assert (m["qwen35moe.expert_count"], m["qwen35moe.expert_used_count"]) == (256, 8)
    assert (m["qwen35moe.expert_feed_forward_length"], m["qwen35moe.expert_shared_feed_forward_length"]) == (512, 512)


def test_the_pass_fuses_every_gdn_layer_of_llama_cpp_s_moe_graph(llama, moe_file):
    """On llama.cpp's own qwen35moe verify graph and plan, every GDN layer's chain and state cache fuse (the GDN
    layers are the dense model's); the expert FFN's ops (ARGSORT, SUM_ROWS, CLAMP, DIV, MUL_MAT_ID) decode, none
    stays OPAQUE."""
    from gdnpass import fusion
    from gdnpass.frontends.llama import capture as cap_mod
    from gdnpass.ir import Op

    c = cap_mod.capture(moe_file, cap_mod.Settings(n_tokens=4, n_rs_seq=3, n_ubatch=8, n_batch=8), install=llama)
    assert [n.op_params["ggml_op"] for n in c.verify.nodes if n.op is Op.OPAQUE] == []
    assert {Op.ARGSORT, Op.SUM_ROWS, Op.CLAMP, Op.DIV, Op.MUL_MAT_ID} <= {n.op for n in c.verify.nodes}
    rep = fusion.fuse(c.verify, enabled=True)
    for pattern in ("gdn_conv_chain", "gdn_state_cache"):
        layers = sorted(a.layer for a in rep.applied if a.pattern == pattern)
        assert layers == MOE.gdn_layers, [r for r in rep.refused if r.pattern == pattern]
