"""gdnpass.serialize: round trips, and one-line GraphErrors for every kind of malformed graph file."""

from __future__ import annotations

import copy
import json

import pytest

from pathlib import Path

from gdnpass import ops, serialize
from gdnpass.ir import BufferSpec, DType, Flag, Graph, GraphError, Op, Tensor, arena_buffer

N_EMBD, D_CONV, CHANNELS, N_TOKENS, N_SEQS, MEM = 8, 4, 6, 5, 1, 2
ALIGN = 32


def build_graph(plan: bool = True) -> Graph:
    """A Qwen3-Next style conv block: qkv projection, conv state gather/concat/write-back, ssm_conv, silu, l2_norm."""
    wqkv = ops.new_tensor("wqkv-0", DType.F32, (N_EMBD, CHANNELS), buffer="weights", layer=0)
    kernel = ops.new_tensor("ssm_conv1d-0", DType.F32, (D_CONV, CHANNELS), buffer="weights", layer=0)
    inp = ops.new_tensor("inp", DType.F32, (N_EMBD, N_TOKENS), buffer="input", flags=Flag.INPUT, layer=-1)
    ids = ops.new_tensor("rs_s_copy", DType.I32, (N_SEQS,), buffer="input", flags=Flag.INPUT, layer=-1)
    cache = ops.new_tensor("cache_r_l0", DType.F32, ((D_CONV - 1) * CHANNELS, MEM), buffer="cache", layer=0)

    qkv = ops.cb(ops.mul_mat(wqkv, inp), "qkv_mixed", 0)
    states = ops.get_rows(cache, ids)
    states = ops.reshape(states, D_CONV - 1, CHANNELS, N_SEQS)
    qkv_t = ops.transpose(ops.reshape(qkv, CHANNELS, N_TOKENS, N_SEQS))
    conv_input = ops.cb(ops.concat(states, qkv_t, 0), "conv_input", 0)
    # write the last d_conv-1 columns back into the cache (a view of a view: view_src is still the base)
    last = ops.view_3d(conv_input, D_CONV - 1, CHANNELS, N_SEQS, conv_input.nb[1], conv_input.nb[2], N_TOKENS * 4,
                       name="last_conv_states-0")
    dst = ops.view_1d(cache, (D_CONV - 1) * CHANNELS * N_SEQS, 0, name="conv_states_dst-0")
    write = ops.cpy(last, dst)
    conv = ops.cb(ops.ssm_conv(conv_input, kernel), "conv_output_raw", 0)
    act = ops.cb(ops.silu(conv), "conv_output_silu", 0)
    q = ops.view_2d(act, 3, N_TOKENS, act.nb[1], 0, name="q_conv-0")
    qn = ops.set_output(ops.cb(ops.l2_norm(q, 1e-6), "q_norm", 0))

    g = Graph()
    g.meta = {"model": "tiny", "n_tokens": N_TOKENS, "dims": (1, 2)}
    g.expand(write)
    g.expand(qn)
    if plan:
        _fake_plan(g)
    return g


