"""Issue 33: bad input as a hostile new user gives it. Every case of the issue as a named regression test, then a
derandomized hypothesis fuzz of malformed GGUF and graph files through the command line.

The contract: a clean one-line error naming the file, key, flag or tensor, exit 2 (or correct behaviour where the
input is legal); no traceback, no hang; an output file (--save, -o, --render) is written whole once the command
succeeded, and a failed, refused or interrupted command leaves an existing one untouched.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

from gdnpass import runtime, serialize  # noqa: E402
from gdnpass.errors import GdnpassError, GraphError  # noqa: E402
from gdnpass.models import PRESETS, VerifyConfig, build_verify_graph  # noqa: E402
from gdnpass.models import gguf_write  # noqa: E402
from gdnpass.models.gguf_model import open_model  # noqa: E402
from gdnpass.models.gguf_write import GGUF_KEYS, tensor_plan, write_gguf  # noqa: E402
from gdnpass.outputs import json_text  # noqa: E402
from support.cli import cli_run, refused  # noqa: E402

V = gguf.GGUFValueType
TINY = ["--model", "tiny-dc4-h64", "--layers", "1"]
SMALL = ["--tokens", "2", "--rs-seq", "1"]
KEEP = "the user's file\n"
# a whole qwen35 model small enough to write, mutate and build many times a second: 4 layers (attention at 3), a
# non-square qkv (E 64, 2*64 + 128 channels), 64 tokens (no tokenizer)
SHAPE = dataclasses.replace(PRESETS["tiny-qwen35-b"], name="hostile", n_embd=64, n_layer=4, n_ff=64, vocab_size=64)


@pytest.fixture
def keep(tmp_path) -> Path:
    """An existing output file that a failed command must leave as it is."""
    p = tmp_path / "keep.json"
    p.write_text(KEEP)
    return p


def kept(p: Path) -> bool:
    return p.read_text() == KEEP and [x.name for x in p.parent.iterdir() if x.name.startswith(".keep")] == []


# ---- GGUF files ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_gguf(SHAPE, tmp_path_factory.mktemp("gguf") / "base.gguf", tokenizer="none")


def rewrite(src: Path, dst: Path, kv: dict | None = None, drop: tuple = (), tensor=None) -> Path:
    """``src`` written again as ``dst`` with key-values ``kv`` (key -> (value, type[, element type])) set, keys in
    ``drop`` left out and each tensor's array passed through ``tensor(name, array)`` (None leaves it out)."""
    kv = kv or {}
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, "qwen35")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name in drop or f.name in kv:
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for k, (v, *t) in kv.items():
        w.add_key_value(k, v, t[0], t[1] if len(t) > 1 else None)
    for t in r.tensors:
        arr = np.array(t.data)
        arr = tensor(t.name, arr) if tensor else arr
        if arr is not None:
            w.add_tensor(t.name, arr, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def transposed(name: str):
    return lambda n, a: np.ascontiguousarray(a.reshape(a.shape[::-1])) if n == name else a


def header_count(src: Path, dst: Path, which: str, value: int) -> Path:
    """``src`` with its tensor_count (bytes 8-16) or kv_count (16-24) replaced."""
    data = bytearray(src.read_bytes())
    at = {"tensor_count": 8, "kv_count": 16}[which]
    data[at:at + 8] = struct.pack("<Q", value)
    dst.write_bytes(bytes(data))
    return dst


K = "qwen35."
U32 = (V.UINT32,)


def test_the_base_file_builds_and_runs(capsys, base, tmp_path):
    """(the fixture every GGUF case below breaks is itself clean)"""
    rc, out, _ = cli_run(capsys, "run", "--gguf", base, *SMALL, "-q", "--save", tmp_path / "g.json")
    assert rc == 0 and "whole forward" in out
    serialize.load(tmp_path / "g.json")


# data loss ----------------------------------------------------------------------------------------------------------
def graph_file(tmp_path: Path, name: str = "g.json", **meta) -> Path:
    g = build_verify_graph(VerifyConfig("tiny-dc4-h64", 2, 1, n_layers=1))
    g.meta.update(meta)
    p = tmp_path / name
    serialize.save(g, p)
    return p


def with_text(p: Path, old: str, new: str) -> Path:
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new, 1))
    return p


