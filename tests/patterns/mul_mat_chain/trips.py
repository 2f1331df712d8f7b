"""Trip graphs of the MUL_MAT_CHAIN rules (tests/patterns/test_rules.py runs them, with every registered pattern's):
the GDN output gate of the small planned verify graph (tests/support/surgery.py: one layer, n_t 4), fused by every
pattern that runs before this one (its gate chain ``MUL(norm, SILU(z))`` an ELEMENTWISE_CHAIN of steps [SILU, RMUL]
over ``z-0 (reshaped)``, in place on its side operand, the RMS_NORM_MUL's normalised GDN output), then one mutation
per rule that breaks that rule and no other; for every hazard a graph where forcing the rewrite past it corrupts
bytes.

``mul-mat-chain.output-overlaps-input`` is a race between the programs of one Triton launch (a program storing its
rows of the gated output over the x later programs still read): its proof runs the z product, the chain and the fused
node on Triton in the interpreter (the rest of the graph on torch), with the launcher's own overlap guard switched
off (``unguard``), on the smallest z at hand (tiny-dc4-h32's: the interpreter pays per program). (An output over a
side operand, not element for element, is the chain's own elt-chain.output-overlaps-input: this pattern takes the
chain on the plan where that rule held.)
"""

from __future__ import annotations

from gdnpass import ops
from gdnpass.fusion import fuse
from gdnpass.ir import DType, Flag, Graph, Op
from gdnpass.kernels import backends, triton_matvec
from gdnpass.patterns import REGISTRY
from gdnpass.patterns.mul_mat_add.matcher import product_of
from gdnpass.patterns.mul_mat_chain import RECORD, MatMulChain
from support.graphs import triton_for
from support.surgery import insert_after, planned, read_bytes_of
from support.trips import Trip, fresh, spread_columns

BEFORE = [p.matcher for p in REGISTRY[:[p.name for p in REGISTRY].index("mul_mat_chain")]]  # the earlier patterns
GATE = "attn_gate"  # z's weight: blk.<i>.attn_gate.weight


def prepared(**config) -> Graph:
    """The planned graph fused by every pattern before this one (what this pattern's candidates come from: the
    elementwise_chain pattern's ELEMENTWISE_CHAIN nodes, after RMS_NORM_MUL took the norm's MUL)."""
    g = planned(**config)
    fuse(g, enabled=True, patterns=[m() for m in BEFORE])
    return g


def parts(g: Graph) -> dict:
    """The output gate's chain node, its product (z), the product's view, x, the weight, the chain's output and its
    side operand."""
    chain = next(n for n in g.nodes if n.op is Op.ELEMENTWISE_CHAIN and product_of(n.src[0]) is not None
                 and GATE in product_of(n.src[0]).src[0].name)
    mm = product_of(chain.src[0])
    return dict(chain=chain, mm=mm, view=chain.src[0] if chain.src[0] is not mm else None, x=mm.src[1], w=mm.src[0],
                out=chain.view_src, side=chain.src[1])


# ---- one mutation per rule ------------------------------------------------------------------------------------------


def m_permuted_view(g):
    """The product's RESHAPE walks it out of order: its dims 1 and 2 swapped (the same bytes, each once)."""
    v = parts(g)["view"]
    n0, n1, n2 = v.ne[:3]
    v.nb = (4, 4 * n0 * n2, 4 * n0, 4 * n0 * n1 * n2)


def m_x_f16(g):
    parts(g)["x"].type = DType.F16


def m_out_strided(g):
    """The chain's output with its columns twice as far apart as its rows need (fresh bytes)."""
    spread_columns(g, parts(g)["out"])


def m_side_strided(g):
    """The side operand (the RMS_NORM_MUL's output, which the chain's output was in place on) with its columns twice
    as far apart as its rows need (fresh bytes)."""
    spread_columns(g, parts(g)["side"])


def m_side_shape(g):
    """The side operand packed but in another shape ([rows, tokens]: the product's) than the output's
    [head_dim, heads, tokens]."""
    side = parts(g)["side"]
    rows = side.ne[0] * side.ne[1]
    ne = (rows, side.nelements // rows, 1, 1)
    side.ne, side.nb = ne, (4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1])


def m_product_output(g):
    parts(g)["mm"].flags |= Flag.OUTPUT


def m_product_read(g):
    """A second reader of the product, right after it."""
    p = parts(g)
    insert_after(g, p["mm"], ops.scale(p["mm"], 1.0))


