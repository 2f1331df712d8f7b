"""The verify-graph builder reproduces llama.cpp's qwen35 GDN layer: node order, snapshot CPYs, use counts."""

import pytest

from gdnpass import ops
from gdnpass.ir import GraphError, Op
from gdnpass.models import PRESETS, VerifyConfig, build_verify_graph, default_ids

V, RS, TR, CP = Op.VIEW, Op.RESHAPE, Op.TRANSPOSE, Op.CPY


def layer_ops(K, first_layer):
    """One GDN layer's node ops, as ggml_build_forward_expand orders them for llama.cpp's qwen35 graph.

    (The tail of layer il, from the attn_output view on, is expanded only by layer il+1's attn_norm, exactly as in
    llama.cpp; the op sequence of two consecutive layers is what this describes.)"""
    s_copy_main = [V] if first_layer else []
    s_copy_extra = [V] if first_layer else []
    build_rs = lambda first: [RS, V, Op.SCALE] + (s_copy_main if first else []) + [Op.GET_ROWS] + (
        s_copy_extra if first else []) + [Op.GET_ROWS, V, CP]
    return (
        [Op.RMS_NORM, Op.MUL]                                   # attn_norm
        + build_rs(True)                                        # conv state: zero row, GET_ROWS, extra rows
        + [RS, Op.MUL_MAT, RS, TR, Op.CONCAT]                   # conv_states_reshaped, qkv, transpose, concat
        + [V, V, CP] * K                                        # window view, cache-row view, CPY per plane
        + build_rs(False)                                       # ssm state build_rs: the nodes "in between"
        + [Op.SSM_CONV, Op.UNARY, V, Op.L2_NORM, V, Op.L2_NORM, V]
        + [Op.MUL_MAT, RS, Op.ADD, Op.UNARY, Op.MUL, RS]        # alpha -> gate
        + [Op.MUL_MAT, RS, Op.UNARY]                            # beta
        + [RS, Op.GATED_DELTA_NET, V, V, CP]                    # state_predelta, GDN, snapshot CPY
        + [V, Op.RMS_NORM, Op.MUL, Op.MUL_MAT, RS, Op.UNARY, Op.MUL, RS, Op.MUL_MAT, RS, Op.ADD]
        + [Op.RMS_NORM, Op.MUL, Op.MUL_MAT, Op.MUL_MAT, Op.GLU, Op.MUL_MAT, Op.ADD]  # FFN: gate, up, SWIGLU, down
    )


@pytest.mark.parametrize("n_t,n_rs", [(1, 0), (4, 3), (8, 7), (16, 15)])
def test_qwen35_9b_layer_structure(n_t, n_rs):
    cfg = VerifyConfig("qwen3.5-9b", n_t, n_rs, n_layers=2, qk_norm="l2")  # the seed's form (rms: see below)
    g = build_verify_graph(cfg)
    ops.validate(g)
    K = n_rs + 1
    first, second = layer_ops(K, True), layer_ops(K, False)
    assert [n.op for n in g.nodes] == first + second
    il0, il1 = PRESETS["qwen3.5-9b"].gdn_layers[:2]
    assert {n.layer for n in g.nodes[: len(first)]} == {il0, -1}
    assert {n.layer for n in g.nodes[len(first):]} == {il1}


