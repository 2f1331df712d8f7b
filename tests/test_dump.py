"""`gdnpass dump`: each format's structure against the graph it shows, --explain's rules and byte ranges, the
JSON schema, focusing (--layer, --around, --diff), DOT rendering and every error path (one line, exit code 2)."""

from __future__ import annotations

import json
import re
import shutil
import stat

import pytest

from gdnpass import cli, dump, pipeline as pipe, serialize
from gdnpass.models import VerifyConfig, build_verify_graph

TINY = ["--model", "tiny-dc4-h64", "--layers", "2"]
QWEN = ["--model", "qwen3.5-9b", "--layers", "2"]
# a table row: sign (' ', '-', '+'), fused mark ('*' or ' '), index, op, name
ROW = re.compile(r"^([ +-])([ *])\s+(\d+)  (\S+)\s+(.+?)\s{2,}")


@pytest.fixture(autouse=True)
def no_ambient_gdn_fusion(monkeypatch):
    """Without --fuse/--no-fuse, GDN_FUSION decides: the tests that rely on that set it themselves."""
    monkeypatch.delenv("GDN_FUSION", raising=False)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.dump_main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def pipeline(model="tiny-dc4-h64", layers=2, fused=True, n_tokens=8):
    """(nodes fusion starts from, graph) as dump should show them, built here through the library's pipeline."""
    res = pipe.run(VerifyConfig(model, n_tokens, 7, n_layers=layers), pipe.PassOptions(fusion=fused))
    return res.before, res.graph


def graph_of(*args, **kw):
    return pipeline(*args, **kw)[1]


def signature(nodes) -> list[tuple[str, str]]:
    """(op, name) of each node; a fused node's name carries a per-build id, so only its op is compared."""
    return [(dump.op_label(n), "" if dump.is_fused(n) else n.name) for n in nodes]


def listed_signature(listed) -> list[tuple[str, str]]:
    return [(r[3], "" if r[1] == "*" else r[4]) for r in listed]


def rows(out: str) -> list[tuple[str, str, int, str, str]]:
    return [(m[1], m[2], int(m[3]), m[4], m[5]) for m in map(ROW.match, out.splitlines()) if m]


# ---- text ----------------------------------------------------------------------------------------------------------


def test_text_lists_every_node_in_order_and_marks_the_fused_ones(capsys):
    rc, out, _ = run(capsys, *TINY, "--fuse")
    g = graph_of()
    listed = rows(out)
    assert rc == 0
    assert [r[2] for r in listed] == list(range(len(g.nodes)))
    assert listed_signature(listed) == signature(g.nodes)
    fused = [r for r in listed if r[1] == "*"]
    # per layer: the attention norm, the chain, alpha/beta, the GDN with its snapshot CPY and its gates (the decay's
    # ADD, SOFTPLUS, MUL, beta's SIGMOID), the gated output norm, the z product with the output gate (SILU, MUL), (the
    # output projection + residual: layer 0's sum lands on the projection's x in this plan, refused), the post norm,
    # the FFN's gate/up, the FFN's down + residual
    layer = ["RMS_NORM_MUL", "GDN_CONV_CHAIN", "MUL_MAT_VEC_PAIR", "GATED_DELTA_NET_CACHE", "RMS_NORM_MUL",
             "MUL_MAT_CHAIN"]
    ffn = ["RMS_NORM_MUL", "MUL_MAT_VEC_PAIR", "MUL_MAT_ADD"]
    assert [r[3] for r in fused] == layer + ffn + layer + ["MUL_MAT_ADD"] + ffn
    lines = out.splitlines()
    for r in fused:  # each fused node is followed by what it replaced
        i = next(k for k, line in enumerate(lines) if (m := ROW.match(line)) and int(m[3]) == r[2])
        assert re.search(r"\^ replaces \d+ nodes", lines[i + 1])
    assert "replaces 35 nodes: conv_states-0, conv_states_reshaped-0, conv_input-0" in out  # RMS form: +2 SCALEs
    assert "beta_sigmoid-0" in out and "arena[0x" in out and "view of cache_r_l0 +0x" in out
    assert f"nodes {len(pipeline()[0])} -> {len(g.nodes)}" in out
    assert "fusion gdn_conv_chain: applied 2" in out and "fusion mul_mat_vec_pair: applied 4" in out


def test_no_fuse_shows_the_plain_graph(capsys):
    _, out, _ = run(capsys, *TINY, "--no-fuse")
    n = len(graph_of(fused=False).nodes)
    assert len(rows(out)) == n and not any(r[1] == "*" for r in rows(out))
    assert f"nodes {n} -> {n}" in out and "fusion off" in out


