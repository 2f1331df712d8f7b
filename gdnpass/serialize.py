"""A versioned JSON file format for a :class:`~gdnpass.ir.Graph` (as built, planned or fused).

Schema, version 2 (docs/graph-format.md)::

    {
      "format": "gdnpass-graph",
      "version": 2,
      "meta": {...},                    # Graph.meta, verbatim (JSON values; tuples become lists)
      "alignment": 0,                   # Graph.alignment (0: not planned)
      "buffers": {                      # every buffer a tensor names, and every buffer of the plan
        "arena": {"size": 123456, "role": "compute"},        # size: Graph.buffers[name], null before planning
        "kv": {"size": 4096, "role": "cache", "backend": "CPU", "usage": "any"}   # role etc.: Graph.buffer_specs
      },
      "tensors": [                      # every tensor: leafs, then nodes, then any other referenced tensor
        {"id": 0, "name": "...", "type": "f32", "ne": [4 ints], "nb": [4 ints], "op": "NONE",
         "op_params": {...}, "src": [ids or null], "view_src": id or null, "view_offs": 0,
         "flags": 0, "buffer": "weights" or null, "offset": 0 or null, "layer": 0 or null},
        ...
      ],
      "nodes": [ids in execution order],
      "leafs": [ids]
    }

Version 1 files still load: their ``buffers`` is ``{name: size}`` over gdnpass's own four buffers (weights, cache,
input, arena), whose roles are implied by their names (:data:`gdnpass.ir.DEFAULT_BUFFERS`).

A fused node stores ``src`` as its inputs followed by ``Tensor.outs`` (the other tensors it writes), with
``op_params["n_inputs"]`` saying where the inputs end.

A tensor's ``id`` is its index in ``tensors``; all references (``src``, ``view_src``, ``nodes``, ``leafs``) are ids, so
a tensor used by several nodes is stored once and loaded as one object. Names need not be unique. ``uid`` is not
stored: loading gives fresh uids.

Loading checks everything a later pass would trip over and raises :class:`~gdnpass.ir.GraphError` with a single line
naming the file and the tensor or field at fault; it ends with :meth:`Graph.check_order` (and, for a planned graph, :func:`gdnpass.alloc.check_plan`).
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any, Callable, NoReturn

import networkx as nx

from gdnpass.alloc import check_plan
from gdnpass.ir import (BUFFER_ROLES, BUFFER_USAGES, DEFAULT_BUFFERS, GGML_MAX_DIMS, BufferSpec, DType, Flag, Graph,
                        GraphError, Op, Tensor, arena_buffer, buffer_spec)
from gdnpass.models.hparams import check_meta
from gdnpass.ops import validate_node
from gdnpass.opspec import INT4, SPECS
from gdnpass.outputs import write_atomic

FORMAT = "gdnpass-graph"
VERSION = 2          # what save writes
VERSIONS = (1, 2)    # what load reads

# top-level field -> (python type, how to say it)
_TOP: dict[str, tuple[type, str]] = {
    "format": (str, "a string"),
    "version": (int, "an int"),
    "meta": (dict, "an object"),
    "alignment": (int, "an int"),
    "buffers": (dict, "an object"),
    "tensors": (list, "a list"),
    "nodes": (list, "a list"),
    "leafs": (list, "a list"),
}

_TENSOR_FIELDS = ("id", "name", "type", "ne", "nb", "op", "op_params", "src", "view_src", "view_offs", "flags",
                  "buffer", "offset", "layer")
_BUFFER_FIELDS = ("size", "role", "backend", "usage")  # size and role required

_ALL_FLAGS = 0
for _f in Flag:
    _ALL_FLAGS |= int(_f)

PathLike = str | os.PathLike


# ---------------------------------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------------------------------


def _ordered(graph: Graph) -> list[Tensor]:
    """Leafs, nodes, then tensors reachable from them through src/view_src but in neither list (found in order)."""
    order: list[Tensor] = []
    seen: set[int] = set()  # id(): identity is the object, not the name (and not uid, which a caller could copy)

    def add(t: Tensor | None) -> None:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            order.append(t)

    for t in graph.leafs:
        add(t)
    for t in graph.nodes:
        add(t)
    i = 0
    while i < len(order):  # order grows while we walk it: this pulls in outside tensors transitively
        t = order[i]
        for s in [*t.src, *t.outs]:
            add(s)
        add(t.view_src)
        i += 1
    return order


def _jsonable(x: Any, where: str) -> Any:
    """A JSON-ready copy of ``x``: tuples become lists; anything JSON cannot hold is a GraphError."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        if not math.isfinite(x):
            raise GraphError(f"{where}: {x} is not a finite number (JSON cannot hold it)")
        return float(x)
    if isinstance(x, (list, tuple)):
        return [_jsonable(v, where) for v in x]
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if not isinstance(k, str):
                raise GraphError(f"{where}: key {k!r} is not a string")
            out[k] = _jsonable(v, f"{where}.{k}")
        return out
    raise GraphError(f"{where}: a {type(x).__name__} cannot be stored as JSON")


