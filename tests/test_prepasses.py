"""Shared pre-passes (gdnpass.prepasses): which quantized products read the int8 activations an earlier product's
pre-pass left in the workspace, each rule's refusal, the 9B verify's plan, and the executor on the Triton kernels
(the interpreter): the products' bytes equal with and without sharing, one pre-pass launched fewer per shared
product, and a plan that went stale refused at launch."""

from __future__ import annotations

import pytest
import torch

from gdnpass import ops, pipeline, prepasses
from gdnpass.alloc import plan as plan_memory
from gdnpass.errors import KernelError
from gdnpass.ir import DType, Flag, Graph, Op
from gdnpass.kernels import triton_matvec as mv
from gdnpass.models import VerifyConfig
from gdnpass.models.fill import fill
from gdnpass.pipeline import PassOptions
from gdnpass.launches import launches, node_launches
from gdnpass.runtime import Executor
from support.arena import DEVICE, Arena, rnd

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
    """Three products of x (Q4_K, Q6_K, Q4_K: q8_K blocks all): the first quantizes, the others read its workspace;
    the launch count drops by one each."""
    x = activation()
    a, b, c = (ops.mul_mat(weight(f"w{i}", t), x) for i, t in enumerate((DType.Q4_K, DType.Q6_K, DType.Q4_K)))
    g = planned(a, b, c)
    p = prepasses.plan(g)
    assert shared_names(g) == {b.name: a.name, c.name: a.name} and p.pre_passes == 1 and not p.refused
    assert sum(launches(g).values()) == sum(node_launches(n) for n in g.nodes) - 2 == 4
    assert p.summary() == "2 of 3 activation pre-passes skipped (0 made by their producers)"


def test_each_rule_refuses_by_name():
    """Rule 2: a reshape of x to other ne; rule 3: a Q8_0 weight (q8_1 groups); rule 4: another activation's
    pre-pass in between (each refused by name); rule 5: x written in between (a new activation: no refusal)."""
    x = activation()
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


@pytest.mark.parametrize("wtype,form", [("q4_k", "q8_K"), ("q8_0", "q8_1")])
def test_the_9b_verify_quantizes_each_norm_and_swiglu_output_in_its_kernel(wtype, form):
    """The whole qwen3.5-9b verify with Q4_K weights (q8_K blocks) or Q8_0 (q8_1 groups), fused: every RMS_NORM_MUL
    and SwiGLU whose output products read writes it in their form, and those products (a GDN layer's qkv and z, an
    attention layer's q and k/v pair, every FFN's gate/up pair and down projection) launch no pre-pass: 128 of 161.
    In Q8_0 two products hand their output on too: the gate/up pair computing the SwiGLU (pair_glu) to ffn_down, and
    the GDN's z chain (its gated output) to ssm_out: 152 of 161, 56 of them handed on.
    The rest quantize the GDN and attention outputs (an RMS_NORM_MUL of head rows, 128 elements: not whole blocks)
    and the lm head's gathered rows (a GET_ROWS of the output norm: no producer)."""
    g = pipeline.run(VerifyConfig("qwen3.5-9b", 4, 3, whole=True, share_weights=False, wtype=wtype),
                     PassOptions(fusion=True)).graph
    p = prepasses.plan(g)
    assert set(p.producing.values()) == {form}
    readers = {}
    for n in g.nodes:
        if n.uid in p.shared:
            readers.setdefault(stem(p.shared[n.uid]), set()).add(product_name(n))
    want = {"attn_norm": {"attn_qkv", "attn_gate", "attn_q", "attn_v+attn_k"}, "attn_post_norm": {"ffn_gate+ffn_up"}}
    if wtype == "q8_0":  # (the hand-offs, q8_1 only: the FFN pair's SwiGLU, the GDN's z chain)
        want |= {"ffn_gate+ffn_up+swiglu": {"ffn_down"}, "attn_output": {"ssm_out"}}
    else:
        want |= {"ffn_swiglu": {"ffn_down"}}
    assert readers == want
    counts = (152, 120, 9, 56) if wtype == "q8_0" else (128, 96, 33, 0)
    assert (len(p.shared), len(p.producing), p.pre_passes, len(p.handed_on), p.refused) == (*counts, [])
    assert all((q.op.value in prepasses.PRODUCERS or prepasses.hand_off(q)) and n.src[1].base is q.base
               for n in g.nodes if (q := p.shared.get(n.uid)) is not None)
    assert sum(launches(g).values()) == sum(node_launches(n) for n in g.nodes) - counts[0]