def test_save_of_a_meta_json_cannot_hold_keeps_the_file(capsys, tmp_path, keep):
    g = with_text(graph_file(tmp_path), '"meta": {', '"meta": {"x": 1e400, ')  # loads (free-form); inf on save
    refused(capsys, "dump", "--graph", g, "--save", keep, says=("--save", "meta.x", "not a finite number"))
    assert kept(keep)


def test_save_of_an_untyped_op_param_json_cannot_hold_keeps_the_file(capsys, tmp_path, keep):
    g = with_text(graph_file(tmp_path), '"op": "GET_ROWS", "op_params": {', '"op": "GET_ROWS", "op_params": {"y": 1e400')
    refused(capsys, "dump", "--graph", g, "--save", keep, says=("--save", "op_params.y"))
    assert kept(keep)


def test_save_failing_midway_keeps_the_file(tmp_path, keep, monkeypatch):
    """serialize.save makes the text first and writes it under a temporary name: a failing write (here: the
    disk) leaves the old file and no temporary one."""
    g = build_verify_graph(VerifyConfig("tiny-dc4-h64", 2, 1, n_layers=1))
    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(GdnpassError, match=f"cannot write {keep}: No space left"):
        serialize.save(g, keep)
    monkeypatch.undo()
    assert kept(keep)


def test_dump_gguf_with_an_infinite_rope_base_keeps_the_file(capsys, base, tmp_path, keep):
    f = rewrite(base, tmp_path / "inf.gguf", {K + "rope.freq_base": (float("inf"), V.FLOAT32)})
    refused(capsys, "dump", "--gguf", f, "--save", keep, says=(str(f), K + "rope.freq_base", "finite"))
    assert kept(keep)


def test_save_waits_for_the_run_refused_for_memory(capsys, keep, monkeypatch):
    monkeypatch.setattr(runtime, "available_bytes", lambda device: 1 << 16)
    refused(capsys, "run", *TINY, "--save", keep, "-q", says=("memory plan needs",))
    assert kept(keep)


def test_save_waits_for_an_interrupted_run(capsys, keep, monkeypatch):
    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime.Executor, "run_probed", interrupt)
    rc, _, err = cli_run(capsys, "run", *TINY, "--save", keep, "-q")
    assert rc == 130 and "interrupted" in err and kept(keep)


def test_save_writes_once_the_run_succeeded(capsys, keep):
    rc, _, _ = cli_run(capsys, "run", *TINY, "--save", keep, "-q")
    assert rc == 0 and serialize.load(keep).nodes


# wrong results, exit 0 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", ["run", "dump"])
def test_a_transposed_weight_is_refused_by_name(capsys, base, tmp_path, cmd):
    f = rewrite(base, tmp_path / "t.gguf", tensor=transposed("blk.0.attn_qkv.weight"))
    refused(capsys, cmd, "--gguf", f, *SMALL, says=(str(f), "'blk.0.attn_qkv.weight'", "[256, 64]", "transposed"))


def test_a_mis_sized_weight_is_refused_by_name(capsys, base, tmp_path):
    f = rewrite(base, tmp_path / "t.gguf", tensor=lambda n, a: a[:-1] if n == "blk.3.attn_k.weight" else a)
    refused(capsys, "run", "--gguf", f, *SMALL, says=("'blk.3.attn_k.weight'", "the header makes it"))