@pytest.mark.parametrize("env, fused", [("1", True), ("0", False)])
def test_gdn_fusion_decides_without_a_flag(capsys, monkeypatch, env, fused):
    monkeypatch.setenv("GDN_FUSION", env)
    _, out, _ = run(capsys, *TINY)
    assert any(r[1] == "*" for r in rows(out)) == fused


@pytest.mark.parametrize("qk_norm, launches", [("l2", 3), ("rms", 5)])
def test_l2_separate_chains_count_their_extra_launches(capsys, tmp_path, qk_norm, launches):
    # planned without the graph-optimize step, the q/k outputs land on the projection: l2_separate, and the q/k
    # norms run as their unfused kernels after the fused one (L2_NORM, or RMS_NORM + SCALE, for q and for k)
    path = tmp_path / "unprepared.json"
    g = pipe.run(VerifyConfig("tiny-dc4-h64", 8, 7, n_layers=2, qk_norm=qk_norm), pipe.PassOptions(fusion=False))
    serialize.save(g.graph, path)
    _, out, _ = run(capsys, "--graph", str(path), "--fuse")
    assert f"{launches} launches: fused kernel + {launches - 1} q/k norm" in out
    assert f"incl. 2 GDN_CONV_CHAIN with l2_separate: {launches} launches each" in out


def test_a_graph_file_without_a_plan_gets_one(capsys, tmp_path):
    g = build_verify_graph(VerifyConfig("tiny-dc4-h64", 8, 7, n_layers=2))
    assert "arena" not in g.buffers
    path = tmp_path / "unplanned.json"
    serialize.save(g, path)
    rc, out, _ = run(capsys, "--graph", str(path), "--fuse")
    assert rc == 0 and f"graph file {path}" in out
    assert len(rows(out)) == len(graph_of().nodes)


# ---- --explain -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, rule", [
    (TINY + ["--tokens", "17"], "scope.n-tokens"),
    (TINY + ["--seqs", "129"], "scope.n-seqs"),
    (QWEN, "pair.different-src1"),
])
def test_explain_names_the_refusing_rule_per_layer(capsys, argv, rule):
    _, out, _ = run(capsys, *argv, "--fuse", "--explain")
    lines = out.splitlines()
    assert lines.index("layer 0:") < lines.index("layer 1:")
    for layer in (0, 1):  # every layer has its refusal, under its own heading ("at node N 'name'", or "at 'name'"
        start = lines.index(f"layer {layer}:")  # when a later rewrite removed that node)
        block = lines[start + 1: lines.index("layer 1:") if layer == 0 else None]
        assert any("REFUSED" in line and f"rule {rule} at " in line and f"-{layer}'" in line for line in block)


def test_explain_shows_the_colliding_byte_ranges(capsys, tmp_path):
    path = tmp_path / "unprepared.json"
    serialize.save(graph_of(fused=False), path)
    _, out, _ = run(capsys, "--graph", str(path), "--fuse", "--explain", "--layer", "1")
    assert "layer 0:" not in out and "layer 1:" in out
    assert "applied  gdn_conv_chain: node" in out
    assert "rule pair.alias at node" in out  # the alpha/beta pair: unprepared, beta reuses alpha's bytes
    assert "rule gdn-gates.between at node" in out  # so the GDN cannot read alpha at its place either
    range_ = r"(\w+)\[(0x[0-9a-f]+), (0x[0-9a-f]+)\)"
    collide = re.findall(rf"bytes collide: {range_} vs {range_}", out)
    assert len(collide) == 2
    for buf_a, lo_a, hi_a, buf_b, lo_b, hi_b in collide:
        assert buf_a == buf_b and int(lo_a, 16) < int(hi_b, 16) and int(lo_b, 16) < int(hi_a, 16)


def test_explain_with_fusion_off_says_so(capsys):
    _, out, _ = run(capsys, *TINY, "--no-fuse", "--explain")
    assert "fusion off: no candidates examined" in out


# ---- JSON ----------------------------------------------------------------------------------------------------------

OPT_STR, OPT_INT = (str, None), (int, None)
RANGE = {"buffer": str, "lo": int, "hi": int}
NODE = {"index": int, "name": str, "op": str, "unary": OPT_STR, "glu": OPT_STR, "type": str, "ne": [int], "nb": [int], "src": [str],
        "writes": [str], "view_src": OPT_STR, "view_offs": int, "buffer": str, "offset": int, "size": int,
        "layer": OPT_INT, "users": int, "fused": bool, "replaced": [str]}