def stem(n) -> str:
    """A node's name without its layer and fused op: "rms_norm_mul(attn_norm-3)" -> "attn_norm",
    "mul_mat_chain(attn_output-0 (rms_norm) (mul) (mul))" -> "attn_output"."""
    return n.name.split("(", 1)[-1].split("-")[0].rstrip(")")


def product_name(n) -> str:
    """A product's weights' names ("attn_qkv", "attn_v+attn_k"; the GDN's z product: "attn_gate")."""
    ws = [n.src[0]] + ([n.src[2]] if n.op is Op.MUL_MAT_VEC_PAIR else [])
    return "+".join(w.base.name.split(".")[2] for w in ws)


def _run(g: Graph, share: bool, monkeypatch, ids=None) -> tuple[list[bytes], int]:
    """The products' bytes after running ``g`` on the Triton kernels, and the pre-passes launched."""
    filled = []
    real = mv.activations_to_fill  # (what a pre-pass claims the workspace with; the producers call their own import)
    monkeypatch.setattr(mv, "activations_to_fill", lambda *a, **k: (filled.append(1), real(*a, **k))[1])
    ex = Executor(g, device=DEVICE, backend="triton", share_pre_passes=share)
    fill(ex, seed=3, ids=ids)
    ex.run()
    return [ex.bytes_of(n) for n in g.nodes if n.op in (Op.MUL_MAT, Op.MUL_MAT_ID)], len(filled)


def test_the_executor_skips_shared_pre_passes_byte_for_byte(monkeypatch):
    """On the Triton kernels: each product's bytes are the same with its pre-pass shared and its own, and the
    shared run launches one pre-pass where the other launches three."""
    x = activation()
    g = planned(*(ops.mul_mat(weight(f"w{i}", t), x) for i, t in enumerate((DType.Q4_K, DType.Q5_K, DType.Q6_K))))
    own, own_passes = _run(g, False, monkeypatch)
    shared, shared_passes = _run(g, True, monkeypatch)
    assert (own_passes, shared_passes) == (3, 1)
    assert shared == own


@pytest.mark.parametrize("form,wtypes", [("q8_K", (DType.Q4_K, DType.Q6_K, DType.Q4_K)),
                                         ("q8_1", (DType.Q8_0, DType.Q8_0, DType.Q8_0))])
def test_a_norm_and_a_swiglu_make_their_products_activations_byte_for_byte(monkeypatch, form, wtypes):
    """An FFN on the Triton kernels: RMS_NORM then MUL (fused: RMS_NORM_MUL) feeding a gate and an up product, their
    SwiGLU feeding a down product, of the K-quants (q8_K blocks) or Q8_0 (q8_1 groups). The norm and the SwiGLU
    write their output in that form, no product launches a pre-pass, and every output's bytes are those of the run
    where each product quantizes for itself."""
    from gdnpass.fusion import fuse
    from gdnpass.ir import Glu

    Kn = 512  # (rms_norm_mul.scope.quantizes_rows: a row in one program's tile)
    x = ops.new_tensor("x", DType.F32, (Kn, T), buffer="input", flags=Flag.INPUT)
    y = ops.mul(ops.rms_norm(x, 1e-6), ops.new_tensor("norm", DType.F32, (Kn,), buffer="weights"))
    gate, up = (ops.mul_mat(ops.new_tensor(f"w{i}", t, (Kn, Kn), buffer="weights"), y)
                for i, t in enumerate(wtypes[:2]))
    down = ops.mul_mat(ops.new_tensor("w_down", wtypes[2], (Kn, M), buffer="weights"), ops.glu_split(gate, up,
                                                                                                   Glu.SWIGLU))
    g = planned(down, gate, up)
    assert fuse(g, enabled=True).applied and any(n.op is Op.RMS_NORM_MUL for n in g.nodes)
    p = prepasses.plan(g)
    assert (len(p.shared), len(p.producing), p.pre_passes) == (3, 2, 0) and set(p.producing.values()) == {form}
    own, own_passes = _run(g, False, monkeypatch)
    made, made_passes = _run(g, True, monkeypatch)
    assert (own_passes, made_passes) == (3, 0)
    assert made == own


