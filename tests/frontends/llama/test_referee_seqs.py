"""llama.cpp as the referee of a verify ubatch of several sequences (issue 37 item 1).

A context of n_seq_max = S (one recurrent cell per sequence, llama.cpp's default of one KV stream per sequence, or
one unified stream), each sequence's prompt decoded on its own, then one batch of S x T verify tokens, which
llama.cpp's split_equal makes one ubatch (n_ubatch >= S x T). Captured on tiny-qwen35 (f32) for S = 2 and 3, T = 4,
n_rs_seq 3:

- the capture is a valid graph on llama.cpp's plan, with S cache rows gathered (GET_ROWS [n_embd_r, S]), 4 snapshot
  CPYs of S rows each and rs_s_copy = each sequence's own cell;
- our builder's GDN layers equal llama.cpp's node for node (use counts included), and so does our whole forward
  (the attention's KV streams, their views and the per-stream KQ mask; flash attention on and off; unified too);
- our planner, given llama.cpp's reserve graph (n_seqs = n_seq_max), reproduces every compute offset and the size;
- the conv chain of every GDN layer fuses on llama.cpp's graph and plan (issue 37 item 2), with llama.cpp's row ids
  and with ids rolled across sequences, and fused vs unfused is byte-identical (``run --check`` too).
"""

from __future__ import annotations

import base64
import copy

import numpy as np
import pytest

from gdnpass import alloc, ops
from gdnpass.errors import GraphError
from gdnpass.frontends.compare import diff_layers, layer_nodes
from gdnpass.frontends.llama import capture as cap_mod
from gdnpass.ir import Op
from gdnpass.models import VerifyConfig, build_verify_graph, get_model
from support.referee import assert_graph_equals_capture, assert_plan_equals_capture
from gdnpass.models.gguf_write import write_gguf
from gdnpass.models.hparams import default_ids

SHAPE, T, RS = "tiny-qwen35", 4, 3


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_gguf(SHAPE, tmp_path_factory.mktemp("gguf") / f"{SHAPE}.gguf", wtype="f32", seed=1)


_CAPTURES: dict[tuple, cap_mod.Capture] = {}


def captured(llama, gguf, S: int, flash: str = "auto", unified: bool = False) -> cap_mod.Capture:
    key = (S, flash, unified)
    if key not in _CAPTURES:
        n_ub = max(8, S * T)  # > n_rs_seq + 1, and the whole verify batch in one ubatch
        s = cap_mod.Settings(n_tokens=T, n_rs_seq=RS, n_ubatch=n_ub, n_batch=n_ub, n_seqs=S, flash_attn=flash,
                             n_ctx=256 if unified else 256 * S, kv_unified=unified)  # 256 cells per stream
        _CAPTURES[key] = cap_mod.capture(gguf, s, install=llama)
    return copy.deepcopy(_CAPTURES[key])


def config(S: int, **kw) -> VerifyConfig:
    return VerifyConfig(model=SHAPE, n_tokens=T, n_rs_seq=RS, n_seqs=S, wtype="f32", ab_wtype="f32", **kw)


SEQS = (2, 3)


@pytest.mark.parametrize("S", SEQS)
def test_capture_of_several_sequences(llama, gguf, S):
    c = captured(llama, gguf, S)
    g = c.verify
    ops.validate(g)
    alloc.check_plan(g)
    assert c.use_counts == g.use_counts()
    st = g.meta["llama"]["settings"]
    assert (st["n_seq_max"], st["n_tokens"], st["reserve"]["n_seqs"]) == (S, S * T, S)
    assert g.meta["llama"]["reallocated"] is False and g.meta["llama"]["same_topology_as_reserve"]
    gathered = [n for n in g.nodes if n.op is Op.GET_ROWS and n.name == "conv_states-0"]
    assert [n.ne[:2] for n in gathered] == [(get_model(SHAPE).n_embd_r, S)]
    snaps = [n for n in g.nodes if n.op is Op.CPY and n.layer == 0 and n.ne[1] == S]
    assert len(snaps) == 1 + RS + 1  # the conv planes and the GDN's snapshot CPY
    s_copy = np.frombuffer(base64.b64decode(g.meta["input_bytes"]["rs_s_copy"]), dtype=np.int32).tolist()
    assert s_copy == default_ids(config(S)) == list(range(S))  # plane 0 of each sequence's own cell