def buffers_dict(graph: Graph, tensors: list[Tensor] | None = None) -> dict:
    """Version 2's ``buffers``: every buffer of the plan, of ``graph.buffer_specs`` and named by a tensor (of
    ``tensors``, default the graph's), with its size (null before planning) and spec."""
    names = dict.fromkeys([*graph.buffers, *graph.buffer_specs,
                           *(t.buffer for t in (tensors if tensors is not None else _ordered(graph)) if t.buffer)])
    out = {}
    for name in names:
        spec = buffer_spec(graph, name)
        size = graph.buffers.get(name)
        entry = {"size": None if size is None else int(size), "role": spec.role}
        entry |= {k: v for k, v in (("backend", spec.backend), ("usage", spec.usage)) if v is not None}
        out[name] = entry
    return out


def to_dict(graph: Graph) -> dict:
    """The graph as a JSON-ready dict (see the module docstring for the schema)."""
    order = _ordered(graph)
    ids = {id(t): i for i, t in enumerate(order)}

    def ref(t: Tensor | None) -> int | None:
        return None if t is None else ids[id(t)]

    tensors = []
    for i, t in enumerate(order):
        params = {**t.op_params, "n_inputs": len(t.src)} if t.outs or t.op.is_fused else t.op_params
        params = _params_to_json(t.op, params)
        tensors.append({
            "id": i,
            "name": t.name,
            "type": t.type.label,
            "ne": [int(x) for x in t.ne],
            "nb": [int(x) for x in t.nb],
            "op": t.op.value,
            "op_params": _jsonable(params, f"tensor {i} ({t.name!r}): op_params"),
            "src": [ref(s) for s in [*t.src, *t.outs]],
            "view_src": ref(t.view_src),
            "view_offs": int(t.view_offs),
            "flags": int(t.flags),
            "buffer": t.buffer,
            "offset": None if t.offset is None else int(t.offset),
            "layer": None if t.layer is None else int(t.layer),
        })
    return {
        "format": FORMAT,
        "version": VERSION,
        "meta": _jsonable(graph.meta, "meta"),
        "alignment": int(graph.alignment),
        "buffers": buffers_dict(graph, order),
        "tensors": tensors,
        "nodes": [ref(t) for t in graph.nodes],
        "leafs": [ref(t) for t in graph.leafs],
    }


def dumps(graph: Graph) -> str:
    """The graph as JSON text, one tensor per line (so files diff and grep well)."""
    d = to_dict(graph)
    parts = []
    for key, value in d.items():
        if key == "tensors":
            body = ",\n".join("  " + json.dumps(t, allow_nan=False) for t in value)
            parts.append(f'"tensors": [\n{body}\n]')
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(value, allow_nan=False)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def save(graph: Graph, path: PathLike) -> None:
    """Write ``graph`` to ``path``: the JSON text is made first (a graph JSON cannot hold is a GraphError before the
    file is touched), then written under a temporary name and renamed into place (:func:`gdnpass.outputs.
    write_atomic`), so an existing file is replaced whole or not at all."""
    write_atomic(path, dumps(graph))


# ---------------------------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------------------------


def _fail(where: str, msg: str) -> NoReturn:
    # one line, always: names and values are repr()'d, but be safe against messages from elsewhere
    raise GraphError(f"{where}: {msg}".replace("\n", "\\n"))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is not 1


