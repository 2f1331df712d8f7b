"""The executor against an independent float64 computation of the GDN layer, and rollback semantics."""

import numpy as np
import pytest
import torch

from gdnpass.alloc import plan
from gdnpass.ir import GraphError, arena_buffer
from gdnpass.models import VerifyConfig, build_verify_graph, default_ids
from gdnpass.models.fill import fill
from gdnpass.launches import launches
from gdnpass.runtime import Executor


def run_layer(cfg, ids=None, seed=3, inputs=None, probes=()):
    g = build_verify_graph(cfg)
    plan(g)
    ex = Executor(g)
    fill(ex, seed=seed, ids=ids)
    if inputs is not None:
        ex.view(g.find("inp_embd")).copy_(inputs)
    before = ex.snapshot()
    ex.probed = ex.run(probes=[g.find(p) for p in probes])
    return g, ex, before


def f64(ex, before, name):
    """A leaf's contents before the run, as float64 numpy in torch layout."""
    saved = ex.snapshot()
    ex.restore(before)
    x = ex.read(name).double().numpy()
    ex.restore(saved)
    return x


def reference_layer(cfg, ex, before, ids):
    """The GDN layer from its formulas in float64: conv window, SiLU, L2, gated delta rule, gated norm, out proj."""
    m, il = cfg.shape, cfg.layer_ids()[0]
    n_t, S, Hk, Hv, dc, C, eps = cfg.n_tokens, m.head_dim, m.n_k_heads, m.n_v_heads, m.d_conv, m.conv_channels, m.eps
    W = lambda n: f64(ex, before, f"blk.{il}.{n}")[0, 0]
    x = f64(ex, before, "inp_embd")[0, 0]                                       # (n_t, E)
    h = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * W("attn_norm.weight")[0]
    qkv, z = h @ W("attn_qkv.weight").T, h @ W("attn_gate.weight").T
    beta = 1 / (1 + np.exp(-(h @ W("ssm_beta.weight").T)))
    a = h @ W("ssm_alpha.weight").T + W("ssm_dt.bias")[0]
    gate = np.log1p(np.exp(a)) * W("ssm_a")[0]
    cache_r, cache_s = f64(ex, before, f"cache_r_l{il}")[0, 0], f64(ex, before, f"cache_s_l{il}")[0, 0]
    window = np.concatenate([cache_r[ids[0]].reshape(C, dc - 1), qkv.T], axis=1)      # (C, dc-1+n_t)
    w = W("ssm_conv1d.weight")                                                       # (C, dc)
    conv = np.stack([(window[:, t:t + dc] * w).sum(-1) for t in range(n_t)])           # (n_t, C)
    silu = conv / (1 + np.exp(-conv))
    l2 = lambda u: u / np.maximum(np.linalg.norm(u, axis=-1, keepdims=True), eps)
    q = l2(silu[:, :Hk * S].reshape(n_t, Hk, S))
    k = l2(silu[:, Hk * S:2 * Hk * S].reshape(n_t, Hk, S))
    v = silu[:, 2 * Hk * S:].reshape(n_t, Hv, S)
    state = cache_s[ids[0]].reshape(Hv, S, S).transpose(0, 2, 1).copy()              # [h][i][col]
    K = cfg.n_rs_seq + 1
    o = np.zeros((n_t, Hv, S))
    snaps = {}
    for t in range(n_t):
        for hh in range(Hv):
            St = state[hh] * np.exp(gate[t, hh])
            kk, qq = k[t, hh % Hk], q[t, hh % Hk]
            delta = (v[t, hh] - St.T @ kk) * beta[t, hh]
            state[hh] = St + np.outer(kk, delta)
            o[t, hh] = state[hh].T @ qq / np.sqrt(S)
        if n_t - 1 - t < K:
            snaps[n_t - 1 - t] = state.transpose(0, 2, 1).reshape(-1).copy()
    on = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * W("ssm_norm.weight")[0]
    gated = on * (z / (1 + np.exp(-z))).reshape(n_t, Hv, S)
    out = gated.reshape(n_t, -1) @ W("ssm_out.weight").T + x
    conv_planes = {s: window[:, max(0, n_t - s):max(0, n_t - s) + dc - 1].reshape(-1) for s in range(K)}
    return dict(silu=silu, q=q, k=k, out=out, conv_planes=conv_planes, ssm_planes=snaps)


@pytest.mark.parametrize("model,n_t,n_rs,read_plane", [
    ("tiny-dc4-h64", 4, 3, 0), ("tiny-dc3-h32", 1, 2, 2), ("tiny-dc5-h128", 5, 7, 3), ("tiny-dc4-h32", 16, 15, 0)])
