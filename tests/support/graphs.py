"""Small verify graphs for the fusion tests (patterns/*/test_fusion, patterns/conv_chain/test_dedup): built and
planned, and the assert on a ``check_fusion`` result."""

from gdnpass.alloc import plan
from gdnpass.ir import Op
from gdnpass.kernels import backends
from gdnpass.patterns.conv_chain import ConvChain
from gdnpass.models import VerifyConfig, build_verify_graph

CHAIN = [ConvChain()]  # the conv-chain pattern alone


def planned(model="tiny-dc4-h64", n_t=4, n_rs=3, **kw):
    """(cfg, graph): a verify graph of ``model`` with 1 layer and 2 recurrent cells unless ``kw`` (VerifyConfig
    fields) says otherwise, built and planned (no fusion hints)."""
    cfg = VerifyConfig(model, n_t, n_rs, **{"n_layers": 1, "mem_size": 2, **kw})
    g = build_verify_graph(cfg)
    plan(g)
    return cfg, g


def assert_identical(res, applied=1, compared=()):
    """A ``check_fusion`` result: ``applied`` rewrites, every compared tensor byte-identical between the unfused and
    the fused run, at least 5 tensors compared, the ones named in ``compared`` among them."""
    assert len(res.report.applied) == applied, res.report.summary()
    bad = [c for c in res.compared if not c.identical]
    assert not bad, [c.to_json() for c in bad]
    assert len(res.compared) >= 5
    names = {c.name for c in res.compared}
    assert set(compared) <= names, sorted(set(compared) - names)


# The ops of the conv chain, unfused and fused: the interpreter tests run these on Triton and the rest of the graph
# on torch (each fused kernel is byte-identical to its unfused Triton kernels, not to torch's; the FFN's products
# would take seconds per launch in the interpreter).
CHAIN_OPS = (Op.SSM_CONV, Op.UNARY, Op.L2_NORM, Op.RMS_NORM, Op.SCALE, Op.GDN_CONV_CHAIN)


def triton_for(ops, where=None) -> dict:
    """A kernel table: torch, with the Triton kernels of ``ops`` (only for the nodes ``where(node)`` holds, if given:
    the interpreter costs ~30 ms a program)."""
    def kernel(op):
        if where is None:
            return backends.TRITON_BACKEND[op]

        def run(n, views, out):
            (backends.TRITON_BACKEND if where(n) else backends.TORCH_BACKEND)[op](n, views, out)
        return run

    return {**backends.TORCH_BACKEND, **{op: kernel(op) for op in ops}}