SCHEMA = {
    "schema": "gdnpass-dump",
    "version": 1,
    "source": str,
    "graph": {"meta": dict, "buffers": dict, "alignment": int},
    "focus": {"layer": OPT_INT, "around": OPT_STR},
    "summary": {"nodes_before": int, "nodes_after": int, "leafs": int, "launches_before": int, "launches_after": int,
                "l2_separate": int},
    "nodes": [NODE],
    "fusion": {
        "enabled": bool,
        "between": str,
        "applied": [{"pattern": str, "layer": OPT_INT, "node": str, "anchor": str, "replaced": [str]}],
        "refused": [{"pattern": str, "layer": OPT_INT, "node": str, "rule": str, "reason": str,
                     "ranges": ([RANGE], None)}],
    },
}


def check(value, schema, path="$") -> None:
    """A tiny JSON-schema: a dict is an exact object, [s] a list of s, a tuple any of, a type an instance, a value
    itself (None: null)."""
    if isinstance(schema, tuple):
        errors = []
        for alt in schema:
            try:
                return check(value, alt, path)
            except AssertionError as e:
                errors.append(str(e))
        raise AssertionError(" / ".join(errors))
    if isinstance(schema, dict):
        assert isinstance(value, dict) and value.keys() == schema.keys(), f"{path}: keys {list(value)}"
        for k, s in schema.items():
            check(value[k], s, f"{path}.{k}")
    elif isinstance(schema, list):
        assert isinstance(value, list), f"{path}: not a list"
        for i, v in enumerate(value):
            check(v, schema[0], f"{path}[{i}]")
    elif isinstance(schema, type):
        assert isinstance(value, schema) and (schema is bool or not isinstance(value, bool)), f"{path}: {value!r}"
    else:
        assert value == schema, f"{path}: {value!r} != {schema!r}"


def test_the_schema_checker_rejects_what_it_should():
    for bad in ({"index": "0"}, {**{k: 0 for k in NODE}}):
        with pytest.raises(AssertionError):
            check(bad, NODE)
    with pytest.raises(AssertionError):
        check({"layer": True, "around": None}, SCHEMA["focus"])


def json_dump(capsys, *argv) -> dict:
    rc, out, _ = run(capsys, *argv, "--format", "json")
    assert rc == 0
    doc = json.loads(out)
    check(doc, SCHEMA)
    return doc


def test_json_matches_the_schema_and_the_graph(capsys):
    doc = json_dump(capsys, *QWEN, "--fuse")
    g = graph_of("qwen3.5-9b")
    label = lambda n: f"UNARY({n['unary']})" if n["unary"] else f"GLU({n['glu']})" if n["glu"] else n["op"]  # noqa
    assert [(label(n), "" if n["fused"] else n["name"]) for n in doc["nodes"]] == signature(g.nodes)
    assert [n["index"] for n in doc["nodes"]] == list(range(len(g.nodes)))
    assert doc["summary"]["nodes_after"] == len(g.nodes) == len(doc["nodes"])
    assert doc["summary"]["nodes_before"] == len(pipeline("qwen3.5-9b")[0])
    assert doc["summary"]["launches_after"] < doc["summary"]["launches_before"]
    fused = [n for n in doc["nodes"] if n["fused"]]
    # (gdn_gates takes a GATED_DELTA_NET_CACHE and an ELEMENTWISE_CHAIN a GDN layer, gdn_state_gather the
    # GATED_DELTA_NET_CACHE it leaves, mul_mat_chain the other ELEMENTWISE_CHAIN, pair_glu the FFN pairs: 29
    # applications, 19 nodes)
    assert len(fused) == 19 and len(doc["fusion"]["applied"]) == 29 and all(n["replaced"] for n in fused)
    assert {r["rule"] for r in doc["fusion"]["refused"]} == {"pair.different-src1", "mul-mat-add.output-overlaps-input"}
    chain = next(n for n in fused if n["op"] == "GDN_CONV_CHAIN")
    assert chain["writes"] and chain["size"] > 0 and chain["buffer"] == "arena"
    assert doc["graph"]["meta"]["config"]["model"] == "qwen3.5-9b" and "arena" in doc["graph"]["buffers"]


