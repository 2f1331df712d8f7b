"""Search tools for tests/patterns/test_soundness.py: random perturbations of planned verify graphs, a tally of what the
fusion pass decided on them, and random mutations of graph files.

A :class:`Sample` is plain data (config, moves, OUTPUT flags, inserted nodes, ids, seed). :func:`build` turns it
into the same planned graph every time, so one sample can be checked several ways (narrow, broad, forced) on fresh
graphs. :func:`samples` draws one with hypothesis, deciding each step on the graph built so far.
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from dataclasses import dataclass, field, replace

from hypothesis import strategies as st

from gdnpass import fusion, models, ops
from gdnpass.alloc import plan
from gdnpass.check import CheckResult, check_fusion
from gdnpass.ir import DType, Flag, Graph, Op, Tensor, byte_range, inputs, outputs, ranges_overlap, runs_kernel
from gdnpass.patterns import REGISTRY, by_name
from gdnpass.patterns.common import Refusal, Rule
from gdnpass.patterns.mat_vec_pair import MatVecPair
from gdnpass.models import VerifyConfig, build_verify_graph, default_ids

PRESETS = ["tiny-dc3-h32", "tiny-dc4-h64", "tiny-dc5-h128", "tiny-dc4-h32"]
MEM_SIZE = 2
LAYOUTS = getattr(models, "SNAPSHOT_LAYOUTS", ("rows",))  # conv snapshot layouts, where the builder has them
BLOCKS = ("ssm_rs", "conv_extra", "rs_zero", "qkv", "beta", "z")  # node runs a valid reorder may move
HAZARD_RULES = ("alias.", "between.", "pair.alias")  # the rules fuse(force=True) skips; the others are structural
INTERMEDIATES = ("conv_states-0", "conv_input-0", "conv_output_raw-0")  # GET_ROWS, CONCAT, SSM_CONV: never written
                                                                          # by the fused node


# ---------------------------------------------------------------------------------------------------------------------
# samples
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Insert:
    """Nodes put right after node ``after`` (an index into the planned graph as earlier inserts left it).

    kind: ``exp`` (an EXP whose *output* lies on the target bytes: a write), ``scale`` (SCALE by 2 in place: a read
    and a write that keeps the values visible), ``read`` (CONT of the target bytes into fresh arena, compared like a
    layer output), ``ids`` (a CPY writing row id ``value`` into one id). ``via_view``: reach the bytes through a VIEW
    node of the real tensor (an edge, so a new user of it; only while it is live), else through a raw alias tensor
    over the same bytes that no node knows about.
    """

    after: int
    kind: str
    region: str    # a key of regions()
    rel: int       # byte offset inside the region
    nbytes: int
    via_view: bool = False
    value: int = 0


@dataclass(frozen=True)
class Sample:
    model: str
    n_t: int
    n_rs: int
    kv_head: int = 0
    n_rs_extra: int = 0
    rs_z: int = -1
    ffn: bool = True
    ab_wtype: str = "f32"
    snapshot_layout: str = "rows"
    moves: tuple = ()       # (block, position), before planning
    outputs: tuple = ()     # node indices flagged OUTPUT, before planning
    reorder: bool = True    # fusion.prepare before planning
    inserts: tuple = ()     # Insert, after planning
    ids: tuple = ()
    seed: int = 0

    @property
    def cfg(self) -> VerifyConfig:
        layout = {} if self.snapshot_layout == "rows" else {"snapshot_layout": self.snapshot_layout}
        return VerifyConfig(self.model, self.n_t, self.n_rs, n_layers=1, mem_size=MEM_SIZE, kv_head=self.kv_head,
                            n_rs_extra=self.n_rs_extra, rs_z=self.rs_z, ffn=self.ffn, ab_wtype=self.ab_wtype,
                            **layout)


def named(g: Graph) -> dict[str, Tensor]:
    return {t.name: t for t in [*g.leafs, *g.nodes]}


def block_nodes(g: Graph, block: str) -> list[Tensor]:
    """The nodes of a block (names of the 1-layer builder)."""
    n, nodes = named(g), g.nodes
    if block == "ssm_rs":  # build_rs of the ssm state: zeroing, gather, extra rows
        cpy = next(c for c in nodes
                   if c.op is Op.CPY and c.src[1].base is n["cache_s_l0"] and c.src[0].op is Op.GET_ROWS)
        return nodes[g.index(n["cache_s_l0 (reshaped)"]): g.index(cpy) + 1]
    if block == "conv_extra":  # the conv cache's extra-row gather and copy
        gr = next(t for t in nodes if t.op is Op.GET_ROWS and t.src[1] is n["rs_s_copy_extra"])
        return nodes[g.index(gr): g.index(next(c for c in nodes if c.op is Op.CPY and c.src[0] is gr)) + 1]
    if block == "rs_zero":  # the conv cache's zeroing SCALE and its view
        sc = next(t for t in nodes if t.op is Op.SCALE and t.view_src is n["cache_r_l0"])
        return [sc.src[0], sc]
    weight = {"qkv": "blk.0.attn_qkv.weight", "beta": "blk.0.ssm_beta.weight", "z": "blk.0.attn_gate.weight"}[block]
    return [t for t in nodes if t.op is Op.MUL_MAT and t.src[0].name == weight]


def order_ok(nodes: list[Tensor], leafs: list[Tensor]) -> bool:
    """Every node's inputs (and view base) exist before it runs: what Graph.validate checks about the order."""
    ready = {t.uid for t in leafs}
    for n in nodes:
        if any(s.uid not in ready for s in inputs(n)) or (n.view_src is not None and n.view_src.uid not in ready):
            return False
        ready.add(n.uid)
    return True


