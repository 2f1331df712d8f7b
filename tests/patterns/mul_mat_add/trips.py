"""Trip graphs of the MUL_MAT_ADD rules (tests/patterns/test_rules.py runs them, with every registered pattern's): the
FFN's down projection and its residual ADD (the layer output) of the small planned verify graph
(tests/support/surgery.py), one mutation per rule that breaks that rule and no other; for every hazard a graph where
forcing the rewrite past it corrupts bytes.

``mul-mat-add.output-overlaps-input`` happens in the plan itself: the GDN output projection's residual ADD lands on
the projection's input (gallocr gives the sum the block x vacated: this graph's attn_residual-0, 4 of qwen3.5-9b's 24),
which the unfused graph may do and the fused kernel may not: a program stores its row of the sum while later
programs still read x. The proof moves the FFN's sum onto its x the same way and runs the mat-vec kernels, single
and fused, in the interpreter, with the launcher's own overlap guard switched off (``unguard``).
"""

from __future__ import annotations

from gdnpass import ops
from gdnpass.ir import DType, Flag, Graph, Op
from gdnpass.kernels import backends, triton_matvec
from gdnpass.patterns.mul_mat_add import MatMulAdd
from support.graphs import triton_for
from support.surgery import insert_after, insert_before, planned, read_bytes_of
from support.trips import Trip, spread_columns


def parts(g: Graph) -> dict:
    """The residual ADD of the FFN's down projection (the layer output), its product, the product's input and the
    addend."""
    add = g.find("l_out-0")
    read = next(s for s in add.src if s.op is Op.MUL_MAT or s.view_src is not None and s.view_src.op is Op.MUL_MAT)
    mm = read if read.op is Op.MUL_MAT else read.view_src
    r = next((s for s in add.src if s is not read), read)  # (the product itself, where the ADD adds it to itself)
    return dict(add=add, mm=mm, read=read, x=mm.src[1], w=mm.src[0], r=r)


def _fresh(g: Graph, t, nbytes: int) -> None:
    """Move non-view ``t`` to arena bytes nothing else uses."""
    t.offset = g.buffers["arena"]
    g.buffers["arena"] += nbytes


# ---- one mutation per rule ------------------------------------------------------------------------------------------


def m_permuted_view(g):
    """The ADD reads the product through a view of its shape that walks it column-major (each row 16 bytes on)."""
    p = parts(g)
    M, N = p["mm"].ne[:2]
    v = insert_after(g, p["mm"], ops.view(p["mm"], (M, N), (4 * M,), 0))
    v.nb = (4 * N, 4, 4 * M * N, 4 * M * N)  # (ops.view's nb0 is the type's size)
    p["add"].src[0] = v


def m_add_in_place(g):
    """The ADD is an in-place op: a view of its addend."""
    p = parts(g)
    p["add"].view_src, p["add"].view_offs = p["r"], 0


def m_broadcast_addend(g):
    """The addend is one column, broadcast over the tokens."""
    p = parts(g)
    p["add"].src[1] = insert_before(g, p["add"], ops.view_1d(p["r"], p["r"].ne[0], 0))


def m_x_f16(g):
    parts(g)["x"].type = DType.F16


def m_sum_strided(g):
    """The sum's columns twice as far apart as its rows need (fresh bytes)."""
    spread_columns(g, parts(g)["add"])


def m_product_output(g):
    parts(g)["mm"].flags |= Flag.OUTPUT


def m_product_read(g):
    """A second reader of the product, right after it."""
    p = parts(g)
    insert_after(g, p["mm"], ops.scale(p["mm"], 1.0))


def m_x_written_between(g):
    """A node between the product and the ADD scales x in place (the unfused product read x before it)."""
    p = parts(g)
    insert_after(g, p["mm"], ops.scale(p["x"], 2.0, inplace=True))


def m_sum_over_x(g):
    """The sum on x's first bytes, as gallocr put the GDN projection's (x is dead after the product: the unfused
    graph is sound)."""
    p = parts(g)
    p["add"].offset = p["x"].offset


def m_product_read_later(g):
    """The sum moved off the product's bytes (fresh bytes), and after the ADD a node reads those bytes through a
    tensor of its own (an arena leaf at their offset: no graph edge): an ADD of them to themselves (an ADD: the
    check compares every ADD)."""
    p = parts(g)
    _fresh(g, p["add"], p["add"].nbytes)
    read_bytes_of(g, p["mm"], p["add"])


def m_product_read_between(g):
    """Between the product and the ADD a node reads the product's bytes through a tensor of its own (as
    m_product_read_later: no graph edge, so the user count does not see it); fused, they are never written."""
    p = parts(g)
    read_bytes_of(g, p["mm"], p["mm"])


def m_product_as_addend(g):
    """The ADD adds the product to itself (the sum moved to fresh bytes): the fused node would read the product's
    bytes as its addend, which it never writes."""
    p = parts(g)
    _fresh(g, p["add"], p["add"].nbytes)
    p["add"].src[:2] = [p["read"], p["read"]]


TRIPS = [
    Trip("mul-mat-add.product", m_permuted_view, name="view"),
    Trip("mul-mat-add.product", m_add_in_place, name="in-place"),
    Trip("mul-mat-add.addend", m_broadcast_addend),
    Trip("mul-mat-add.type", m_x_f16),
    Trip("mul-mat-add.n-cols", config=dict(n_tokens=17, wtype="f32")),  # (over 16 columns: torch's matmul)
    Trip("mul-mat-add.layout", m_sum_strided),
    Trip("mul-mat.user-count", m_product_output, name="output"),
    Trip("mul-mat.user-count", m_product_read, name="reader"),
    Trip("between.writes-input", m_x_written_between),
    Trip("mul-mat-add.output-overlaps-input", m_sum_over_x, name="ffn", kernels="triton"),
    Trip("mul-mat-add.product-read-later", m_product_as_addend, name="addend"),
    Trip("mul-mat-add.product-read-later", m_product_read_later, name="later"),
    Trip("mul-mat-add.product-read-later", m_product_read_between, name="between"),
]


def candidate(t: Trip | None = None, mutate: bool = True):
    """(graph, pattern, anchor) of a trip case (None: the plain graph); ``mutate=False``: unmutated."""
    g = planned(**(t.config if t else {}))
    if t is not None and mutate and t.mutate:
        t.mutate(g)
    return g, MatMulAdd(), parts(g)["add"]


def kernels(t: Trip) -> dict:
    """The kernel table of a force proof: the torch references (named: on a GPU the default would be Triton), or the
    mat-vec, single and fused, on Triton for the FFN's down projection (64 rows; the other products on torch: the
    interpreter pays per program)."""
    if t.kernels == "torch":
        return backends.TORCH_BACKEND
    return triton_for((Op.MUL_MAT, Op.MUL_MAT_ADD), where=lambda n: "ffn_down" in n.src[0].name)


def unguard(t: Trip, monkeypatch) -> None:
    """Forcing rule 8's overlap: the launcher refuses it too (a second line of defence), so the proof runs the kernel
    without its guard."""
    if t.kernels == "triton":
        monkeypatch.setattr(triton_matvec, "_alias_ok", lambda *a, **k: None)
