"""MOE_ROUTER beyond its rule tests (tests/patterns/test_rules.py) and its kernel's (test_moe_router_kernel.py): the
fused tiny-qwen35moe graph byte-identical to the unfused one on torch and on Triton (the interpreter here), one
program a tile at 4 tokens and serial at 8 (gallocr puts the DIV in the logits); ``gdnpass run --gguf --check`` on a
tiny file; llama.cpp's own captured qwen35moe verify."""

import pytest

from gdnpass import cli, pipeline
from gdnpass.check import check_fusion
from gdnpass.ir import Op
from gdnpass.fusion import fuse
from gdnpass.kernels.backends import TORCH_BACKEND, programs
from gdnpass.models import VerifyConfig
from support.graphs import triton_for

from patterns.moe_router.trips import ROUTER_OPS

gguf = pytest.importorskip("gguf")


def _graph(n_t: int, whole: bool = False):
    """The planned unfused graph: the first layer's, or the whole forward (4 layers, attention's too)."""
    cfg = VerifyConfig("tiny-qwen35moe", n_t, 3, whole=True) if whole else VerifyConfig("tiny-qwen35moe", n_t, 3,
                                                                                           n_layers=1)
    return pipeline.run(cfg, pipeline.PassOptions(fusion=True), fuse_now=False).graph


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("n_t,serial", [(4, False), (8, True)])
def test_the_fused_router_is_byte_identical(backend, n_t, serial, device):
    """check_fusion of the 1-layer graph: the router's ops on ``backend`` (Triton: only the router's, the
    interpreter pays per program), both outputs compared."""
    table = triton_for(ROUTER_OPS, where=lambda n: "ffn_moe" in n.name) if backend == "triton" else TORCH_BACKEND
    g = _graph(n_t)
    out = check_fusion(g, device, backend=table)  # (leaves g fused)
    assert out.identical, [c.to_json() for c in out.compared if not c.identical]
    (node,) = [n for n in g.nodes if n.op is Op.MOE_ROUTER]
    assert node.op_params["serial"] is serial
    assert {"ffn_moe_argsort-0", "ffn_moe_weights_norm-0"} <= {c.name for c in out.compared}


def test_the_fused_node():
    """What the pass writes in the whole 4-layer graph: one MOE_ROUTER a layer, at the DIV, reading the logits,
    writing the DIV's memory and the ARGSORT's; five launches fewer a layer; serial from 8 tokens."""
    for n_t, serial in ((4, False), (8, True)):
        g = _graph(n_t, whole=True)
        router = lambda: sum(n.op in ROUTER_OPS and "ffn_moe" in n.name for n in g.nodes)  # noqa: E731
        before = router()
        fuse(g, enabled=True)
        fused = [n for n in g.nodes if n.op is Op.MOE_ROUTER]
        assert len(fused) == 4 and before == 4 * 6 and router() == 4  # six launches a layer, then one
        for n in fused:
            assert n.src[0].op is Op.MUL_MAT and n.outs[0].name.startswith("ffn_moe_argsort")
            assert n.view_src.name.startswith("ffn_moe_weights_norm") and n.op_params["serial"] is serial
            assert n.op_params["n_used"] == 2 and n.op_params["min"] == 6.103515625e-5
            assert programs(n) == [("moe_router", 1, 1)]  # (8 experts: a tile holds 128 tokens)


def test_run_check_on_a_tiny_moe_file(tmp_path, capsys):
    """``gdnpass run --gguf FILE --check`` (torch, the file's first layer): the router fused, identical."""
    from gdnpass.models.gguf_write import write_gguf

    path = write_gguf("tiny-qwen35moe", tmp_path / "moe.gguf", wtype="f32", seed=1)
    assert cli.main(["run", "--gguf", str(path), "--tokens", "8", "--rs-seq", "3", "--layers", "1", "--check"]) == 0
    out = capsys.readouterr().out
    assert "moe_router" in out and " 0 differing" in out and "DIFFERS" not in out, out
    assert "identical  ffn_moe_weights_norm-0" in out and "identical  ffn_moe_argsort-0" in out, out


def test_llama_cpp_s_moe_graph_fuses_its_routers(llama, tmp_path):
    """On llama.cpp's own qwen35moe verify graph and plan (4 and 8 tokens), every layer's router fuses, and the
    fused graph is byte-identical to the unfused one (torch)."""
    from gdnpass.frontends.llama import capture
    from gdnpass.models.gguf_write import write_gguf

    path = write_gguf("tiny-qwen35moe", tmp_path / "moe.gguf", wtype="f32", seed=1)
    for n_t in (4, 8):
        c = capture.capture(path, capture.Settings(n_tokens=n_t, n_rs_seq=3, n_ubatch=8, n_batch=8), install=llama)
        out = check_fusion(c.verify)
        routers = [a for a in out.report.applied if a.pattern == "moe_router"]
        assert out.identical and len(routers) == 4, [r.describe() for r in out.report.refused
                                                     if r.pattern == "moe_router"]

