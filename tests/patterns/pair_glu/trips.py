"""Trip graphs of the pair_glu rules (tests/patterns/test_rules.py runs them, with every registered pattern's): the
small planned verify graph (tests/support/surgery.py: one layer, here n_t 8 and an FFN whose tile splits K,
``SPLIT_FFN``) with its FFN gate / up fused into a MUL_MAT_VEC_PAIR (the pattern that runs before this one), then one
mutation per rule that breaks that rule and no other; for every hazard a graph where forcing the rewrite past it
corrupts bytes.

``pair-glu.output-overlaps-input`` is a race between the programs of one Triton launch (the last program of a row
block storing its rows of y over x while later programs still read x): its proof runs the pair's and the GLU's
kernels in the interpreter, with the launcher's own overlap guard switched off (``unguard``).
"""

from __future__ import annotations

from gdnpass import ops
from gdnpass.fusion import fuse
from gdnpass.ir import DType, Flag, Graph, Op, contiguous_strides
from gdnpass.kernels import backends, triton_matvec
from gdnpass.patterns.mat_vec_pair import MatVecPair
from gdnpass.patterns.pair_glu import PairGlu
from support.graphs import triton_for
from support.surgery import SPLIT_FFN, insert_after, planned, read_bytes_of
from support.trips import Trip, fresh, spread_columns

OPS = (Op.MUL_MAT_VEC_PAIR, Op.GLU)  # the Triton kernels of a "triton" force proof


def prepared(**config) -> Graph:
    """The planned graph at 8 tokens of an FFN whose pair's tile splits K (the epilogue's scope: pair-glu.tile) with
    the pairs fused (what this pattern's candidates come from)."""
    g = planned(**{"model": SPLIT_FFN, "n_tokens": 8, **config})
    fuse(g, enabled=True, patterns=[MatVecPair()])
    return g


def parts(g: Graph) -> dict:
    """The FFN's pair node, its products, its input and the GLU of them."""
    pair = next(n for n in g.nodes if n.op is Op.MUL_MAT_VEC_PAIR and "ffn_gate" in n.name)
    glu = next(n for n in g.nodes if n.op is Op.GLU)
    return dict(pair=pair, a=pair.view_src, b=pair.outs[0], x=pair.src[1], glu=glu)


# ---- one mutation per rule ------------------------------------------------------------------------------------------


def m_y_strided(g):
    """The GLU's output with its columns twice as far apart as its rows need (fresh bytes)."""
    spread_columns(g, parts(g)["glu"])


def m_product_output(g):
    parts(g)["b"].flags |= Flag.OUTPUT


def m_product_read(g):
    """A second reader of the gate product, right after the pair."""
    p = parts(g)
    insert_after(g, p["pair"], ops.scale(p["a"], 1.0))


def m_y_over_x(g):
    """x moved to bytes of its own past the arena's end, and y onto them (x is dead after the pair: the unfused graph
    is sound; y is the larger, so the bytes past x are nobody's)."""
    p = parts(g)
    fresh(g, p["glu"], fresh(g, p["x"]))


def m_y_read_between(g):
    """Between the pair and the GLU a node reads y's bytes through a tensor of its own (no graph edge): it reads the
    bytes before the GLU writes them, the fused node has written them by then."""
    p = parts(g)
    read_bytes_of(g, p["glu"], p["pair"])


def m_product_read_between(g):
    """Between the pair and the GLU a node reads the up product's bytes through a tensor of its own (no graph edge,
    so the user count does not see it); fused, they are never written."""
    p = parts(g)
    read_bytes_of(g, p["b"], p["pair"])


def m_product_read_later(g):
    """After the GLU a node reads the gate product's bytes through a tensor of its own; fused, never written."""
    p = parts(g)
    read_bytes_of(g, p["a"], p["glu"])


def m_down_k_quant(g):
    """The down product's weight Q4_K (its activations q8_K blocks of 256 rows: nothing the pair can hand on)."""
    down = next(n for n in g.nodes if n.op in (Op.MUL_MAT, Op.MUL_MAT_ADD) and n.src[1] is parts(g)["glu"])
    w = down.src[0]
    w.type, w.nb = DType.Q4_K, contiguous_strides(DType.Q4_K, w.ne)


TRIPS = [
    Trip("pair-glu.type", m_down_k_quant, config=dict(model="tiny-dc4-h64-e512", wtype="q8_0")),
    Trip("pair-glu.tile", config=dict(n_tokens=17), name="gemm"),  # (bf16 over 16 columns: the GEMM's pair)
    Trip("pair-glu.tile", config=dict(model="tiny-dc4-h64"), name="unsplit"),  # (192 x 64: one K step)
    Trip("pair-glu.layout", m_y_strided),
    Trip("pair-product.user-count", m_product_output, name="output"),
    Trip("pair-product.user-count", m_product_read, name="reader"),
    Trip("pair-glu.output-overlaps-input", m_y_over_x, kernels="triton"),
    Trip("pair-glu.between", m_y_read_between, name="y"),
    Trip("pair-glu.between", m_product_read_between, name="product"),
    Trip("pair-glu.product-read-later", m_product_read_later),
]


def candidate(t: Trip | None = None, mutate: bool = True):
    """(graph, pattern, anchor) of a trip case (None: the plain graph); ``mutate=False``: unmutated."""
    g = prepared(**(t.config if t else {}))
    if t is not None and mutate and t.mutate:
        t.mutate(g)
    return g, PairGlu(), parts(g)["pair"]


def kernels(t: Trip) -> dict:
    """The kernel table of a force proof: the torch references (named: on a GPU the default would be Triton), or the
    pair's and the GLU's kernels on Triton (the GLU's exp is numpy's in the interpreter: the fused epilogue's too)."""
    return backends.TORCH_BACKEND if t.kernels == "torch" else triton_for(OPS)


def unguard(t: Trip, monkeypatch) -> None:
    """Forcing the overlap: the launcher refuses it too (a second line of defence), so the proof runs the kernel
    without its guard."""
    if t.kernels == "triton":
        monkeypatch.setattr(triton_matvec, "_alias_ok", lambda *a, **k: None)