def test_tensors_the_header_does_not_account_for_are_refused(capsys, base, tmp_path):
    """block_count 0 was a 0-layer model ignoring every layer's tensors; a smaller block_count leaves some out"""
    f = rewrite(base, tmp_path / "bc0.gguf", {K + "block_count": (0, *U32)})
    refused(capsys, "run", "--gguf", f, says=(K + "block_count", "1..512", "is 0"))
    f = rewrite(base, tmp_path / "bc2.gguf", {K + "block_count": (2, *U32)})
    refused(capsys, "dump", "--gguf", f, says=("'blk.2.", "not part of a qwen35 model", "2 layers"))
    f = rewrite(base, tmp_path / "gone.gguf", tensor=lambda n, a: None if n == "blk.1.ssm_a" else a)
    refused(capsys, "dump", "--gguf", f, says=("'blk.1.ssm_a'", "missing"))


@pytest.mark.parametrize("cmd", ["run", "dump"])
@pytest.mark.parametrize("kv, says", [
    ({K + "vocab_size": (0, *U32)}, K + "vocab_size must be >= 1"),
    ({K + "attention.value_length": (16, *U32)}, K + "attention.key_length 32 != " + K + "attention.value_length 16"),
    ({K + "rope.freq_base": (float("inf"), V.FLOAT32)}, K + "rope.freq_base must be a finite number > 0, is inf"),
    ({K + "attention.layer_norm_rms_epsilon": (float("nan"), V.FLOAT32)}, "layer_norm_rms_epsilon must be a finite"),
])
def test_metadata_llama_cpp_would_refuse_is_refused(capsys, base, tmp_path, cmd, kv, says):
    f = rewrite(base, tmp_path / "m.gguf", kv)
    refused(capsys, cmd, "--gguf", f, *SMALL, says=(str(f), says))


def test_dump_json_is_valid_json_with_infinite_values(capsys, tmp_path):
    g = with_text(graph_file(tmp_path), '"meta": {', '"meta": {"x": 1e400, "y": [-1e400], ')
    rc, out, _ = cli_run(capsys, "dump", "--graph", g, "--format", "json")
    assert rc == 0
    d = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in JSON output"))
    assert d["graph"]["meta"]["x"] == "Infinity" and d["graph"]["meta"]["y"] == ["-Infinity"]
    assert json_text({"a": float("nan"), "b": (np.float32("inf"), 1)}) == '{"a": "NaN", "b": ["Infinity", 1]}'


@pytest.mark.parametrize("flag", [["--model", "qwen3.5-9b"], ["--wtype", "f32"], ["--ab-wtype", "bf16"],
                                  ["--snapshot-layout", "dedup"], ["--dflash"]])
def test_flags_the_gguf_file_decides_are_refused(capsys, base, flag):
    refused(capsys, "dump", "--gguf", base, *flag, says=(flag[0], "does nothing with --gguf"))


@pytest.mark.parametrize("flag", [["--tokens", "4"], ["--model", "tiny-dc4-h64"], ["--layers", "1"], ["--whole"]])
def test_graph_flags_beside_a_graph_file_are_refused(capsys, tmp_path, flag):
    refused(capsys, "dump", "--graph", graph_file(tmp_path), *flag, says=(flag[0], "does nothing with --graph"))


def test_alignment_beside_a_planned_graph_file_is_refused(capsys, tmp_path):
    planned = tmp_path / "planned.json"
    assert cli_run(capsys, "run", *TINY, "--save", planned, "-q")[0] == 0
    refused(capsys, "dump", "--graph", planned, "--alignment", "64", says=("--alignment 64", "alignment 128"))
    assert cli_run(capsys, "dump", "--graph", planned, "--alignment", "128")[0] == 0  # (what the plan has: fine)
    unplanned = graph_file(tmp_path, "unplanned.json")  # no plan yet: the flag plans it
    assert cli_run(capsys, "dump", "--graph", unplanned, "--alignment", "64")[0] == 0


