"""Every named legality rule of every pattern: documented, tripped alone, and (for hazards) needed.

1. The rule block of each matcher's docstring names exactly the rules the code runs, in the order it runs them
   (the conv chain per between-mode), with a negative control on doctored docstrings.
2. For every rule, a mutation of a small planned verify graph (tiny-dc4-h64, 1 layer, n_t=4, n_rs_seq=3, the
   pipeline's prepare + plan) that breaks that rule and no other: ``violations(...) == [rule]``, and ``fuse``
   refuses the candidate naming that rule and leaves the graph unchanged. A rule without such a graph fails
   ``test_every_rule_has_a_trip_graph``.
3. For every hazard rule, forcing the rewrite past it on its graph really corrupts bytes (``check_fusion(force=True)``
   is not identical) while the unforced run refuses and stays identical. The runtime data is arranged so that the
   move matters (the ids an in-between node writes differ from the ones read, a stale read feeds the layer output).

Finding (3): the torch references of the fused ops compute every result before writing any output, so an overlap of
a fused node's outputs with its own inputs (``alias.output-overlaps-input``, ``pair.alias``) cannot change a byte
there; those hazards are races between the programs of one Triton launch. Their proofs run the Triton kernels of the
ops involved (fused and unfused) in the interpreter, the rest of the graph on torch: the interpreter runs programs
one after another, so a program that writes over what a later program reads corrupts it, as on the GPU.
And ``between.writes-destination`` refuses writes to A's product between A and B, which no forced rewrite can turn
into a difference (see ``p_write_a_between``); its B half is the hazard.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import pytest

from gdnpass import ops
from gdnpass.check import check_fusion
from gdnpass.fusion import fuse
from gdnpass.ir import DType, Flag, Graph, Op
from gdnpass.kernels import backends
from gdnpass.patterns.common import HAZARD, STRUCTURAL, Context, Rule, refusal_names, violations
from gdnpass.patterns.conv_chain import ConvChain
from gdnpass.patterns.conv_chain import matcher as conv_chain
from gdnpass.patterns.mat_vec_pair import MatVecPair
from gdnpass.patterns.mat_vec_pair import matcher as mat_vec_pair
from gdnpass.models import ModelShape, VerifyConfig
from gdnpass.models.fill import fill
from gdnpass.pipeline import PassOptions, run
from support.graphs import CHAIN_OPS, triton_for

MODES = ("narrow", "broad")

# ---------------------------------------------------------------------------------------------------------------------
# 1. the docstring's rule block vs the code
# ---------------------------------------------------------------------------------------------------------------------

RULE_NAME = re.compile(r"\[([A-Za-z][\w-]*(?:\.[\w-]+)+)\]")  # [structure.concat], [between.touches-chain-buffer]


def doc_rules(doc: str) -> list[str]:
    """The bracketed rule names of a docstring's rule block (from "Legality rules" to the next blank line), in the
    order they are listed. (Shapes such as ``[d_conv-1, C, 1]`` in the block are not names: no dot, spaces.)"""
    start = doc.find("Legality rules")
    assert start >= 0, "no 'Legality rules' block in the docstring"
    end = doc.find("\n\n", start)
    return RULE_NAME.findall(doc[start:] if end < 0 else doc[start:end])


def code_rules(pattern, between: str = "narrow") -> list[str]:
    """The refusal names the pattern's rules report, in order (the generic confinement rule reports one per role)."""
    return refusal_names(pattern.rules(Context(Graph(), between)))


def doc_problems(doc: str, modes: dict[str, list[str]]) -> list[str]:
    """What is wrong between a docstring and the rule names each mode runs (empty: they agree)."""
    listed = doc_rules(doc)
    problems = [f"listed twice: {n}" for n in sorted({n for n in listed if listed.count(n) > 1})]
    in_code = {n for names in modes.values() for n in names}
    problems += [f"in the docstring, not in code: {n}" for n in listed if n not in in_code]
    problems += [f"in code, not in the docstring: {n}" for n in sorted(in_code - set(listed))]
    for mode, names in modes.items():
        order = [n for n in listed if n in names]
        if order != [n for n in names if n in listed]:
            problems.append(f"{mode}: docstring order {order} is not the code's {names}")
    return problems


PATTERN_MODES = {
    "gdn_conv_chain": (conv_chain, {m: code_rules(ConvChain(), m) for m in MODES}),
    "mul_mat_vec_pair": (mat_vec_pair, {"narrow": code_rules(MatVecPair())}),
}


