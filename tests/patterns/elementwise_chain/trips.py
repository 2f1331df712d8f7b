"""Trip graphs of the ELEMENTWISE_CHAIN rules: a small planned graph that fuses, and one mutation per rule that breaks
that rule alone (tests/patterns/test_rules.py runs them, with every registered pattern's).

The graph: ``x`` (an INPUT) -> SCALE ``pre`` -> ADD a bias -> SOFTPLUS -> MUL by a weight (the GDN gate's chain)
-> SCALE ``l_out-0`` (the output ``run --check`` compares); ``ROWS`` rows of ``NE0``: three programs of the
elementwise tile, so that a program overwriting the next one's elements shows in the interpreter. gallocr makes the
chain in place (each node over the one before), the case rule 6 allows; the hazard mutations move tensors to fresh
bytes past the arena's end.
"""

from __future__ import annotations

from gdnpass import ops
from gdnpass.ir import DType, Flag, Graph, Op, Tensor
from gdnpass.kernels import backends
from gdnpass.kernels import triton_elementwise as elt
from gdnpass.patterns.elementwise_chain import ElementwiseChain
from support.graphs import triton_for
from support.trips import Trip, fresh, insert_after, nodes, planned_graph

NE0, ROWS = 64, 40  # 2560 elements: programs of ELT_BLOCK = 1024
OPS = (Op.ADD, Op.MUL, Op.UNARY, Op.ELEMENTWISE_CHAIN)  # the Triton kernels of a "triton" force proof


def build(inplace: bool = False, extra_user: bool = False, extra_add: bool = False) -> Graph:
    """The graph, planned (not fused)."""
    x = ops.new_tensor("x", DType.F32, (NE0, ROWS), buffer="input", flags=Flag.INPUT)
    bias = ops.new_tensor("blk.0.ssm_dt.bias", DType.F32, (NE0,), buffer="weights")
    a = ops.new_tensor("blk.0.ssm_a", DType.F32, (NE0,), buffer="weights")
    pre = ops.scale(x, 0.5)
    pre.name = "pre"
    y = ops.add(pre, bias)
    y.name = "alpha-0 (add)"
    sp = ops.softplus(y)
    sp.name = "a_softplus-0"
    last = ops.mul(sp, a, inplace=inplace)
    last.name = "gate-0"
    if extra_add:
        c = ops.new_tensor("blk.0.extra", DType.F32, (NE0,), buffer="weights")
        last = ops.add(last, c)
        last.name = "gate-0 (add)"
    return planned_graph(last, sp if extra_user else None)


# ---- one mutation per rule --------------------------------------------------------------------------------------


def m_weight_f16(g):
    w = nodes(g)["gate-0"].src[1]
    w.type = DType.F16
    w.nb = (2, 2 * w.ne[0], 2 * w.ne[0], 2 * w.ne[0])


def m_weight_as_src0(g):
    """MUL(a, softplus): the weight as src0, where it would have to have the chain's shape (ggml repeats src1 only)."""
    mul = nodes(g)["gate-0"]
    mul.src = [mul.src[1], mul.src[0]]


def m_unary_tanh(g):
    """A UNARY kind the kernel does not compute in the middle of the chain."""
    nodes(g)["a_softplus-0"].op_params["kind"] = "TANH"


def m_softplus_output(g):
    nodes(g)["a_softplus-0"].flags |= Flag.OUTPUT


def m_output_one_program_on(g):
    """x (pre) and the interior on fresh bytes, the chain's output one program's elements (ELT_BLOCK) further on:
    program p writes what program p+1 reads as x (pre is dead when the unfused MUL runs: harmless unfused)."""
    n = nodes(g)
    fresh(g, n["alpha-0 (add)"])
    fresh(g, n["a_softplus-0"])
    at = fresh(g, n["pre"])
    fresh(g, n["gate-0"], at + 4 * elt.ELT_BLOCK)


def m_interior_read_later(g):
    """The SOFTPLUS and the product on fresh bytes of their own, and after the MUL a node reading the SOFTPLUS's bytes
    through a tensor of its own (an arena leaf at its offset: no graph edge), feeding an output."""
    n = nodes(g)
    sp, mul = n["a_softplus-0"], n["gate-0"]
    fresh(g, sp)
    fresh(g, mul)
    alias = Tensor(name="softplus-bytes", type=DType.F32, ne=sp.ne, nb=sp.nb, buffer="arena", offset=sp.offset)
    reader = ops.scale(alias, 1.0)
    reader.name = "l_out-reader"
    reader.flags |= Flag.OUTPUT
    insert_after(g, mul, reader)
    g.leafs.append(alias)


TRIPS = [
    Trip("elt-chain.views", config=dict(inplace=True)),
    Trip("elt-chain.type", m_weight_f16),
    Trip("elt-chain.shape", m_weight_as_src0),
    Trip("scope.chain-length", m_unary_tanh),
    Trip("scope.chain-length", config=dict(extra_add=True), name="three-sides"),
    Trip("elt-chain.user-count", config=dict(extra_user=True)),
    Trip("elt-chain.user-count", m_softplus_output, name="output"),
    Trip("elt-chain.output-overlaps-input", m_output_one_program_on, kernels="triton"),
    Trip("elt-chain.interior-read-later", m_interior_read_later),
]


def candidate(t: Trip | None = None, mutate: bool = True):
    """(graph, pattern, anchor) of a trip case (None: the plain graph); ``mutate=False``: unmutated."""
    g = build(**(t.config if t else {}))
    if t is not None and mutate and t.mutate:
        t.mutate(g)
    pattern = ElementwiseChain()
    (anchor,) = pattern.candidates(g)
    return g, pattern, anchor


def kernels(t: Trip):
    """The kernel table of a force proof: the torch references (named: on a GPU the default would be Triton), or the
    ADD, MUL, UNARY and fused Triton kernels."""
    return backends.TORCH_BACKEND if t.kernels == "torch" else triton_for(OPS)


def unguard(t: Trip, monkeypatch) -> None:
    """Forcing rule 6's overlap: the launcher's own guard refuses it too (its test in test_elementwise_chain.py), so
    the proof runs the kernel without it."""
    if t.kernels == "triton":
        monkeypatch.setattr(elt, "_alias_ok", lambda *a, **k: None)