def test_a_graph_file_whose_tensors_share_one_name_runs(capsys, tmp_path):
    """(names may repeat, as the docs say: execution and --check go by identity, not by name)"""
    g = graph_file(tmp_path)
    d = json.loads(g.read_text())
    for t in d["tensors"]:
        t["name"] = "x"
    g.write_text(json.dumps(d))
    rc, out, _ = cli_run(capsys, "run", "--graph", g, "-q")
    assert rc == 0 and "launches" in out
    rc, out, _ = cli_run(capsys, "run", "--graph", g, "--check", "-q")
    assert rc == 0 and " 0 differing" in out


# tracebacks ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("meta, says", [
    ({"ids": [99]}, ("node 'conv_states-0'", "row id 99 is outside the source's 2 rows")),
    ({"ids": [-1]}, ("row id -1",)),
    ({"ids": "0"}, ("field 'meta'", "meta.ids must be a list of integers")),
    ({"config": "x"}, ("field 'meta'", "meta.config must be an object")),
    ({"input_bytes": {"rs_s_copy": 5}}, ("meta.input_bytes",)),
])
def test_graph_file_meta_execution_reads_is_checked(capsys, tmp_path, meta, says):
    refused(capsys, "run", "--graph", graph_file(tmp_path, **meta), "-q", says=says)


def test_a_whole_graph_file_with_a_broken_model_is_refused(capsys, tmp_path):
    g = build_verify_graph(VerifyConfig(SHAPE, 2, 1, whole=True))
    g.meta["model"]["vocab_size"] = 0
    serialize.save(g, tmp_path / "w.json")
    refused(capsys, "run", "--graph", tmp_path / "w.json", "-q", says=("meta.model.vocab_size must be >= 1",))
    g.meta["model"]["vocab_size"], g.meta["config"]["n_tokens"] = 64, "8"
    serialize.save(g, tmp_path / "w.json")
    refused(capsys, "run", "--graph", tmp_path / "w.json", "-q", says=("meta.config",))


@pytest.mark.parametrize("which", ["tensor_count", "kv_count"])
def test_header_counts_past_the_file_are_refused(capsys, base, tmp_path, which):
    f = header_count(base, tmp_path / "c.gguf", which, 1 << 62)
    refused(capsys, "dump", "--gguf", f, says=(str(f), "truncated", str(1 << 62)))


@pytest.mark.parametrize("kv, says", [
    ({K + "block_count": (10**9, *U32)}, "block_count must be 1..512"),
    ({K + "block_count": ("4", V.STRING)}, "block_count must be an integer, is a string"),
    ({K + "embedding_length": (-64, V.INT32)}, "embedding_length must be >= 0, is -64"),
    ({K + "rope.dimension_sections": (7, *U32)}, "dimension_sections must be an array of integers"),
    ({K + "attention.head_count": ([8, 8], V.ARRAY, V.UINT32)}, "head_count has 2 per-layer values"),
    ({"general.architecture": (35, *U32)}, "general.architecture must be a string"),
])
def test_metadata_of_the_wrong_type_or_size_is_refused(capsys, base, tmp_path, kv, says):
    f = rewrite(base, tmp_path / "m.gguf", kv)
    refused(capsys, "dump", "--gguf", f, says=(str(f), says))


def test_run_on_a_vocab_0_file_is_refused(capsys, base, tmp_path):
    f = rewrite(base, tmp_path / "v.gguf", {K + "vocab_size": (0, *U32)})
    refused(capsys, "run", "--gguf", f, "-q", says=("vocab_size",))


def test_gguf_write_refuses_a_negative_seed(tmp_path, capsys):
    assert gguf_write.main(["tiny-qwen35-b", str(tmp_path / "x.gguf"), "--seed", "-1"]) == 2
    err = capsys.readouterr().err
    assert "seed must be an integer >= 0" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "x.gguf").exists()


