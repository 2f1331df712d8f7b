"""``gdnpass dump``: print a graph node by node, with its memory and what fusion did to it and why.

One command answers "did it fuse layer 7, and if not, which rule refused it and which bytes collided?"::

    gdnpass dump --fuse --explain --layer 7

The graph is built from the same flags as ``gdnpass run`` (or read from a JSON graph file) and goes through the same
pipeline (:mod:`gdnpass.pipeline`), then is shown as a ggml_graph_print-like table (``--format text``), Graphviz DOT
(``--format dot``, ``--render svg|png FILE``) or JSON (``--format json``, schema in docs/dump.md). ``--explain``
lists every fusion candidate, ``--diff`` the nodes fusion removed and added; ``--layer`` and ``--around`` focus
any of them.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from gdnpass import ir, prepasses
from gdnpass.fusion import Applied, FusionReport
from gdnpass.launches import nodes_launches
from gdnpass.ir import Graph, GraphError, Op, Tensor, byte_range, inputs, outputs, written
from gdnpass.patterns import RECORDS
from gdnpass.patterns.common import Refusal, fmt_range
from gdnpass.opspec import ROPE_MODES, SPECS
from gdnpass.outputs import atomic_path, check_writable, json_safe
from gdnpass.serialize import buffers_dict

SCHEMA = "gdnpass-dump"
SCHEMA_VERSION = 1
AROUND = 8              # --around shows this many nodes either side
DIFF_CONTEXT = 3        # unchanged nodes kept around each change in --diff, as diff -U3
RENDER_FORMATS = ("svg", "png")
DESCRIPTION = "Print a graph node by node, with its memory, what fusion did to it and why."


# ---------------------------------------------------------------------------------------------------------------------
# the pipeline
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Dump:
    graph: Graph            # as shown: fused when fusion is on
    before: list[Tensor]    # the node list fusion started from (prepared and planned)
    report: FusionReport
    source: str             # what the graph came from, for the title line


@dataclass
class Row:
    """One line of a node listing: ``sign`` is ' ' (a node), '-' (removed by fusion) or '+' (added by it)."""

    sign: str
    t: Tensor
    index: int              # position in the fused graph, or in the unfused one for '-'
    before: int | None = None  # position in the unfused graph (diff hunk headers)


# ---------------------------------------------------------------------------------------------------------------------
# facts about nodes
# ---------------------------------------------------------------------------------------------------------------------


def is_fused(t: Tensor) -> bool:
    return t.op.is_fused


def replaced(t: Tensor) -> list[str]:
    return list(t.op_params.get("replaced", [])) if is_fused(t) else []


op_label = ir.op_label  # as launches.launches labels it: UNARY(SILU), GLU(SWIGLU)


def _num(x: float) -> str:
    return f"{x:g}"


def _value(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, tuple) else _num(v) if isinstance(v, float) else str(v)


# ops whose parameters the listing says elsewhere: a view's offset and a transpose's axes in the memory columns, a
# UNARY's kind in its label
_SAID_ELSEWHERE = frozenset({Op.VIEW, Op.TRANSPOSE, Op.UNARY})


def params_text(t: Tensor) -> str:
    """A node's op params in a few words: what a reader checks first (RoPE's mode, sections and n_dims, the softmax
    and attention scales, the GLU form); fused nodes list what they replaced instead."""
    p, src = t.op_params, t.src

    def has(i: int) -> bool:  # an optional source (mask, sinks, freq factors) is set
        return len(src) > i and src[i] is not None

    words: list[str] = []
    if t.op is Op.ROPE:
        words += [ROPE_MODES.get(p["mode"], f"mode={p['mode']}"), f"n_dims={p['n_dims']}"]
        if any(p["sections"]):
            words.append("sections=" + ",".join(map(str, p["sections"])))
        words.append(f"base={_num(p['freq_base'])}")
        words += [f"{k}={_num(p[k])}" for k, default in (("freq_scale", 1.0), ("ext_factor", 0.0),
                                                         ("attn_factor", 1.0)) if p[k] != default]
        words += [f"n_offs={p['n_offs']}"] * bool(p["n_offs"]) + ["freq_factors"] * has(2)
    elif t.op in (Op.SOFT_MAX, Op.FLASH_ATTN_EXT):
        words.append(f"scale={_num(p['scale'])}")
        words += [f"max_bias={_num(p['max_bias'])}"] * bool(p["max_bias"])
        if t.op is Op.FLASH_ATTN_EXT:
            words += [f"softcap={_num(p['logit_softcap'])}"] * bool(p["logit_softcap"]) + [f"prec={p['prec']}"]
            words += [f"n_kv_max={p['n_kv_max']}"] * bool(p["n_kv_max"])
        mask, sinks = (1, 2) if t.op is Op.SOFT_MAX else (3, 4)
        words += ["mask"] * has(mask) + ["sinks"] * has(sinks)
    elif t.op is Op.GLU:
        words.append("split" if has(1) else "fused" + " swapped" * bool(p["swapped"]))
        words += [f"{k}={_num(p[k])}" for k in ("alpha", "limit") if k in p]
    elif t.op is Op.SET_ROWS:
        words.append(f"ids {src[1].type.label}")
    elif t.op is Op.SCALE:
        words += [f"s={_num(p['s'])}"] + [f"b={_num(p['b'])}"] * bool(p.get("b"))
    elif t.op is Op.OPAQUE:
        words.append(f"ggml {p['ggml_op']}")
    elif t.op in SPECS and t.op not in _SAID_ELSEWHERE:  # the rest: the spec's parameters the node carries
        words += [f"{k}={_value(p[k])}" for k in SPECS[t.op].types if k in p and k != "inplace"]
    return " ".join(words + ["inplace"] * bool(p.get("inplace") and t.op is not Op.OPAQUE))


def writers(nodes: list[Tensor]) -> dict[int, Tensor]:
    """uid of a tensor -> the node that writes it."""
    return {t.uid: n for n in nodes for t in written(n)}


def user_counts(nodes: list[Tensor]) -> dict[int, int]:
    """node uid -> how many distinct nodes read something it writes."""
    writer = writers(nodes)
    readers: dict[int, set[int]] = {}
    for n in nodes:
        for s in inputs(n):
            if s.uid in writer:
                readers.setdefault(writer[s.uid].uid, set()).add(n.uid)
    return {uid: len(r) for uid, r in readers.items()}


def count_launches(nodes: list[Tensor]) -> tuple[int, int]:
    """(kernel launches, how many fused nodes run a multi-launch variant: a GDN_CONV_CHAIN with l2_separate).

    Counted as ``gdnpass run`` counts them (:func:`gdnpass.launches.nodes_launches`: a quantized product's pre-pass
    included where it is not shared). A fused node's record counts its launches, and names the variant that costs
    more (``extra_launches``): an
    l2_separate chain writes its normalised q/k over the projection it reads, so it runs the fused kernel, then the
    unfused q/k norm kernels once every program has read the projection (3 launches in the L2 form, 5 in the RMS
    form)."""
    separate = sum(1 for n in nodes if _extra(n))
    return nodes_launches(nodes), separate


def _extra(t: Tensor | None) -> tuple[str, str] | None:
    """(flag, what the later launches run) of a fused node in its record's multi-launch variant, else None."""
    extra = RECORDS[t.op].extra_launches if t is not None and t.op.is_fused else None
    return extra if extra and t.op_params.get(extra[0]) else None


