"""A model from its GGUF file: header-only opening, the whole graph in the file's types, weights loaded exactly."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gdnpass.frontends.compare import signature  # noqa: E402
from gdnpass.kernels.quants import dequantize, file_rows, held_rows
from gdnpass.ir import DType  # noqa: E402
from gdnpass.models import VerifyConfig, build_verify_graph  # noqa: E402
from gdnpass.models.fill import fill  # noqa: E402
from gdnpass.models.gguf_model import open_model  # noqa: E402
from gdnpass.models.gguf_write import GgufError, write_gguf  # noqa: E402
from gdnpass.pipeline import PassOptions, run  # noqa: E402
from gdnpass.runtime import Executor  # noqa: E402


@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory):
    return write_gguf("tiny-qwen35-b", tmp_path_factory.mktemp("m") / "b.gguf", wtype="bf16", ab_wtype="f32", seed=3)


def test_open_reads_shape_and_types(bf16_file):
    m = open_model(bf16_file)
    assert m.shape.n_layer == 8 and m.shape.gdn_layers == [0, 1, 2, 4, 5, 6]
    assert m.types["blk.0.attn_qkv.weight"] == "BF16" and m.types["blk.0.ssm_alpha.weight"] == "F32"
    assert m.dequantized == []


def test_build_takes_the_file_s_types(bf16_file):
    m = open_model(bf16_file)
    g = m.build(m.config(n_tokens=4, n_rs_seq=3))
    want = build_verify_graph(VerifyConfig(model=m.shape, n_tokens=4, n_rs_seq=3, wtype="bf16", ab_wtype="f32",
                                           whole=True))
    assert signature(g) == signature(want)
    types = {t.name: t.type for t in g.leafs if t.buffer == "weights"}
    assert types["token_embd.weight"] is DType.BF16 and types["blk.3.attn_q_norm.weight"] is DType.F32


def test_weights_load_byte_for_byte(bf16_file):
    m = open_model(bf16_file)
    res = run(m.build(m.config(n_tokens=2, n_rs_seq=1)), PassOptions(fusion=False))
    ex = Executor(res.graph)
    fill(ex, seed=0)
    m.load_weights(ex, res.graph)
    by_name = {t.name: t for t in gguf.GGUFReader(bf16_file).tensors}
    for name in ("blk.0.attn_qkv.weight", "blk.0.ssm_a", "token_embd.weight"):
        t = next(x for x in res.graph.leafs if x.name == name)
        want = np.array(by_name[name].data).tobytes()
        assert ex.bytes_of(t) == want, name


def test_block_types_stay_blocks_and_others_are_dequantized(tmp_path):
    """A Q8_0 tensor is held as its blocks, the file's bytes with every row split (quants.held_rows: the quants,
    then the scales; joined again they are the file's byte for byte; its values: ggml's dequantization, the kernels'
    reference); a Q5_0 tensor, a type the kernels do not read, is held as f32: gguf's dequantization of its blocks."""
    path = write_gguf("tiny-qwen35", tmp_path / "q.gguf", wtype="f32", seed=2)
    src = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    w = gguf.GGUFWriter(tmp_path / "q8.gguf", "qwen35")
    r = gguf.GGUFReader(path)
    for f in r.fields.values():  # the header as it was
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    quantized = {"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q8_0,
                 "blk.0.ffn_gate.weight": gguf.GGMLQuantizationType.Q5_0}
    for name, arr in src.items():
        if name in quantized:
            w.add_tensor(name, gguf.quants.quantize(arr, quantized[name]), raw_dtype=quantized[name])
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m = open_model(tmp_path / "q8.gguf")
    assert m.dequantized == ["blk.0.ffn_gate.weight"]
    res = run(m.build(m.config(n_tokens=2, n_rs_seq=1)), PassOptions(fusion=False))
    held = {x.name: x for x in res.graph.leafs}
    assert held["blk.0.ffn_up.weight"].type is DType.Q8_0 and held["blk.0.ffn_gate.weight"].type is DType.F32
    ex = Executor(res.graph)
    fill(ex, seed=0)
    m.load_weights(ex, res.graph)
    file = {x.name: x for x in gguf.GGUFReader(tmp_path / "q8.gguf").tensors}
    q8 = held["blk.0.ffn_up.weight"]
    raw = torch.from_numpy(np.array(file[q8.name].data)).view(ex.read(q8).shape)  # (the file's blocks)
    assert torch.equal(ex.read(q8), held_rows(raw, DType.Q8_0)) and not torch.equal(ex.read(q8), raw)
    assert file_rows(ex.read(q8), DType.Q8_0).numpy().tobytes() == raw.numpy().tobytes()
    assert torch.equal(dequantize(file_rows(ex.read(q8), DType.Q8_0), DType.Q8_0).reshape(-1), torch.from_numpy(
        gguf.quants.dequantize(np.array(file[q8.name].data), file[q8.name].tensor_type).reshape(-1)))
    q5 = file["blk.0.ffn_gate.weight"]
    want = torch.from_numpy(gguf.quants.dequantize(np.array(q5.data), q5.tensor_type).astype(np.float32))
    assert torch.equal(ex.read(held[q5.name]).reshape(want.shape), want)