def test_json_carries_the_colliding_ranges(capsys, tmp_path):
    path = tmp_path / "unprepared.json"
    serialize.save(graph_of(fused=False), path)
    doc = json_dump(capsys, "--graph", str(path), "--fuse")
    alias = [r for r in doc["fusion"]["refused"] if r["rule"] == "pair.alias"]
    assert alias and all(len(r["ranges"]) == 2 for r in alias)
    a, b = alias[0]["ranges"]
    assert a["buffer"] == b["buffer"] and a["lo"] < b["hi"] and b["lo"] < a["hi"]


def test_json_layer_focus_keeps_only_that_layer(capsys):
    doc = json_dump(capsys, *TINY, "--fuse", "--tokens", "17", "--layer", "1")
    assert doc["focus"] == {"layer": 1, "around": None}
    assert doc["nodes"] and {n["layer"] for n in doc["nodes"]} == {1}
    assert doc["fusion"]["refused"] and {r["layer"] for r in doc["fusion"]["refused"]} == {1}


# ---- --layer, --around, --diff -------------------------------------------------------------------------------------


def test_layer_shows_exactly_that_layers_nodes(capsys):
    _, out, _ = run(capsys, *TINY, "--fuse", "--layer", "1")
    g = graph_of()
    assert [r[2] for r in rows(out)] == [i for i, n in enumerate(g.nodes) if n.layer == 1]


@pytest.mark.parametrize("key", ["40", "gdn_conv_chain-1", "blk.1.attn_qkv.weight * attn_norm-1"])
def test_around_shows_eight_nodes_either_side(capsys, key):
    _, out, _ = run(capsys, *TINY, "--fuse", "--around", key)
    g = graph_of()
    at = int(key) if key.isdigit() else next(i for i, n in enumerate(g.nodes) if n.name == key)
    assert [r[2] for r in rows(out)] == list(range(at - 8, at + 9))


def test_around_is_clipped_at_the_ends(capsys):
    _, out, _ = run(capsys, *TINY, "--around", "0")
    assert [r[2] for r in rows(out)] == list(range(9))


def test_diff_removes_the_replaced_nodes_and_adds_the_fused_ones(capsys):
    _, out, _ = run(capsys, *TINY, "--fuse", "--diff")
    g = graph_of()
    listed = rows(out)
    added = [r for r in listed if r[0] == "+"]
    removed = [r for r in listed if r[0] == "-"]
    fused = [n for n in g.nodes if n.op.is_fused]
    assert [r[3] for r in added] == [n.op.value for n in fused] and all(r[1] == "*" for r in added)
    assert sorted(r[4] for r in removed) == sorted(x for n in fused for x in n.op_params["replaced"])
    assert out.count("\n@@ -") >= 1  # (one hunk since the GDN absorbs its gates and its state's GET_ROWS)
    names = [r[4] for r in listed]  # in order: the chain runs where its CONCAT ran
    assert names.index("conv_input-0") < names.index("gdn_conv_chain-0") < names.index("conv_output_silu-0")
    assert names.index("blk.0.ssm_beta.weight * attn_norm-0") < names.index("alpha-0")


def test_diff_around_a_replaced_node(capsys):
    rc, out, _ = run(capsys, *TINY, "--fuse", "--diff", "--around", "conv_input-0")
    assert rc == 0 and ("-", " ", "CONCAT", "conv_input-0") in [r[:2] + r[3:5] for r in rows(out)]


def test_diff_without_fusion_has_no_differences(capsys):
    _, out, _ = run(capsys, *TINY, "--no-fuse", "--diff")
    assert "no differences" in out and not rows(out)


# ---- DOT -----------------------------------------------------------------------------------------------------------


def test_dot_has_a_cluster_per_layer_and_every_node(capsys):
    rc, out, _ = run(capsys, *TINY, "--fuse", "--format", "dot")
    g = graph_of()
    assert rc == 0 and out.startswith("digraph gdnpass {") and out.rstrip().endswith("}")
    assert out.count("{") == out.count("}")
    assert re.findall(r"subgraph (cluster_L\d+)", out) == ["cluster_L0", "cluster_L1"]
    declared = re.findall(r"^\s+(n\d+) \[label=\"(\d+): ", out, re.M)
    assert sorted(int(i) for _, i in declared) == list(range(len(g.nodes)))
    assert out.count("fillcolor=gold") == 19
    read_leafs = {s.uid for n in g.nodes for s in n.src if s is not None and s.is_leaf}
    assert out.count("shape=ellipse") == len(read_leafs)
    ids = set(re.findall(r"^\s+([nl]\d+) \[", out, re.M))
    edges = re.findall(r"^\s+([nl]\d+) -> ([nl]\d+);", out, re.M)
    assert edges and all(a in ids and b in ids for a, b in edges)