@pytest.mark.parametrize("pattern", PATTERN_MODES)
def test_docstring_lists_the_rules_the_code_runs_in_order(pattern):
    module, modes = PATTERN_MODES[pattern]
    assert doc_problems(module.__doc__, modes) == []
    assert len(doc_rules(module.__doc__)) == len({n for names in modes.values() for n in names})


def test_conv_chain_between_modes():
    """Structure and the alias rule run in both modes; the six narrow between-rules only in narrow, the one broad
    rule only in broad."""
    narrow, broad = (PATTERN_MODES["gdn_conv_chain"][1][m] for m in MODES)
    assert set(narrow) - set(broad) == {r.name for r in conv_chain.NARROW}
    assert set(broad) - set(narrow) == {"between.touches-chain-buffer"}
    assert len(conv_chain.NARROW) == 6 and all(n.startswith("between.") for n in set(narrow) ^ set(broad))
    assert narrow[:len(narrow) - 6] == broad[:-1]  # a common prefix, then the mode's between-rules


@pytest.mark.parametrize("pattern,mode", [("gdn_conv_chain", "narrow"), ("gdn_conv_chain", "broad"),
                                          ("mul_mat_vec_pair", "narrow")])
def test_structural_rules_run_before_hazards(pattern, mode):
    """``violations`` and ``force`` rely on it: the structural rules first, then the hazards; names unique."""
    p = ConvChain() if pattern == "gdn_conv_chain" else MatVecPair()
    rules = p.rules(Context(Graph(), mode))
    kinds = [r.kind for r in rules]
    assert set(kinds) == {STRUCTURAL, HAZARD} and kinds == sorted(kinds, key=[STRUCTURAL, HAZARD].index)
    assert len({r.name for r in rules}) == len(rules)


def _swap(doc: str, a: str, b: str) -> str:
    return doc.replace(f"[{a}]", "[@@]").replace(f"[{b}]", f"[{a}]").replace("[@@]", f"[{b}]")


@pytest.mark.parametrize("doctor,expect", [
    (lambda d: d.replace("[scope.d-conv] ", ""), "in code, not in the docstring: scope.d-conv"),
    (lambda d: d.replace("[between.touches-chain-buffer]", "[between.touches-chain]"),
     "in the docstring, not in code: between.touches-chain"),
    (lambda d: _swap(d, "between.writes-ids", "between.writes-weights"), "narrow: docstring order"),
    (lambda d: _swap(d, "structure.weight", "structure.state"), "broad: docstring order"),
    (lambda d: d.replace("[cpy-run.whole-row]", "[cpy-run.whole-row] [l2.head-geometry]"),
     "listed twice: l2.head-geometry"),
    (lambda d: d.replace("Legality rules, in the order they run", "Legality rules\n\n"),
     "in code, not in the docstring: structure.concat"),  # the block ends at a blank line
], ids=["dropped", "renamed", "swapped-narrow", "swapped-structure", "duplicated", "block-cut"])
def test_docstring_check_fails_on_a_doctored_docstring(doctor, expect):
    """Negative control: each doctoring of the conv chain's real docstring is caught, with the reason."""
    module, modes = PATTERN_MODES["gdn_conv_chain"]
    doctored = doctor(module.__doc__)
    assert doctored != module.__doc__
    problems = doc_problems(doctored, modes)
    assert any(p.startswith(expect) for p in problems), problems


def test_docstring_parser_reads_names_not_shapes():
    doc = ("Legality rules:\n 1. [a.b] x is [d_conv-1, C, 1] and [C, n_t];\n    [c.d-e] y [S, H_k].\n\n"
           "[f.g] after the block")
    assert doc_rules(doc) == ["a.b", "c.d-e"]


# ---------------------------------------------------------------------------------------------------------------------
# 2. graph surgery: every mutation breaks exactly one rule of an otherwise fusable candidate
# ---------------------------------------------------------------------------------------------------------------------

BASE = dict(model="tiny-dc4-h64", n_tokens=4, n_rs_seq=3, n_layers=1, mem_size=2)
IDS = [1]  # s_copy: plane 0 of cell 1 (the ubatch's cell is 0): a row none of the snapshots writes


def planned(**kw) -> Graph:
    """A verify graph built, prepared for fusion and planned by the pipeline (not fused): ``BASE`` + ``kw``."""
    return run(VerifyConfig(**{**BASE, **kw}), PassOptions(fusion=True), fuse_now=False).graph


