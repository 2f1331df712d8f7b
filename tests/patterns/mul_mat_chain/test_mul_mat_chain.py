"""MUL_MAT_CHAIN beyond its rule tests (tests/patterns/test_rules.py): the fused kernel against the MUL_MAT and
ELEMENTWISE_CHAIN it replaces, byte for byte (the Triton ones in the interpreter here, compiled on a GPU: the sm_90
compile check builds its epilogue), in place on a side operand, through the split-K path, on quantized blocks and on
the GEMM, and against float64 math; the fused graph byte-identical to the unfused one; what the fused node is.

Everything lives in one NaN-poisoned uint8 arena and the kernels get strided views of it, as from the executor.
"""

import pytest
import torch

from gdnpass import pipeline
from gdnpass.check import check_fusion
from gdnpass.errors import KernelError
from gdnpass.fusion import fuse
from gdnpass.ir import DType, Op
from gdnpass.kernels import triton_matvec
from gdnpass.kernels.backends import TORCH_BACKEND, TRITON_BACKEND, programs
from gdnpass.kernels.quants import held_rows, random_blocks
from gdnpass.models import VerifyConfig, default_ids
from gdnpass.models.hparams import get_model
from gdnpass.patterns.elementwise_chain import ElementwiseChain
from gdnpass.patterns.mul_mat_chain import MatMulChain
from support.arena import DEVICE, Arena, assert_close, node, rnd
from support.compare import assert_same_bytes
from support.graphs import triton_for

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

WTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
GATE = ["SILU", "RMUL"]  # Qwen3.5's GDN output gate: norm * SiLU(z), z the product
CASES = ([("torch", w, n) for w in WTYPES for n in (1, 4)]
         + [("triton", w, n) for w in WTYPES for n in (1, 4)]
         + [("triton", "bf16", 20)])  # over 16 columns: the GEMM's store runs the steps


def _operands(a: Arena, wtype, n: int, M: int = 12, K: int = 200):
    w = a.put(rnd(1, 1, M, K).to(wtype))
    x = a.put(rnd(1, 1, n, K), row_stride=K + 24)  # columns with gaps
    return w, x, a.put(rnd(1, 1, n, M)), a.put(rnd(1, 1, n, M))


def _unfused(table, types, steps, w, x, sides, a: Arena, n: int, M: int):
    """The MUL_MAT then the ELEMENTWISE_CHAIN (itself byte-identical to the unfused nodes: its own tests)."""
    product, want = a.view((1, 1, n, M)), a.view((1, 1, n, M))
    table[Op.MUL_MAT](node(Op.MUL_MAT, types), [w, x], product)
    table[Op.ELEMENTWISE_CHAIN](node(Op.ELEMENTWISE_CHAIN, steps=steps), [product, *sides], want)
    return product, want


@pytest.mark.parametrize("backend,wtype,n", CASES, ids=[f"{b}-{w}-{n}" for b, w, n in CASES])
@pytest.mark.parametrize("in_place", [False, True], ids=["own-memory", "on-a-side"])
def test_fused_kernel_has_the_bytes_of_the_product_then_the_chain(backend, wtype, n, in_place):
    table = {"torch": TORCH_BACKEND, "triton": TRITON_BACKEND}[backend]
    a = Arena()
    w, x, norm, b = _operands(a, WTYPES[wtype], n)
    types = (DType.parse(wtype),)
    steps, sides = [*GATE, "ADD"], [norm, b]  # the gate, then a second side: both side slots
    product, want = _unfused(table, types, steps, w, x, sides, a, n, 12)
    gate = norm.clone()
    out = norm if in_place else a.view((1, 1, n, 12))
    a.run(lambda: table[Op.MUL_MAT_CHAIN](node(Op.MUL_MAT_CHAIN, types, steps=steps), [w, x, *sides], out), out)
    assert_same_bytes(out, want, "chain of the product")
    z = x.double() @ w.double().transpose(-1, -2)
    assert_close(out, (gate.double() * z * torch.sigmoid(z) + b.double()).float())


def test_split_k_store_runs_the_steps_on_the_summed_slices():
    """The split-K path (the last program of a row block adds the partials, then runs the steps), forced on a small
    product: the same tile unfused and fused."""
    a = Arena()
    w, x, norm, _ = _operands(a, torch.float32, 4, M=8, K=512)
    tile = triton_matvec.MatVecTile(block_m=4, cols=4, block_k=64, dot=False, warps=4, split_k=4)
    product, want, out = (a.view((1, 1, 4, 8)) for _ in range(3))
    triton_matvec._mat_vecs([(w, product)], x, tile=tile)
    TRITON_BACKEND[Op.ELEMENTWISE_CHAIN](node(Op.ELEMENTWISE_CHAIN, steps=GATE), [product, norm], want)
    a.run(lambda: triton_matvec._mat_vecs([(w, out)], x, tile=tile,
                                          epilogue=triton_matvec.Epilogue(tuple(GATE), (norm,))), out)
    assert_same_bytes(out, want, "split-K chain")


