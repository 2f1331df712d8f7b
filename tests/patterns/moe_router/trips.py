"""Trip graphs of the MOE_ROUTER rules (tests/patterns/test_rules.py runs them, with every registered pattern's): the
expert router of the small planned tiny-qwen35moe verify graph (1 layer, 8 experts, 2 used, 4 tokens), one mutation
per rule that breaks that rule and no other; for every hazard a graph where forcing the rewrite past it corrupts
bytes.

``moe-router.output-overlaps-input``: gallocr puts the DIV inside the logits from 8 tokens on (the probabilities are
dead by then), which the kernel runs as one program walking its tiles in order (a tile: SOFT_MAX's, 128 rows of 8
experts). Its proof needs two tiles (129 tokens): the logits and the in-place SOFT_MAX moved to fresh bytes and the
DIV onto the second tile's logits (legal unfused), run on the Triton kernels with the launcher's own overlap guard
switched off (``unguard``): the first tile's stores overwrite logits the second tile then reads.
"""

from __future__ import annotations

from gdnpass import ops
from gdnpass.ir import DType, Flag, Graph, Op
from gdnpass.kernels import backends
from gdnpass.patterns.moe_router import MoeRouter, kernel
from support.graphs import triton_for
from support.surgery import insert_after, planned
from support.trips import Trip

BASE = dict(model="tiny-qwen35moe", n_layers=1)
ROUTER_OPS = (Op.SOFT_MAX, Op.ARGSORT, Op.GET_ROWS, Op.SUM_ROWS, Op.CLAMP, Op.DIV, Op.MOE_ROUTER)


def parts(g: Graph) -> dict:
    """The router's nodes, by role."""
    sm = g.find("ffn_moe_probs-0")
    get_rows = g.find("ffn_moe_weights-0")
    div = g.find("ffn_moe_weights_norm-0")
    return dict(logits=sm.src[0], soft_max=sm, argsort=g.find("ffn_moe_argsort-0"), topk=get_rows.src[1],
                probs_view=get_rows.src[0], get_rows=get_rows, w_view=div.src[0], sum=g.find("ffn_moe_weights_sum-0"),
                clamp=div.src[1], div=div)


def _packed(t, ne) -> None:
    t.ne = ne
    t.nb = (t.type.size, t.type.size * ne[0], t.type.size * ne[0] * ne[1], t.type.size * ne[0] * ne[1] * ne[2])


def _fresh(g: Graph, nbytes: int) -> int:
    """Arena bytes nothing else uses: their offset."""
    at = g.buffers["arena"]
    g.buffers["arena"] += nbytes
    return at


# ---- one mutation per rule ------------------------------------------------------------------------------------------


def m_scaled_soft_max(g):
    parts(g)["soft_max"].op_params["scale"] = 0.5


def m_ascending(g):
    parts(g)["argsort"].op_params["order"] = 0


def m_probs_view_shifted(g):
    """The GET_ROWS reads the probabilities one element on."""
    parts(g)["probs_view"].view_offs = 4


def m_nan_bound(g):
    parts(g)["clamp"].op_params["min"] = float("nan")


def m_wide_rows(g):
    """2000 experts a row (the logits, the probabilities and their view, the ARGSORT and its top-k rows)."""
    p = parts(g)
    n_t = p["soft_max"].ne[1]
    for t in (p["logits"], p["soft_max"], p["argsort"]):
        _packed(t, (2000, n_t, 1, 1))
    _packed(p["probs_view"], (1, 2000, n_t, 1))
    p["topk"].nb = p["argsort"].nb


def m_probs_output(g):
    parts(g)["soft_max"].flags |= Flag.OUTPUT


def m_sum_read(g):
    """A second reader of the weights' sum, right after it."""
    p = parts(g)
    insert_after(g, p["sum"], ops.scale(p["sum"], 1.0))


def m_logits_written_between(g):
    """A node after the ARGSORT scales the logits in place (unfused, the SOFT_MAX read them before; the same bytes
    hold the probabilities then, in place: the GET_ROWS reads them scaled)."""
    p = parts(g)
    insert_after(g, p["argsort"], ops.scale(p["logits"], 2.0, inplace=True))


def m_div_over_second_program(g):
    """129 tokens: the logits (and the in-place SOFT_MAX) on fresh bytes, the DIV on the logits of the second
    program's rows (row 128 on)."""
    p = parts(g)
    n_exp, n_t = p["logits"].ne[:2]
    at = _fresh(g, 4 * n_exp * n_t + p["div"].nbytes)
    p["logits"].offset = p["soft_max"].offset = at
    block_r, _ = kernel.soft_max_tile(n_exp)
    p["div"].offset = at + 4 * n_exp * block_r


def m_probs_read_later(g):
    """After the DIV, a DIV of a CLAMP (what the check compares) reads the probabilities' bytes through a tensor of
    its own (an arena leaf at their offset: no graph edge)."""
    p = parts(g)
    alias = ops.new_tensor("probs-bytes", DType.F32, p["div"].ne, buffer="arena")
    alias.offset = p["soft_max"].offset
    g.leafs.append(alias)
    c = insert_after(g, p["div"], ops.clamp(p["div"], 1.0, 2.0))
    insert_after(g, c, ops.div(alias, c)).flags |= Flag.OUTPUT


TRIPS = [
    Trip("moe-router.soft-max", m_scaled_soft_max),
    Trip("moe-router.argsort", m_ascending),
    Trip("moe-router.gather", m_probs_view_shifted),
    Trip("moe-router.normalise", m_nan_bound),
    Trip("scope.router-size", m_wide_rows),
    Trip("moe-probs.user-count", m_probs_output),
    Trip("moe-weights.user-count", m_sum_read),
    Trip("between.writes-input", m_logits_written_between),
    Trip("moe-router.output-overlaps-input", m_div_over_second_program, config=dict(n_tokens=129),
         kernels="triton"),
    Trip("moe-router.interior-read-later", m_probs_read_later),
]


def candidate(t: Trip | None = None, mutate: bool = True):
    """(graph, pattern, anchor) of a trip case (None: the plain graph); ``mutate=False``: unmutated."""
    g = planned(**{**BASE, "n_tokens": 4, **(t.config if t else {})})
    if t is not None and mutate and t.mutate:
        t.mutate(g)
    return g, MoeRouter(), parts(g)["soft_max"]


def kernels(t: Trip) -> dict:
    """The kernel table of a force proof: the torch references (named: on a GPU the default would be Triton), or the
    router's ops, unfused and fused, on Triton (the rest on torch: the interpreter pays per program)."""
    if t.kernels == "torch":
        return backends.TORCH_BACKEND
    return triton_for(ROUTER_OPS, where=lambda n: "ffn_moe" in n.name)


def unguard(t: Trip, monkeypatch) -> None:
    """Forcing rule 9's overlap: the launcher refuses it too (a second line of defence), so the proof runs the kernel
    without its guard."""
    if t.kernels == "triton":
        monkeypatch.setattr(kernel, "_alias_ok", lambda *a, **k: None)