def test_layer_matches_float64_formulas(model, n_t, n_rs, read_plane):
    cfg = VerifyConfig(model, n_t, n_rs, n_layers=1, mem_size=2, wtype="f32", ffn=False)  # the GDN sub-layer alone
    ids = default_ids(cfg, read_plane=read_plane, src_cell=1)  # read another cell's plane: no aliasing with writes
    il = cfg.layer_ids()[0]
    names = [f"conv_output_silu-{il}", f"q_conv_predelta-{il}", f"k_conv_predelta-{il}"]
    g, ex, before = run_layer(cfg, ids, probes=names)
    ref = reference_layer(cfg, ex, before, ids)
    close = lambda got, want: np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    close(ex.probed[names[0]].double().numpy()[0, 0], ref["silu"])
    close(ex.probed[names[1]].double().numpy()[0], ref["q"])
    close(ex.probed[names[2]].double().numpy()[0], ref["k"])
    close(ex.read(g.nodes[-1]).double().numpy()[0, 0], ref["out"])
    row = lambda name, r: ex.read(name).double().numpy()[0, 0, r]
    for s, want in ref["conv_planes"].items():
        close(row(f"cache_r_l{il}", s * cfg.cells), want)  # (the projection part is f64 in the reference)
    for s, want in ref["ssm_planes"].items():
        close(row(f"cache_s_l{il}", s * cfg.cells), want)