def _without(g: Graph, block: str) -> tuple[list[Tensor], list[Tensor]]:
    moved = block_nodes(g, block)
    return moved, [t for t in g.nodes if all(t is not m for m in moved)]


def move_positions(g: Graph, block: str) -> list[int]:
    """Where the block may go (indices into the node list without it) so that the order stays valid."""
    moved, rest = _without(g, block)
    return [p for p in range(len(rest) + 1) if order_ok(rest[:p] + moved + rest[p:], g.leafs)]


def apply_move(g: Graph, block: str, pos: int) -> None:
    moved, rest = _without(g, block)
    g.nodes = rest[:pos] + moved + rest[pos:]


def planned(s: Sample) -> Graph:
    """The sample's graph before the inserts: built, moved, flagged, maybe reordered for fusion, planned."""
    g = build_verify_graph(s.cfg)
    for block, pos in s.moves:
        apply_move(g, block, pos)
    for i in s.outputs:
        if g.nodes[i].view_src is None:  # flags on views would mean nothing to the planner
            g.nodes[i].flags |= Flag.OUTPUT
    if s.reorder:
        fusion.prepare(g, enabled=True)
    plan(g)
    return g


@dataclass(frozen=True)
class Region:
    tensor: Tensor  # the base tensor that owns the bytes (what a VIEW node would view)
    lo: int         # absolute byte range in tensor.buffer
    hi: int


def regions(g: Graph) -> dict[str, Region]:
    """The byte ranges an inserted node may touch: cache rows, chain and pair tensors, weights, ids, the arena."""
    n = named(g)
    out: dict[str, Region] = {}

    def add(name: str, t: Tensor) -> None:
        t = t.base
        if t.offset is not None and t.nbytes:
            out[name] = Region(t, t.offset, t.offset + t.nbytes)

    for c in g.leafs:
        if c.buffer == "cache":
            for r in range(c.ne[1]):
                out[f"{c.name}[{r}]"] = Region(c, c.offset + r * c.nb[1], c.offset + (r + 1) * c.nb[1])
    for name, key in [("projection", "linear_attn_qkv_mixed-0"), ("get_rows", "conv_states-0"),
                      ("concat", "conv_input-0"), ("ssm_conv", "conv_output_raw-0"), ("silu", "conv_output_silu-0"),
                      ("q_l2", "q_conv_predelta-0"), ("k_l2", "k_conv_predelta-0"), ("x", "attn_norm-0"),
                      ("ids", "rs_s_copy"), ("w_conv", "blk.0.ssm_conv1d.weight"), ("w_qkv", "blk.0.attn_qkv.weight"),
                      ("w_alpha", "blk.0.ssm_alpha.weight"), ("w_beta", "blk.0.ssm_beta.weight")]:
        if key in n:
            add(name, n[key])
    for a, b in MatVecPair().candidates(g):  # both products of every mat-vec pair candidate
        add(f"mm:{a.src[0].name}", a)
        add(f"mm:{b.src[0].name}", b)
    out["arena"] = Region(raw("arena", 0, g.buffers["arena"]), 0, g.buffers["arena"])
    return out


def region_group(name: str) -> str:
    """cache_r_l0[3] -> cache_r_l0, mm:<weight> -> mm, w_conv -> w; chain tensors, ids and arena stand alone."""
    if "[" in name:
        return name.split("[")[0]
    return "mm" if name.startswith("mm:") else "w" if name.startswith("w_") else name