# ---------------------------------------------------------------------------------------------------------------------
# choosing what to show: --layer, --around, --diff
# ---------------------------------------------------------------------------------------------------------------------


def node_rows(d: Dump) -> list[Row]:
    return [Row(" ", t, i) for i, t in enumerate(d.graph.nodes)]


def diff_rows(d: Dump) -> list[Row]:
    """Unfused vs fused node lists, aligned on tensor identity: ' ' kept, '-' replaced, '+' fused in."""
    after = d.graph.nodes
    sm = difflib.SequenceMatcher(None, [t.uid for t in d.before], [t.uid for t in after], autojunk=False)
    rows: list[Row] = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            rows += [Row(" ", after[j], j, i) for i, j in zip(range(i1, i2), range(j1, j2))]
            continue
        rows += [Row("-", d.before[i], i, i) for i in range(i1, i2)]
        rows += [Row("+", after[j], j) for j in range(j1, j2)]
    return rows


def focus(rows: list[Row], d: Dump, layer: int | None, around: str | None) -> list[Row]:
    """Rows of ``layer``, then the AROUND rows either side of node ``around`` (an index or a name)."""
    if layer is not None:
        rows = [r for r in rows if r.t.layer == layer]
    if around is None:
        return rows
    try:
        target = d.graph.find(around) if around.isdigit() else None  # an index is one of the fused graph's nodes
    except GraphError as e:
        raise GraphError(f"--around: {e}") from None
    at = next((k for k, r in enumerate(rows) if (r.t is target if target is not None else r.t.name == around)), None)
    if at is None:
        raise GraphError(f"--around: {_why_absent(d, around, layer)}")
    return rows[max(0, at - AROUND): at + AROUND + 1]