def chain(g: Graph) -> dict:
    n = {t.name: t for t in g.nodes}
    concat = n["conv_input-0"]
    windows = [w for w in g.nodes if w.op is Op.VIEW and w.view_src is concat]
    cpys = [c for c in g.nodes if c.op is Op.CPY and c.src[0] in windows]
    # q_l2 / k_l2: what the GDN reads (the L2_NORM, or the RMS form's SCALE); k_norm: k's L2_NORM or RMS_NORM
    k_l2 = n["k_conv_predelta-0"]
    return dict(concat=concat, gr=n["conv_states-0"], conv=n["conv_output_raw-0"], silu=n["conv_output_silu-0"],
                q=n["q_conv-0"], k=n["k_conv-0"], q_l2=n["q_conv_predelta-0"], k_l2=k_l2,
                k_norm=k_l2.src[0] if k_l2.op is Op.SCALE else k_l2,
                cpys=cpys, dsts=[c.src[1] for c in cpys], windows=windows, ids=n["rs_s_copy_main"],
                proj=n["linear_attn_qkv_mixed-0"].base, weight=n["conv_output_raw-0"].src[1],
                cache=concat.src[0].src[0].src[0].base, attn_norm=n["attn_norm-0"],
                attn_residual=n["attn_residual-0"], l_out=n["l_out-0"])


def alpha_beta(g: Graph) -> tuple:
    mm = {n.src[0].name.split(".")[-2]: n for n in g.nodes if n.op is Op.MUL_MAT}
    return mm["ssm_alpha"], mm["ssm_beta"]


def insert_after(g: Graph, anchor, node, offset=None, buffer="arena"):
    """Put ``node`` right after ``anchor``; a non-view gets bytes of ``buffer`` at ``offset`` (default: past the
    arena's end, bytes nothing else uses)."""
    if node.view_src is None:
        node.buffer = buffer
        node.offset = g.buffers["arena"] if offset is None else offset
        if buffer == "arena":
            g.buffers["arena"] = max(g.buffers["arena"], node.offset + node.nbytes)
    g.nodes.insert(g.index(anchor) + 1, node)
    node.flags |= Flag.COMPUTE
    return node


def insert_before(g: Graph, anchor, node, offset=None):
    return insert_after(g, g.nodes[g.index(anchor) - 1], node, offset)


