"""MUL_MAT_ADD beyond its rule tests (tests/patterns/test_rules.py): the fused kernel against the MUL_MAT and ADD it
replaces, byte for byte (the Triton ones in the interpreter here, compiled on a GPU), in place on the addend and
through the split-K path, and against independent math; the fused graph byte-identical to the unfused one; what the
fused node is.

Everything lives in one NaN-poisoned uint8 arena and the kernels get strided views of it, as from the executor.
"""

import pytest
import torch

from gdnpass import pipeline
from gdnpass.check import check_fusion
from gdnpass.fusion import fuse
from gdnpass.ir import DType, Op
from gdnpass.kernels import triton_matvec
from gdnpass.kernels.backends import TORCH_BACKEND, TRITON_BACKEND, programs
from gdnpass.models import VerifyConfig, default_ids
from gdnpass.patterns.mul_mat_add import MatMulAdd
from support.arena import Arena, assert_close, node, rnd
from support.compare import assert_same_bytes
from support.graphs import triton_for

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

WTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
CASES = ([("torch", w, n) for w in WTYPES for n in (1, 4, 16)]
         + [("triton", w, n) for w in WTYPES for n in (1, 4)] + [("triton", "bf16", 9)]
         + [("triton", w, 20) for w in ("f16", "bf16")])  # over 16 columns: the GEMM's store adds r


def _operands(a: Arena, wtype, n: int, M: int = 12, K: int = 200):
    w = a.put(rnd(1, 1, M, K).to(wtype))
    x = a.put(rnd(1, 1, n, K), row_stride=K + 24)  # columns with gaps
    r = a.put(rnd(1, 1, n, M))
    return w, x, r


@pytest.mark.parametrize("backend,wtype,n", CASES, ids=[f"{b}-{w}-{n}" for b, w, n in CASES])
@pytest.mark.parametrize("in_place", [False, True], ids=["own-memory", "on-the-addend"])
def test_fused_kernel_has_the_bytes_of_the_product_then_the_add(backend, wtype, n, in_place):
    table = {"torch": TORCH_BACKEND, "triton": TRITON_BACKEND}[backend]
    a = Arena()
    w, x, r = _operands(a, WTYPES[wtype], n)
    product, want = a.view((1, 1, n, 12)), a.view((1, 1, n, 12))
    types = (DType.parse(wtype),)  # (the adapters read the weight's type: the mat-vec, the GEMM or torch's)
    table[Op.MUL_MAT](node(Op.MUL_MAT, types), [w, x], product)
    table[Op.ADD](node(Op.ADD), [product, r], want)
    addend = r.clone()
    out = r if in_place else a.view((1, 1, n, 12))
    a.run(lambda: table[Op.MUL_MAT_ADD](node(Op.MUL_MAT_ADD, types), [w, x, r], out), out)
    assert_same_bytes(out, want, "sum")
    assert_close(out, (x.double() @ w.double().transpose(-1, -2) + addend.double()).float())


def test_split_k_sum_has_the_bytes_of_the_split_k_product_then_the_add():
    """The split-K path (the last program of a row block adds the partials, then the addend), forced on a small
    product: the same tile unfused and fused."""
    a = Arena()
    w, x, r = _operands(a, torch.float32, 4, M=8, K=512)
    tile = triton_matvec.MatVecTile(block_m=4, cols=4, block_k=64, dot=False, warps=4, split_k=4)
    product, want, out = (a.view((1, 1, 4, 8)) for _ in range(3))
    triton_matvec._mat_vecs([(w, product)], x, tile=tile)
    TRITON_BACKEND[Op.ADD](node(Op.ADD), [product, r], want)
    residual = triton_matvec.Epilogue(("ADD",), (r,))
    a.run(lambda: triton_matvec._mat_vecs([(w, out)], x, tile=tile, epilogue=residual), out)
    assert_same_bytes(out, want, "split-K sum")


def test_the_launcher_refuses_a_sum_over_its_input():
    a = Arena()
    w, x, r = _operands(a, torch.float32, 1)
    from gdnpass.errors import KernelError

    with pytest.raises(KernelError, match="mul_mat_vec_chain: the output overlaps an input"):
        triton_matvec.mul_mat_vec_add(w, x, r, x[..., :12])


def _graph(n_t: int, rs: int):
    cfg = VerifyConfig("tiny-dc4-h64", n_t, rs, n_layers=2, mem_size=2)
    return cfg, pipeline.run(cfg, pipeline.PassOptions(fusion=True), fuse_now=False).graph


def _residual_product(n) -> bool:  # the FFN's down and the GDN's output projections, plain and fused
    return any(s in n.src[0].name for s in ("ffn_down", "ssm_out"))


@pytest.mark.parametrize("n_t,rs", [(1, 0), (4, 3), (17, 0)], ids=["T1", "T4", "T17"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_fused_graph_is_byte_identical(n_t, rs, kernels, device):
    """(T17: 17 columns, the bf16 products on the GEMM, fused with their residual ADDs as the mat-vec's are.)"""
    cfg, g = _graph(n_t, rs)
    table = "torch" if kernels == "torch" else triton_for((Op.MUL_MAT, Op.MUL_MAT_ADD, Op.ADD),
                                                          where=lambda n: n.op is Op.ADD or _residual_product(n))
    res = check_fusion(g, device=device, backend=table, patterns=[MatMulAdd()], ids=default_ids(cfg))
    applied = [a.layer for a in res.report.applied]
    # both layers' FFN residuals; their GDN projections' where the sum does not land on x (this plan: layer 1's)
    assert applied.count(0) >= 1 and applied.count(1) >= 1, res.report.summary()
    assert {r.rule for r in res.report.refused} <= {"mul-mat-add.output-overlaps-input", "mul-mat-add.addend"}
    assert res.identical, [c.to_json() for c in res.compared if not c.identical]
    names = {c.name for c in res.compared}
    assert {"l_out-0", "l_out-1"} <= names


def test_the_fused_node_is_a_view_of_the_sum_on_the_mat_vecs_grid():
    _, g = _graph(4, 3)
    add = g.find("l_out-0")
    mm = next(s for s in add.src if s.op is Op.MUL_MAT)
    want = programs(mm)
    fuse(g, enabled=True, patterns=[MatMulAdd()])
    n = next(x for x in g.nodes if x.op is Op.MUL_MAT_ADD and x.view_src is add)
    assert n.src == [mm.src[0], mm.src[1], next(s for s in add.src if s is not mm)]
    assert n.ne == add.ne and n.nb == add.nb and n.view_offs == 0
    assert programs(n) == want  # the single mat-vec's kernel and grid
    assert mm not in g.nodes and add not in g.nodes