def test_a_q8_0_pair_hands_its_swiglu_on_byte_for_byte(monkeypatch):
    """A Q8_0 FFN fused whole (RMS_NORM_MUL, the gate/up pair with SwiGLU's epilogue: pair_glu) on the Triton
    kernels: the pair reads the norm's quantized output and hands its own on as the down product's q8_1 activations
    (rule 1's hand-off, in the workspace's second slot), so no product launches a pre-pass and no GLU runs; every
    output's bytes are those of the run where each product quantizes for itself. (The norm's output is kept as an
    output: otherwise the plan puts y over it, and pair-glu.output-overlaps-input refuses the fusion.)"""
    from gdnpass.fusion import fuse
    from gdnpass.ir import Glu
    from gdnpass.kernels import triton_core as core

    Kn = 512  # (the Q8_0 pair's tile then splits K: pair-glu.tile)
    x = ops.new_tensor("x", DType.F32, (Kn, T), buffer="input", flags=Flag.INPUT)
    y = ops.mul(ops.rms_norm(x, 1e-6), ops.new_tensor("norm", DType.F32, (Kn,), buffer="weights"))
    gate, up = (ops.mul_mat(ops.new_tensor(f"w{i}", DType.Q8_0, (Kn, Kn), buffer="weights"), y) for i in range(2))
    down = ops.mul_mat(ops.new_tensor("w_down", DType.Q8_0, (Kn, M), buffer="weights"),
                       ops.glu_split(gate, up, Glu.SWIGLU))
    g = planned(down, y)
    fuse(g, enabled=True)
    pair = next(n for n in g.nodes if n.op is Op.MUL_MAT_VEC_PAIR)
    assert pair.op_params.get("glu") == "SWIGLU" and not any(n.op is Op.GLU for n in g.nodes)
    p = prepasses.plan(g)
    assert p.handed_on == {down.uid} and p.shared[down.uid] is pair and p.producing[pair.uid] == "q8_1"
    assert p.pre_passes == 0 and len(p.shared) == 2

    real = mv.activations_to_fill

    def run(share: bool) -> tuple[list[bytes], list[int]]:
        slots = []
        monkeypatch.setattr(mv, "activations_to_fill",
                            lambda *a, **k: (slots.append(k.get("slot", core.FILL_SLOT)), real(*a, **k))[1])
        ex = Executor(g, device=DEVICE, backend="triton", share_pre_passes=share)
        fill(ex, seed=3)
        ex.run()
        return [ex.bytes_of(n) for n in g.nodes if n.op in (Op.MUL_MAT, Op.MUL_MAT_VEC_PAIR)], slots

    own, own_slots = run(False)
    made, made_slots = run(True)
    assert own_slots == [core.FILL_SLOT] * 2 and made_slots == [core.HAND_OFF_SLOT]  # (the norm fills with its own)
    assert made == own


def test_a_producer_writes_its_first_readers_form_only():
    """Rule 3 with a producer: a norm's output read by a Q8_0 product, then by a Q4_K one. The norm writes the q8_1
    groups the first reads, which skips its pre-pass; the second quantizes for itself (q8_K)."""
    from gdnpass.fusion import fuse

    Kn = 512  # (rms_norm_mul.scope.quantizes_rows)
    x = ops.new_tensor("x", DType.F32, (Kn, T), buffer="input", flags=Flag.INPUT)
    y = ops.mul(ops.rms_norm(x, 1e-6), ops.new_tensor("norm", DType.F32, (Kn,), buffer="weights"))
    first = ops.mul_mat(ops.new_tensor("w0", DType.Q8_0, (Kn, M), buffer="weights"), y)
    second = ops.mul_mat(ops.new_tensor("w1", DType.Q4_K, (Kn, M), buffer="weights"), y)
    g = planned(first, second)
    assert fuse(g, enabled=True).applied
    norm = next(n for n in g.nodes if n.op is Op.RMS_NORM_MUL)
    p = prepasses.plan(g)
    assert g.index(first) < g.index(second)
    assert p.producing == {norm.uid: "q8_1"} and shared_names(g) == {first.name: norm.name} and p.pre_passes == 1