@pytest.mark.parametrize("n_t,r", [(4, 1), (4, 3), (8, 5), (3, 0)])
def test_rollback_plane_r_is_the_state_after_n_t_minus_r_tokens(n_t, r):
    """Verify n_t tokens, then compare plane r with plane 0 of a verify of only the first n_t - r tokens."""
    n_rs = 7
    long = VerifyConfig("tiny-dc4-h64", n_t, n_rs, n_layers=1, wtype="f32")
    g1, ex1, _ = run_layer(long, default_ids(long))
    short = VerifyConfig("tiny-dc4-h64", n_t - r, n_rs, n_layers=1, wtype="f32")
    x = ex1.read("inp_embd")  # caches start identical (same shape, same seed); feed the same first tokens
    g2, ex2, _ = run_layer(short, default_ids(short), inputs=x[:, :, : n_t - r].clone())
    il = long.layer_ids()[0]
    conv1, conv2 = ex1.read(f"cache_r_l{il}")[0, 0], ex2.read(f"cache_r_l{il}")[0, 0]
    ssm1, ssm2 = ex1.read(f"cache_s_l{il}")[0, 0], ex2.read(f"cache_s_l{il}")[0, 0]
    # (not bytewise: a 1-column projection may take a different matmul path than a 4-column one)
    torch.testing.assert_close(conv1[r], conv2[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ssm1[r], ssm2[0], rtol=1e-5, atol=1e-6)


def test_planes_beyond_n_t_hold_the_pre_state():
    cfg = VerifyConfig("tiny-dc4-h64", 2, 5, n_layers=1, mem_size=2, wtype="f32")
    ids = default_ids(cfg, src_cell=1)
    g, ex, before = run_layer(cfg, ids)
    il = cfg.layer_ids()[0]
    ex2 = Executor(g)
    ex2.restore(before)
    pre = ex2.read(f"cache_r_l{il}")[0, 0, ids[0]]
    after = ex.read(f"cache_r_l{il}")[0, 0]
    for s in range(2, 6):
        assert torch.equal(after[s * cfg.cells], pre)


def test_any_tensor_reads_back_and_views_alias():
    g, ex, _ = run_layer(VerifyConfig("tiny-dc4-h64", 4, 3, n_layers=2), probes=["conv_output_silu-0", "q_conv-0"])
    silu, q = ex.probed["conv_output_silu-0"], ex.probed["q_conv-0"]
    assert torch.equal(q[0], silu[0, 0, :, : q.shape[-1] * q.shape[-2]].reshape(4, q.shape[-2], q.shape[-1]))
    assert launches(g)["SSM_CONV"] == 2


def test_unplanned_graph_is_refused():
    g = build_verify_graph(VerifyConfig("tiny-dc4-h64", 4, 3, n_layers=1))
    with pytest.raises(GraphError, match="no memory plan"):
        Executor(g)


class _BufferOn:
    """Stands in for a 1-D uint8 tensor on any device, e.g. a second GPU on a machine without one: the shared-buffer
    check reads only its dtype, device, rank and size."""

    dtype = torch.uint8

    def __init__(self, device: str, nbytes: int) -> None:
        self.device, self.nbytes = torch.device(device), nbytes

    def dim(self) -> int:
        return 1

    def numel(self) -> int:
        return self.nbytes


def test_a_shared_buffer_on_another_device_is_refused():
    g = build_verify_graph(VerifyConfig("tiny-dc4-h64", 4, 3, n_layers=1))
    plan(g)
    arena = arena_buffer(g)
    nbytes = g.buffers[arena] + 4096  # enough bytes: only the device is wrong
    Executor(g, buffers={arena: torch.empty(nbytes, dtype=torch.uint8)})  # the same device: accepted
    Executor(g, device="cpu:0", buffers={arena: torch.empty(nbytes, dtype=torch.uint8)})  # cpu:0 is the CPU
    with pytest.raises(GraphError, match=r"shared buffer .*: is on meta, the executor runs on cpu$"):
        Executor(g, buffers={arena: torch.empty(nbytes, dtype=torch.uint8, device="meta")})
    # another GPU of the same type: the index counts (checked before any CUDA call, so it runs without a GPU)
    with pytest.raises(GraphError, match=r"shared buffer .*: is on cuda:1, the executor runs on cuda:0$"):
        Executor(g, device="cuda:0", buffers={arena: _BufferOn("cuda:1", nbytes)})
    with pytest.raises(GraphError, match=r"must be a 1-D uint8 tensor on cpu, is a 1-D torch.float32 tensor$"):
        Executor(g, buffers={arena: torch.empty(nbytes, dtype=torch.float32)})


@pytest.mark.gpu
def test_cuda_graph_capture_replays_the_same_bytes():
    g = build_verify_graph(VerifyConfig("tiny-dc4-h64", 4, 3, n_layers=2))
    plan(g)
    ex = Executor(g, device="cuda")
    fill(ex, seed=1)
    start = ex.snapshot()
    ex.run()
    eager = ex.snapshot()
    ex.restore(start)
    ex.capture()
    ex.restore(start)
    ex.run()
    assert all(torch.equal(eager[k], ex.buffers[k]) for k in eager)


@pytest.mark.gpu
def test_gpu_programmatic_dependent_launch_writes_the_bytes_of_serial_launches():
    """Under PDL each kernel may start while its predecessor runs (triton_core.wait_for_previous_kernels holds its
    body back): a fused qwen3.5-9b forward (2 GDN layers, T 8, the real shapes: products of several waves, split-K,
    the fused chain, GDN into the cache) captured with it replays the bytes of serial launches, every replay."""
    from gdnpass.fusion import PATTERNS, fuse
    from gdnpass.kernels.triton_core import PDL_SUPPORTED, programmatic_launch

    if not PDL_SUPPORTED:
        pytest.skip("programmatic dependent launch needs sm_90 or later (or GDN_PDL=0 is set)")
    cfg = VerifyConfig("qwen3.5-9b", 8, 7, n_layers=2, dflash=True)
    g = build_verify_graph(cfg)
    plan(g)
    assert {a.pattern for a in fuse(g, enabled=True).applied} == {p.name for p in PATTERNS}
    ex = Executor(g, device="cuda")
    fill(ex, seed=3, ids=default_ids(cfg))
    start = ex.snapshot()
    with programmatic_launch(False):
        ex.run()
    serial = ex.snapshot()
    ex.restore(start)
    ex.capture(pdl=True)
    for _ in range(5):
        ex.restore(start)
        ex.run()
        assert all(torch.equal(serial[k], ex.buffers[k]) for k in serial)


def _filled(cfg, seed=0):
    g = build_verify_graph(cfg)
    plan(g)
    ex = Executor(g)
    fill(ex, seed=seed)
    return g, ex


def test_fill_depends_on_seed_and_name_only():
    # two graphs from one config: the same bytes for every leaf
    cfg = VerifyConfig("tiny-dc4-h64", 4, 3, n_layers=2)
    (g1, e1), (g2, e2) = _filled(cfg), _filled(cfg)
    for t in g1.leafs:
        if not t.is_view and not t.is_empty:
            assert e1.bytes_of(t) == e2.bytes_of(g2.find(t.name)), t.name
    # a tensor's fill does not depend on the others: layer 0 of a 1-layer graph equals layer 0 of the 2-layer one,
    # also at other plan offsets (fusion hints move the arena, not the weights; a wider graph moves the offsets)
    g3, e3 = _filled(VerifyConfig("tiny-dc4-h64", 4, 3, n_layers=1))
    shared = [t for t in g3.leafs if t.buffer == "weights" and not t.is_view]
    assert shared
    for t in shared:
        assert e3.bytes_of(t) == e1.bytes_of(g1.find(t.name)), t.name
    # another seed, other bytes
    _, e4 = _filled(cfg, seed=1)
    w = next(t for t in g1.leafs if t.name.endswith("ssm_out.weight"))
    assert e4.bytes_of(g1.find(w.name)) != e1.bytes_of(w)


def test_big_leafs_fill_in_place_like_the_values():
    """The fast path (one block, broadcast into the view) gives exactly _init_values' values."""
    from gdnpass.ir import DType, Tensor
    from gdnpass.models.fill import _TILE, _init_into, _init_values

    for dtype, tdt in ((DType.BF16, torch.bfloat16), (DType.F32, torch.float32)):
        ne1 = _TILE // 4096 + 3
        es = dtype.size
        t = Tensor(name="blk.0.ffn_up.weight", type=dtype, ne=(4096, ne1, 1, 1),
                   nb=(es, 4096 * es, 4096 * ne1 * es, 4096 * ne1 * es))
        t.buffer = "weights"
        dst = torch.empty(t.nelements, dtype=tdt)
        _init_into(dst, t, torch.Generator().manual_seed(5))
        want = _init_values(t, torch.Generator().manual_seed(5))
        assert torch.equal(dst, want)
        assert dst.float().abs().max() < 1.0 and dst.float().std() > 0.5 / 64


def test_forward_stays_finite_through_every_layer():
    cfg = VerifyConfig("tiny-dc4-h64", 8, 7, n_layers=3)
    g, ex = _filled(cfg)
    outs = [n for n in g.nodes if n.name.startswith("l_out")]
    assert len(outs) >= 3
    got = ex.run(probes=outs)
    for name, x in got.items():
        assert torch.isfinite(x).all() and x.abs().max() < 1e4, name


def test_a_quantized_product_counts_its_pre_pass_launch():
    """A mat-vec of a quantized weight is two launches (the activations' pre-pass, then the mat-vec), single or
    fused into the pair or MUL_MAT_ADD; a plain weight's is one (the alpha/beta products stay f32)."""
    from gdnpass.fusion import fuse
    from gdnpass.ir import Op
    from gdnpass.launches import node_launches

    g = build_verify_graph(VerifyConfig("qwen3.5-9b", 4, 3, n_layers=1, wtype="q4_k"))
    counts = {(n.src[0].type.label, node_launches(n)) for n in g.nodes if n.op is Op.MUL_MAT}
    assert counts == {("q4_k", 2), ("f32", 1)}, counts
    plan(g)
    fuse(g, enabled=True)
    products = [n for n in g.nodes if n.op in (Op.MUL_MAT_VEC_PAIR, Op.MUL_MAT_ADD)]
    assert products and all(node_launches(n) == (2 if n.src[0].type.is_quantized else 1) for n in products)
    assert any(n.src[0].type.is_quantized for n in products)


def test_graphs_of_quantized_products_are_captured_with_serial_launches():
    """runtime.programmatic_launch_pays: programmatic dependent launch for a verify whose products read plain types,
    serial launches where one reads a block type (what each measured faster, docs/performance.md)."""
    from gdnpass.runtime import programmatic_launch_pays

    assert programmatic_launch_pays(build_verify_graph(VerifyConfig("qwen3.5-9b", 4, 3, n_layers=1)))
    # several sequences' bf16 products run the GEMM, whose bf16 terms fill the workspace: still plain types
    assert programmatic_launch_pays(build_verify_graph(VerifyConfig("qwen3.5-9b", 4, 3, n_layers=1, n_seqs=8)))
    assert not programmatic_launch_pays(build_verify_graph(VerifyConfig("qwen3.5-9b", 4, 3, n_layers=1,
                                                                        wtype="q4_k")))


def test_a_view_of_part_of_q8_0_rows_is_refused():
    """gdnpass holds Q8_0 rows split (quants.held_rows: a row's scales after its K quants), so a view that takes a
    row's first blocks only would read quants as scales: the executor refuses it by name; whole rows are fine."""
    from gdnpass import ops
    from gdnpass.ir import DType, Graph

    w = ops.new_tensor("w", DType.Q8_0, (512, 8), buffer="weights")
    x = ops.new_tensor("x", DType.F32, (256, 2), buffer="input")
    part = ops.view_2d(w, 256, 8, w.nb[1], 0, name="w_part")
    rows = ops.view_2d(w, 512, 4, w.nb[1], 2 * w.nb[1], name="w_rows")
    every_other = ops.view_2d(w, 512, 4, 2 * w.nb[1], w.nb[1], name="w_every_other")
    g = Graph()
    g.expand(ops.mul_mat(part, x))
    g.expand(ops.mul_mat(rows, ops.new_tensor("x2", DType.F32, (512, 2), buffer="input")))
    g.expand(ops.get_rows(every_other, ops.new_tensor("ids", DType.I32, (2,), buffer="input")))
    plan(g)
    ex = Executor(g)
    assert ex.view(g.find("w_rows")).shape == (1, 1, 4, DType.Q8_0.row_bytes(512))
    assert ex.view(g.find("w_every_other")).stride(2) == 2 * DType.Q8_0.row_bytes(512)  # (whole rows, strided)
    with pytest.raises(GraphError, match="a view of Q8_0 rows must take them whole"):
        ex.view(g.find("w_part"))