def m_chain_output(g):
    """The chain node flagged OUTPUT (the rewrite removes it; its memory, the output, stays). Neither this nor the
    reader below is a graph the pass makes (the elementwise rewrite gives its node no reader and no flag but COMPUTE),
    and both fuse byte-identically past the rule: the node is a view at offset 0, in the output's ne and nb, of the
    output the fused node writes."""
    parts(g)["chain"].flags |= Flag.OUTPUT


def m_chain_read(g):
    """A node reading the chain node itself (not its output tensor), right after it."""
    p = parts(g)
    insert_after(g, p["chain"], ops.scale(p["chain"], 1.0))


def m_x_written_between(g):
    """A node between the product and the chain scales x in place (the unfused product read x before it)."""
    p = parts(g)
    insert_after(g, p["mm"], ops.scale(p["x"], 2.0, inplace=True))


def m_out_over_x(g):
    """x moved to fresh bytes, the chain's output right behind x's first column, so it overlaps x's other columns
    (two tokens at least; x is dead after the product: the unfused graph is sound) and no side operand: the fused
    node's first program stores its rows over x before the next reads it."""
    p = parts(g)
    x, out = p["x"].base, p["out"]
    at = fresh(g, x)
    fresh(g, out, at + 4 * x.ne[0])


def m_product_read_later(g):
    """After the chain a node reads the product's bytes through a tensor of its own (an arena leaf at their offset:
    no graph edge): an ADD of them to themselves (an ADD: the check compares every ADD)."""
    p = parts(g)
    read_bytes_of(g, p["mm"], p["chain"])


def m_product_read_between(g):
    """Between the product and the chain a node reads the product's bytes through a tensor of its own (as
    m_product_read_later: no graph edge, so the user count does not see it); fused, they are never written."""
    p = parts(g)
    read_bytes_of(g, p["mm"], p["mm"])


def m_product_as_side(g):
    """The chain's side operand is the product's own view (the gate as ``MUL(z, SILU(z))``): the fused node would
    read the product's bytes, which it never writes."""
    p = parts(g)
    p["chain"].src[1] = p["view"] if p["view"] is not None else p["mm"]


TRIPS = [
    Trip("mul-mat-chain.product", m_permuted_view),
    Trip("mul-mat-chain.type", m_x_f16),
    Trip("mul-mat-chain.n-cols", config=dict(n_tokens=17, wtype="f32")),  # (over 16 columns of f32: torch's matmul)
    Trip("mul-mat-chain.layout", m_out_strided, name="output"),
    Trip("mul-mat-chain.layout", m_side_strided, name="side"),
    Trip("mul-mat-chain.layout", m_side_shape, name="side-shape"),
    Trip("mul-mat.user-count", m_product_output, name="output"),
    Trip("mul-mat.user-count", m_product_read, name="reader"),
    Trip("elt-chain.user-count", m_chain_output, name="output"),
    Trip("elt-chain.user-count", m_chain_read, name="reader"),
    Trip("between.writes-input", m_x_written_between),
    # (z of tiny-dc4-h32 is 64 rows, 8 tokens two rows a program: a grid of 32, not tiny-dc4-h64's 128 at 4 tokens)
    Trip("mul-mat-chain.output-overlaps-input", m_out_over_x, config=dict(model="tiny-dc4-h32", n_tokens=8),
         kernels="triton"),
    Trip("mul-mat-chain.product-read-later", m_product_as_side, name="side"),
    Trip("mul-mat-chain.product-read-later", m_product_read_later, name="later"),
    Trip("mul-mat-chain.product-read-later", m_product_read_between, name="between"),
]


def candidate(t: Trip | None = None, mutate: bool = True):
    """(graph, pattern, anchor) of a trip case (None: the plain graph); ``mutate=False``: unmutated."""
    g = prepared(**(t.config if t else {}))
    if t is not None and mutate and t.mutate:
        t.mutate(g)
    return g, MatMulChain(), parts(g)["chain"]


def kernels(t: Trip) -> dict:
    """The kernel table of a force proof: the torch references (named: on a GPU the default would be Triton), or
    the z product (unfused: its MUL_MAT and the chain's kernel; fused: MUL_MAT_CHAIN) on Triton, the rest on torch
    (the interpreter pays per program)."""
    if t.kernels == "torch":
        return backends.TORCH_BACKEND
    return triton_for((Op.MUL_MAT, Op.ELEMENTWISE_CHAIN, RECORD.op),
                      where=lambda n: n.op is not Op.MUL_MAT or GATE in n.src[0].name)


def unguard(t: Trip, monkeypatch) -> None:
    """Forcing rule 7's overlap: the launcher refuses it too (a second line of defence), so the proof runs the kernel
    without its guard."""
    if t.kernels == "triton":
        monkeypatch.setattr(triton_matvec, "_alias_ok", lambda *a, **k: None)