@pytest.mark.parametrize("arch,needs", [("qwen3next", "no rollback"), ("llama", "gdnpass builds 'qwen35'")])
def test_other_archs_are_refused_by_name(tmp_path, arch, needs):
    p = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(p, arch)
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GgufError, match=needs) as e:
        open_model(p)
    assert "\n" not in str(e.value) and str(p) in str(e.value)


def test_dump_gguf_imports_no_torch(bf16_file):
    code = ("import sys; from gdnpass import cli; rc = cli.main(['dump', '--gguf', sys.argv[1], '--tokens', '4', "
            "'--rs-seq', '3', '--fuse']); assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(bf16_file)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "fusion gdn_conv_chain: applied 6" in r.stdout


def test_layers_selects_the_first_layers_of_the_file_s_pattern(bf16_file, capsys):
    """``--layers N --gguf FILE``: the first N layers of the file's pattern, attention layers counted (tiny-qwen35-b
    has attention at 3 and 7): the embedding, N layers, the output norm and the lm head; the header says what was
    built (layers by kind, the lm head, the weights by type; the buffers line the weights and the arena)."""
    from gdnpass import cli

    m = open_model(bf16_file)
    g = m.build(m.config(layers=4, n_tokens=4, n_rs_seq=3))
    blocks = sorted({int(t.name.split(".")[1]) for t in g.leafs if t.name.startswith("blk.")})
    assert blocks == [0, 1, 2, 3] and sum(n.name.startswith("result_output") for n in g.nodes) == 1
    assert sorted({n.layer for n in g.nodes if n.op.value == "GATED_DELTA_NET"}) == [0, 1, 2]
    assert sorted({n.layer for n in g.nodes if n.op.value == "FLASH_ATTN_EXT"}) == [3]
    assert cli.main(["run", "--gguf", str(bf16_file), "--layers", "4", "--tokens", "4", "--rs-seq", "3", "--check",
                     "-q"]) == 0
    out = capsys.readouterr().out
    assert ("whole forward: token embedding, the first 4 of 8 layers (GDN [0, 1, 2], attention [3]), lm head "
            "output.weight; n_t=4, n_rs_seq=3; weights BF16 x") in out
    assert "gdn_conv_chain: 3 applied" in out and " 0 differing" in out and "DIFFERS" not in out
    assert cli.main(["run", "--gguf", str(bf16_file), "--layers", "9", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--layers 9" in err and "has 8 layers (attention layers count)" in err
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "attention layers count" in " ".join(capsys.readouterr().out.split())
