"""Issue 35, items 1 and 2 without llama.cpp: GGUF files with MTP (NextN) blocks, written and read back, and the MTP
head's graph from the one builder. llama.cpp's side (it loads these files, its MTP graph and plan equal ours) is in
tests/frontends/llama/test_mtp_referee.py."""

from __future__ import annotations

import dataclasses

import pytest

gguf = pytest.importorskip("gguf")

from gdnpass import ops  # noqa: E402
from gdnpass.errors import GdnpassError, GraphError  # noqa: E402
from gdnpass.ir import Flag, Op  # noqa: E402
from gdnpass.models import PRESETS, VerifyConfig, build_verify_graph  # noqa: E402
from gdnpass.models.gguf_model import open_model  # noqa: E402
from gdnpass.models.gguf_write import (GgufError, explicit, gguf_metadata, main, read_shape,  # noqa: E402
                                       tensor_plan, write_gguf)
from support.gguf_edit import rewrite_gguf  # noqa: E402

MTP = dataclasses.replace(PRESETS["tiny-qwen35"], name="tiny-mtp", nextn_predict_layers=1)

# llama.cpp's qwen35 load_block_mtp (src/models/qwen35.cpp, 0c1e570): the MTP block's tensors and their ne, for
# tiny-qwen35 (E 256, 4 heads / 2 KV heads of 64, n_ff 512, vocab 512); the optional ones after the required
REQUIRED = {"attn_norm.weight": [256], "post_attention_norm.weight": [256], "attn_q.weight": [256, 512],
            "attn_k.weight": [256, 128], "attn_v.weight": [256, 128], "attn_output.weight": [256, 256],
            "attn_q_norm.weight": [64], "attn_k_norm.weight": [64], "ffn_gate.weight": [256, 512],
            "ffn_down.weight": [512, 256], "ffn_up.weight": [256, 512], "nextn.eh_proj.weight": [512, 256],
            "nextn.enorm.weight": [256], "nextn.hnorm.weight": [256]}
OPTIONAL = {"nextn.shared_head_norm.weight": [256], "nextn.embed_tokens.weight": [256, 512],
            "nextn.shared_head_head.weight": [256, 512]}


@pytest.fixture(scope="module")
def mtp_file(tmp_path_factory):
    return write_gguf(MTP, tmp_path_factory.mktemp("mtp") / "mtp.gguf", tokenizer="none", seed=2)


def _tensors(path) -> dict[str, list[int]]:
    return {t.name: [int(x) for x in t.shape] for t in gguf.GGUFReader(path).tensors}


# ---- the file -------------------------------------------------------------------------------------------------------
def test_mtp_block_is_written_as_llama_cpp_loads_it(mtp_file):
    """block_count counts the MTP block, nextn_predict_layers names it, blk.4 holds a full-attention block and its
    nextn tensors (with the head's own norm), and read_shape gives the shape back."""
    r = gguf.GGUFReader(mtp_file)
    assert int(r.fields["qwen35.block_count"].contents()) == 5
    assert int(r.fields["qwen35.nextn_predict_layers"].contents()) == 1
    got = {n[len("blk.4."):]: ne for n, ne in _tensors(mtp_file).items() if n.startswith("blk.4.")}
    assert got == REQUIRED | {"nextn.shared_head_norm.weight": [256]}
    assert read_shape(mtp_file) == explicit(MTP)
    assert MTP.block_count == 5 and MTP.mtp_layer == 4


def test_a_trunk_only_file_has_no_nextn_key(tmp_path):
    shape = PRESETS["tiny-qwen35"]
    assert "qwen35.nextn_predict_layers" not in gguf_metadata(shape)
    assert "qwen35.nextn_predict_layers" not in gguf.GGUFReader(write_gguf(shape, tmp_path / "t.gguf",
                                                                           tokenizer="none")).fields
    assert [n for n, _, _ in tensor_plan(MTP) if not n.startswith("blk.4.")] == [n for n, _, _ in tensor_plan(shape)]


@pytest.mark.parametrize("nextn", [(), ("embed_tokens", "shared_head_head", "shared_head_norm")])
def test_optional_nextn_tensors(tmp_path, nextn):
    path = write_gguf(MTP, tmp_path / "o.gguf", tokenizer="none", nextn=nextn)
    got = {n[len("blk.4."):]: ne for n, ne in _tensors(path).items() if n.startswith("blk.4.")}
    assert got == REQUIRED | {k: v for k, v in OPTIONAL.items() if k.split(".")[1] in nextn}
    model = open_model(path)  # (optional tensors absent or present: both load)
    assert all(n in model.types for n in (f"blk.4.{k}" for k in got))