@pytest.mark.parametrize("n_t,n_rs", [(1, 0), (4, 3), (8, 7), (16, 15), (2, 7)])
def test_snapshot_cpys_columns_and_planes(n_t, n_rs):
    cfg = VerifyConfig("qwen3.5-9b", n_t, n_rs, n_layers=1)
    m = cfg.shape
    g = build_verify_graph(cfg)
    concat = next(n for n in g.nodes if n.op is Op.CONCAT)
    cache = next(t for t in g.leafs if t.name.startswith("cache_r"))
    cpys = [n for n in g.nodes if n.op is Op.CPY and n.src[0].view_src is concat]
    K = n_rs + 1
    assert len(cpys) == K
    row = cache.nb[1]
    planes = []
    for c in cpys:
        window, dst = c.src
        plane = (dst.view_offs // row - cfg.kv_head) // cfg.cells
        planes.append(plane)
        # plane s gets the window after n_t - s tokens, clamped at 0
        assert window.view_offs == 4 * max(0, n_t - plane)
        assert window.ne == (m.d_conv - 1, m.conv_channels, 1, 1)
        assert window.nb[1:3] == concat.nb[1:3]
        assert dst.ne[0] == m.n_embd_r and dst.nb[1] == row and dst.view_offs % row == 0
    assert planes == list(range(K - 1, -1, -1))  # plane K-1 first, plane 0 last


@pytest.mark.parametrize("n_t,n_rs", [(1, 0), (4, 3), (8, 7), (16, 15)])
def test_use_counts(n_t, n_rs):
    g = build_verify_graph(VerifyConfig("qwen3.5-9b", n_t, n_rs, n_layers=1))
    uc = g.use_counts()
    by_name = {n.name: n for n in g.nodes}
    assert uc[by_name["conv_input-0"].uid] == n_rs + 2          # K windows + SSM_CONV
    assert uc[by_name["conv_output_raw-0"].uid] == 1            # SSM_CONV's only user is SILU
    assert uc[by_name["conv_output_silu-0"].uid] == 3           # q, k, v views
    assert uc[by_name["attn_norm-0"].uid] == 4                  # qkv, z, beta, alpha projections
    assert uc[by_name["gdn_out-0"].uid] == 2                    # attn_output view, snapshot view
    assert uc[by_name["conv_states-0"].uid] == 1                # its reshape


def test_l2_views_have_head_geometry():
    cfg = VerifyConfig("qwen3.5-9b", 4, 3, n_layers=1)
    m = cfg.shape
    g = build_verify_graph(cfg)
    silu = g.find("conv_output_silu-0")
    q = g.find("q_conv-0")
    k = g.find("k_conv-0")
    assert q.view_src is silu and q.view_offs == 0 and k.view_offs == 4 * m.key_dim
    assert q.ne == (m.head_dim, m.n_k_heads, 4, 1) and q.nb == (4, 4 * m.head_dim, 4 * m.conv_channels, 16 * m.conv_channels)


def test_multi_sequence_and_dflash_flags():
    g = build_verify_graph(VerifyConfig("qwen3.5-9b", 4, 3, n_layers=6, n_seqs=2, dflash=True))
    ops.validate(g)
    outs = [n.name for n in g.nodes if n.flags & 2]
    assert len(outs) == 1 + len(g.meta["dflash_taps"]) and outs[-1].startswith("l_out")
    assert g.find("conv_input-0").ne == (3 + 4, 8192, 2, 1)


def test_config_errors_name_the_field():
    with pytest.raises(GraphError, match="'n_tokens'"):
        build_verify_graph(VerifyConfig("qwen3.5-9b", 513))
    with pytest.raises(GraphError, match="'n_rs_seq'"):
        build_verify_graph(VerifyConfig("qwen3.5-9b", 4, 16))
    with pytest.raises(GraphError, match="unknown model 'qwen9'"):
        build_verify_graph(VerifyConfig("qwen9", 4))
    with pytest.raises(GraphError, match="read_plane"):
        default_ids(VerifyConfig("qwen3.5-9b", 4, 3), read_plane=4)


def test_presets_shapes():
    assert PRESETS["qwen3.5-9b"].conv_channels == 8192 and len(PRESETS["qwen3.5-9b"].gdn_layers) == 24
    assert PRESETS["qwen3.5-27b"].conv_channels == 10240 and len(PRESETS["qwen3.5-27b"].gdn_layers) == 48
    assert PRESETS["qwen3-next-80b"].conv_channels == 8192 and len(PRESETS["qwen3-next-80b"].gdn_layers) == 36
    assert {PRESETS[n].d_conv for n in PRESETS if n.startswith("tiny")} == {3, 4, 5}


def test_qk_norm_rms_is_upstreams_build_gdn_l2_norm():
    """qk_norm="rms": where the L2_NORMs were, RMS_NORM(x, eps/n) then SCALE(1/sqrtf(n)) for q, then for k (upstream
    models.h build_gdn_l2_norm, qwen35.cpp), params the f32 values ggml stores; everything else unchanged."""
    import numpy as np

    from gdnpass.models import hparams

    assert VerifyConfig("tiny-dc4-h32", 2).qk_norm == hparams.DEFAULT_QK_NORM == "rms"  # upstream's form by default
    assert hparams.qk_rms_params(1e-6, 32) == (float(np.float32(3.125e-8)), float(np.float32(1) / np.sqrt(np.float32(32))))
    assert hparams.qk_rms_params(1e-6, 128) == (float(np.float32(1e-6) / np.float32(128)),
                                                float(np.float32(1) / np.sqrt(np.float32(128))))
    l2 = build_verify_graph(VerifyConfig("qwen3.5-9b", 4, 3, n_layers=1, qk_norm="l2"))
    g = build_verify_graph(VerifyConfig("qwen3.5-9b", 4, 3, n_layers=1, qk_norm="rms"))
    ops.validate(g)
    want = []
    for n in l2.nodes:
        want += [Op.RMS_NORM, Op.SCALE] if n.op is Op.L2_NORM else [n.op]
    assert [n.op for n in g.nodes] == want
    silu = next(n for n in g.nodes if n.name == "conv_output_silu-0")
    i = g.nodes.index(silu)
    q_view, q_rms, q_scale, k_view, k_rms, k_scale = g.nodes[i + 1:i + 7]
    eps, s = hparams.qk_rms_params(1e-6, 128)
    for view, rms, sc, name in ((q_view, q_rms, q_scale, "q"), (k_view, k_rms, k_scale, "k")):
        assert rms.src == [view] and rms.op_params == {"eps": eps} and view.view_src is silu
        assert sc.src == [rms] and sc.op_params == {"s": s, "b": 0.0, "inplace": False}
        assert sc.name == f"{name}_conv_predelta-0" and sc.layer == 0
    gdn = next(n for n in g.nodes if n.op is Op.GATED_DELTA_NET)
    assert gdn.src[0] is q_scale and gdn.src[1] is k_scale


def test_qk_norm_is_checked():
    with pytest.raises(GraphError, match="qk_norm"):
        build_verify_graph(VerifyConfig("tiny-dc4-h32", 2, qk_norm="layer"))


def test_dflash_taps_of_a_whole_forward_are_layer_inputs():
    """DFlash's rule (outputs of layers 1, 8, 15, 22, 29 for 32 layers and a 5-layer drafter), flagged as llama.cpp
    flags them: the *inputs* of the next layers (t_layer_inp), OUTPUT."""
    from gdnpass.ir import Flag
    from gdnpass.models.hparams import dflash_target_layers

    assert dflash_target_layers(32, 5) == [1, 8, 15, 22, 29]
    assert dflash_target_layers(64, 5) == [1, 16, 31, 46, 61] and dflash_target_layers(32, 1) == [16]
    g = build_verify_graph(VerifyConfig("qwen3.5-9b", 4, 3, whole=True, dflash=True, share_weights=True))
    outputs = {n.name for n in g.nodes if n.flags & Flag.OUTPUT}
    assert outputs == {f"l_out-{il}" for il in (1, 8, 15, 22, 29)} | {"h_nextn", "result_norm", "result_output"}
    assert g.meta["dflash_taps"] == [2, 9, 16, 23, 30]