def test_gguf_write_interrupted_keeps_the_old_file(tmp_path, capsys, monkeypatch):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"old")

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_write, "_write_next", interrupt)
    assert gguf_write.main(["tiny-qwen35-b", str(p)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert p.read_bytes() == b"old" and [x.name for x in tmp_path.iterdir()] == ["m.gguf"]


# hang ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, says", [(["--seqs", "1000000000000"], "'n_seqs': must be 1..256"),
                                        (["--seqs", "3000000", "--save", "{keep}"], "'n_seqs'")])
def test_sizes_from_flags_are_bounded_before_anything_is_built(capsys, keep, argv, says):
    refused(capsys, "dump", *TINY, *[a.format(keep=keep) for a in argv], says=(says,))
    assert kept(keep)


# unclear -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, says", [
    ("attention.head_count", 0, "attention.head_count must be >= 1, is 0"),
    ("ssm.conv_kernel", 0, "ssm.conv_kernel must be >= 2"),
    ("attention.head_count_kv", 0, "attention.head_count_kv must be >= 1, is 0"),
    ("attention.head_count_kv", 3, "attention.head_count 8 is not a multiple of qwen35.attention.head_count_kv 3"),
    ("nextn_predict_layers", 10, "nextn_predict_layers 10 leaves no trunk of qwen35.block_count 4"),
])
def test_bad_metadata_names_the_file_and_the_key(capsys, base, tmp_path, key, value, says):
    f = rewrite(base, tmp_path / "m.gguf", {K + key: (value, *U32)})
    refused(capsys, "run", "--gguf", f, "-q", says=(f"{f}: ", K + says))


def test_capture_checks_its_flags_before_building_llama_cpp(capsys, base, tmp_path, monkeypatch):
    from gdnpass.frontends.llama import build

    def no_build(*a, **k):
        raise AssertionError("capture built llama.cpp before checking its flags")

    monkeypatch.setattr(build, "ensure", no_build)
    out = tmp_path / "v.json"
    refused(capsys, "capture", "--gguf", tmp_path / "typo.gguf", "-o", out, says=("typo.gguf", "no such file"))
    refused(capsys, "capture", "--gguf", base, "-o", out, "--tokens", "0", says=("--tokens", "1..64"))
    refused(capsys, "capture", "--gguf", base, "-o", tmp_path / "no" / "v.json", says=("-o", "does not exist"))
    refused(capsys, "capture", "--gguf", base, "-o", tmp_path, says=("-o", "is a directory"))
    refused(capsys, "capture", "--gguf", base, "-o", out, "--ctx", "100000", says=("--ctx", "context_length 4096"))



def test_mtp_flags_are_refused_where_they_cannot_work(capsys, base, tmp_path, monkeypatch):
    """Issue 35: --mtp without a file, on a file without an MTP block, beside flags the head does not take;
    capture --mtp likewise, before llama.cpp is built."""
    from gdnpass.frontends.llama import build

    monkeypatch.setattr(build, "ensure", lambda *a, **k: pytest.fail("capture built llama.cpp before its checks"))
    refused(capsys, "dump", "--mtp", *TINY, says=("--mtp needs --gguf FILE",))
    refused(capsys, "dump", "--gguf", base, "--mtp", says=(str(base), "nextn_predict_layers is 0", "no MTP head"))
    mtp = write_gguf(dataclasses.replace(SHAPE, nextn_predict_layers=1), tmp_path / "mtp.gguf", tokenizer="none")
    refused(capsys, "dump", "--gguf", mtp, "--mtp", "--rs-seq", "2", says=("--rs-seq does nothing with --mtp",))
    out = tmp_path / "v.json"
    refused(capsys, "capture", "--gguf", base, "-o", out, "--mtp", says=("--mtp", str(base), "0 MTP blocks"))
    refused(capsys, "capture", "--gguf", mtp, "-o", out, "--mtp-outputs", "none",
            says=("--mtp-outputs none does nothing without --mtp",))
    rc, text, _ = cli_run(capsys, "dump", "--gguf", mtp, "--mtp", "--tokens", "2")  # (and the head itself dumps)
    assert rc == 0 and "MTP head (block 4)" in text, text

