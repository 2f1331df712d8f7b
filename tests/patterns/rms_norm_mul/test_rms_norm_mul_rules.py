"""RMS_NORM_MUL's own rule tests, beside the generic ones every registered pattern runs (tests/patterns/test_rules.py,
on this folder's trips.py: each rule tripped alone, each hazard shown to corrupt bytes when the rewrite is forced past
it): the launcher's own guard against rule 8's overlap; the plain graph, its in-place chain and the joined ADD fused
byte-identically on the torch references and on the Triton kernels (the interpreter, without a GPU)."""

import pytest

from gdnpass.check import check_fusion
from gdnpass.errors import KernelError
from gdnpass.fusion import fuse
from gdnpass.ir import Flag, Op
from gdnpass.kernels import backends
from gdnpass.patterns.common import Context, violations
from gdnpass.patterns.rms_norm_mul import RmsNormMul
from patterns.rms_norm_mul.trips import OPS, TRIPS, build, candidate, kernels, nodes
from support.graphs import triton_for
from support.trips import Only


@pytest.mark.parametrize("t", [t for t in TRIPS if t.kernels == "triton"], ids=lambda t: t.id)
def test_the_launcher_refuses_the_forced_overlap_too(t, device):
    """A second line of defence: forced past rule 8, the fused launcher's own guard refuses the overlap (the force
    proof in tests/patterns/test_rules.py runs the kernel without it, trips.unguard)."""
    g, p, anchor = candidate(t)
    with pytest.raises(KernelError, match="overlaps an input other than element for element"):
        check_fusion(g, device, patterns=[Only(p, anchor)], force=True, backend=kernels(t))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("config", [{}, dict(add=True)], ids=["mul", "mul+add"])
def test_fuses_byte_identically(config, backend, device):
    """The plain graph is an in-place chain (norm over its input, MUL over the norm): the case rule 8 allows."""
    g = build(**config)
    n = nodes(g)
    last = n["attn_norm_res-0" if config else "attn_norm-0"]
    assert n["norm-0"].offset == n["pre"].offset and last.offset == n["pre"].offset  # gallocr's in-place chain
    res = check_fusion(g, device, backend=None if backend == "torch" else triton_for(OPS))
    assert [a.pattern for a in res.report.applied] == ["rms_norm_mul"] and res.identical
    fused = next(x for x in g.nodes if x.op is Op.RMS_NORM_MUL)
    assert fused.view_src is last and len(fused.src) == (3 if config else 2)
    assert {c.name for c in res.compared} == {last.name, "l_out-0"}  # (with the ADD, the MUL is interior)


def test_the_add_joins_only_when_it_alone_reads_the_mul():
    g = build(add=True)
    mul = nodes(g)["attn_norm-0"]
    p = RmsNormMul()
    assert p.capture(g, nodes(g)["norm-0"], Context(g)).add is not None
    mul.flags |= Flag.OUTPUT  # now the host may read the MUL
    c = p.capture(g, nodes(g)["norm-0"], Context(g))
    assert c.add is None and c.last is mul  # RMS_NORM+MUL, the ADD stays (as ggml-cuda falls back to two ops)
    assert violations(p, g, nodes(g)["norm-0"], Context(g)) == []


def test_launches_and_cost():
    g = build(add=True)
    before = sum(1 for n in g.nodes if n.op in (Op.RMS_NORM, Op.MUL, Op.ADD))
    fuse(g, enabled=True, patterns=[RmsNormMul()])
    (fused,) = [n for n in g.nodes if n.op is Op.RMS_NORM_MUL]
    assert before == 3 and not [n for n in g.nodes if n.op in (Op.RMS_NORM, Op.MUL, Op.ADD)]
    assert backends.programs(fused) == [("rms_norm_mul", 2, 1)]  # 12 rows of 64: two programs of 8 rows