def _why_absent(d: Dump, key: str, layer: int | None) -> str:
    if key.isdigit() or any(n.name == key for n in d.graph.nodes):
        return f"node {key!r} is not in layer {layer}"
    fused_into = next((n.name for n in d.graph.nodes if key in replaced(n)), None)
    if fused_into:
        return f"node {key!r} was fused into {fused_into!r} (--diff shows it)"
    return f"no node named {key!r} in the graph"


def check_layer(d: Dump, layer: int | None) -> None:
    known = {t.layer for t in d.before + d.graph.nodes if t.layer is not None}
    if layer is not None and layer not in known:
        built = ", ".join(str(k) for k in sorted(known) if k >= 0)
        raise GraphError(f"--layer {layer}: no node of that layer in the graph (layers: {built}; -1: graph-wide)")


# ---------------------------------------------------------------------------------------------------------------------
# candidates (applied and refused), for --explain and JSON
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Candidate:
    pattern: str
    layer: int | None
    node: Tensor | None         # the fused node, or the node a refusal names
    applied: Applied | None = None
    refusal: Refusal | None = None


def candidates(d: Dump, layer: int | None, shown: list[Row] | None) -> list[Candidate]:
    """Every decision fusion made, by layer (graph-wide last), optionally only those whose node is ``shown``."""
    by_name = {n.name: n for n in d.graph.nodes}
    out = [Candidate(a.pattern, a.layer, by_name.get(a.node), applied=a) for a in d.report.applied]
    out += [Candidate(r.pattern, r.layer, r.node, refusal=r) for r in d.report.refused]
    if layer is not None:
        out = [c for c in out if c.layer == layer]
    if shown is not None:
        uids = {r.t.uid for r in shown}
        out = [c for c in out if c.node is not None and c.node.uid in uids]
    return sorted(out, key=lambda c: _layer_key(c.layer))  # stable: pattern order kept inside a layer


def _layer_key(layer: int | None) -> tuple[bool, int]:
    return (layer is None or layer < 0, layer if layer is not None else 0)


def _layer_title(layer: int | None) -> str:
    return "graph-wide" if layer is None or layer < 0 else f"layer {layer}"


# ---------------------------------------------------------------------------------------------------------------------
# text
# ---------------------------------------------------------------------------------------------------------------------