def test_check_fusion_compares_every_product_quantizing_for_itself_with_the_fused_plan():
    """run --check's comparison on the FFN of the test above, on the Triton kernels: the unfused run quantizes in
    every product, the fused one runs its plan (the norm's and the SwiGLU's blocks; planned again after the rewrite,
    on the executor made before it): every compared tensor byte-identical."""
    from gdnpass.check import check_fusion
    from gdnpass.ir import Glu

    Kn = 512
    y = _norm(ops.new_tensor("x", DType.F32, (Kn, T), buffer="input", flags=Flag.INPUT))
    gate, up = (ops.mul_mat(ops.new_tensor(f"w{i}", t, (Kn, Kn), buffer="weights"), y)
                for i, t in enumerate((DType.Q4_K, DType.Q6_K)))
    down = ops.mul_mat(ops.new_tensor("w_down", DType.Q4_K, (Kn, M), buffer="weights"),
                       ops.glu_split(gate, up, Glu.SWIGLU))
    g = planned(down)
    assert len(prepasses.plan(g).producing) == 1  # (unfused: the SwiGLU's; no RMS_NORM_MUL yet)
    res = check_fusion(g, device=DEVICE, backend="triton")
    assert res.report.applied and res.compared and all(c.identical for c in res.compared)
    assert len(prepasses.plan(g).producing) == 2


def test_a_q8_0_gdn_layer_hands_on_byte_for_byte_under_check_fusion():
    """A whole Q8_0 GDN layer with its FFN (tiny-dc4-h64-e512: the FFN pair and the z product split K on 64-row
    blocks) checked unfused against fused on the Triton kernels: the fused run hands the FFN's SwiGLU on to ffn_down
    and the z chain's output on to ssm_out (rule 1's hand-offs), and every compared output is byte-identical to the
    run where each product quantizes its own activations."""
    from gdnpass.check import check_fusion

    g = pipeline.run(VerifyConfig("tiny-dc4-h64-e512", 4, 3, n_layers=1, wtype="q8_0"), PassOptions(fusion=True),
                     fuse_now=False).graph
    res = check_fusion(g, device=DEVICE, backend="triton")
    assert res.compared and all(c.identical for c in res.compared)
    p = prepasses.plan(g)
    assert sorted(product_name(n) for n in g.nodes if n.uid in p.handed_on) == ["ffn_down", "ssm_out"]


def test_the_executor_plans_again_after_a_rewrite():
    """An executor made before fusion runs the fused graph on the fused graph's plan (check_fusion does so)."""
    from gdnpass.fusion import fuse

    Kn = 512
    y = _norm(ops.new_tensor("x", DType.F32, (Kn, T), buffer="input", flags=Flag.INPUT))
    g = planned(ops.mul_mat(ops.new_tensor("w", DType.Q4_K, (Kn, M), buffer="weights"), y))
    ex = Executor(g, device=DEVICE, backend="triton")
    assert not ex.pre_passes.producing
    fuse(g, enabled=True)
    assert len(ex.pre_passes.producing) == 1 and ex.pre_passes is ex.pre_passes


def test_a_swiglu_makes_the_expert_products_activations(monkeypatch):
    """The MoE down projection's form: a SwiGLU of [K, n_used, n_t] feeding a quantized MUL_MAT_ID (its columns slot
    by token, the SwiGLU's rows in order): the SwiGLU writes the blocks, the expert product launches no pre-pass, its
    bytes those of the run where it quantizes for itself."""
    from gdnpass.ir import Glu

    n_used, n_t = 2, 2
    gate, up = (ops.new_tensor(n, DType.F32, (K, n_used, n_t), buffer="input", flags=Flag.INPUT) for n in "gu")
    ids = ops.new_tensor("ids", DType.I32, (n_used, n_t), buffer="input", flags=Flag.INPUT)
    experts = ops.mul_mat_id(ops.new_tensor("down_exps", DType.Q4_K, (K, M, 4), buffer="weights"),
                             ops.glu_split(gate, up, Glu.SWIGLU), ids)
    g = planned(experts)
    p = prepasses.plan(g)
    assert (len(p.shared), len(p.producing), p.pre_passes) == (1, 1, 0)
    own, own_passes = _run(g, False, monkeypatch, ids=[0, 3, 2, 1])
    made, made_passes = _run(g, True, monkeypatch, ids=[0, 3, 2, 1])
    assert (own_passes, made_passes) == (1, 0) and made == own