def arena_tensor(name, nbytes):
    return ops.new_tensor(name, DType.F32, (nbytes // 4,), buffer="arena")


def feed_layer_output(g: Graph, c: dict, t):
    """Make ``t``'s first (up to) 64 elements flow into the layer output (l_out = ffn_out + (attn_residual + t)), so a
    stale read in ``t`` shows in the compared bytes."""
    n = min(64, t.nelements)
    assert 64 % n == 0
    v = insert_before(g, c["l_out"], ops.view_1d(t, n, 0))
    r = insert_before(g, c["l_out"], ops.add(c["attn_residual"], v))
    c["l_out"].src[1] = r


# ---- the conv chain: structure and scope ----------------------------------------------------------------------------


def m_concat_dim(g, c):
    c["concat"].op_params["dim"] = 1


def m_state_from_mid_cache(g, c):  # GET_ROWS from a view of the cache at row 1, not at offset 0
    cache = c["cache"]
    rows = insert_before(g, c["gr"], ops.view_2d(cache, cache.ne[0], cache.ne[1] - 1, cache.nb[1], cache.nb[1]))
    c["gr"].src[0] = rows


def m_state_copied(g, c):  # CONCAT(CONT(the gathered state), ...): its first source is no RESHAPE(GET_ROWS)
    c["concat"].src[0] = insert_before(g, c["concat"], ops.cont(c["concat"].src[0]))


def m_projection_copied(g, c):  # CONCAT(state, CONT(TRANSPOSE(x))): its second source is no TRANSPOSE
    c["concat"].src[1] = insert_before(g, c["concat"], ops.cont(c["concat"].src[1]))


def m_extra_row(g, c):  # a 17th snapshot row
    w = ops.view_3d(c["concat"], *c["windows"][0].ne[:3], c["concat"].nb[1], c["concat"].nb[2], 0)
    cache = c["cache"]
    dst = ops.view_2d(cache, cache.ne[0], 1, cache.nb[1], cache.nb[1] * 1)  # row 1: cell 1, never a snapshot here
    cp = ops.cpy(w, dst)
    last = c["cpys"][-1]
    for t in (cp, dst, w):
        insert_after(g, last, t)


def m_cache_type(g, c):
    c["cache"].type = DType.F16


def m_weight_strided(g, c):  # SSM_CONV's weight: [d_conv, C] columns of a wider [2*d_conv, C] tensor
    w = c["weight"]
    wide = ops.new_tensor("conv1d_wide", DType.F32, (2 * w.ne[0], w.ne[1]), buffer="weights")
    wide.offset, g.buffers["weights"] = g.buffers["weights"], g.buffers["weights"] + wide.nbytes
    g.leafs.append(wide)
    c["conv"].src[1] = insert_before(g, c["conv"], ops.view_2d(wide, w.ne[0], w.ne[1], wide.nb[1], 0))


# ---- the CPY run, use counts, the norms -----------------------------------------------------------------------------


def m_window_column(g, c):
    c["windows"][0].view_offs = 4 * (c["concat"].ne[0] - 2)  # past column n_t


def m_window_read_twice(g, c):  # a second reader of a window
    insert_after(g, c["cpys"][0], ops.cont(c["windows"][0]))


def m_half_row(g, c):
    c["dsts"][0].view_offs += 4


def m_row_twice(g, c):
    c["dsts"][1].view_offs = c["dsts"][0].view_offs


def m_concat_user(g, c):
    insert_after(g, c["concat"], ops.cont(c["concat"]))


def m_concat_output(g, c):
    c["concat"].flags |= Flag.OUTPUT


def m_gr_user(g, c):
    insert_after(g, c["gr"], ops.cont(c["gr"]))


def m_conv_user(g, c):
    insert_after(g, c["conv"], ops.exp(c["conv"]))


def m_cpy_user(g, c):  # a node reads a snapshot CPY's result (the rewrite removes the CPY node)
    insert_after(g, c["cpys"][-1], ops.cont(c["cpys"][0]))


def m_k_geometry(g, c):
    c["k"].view_offs += 4


def m_rms_norm_user(g, c):  # a second reader of k's RMS_NORM output, which the fused node never writes
    insert_after(g, c["k_norm"], ops.cont(c["k_norm"]))


def m_scale_bias(g, c):
    c["k_l2"].op_params["b"] = 0.5


def m_k_eps(g, c):  # k's RMS_NORM with another eps than q's
    c["k_norm"].op_params["eps"] *= 2


# ---- the conv chain: hazards ----------------------------------------------------------------------------------------


def m_silu_across_channels(g, c):  # SiLU on the projection, but one element off: other programs' channels
    c["silu"].offset = c["conv"].offset = c["proj"].offset + 4


def m_write_row_between(g, c):  # after the fused position, a node writes snapshot row 0 (before its CPY did)
    insert_after(g, c["concat"], ops.exp(c["attn_norm"]), offset=byte_lo(c["dsts"][0]), buffer="cache")


def m_write_gathered_row_between(g, c):  # before the fused position, a node writes the row the ids gather
    row = c["cache"].nb[1] * IDS[0]
    insert_after(g, c["gr"], ops.exp(c["attn_norm"]), offset=c["cache"].offset + row, buffer="cache")


def m_write_ids_between(g, c):  # between GET_ROWS and CONCAT: ids := 2 (the runtime ids are IDS = [1])
    one = insert_after(g, c["gr"], ops.view_1d(c["attn_norm"], 1, 0))
    two = insert_after(g, one, ops.scale(one, 0.0, 2.0))
    insert_after(g, two, ops.cpy(two, c["ids"]))


def m_write_weight_between(g, c):
    insert_after(g, c["concat"], ops.scale(c["weight"], 2.0, inplace=True))


def m_write_silu_between(g, c):  # scribbles on the SiLU block after the fused node wrote it there
    insert_after(g, c["concat"], ops.exp(c["attn_norm"]), offset=c["silu"].offset)


def m_read_silu_between(g, c):  # reads the SiLU block before SILU ran (the fused node has written it by then)
    t = arena_tensor("stale", 256)
    t.offset = c["silu"].offset
    feed_layer_output(g, c, insert_after(g, c["concat"], ops.exp(t)))


def m_read_row_between(g, c):  # reads snapshot row 0 before its CPY ran
    feed_layer_output(g, c, insert_after(g, c["concat"], ops.cont(c["dsts"][0])))


def byte_lo(t) -> int:
    return t.base.offset + t.view_offs


# ---- the mat-vec pair ---------------------------------------------------------------------------------------------


def p_different_src1(g, a, b):  # B reads a copy of x
    b.src[1] = insert_before(g, b, ops.cont(a.src[1]))


def p_type(g, a, b):
    b.src[0].type = DType.BF16


def p_x_type(g, a, b):  # the weights agree, x is f16
    a.src[1].type = DType.F16


def p_flags(g, a, b):
    b.flags |= Flag.OUTPUT


def p_b_over_x(g, a, b):  # gallocr-style reuse gone wrong: B's product on x's first bytes
    b.offset = a.src[1].base.offset


def p_write_b_between(g, a, b):  # a node between A and B writes B's block (B overwrote it, unfused)
    x = a.src[1]
    insert_after(g, a, ops.cont(ops.view_1d(x, b.nelements, 0)), offset=b.offset)


def p_write_a_between(g, a, b):
    """The same over A's block (the pair fusion test's old graph): a conservative refusal. The pair writes A at A's own
    position, as the unfused graph did, so a node between clobbers A in both graphs alike and forcing changes no
    byte: the A half of between.writes-destination protects nothing (writes-input, consistently, leaves w_a out)."""
    x = a.src[1]
    insert_after(g, a, ops.cont(ops.view_1d(x, a.nelements, 0)), offset=a.offset)


def p_write_x_between(g, a, b):
    insert_after(g, a, ops.scale(a.src[1], 2.0, inplace=True))


def p_read_b_between(g, a, b):  # reads B's block before B ran, feeding the layer output
    stale = ops.new_tensor("stale", DType.F32, (b.nelements,), buffer="arena")
    stale.offset = b.offset
    feed_layer_output(g, chain(g), insert_after(g, a, ops.exp(stale)))


# ---- the table ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trip:
    """A graph that trips ``rule`` alone: ``config`` (VerifyConfig overrides of BASE), then ``mutate``."""

    rule: str
    mutate: Callable | None = None
    config: dict = field(default_factory=dict)
    pattern: str = "gdn_conv_chain"
    between: str = "narrow"
    corrupts: bool = True      # hazards: forcing corrupts bytes (False: a graph the rule refuses but that is safe)
    kernels: str = "torch"     # hazards: the kernels of the force proof (see KERNELS)
    name: str = ""

    @property
    def id(self) -> str:
        return self.rule + (f"[{self.name}]" if self.name else "") + (f"-{self.between}" if self.between != "narrow"
                                                                      else "")


TINY_DC6 = ModelShape("tiny-dc6", n_embd=64, n_layer=2, n_k_heads=1, n_v_heads=2, head_dim=32, d_conv=6)
TINY_H80 = ModelShape("tiny-h80", n_embd=64, n_layer=2, n_k_heads=1, n_v_heads=1, head_dim=80, d_conv=4)  # llama.cpp
# accepts any head size; the fused kernel's heads are powers of two
PAIR = "mul_mat_vec_pair"

TRIPS = [
    Trip("structure.concat", m_concat_dim),
    Trip("structure.state", m_state_from_mid_cache),
    Trip("structure.state", m_state_copied, name="copied"),
    Trip("structure.projection", m_projection_copied),
    Trip("scope.n-seqs", config=dict(n_seqs=2)),
    Trip("scope.n-tokens", config=dict(n_tokens=17)),
    Trip("scope.n-rows", m_extra_row, config=dict(n_rs_seq=15)),
    Trip("scope.d-conv", config=dict(model=TINY_DC6)),
    Trip("scope.type", m_cache_type),
    Trip("structure.weight", m_weight_strided),
    Trip("cpy-run.view-of-concat", m_window_column),
    Trip("cpy-run.view-of-concat", m_window_read_twice, name="read-twice"),
    Trip("cpy-run.whole-row", m_half_row),
    Trip("cpy-run.row-written-twice", m_row_twice),
    Trip("concat.user-count", m_concat_user),
    Trip("concat.user-count", m_concat_output, name="output"),
    Trip("get-rows.user-count", m_gr_user),
    Trip("ssm-conv.user-count", m_conv_user),
    Trip("cpy.user-count", m_cpy_user),
    Trip("scope.head-dim", config=dict(model=TINY_H80)),
    Trip("l2.head-geometry", m_k_geometry, config=dict(qk_norm="l2")),
    Trip("rms.head-geometry", m_k_geometry),
    Trip("rms.norm-use", m_rms_norm_user),
    Trip("rms.scale-bias", m_scale_bias),
    Trip("rms.same-params", m_k_eps),
    Trip("alias.output-overlaps-input", m_silu_across_channels, kernels="triton-chain"),
    Trip("between.writes-cache", m_write_row_between, name="snapshot-row"),
    Trip("between.writes-cache", m_write_gathered_row_between, name="gathered-row"),
    Trip("between.writes-ids", m_write_ids_between),
    Trip("between.writes-weights", m_write_weight_between),
    Trip("between.writes-early-output", m_write_silu_between),
    Trip("between.reads-early-output", m_read_silu_between),
    Trip("between.reads-cache", m_read_row_between),
    Trip("between.touches-chain-buffer", m_write_silu_between, between="broad"),
    Trip(PAIR + ":pair.different-src1", p_different_src1, pattern=PAIR),
    Trip(PAIR + ":pair.type", p_type, pattern=PAIR),
    Trip(PAIR + ":pair.type", p_x_type, pattern=PAIR, name="x"),
    Trip(PAIR + ":pair.n-cols", config=dict(n_tokens=17), pattern=PAIR),
    Trip(PAIR + ":pair.flags", p_flags, pattern=PAIR),
    Trip(PAIR + ":pair.alias", p_b_over_x, pattern=PAIR, kernels="triton-pair"),
    Trip(PAIR + ":between.writes-destination", p_write_b_between, pattern=PAIR, name="b"),
    Trip(PAIR + ":between.writes-destination", p_write_a_between, pattern=PAIR, name="a", corrupts=False),
    Trip(PAIR + ":between.writes-input", p_write_x_between, pattern=PAIR),
    Trip(PAIR + ":between.reads-destination-early", p_read_b_between, pattern=PAIR),
]
# (the pair's rule names share a namespace with the chain's, "between.*": its trips are keyed "pattern:rule")


def rule_of(t: Trip) -> str:
    return t.rule.split(":", 1)[1] if ":" in t.rule else t.rule


def key(pattern: str, rule: str) -> str:
    return rule if pattern == "gdn_conv_chain" else f"{pattern}:{rule}"


ALL_RULES = [(pattern, mode, name) for pattern, (_, modes) in PATTERN_MODES.items()
             for mode, names in modes.items() for name in names]
RULE_KEYS = sorted({key(p, n) for p, _, n in ALL_RULES})
KIND = {key(p, name): r.kind for p, (_, modes) in PATTERN_MODES.items() for m in modes
        for r in (ConvChain() if p == "gdn_conv_chain" else MatVecPair()).rules(Context(Graph(), m))
        for name in r.refusals}


class Only:
    """One pattern restricted to one candidate (so fuse and check_fusion decide that candidate alone)."""

    def __init__(self, pattern, anchor):
        self._pattern, self._anchor = pattern, anchor

    def candidates(self, graph):
        return [self._anchor]

    def __getattr__(self, name):
        return getattr(self._pattern, name)


def build(t: Trip, mutate: bool = True):
    """(graph, pattern, anchor) of a trip case; ``mutate=False``: the same graph unmutated."""
    g = planned(**t.config)
    if t.pattern == PAIR:
        pattern = MatVecPair()
        a, b = alpha_beta(g)
        if mutate and t.mutate:
            t.mutate(g, a, b)
        anchor = next(p for p in pattern.candidates(g) if p[0] is a)
    else:
        pattern = ConvChain()
        if mutate and t.mutate:
            t.mutate(g, chain(g))
        (anchor,) = pattern.candidates(g)
    return g, pattern, anchor


def uncovered(patterns: dict, trips: list[Trip]) -> list[str]:
    """Rule keys of ``patterns`` ({name: pattern}, every between-mode) that no trip graph covers."""
    names = {key(n, name) for n, p in patterns.items() for m in MODES
             for name in refusal_names(p.rules(Context(Graph(), m)))}
    return sorted(names - {t.rule for t in trips})


@pytest.mark.parametrize("rule", RULE_KEYS)
def test_every_rule_has_a_trip_graph(rule):
    """A new rule without a graph that trips it alone fails here."""
    assert any(t.rule == rule for t in TRIPS), f"no trip graph for {rule}: add one to TRIPS"


def test_a_new_rule_without_a_trip_graph_is_caught():
    """Negative control of the test above: a pattern with one more rule has exactly that rule uncovered."""
    class Extended(MatVecPair):
        def rules(self, ctx):
            return super().rules(ctx) + (Rule("between.new-hazard", HAZARD, lambda c, ctx: None),)

    patterns = {"gdn_conv_chain": ConvChain(), PAIR: MatVecPair()}
    assert uncovered(patterns, TRIPS) == []
    assert uncovered({**patterns, PAIR: Extended()}, TRIPS) == [PAIR + ":between.new-hazard"]


def test_violations_lists_every_hazard():
    """Negative control of "trips alone": an in-place SCALE of snapshot row 0 after the fused position both writes
    and reads it, and ``violations`` names both hazards (fuse reports the first)."""
    def scale_row(g, c):
        insert_after(g, c["concat"], ops.scale(c["dsts"][0], 2.0, inplace=True))

    g, p, anchor = build(Trip("", scale_row))
    assert violations(p, g, anchor, Context(g)) == ["between.writes-cache", "between.reads-cache"]
    assert [r.rule for r in fuse(g, enabled=True, patterns=[p]).refused] == ["between.writes-cache"]


def test_trip_table_names_only_real_rules():
    assert {t.rule for t in TRIPS} <= set(RULE_KEYS)


@pytest.mark.parametrize("pattern", ["gdn_conv_chain", PAIR])
@pytest.mark.parametrize("mode", MODES)
def test_the_unmutated_candidates_break_no_rule(pattern, mode):
    g, p, anchor = build(Trip("", pattern=pattern), mutate=False)
    assert violations(p, g, anchor, Context(g, mode)) == []


@pytest.mark.parametrize("t", TRIPS, ids=[t.id for t in TRIPS])
def test_each_rule_trips_alone(t):
    if t.mutate:  # the mutation is what breaks the rule: unmutated, the same config's candidate is legal
        g, p, anchor = build(t, mutate=False)
        assert violations(p, g, anchor, Context(g, t.between)) == []
    g, p, anchor = build(t)
    assert violations(p, g, anchor, Context(g, t.between)) == [rule_of(t)]
    if KIND[t.rule] == STRUCTURAL:  # structural rules are the same in both modes
        other = "broad" if t.between == "narrow" else "narrow"
        assert violations(p, g, anchor, Context(g, other)) == [rule_of(t)]
    # fuse: the candidate is refused by that rule, the graph left unchanged
    before = list(g.nodes)
    report = fuse(g, enabled=True, patterns=[Only(p, anchor)], between=t.between)
    assert [r.rule for r in report.refused] == [rule_of(t)], [r.describe() for r in report.refused]
    assert not report.applied and g.nodes == before
    r = report.refused[0]
    assert r.pattern == p.name and r.reason and r.node is not None
    if KIND[t.rule] == HAZARD:
        assert r.ranges is not None  # aliasing refusals name the two colliding byte ranges


@pytest.mark.parametrize("t", [t for t in TRIPS if t.pattern == "gdn_conv_chain" and t.rule.startswith("between.")
                               and t.between == "narrow"], ids=lambda t: t.id)
def test_broad_refuses_every_narrow_between_graph(t):
    """The broad check is broader: what a narrow between-rule refuses, broad refuses too (by its one rule)."""
    g, p, anchor = build(t)
    assert violations(p, g, anchor, Context(g, "broad")) == ["between.touches-chain-buffer"]


def test_broad_check_refuses_what_narrow_proves_safe():
    """A node in between that writes the dead projection block: broad refuses, narrow fuses, bytes identical."""
    def scratch(g, c):
        early = [(t.offset, t.offset + t.nbytes) for t in (c["silu"], c["q_l2"], c["k_l2"])]
        proj = c["proj"]
        free = [o for o in range(proj.offset, proj.offset + proj.nbytes - 255, 256)
                if all(o + 256 <= lo or o >= hi for lo, hi in early)]
        assert free, "the projection block is entirely reused by early outputs in this plan"
        insert_after(g, c["cpys"][-1], ops.cont(ops.view_1d(c["attn_norm"], 64, 0)), offset=free[0])

    t = Trip("between.touches-chain-buffer", scratch, between="broad")
    g, p, anchor = build(t)
    assert violations(p, g, anchor, Context(g, "broad")) == ["between.touches-chain-buffer"]
    broad = fuse(g, enabled=True, patterns=[p], between="broad")
    assert [r.rule for r in broad.refused] == ["between.touches-chain-buffer"]
    g, p, anchor = build(t)
    assert violations(p, g, anchor, Context(g, "narrow")) == []
    res = check_fusion(g, patterns=[p], ids=IDS)
    assert len(res.report.applied) == 1 and res.identical, [c.to_json() for c in res.compared if not c.identical]
    g, p, anchor = build(t)  # and forcing it in broad mode changes no byte: broad refused a safe rewrite
    res = check_fusion(g, patterns=[p], ids=IDS, between="broad", force=True)
    assert [r.rule for r in res.report.refused] == ["between.touches-chain-buffer"] and res.identical


@pytest.mark.parametrize("model,n_t,n_rs,rule", [
    ("tiny-dc4-h64", 17, 3, "scope.n-tokens"),
    (TINY_DC6, 4, 3, "scope.d-conv"),
])
def test_scope_rules(model, n_t, n_rs, rule):
    g = planned(model=model, n_tokens=n_t, n_rs_seq=n_rs)
    report = fuse(g, enabled=True, patterns=[ConvChain()])
    assert [r.rule for r in report.refused] == [rule]


def test_pair_different_src1_is_reported_for_same_shaped_weights():
    # z and ssm_out have the same weight shape in qwen3.5-9b ([4096, 4096]) but read different inputs
    from gdnpass.alloc import plan
    from gdnpass.models import build_verify_graph

    g = build_verify_graph(VerifyConfig("qwen3.5-9b", 4, 3, n_layers=1))
    plan(g)
    r = fuse(g, enabled=True, patterns=[MatVecPair()])
    assert "pair.different-src1" in {x.rule for x in r.refused}


# ---------------------------------------------------------------------------------------------------------------------
# 3. forcing a hazard rule's rewrite corrupts bytes
# ---------------------------------------------------------------------------------------------------------------------


TORCH, TRITON = backends.TORCH_BACKEND, backends.TRITON_BACKEND


def _small(op):
    """The Triton kernel of ``op`` for products of at most 32 rows (alpha/beta), torch for the others (the FFN's
    192-row products take seconds in the interpreter)."""
    tri, ref = TRITON[op], TORCH[op]

    def adapter(node, views, out):
        (tri if node.ne[0] <= 32 else ref)(node, views, out)

    return adapter


def kernels(name: str) -> dict:
    """A kernel table: torch, with the Triton kernels (in the interpreter on a CPU) of the ops a race involves, fused
    and unfused alike (each fused kernel is byte-identical to its unfused Triton kernels, not to torch's)."""
    if name == "triton-chain":
        return triton_for(CHAIN_OPS)
    if name == "triton-pair":
        return {**TORCH, Op.MUL_MAT: _small(Op.MUL_MAT), Op.MUL_MAT_VEC_PAIR: _small(Op.MUL_MAT_VEC_PAIR)}
    raise KeyError(name)


HAZARDS = [t for t in TRIPS if KIND[t.rule] == HAZARD]


def check(t: Trip, force: bool, mutate: bool = True):
    g, p, anchor = build(t, mutate)
    backend = None if t.kernels == "torch" else kernels(t.kernels)
    return check_fusion(g, patterns=[Only(p, anchor)], ids=IDS, between=t.between, force=force, backend=backend)


@pytest.mark.parametrize("rule", sorted({t.rule for t in TRIPS if KIND[t.rule] == HAZARD}))
def test_every_hazard_has_a_corruption_proof(rule):
    assert any(t.rule == rule and t.corrupts for t in HAZARDS), f"no graph where forcing past {rule} corrupts bytes"


@pytest.mark.parametrize("t", HAZARDS, ids=[t.id for t in HAZARDS])
def test_forcing_a_hazard_corrupts_bytes(t):
    refused = check(t, force=False)
    assert [r.rule for r in refused.report.refused] == [rule_of(t)] and not refused.report.applied
    assert refused.identical, [c.to_json() for c in refused.compared if not c.identical]
    forced = check(t, force=True)
    assert [r.rule for r in forced.report.refused] == [rule_of(t)] and len(forced.report.applied) == 1
    differing = [c.name for c in forced.compared if not c.identical]
    if t.corrupts:
        assert differing, "forced past the rule, the fused graph is still byte-identical"
    else:
        assert not differing, differing  # a conservative refusal: see its mutation's docstring
    if t.kernels != "torch":  # control: with these kernels the unmutated candidate fuses byte-identically
        clean = check(t, force=False, mutate=False)
        assert len(clean.report.applied) == 1 and clean.identical


def test_negative_control_forced_fusion_corrupts_bytes():
    """Force the rewrite past a between-rule: the executor's output really differs, so the tests can see hazards
    (and, control of the control, unfused the scribble is harmless: SILU overwrites it later)."""
    from gdnpass.check import watched
    from gdnpass.runtime import Executor

    def unfused(g):
        ex = Executor(g)
        fill(ex, seed=5, ids=IDS)
        return ex.run(probes=watched(g))

    t = Trip("between.writes-early-output", m_write_silu_between)
    (clean, _, _), (g, p, anchor) = build(t, mutate=False), build(t)
    want, got = unfused(clean), unfused(g)
    assert want.keys() == got.keys() and all(want[k].equal(got[k]) for k in want)
    res = check_fusion(g, patterns=[p], ids=IDS, seed=5, force=True)
    assert [r.rule for r in res.report.refused] == ["between.writes-early-output"]
    assert len(res.report.applied) == 1  # forced through
    assert {"conv_output_silu-0", "l_out-0"} <= {x.name for x in res.compared if not x.identical}


@pytest.mark.parametrize("t", [t for t in HAZARDS if t.kernels != "torch"], ids=lambda t: t.id)
def test_alias_hazards_are_invisible_to_the_torch_references(t):
    """The finding above: on the torch kernels, forcing past an alias rule changes no byte (the references compute
    everything before writing), which is why the alias proofs need the Triton kernels."""
    res = check(Trip(t.rule, t.mutate, t.config, t.pattern, t.between), force=True)
    assert len(res.report.applied) == 1 and res.identical