def raw(buffer: str, lo: int, nbytes: int, type_: DType = DType.F32) -> Tensor:
    """A tensor over bytes [lo, lo+nbytes) of ``buffer`` that no node of the graph knows about."""
    t = ops.new_tensor(f"raw@{buffer}+{lo:#x}", type_, (nbytes // type_.size,), buffer=buffer)
    t.offset = lo
    return t


def live_at(g: Graph, t: Tensor, after: int) -> bool:
    """Whether ``t`` holds its value right after node ``after`` in the plan (leafs always do)."""
    if all(t is not n for n in g.nodes):
        return True
    readers = [i for i, n in enumerate(g.nodes) if any(s is not None and s.base is t for s in n.src)]
    last = len(g.nodes) if t.flags & Flag.OUTPUT else max(readers, default=-1)
    return g.index(t) <= after < last


def apply_insert(g: Graph, ins: Insert, k: int, regs: dict[str, Region]) -> None:
    reg = regs[ins.region]
    base, lo, nb = reg.tensor, reg.lo + ins.rel, ins.nbytes
    want_type = DType.I32 if ins.kind == "ids" else DType.F32

    def target() -> tuple[Tensor, list[Tensor]]:
        # an edge only to a tensor that is live there: an edge past its death would read garbage (and move
        # check_fusion's probe of it past its death too)
        if (ins.via_view and (base.type is want_type or ins.kind == "read") and base in g.tensors()
                and live_at(g, base, ins.after)):
            v = ops.view_1d(base, nb // base.type.size, lo - base.offset)
            return v, [v]
        return raw(base.buffer, lo, nb, want_type), []

    def fresh(t: Tensor) -> Tensor:  # an output nobody else touches: past the end of the arena
        t.buffer, t.offset = "arena", g.buffers["arena"]
        g.buffers["arena"] += -(-t.nbytes // 128) * 128
        return t

    if ins.kind == "exp":  # values from the weights buffer, written onto the target bytes
        node = ops.exp(raw("weights", 0, nb))
        node.buffer, node.offset = base.buffer, lo
        new = [node]
    elif ins.kind == "scale":
        t, new = target()
        new.append(ops.scale(t, 2.0, inplace=True))
    elif ins.kind == "read":
        t, new = target()
        new.append(fresh(ops.cont(t)))
    elif ins.kind == "ids":  # a valid row id, so that GET_ROWS stays in range
        value = fresh(ops.scale(raw("weights", 0, 4), 0.0, float(ins.value)))  # attn_norm weights are finite
        t, new = target()
        new = [value, *new, ops.cpy(value, t)]
    else:
        raise ValueError(ins.kind)
    for i, t in enumerate(new):
        # check.watched compares every tensor named l_out*: so a read's value is part of the comparison
        t.name = f"l_out-read{k}" if ins.kind == "read" and i == len(new) - 1 else f"inserted-{ins.kind}{k}.{i}"
        t.flags |= Flag.COMPUTE
        g.nodes.insert(ins.after + 1 + i, t)


def build(s: Sample) -> Graph:
    g = planned(s)
    regs = regions(g)
    for k, ins in enumerate(s.inserts):
        apply_insert(g, ins, k, regs)
    g.meta["leaks"] = unwatch_intermediate_reads(g)
    return g


# ---------------------------------------------------------------------------------------------------------------------
# drawing samples
# ---------------------------------------------------------------------------------------------------------------------


def gaps(g: Graph) -> list[tuple[int, int]]:
    """(first, last): ranges of node indices to insert after. The chain's covers one position before the GET_ROWS
    and one after the last L2_NORM (outside the span, as controls); a pair's lies strictly between A and B."""
    n = named(g)
    out = []
    if all(k in n for k in ("conv_states-0", "q_conv_predelta-0", "k_conv_predelta-0")):
        out.append((g.index(n["conv_states-0"]) - 1,
                    max(g.index(n["q_conv_predelta-0"]), g.index(n["k_conv_predelta-0"]))))
    for a, b in MatVecPair().candidates(g):
        if g.index(b) > g.index(a):
            out.append((g.index(a), g.index(b) - 1))
    return out


@st.composite
def samples(draw, max_inserts: int = 3) -> Sample:
    model = draw(st.sampled_from(PRESETS))
    n_t, n_rs = draw(st.integers(1, 16)), draw(st.integers(0, 15))
    n_rs_extra = draw(st.integers(0, 1))
    kv_head = 0 if n_rs_extra else draw(st.integers(0, 1))
    s = Sample(model, n_t, n_rs, kv_head, n_rs_extra, draw(st.sampled_from([-1, 0, 1])), draw(st.booleans()),
               draw(st.sampled_from(["f32", "f16", "bf16"])), draw(st.sampled_from(LAYOUTS)))

    # the memory plan: move a block to another valid place, flag nodes OUTPUT, reorder for fusion or not
    g = build_verify_graph(s.cfg)
    moves = []
    if draw(st.booleans()):
        block = draw(st.sampled_from(BLOCKS))
        pos = draw(st.sampled_from(move_positions(g, block)))
        apply_move(g, block, pos)
        moves.append((block, pos))
    outputs_ = draw(st.lists(st.integers(0, len(g.nodes) - 1), max_size=2))
    s = replace(s, moves=tuple(moves), outputs=tuple(outputs_), reorder=draw(st.booleans()))

    # ids: the read row among the written rows (own cell, plane 0) or not; sometimes any valid row
    cfg = s.cfg
    rows = cfg.cells * (1 + n_rs)
    if draw(st.integers(0, 4)) == 0:
        ids = draw(st.lists(st.integers(0, rows - 1), min_size=1 + n_rs_extra, max_size=1 + n_rs_extra))
    else:
        cells = [None] + list(range(cfg.cells - n_rs_extra))
        ids = default_ids(cfg, read_plane=draw(st.integers(0, n_rs)), src_cell=draw(st.sampled_from(cells)))

    # inserted nodes, each placed on the graph as the earlier ones left it
    g = planned(s)
    regs = regions(g)
    inserts = []
    for k in range(draw(st.integers(1, max_inserts))):
        first, last = draw(st.sampled_from(gaps(g)))
        after = draw(st.integers(first, last))
        group = draw(st.sampled_from(sorted({region_group(r) for r in regs})))  # cache rows must not crowd out the rest
        name = draw(st.sampled_from(sorted(r for r in regs if region_group(r) == group)))
        size = regs[name].hi - regs[name].lo
        if name == "ids":  # f32 writes would make row ids out of range: only reads and valid ids
            kind = draw(st.sampled_from(["ids", "read"]))
            rel, nb = 4 * draw(st.integers(0, size // 4 - 1)), 4
        else:
            kind = draw(st.sampled_from(["exp", "scale", "read"]))
            if draw(st.booleans()):
                rel, nb = 0, size  # the whole region
            else:
                rel = 4 * draw(st.integers(0, size // 4 - 1))
                nb = 4 * draw(st.integers(1, min(1024, (size - rel) // 4)))
            nb = min(nb, g.buffers["weights"] // 4 * 4)  # an EXP's values come from the weights buffer
        ins = Insert(after, kind, name, rel, nb, draw(st.booleans()), draw(st.integers(0, rows - 1)))
        apply_insert(g, ins, k, regs)
        inserts.append(ins)
    return replace(s, inserts=tuple(inserts), ids=tuple(ids), seed=draw(st.integers(0, 2**16)))


# ---------------------------------------------------------------------------------------------------------------------
# what lies outside the property: plans gallocr never makes, and a reported bug of the broad check
# ---------------------------------------------------------------------------------------------------------------------


def node_reads(n: Tensor) -> list:
    """(byte range, tensor) of what ``n`` reads (ir.inputs), skipping empty tensors."""
    return [(byte_range(t), t) for t in inputs(n) if not t.is_empty]


def node_writes(n: Tensor) -> list:
    """(byte range, tensor) of what ``n`` writes (ir.outputs), skipping empty tensors."""
    return [(byte_range(t), t) for t in outputs(n) if not t.is_empty]


def is_inserted(n: Tensor) -> bool:
    return n.name.startswith(("inserted-", "l_out-read"))


def _subtract(spans: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    out = []
    for a, b in spans:
        out += [(x, y) for x, y in ((a, min(b, lo)), (max(a, hi), b)) if x < y]
    return out


def unwatch_intermediate_reads(g: Graph) -> list[str]:
    """Track which arena bytes hold values of the chain's intermediates, which the fused node never writes: written
    by one of them, kept by inserted in-place SCALEs (element-wise), cleared by any other write. An inserted read of
    such bytes reads a live tensor without an edge, or garbage once it died; neither happens in a graph gallocr
    planned, so its value is not compared (renamed out of check.watched's l_out*). Returns the original nodes that
    read such bytes other than through an edge (none expected)."""
    inter = {t.uid for t in g.nodes if t.name in INTERMEDIATES and t.view_src is None}
    tainted: list[tuple[int, int]] = []
    leaks = []
    for n in g.nodes:
        if not runs_kernel(n):
            continue
        hit = any(buf == "arena" and any(a < hi and lo < b for a, b in tainted)
                  for (buf, lo, hi), t in node_reads(n) if is_inserted(n) or t.base.uid not in inter)
        if hit and n.name.startswith("l_out-read"):
            n.name = n.name.replace("l_out-read", "inserted-read") + ".unwatched"
        elif hit and not is_inserted(n):
            leaks.append(n.name)
        for (buf, lo, hi), _ in node_writes(n):
            if buf != "arena" or (is_inserted(n) and n.op is Op.SCALE):
                continue
            tainted = _subtract(tainted, lo, hi) + ([(lo, hi)] if n.uid in inter else [])
    return leaks


def writes_live_intermediate(g: Graph) -> list[str]:
    """Inserted nodes that write bytes of a chain intermediate while it is live, without an edge to it (gallocr
    never gives a live tensor's bytes to another). The narrow check does not look for this: the known gap of
    docs/soundness.md; the broad check refuses it."""
    hits = []
    for t in g.nodes:
        if t.name not in INTERMEDIATES or t.view_src is not None or t.is_empty:
            continue
        first = g.index(t)
        last = max([i for i, x in enumerate(g.nodes) if runs_kernel(x) and any(s.base is t for s in inputs(x))],
                   default=first)
        for m in g.nodes[first + 1: last]:
            if is_inserted(m) and any(x.base is not t and ranges_overlap(r, byte_range(t)) for r, x in node_writes(m)):
                hits.append(f"{m.name!r} writes live {t.name!r}")
    return hits


def touches_window_rows(g: Graph) -> list[str]:
    """Inserted nodes in the chain's span that touch a snapshot destination outside the gathered cache (the dedup
    layouts' cache_w): the broad check does not count those as chain buffers (a reported bug)."""
    n = named(g)
    if not all(k in n for k in ("conv_states-0", "conv_input-0", "q_conv_predelta-0", "k_conv_predelta-0")):
        return []
    cache, concat = n["conv_states-0"].src[0].base, n["conv_input-0"]
    dsts = [byte_range(c.src[1]) for c in g.nodes
            if c.op is Op.CPY and c.src[0].view_src is concat and c.src[1].base is not cache and not c.is_empty]
    first = g.index(n["conv_states-0"])
    last = max(g.index(n["q_conv_predelta-0"]), g.index(n["k_conv_predelta-0"]))
    return [m.name for m in g.nodes[first: last + 1] if is_inserted(m) and runs_kernel(m)
            and any(ranges_overlap(r, d) for r, _ in node_reads(m) + node_writes(m) for d in dsts)]


def plan_conflicts(g: Graph) -> list[str]:
    """Pairs of tensors that own overlapping bytes while both are live: a plan gallocr never makes (leafs are live
    throughout, a node from its position to its last reader or, if OUTPUT, to the end; an in-place successor only
    touches its parent's range). serialize.from_dict does not look for these."""
    pos = g.positions()
    end = len(g.nodes)
    last: dict[int, int] = {}
    for i, n in enumerate(g.nodes):
        for x in n.src:
            if x is not None:
                last[x.base.uid] = i
    owners = []
    for t in [*g.leafs, *g.nodes]:
        if t.view_src is not None or t.buffer is None or t.offset is None or t.is_empty:
            continue
        if t.uid not in pos:
            first, stop = -1, end
        else:
            first = pos[t.uid]
            stop = end if t.flags & Flag.OUTPUT else max(first, last.get(t.uid, first))
        owners.append((t, first, stop, byte_range(t)))
    out = []
    for i, (a, fa, sa, ra) in enumerate(owners):
        for b, fb, sb, rb in owners[i + 1:]:
            if ranges_overlap(ra, rb) and fa < sb and fb < sa:
                out.append(f"{a.name!r} and {b.name!r} share bytes while both are live")
    return out


# ---------------------------------------------------------------------------------------------------------------------
# running the pass on a sample
# ---------------------------------------------------------------------------------------------------------------------


def key(pattern: str, candidate) -> str:
    parts = candidate if isinstance(candidate, tuple) else (candidate,)
    return pattern + ":" + " + ".join(t.name for t in parts)


def pattern_of(k: str) -> str:
    return k.split(":", 1)[0]


class Tracked:
    """A matcher wrapper: records its first decision per candidate (the first rule that refused it, or True when
    it was planned); ``only`` limits it to one candidate. Everything else is the wrapped pattern's."""

    def __init__(self, pattern, only: str | None = None) -> None:
        self.pattern, self.only, self.name = pattern, only, pattern.name
        self.decisions: dict = {}
        self._key = ""

    def __getattr__(self, name):
        return getattr(self.pattern, name)  # prepare, removed, rewrite

    def candidates(self, graph: Graph) -> list:
        return [c for c in self.pattern.candidates(graph) if self.only in (None, key(self.name, c))]

    def capture(self, graph: Graph, candidate, ctx):
        self._key = key(self.name, candidate)
        return self.pattern.capture(graph, candidate, ctx)

    def rules(self, ctx) -> tuple:
        return tuple(Rule(r.name, r.kind, self._recording(r), r.names) for r in self.pattern.rules(ctx))

    def _recording(self, r: Rule):
        def check(c, ctx):
            why = r.check(c, ctx)
            if why is not None:
                self.decisions.setdefault(self._key, Refusal(self.name, why.rule or r.name, why.node, why.reason,
                                                             c.layer, why.ranges))
            return why

        return check

    def plan(self, c, ctx):
        self.decisions.setdefault(self._key, True)
        return self.pattern.plan(c, ctx)


def tracked(only: str | None = None) -> list[Tracked]:
    """Fresh instances of the pass's patterns (fusion.PATTERNS), in its order."""
    return [Tracked(type(p)(), only) for p in fusion.PATTERNS if only is None or pattern_of(only) == p.name]


@dataclass
class Run:
    result: CheckResult
    decisions: dict  # candidate key -> True (accepted) or the Refusal

    @property
    def accepted(self) -> set[str]:
        return {k for k, d in self.decisions.items() if d}

    @property
    def refused(self) -> dict:
        return {k: d for k, d in self.decisions.items() if not d}

    def diff(self) -> list[dict]:
        return [c.to_json() for c in self.result.compared if not c.identical]


def run(s: Sample, between: str = "narrow", force: bool = False, only: str | None = None) -> Run:
    """check_fusion on a fresh build of ``s`` (``only``: just that one candidate). A candidate of a pattern that
    takes other patterns' fused nodes (``Pattern.needs``) is one of the graph as the pass hands it to that pattern:
    the patterns before it applied first (unforced; check_fusion then compares their fused nodes' outputs too)."""
    g, pats = build(s), tracked(only)
    if only is not None and by_name(pattern_of(only)).needs:
        names = [p.name for p in REGISTRY]
        before = [p.matcher() for p in REGISTRY[:names.index(pattern_of(only))]]
        fusion.fuse(g, enabled=True, between=between, patterns=before)
    res = check_fusion(g, ids=list(s.ids), seed=s.seed, between=between, force=force, patterns=pats)
    return Run(res, {k: d for p in pats for k, d in p.decisions.items()})


def decide(s: Sample, between: str) -> dict:
    """The pass's decisions, without executing anything."""
    pats = tracked()
    fusion.fuse(build(s), enabled=True, between=between, patterns=pats)
    return {k: d for p in pats for k, d in p.decisions.items()}


@dataclass
class Stats:
    """What the search saw, per candidate (a candidate is one chain or one pair of one sample)."""

    samples: int = 0
    candidates: Counter = field(default_factory=Counter)       # pattern -> candidates seen
    accepted: Counter = field(default_factory=Counter)         # pattern -> narrow accepted
    broad_accepted: Counter = field(default_factory=Counter)   # pattern -> broad accepted
    narrow_only: Counter = field(default_factory=Counter)      # pattern -> narrow accepted, broad refused
    refused: Counter = field(default_factory=Counter)          # (pattern, rule) -> narrow refusals
    necessary: Counter = field(default_factory=Counter)        # (pattern, rule) -> forced alone: bytes differ
    conservative: Counter = field(default_factory=Counter)     # (pattern, rule) -> forced alone: bytes identical
    broad_refused: Counter = field(default_factory=Counter)    # (pattern, rule) -> broad refusals
    unsafe: Counter = field(default_factory=Counter)           # check -> samples accepted with differing bytes
    excused: Counter = field(default_factory=Counter)          # reason -> samples outside the property
    examples: dict = field(default_factory=dict)               # what -> the first few samples (repr)
    forced_runs: int = 0

    def note(self, what: str, s: Sample) -> None:
        self.examples.setdefault(what, [])
        if len(self.examples[what]) < 3:
            self.examples[what].append(repr(s))

    def table(self) -> str:
        lines = [f"samples: {self.samples}   forced single-candidate runs: {self.forced_runs}",
                 f"unsafe accepted: narrow {self.unsafe['narrow']}, broad {self.unsafe['broad']}",
                 "outside the property (samples; of which accepted with differing bytes by narrow, broad):"]
        lines += [f"  {why}: {n}; {self.unsafe['narrow, ' + why]}, {self.unsafe['broad, ' + why]}"
                  for why, n in sorted(self.excused.items())]
        lines += ["", f"{'pattern':<18} {'candidates':>10} {'narrow acc':>10} {'broad acc':>10} {'narrow only':>11}"]
        for p in sorted(self.candidates):
            lines.append(f"{p:<18} {self.candidates[p]:>10} {self.accepted[p]:>10} {self.broad_accepted[p]:>10} "
                         f"{self.narrow_only[p]:>11}")
        lines += ["", f"{'pattern':<18} {'rule (narrow)':<34} {'refused':>8} {'forced: differs':>16} "
                      f"{'forced: identical':>18}"]
        for (p, r), c in sorted(self.refused.items()):
            forced = r.startswith(HAZARD_RULES)
            lines.append(f"{p:<18} {r:<34} {c:>8} {self.necessary[p, r] if forced else '-':>16} "
                         f"{self.conservative[p, r] if forced else '-':>18}")
        lines += ["", f"{'pattern':<18} {'rule (broad)':<34} {'refused':>8}"]
        lines += [f"{p:<18} {r:<34} {c:>8}" for (p, r), c in sorted(self.broad_refused.items())]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {k: ({" / ".join(x) if isinstance(x, tuple) else x: n for x, n in v.items()}
                    if isinstance(v, Counter) else v) for k, v in self.__dict__.items()}


LIVE_INTERMEDIATE = "inserted node writes a live chain intermediate"
WINDOW_ROWS = "inserted node touches a window row outside the cache"


def examine(s: Sample, stats: Stats) -> list[str]:
    """Check one sample; returns the violations (empty when sound). Counts go to ``stats``."""
    stats.samples += 1
    problems = [f"the planner made a conflicting plan: {c}" for c in plan_conflicts(planned(s))[:3]]
    g = build(s)
    # outside the property: for narrow and broad alike (gallocr never plans it), and for broad (its reported bug)
    gap = LIVE_INTERMEDIATE if writes_live_intermediate(g) + g.meta["leaks"] else None
    window_rows = WINDOW_ROWS if touches_window_rows(g) else None
    for why in filter(None, (gap, window_rows)):
        stats.excused[why] += 1

    # 1. whatever narrow accepts runs byte-identical
    narrow = run(s)
    for k in narrow.decisions:
        stats.candidates[pattern_of(k)] += 1
    for k in narrow.accepted:
        stats.accepted[pattern_of(k)] += 1
    if not narrow.result.identical:
        which = f"narrow, {gap}" if gap else "narrow"
        stats.unsafe[which] += 1
        stats.note(which, s)
        if not gap:
            problems.append(f"narrow accepted {sorted(narrow.accepted)} but bytes differ: {narrow.diff()[:3]}")

    # 2. each refused candidate, forced alone: the refusal prevents a real difference, or it was conservative
    for k, r in narrow.refused.items():
        stats.refused[r.pattern, r.rule] += 1
        if not r.rule.startswith(HAZARD_RULES):
            continue  # structural: force=True cannot apply it either
        forced = run(s, force=True, only=k)
        stats.forced_runs += 1
        if len(forced.result.report.applied) != 1:
            problems.append(f"forcing {k} (refused by {r.rule}) did not apply it")
        elif forced.result.identical:
            stats.conservative[r.pattern, r.rule] += 1
            stats.note(f"conservative {r.pattern} {r.rule}", s)
        else:
            stats.necessary[r.pattern, r.rule] += 1

    # 3. broad: never unsafe, and never accepting what narrow refuses
    broad = decide(s, "broad")
    broad_acc = {k for k, d in broad.items() if d}
    for k, d in broad.items():
        if d:
            stats.broad_accepted[pattern_of(k)] += 1
        else:
            stats.broad_refused[d.pattern, d.rule] += 1
    for k in narrow.accepted - broad_acc:
        stats.narrow_only[pattern_of(k)] += 1
    if broad_acc and broad_acc != narrow.accepted:  # the same set was shown identical above
        b = run(s, between="broad")
        if not b.result.identical:
            which = f"broad, {gap or window_rows}" if gap or window_rows else "broad"
            stats.unsafe[which] += 1
            stats.note(which, s)
            if which == "broad":
                problems.append(f"broad accepted {sorted(b.accepted)} but bytes differ: {b.diff()[:3]}")
    if not window_rows:
        problems += [f"broad accepts {k} but narrow refuses it ({narrow.decisions[k].describe()})"
                     for k in broad_acc - narrow.accepted]
    return problems


def n_examples(default: int, per: float = 1.0) -> int:
    """CI runs ``default`` examples; GDNPASS_SOUNDNESS_EXAMPLES=N runs N*per (the long run in docs/soundness.md)."""
    n = os.environ.get("GDNPASS_SOUNDNESS_EXAMPLES")
    return max(1, int(int(n) * per)) if n else default


# ---------------------------------------------------------------------------------------------------------------------
# malformed graph files
# ---------------------------------------------------------------------------------------------------------------------

# field -> replacement values: out of range, of the wrong type, or plausible but inconsistent
_BAD = {
    "ne": lambda v, n: [[*v[:j], x, *v[j + 1:]] for j in range(4) for x in (0, v[j] + 1, 2 * v[j], -1)]
    + [v[:3], v + [1], "4", None],
    "nb": lambda v, n: [[*v[:j], x, *v[j + 1:]] for j in range(4) for x in (-4, 0, v[0], v[j] + 4, 2)] + [v[:2], {}],
    "src": lambda v, n: [[*v[:j], x, *v[j + 1:]] for j in range(len(v)) for x in (n, n + 7, -1, "0", None, 1.0)]
    + [v[:-1], v + [0], [], None, 7],
    "view_src": lambda v, n: [n, -1, 0, n - 1, "1", 2.5, None],
    "view_offs": lambda v, n: [v + 4, v + 2, 2**40, -4, None, "0", True],
    "offset": lambda v, n: [(v or 0) + 4, (v or 0) + 2, 2**40, -1, None, 0, "0", 1.5],
    "buffer": lambda v, n: ["arena", "cache", "weights", "input", "gpu", None, 3],
    "type": lambda v, n: ["f32", "f16", "bf16", "i32", "q4_0", 4, None],
    "op": lambda v, n: ["NONE", "VIEW", "CPY", "CONCAT", "ADD", "GDN_CONV_CHAIN", "MUL_MAT_VEC_PAIR", "FOO", None],
    "op_params": lambda v, n: [{}, [], None, {**v, "offset": -4}, {**v, "offset": "x"}, {**v, "dim": 3},
                               {**v, "kind": "TANH"}, {**v, "eps": -1.0}, {**v, "K": 0}, {**v, "s": "2"},
                               {**v, "inplace": 1}, {**v, "axes": [0, 0, 1, 2]}, {**v, "n_inputs": 99},
                               {**v, "columns": None}, {**v, "hint": "keep-alive"}],
    "flags": lambda v, n: [v | 2, 0, 64, -1, "2", None],
    "name": lambda v, n: [None, 3, "", "l_out-0"],
    "layer": lambda v, n: ["0", 1.5, None, -1, 99],
    "id": lambda v, n: [v + 1, -1, "0", None],
}


class Bases(list):
    """Graph dicts to mutate (a short repr keeps hypothesis' reports readable)."""

    def __repr__(self) -> str:
        return f"<{len(self)} graph dicts>"


@st.composite
def mutations(draw, bases: Bases) -> tuple[dict, list[str]]:
    """1-3 random mutations of one of ``bases`` (a deep copy); returns it and a description of each step."""
    i = draw(st.integers(0, len(bases) - 1))
    d = copy.deepcopy(bases[i])
    steps = [f"base {i}"]
    for _ in range(draw(st.integers(1, 3))):
        tensors = d["tensors"] if isinstance(d.get("tensors"), list) else []
        nodes = d["nodes"] if isinstance(d.get("nodes"), list) else []
        n = len(tensors)
        what = draw(st.sampled_from(["field", "field", "field", "cycle", "duplicate", "truncate", "swap", "drop",
                                     "top", "buffers", "plan"]))
        if what == "field" and n and isinstance(e := tensors[draw(st.integers(0, n - 1))], dict):
            f = draw(st.sampled_from(sorted(_BAD)))
            if f in e:
                try:
                    choices = _BAD[f](copy.deepcopy(e[f]), n)
                except (TypeError, AttributeError, IndexError):  # an earlier step already broke this field
                    choices = [None, "x", -1, [], {}]
                e[f] = draw(st.sampled_from(choices))
                steps.append(f"{e.get('name')!r}.{f} = {e[f]!r}")
        elif what == "cycle" and len(nodes) > 1:  # an earlier node reads a later one
            i, j = sorted(draw(st.lists(st.integers(0, len(nodes) - 1), min_size=2, max_size=2, unique=True)))
            e = tensors[nodes[i]] if nodes[i] in range(n) else None
            if isinstance(e, dict) and isinstance(e.get("src"), list) and e["src"]:
                e["src"][0] = nodes[j]
                steps.append(f"node {i} src[0] = node {j}")
        elif what in ("duplicate", "truncate"):
            lst = draw(st.sampled_from(["nodes", "leafs", "tensors"]))
            if isinstance(d.get(lst), list) and d[lst]:
                j = draw(st.integers(0, len(d[lst]) - 1))
                if what == "duplicate":
                    d[lst].insert(draw(st.integers(0, len(d[lst]))), copy.deepcopy(d[lst][j]))
                else:
                    d[lst] = d[lst][:j]
                steps.append(f"{lst}: {what} at {j}")
        elif what == "swap" and len(nodes) > 1:
            i, j = draw(st.lists(st.integers(0, len(nodes) - 1), min_size=2, max_size=2, unique=True))
            nodes[i], nodes[j] = nodes[j], nodes[i]
            steps.append(f"nodes {i} and {j} swapped")
        elif what == "drop" and n and isinstance(e := tensors[draw(st.integers(0, n - 1))], dict) and e:
            f = draw(st.sampled_from(sorted(e)))
            del e[f]
            steps.append(f"{e.get('name')!r}.{f} deleted")
        elif what == "top":
            f = draw(st.sampled_from(["format", "version", "meta", "alignment", "buffers", "tensors", "nodes",
                                      "leafs", "extra"]))
            d[f] = draw(st.sampled_from([None, 0, -1, "x", [], {}, 2]))
            steps.append(f"{f} = {d[f]!r}")
        elif what == "buffers" and isinstance(d.get("buffers"), dict) and d["buffers"]:
            b = draw(st.sampled_from(sorted(d["buffers"])))
            size = d["buffers"][b] if isinstance(d["buffers"][b], int) else 0
            d["buffers"][b] = draw(st.sampled_from([0, -1, None, "1", 1.5, size // 2, size + 1]))
            steps.append(f"buffers[{b!r}] = {d['buffers'][b]!r}")
        elif what == "plan":  # plausible but wrong: one arena tensor moved onto another's bytes
            arena = [e for e in tensors if isinstance(e, dict) and e.get("buffer") == "arena"]
            if len(arena) > 1:
                a, b = draw(st.lists(st.sampled_from(arena), min_size=2, max_size=2, unique_by=id))
                a["offset"] = b["offset"]
                steps.append(f"{a.get('name')!r} moved onto {b.get('name')!r}")
    return d, steps