@pytest.mark.parametrize("S", SEQS)
def test_builder_gdn_layers_equal_llama_cpp_s(llama, gguf, S):
    c = captured(llama, gguf, S)
    mine = build_verify_graph(config(S))
    gdn = get_model(SHAPE).gdn_layers
    for il in gdn:
        got = diff_layers(mine, c.verify, il, their_uses=c.use_counts)
        if il == gdn[-1]:  # the GDN-only graph's one named difference (tests/frontends/llama/test_referee.py)
            k = len(layer_nodes(mine, il)) - 1
            assert got == [f"layer {il} node {k} ('l_out-{il}' / 'l_out-{il}'): flags: 18 vs 16; uses: 0 vs 2"]
        else:
            assert got == [], il


@pytest.mark.parametrize("S,flash,unified", [(2, "on", False), (3, "on", False), (2, "off", False),
                                             (3, "off", False), (2, "on", True), (2, "off", True)])
def test_whole_builder_graph_equals_llama_cpp_s(llama, gguf, S, flash, unified):
    """Node for node, leaf for leaf, use counts: one KV stream per sequence (the caches [n_embd_gqa, kv_size,
    n_stream], stored through a 2-D reshape, read as [hd, Hkv, n_kv, n_stream] views, q as n_stream streams, the KQ
    mask [n_kv, n_t / n_stream, 1, n_stream]), or a unified one (llama.cpp's kv_unified)."""
    c = captured(llama, gguf, S, flash, unified)
    mine = build_verify_graph(config(S, whole=True, flash_attn=flash == "on", kv_unified=unified))
    ops.validate(mine)
    assert_graph_equals_capture(mine, c)
    assert mine.find("attn_inp_kq_mask").ne == (256, T * S // (1 if unified else S), 1, 1 if unified else S)


@pytest.mark.parametrize("S", SEQS)
def test_planner_reproduces_llama_cpp_s_offsets(llama, gguf, S):
    c = captured(llama, gguf, S)
    compute, _ = assert_plan_equals_capture(c)
    assert len(compute) > 50


@pytest.mark.parametrize("S", SEQS)
@pytest.mark.parametrize("ids", ["recorded", "rolled"])
def test_the_chain_of_several_sequences_fuses_on_llama_cpp_s_plan(llama, gguf, S, ids):
    """Every GDN layer's chain of S sequences fuses on llama.cpp's own graph and memory plan (issue 37 item 2), with
    the rows llama.cpp's s_copy held (each sequence its own cell), and rolled (sequence i gathers plane i+1 of cell
    i+1, the row another sequence writes, as after find_slot's swaps and a rollback); everything the pass fused is
    byte-identical to unfused."""
    from gdnpass.check import check_fusion

    c = captured(llama, gguf, S)
    g = c.verify
    if ids == "rolled":
        gathered = next(n for n in g.nodes if n.op is Op.GET_ROWS and n.name == "conv_states-0")
        cells = gathered.src[0].ne[1] // (1 + RS)  # the cache's rows: 1 + n_rs_seq planes of its cells
        rolled = np.array([((i + 1) % (1 + RS)) * cells + (i + 1) % S for i in range(S)], dtype=np.int32)
        g.meta["input_bytes"]["rs_s_copy"] = base64.b64encode(rolled.tobytes()).decode()
    out = check_fusion(g)
    chains = sorted(a.layer for a in out.report.applied if a.pattern == "gdn_conv_chain")
    assert chains == get_model(SHAPE).gdn_layers
    assert not [r for r in out.report.refused if r.pattern == "gdn_conv_chain"]
    assert out.identical and any(x.name == "result_output" for x in out.compared)
    assert {f"cache_r_l{il}" for il in chains} <= {x.name for x in out.compared}


def test_run_check_on_a_captured_graph_of_several_sequences(llama, gguf, tmp_path, capsys):
    """``gdnpass run --graph CAPTURE --check`` on llama.cpp's graph of 3 sequences: every chain fused, identical."""
    from gdnpass import cli, serialize

    path = tmp_path / "seqs.json"
    serialize.save(captured(llama, gguf, 3).verify, path)
    assert cli.main(["run", "--graph", str(path), "--check", "-q"]) == 0
    out = capsys.readouterr().out
    n = len(get_model(SHAPE).gdn_layers)
    assert f"gdn_conv_chain: {n} applied" in out and " 0 differing" in out and "DIFFERS" not in out, out


@pytest.mark.parametrize("S,flash", [(2, "on"), (3, "off")])
def test_inputs_are_written_as_llama_cpp_sets_them(llama, gguf, S, flash):
    """Every input of the whole forward (token ids, M-RoPE positions, output rows, K/V row ids in each sequence's
    stream, the per-stream KQ mask, rs_s_copy) as gdnpass's InputWriter writes it equals, byte for byte, what
    llama.cpp's set_input wrote for the captured ubatch of S sequences x T tokens."""
    from gdnpass.models.inputs import input_values

    from gdnpass.ir import DType

    c = captured(llama, gguf, S, flash)
    s = cap_mod.Settings(n_tokens=T)  # (the capture's prompts and verify tokens)
    assert c.verify.meta["llama"]["settings"]["n_prompt"] == s.n_prompt
    tokens = [x % c.n_vocab for q in range(S) for x in s.seq_tokens(q)[1]]
    mine = input_values(config(S, whole=True, flash_attn=flash == "on", n_past=s.n_prompt), tokens=tokens)
    theirs = c.verify.meta["input_bytes"]
    assert set(mine) == set(theirs)
    as_np = {DType.I32: np.int32, DType.I64: np.int64, DType.F16: np.float16, DType.F32: np.float32}
    for name, values in mine.items():
        t = as_np[c.verify.find(name).type]
        assert base64.b64decode(theirs[name]) == values.astype(t).tobytes(), name


def test_several_sequences_refused_where_not_supported(llama, gguf):
    """One line naming the field: a verify batch larger than a ubatch; a whole forward's inputs for several
    sequences in one unified KV stream (find_slot interleaves their cells: gdnpass writes a stream per sequence)."""
    from gdnpass.models.inputs import input_values

    with pytest.raises(GraphError, match=r"^capture setting n_ubatch: must be at least n_tokens x n_seqs \(8\)"):
        cap_mod.Settings(n_tokens=T, n_rs_seq=RS, n_ubatch=6, n_batch=8, n_seqs=2).check()
    with pytest.raises(GraphError, match=r"^config field 'kv_unified': the inputs of several sequences"):
        input_values(config(2, whole=True, kv_unified=True))
    assert list(input_values(config(2))) == ["rs_s_copy"]  # the GDN layers' one input is written per sequence


def test_capture_cli_with_seqs(llama, gguf, tmp_path, capsys):
    from gdnpass import cli, serialize

    out = tmp_path / "v.json"
    assert cli.main(["capture", "--gguf", str(gguf), "--tokens", "4", "--rs-seq", "3", "--ubatch", "12", "--seqs", "3",
                     "--ctx", "768", "-o", str(out)]) == 0
    assert "verify ubatch of 3 sequences x 4 tokens (a KV stream each)" in capsys.readouterr().out
    assert serialize.load(out).meta["llama"]["settings"]["n_seq_max"] == 3
    assert cli.main(["capture", "--gguf", str(gguf), "--seqs", "3", "--ubatch", "8", "-o", str(out)]) != 0
    assert "capture setting --ubatch: must be at least n_tokens x n_seqs (12)" in capsys.readouterr().err