def _int_list(x: Any, n: int, ok: Callable[[int], bool]) -> bool:
    return isinstance(x, list) and len(x) == n and all(_is_int(v) and ok(v) for v in x)


def _params_to_json(op: Op, params: dict) -> dict:
    """op_params with each value its spec type writes differently in JSON (a BOUND's ±inf) in that form."""
    types = _param_types(op)
    return {k: (types[k].to_json(v) if k in types and types[k].to_json is not None else v) for k, v in params.items()}


def _param_types(op: Op) -> dict:
    """The op_params keys whose type the shape rules rely on (a wrong type would crash int()/float() inside ops): a
    base op's spec's. Keys not listed are free-form; a fused node's record checks its own (ops.validate_node)."""
    spec = SPECS.get(op)
    if spec is None and op.is_fused:  # a fused node's: its record's (MOE_ROUTER's CLAMP bounds may be ±inf)
        from gdnpass.patterns import record_of

        return record_of(op).params
    return {} if spec is None else spec.types


def _parse_buffers(d: dict, source: str) -> tuple[dict[str, int], dict[str, BufferSpec], dict[str, str]]:
    """(sizes, specs that differ from gdnpass's defaults, role of every buffer) of the top-level ``buffers``."""
    if d["version"] == 1:  # {name: size} over gdnpass's own buffers
        for name, size in d["buffers"].items():
            if name not in DEFAULT_BUFFERS:
                _fail(source, f"field 'buffers': unknown buffer {name!r} (version 1 knows "
                              f"{', '.join(DEFAULT_BUFFERS)})")
            if not (_is_int(size) and size >= 0):
                _fail(source, f"field 'buffers': size of {name!r} must be a non-negative int, got {size!r}")
        return dict(d["buffers"]), {}, {name: spec.role for name, spec in DEFAULT_BUFFERS.items()}
    sizes: dict[str, int] = {}
    specs: dict[str, BufferSpec] = {}
    roles: dict[str, str] = {}
    for name, e in d["buffers"].items():
        where = f"{source}: field 'buffers': buffer {name!r}"
        if not name:
            _fail(source, "field 'buffers': a buffer name must not be empty")
        if not isinstance(e, dict):
            _fail(where, f"must be an object, not {type(e).__name__}")
        for key in ("size", "role"):
            if key not in e:
                _fail(where, f"missing field {key!r}")
        for key in e:
            if key not in _BUFFER_FIELDS:
                _fail(where, f"unknown field {key!r}")
        if e["size"] is not None and not (_is_int(e["size"]) and e["size"] >= 0):
            _fail(where, f"field 'size' must be null or a non-negative int, got {e['size']!r}")
        if e["role"] not in BUFFER_ROLES:
            _fail(where, f"field 'role' is {e['role']!r}, expected one of {', '.join(BUFFER_ROLES)}")
        if "backend" in e and not isinstance(e["backend"], str):
            _fail(where, f"field 'backend' must be a string, got {e['backend']!r}")
        if "usage" in e and e["usage"] not in BUFFER_USAGES:
            _fail(where, f"field 'usage' is {e['usage']!r}, expected one of {', '.join(BUFFER_USAGES)}")
        spec = BufferSpec(e["role"], e.get("backend"), e.get("usage"))
        if spec != DEFAULT_BUFFERS.get(name):
            specs[name] = spec
        if e["size"] is not None:
            sizes[name] = e["size"]
        roles[name] = spec.role
    return sizes, specs, roles