def _norm(x, name="norm"):
    return ops.mul(ops.rms_norm(x, 1e-6), ops.new_tensor(name, DType.F32, (x.ne[0],), buffer="weights"))


def test_a_producer_fills_only_for_the_next_fill_and_unread_by_others():
    """Rule 4's offer: a producer writes its blocks only where its output's product is the next to fill the
    workspace, no product before it reads what the workspace held, and its output is unwritten up to there. Each
    case below breaks one of these (after fusion: RMS_NORM_MUL), and the product quantizes for itself; the first
    case without its product in between is the control."""
    from gdnpass.fusion import fuse

    Kn = 512

    def plan_of(*in_order):
        """The plan of the graph of these nodes in this order (products marked outputs), planned and fused."""
        g = Graph()
        for t in in_order:
            g.expand(ops.set_output(t) if t.op in (Op.MUL_MAT, Op.CPY) else t)
        plan_memory(g)
        fuse(g, enabled=True)
        assert any(n.op is Op.RMS_NORM_MUL for n in g.nodes)
        return prepasses.plan(g)

    def inp(name):
        return ops.new_tensor(name, DType.F32, (Kn, T), buffer="input", flags=Flag.INPUT)

    def product(name, x):
        return ops.mul_mat(ops.new_tensor(name, DType.Q4_K, (Kn, M), buffer="weights"), x)

    x = inp("x")
    y = _norm(x)
    p = plan_of(y, product("w_mine", y))
    assert len(p.producing) == 1 and p.pre_passes == 0
    x, z = inp("x"), inp("z")
    y = _norm(x)
    p = plan_of(y, product("w_other", z), product("w_mine", y))  # another activation's pre-pass in between
    assert not p.producing and not p.shared and p.pre_passes == 2
    x, z = inp("x"), inp("z")
    first, y = product("w_first", z), _norm(x)
    again = product("w_again", z)  # a product reading the workspace's old activation in between
    p = plan_of(first, y, again, product("w_mine", y))
    assert not p.producing and set(p.shared) == {again.uid} and p.pre_passes == 2
    x, z = inp("x"), inp("z")
    y = _norm(x)
    p = plan_of(y, ops.cpy(ops.scale(z, 2.0), y), product("w_mine", y))  # its output rewritten in between
    assert not p.producing and p.pre_passes == 1


def test_a_norm_in_place_of_its_x_makes_no_quants():
    """An RMS_NORM_MUL that gallocr put in place of its x (an intermediate: a SCALE's output) is no producer (its
    quantizing programs would read rows other programs overwrite): the first product quantizes, the second shares."""
    from gdnpass.fusion import fuse
    from gdnpass.ir import byte_range

    Kn = 512
    x = ops.scale(ops.new_tensor("x", DType.F32, (Kn, T), buffer="input", flags=Flag.INPUT), 2.0)
    y = ops.mul(ops.rms_norm(x, 1e-6), ops.new_tensor("norm", DType.F32, (Kn,), buffer="weights"))
    first, second = (ops.mul_mat(ops.new_tensor(f"w{i}", DType.Q4_K, (Kn, M), buffer="weights"), y) for i in (0, 1))
    g = planned(first, second)
    fuse(g, enabled=True)
    norm = next(n for n in g.nodes if n.op is Op.RMS_NORM_MUL)
    assert byte_range(norm) == byte_range(norm.src[0])
    p = prepasses.plan(g)
    assert not p.producing and shared_names(g) == {second.name: first.name}


def test_a_stale_plan_is_a_one_line_error(monkeypatch):
    """A product told to skip its pre-pass while the workspace holds another activation's is refused at launch
    (the workspace records what it holds), not run on stale quants."""
    x, y = activation(), activation("y")
    a, b = ops.mul_mat(weight("w0"), x), ops.mul_mat(weight("w1"), y)
    g = planned(a, b)
    ex = Executor(g, device=DEVICE, backend="triton")
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


