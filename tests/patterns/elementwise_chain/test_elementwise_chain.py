"""ELEMENTWISE_CHAIN's own tests, beside the generic ones every registered pattern runs (tests/patterns/test_rules.py,
on this folder's trips.py): the kernel against its torch reference bit for bit over every step kind and operand
order; the launcher's own guard against rule 6's overlap; the plain graph (an in-place chain) fused byte-identically
on the torch references and on the Triton kernels; the chains of a Qwen3.5 graph; launches and programs."""

import pytest

from gdnpass.check import check_fusion
from gdnpass.errors import KernelError
from gdnpass.fusion import fuse
from gdnpass.ir import Op
from gdnpass.kernels import backends
from gdnpass.kernels import triton_elementwise as elt
from gdnpass.models import VerifyConfig
from gdnpass.patterns.elementwise_chain import ElementwiseChain
from gdnpass.patterns.elementwise_chain.record import reference
from patterns.elementwise_chain.trips import NE0, OPS, ROWS, TRIPS, candidate, kernels, nodes
from patterns.elementwise_chain.trips import build as build_trip
from support.arena import Arena, rnd
from support.compare import assert_bits
from support.graphs import triton_for
from support.trips import Only


@pytest.mark.parametrize("steps", [["ADD", "SOFTPLUS", "MUL"], ["SILU", "RMUL"], ["SIGMOID", "RADD", "EXP", "MUL"],
                                   ["MUL", "SILU"]], ids="-".join)
def test_the_kernel_is_its_reference_bit_for_bit(steps, kernel_exp):
    """Each step the unfused kernel's own expression: the bits of the references' step-by-step result, with side
    operands that broadcast (src1 steps: a row, a column) and ones of the full shape (src0 steps), values spanning
    SOFTPLUS's > 20 branch and EXP's range, strided x and output (in the interpreter the reference takes numpy's
    exp and log, the kernels': the ``kernel_exp`` fixture)."""
    a = Arena(1 << 20)
    shape = (1, 2, 3, 40)
    x = a.put(rnd(*shape) * 12, row_stride=48)
    sides = []
    for i, s in enumerate(st for st in steps if st in ("ADD", "MUL", "RADD", "RMUL")):
        full = s.startswith("R")
        sides.append(a.put(rnd(*(shape if full else (1, 1, 1, 40) if i == 0 else (1, 2, 3, 1)))))
    out = a.view(shape)
    a.run(lambda: elt.elementwise_chain(steps, x, sides, out), out)
    assert_bits(out, reference(steps, x, sides), " -> ".join(steps))


def test_the_launcher_refuses_a_chain_outside_its_scope():
    a = Arena()
    x, b, out = a.put(rnd(1, 1, 2, 8)), a.put(rnd(1, 1, 1, 8)), a.view((1, 1, 2, 8))
    with pytest.raises(KernelError, match="outside the kernel's scope"):
        elt.elementwise_chain(["ADD", "TANH"], x, [b], out)
    with pytest.raises(KernelError, match="outside the kernel's scope"):
        elt.elementwise_chain(["ADD", "MUL"], x, [b], out)  # two binary steps, one side operand


@pytest.mark.parametrize("t", [t for t in TRIPS if t.kernels == "triton"], ids=lambda t: t.id)
def test_the_launcher_refuses_the_forced_overlap_too(t, device):
    """A second line of defence: forced past rule 6, the fused launcher's own guard refuses the overlap (the force
    proof in tests/patterns/test_rules.py runs the kernel without it, trips.unguard)."""
    g, p, anchor = candidate(t)
    with pytest.raises(KernelError, match="overlaps an input other than element for element"):
        check_fusion(g, device, patterns=[Only(p, anchor)], force=True, backend=kernels(t))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fuses_byte_identically(backend, device):
    """The plain graph is an in-place chain (each node over the one before): the case rule 6 allows."""
    g = build_trip()
    n = nodes(g)
    assert n["gate-0"].offset == n["a_softplus-0"].offset == n["alpha-0 (add)"].offset == n["pre"].offset
    res = check_fusion(g, device, backend=None if backend == "torch" else triton_for(OPS))
    assert [a.pattern for a in res.report.applied] == ["elementwise_chain"] and res.identical
    fused = next(x for x in g.nodes if x.op is Op.ELEMENTWISE_CHAIN)
    assert fused.view_src is n["gate-0"] and fused.op_params["steps"] == ["ADD", "SOFTPLUS", "MUL"]
    assert [s.name for s in fused.src] == ["pre", "blk.0.ssm_dt.bias", "blk.0.ssm_a"]
    assert {c.name for c in res.compared} == {"gate-0", "l_out-0"}  # the chain's interior is left out


def test_the_chains_of_a_qwen35_graph():
    """tiny-qwen35's whole verify, after the other patterns: per GDN layer the gate (ADD -> SOFTPLUS -> MUL, which
    gdn_gates then has the GDN compute, with beta's SIGMOID) and the output gate (SILU -> MUL by the normed output,
    its src0, which mul_mat_chain then has the z product's store run), in the attention layer the output's SIGMOID
    gate."""
    from gdnpass import pipeline
    from gdnpass.patterns import matchers

    cfg = VerifyConfig("tiny-qwen35", 4, 3, whole=True)
    g = pipeline.run(cfg, pipeline.PassOptions(fusion=True), fuse_now=False).graph
    fuse(g, enabled=True, patterns=[m for m in matchers() if m.name not in ("gdn_gates", "mul_mat_chain")])
    chains = [n.op_params["steps"] for n in g.nodes if n.op is Op.ELEMENTWISE_CHAIN]
    assert chains == [["ADD", "SOFTPLUS", "MUL"], ["SILU", "RMUL"]] * 3 + [["SIGMOID", "RMUL"]]
    res = pipeline.run(cfg, pipeline.PassOptions(fusion=True))
    chains = [n.op_params["steps"] for n in res.graph.nodes if n.op is Op.ELEMENTWISE_CHAIN]
    gates = [(n.op_params["g_steps"], n.op_params["beta_steps"]) for n in res.graph.nodes
             if n.op is Op.GATED_DELTA_NET_CACHE]
    products = [n.op_params["steps"] for n in res.graph.nodes if n.op is Op.MUL_MAT_CHAIN]
    assert chains == [["SIGMOID", "RMUL"]] and products == [["SILU", "RMUL"]] * 3
    assert gates == [(["ADD", "SOFTPLUS", "MUL"], ["SIGMOID"])] * 3


def test_launches_and_cost():
    g = build_trip()
    before = sum(1 for n in g.nodes if n.op in (Op.ADD, Op.MUL, Op.UNARY))
    fuse(g, enabled=True, patterns=[ElementwiseChain()])
    (fused,) = [n for n in g.nodes if n.op is Op.ELEMENTWISE_CHAIN]
    assert before == 3 and not [n for n in g.nodes if n.op in (Op.ADD, Op.MUL, Op.UNARY)]
    assert backends.programs(fused) == [("elementwise_chain", -(-NE0 * ROWS // elt.ELT_BLOCK), 1)]