def _parse_tensor(e: dict, i: int, where: str, roles: dict[str, str]) -> Tensor:
    """Every field of one entry except the references (src, view_src), which need all tensors first."""
    if e["id"] != i or not _is_int(e["id"]):
        _fail(where, f"field 'id' is {e['id']!r}, expected {i} (its index in 'tensors')")
    if not isinstance(e["name"], str):
        _fail(where, "field 'name' must be a string")
    if not isinstance(e["type"], str):
        _fail(where, "field 'type' must be a string")
    try:
        type_ = DType.parse(e["type"])
    except GraphError as err:
        _fail(where, f"field 'type': {err}")
    if not _int_list(e["ne"], GGML_MAX_DIMS, lambda v: v >= 0):
        _fail(where, "field 'ne' must be a list of 4 non-negative ints")
    # ggml allows overlapping strides in views and zero strides in empty tensors, never negative ones
    if not _int_list(e["nb"], GGML_MAX_DIMS, lambda v: v >= 0) or e["nb"][0] == 0:
        _fail(where, "field 'nb' must be a list of 4 non-negative ints with nb[0] > 0")
    if not isinstance(e["op"], str):
        _fail(where, "field 'op' must be a string")
    try:
        op = Op(e["op"])
    except ValueError:
        _fail(where, f"field 'op': unknown op {e['op']!r}")
    params = e["op_params"]
    if not isinstance(params, dict):
        _fail(where, "field 'op_params' must be an object")
    _check_depth(params, f"{where}: field 'op_params'")
    types = _param_types(op)
    params = copy.deepcopy(params)  # the Graph must not alias the caller's dict
    for key, p in types.items():
        if key in params and p.from_json is not None:
            params[key] = p.from_json(params[key])  # a BOUND's "Infinity" / "-Infinity"
        if key in params and not p.ok(params[key]):
            _fail(where, f"field 'op_params': {key!r} must be {p.what}, got {e['op_params'][key]!r}")
    for key, p in types.items():
        if p is INT4 and key in params:
            params[key] = tuple(params[key])  # JSON only has lists; ops builds these as tuples
    if not (_is_int(e["view_offs"]) and e["view_offs"] >= 0):
        _fail(where, "field 'view_offs' must be a non-negative int")
    if not (_is_int(e["flags"]) and e["flags"] >= 0 and e["flags"] & ~_ALL_FLAGS == 0):
        _fail(where, f"field 'flags' must be an int made of the bits {_ALL_FLAGS:#x}, got {e['flags']!r}")
    if e["buffer"] is not None and (not isinstance(e["buffer"], str) or e["buffer"] not in roles):
        _fail(where, f"field 'buffer' is {e['buffer']!r}, expected null or one of {', '.join(roles)}")
    if e["offset"] is not None and not (_is_int(e["offset"]) and e["offset"] >= 0):
        _fail(where, f"field 'offset' must be null or a non-negative int, got {e['offset']!r}")
    if e["layer"] is not None and not _is_int(e["layer"]):
        _fail(where, "field 'layer' must be null or an int")
    return Tensor(name=e["name"], type=type_, ne=tuple(e["ne"]), nb=tuple(e["nb"]), op=op, op_params=params,
                  view_offs=e["view_offs"], flags=Flag(e["flags"]), buffer=e["buffer"], offset=e["offset"],
                  layer=e["layer"])


MAX_DEPTH = 64  # free-form values (meta, op_params) nest at most this deep: copying or writing them again recurses