@pytest.mark.parametrize("cut", [0, 3, 20, 100, 2000, -1])
def test_a_truncated_gguf_says_truncated(capsys, base, tmp_path, cut):
    f = tmp_path / "cut.gguf"
    data = base.read_bytes()
    f.write_bytes(data[:cut])
    refused(capsys, "dump", "--gguf", f, says=(str(f), "truncated"))


def patch_tensor_info(src: Path, dst: Path, name: str, field: str, value: int) -> Path:
    """``src`` with tensor ``name``'s n_dims or ggml type (as GGUF lays out a tensor info) overwritten."""
    f = next(t.field for t in gguf.GGUFReader(src).tensors if t.name == name)
    n, n_dims = int(f.parts[0][0]), int(f.parts[2][0])
    at = f.offset + 8 + n + (0 if field == "n_dims" else 4 + 8 * n_dims)
    data = bytearray(src.read_bytes())
    data[at:at + 4] = struct.pack("<I", value)
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("field, value, says", [("n_dims", 9, "'blk.0.ssm_a' has 9 dimensions (ggml has 4)"),
                                                ("type", 200, "'blk.0.ssm_a' has unknown ggml type 200"),
                                                ("type", 8, "'blk.0.ssm_a' (Q8_0): rows of 2 values")])
def test_a_corrupt_tensor_info_is_refused_by_name(capsys, base, tmp_path, field, value, says):
    f = patch_tensor_info(base, tmp_path / "c.gguf", "blk.0.ssm_a", field, value)
    refused(capsys, "dump", "--gguf", f, says=(str(f), "not a readable GGUF file", says))


# found after the fixes (hostile cases beyond the issue's) ------------------------------------------------------------
def test_alignment_is_bounded(capsys):
    from gdnpass.pipeline import PassOptions

    rc, _, err = cli_run(capsys, "run", *TINY, "--alignment", str(1 << 62))  # (emptied the planner's free list)
    assert rc == 2 and "--alignment must be a power of two, 1..4096" in err
    with pytest.raises(GraphError, match="1..4096"):
        PassOptions(alignment=8192)


def test_save_to_a_device_or_through_a_link(capsys, tmp_path):
    """(an atomic rename would have replaced /dev/null with a file, and a link with a file)"""
    import os
    import stat

    assert cli_run(capsys, "dump", *TINY, "--save", "/dev/null")[0] == 0
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text(KEEP)
    link.symlink_to(target.name)
    assert cli_run(capsys, "dump", *TINY, "--save", link)[0] == 0
    assert link.is_symlink() and serialize.load(target).nodes


@pytest.mark.parametrize("where", ['"meta": {', '"op_params": {}'])
def test_free_form_values_nesting_too_deep_are_refused(capsys, tmp_path, keep, where):
    """(600 levels in meta loaded, then copying it overflowed Python's stack: a RecursionError traceback)"""
    deep = "[" * 600 + "]" * 600
    new = '"meta": {"deep": ' + deep + ", " if where.startswith('"meta"') else '"op_params": {"deep": ' + deep + "}"
    g = with_text(graph_file(tmp_path), where, new)
    refused(capsys, "run", "--graph", g, "--save", keep, "-q", says=("nests deeper than 64 levels",))
    assert kept(keep)


def test_an_error_quoting_a_newline_stays_one_line(capsys, tmp_path):
    refused(capsys, "dump", "--gguf", tmp_path / "a\nb.gguf", says=("a\\nb.gguf: no such file",))


def test_capture_settings_fit_llama_cpp_s_32_bits(capsys, base, tmp_path, monkeypatch):
    from gdnpass.frontends.llama import build

    monkeypatch.setattr(build, "ensure", lambda *a, **k: pytest.fail("built llama.cpp"))
    refused(capsys, "capture", "--gguf", base, "-o", tmp_path / "v.json", "--ubatch", str(1 << 40),
            says=("--ubatch", "below 2^31"))