def _cells(r: Row, users: dict[int, int]) -> list[str]:
    t = r.t
    view = f"view of {t.view_src.name} +{t.view_offs:#x}" if t.view_src is not None else ""
    ne = "[" + ", ".join(map(str, t.ne)) + "]"
    try:
        where = fmt_range(byte_range(t))
    except GraphError:  # a captured tensor llama.cpp gave no memory (an empty one)
        where = "no memory"
    where += " (empty)" * t.is_empty  # zero-size: launches nothing, but keeps its place in the graph
    return [r.sign + ("*" if is_fused(t) else " "), str(r.index), op_label(t), t.name, t.type.label, ne, where,
            str(users.get(t.uid, 0)), view, params_text(t)]


HEADER = ["", "#", "op", "name", "type", "ne", "bytes [lo, hi)", "users", "view", "params"]


def format_rows(rows: list[Row], users: dict[int, int], headings: dict[int, str] | None = None,
                show_replaced: bool = True) -> list[str]:
    """An aligned table. ``headings``: lines to put before some rows (diff hunks). With ``show_replaced`` each fused
    node is followed by the names of the nodes it replaced."""
    table = [HEADER] + [_cells(r, users) for r in rows]
    widths = [max(len(c[k]) for c in table) for k in range(len(HEADER))]
    right = {1, 7}  # numbers align right

    def line(cells: list[str]) -> str:
        padded = (c.rjust(w) if k in right else c.ljust(w) for k, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    out = [line(HEADER)]
    for k, (r, cells) in enumerate(zip(rows, table[1:])):
        if headings and k in headings:
            out.append(headings[k])
        out.append(line(cells))
        names = replaced(r.t)
        if show_replaced and names:
            k, more = RECORDS[r.t.op].launches(r.t), _extra(r.t)
            extra = f", {k} launches: fused kernel + {k - 1} {more[1]}" if more else ""
            out.append(f"{'':{widths[0] + widths[1] + 4}}^ replaces {len(names)} nodes{extra}: {', '.join(names)}")
    return out


def format_diff(rows: list[Row], users: dict[int, int]) -> list[str]:
    """Changed rows with DIFF_CONTEXT unchanged rows around them, under unified-diff hunk headers (node indices)."""
    changed = [k for k, r in enumerate(rows) if r.sign != " "]
    if not changed:
        return ["no differences: fusion changed no node" + (" here" if rows else "")]
    keep = sorted({j for k in changed for j in range(k - DIFF_CONTEXT, k + DIFF_CONTEXT + 1) if 0 <= j < len(rows)})
    starts = [p for p, k in enumerate(keep) if p == 0 or k != keep[p - 1] + 1]
    headings = {}
    for start, stop in zip(starts, starts[1:] + [len(keep)]):
        hunk = [rows[k] for k in keep[start:stop]]
        old = [r.before for r in hunk if r.sign != "+"]
        new = [r.index for r in hunk if r.sign != "-"]
        headings[start] = f"@@ -{old[0] if old else 0},{len(old)} +{new[0] if new else 0},{len(new)} @@"
    return format_rows([rows[k] for k in keep], users, headings, show_replaced=False)


def format_explain(cands: list[Candidate], d: Dump) -> list[str]:
    if not d.report.enabled:
        return ["fusion off: no candidates examined (use --fuse or GDN_FUSION=1)"]
    if not cands:
        return ["no fusion candidates here"]
    pos = d.graph.positions()

    def where(t: Tensor) -> str:
        return f"node {pos[t.uid]} {t.name!r}" if t.uid in pos else repr(t.name)

    out, current = [], object()
    for c in cands:
        if c.layer != current:
            current = c.layer
            out.append(f"{_layer_title(c.layer)}:")
        if c.applied is not None:  # (a Refusal is falsy: test identity, not truth)
            a = c.applied
            node = where(c.node) if c.node is not None else repr(a.node)
            out.append(f"  applied  {c.pattern}: {node}{_variant(c.node)} replaces {len(a.replaced)} nodes: "
                       f"{_some(a.replaced)}")
        else:
            r = c.refusal
            out.append(f"  REFUSED  {c.pattern}: rule {r.rule} at {where(r.node)}: {r.reason}")
            if r.ranges:
                out.append(f"           bytes collide: {fmt_range(r.ranges[0])} vs {fmt_range(r.ranges[1])}")
    return out


def _variant(t: Tensor | None) -> str:
    """The kernel variant of a fused node worth a reader's eye, as its record says (the chain's q/k form, its
    later-launch fallback)."""
    return RECORDS[t.op].variant(t) if t is not None and t.op.is_fused else ""


def _some(names: list[str], limit: int = 4) -> str:
    """The first few names (the node listing shows them all)."""
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def format_buffers(g: Graph) -> str:
    """The buffers by name, with their size and role (and backend) where the name does not say it."""
    parts = []
    for name, b in buffers_dict(g).items():
        size = "unplanned" if b["size"] is None else f"{b['size'] / (1 << 20):.2f} MiB"
        about = [x for x in (b["role"], b.get("backend")) if x is not None and x != name]
        parts.append(f"{name} {size}" + (f" ({', '.join(about)})" if about else ""))
    return "buffers: " + (", ".join(parts) if parts else "none")


def format_summary(d: Dump) -> list[str]:
    n_before, n_after = len(d.before), len(d.graph.nodes)
    (l_before, _), (l_after, _) = count_launches(d.before), count_launches(d.graph.nodes)
    multi: dict[tuple, list[int]] = {}
    for n in d.graph.nodes:
        if _extra(n):
            multi.setdefault((n.op.value, *_extra(n)), []).append(RECORDS[n.op].launches(n))
    note = "".join(f" (incl. {len(ks)} {op} with {flag}: {'/'.join(map(str, sorted(set(ks))))} launches each, the "
                   f"fused kernel then the {what} kernels)" for (op, flag, what), ks in multi.items())
    lines = [f"nodes {n_before} -> {n_after}, leafs {len(d.graph.leafs)}",
             f"launches {l_before} -> {l_after}{note}", format_buffers(d.graph)]
    pre = prepasses.plan(d.graph)
    if pre.pre_passes or pre.shared:  # (the quantized products' activations: gdnpass.prepasses)
        lines += [f"quantized products: {pre.summary()}", *(f"  {r.describe()}" for r in pre.refused)]
    if not d.report.enabled:
        return lines + ["fusion off (--fuse, or GDN_FUSION=1, turns it on)"]
    counts = d.report.counts()
    if not counts:
        return lines + ["fusion on: no candidates"]
    for pattern, c in counts.items():
        rules = {k: v for k, v in c.items() if k != "applied"}
        refused = (f", refused {sum(rules.values())} (" + ", ".join(f"{k} {v}" for k, v in rules.items()) + ")"
                   if rules else "")
        lines.append(f"fusion {pattern}: applied {c['applied']}{refused}")
    return lines


# ---------------------------------------------------------------------------------------------------------------------
# DOT
# ---------------------------------------------------------------------------------------------------------------------


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def format_dot(rows: list[Row], d: Dump) -> str:
    """One cluster per layer; fused nodes filled; leafs as ellipses; sources outside the focus dotted."""
    writer = writers(d.graph.nodes)
    shown = {r.t.uid for r in rows}
    # ids from positions, not uids: the same graph gives the same DOT text
    ident = {t.uid: f"l{i}" for i, t in enumerate(d.graph.leafs)}
    ident |= {t.uid: f"n{i}" for i, t in enumerate(d.graph.nodes)}
    decl: dict[int, tuple[int | None, str]] = {}  # uid -> (layer, node statement), in first-seen order
    edges: dict[str, None] = {}                   # ordered set

    def ref(t: Tensor) -> str:
        return ident.get(t.uid, f"t{t.uid}")

    def declare(t: Tensor, label: str, attrs: str = "", layer: int | None = None) -> None:
        decl[t.uid] = (layer, f"{ref(t)} [label={_q(label)}{', ' + attrs if attrs else ''}];")

    for r in rows:
        t = r.t
        label = f"{r.index}: {t.name}\n{op_label(t)} {t.type.label} {list(t.ne)}"
        if is_fused(t):
            declare(t, f"{label}\nreplaces {len(replaced(t))} nodes", "style=filled, fillcolor=gold", t.layer)
        else:
            declare(t, label, "style=dashed" if t.is_view else "", t.layer)
        for s in inputs(t):
            src = writer.get(s.uid, s)
            if src.uid not in decl and src.uid not in shown:
                if src.is_leaf:
                    declare(src, f"{src.name}\n{src.type.label} {list(src.ne)}", "shape=ellipse", src.layer)
                else:
                    declare(src, src.name, "style=dotted", src.layer)
            edges[f"  {ref(src)} -> {ref(t)};"] = None

    by_layer: dict[int | None, list[str]] = {}
    for layer, stmt in decl.values():
        by_layer.setdefault(layer if layer is not None and layer >= 0 else None, []).append(stmt)
    out = ["digraph gdnpass {", '  node [shape=box, fontname="monospace", fontsize=10];']
    for layer in sorted(by_layer, key=_layer_key):
        if layer is None:
            out += [f"  {s}" for s in by_layer[layer]]
            continue
        out += [f"  subgraph cluster_L{layer} {{", f"    label={_q(_layer_title(layer))}; style=rounded;"]
        out += [f"    {s}" for s in by_layer[layer]] + ["  }"]
    return "\n".join(out + list(edges) + ["}"]) + "\n"


def render(dot_text: str, fmt: str, path: str) -> None:
    if fmt not in RENDER_FORMATS:
        raise GraphError(f"--render: format {fmt!r} is not one of {', '.join(RENDER_FORMATS)}")
    dot = shutil.which("dot")
    if dot is None:
        raise GraphError("--render needs Graphviz's 'dot' program, which is not installed "
                         "(install graphviz, or use --format dot and render elsewhere)")
    check_writable(path, "--render")
    with atomic_path(path) as tmp:  # (dot writes a temporary file, renamed over FILE only when it succeeded)
        res = subprocess.run([dot, f"-T{fmt}", "-o", str(tmp)], input=dot_text, text=True, capture_output=True)
        if res.returncode != 0:
            first = (res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[0]
            raise GraphError(f"--render: dot failed: {first}")


# ---------------------------------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------------------------------


def _range_json(r) -> dict:
    return {"buffer": r[0], "lo": r[1], "hi": r[2]}


def node_json(r: Row, users: dict[int, int]) -> dict:
    t = r.t
    buffer, lo, hi = byte_range(t)
    return {"index": r.index, "name": t.name, "op": t.op.value,
            "unary": t.op_params.get("kind") if t.op is Op.UNARY else None,
            "glu": t.op_params.get("kind") if t.op is Op.GLU else None,
            "type": t.type.label, "ne": list(t.ne), "nb": list(t.nb),
            "src": [s.name for s in inputs(t)], "writes": [o.name for o in outputs(t)[1:]],
            "view_src": t.view_src.name if t.view_src is not None else None, "view_offs": t.view_offs,
            "buffer": buffer, "offset": lo, "size": hi - lo, "layer": t.layer, "users": users.get(t.uid, 0),
            "fused": is_fused(t), "replaced": replaced(t)}


def applied_json(a: Applied) -> dict:
    return {"pattern": a.pattern, "layer": a.layer, "node": a.node, "anchor": a.anchor, "replaced": a.replaced}


def refused_json(r: Refusal) -> dict:
    return {"pattern": r.pattern, "layer": r.layer, "node": r.node.name, "rule": r.rule, "reason": r.reason,
            "ranges": [_range_json(x) for x in r.ranges] if r.ranges else None}


def to_json(d: Dump, rows: list[Row], cands: list[Candidate], layer: int | None, around: str | None) -> dict:
    users = user_counts(d.graph.nodes)
    (l_before, _), (l_after, separate) = count_launches(d.before), count_launches(d.graph.nodes)
    rep = d.report
    return {
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "source": d.source,
        "graph": {"meta": d.graph.meta, "buffers": d.graph.buffers, "alignment": d.graph.alignment},
        "focus": {"layer": layer, "around": around},
        "summary": {"nodes_before": len(d.before), "nodes_after": len(d.graph.nodes), "leafs": len(d.graph.leafs),
                    "launches_before": l_before, "launches_after": l_after, "l2_separate": separate},
        "nodes": [node_json(r, users) for r in rows],
        "fusion": {
            "enabled": rep.enabled,
            "between": rep.between,
            "applied": [applied_json(c.applied) for c in cands if c.applied is not None],
            "refused": [refused_json(c.refusal) for c in cands if c.refusal is not None],
        },
    }


def json_text(x, depth: int = 0) -> str:
    """JSON with one node / one candidate per line: greppable, and short enough to read. Always valid JSON: a
    non-finite number (an infinite value in a graph's meta) is written as a string (:func:`gdnpass.outputs.json_safe`)."""
    if depth == 0:
        x = json_safe(x)
    pad, end = "  " * (depth + 1), "  " * depth
    if depth < 2 and isinstance(x, dict) and x:
        items = (f"{pad}{json.dumps(k)}: {json_text(v, depth + 1)}" for k, v in x.items())
        return "{\n" + ",\n".join(items) + f"\n{end}}}"
    if isinstance(x, list) and x and all(isinstance(i, dict) for i in x):
        return "[\n" + ",\n".join(pad + json.dumps(i, allow_nan=False) for i in x) + f"\n{end}]"
    return json.dumps(x, allow_nan=False)


# ---------------------------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------------------------


def cmd_dump(a: argparse.Namespace, planned) -> int:
    """``gdnpass dump`` on the pipeline's result ``planned`` (:class:`gdnpass.pipeline.Planned`); ``a`` holds the
    view flags (``cli`` parses them)."""
    d = Dump(planned.graph, planned.before, planned.report, planned.source)
    check_layer(d, a.layer)
    rows = focus(diff_rows(d) if a.diff else node_rows(d), d, a.layer, a.around)
    if a.render:
        fmt, path = a.render
        render(format_dot(rows, d), fmt, path)
        emit(f"wrote {path} ({fmt}, {len(rows)} nodes)\n")
    elif a.format == "dot":
        emit(format_dot(rows, d))
    elif a.format == "json":
        cands = candidates(d, a.layer, rows if a.around is not None else None)
        emit(json_text(to_json(d, rows, cands, a.layer, a.around)) + "\n")
    else:
        emit("\n".join(format_text(a, d, rows)) + "\n")
    return 0


def format_text(a: argparse.Namespace, d: Dump, rows: list[Row]) -> list[str]:
    """Title, then the listing, the diff or the candidates, then the summary."""
    users = {**user_counts(d.before), **user_counts(d.graph.nodes)}  # removed nodes keep their unfused count
    if a.explain:
        body = format_explain(candidates(d, a.layer, rows if a.around is not None else None), d)
    elif a.diff:
        body = format_diff(rows, users)
    else:
        body = format_rows(rows, users)
    focus_note = "".join([f", layer {a.layer}" if a.layer is not None else "",
                          f", around {a.around!r}" if a.around is not None else ""])
    title = f"gdnpass dump: {d.source}, fusion {'on' if d.report.enabled else 'off'}{focus_note}"
    return [title] + body + [""] + format_summary(d)


def emit(text: str) -> None:
    """Write to stdout; a reader that stops early (| head) is not an error."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush stays quiet