def _fake_plan(g: Graph) -> None:
    """What alloc would set: leafs packed in their buffers, non-view nodes in an aligned arena."""
    ends: dict[str, int] = {}
    for t in g.leafs:
        t.offset = ends.get(t.buffer, 0)
        ends[t.buffer] = t.offset + t.nbytes
    arena = 0
    for t in g.nodes:
        if t.view_src is None:
            t.buffer, t.offset = "arena", arena
            arena = -(-(arena + t.nbytes) // ALIGN) * ALIGN
    g.buffers = {**ends, "arena": arena}
    g.alignment = ALIGN


def fields(t: Tensor) -> tuple:
    return (t.name, t.type, t.ne, t.nb, t.op, t.op_params, t.view_offs, t.flags, t.buffer, t.offset, t.layer)


def assert_same_graph(a: Graph, b: Graph) -> None:
    ta, tb = serialize._ordered(a), serialize._ordered(b)
    assert len(ta) == len(tb)
    pos_a = {id(t): i for i, t in enumerate(ta)}
    pos_b = {id(t): i for i, t in enumerate(tb)}
    for x, y in zip(ta, tb):
        assert fields(x) == fields(y)  # tuple != list, so this also checks ne/nb/axes come back as tuples
        assert [pos_a[id(s)] for s in x.src] == [pos_b[id(s)] for s in y.src]
        assert (x.view_src is None) == (y.view_src is None)
        if x.view_src is not None:
            assert pos_a[id(x.view_src)] == pos_b[id(y.view_src)]
    assert [pos_a[id(t)] for t in a.nodes] == [pos_b[id(t)] for t in b.nodes]
    assert [pos_a[id(t)] for t in a.leafs] == [pos_b[id(t)] for t in b.leafs]
    assert (a.buffers, a.buffer_specs, a.alignment) == (b.buffers, b.buffer_specs, b.alignment)


def by_name(g: Graph, name: str) -> Tensor:
    return next(t for t in g.tensors() if t.name == name)


# ---------------------------------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", [False, True])
def test_round_trip_dict(plan):
    g = build_graph(plan)
    ops.validate(g)
    g2 = serialize.from_dict(serialize.to_dict(g))
    assert_same_graph(g, g2)
    assert serialize.to_dict(g2) == serialize.to_dict(g)
    assert g2.meta == {"model": "tiny", "n_tokens": N_TOKENS, "dims": [1, 2]}  # meta is plain JSON


def test_round_trip_string_and_file(tmp_path):
    g = build_graph()
    text = serialize.dumps(g)
    assert json.loads(text) == serialize.to_dict(g)
    assert len(text.splitlines()) == len(serialize._ordered(g)) + 11  # one tensor per line, 11 lines of frame
    assert_same_graph(g, serialize.loads(text))
    path = tmp_path / "graph.json"
    serialize.save(g, path)
    assert_same_graph(g, serialize.load(path))
    assert_same_graph(g, serialize.load(str(path)))


def test_schema_shape():
    d = serialize.to_dict(build_graph())
    assert d["format"] == "gdnpass-graph" and d["version"] == 2
    assert list(d) == ["format", "version", "meta", "alignment", "buffers", "tensors", "nodes", "leafs"]
    assert d["buffers"] == {"cache": {"size": 144, "role": "cache"}, "input": {"size": 164, "role": "input"},
                            "weights": {"size": 288, "role": "weights"}, "arena": {"size": 736, "role": "compute"}}
    # unplanned: the buffers the leafs name, without a size yet
    assert serialize.to_dict(build_graph(plan=False))["buffers"] == {
        "cache": {"size": None, "role": "cache"}, "input": {"size": None, "role": "input"},
        "weights": {"size": None, "role": "weights"}}
    n_leafs = len(d["leafs"])
    assert d["leafs"] == list(range(n_leafs))  # leafs first, then nodes
    assert d["nodes"] == list(range(n_leafs, n_leafs + len(d["nodes"])))
    for i, e in enumerate(d["tensors"]):
        assert e["id"] == i and list(e) == list(serialize._TENSOR_FIELDS)
    t = next(e for e in d["tensors"] if e["op"] == "TRANSPOSE")
    assert t["op_params"] == {"axes": [1, 0, 2, 3]}


def test_shared_tensors_stay_shared():
    g2 = serialize.loads(serialize.dumps(build_graph()))
    conv_input = by_name(g2, "conv_input-0")
    users = g2.users(conv_input)
    assert {u.op for u in users} == {Op.VIEW, Op.SSM_CONV}
    assert all(u.src[0] is conv_input for u in users)
    cache = by_name(g2, "cache_r_l0")
    write = next(t for t in g2.nodes if t.op is Op.CPY)
    assert write.view_src is cache and write.src[1].view_src is cache
    assert by_name(g2, "last_conv_states-0").view_src is conv_input  # a view of a view points at the base
    assert by_name(g2, "qkv_mixed-0 (reshaped) (transposed)").op_params["axes"] == (1, 0, 2, 3)


def test_loaded_graph_is_marked_visited():
    g2 = serialize.from_dict(serialize.to_dict(build_graph()))
    n_nodes, n_leafs = len(g2.nodes), len(g2.leafs)
    assert {t.uid for t in g2.tensors()} <= g2._visited
    g2.expand(g2.nodes[-1])
    assert (len(g2.nodes), len(g2.leafs)) == (n_nodes, n_leafs)
    top = ops.silu(by_name(g2, "conv_output_silu-0"))
    g2.expand(top)
    assert g2.nodes[n_nodes:] == [top] and len(g2.leafs) == n_leafs


def test_duplicate_names_are_fine():
    g = build_graph()
    for t in g.nodes:
        t.name = "same"
    assert_same_graph(g, serialize.loads(serialize.dumps(g)))


def test_tensor_outside_the_graph_is_listed_last():
    # a node whose src is in neither list still serializes (validate then rejects it, as it would in memory)
    x = ops.new_tensor("x", DType.F32, (4,), buffer="input")
    y = ops.silu(x)
    g = Graph()
    g.nodes = [y]
    d = serialize.to_dict(g)
    assert [e["name"] for e in d["tensors"]] == ["x (silu)", "x"]
    assert d["tensors"][0]["src"] == [1] and d["nodes"] == [0] and d["leafs"] == []
    with pytest.raises(GraphError, match=r"'x \(silu\)': src 'x' is not computed before it"):
        serialize.from_dict(d)


def test_to_dict_rejects_unstorable_op_params():
    g = build_graph()
    g.nodes[-1].op_params["tensor"] = g.leafs[0]
    with pytest.raises(GraphError, match=r"tensor \d+ \('q_norm-0'\): op_params.tensor: a Tensor cannot be stored"):
        serialize.to_dict(g)
    g.nodes[-1].op_params = {"eps": float("nan")}
    with pytest.raises(GraphError, match="not a finite number"):
        serialize.to_dict(g)


# ---------------------------------------------------------------------------------------------------------------------
# version 1 files, named buffers, i64 / f16
# ---------------------------------------------------------------------------------------------------------------------

V1_FILE = Path(__file__).parent / "data" / "graph_v1.json"  # a planned graph saved by the version-1 writer


def test_version_1_file_still_loads():
    d1 = json.loads(V1_FILE.read_text())
    g = serialize.load(V1_FILE)
    assert d1["version"] == 1 and g.buffer_specs == {} and arena_buffer(g) == "arena"
    d2 = serialize.to_dict(g)  # saved again: version 2, every tensor as the version-1 writer wrote it
    roles = {"weights": "weights", "cache": "cache", "input": "input", "arena": "compute"}
    assert d2["version"] == 2
    assert d2["buffers"] == {name: {"size": size, "role": roles[name]} for name, size in d1["buffers"].items()}
    rest = ("meta", "alignment", "tensors", "nodes", "leafs")
    assert [d2[k] for k in rest] == [d1[k] for k in rest]
    assert_same_graph(g, serialize.loads(serialize.dumps(g)))


def test_version_1_knows_only_gdnpass_buffers():
    d = json.loads(V1_FILE.read_text())
    d["buffers"]["kv"] = 64
    _bad(d, r"field 'buffers': unknown buffer 'kv' \(version 1 knows weights, cache, input, arena\)")
    d = json.loads(V1_FILE.read_text())
    d["buffers"]["arena"] = {"size": 1, "role": "compute"}
    _bad(d, "field 'buffers': size of 'arena' must be a non-negative int")


def llama_buffers_graph() -> Graph:
    """The shape of a llama.cpp capture: inputs and computed tensors in one compute buffer, an f16 KV cache written
    by SET_ROWS at i64 row ids, the weights in a buffer named after its backend."""
    w = ops.new_tensor("blk.0.attn_k.weight", DType.F16, (8, 4), buffer="CPU_Mapped", layer=0)
    x = ops.new_tensor("inp_embd", DType.F32, (8, 3), buffer="compute", flags=Flag.INPUT, layer=-1)
    idx = ops.new_tensor("attn_inp_k_idxs", DType.I64, (3,), buffer="compute", flags=Flag.INPUT, layer=-1)
    cache = ops.new_tensor("cache_k_l0", DType.F16, (4, 16), buffer="kv", layer=0)
    k = ops.cb(ops.mul_mat(w, x), "Kcur", 0)
    store = ops.set_rows(cache, k, idx)
    g = Graph()
    g.expand(store)
    off = 0
    for t in [x, idx, k]:  # by hand: gallocr's order is not the point here
        t.offset, off = off, off + 32 * -(-t.nbytes // 32)
    k.buffer = "compute"
    w.offset = cache.offset = 0
    g.buffers = {"CPU_Mapped": w.nbytes, "kv": cache.nbytes, "compute": off}
    g.buffer_specs = {"CPU_Mapped": BufferSpec("weights", "CPU_Mapped", "weights"),
                      "kv": BufferSpec("cache", "CPU", "any"), "compute": BufferSpec("compute", "CPU", "compute")}
    g.alignment = 32
    g.meta = {"llama": {"commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f", "n_ctx": 256}}
    return g


def test_named_buffers_round_trip():
    g = llama_buffers_graph()
    ops.validate(g)
    d = serialize.to_dict(g)
    assert d["buffers"]["kv"] == {"size": 128, "role": "cache", "backend": "CPU", "usage": "any"}
    g2 = serialize.loads(serialize.dumps(g))
    assert_same_graph(g, g2)
    assert arena_buffer(g2) == "compute"
    assert [t.type for t in g2.leafs] == [DType.F16, DType.F32, DType.I64, DType.F16]
    store = g2.nodes[-1]
    assert store.op is Op.SET_ROWS and store.view_src is g2.leafs[3] and store.src[1].type is DType.I64
    assert [e["type"] for e in d["tensors"][:4]] == ["f16", "f32", "i64", "f16"]


def test_a_buffer_without_a_role_cannot_be_saved():
    g = llama_buffers_graph()
    del g.buffer_specs["kv"]
    with pytest.raises(GraphError, match=r"buffer 'kv' has no role \(give it one in graph.buffer_specs"):
        serialize.to_dict(g)


def test_a_buffer_a_tensor_names_must_be_listed():
    d = serialize.to_dict(llama_buffers_graph())
    del d["buffers"]["kv"]
    _bad(d, r"tensor 3 \('cache_k_l0'\): field 'buffer' is 'kv', expected null or one of CPU_Mapped, compute$")


# ---------------------------------------------------------------------------------------------------------------------
# malformed files
# ---------------------------------------------------------------------------------------------------------------------


def _bad(d_or_text, match: str) -> str:
    load = serialize.loads if isinstance(d_or_text, str) else serialize.from_dict
    with pytest.raises(GraphError, match=match) as err:
        load(d_or_text, source="graph.json")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("graph.json: ")
    return msg


@pytest.fixture
def d() -> dict:
    return serialize.to_dict(build_graph())


def tid(d: dict, name: str) -> int:
    return next(e["id"] for e in d["tensors"] if e["name"] == name)


def entry(d: dict, name: str) -> dict:
    return d["tensors"][tid(d, name)]


def ctx(d: dict, name: str) -> str:
    """The regex prefix an error about tensor ``name`` starts with."""
    return rf"graph\.json: tensor {tid(d, name)} \('{name}'\): "


CONV = "conv_input-0"


def test_not_json():
    _bad("{\"format\": ", r"graph\.json: not valid JSON: Expecting value")
    _bad('{"x": NaN}', "not valid JSON: NaN is not valid JSON")


def test_not_an_object():
    _bad("[1, 2]", "the top level must be a JSON object, not list")


def test_wrong_format(d):
    d["format"] = "ggml-graph"
    _bad(d, r"field 'format' is 'ggml-graph', expected 'gdnpass-graph'")
    del d["format"]
    _bad(d, r"field 'format' is None")


@pytest.mark.parametrize("version", [0, 3, "2", True])
def test_unsupported_version(d, version):
    d["version"] = version
    _bad(d, r"unsupported version .* \(this gdnpass reads versions 1, 2\)")


def test_missing_version(d):
    del d["version"]
    _bad(d, "missing field 'version'")


@pytest.mark.parametrize("key", ["meta", "alignment", "buffers", "tensors", "nodes", "leafs"])
def test_missing_top_level_field(d, key):
    del d[key]
    _bad(d, rf"graph\.json: missing field '{key}'$")


@pytest.mark.parametrize("key, value, what", [
    ("meta", [], "an object"), ("alignment", "32", "an int"), ("alignment", True, "an int"),
    ("buffers", [], "an object"), ("tensors", {}, "a list"), ("nodes", None, "a list"), ("leafs", 3, "a list"),
])
def test_top_level_field_of_wrong_type(d, key, value, what):
    d[key] = value
    _bad(d, rf"field '{key}' must be {what}")


def test_unknown_top_level_field(d):
    d["extra"] = 1
    _bad(d, "unknown field 'extra'")


def test_bad_alignment_and_buffers(d):
    d2 = copy.deepcopy(d)
    d2["alignment"] = -1
    _bad(d2, "field 'alignment' must be >= 0")
    for change, match in [
        (lambda b: b.update(vram=10), "buffer 'vram': must be an object, not int"),
        (lambda b: b["arena"].update(size=-5), "buffer 'arena': field 'size' must be null or a non-negative int"),
        (lambda b: b["arena"].update(size=True), "buffer 'arena': field 'size' must be null or a non-negative int"),
        (lambda b: b["arena"].pop("role"), "buffer 'arena': missing field 'role'"),
        (lambda b: b["arena"].pop("size"), "buffer 'arena': missing field 'size'"),
        (lambda b: b["arena"].update(role="arena"), "buffer 'arena': field 'role' is 'arena', expected one of "
                                                     "weights, cache, input, compute"),
        (lambda b: b["arena"].update(usage="WEIGHTS"), "buffer 'arena': field 'usage' is 'WEIGHTS', expected one "
                                                        "of any, weights, compute"),
        (lambda b: b["arena"].update(backend=0), "buffer 'arena': field 'backend' must be a string"),
        (lambda b: b["arena"].update(bytes=1), "buffer 'arena': unknown field 'bytes'"),
        (lambda b: b.update({"": {"size": 0, "role": "input"}}), "a buffer name must not be empty"),
    ]:
        d2 = copy.deepcopy(d)
        change(d2["buffers"])
        _bad(d2, rf"graph\.json: field 'buffers': {match}")


@pytest.mark.parametrize("field", serialize._TENSOR_FIELDS)
def test_tensor_missing_field(d, field):
    i = tid(d, CONV)
    del d["tensors"][i][field]
    name = r" \('conv_input-0'\)" if field != "name" else ""
    _bad(d, rf"graph\.json: tensor {i}{name}: missing field '{field}'$")


def test_tensor_unknown_field(d):
    entry(d, CONV)["dtype"] = "f32"
    _bad(d, ctx(d, CONV) + "unknown field 'dtype'")


def test_tensor_not_an_object(d):
    d["tensors"][3] = [1, 2]
    _bad(d, r"graph\.json: tensor 3: must be an object, not list")


# (field, bad value, message) for one entry, the concat node 'conv_input-0'
BAD_FIELDS = [
    ("id", 99, r"field 'id' is 99, expected \d+"),
    ("name", 7, "field 'name' must be a string"),
    ("type", "f64", r"field 'type': unknown type 'f64' \(expected one of f32, f16, bf16, i32, i64, q8_0, q4_k, q5_k, q6_k\)"),
    ("type", 1, "field 'type' must be a string"),
    ("op", "CONV_2D", "field 'op': unknown op 'CONV_2D'"),
    ("op", None, "field 'op' must be a string"),
    ("ne", [8, 6, 1], "field 'ne' must be a list of 4 non-negative ints"),
    ("ne", [8, -6, 1, 1], "field 'ne' must be a list of 4 non-negative ints"),
    ("ne", [8.0, 6, 1, 1], "field 'ne' must be a list of 4 non-negative ints"),
    ("ne", [True, 6, 1, 1], "field 'ne' must be a list of 4 non-negative ints"),
    ("ne", "8,6,1,1", "field 'ne' must be a list of 4 non-negative ints"),
    ("nb", [0, 32, 192, 192], "field 'nb' must be a list of 4 non-negative ints"),
    ("nb", [4, -32, 192, 192], "field 'nb' must be a list of 4 non-negative ints"),
    ("op_params", [], "field 'op_params' must be an object"),
    ("op_params", {"dim": "0"}, r"field 'op_params': 'dim' must be an int, got '0'"),
    ("src", 3, r"field 'src' must be a list of tensor ids"),
    ("src", [0, 999], r"field 'src': tensor 999 does not exist \(ids are 0\.\.\d+\)"),
    ("src", [0, -1], r"field 'src': tensor -1 does not exist"),
    ("src", [0, "1"], r"field 'src': '1' is not a tensor id"),
    ("view_src", 999, r"field 'view_src': tensor 999 does not exist"),
    ("view_offs", -4, "field 'view_offs' must be a non-negative int"),
    ("view_offs", 16, "field 'view_offs' is 16 but the tensor is not a view"),
    ("flags", -1, "field 'flags' must be an int made of the bits 0x17"),
    ("flags", 8, "field 'flags' must be an int made of the bits 0x17"),
    ("buffer", "vram", r"field 'buffer' is 'vram', expected null or one of cache, input, weights, arena"),
    ("buffer", "weights", r"field 'buffer': a computed tensor lives in a compute buffer, and 'weights' is a weights "
                          r"buffer"),
    ("offset", -64, "field 'offset' must be null or a non-negative int"),
    ("offset", "0", "field 'offset' must be null or a non-negative int"),
    ("layer", "0", "field 'layer' must be null or an int"),
]


@pytest.mark.parametrize("field, value, match", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v, _ in BAD_FIELDS])
def test_bad_tensor_field(d, field, value, match):
    i = tid(d, CONV)
    d["tensors"][i][field] = value
    name = r" \('conv_input-0'\)" if field != "name" else ""
    _bad(d, rf"graph\.json: tensor {i}{name}: {match}")


def test_bad_op_params_type_for_a_norm(d):
    entry(d, "q_norm-0")["op_params"]["eps"] = "tiny"
    _bad(d, ctx(d, "q_norm-0") + r"field 'op_params': 'eps' must be a finite number, got 'tiny'")


def test_view_src_must_be_a_base(d):
    # q_conv-0 views the silu output; point it at another view instead
    entry(d, "q_conv-0")["view_src"] = tid(d, "last_conv_states-0")
    _bad(d, ctx(d, "q_conv-0") + r"field 'view_src' must name a base tensor, but tensor \d+ "
                                 r"\('last_conv_states-0'\) is itself a view")


def test_view_past_its_base(d):
    entry(d, "last_conv_states-0")["view_offs"] = 100  # 172 bytes from 100 > 192
    _bad(d, ctx(d, "last_conv_states-0") + r"view bytes \[100, 272\) run past its base tensor \d+ "
                                           r"\('conv_input-0'\) \(192 bytes\)")


def test_view_with_its_own_memory(d):
    entry(d, "q_conv-0")["buffer"] = "arena"
    _bad(d, ctx(d, "q_conv-0") + "a view has no memory of its own")


def test_base_past_its_buffer(d):
    e = entry(d, CONV)
    e["offset"] = d["buffers"]["arena"]["size"] - 100
    _bad(d, ctx(d, CONV) + r"bytes \[\d+, \d+\) run past buffer 'arena' \(\d+ bytes\)")
    # without a size for the buffer there is nothing to check against
    d["buffers"]["arena"]["size"] = None
    e["offset"] = 10**9
    serialize.from_dict(d)


def test_base_past_a_leaf_buffer(d):
    d["buffers"]["weights"]["size"] -= 4
    _bad(d, ctx(d, "ssm_conv1d-0") + r"bytes \[192, 288\) run past buffer 'weights' \(284 bytes\)")


def test_offset_without_buffer(d):
    entry(d, CONV)["buffer"] = None
    _bad(d, ctx(d, CONV) + "field 'offset' is set but 'buffer' is null")


@pytest.mark.parametrize("key", ["nodes", "leafs"])
def test_id_list_with_unknown_id(d, key):
    d[key].append(len(d["tensors"]))
    _bad(d, rf"graph\.json: field '{key}': {len(d['tensors'])} is not a tensor id")
    d[key][-1] = "0"
    _bad(d, rf"graph\.json: field '{key}': '0' is not a tensor id")


def test_id_list_with_duplicates(d):
    d["nodes"].append(d["nodes"][0])
    _bad(d, rf"field 'nodes': tensor {d['nodes'][0]} \('.*'\) is listed twice")


def test_id_in_both_lists(d):
    d["nodes"].insert(0, d["leafs"][0])
    _bad(d, r"field 'nodes': tensor 0 \('.*'\) is listed twice")


def test_leaf_that_computes(d):
    i = tid(d, CONV)
    d["nodes"].remove(i)
    d["leafs"].append(i)
    _bad(d, rf"field 'leafs': tensor {i} \('conv_input-0'\) has op CONCAT; a leaf must have op NONE")


def test_node_with_op_none(d):
    i = d["leafs"].pop(0)
    d["nodes"].insert(0, i)
    _bad(d, rf"field 'nodes': tensor {i} \('.*'\) has op NONE; a node must compute something")


def test_cycle(d):
    # get_rows reads the silu output, which (through concat and ssm_conv) reads get_rows
    gr = next(e for e in d["tensors"] if e["op"] == "GET_ROWS")
    gr["src"][0] = tid(d, "conv_output_silu-0")
    _bad(d, r"graph\.json: tensor \d+ \('.*'\): is part of a cycle of src/view_src references \(\d+( -> \d+)+\)")


def test_self_cycle(d):
    e = entry(d, "conv_output_silu-0")
    e["src"] = [e["id"]]
    _bad(d, ctx(d, "conv_output_silu-0") + rf"is part of a cycle .*\({e['id']} -> {e['id']}\)")


def test_validate_catches_tampered_ne(d):
    e = entry(d, "conv_output_raw-0")
    e["ne"][1] -= 1  # smaller, so it still fits its arena slot: only the shape rule can catch it
    _bad(d, rf"graph\.json: tensor {e['id']}: node 'conv_output_raw-0' \(SSM_CONV\): ne \(6, 4, 1, 1\), "
            rf"expected \(6, 5, 1, 1\)$")


def test_validate_catches_tampered_view(d):
    e = entry(d, "q_conv-0")
    e["view_offs"] = 4  # still inside its base, but not where op_params' offset puts it
    _bad(d, rf"graph\.json: tensor {e['id']}: node 'q_conv-0' \(VIEW\): view_offs 4, expected 0")


def test_validate_catches_execution_order(d):
    nodes = d["nodes"]
    nodes.insert(0, nodes.pop())  # l2_norm first, before its source
    _bad(d, r"graph\.json: node 'q_norm-0': src 'q_conv-0' is not computed before it")


def test_load_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"format": "gdnpass-graph", "version": 7}')
    with pytest.raises(GraphError, match=r"broken\.json: unsupported version 7"):
        serialize.load(path)
    with pytest.raises(GraphError, match=r"missing\.json: cannot read"):
        serialize.load(tmp_path / "missing.json")
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(GraphError, match=r"broken\.json: not UTF-8 text"):
        serialize.load(path)