# not tried, read in the code -----------------------------------------------------------------------------------------
def test_the_memory_check_counts_check_s_snapshot(capsys, monkeypatch):
    from gdnpass import pipeline

    g = pipeline.run(VerifyConfig("tiny-dc4-h64", 8, 7, n_layers=1), pipeline.PassOptions(fusion=False)).graph
    plan = sum(runtime._pad(s) for s in g.buffers.values())
    monkeypatch.setattr(runtime, "available_bytes", lambda device: plan + 1024)  # the plan fits, twice it does not
    assert cli_run(capsys, "run", *TINY, "-q")[0] == 0
    refused(capsys, "run", *TINY, "--check", "-q", says=("the check's snapshot of every buffer",))


def test_the_memory_check_counts_a_weight_s_temporary_copy(capsys, base, monkeypatch):
    from gdnpass import pipeline

    m = open_model(base)
    g = pipeline.run(m.build(m.config(n_tokens=2, n_rs_seq=1)), pipeline.PassOptions(fusion=False)).graph
    largest = max(t.nbytes for t in g.leafs if t.buffer == "weights")
    assert m.load_extra_bytes(g) == largest  # f32 file, f32 weights: one copy of the largest
    plan = sum(runtime._pad(s) for s in g.buffers.values())
    monkeypatch.setattr(runtime, "available_bytes", lambda device: plan + largest - 1)
    refused(capsys, "run", "--gguf", base, *SMALL, "-q", says=("loading a weight",))


