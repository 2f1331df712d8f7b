"""Trip graphs of the RMS_NORM_MUL rules: a small planned graph that fuses, and one mutation per rule that breaks
that rule alone (tests/patterns/test_rules.py runs them, with every registered pattern's).

The graph: ``x`` (an INPUT) -> SCALE -> RMS_NORM -> MUL by a weight [-> ADD a residual] -> SCALE ``l_out-0`` (the
output ``run --check`` compares), ``ROWS`` rows of ``NE0``: two programs of the kernel's tile, so that a program
overwriting the next one's rows shows in the interpreter. gallocr makes the chain in place (the norm over the
SCALE, the MUL over the norm), the case rule 8 allows; the hazard mutations move tensors to fresh bytes past the
arena's end.
"""

from __future__ import annotations

from gdnpass import ops
from gdnpass.ir import DType, Flag, Graph, Op, Tensor
from gdnpass.kernels import backends
from gdnpass.patterns.rms_norm_mul import RmsNormMul, kernel
from gdnpass.patterns.rms_norm_mul.scope import ROW_MAX
from support.graphs import triton_for
from support.trips import Trip, fresh, insert_after, nodes, planned_graph

NE0, ROWS, EPS = 64, 12, 1e-6
OPS = (Op.RMS_NORM, Op.MUL, Op.ADD, Op.RMS_NORM_MUL)  # the Triton kernels of a "triton" force proof


def build(ne0: int = NE0, rows: int = ROWS, add: bool = False, inplace_mul: bool = False,
          extra_user: bool = False) -> Graph:
    """The graph, planned (not fused)."""
    x = ops.new_tensor("x", DType.F32, (ne0, rows), buffer="input", flags=Flag.INPUT)
    w = ops.new_tensor("blk.0.attn_norm.weight", DType.F32, (ne0,), buffer="weights")
    pre = ops.scale(x, 0.5)
    pre.name = "pre"
    norm = ops.rms_norm(pre, EPS)
    norm.name = "norm-0"
    y = ops.mul(norm, w, inplace=inplace_mul)
    y.name = "attn_norm-0"
    last = y
    if add:
        r = ops.new_tensor("residual", DType.F32, (ne0, rows), buffer="input", flags=Flag.INPUT)
        last = ops.add(y, r)
        last.name = "attn_norm_res-0"
    return planned_graph(last, norm if extra_user else None)


# ---- one mutation per rule --------------------------------------------------------------------------------------


def m_node_between(g):
    """A SCALE of x between the norm and its MUL (a node of its own, on fresh bytes)."""
    n = nodes(g)
    insert_after(g, n["norm-0"], ops.scale(n["pre"], 1.0))


def m_weight_f16(g):
    w = nodes(g)["attn_norm-0"].src[1]
    w.type = DType.F16
    w.nb = (2, 2 * w.ne[0], 2 * w.ne[0], 2 * w.ne[0])


def m_norm_as_src1(g):
    """MUL(w, norm): the norm as src1 of a weight that would have to repeat into it."""
    mul = nodes(g)["attn_norm-0"]
    mul.src = [mul.src[1], mul.src[0]]


def m_weight_strided(g):
    """Weight elements 8 bytes apart (a view of every other element)."""
    w = nodes(g)["attn_norm-0"].src[1]
    w.nb = (8, 8 * w.ne[0], 8 * w.ne[0], 8 * w.ne[0])
    g.buffers["weights"] = max(g.buffers["weights"], w.offset + w.nbytes)


def m_norm_output(g):
    nodes(g)["norm-0"].flags |= Flag.OUTPUT


def m_output_one_row_on(g):
    """x on fresh bytes and the product one row further on: program p writes what program p+1 reads as x (x is
    dead when the unfused MUL runs, so unfused this is harmless)."""
    n = nodes(g)
    fresh(g, n["norm-0"])
    at = fresh(g, n["pre"])
    fresh(g, n["attn_norm-0"], at + 4 * NE0)


def m_norm_bytes_read_later(g):
    """The norm and the product on fresh bytes of their own, and after the MUL a node reading the norm's bytes
    through a tensor of its own (an arena leaf at the norm's offset: no graph edge), feeding an output."""
    n = nodes(g)
    norm, mul = n["norm-0"], n["attn_norm-0"]
    fresh(g, norm)
    fresh(g, mul)
    alias = Tensor(name="norm-bytes", type=DType.F32, ne=norm.ne, nb=norm.nb, buffer="arena", offset=norm.offset)
    reader = ops.scale(alias, 1.0)
    reader.name = "l_out-reader"
    reader.flags |= Flag.OUTPUT
    insert_after(g, mul, reader)
    g.leafs.append(alias)


TRIPS = [
    Trip("rms-mul.adjacent", m_node_between),
    Trip("rms-mul.views", config=dict(inplace_mul=True)),
    Trip("rms-mul.type", m_weight_f16),
    Trip("rms-mul.shape", m_norm_as_src1),
    Trip("rms-mul.contiguous-rows", m_weight_strided),
    Trip("scope.row-size", config=dict(ne0=ROW_MAX + 1, rows=1)),
    Trip("rms-norm.user-count", config=dict(extra_user=True)),
    Trip("rms-norm.user-count", m_norm_output, name="output"),
    Trip("rms-mul.output-overlaps-input", m_output_one_row_on, kernels="triton"),
    Trip("rms-mul.interior-read-later", m_norm_bytes_read_later),
]


def candidate(t: Trip | None = None, mutate: bool = True):
    """(graph, pattern, anchor) of a trip case (None: the plain graph); ``mutate=False``: unmutated."""
    g = build(**(t.config if t else {}))
    if t is not None and mutate and t.mutate:
        t.mutate(g)
    pattern = RmsNormMul()
    (anchor,) = [c for c in pattern.candidates(g) if c.op is Op.RMS_NORM]
    return g, pattern, anchor


def kernels(t: Trip):
    """The kernel table of a force proof: the torch references (named: on a GPU the default would be Triton), or the
    norm, MUL, ADD and fused Triton kernels."""
    return backends.TORCH_BACKEND if t.kernels == "torch" else triton_for(OPS)


def unguard(t: Trip, monkeypatch) -> None:
    """Forcing rule 8's overlap: the launcher's own guard refuses it too (a second line of defence, its test in
    test_rms_norm_mul_rules.py), so the proof runs the kernel without it."""
    if t.kernels == "triton":
        monkeypatch.setattr(kernel, "_alias_ok", lambda *a, **k: None)