def _check_depth(x: Any, where: str) -> None:
    """A free-form JSON value nesting deeper than MAX_DEPTH is refused (walked without recursion)."""
    stack = [(x, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            _fail(where, f"nests deeper than {MAX_DEPTH} levels")
        if isinstance(v, dict):
            stack += ((c, depth + 1) for c in v.values())
        elif isinstance(v, list):
            stack += ((c, depth + 1) for c in v)


def _ref(x: Any, n: int, where: str, field: str) -> int:
    if not _is_int(x):
        _fail(where, f"field {field!r}: {x!r} is not a tensor id")
    if not 0 <= x < n:
        _fail(where, f"field {field!r}: tensor {x} does not exist (ids are 0..{n - 1})")
    return x


def _label(i: int, t: Tensor) -> str:
    return f"tensor {i} ({t.name!r})"


def _check_memory(tensors: list[Tensor], index: dict[int, int], buffers: dict[str, int], roles: dict[str, str],
                  source: str) -> None:
    """Views point at bases and stay inside them; base tensors stay inside their buffers, computed ones in a compute
    buffer (what gallocr plans)."""
    for i, t in enumerate(tensors):
        where = f"{source}: {_label(i, t)}"
        base = t.view_src
        if base is not None:
            if base.view_src is not None:
                _fail(where, f"field 'view_src' must name a base tensor, but {_label(index[id(base)], base)} "
                             f"is itself a view")
            if t.buffer is not None or t.offset is not None:
                _fail(where, "a view has no memory of its own: fields 'buffer' and 'offset' must be null")
            end = t.view_offs + t.nbytes
            if not t.is_empty and end > base.nbytes:
                _fail(where, f"view bytes [{t.view_offs}, {end}) run past its base "
                             f"{_label(index[id(base)], base)} ({base.nbytes} bytes)")
            continue
        if t.view_offs != 0:
            _fail(where, f"field 'view_offs' is {t.view_offs} but the tensor is not a view")
        if t.offset is not None and t.buffer is None:
            _fail(where, "field 'offset' is set but 'buffer' is null")
        if t.buffer is not None and t.op is not Op.NONE and roles[t.buffer] != "compute":
            _fail(where, f"field 'buffer': a computed tensor lives in a compute buffer, and {t.buffer!r} is a "
                         f"{roles[t.buffer]} buffer")
        if t.offset is not None and t.buffer in buffers and t.offset + t.nbytes > buffers[t.buffer]:
            _fail(where, f"bytes [{t.offset}, {t.offset + t.nbytes}) run past buffer {t.buffer!r} "
                         f"({buffers[t.buffer]} bytes)")


def _id_list(d: dict, key: str, tensors: list[Tensor], seen: set[int], source: str) -> list[Tensor]:
    out = []
    for x in d[key]:
        if not _is_int(x) or not 0 <= x < len(tensors):
            _fail(source, f"field {key!r}: {x!r} is not a tensor id (ids are 0..{len(tensors) - 1})")
        if x in seen:
            _fail(source, f"field {key!r}: {_label(x, tensors[x])} is listed twice in 'nodes'/'leafs'")
        seen.add(x)
        t = tensors[x]
        if key == "leafs" and t.op is not Op.NONE:
            _fail(source, f"field 'leafs': {_label(x, t)} has op {t.op.value}; a leaf must have op NONE")
        if key == "nodes" and t.op is Op.NONE and not t.op_params.get("hint"):
            _fail(source, f"field 'nodes': {_label(x, t)} has op NONE; a node must compute something")
        out.append(t)
    return out


def _check_acyclic(tensors: list[Tensor], index: dict[int, int], source: str) -> None:
    g = nx.DiGraph()
    g.add_nodes_from(range(len(tensors)))
    for i, t in enumerate(tensors):
        for s in [*t.src, *t.outs, t.view_src]:
            if s is not None:
                g.add_edge(index[id(s)], i)
    if not nx.is_directed_acyclic_graph(g):
        cycle = [u for u, _ in nx.find_cycle(g)]
        path = " -> ".join(str(u) for u in cycle + cycle[:1])
        _fail(source, f"{_label(cycle[0], tensors[cycle[0]])}: is part of a cycle of src/view_src references "
                      f"({path})")


def from_dict(d: Any, source: str = "<dict>") -> Graph:
    """Build and validate a Graph from :func:`to_dict`'s format. ``source`` prefixes error messages (a file name)."""
    # ---- top level: format first, so a foreign JSON file gets the clearest message
    if not isinstance(d, dict):
        _fail(source, f"the top level must be a JSON object, not {type(d).__name__}")
    if d.get("schema") == "gdnpass-dump":  # gdnpass.dump.SCHEMA (not imported: dump builds on fusion)
        _fail(source, "this is the output of 'gdnpass dump --format json' (a report), not a graph file; write a graph "
                      "file with --save FILE (gdnpass run/dump ... --save FILE) and pass that to --graph")
    if d.get("format") != FORMAT:
        _fail(source, f"field 'format' is {d.get('format')!r}, expected {FORMAT!r} (not a gdnpass graph file?)")
    if "version" not in d:
        _fail(source, "missing field 'version'")
    if not _is_int(d["version"]) or d["version"] not in VERSIONS:
        _fail(source, f"unsupported version {d['version']!r} (this gdnpass reads versions "
                      f"{', '.join(map(str, VERSIONS))})")
    for key, (typ, what) in _TOP.items():
        if key not in d:
            _fail(source, f"missing field {key!r}")
        if not isinstance(d[key], typ) or (typ is int and isinstance(d[key], bool)):
            _fail(source, f"field {key!r} must be {what}, not {type(d[key]).__name__}")
    for key in d:
        if key not in _TOP:
            _fail(source, f"unknown field {key!r}")
    if d["alignment"] < 0:
        _fail(source, f"field 'alignment' must be >= 0, got {d['alignment']}")
    _check_depth(d["meta"], f"{source}: field 'meta'")
    try:
        check_meta(d["meta"])  # free-form, but for what execution reads
    except GraphError as err:
        _fail(source, f"field 'meta': {err}")
    buffers, specs, roles = _parse_buffers(d, source)

    # ---- tensors: fields first, then references (an entry may refer to a later one)
    entries = d["tensors"]
    tensors: list[Tensor] = []
    for i, e in enumerate(entries):
        where = f"{source}: tensor {i}"
        if not isinstance(e, dict):
            _fail(where, f"must be an object, not {type(e).__name__}")
        if isinstance(e.get("name"), str):
            where += f" ({e['name']!r})"
        for key in _TENSOR_FIELDS:
            if key not in e:
                _fail(where, f"missing field {key!r}")
        for key in e:
            if key not in _TENSOR_FIELDS:
                _fail(where, f"unknown field {key!r}")
        tensors.append(_parse_tensor(e, i, where, roles))
    index = {id(t): i for i, t in enumerate(tensors)}
    n = len(tensors)
    for i, (e, t) in enumerate(zip(entries, tensors)):
        where = f"{source}: {_label(i, t)}"
        if not isinstance(e["src"], list):
            _fail(where, "field 'src' must be a list of tensor ids (or null for an empty slot)")
        src = [None if x is None else tensors[_ref(x, n, where, "src")] for x in e["src"]]
        if "n_inputs" in t.op_params:  # a fused node: its inputs, then the other tensors it writes
            k = t.op_params.pop("n_inputs")
            if not (_is_int(k) and 0 <= k <= len(src)) or any(s is None for s in src[k:]):
                _fail(where, f"field 'op_params': 'n_inputs' must be an int in 0..{len(src)} (the sources before "
                             f"the written tensors), got {k!r}")
            src, t.outs = src[:k], src[k:]
        elif t.op.is_fused:
            _fail(where, "field 'op_params' lacks 'n_inputs' (a fused node's count of input sources)")
        t.src = src
        if e["view_src"] is not None:
            t.view_src = tensors[_ref(e["view_src"], n, where, "view_src")]

    _check_memory(tensors, index, buffers, roles, source)
    seen: set[int] = set()
    leafs = _id_list(d, "leafs", tensors, seen, source)
    nodes = _id_list(d, "nodes", tensors, seen, source)
    _check_acyclic(tensors, index, source)

    graph = Graph()
    graph.meta = copy.deepcopy(d["meta"])
    graph.alignment = d["alignment"]
    graph.buffers = buffers
    graph.buffer_specs = specs
    graph.leafs = leafs
    graph.nodes = nodes
    graph._visited = {t.uid for t in graph.tensors()}  # a later expand() must not add them again

    # ---- shape rules, per node so the message carries the tensor id (names may repeat)
    for t in nodes:
        where = f"{source}: tensor {index[id(t)]}"
        try:
            validate_node(t)
        except GraphError as err:
            _fail(where, str(err))
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            # op_params of a shape no rule expects (the typed keys above are checked; others are free-form)
            _fail(where, f"node {t.name!r} ({t.op.value}) cannot be checked: {type(err).__name__}: {err}")
    try:
        graph.check_order()  # execution order (src computed before use) and acyclicity
        if arena_buffer(graph) is not None:
            check_plan(graph)  # no two live tensors on the same bytes: fusion is decided on the plan
    except GraphError as err:
        _fail(source, str(err))
    return graph


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def loads(text: str | bytes, source: str = "<string>") -> Graph:
    try:
        d = json.loads(text, parse_constant=_reject_constant)  # NaN / Infinity are not JSON
    except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        _fail(source, f"not valid JSON: {err}")
    return from_dict(d, source)


def load(path: PathLike) -> Graph:
    source = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        _fail(source, f"cannot read: {err.strerror or err}")
    except UnicodeDecodeError as err:
        _fail(source, f"not UTF-8 text: {err}")
    return loads(text, source)
