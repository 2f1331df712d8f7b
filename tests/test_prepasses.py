"""Shared pre-passes (gdnpass.prepasses): which quantized products read the int8 activations an earlier product's
pre-pass left in the workspace, each rule's refusal, the 9B verify's plan, and the executor on the Triton kernels
(the interpreter): the products' bytes equal with and without sharing, one pre-pass launched fewer per shared
product, and a plan that went stale refused at launch."""

from __future__ import annotations

import pytest

from gdnpass import ops, pipeline, prepasses
from gdnpass.alloc import plan as plan_memory
from gdnpass.errors import KernelError
from gdnpass.ir import DType, Flag, Graph, Op
from gdnpass.kernels import triton_matvec as mv
from gdnpass.models import VerifyConfig
from gdnpass.models.fill import fill
from gdnpass.pipeline import PassOptions
from gdnpass.runtime import Executor, launches, node_launches

K, M, T = 256, 16, 4


def weight(name: str, dtype: DType = DType.Q4_K):
    return ops.new_tensor(name, dtype, (K, M), buffer="weights")


def activation(name: str = "x"):
    return ops.new_tensor(name, DType.F32, (K, T), buffer="input", flags=Flag.INPUT)


def planned(*outputs) -> Graph:
    g = Graph()
    for t in outputs:
        g.expand(ops.set_output(t))
    plan_memory(g)
    return g


def shared_names(g: Graph) -> dict[str, str]:
    return {n.name: q.name for uid, q in prepasses.plan(g).shared.items() for n in g.nodes if n.uid == uid}


def test_products_of_one_activation_share_the_first_pre_pass():
    """Three products of x (Q4_K, Q6_K, and a pair's form: both q8_K blocks): the first quantizes, the others read
    its workspace; the launch count drops by one each."""
    x = activation()
    a, b, c = (ops.mul_mat(weight(f"w{i}", t), x) for i, t in enumerate((DType.Q4_K, DType.Q6_K, DType.Q4_K)))
    g = planned(a, b, c)
    p = prepasses.plan(g)
    assert shared_names(g) == {b.name: a.name, c.name: a.name} and p.pre_passes == 1 and not p.refused
    assert sum(launches(g).values()) == sum(node_launches(n) for n in g.nodes) - 2 == 4
    assert p.summary() == "2 of 3 activation pre-passes shared"


def test_each_rule_refuses_by_name():
    """Rule 2: a reshape of x to other ne; rule 3: a Q8_0 weight (q8_1 groups); rule 4: another activation's
    pre-pass in between (each refused by name); rule 5: x written in between (a new activation: no refusal)."""
    x, y = activation(), activation("y")
    first = ops.mul_mat(weight("w0"), x)
    other_ne = ops.mul_mat(weight("w1"), ops.reshape(x, K, 2, 2))
    q8_0 = ops.mul_mat(weight("w2", DType.Q8_0), x)
    g = planned(first, q8_0, other_ne)
    assert [(r.node.name, r.rule) for r in prepasses.plan(g).refused] == [(q8_0.name, "same-form"),
                                                                         (other_ne.name, "same-activation")]
    x, y = activation(), activation("y")
    first, between, again = ops.mul_mat(weight("w0"), x), ops.mul_mat(weight("w1"), y), ops.mul_mat(weight("w2"), x)
    g = planned(first, between, again)
    (r,) = prepasses.plan(g).refused
    assert (r.node, r.rule) == (again, "last-pre-pass") and first.name in r.describe()
    x, y = activation(), activation("y")
    first, again = ops.mul_mat(weight("w0"), x), ops.mul_mat(weight("w1"), x)
    rewrite = ops.cpy(ops.scale(y, 2.0), x)  # (a CPY into x's bytes between the products)
    g = Graph()
    for t in (ops.set_output(first), rewrite, ops.set_output(again)):
        g.expand(t)
    plan_memory(g)
    assert g.index(first) < g.index(rewrite) < g.index(again)
    p = prepasses.plan(g)
    assert not p.shared and not p.refused and p.pre_passes == 2


def test_the_9b_verify_shares_qkv_with_z_and_q_with_k_v():
    """The whole qwen3.5-9b verify with Q4_K weights, fused: every GDN layer's z reads the pre-pass of its qkv
    product (the attention norm's output), every attention layer's k/v pair the one of its q: 32 of 161."""
    g = pipeline.run(VerifyConfig("qwen3.5-9b", 4, 3, whole=True, share_weights=False, wtype="q4_k"),
                     PassOptions(fusion=True)).graph
    p = prepasses.plan(g)
    pairs = {(n.name.split("-")[0], p.shared[n.uid].src[0].name.split(".")[2]) for n in g.nodes if n.uid in p.shared}
    assert pairs == {("z", "attn_qkv"), ("mul_mat_vec_pair(attn_v+attn_k)", "attn_q")}
    assert (len(p.shared), p.pre_passes, p.refused) == (32, 129, [])
    assert all(n.src[1] is p.shared[n.uid].src[1] for n in g.nodes if n.uid in p.shared)


def _run(g: Graph, share: bool, monkeypatch) -> tuple[list[bytes], int]:
    """The products' bytes after running ``g`` on the Triton kernels, and the pre-passes launched."""
    filled = []
    real = mv.activation_workspace
    monkeypatch.setattr(mv, "activation_workspace", lambda *a, **k: (filled.append(1), real(*a, **k))[1])
    ex = Executor(g, device="cpu", backend="triton", share_pre_passes=share)
    fill(ex, seed=3)
    ex.run()
    return [ex.bytes_of(n) for n in g.nodes if n.op is Op.MUL_MAT], len(filled)


def test_the_executor_skips_shared_pre_passes_byte_for_byte(monkeypatch):
    """On the Triton kernels: each product's bytes are the same with its pre-pass shared and its own, and the
    shared run launches one pre-pass where the other launches three."""
    x = activation()
    g = planned(*(ops.mul_mat(weight(f"w{i}", t), x) for i, t in enumerate((DType.Q4_K, DType.Q5_K, DType.Q6_K))))
    own, own_passes = _run(g, False, monkeypatch)
    shared, shared_passes = _run(g, True, monkeypatch)
    assert (own_passes, shared_passes) == (3, 1)
    assert shared == own


def test_a_stale_plan_is_a_one_line_error(monkeypatch):
    """A product told to skip its pre-pass while the workspace holds another activation's is refused at launch
    (the workspace records what it holds), not run on stale quants."""
    x, y = activation(), activation("y")
    a, b = ops.mul_mat(weight("w0"), x), ops.mul_mat(weight("w1"), y)
    g = planned(a, b)
    ex = Executor(g, device="cpu", backend="triton")
    fill(ex, seed=3)
    ex.pre_passes.shared[b.uid] = a  # (what no legal plan says: b's activation is y)
    with pytest.raises(KernelError, match="the workspace holds others"):
        ex.run()


def test_the_torch_backend_plans_nothing():
    """The torch reference quantizes inside each product: nothing to share, nothing planned."""
    x = activation()
    g = planned(ops.mul_mat(weight("w0"), x), ops.mul_mat(weight("w1"), x))
    assert Executor(g, device="cpu").pre_passes is None
    assert Executor(g, device="cpu", backend="triton", share_pre_passes=False).pre_passes is None