def test_the_writer_cli_adds_mtp_blocks(tmp_path, capsys):
    assert main(["tiny-qwen35", str(tmp_path / "c.gguf"), "--mtp", "1", "--tokenizer", "none"]) == 0
    assert read_shape(tmp_path / "c.gguf").nextn_predict_layers == 1
    assert main(["tiny-qwen35", str(tmp_path / "d.gguf"), "--mtp", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mtp -1" in err and not (tmp_path / "d.gguf").exists()
    with pytest.raises(GgufError, match="nextn 'head' is not an optional MTP tensor"):
        write_gguf(MTP, tmp_path / "e.gguf", nextn=("head",))


def test_open_model_keeps_the_mtp_tensor_types_and_builds_the_trunk_unchanged(mtp_file, tmp_path):
    model = open_model(mtp_file)
    assert model.shape.nextn_predict_layers == 1 and "blk.4.nextn.eh_proj.weight" in model.types
    trunk = model.build(model.config(n_tokens=4, n_rs_seq=3))
    plain = open_model(write_gguf(PRESETS["tiny-qwen35"], tmp_path / "p.gguf", tokenizer="none"))
    from gdnpass.frontends.compare import signature

    assert signature(trunk) == signature(plain.build(plain.config(n_tokens=4, n_rs_seq=3)))
    assert not any(t.name.startswith("blk.4.") for t in trunk.leafs)
    # a model cut after its first layers has no MTP block (it sits after the last layer)
    assert model.shape.first_layers(2).nextn_predict_layers == 0


# ---- bad files: one line naming the tensor ---------------------------------------------------------------------------
def test_a_partial_mtp_block_is_refused_naming_the_tensor(mtp_file, tmp_path):
    bad = rewrite_gguf(mtp_file, tmp_path / "b.gguf", keep=lambda n: n != "blk.4.nextn.hnorm.weight")
    with pytest.raises(GgufError, match=r"b\.gguf: tensor 'blk\.4\.nextn\.hnorm\.weight' is missing$"):
        open_model(bad)
    odd = rewrite_gguf(mtp_file, tmp_path / "t.gguf",
                   change=lambda n, a: a.T.copy() if n == "blk.4.nextn.eh_proj.weight" else a)
    with pytest.raises(GgufError, match=r"tensor 'blk\.4\.nextn\.eh_proj\.weight' has ne \[256, 512\], the header "
                                        r"makes it \[512, 256\] \(transposed\?\)"):
        open_model(odd)


def test_a_stripped_mtp_block_loads_the_trunk_and_refuses_the_head(mtp_file, tmp_path):
    """No tensor of the MTP block at all (llama.cpp loads that file too, without load_mtp): the trunk builds; the
    head is refused naming what the file lacks."""
    bare = open_model(rewrite_gguf(mtp_file, tmp_path / "s.gguf", keep=lambda n: not n.startswith("blk.4.")))
    assert bare.build(bare.config(n_tokens=2)).nodes
    with pytest.raises(GraphError, match=r"s\.gguf: the graph needs .*blk\.4\..*absent from the file"):
        bare.build(bare.mtp_config(n_tokens=2))


# ---- the MTP head's graph -------------------------------------------------------------------------------------------
def test_mtp_graph_of_a_preset_shape():
    """The head of a shape with one MTP block, without a file (the writer's tensors assumed): the inputs llama.cpp
    gives graph_mtp, one attention block of block 4's weights, h_nextn and the logits OUTPUT, llama.cpp's op chain
    from the two norms to the projection."""
    cfg = VerifyConfig(MTP, 3, whole=True, mtp=True, wtype="f32")
    g = build_verify_graph(cfg)
    ops.validate(g)
    inputs = [t.name for t in g.leafs if t.flags & Flag.INPUT]
    assert inputs == [g.meta["token_input"], "mtp_h_input", "inp_pos", "attn_inp_k_idxs", "attn_inp_v_idxs",
                      "attn_inp_kq_mask", "out_ids"]
    assert g.meta["token_input"] == "leaf_3"  # ggml's name of the unnamed leaf at position 3
    weights = {t.name for t in g.leafs if t.buffer == "weights"}
    assert {f"blk.4.{n}" for n in REQUIRED} | {"blk.4.nextn.shared_head_norm.weight", "token_embd.weight",
                                                "output.weight"} == weights
    assert [t.name for t in g.leafs if t.buffer == "cache"] == ["cache_k_l4", "cache_v_l4"]
    out = [n.name for n in g.nodes if n.flags & Flag.OUTPUT]
    assert out == ["h_nextn", "result_output"]
    cat = g.find("mtp_concat-4")
    assert cat.op is Op.CONCAT and [s.name for s in cat.src] == ["mtp_enorm-4", "mtp_hnorm-4"]
    assert g.find("mtp_eh_proj-4").ne[:2] == (256, 3) and g.find("result_output").ne[:2] == (512, 3)
    assert sum(n.op is Op.FLASH_ATTN_EXT for n in g.nodes) == 1 and not any(n.op is Op.GATED_DELTA_NET
                                                                              for n in g.nodes)


def test_mtp_config_is_checked():
    with pytest.raises(GraphError, match="config field 'mtp': model 'tiny-qwen35' has 0 MTP blocks"):
        VerifyConfig("tiny-qwen35", 2, whole=True, mtp=True).check()
    with pytest.raises(GraphError, match="config field 'mtp': the MTP head is a whole graph"):
        VerifyConfig(MTP, 2, mtp=True).check()
    two = dataclasses.replace(MTP, nextn_predict_layers=2)
    with pytest.raises(GraphError, match="has 2 MTP blocks"):
        VerifyConfig(two, 2, whole=True, mtp=True).check()
    with pytest.raises(GdnpassError, match="nextn_predict_layers must be >= 0"):
        dataclasses.replace(MTP, nextn_predict_layers=-1).check()


def test_mtp_graph_runs_fused_and_unfused_identically(mtp_file, capsys):
    """``gdnpass run --gguf F --mtp --check``: the head's graph from the file, its weights loaded, unfused then
    fused, byte for byte."""
    from gdnpass import cli

    assert cli.main(["run", "--gguf", str(mtp_file), "--mtp", "--tokens", "2", "--check", "-q"]) == 0
    out = capsys.readouterr().out
    assert "MTP head (block 4)" in out and "identical  result_output" in out and " 0 differing" in out, out