FORMS = {"q8_K": DType.Q4_K, "q8_1": DType.Q8_0}  # a product's weight type of each form


def written(acts: torch.Tensor, K: int, n: int, form: str) -> torch.Tensor:
    """The bytes the pre-pass of n columns writes into the workspace ``acts`` in ``form``: each chunk's own."""
    from gdnpass.kernels import triton_core as core

    chunks = -(-n // 16)
    return acts[:chunks * core.activation_bytes(K)].view(chunks, -1)[:, :core.activation_bytes(K, form)].clone()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("in_place", [False, True])
def test_swiglu_writes_the_pre_passes_bytes(in_place, form):
    """SWIGLU quantizing its output (the split form, in place of its gate or not) writes into the workspace the
    bytes a product's pre-pass of that output writes, in either form, and the output itself as without."""
    from gdnpass.kernels import triton_core as core
    from gdnpass.kernels import triton_elementwise as elt

    Kx, rows = 512, 5
    a = Arena(1 << 22)
    g, u = a.put(rnd(1, 1, rows, Kx)), a.put(rnd(1, 1, rows, Kx))
    plain = a.view((1, 1, rows, Kx))
    elt.glu("SWIGLU", g, u, False, plain)
    out = g if in_place else a.view((1, 1, rows, Kx))
    core.activation_workspace(g.device, 1 << 16, "test").fill_(0x5A)
    elt.glu("SWIGLU", g, u, False, out, quantize=form)
    n, cols = core.product_columns(out)
    made = written(core.held_activations(out.device, core.activations_key(out, form, n, cols), "test"), Kx, n, form)
    assert torch.equal(out.view(torch.int32), plain.view(torch.int32))
    core.activation_workspace(g.device, 1 << 16, "test").fill_(0xA5)
    assert torch.equal(made, written(mv.quantize_activations(out, FORMS[form], Kx, n, cols), Kx, n, form))


@pytest.mark.parametrize("rows,form,int8", [(4, "norm*w", "q8_K"), (20, "norm*w", "q8_K"), (4, "w*norm+a", "q8_K"),
                                            (4, "a+norm*w, in place", "q8_K"), (20, "norm*w", "q8_1"),
                                            (4, "w*norm+a", "q8_1")])
def test_rms_norm_mul_writes_the_pre_passes_bytes(rows, form, int8):
    """RMS_NORM_MUL quantizing its output writes into the workspace the very bytes a product's pre-pass of that
    output writes, in either form (every chunk, the padding columns' zeros included), and the output itself as
    without: both operand orders, with the ADD, the output in place of the addend."""
    from gdnpass.kernels import triton_core as core
    from gdnpass.patterns.rms_norm_mul import kernel as rms

    Kx = 512
    a = Arena(1 << 22)
    x, addend = a.put(rnd(1, 1, rows, Kx)), a.put(rnd(1, 1, rows, Kx))
    w = a.put(rnd(1, 1, rows, Kx) if form.startswith("w*") else rnd(1, 1, 1, Kx))  # (src0 of the MUL: x's shape)
    kw = dict(addend=addend if "a" in form.replace("norm", "") else None, norm_first=not form.startswith("w*"),
              add_first=form.startswith("a+"))
    plain = a.view((1, 1, rows, Kx))
    rms.rms_norm_mul(x, w, 1e-6, plain, **kw)
    out = addend if "in place" in form else a.view((1, 1, rows, Kx))
    core.activation_workspace(x.device, 1 << 16, "test").fill_(0x5A)  # (stale bytes to overwrite)
    rms.rms_norm_mul(x, w, 1e-6, out, quantize=int8, **kw)
    n, cols = core.product_columns(out)
    made = written(core.held_activations(out.device, core.activations_key(out, int8, n, cols), "test"), Kx, n, int8)
    assert torch.equal(out.view(torch.int32), plain.view(torch.int32))
    core.activation_workspace(x.device, 1 << 16, "test").fill_(0xA5)
    quantized = written(mv.quantize_activations(out, FORMS[int8], Kx, n, cols), Kx, n, int8)
    assert torch.equal(made, quantized)