def fake_dot(tmp_path) -> str:
    """A stand-in for Graphviz that writes the DOT it is given to the -o file (checks the plumbing, not dot)."""
    script = tmp_path / "dot"
    script.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\ncat > "$2"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_render_pipes_the_dot_text_to_dot(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(dump.shutil, "which", lambda name: fake_dot(tmp_path) if name == "dot" else None)
    target = tmp_path / "g.svg"
    rc, out, _ = run(capsys, *TINY, "--layer", "0", "--render", "svg", str(target))
    assert rc == 0 and f"wrote {target}" in out
    _, dot_text, _ = run(capsys, *TINY, "--layer", "0", "--format", "dot")
    assert target.read_text() == dot_text


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_render_svg_with_graphviz(capsys, tmp_path):
    target = tmp_path / "g.svg"
    rc, _, err = run(capsys, *TINY, "--fuse", "--render", "svg", str(target))
    assert rc == 0, err
    assert "<svg" in target.read_text()


# ---- errors: one line on stderr, exit code 2 -----------------------------------------------------------------------


def malformed(tmp_path) -> str:
    path = tmp_path / "bad.json"
    path.write_text('{"format": "gdnpass-graph", "version": 1,')
    return str(path)


@pytest.mark.parametrize("argv, says", [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--graph", "{tmp}/missing.json"], "missing.json: cannot read: No such file or directory"),
    (["--graph", "{bad}"], "bad.json: not valid JSON"),
    (TINY + ["--around", "nope"], "--around: no node named 'nope'"),
    (TINY + ["--around", "999"], "--around: node index 999 out of range"),
    (TINY + ["--fuse", "--around", "conv_input-0"], "was fused into 'gdn_conv_chain-0'"),
    (TINY + ["--layer", "7"], "--layer 7: no node of that layer in the graph (layers: 0, 1; -1: graph-wide)"),
    (TINY + ["--explain", "--format", "json"], "--explain prints text"),
    (TINY + ["--render", "pdf", "x.pdf"], "--render: format 'pdf' is not one of svg, png"),
])
def test_errors_are_one_line_and_exit_2(capsys, tmp_path, argv, says):
    argv = [x.format(tmp=tmp_path, bad=malformed(tmp_path)) for x in argv]
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("gdnpass-dump: error: ") and says in err, err


def test_render_without_graphviz_is_one_clear_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(dump.shutil, "which", lambda name: None)
    rc, _, err = run(capsys, *TINY, "--render", "png", str(tmp_path / "g.png"))
    assert rc == 2 and err.count("\n") == 1 and "'dot' program, which is not installed" in err


def test_bad_gdn_fusion_value_is_an_error(capsys, monkeypatch):
    monkeypatch.setenv("GDN_FUSION", "yes")
    rc, _, err = run(capsys, *TINY)
    assert rc == 2 and "GDN_FUSION must be 0 or 1" in err


def test_gdnpass_dump_is_the_same_command(capsys):
    a = cli.make_parser().parse_args(["dump", *TINY, "--fuse", "--format", "json"])
    assert a.func is cli.cmd_dump and a.func(a) == 0
    check(json.loads(capsys.readouterr().out), SCHEMA)


@pytest.mark.parametrize("form, says", [("rms", "[q/k RMS_NORM + SCALE (upstream)]"), ("l2", "[q/k L2_NORM]")])
def test_explain_names_the_q_k_form(capsys, form, says):
    rc, out, _ = run(capsys, *TINY, "--fuse", "--explain", "--qk-norm", form)
    chains = [line for line in out.splitlines() if "applied  gdn_conv_chain" in line]
    assert rc == 0 and len(chains) == 2 and all(says in line for line in chains)


def test_the_summary_says_which_pre_passes_the_quantized_products_skip(capsys):
    """With quantized weights the summary gives the pre-pass plan (gdnpass.prepasses); without, none. One GDN layer
    and its FFN, fused: the two norms and the SwiGLU make the int8
    activations of qkv, the gate/up pair and the down projection, z shares qkv's; ssm_out quantizes for itself."""
    _, out, _ = run(capsys, "--model", "qwen3.5-9b", "--layers", "1", "--wtype", "q4_k", "--tokens", "4", "--fuse")
    assert "quantized products: 4 of 5 activation pre-passes skipped (3 made by their producers)" in out, out[-800:]
    _, plain, _ = run(capsys, "--model", "qwen3.5-9b", "--layers", "1", "--tokens", "4", "--fuse")
    assert "quantized products" not in plain