# ---- the fuzz: malformed GGUF and graph files through the command line -------------------------------------------
def search(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# every value here is wrong for every qwen35 key below: zero or negative counts, strings, non-finite or negative
# floats, short arrays (as GGUF types)
HOSTILE = [(0, V.UINT32), (-3, V.INT32), ("x", V.STRING), (float("inf"), V.FLOAT32), (float("nan"), V.FLOAT32),
           (-1.0, V.FLOAT32), ([0, 0], V.ARRAY, V.INT32), (1 << 40, V.UINT64)]
KEYS = [K + k for k, *_ in GGUF_KEYS if k not in ("context_length", "attention.layer_norm_rms_epsilon",
                                                  "rope.freq_base")]  # (a huge one of these is legal)
KEYS_ANY = [K + "context_length", K + "attention.layer_norm_rms_epsilon", K + "rope.freq_base"]
DROPPABLE = [K + k for k, _, _, req in GGUF_KEYS if req] + [K + "vocab_size", K + "attention.head_count_kv",
                                                          K + "attention.key_length"]
NON_SQUARE = [n for n, s, _ in tensor_plan(SHAPE) if len(s) == 2 and s[0] != s[1]]


@st.composite
def broken_gguf(draw):
    """(how to break the base file, a description): every mutation makes a file gdnpass must refuse."""
    kind = draw(st.sampled_from(["value", "value_any", "drop", "truncate", "count", "transpose", "resize"]))
    if kind == "value":
        key, v = draw(st.sampled_from(KEYS)), draw(st.sampled_from(HOSTILE))
        return ("kv", {key: v}), f"{key} = {v[0]!r}"
    if kind == "value_any":  # keys where only some hostile values are wrong: the non-finite, negative, zero, text
        key, v = draw(st.sampled_from(KEYS_ANY)), draw(st.sampled_from(HOSTILE[:6]))
        return ("kv", {key: v}), f"{key} = {v[0]!r}"
    if kind == "drop":
        key = draw(st.sampled_from(DROPPABLE))
        return ("drop", key), f"without {key}"
    if kind == "truncate":
        return ("cut", draw(st.floats(0.0, 0.999))), "truncated"
    if kind == "count":
        which = draw(st.sampled_from(["tensor_count", "kv_count"]))
        return ("count", (which, draw(st.sampled_from([1 << 62, (1 << 64) - 1, 10**9])))), which
    name = draw(st.sampled_from(NON_SQUARE))
    if kind == "transpose":
        return ("tensor", transposed(name)), f"{name} transposed"
    return ("tensor", lambda n, a: np.concatenate([a, a[:1]]) if n == name else a), f"{name} one row longer"


def make(base: Path, dst: Path, how) -> Path:
    op, arg = how
    if op == "kv":
        return rewrite(base, dst, arg)
    if op == "drop":
        return rewrite(base, dst, drop=(arg,))
    if op == "tensor":
        return rewrite(base, dst, tensor=arg)
    if op == "count":
        return header_count(base, dst, *arg)
    data = base.read_bytes()
    dst.write_bytes(data[:int(arg * len(data))])
    return dst


def test_fuzz_malformed_gguf_files(capsys, base, tmp_path):
    keep = tmp_path / "keep.json"

    @search(40)
    @given(broken_gguf())
    def check(case):
        how, what = case
        keep.write_text(KEEP)
        f = make(base, tmp_path / "fuzz.gguf", how)
        rc, _, err = cli_run(capsys, "dump", "--gguf", f, *SMALL, "--save", keep)
        assert rc == 2 and err.count("\n") == 1 and str(f) in err, (what, rc, err)
        assert kept(keep), what

    check()


@st.composite
def broken_graph_file(draw):
    """(JSON text edit of a valid graph file, a description): meta that execution reads made wrong, numbers JSON
    cannot hold where saving meets them, or the text cut short."""
    kind = draw(st.sampled_from(["ids", "config", "input_bytes", "inf", "deep", "cut"]))
    if kind == "ids":
        v = draw(st.sampled_from([[99], [-1], [2], "0", [0.5], [True], {}, [None]]))
        return ("meta", {"ids": v}), f"meta.ids = {v!r}"
    if kind == "config":
        v = draw(st.sampled_from(["x", 3, [], True]))
        return ("meta", {"config": v}), f"meta.config = {v!r}"
    if kind == "input_bytes":
        v = draw(st.sampled_from([5, "x", {"rs_s_copy": 5}, []]))
        return ("meta", {"input_bytes": v}), f"meta.input_bytes = {v!r}"
    if kind == "inf":
        where, new = draw(st.sampled_from([('"meta": {', '"meta": {"z": -1e999, '),
                                           ('"op_params": {}', '"op_params": {"z": 1e999}')]))
        return ("text", (where, new)), f"an infinity in {where}"
    if kind == "deep":
        n = draw(st.integers(65, 900))
        return ("meta", {"deep": json.loads("[" * n + "]" * n)}), f"meta nesting {n} deep"
    return ("cut", draw(st.floats(0.0, 0.999))), "cut"


def test_fuzz_malformed_graph_files(capsys, tmp_path):
    keep = tmp_path / "keep.json"
    g = build_verify_graph(VerifyConfig("tiny-dc4-h64", 2, 1, n_layers=1))
    text = serialize.dumps(g)

    @search(30)
    @given(broken_graph_file())
    def check(case):
        (op, arg), what = case
        keep.write_text(KEEP)
        f = tmp_path / "fuzz.json"
        if op == "meta":
            d = json.loads(text)
            d["meta"].update(arg)
            f.write_text(json.dumps(d))
        elif op == "text":
            f.write_text(text.replace(arg[0], arg[1], 1))
        else:
            f.write_text(text[:int(arg * len(text))])
        rc, _, err = cli_run(capsys, "run", "--graph", f, "--save", keep, "-q")
        assert rc == 2 and err.count("\n") == 1, (what, rc, err)
        assert kept(keep), what

    check()


def test_the_config_bounds_are_llama_cpp_s():
    with pytest.raises(GraphError, match="mem_size"):
        VerifyConfig("tiny-dc4-h64", 2, 1, n_layers=1, mem_size=257).check()
    VerifyConfig("tiny-dc4-h64", 2, 1, n_layers=1, n_seqs=256).check()