@pytest.mark.parametrize("dtype", [DType.Q8_0, DType.Q4_K], ids=lambda t: t.label)
def test_the_chain_on_quantized_blocks_is_the_products_chain(dtype):
    M, K, n = 16, 512, 3
    a = Arena(1 << 24)
    w = random_blocks(M, K, dtype, torch.Generator().manual_seed(0), 0.05)
    w = a.put(held_rows(w, dtype).view(1, 1, M, -1).to(DEVICE))
    x, norm = a.put(rnd(1, 1, n, K)), a.put(rnd(1, 1, n, M))
    _, want = _unfused(TRITON_BACKEND, (dtype,), GATE, w, x, [norm], a, n, M)
    out = a.view((1, 1, n, M))
    a.run(lambda: triton_matvec.mul_mat_vec_chain(w, x, GATE, [norm], out, dtype), out)
    assert_same_bytes(out, want, "chain of the quantized product")


def test_the_launcher_refuses_what_the_store_cannot_run():
    a = Arena()
    w, x, norm, _ = _operands(a, torch.float32, 4)
    out = a.view((1, 1, 4, 12))
    with pytest.raises(KernelError, match="mul_mat_vec_chain: the output overlaps an input"):
        triton_matvec.mul_mat_vec_chain(w, x, GATE, [norm], x[..., :12])
    with pytest.raises(KernelError, match=r"steps \['SILU', 'RMUL'\] with 0 side operands"):
        triton_matvec.mul_mat_vec_chain(w, x, GATE, [], out)
    with pytest.raises(KernelError, match="a side operand must be f32 and laid out as the output"):
        triton_matvec.mul_mat_vec_chain(w, x, GATE, [norm[..., :1].expand(1, 1, 4, 12)], out)


def _graph(n_t: int, rs: int):
    cfg = VerifyConfig(get_model("tiny-qwen35").first_layers(1), n_t, rs, whole=True)  # (one GDN layer)
    g = pipeline.run(cfg, pipeline.PassOptions(fusion=True), fuse_now=False).graph
    fuse(g, enabled=True, patterns=[ElementwiseChain()])  # (its nodes are what the pattern takes)
    return cfg, g


def _on_triton(n) -> bool:  # the GDN's products and chains, plain and fused (the other products stay on torch)
    return n.op is Op.ELEMENTWISE_CHAIN or n.src[0].name.split(".")[-2] in ("attn_gate", "ssm_alpha")


@pytest.mark.parametrize("n_t,rs", [(1, 0), (4, 3)], ids=["T1", "T4"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_fused_graph_is_byte_identical(n_t, rs, kernels, device):
    cfg, g = _graph(n_t, rs)
    table = "torch" if kernels == "torch" else triton_for((Op.MUL_MAT, Op.MUL_MAT_CHAIN, Op.ELEMENTWISE_CHAIN),
                                                          where=_on_triton)
    res = check_fusion(g, device=device, backend=table, patterns=[MatMulChain()], ids=default_ids(cfg))
    # the output gate's chain; the decay's (ADD dt_bias -> SOFTPLUS -> MUL ssm_a of the alpha product, unpaired
    # here) at one token, where its sides have its shape, refused at 4 (broadcast over the tokens)
    fused = {a.anchor: a.pattern for a in res.report.applied}
    assert fused.get("elementwise_chain(attn_output-0 (rms_norm) (mul) (mul))") == "mul_mat_chain", fused
    assert len(fused) == (2 if n_t == 1 else 1), res.report.summary()
    assert {r.rule for r in res.report.refused} <= {"mul-mat-chain.layout"}
    assert res.identical, [c.to_json() for c in res.compared if not c.identical]


def test_the_fused_node_is_a_view_of_the_chains_output_on_the_mat_vecs_grid():
    _, g = _graph(4, 3)
    chain = next(n for n in g.nodes if n.op is Op.ELEMENTWISE_CHAIN and n.op_params["steps"] == GATE)
    mm = chain.src[0].view_src
    want = programs(mm)
    fuse(g, enabled=True, patterns=[MatMulChain()])
    (n,) = [x for x in g.nodes if x.op is Op.MUL_MAT_CHAIN]
    assert n.src == [mm.src[0], mm.src[1], chain.src[1]] and n.op_params["steps"] == GATE
    assert n.view_src is chain.view_src and n.ne == chain.ne and n.nb == chain.nb and n.view_offs == 0
    assert programs(n) == want  # the single mat-vec's kernel and grid
    assert mm not in g.nodes and chain not in g.nodes