def test_rule_crash_becomes_one_line(d, monkeypatch):
    # a shape rule tripping over free-form op_params must still give a GraphError naming the node, not a traceback
    def boom(n):
        raise TypeError("float() argument must be a string or a real number, not 'list'")

    monkeypatch.setattr(serialize, "validate_node", boom)
    i = d["nodes"][0]
    _bad(d, rf"graph\.json: tensor {i}: node '.*' \(GET_ROWS\) cannot be checked: TypeError: float\(\) argument")


def test_a_fused_graph_of_quantized_products_round_trips(tmp_path):
    """A fused verify layer with Q4_K weights (its FFN down projection a quantized MUL_MAT_ADD, its gate/up a
    quantized pair) saves and loads back: every fused node's record accepts the block types the mat-vec reads."""
    from gdnpass import pipeline as pipe
    from gdnpass.models import VerifyConfig

    g = pipe.run(VerifyConfig("qwen3.5-9b", 4, 3, n_layers=1, wtype="q4_k"), pipe.PassOptions(fusion=True)).graph
    fused = {n.op for n in g.nodes if n.op.is_fused and n.src[0].type.is_quantized}
    assert {Op.MUL_MAT_ADD, Op.MUL_MAT_VEC_PAIR} <= fused
    path = tmp_path / "q4_k.json"
    serialize.save(g, path)
    back = serialize.load(path)
    assert [(n.name, n.op) for n in back.nodes] == [(n.name, n.op) for n in g.nodes]
