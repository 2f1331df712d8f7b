"""The deduplicated snapshot window (seed 003): the builder's "dedup" / "dedup-t" layouts, the matcher's shared-row
gate (rule 5b) and the fused kernel's one-tile store, bit for bit.

Kernel level: the tile path, the per-window path (the same node without its tile) and the torch reference against a
row built here from the spec (plane s = CONCAT columns max(0, n_t - s) .. +dc-2; the shared row holds CONCAT column c
at its column c), and no byte outside the written columns moves. Graph level: fused vs unfused through check_fusion.
"""

import json

import pytest
import torch

from gdnpass import cli
from gdnpass.check import check_fusion
from gdnpass.fusion import fuse
from gdnpass.errors import KernelError
from gdnpass.ir import GraphError, Op
from gdnpass.kernels.backends import TORCH_BACKEND, TRITON_BACKEND
from gdnpass.models import VerifyConfig, default_ids
from gdnpass.sweep import sweep_ids
from support import graphs
from support.arena import Arena, node, rnd
from support.compare import assert_bits
from support.graphs import CHAIN, CHAIN_OPS, triton_for

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

LAYOUTS = ["dedup", "dedup-t"]
EPS = 1e-6


# ---- kernel level ---------------------------------------------------------------------------------------------------


def shared_row(cache_w, cell, C, W, layout):
    """Cell ``cell``'s shared row as a [C, W] (channel, column) view."""
    flat = cache_w[0, 0, cell]
    return flat.view(C, W) if layout == "dedup" else flat.view(W, C).T


def chain(S, H_k, H_v, dc, n_t, n_rs, layout, read_plane, cells=3, cell=1, seed=0):
    """One sequence at cell ``cell`` of ``cells``, laid out as the builder lays out ``layout``: plane 0 a row of
    cache_r, planes 1..n_rs windows of cache_w (random bytes everywhere, so untouched bytes are checkable). The
    gathered row is plane ``read_plane`` of the cell: plane 0 is the row plane 0 rewrites, another plane an
    accepted-token offset (a row nobody writes)."""
    torch.manual_seed(seed)
    a = Arena()
    C, W, K = (2 * H_k + H_v) * S, n_t + dc - 2, n_rs + 1
    cache_r = a.put(rnd(1, 1, cells * K, (dc - 1) * C))
    cache_w = a.put(rnd(1, 1, cells, W * C))
    proj = a.put(rnd(1, 1, n_t, C))
    w = a.put(rnd(1, 1, C, dc))
    ids = a.view((1, 1, 1, 1)).view(torch.int32).fill_(read_plane * cells + cell)
    slots = range(K - 1, -1, -1)  # build_conv_state's order
    columns = [max(0, n_t - s) for s in slots]
    row = shared_row(cache_w, cell, C, W, layout)[None, None]
    rows = [cache_r[:, :, cell:cell + 1] if s == 0 else row[..., c:c + dc - 1] for s, c in zip(slots, columns)]
    first = max(0, n_t - n_rs)  # the spec's range: planes n_rs..1 write CONCAT columns first .. W-1
    tile = {"windows": list(range(n_rs)), "first": first, "n_cols": W - first} if n_rs else None
    params = dict(d_conv=dc, n_tokens=n_t, columns=columns, eps=EPS, head_dim=S, n_k_heads=H_k,
                  l2_separate=False)
    y, q, k = a.view((1, 1, n_t, C)), a.view((1, n_t, H_k, S)), a.view((1, n_t, H_k, S))
    src = [cache_r, ids, proj.transpose(-1, -2), w, q, k, *rows]
    return dict(a=a, C=C, W=W, dc=dc, n_t=n_t, cell=cell, layout=layout, cache_r=cache_r, cache_w=cache_w, src=src,
                y=y, q=q, k=k, rows=rows, first=first, params=params, tile=tile, gathered=read_plane * cells + cell)


def run(c, backend, tile: bool) -> None:
    params = {**c["params"], **({"tile": c["tile"]} if tile and c["tile"] else {})}
    c["a"].run(lambda: backend[Op.GDN_CONV_CHAIN](node(Op.GDN_CONV_CHAIN, **params), c["src"], c["y"]),
               c["y"], c["q"], c["k"], *c["rows"])


def expected_caches(c, cache_r, cache_w):
    """The caches as the spec says they end: plane 0's window in its row, CONCAT columns first .. W-1 in the shared
    row, every other byte (other cells, other rows, columns before ``first``) as it was."""
    C, dc, n_t, cell = c["C"], c["dc"], c["n_t"], c["cell"]
    concat = torch.cat([cache_r[0, 0, c["gathered"]].view(C, dc - 1), c["src"][2][0, 0]], dim=1)  # [C, W + 1]
    want_r, want_w = cache_r.clone(), cache_w.clone()
    want_r[0, 0, cell] = concat[:, n_t:n_t + dc - 1].reshape(-1)
    shared_row(want_w, cell, C, c["W"], c["layout"])[:, c["first"]:] = concat[:, c["first"]:c["W"]]
    return want_r, want_w


SHAPES = [(32, 1, 1, 4), (32, 2, 2, 3), (64, 1, 2, 5)]  # S, H_k, H_v, dc: C = 96 (3 programs), 192, 256
TN = [(1, 1), (1, 3), (2, 1), (3, 5), (8, 3), (8, 8), (9, 15), (16, 15), (16, 7)]  # T, n_rs: full, clamped, partial
KERNEL_CASES = [(*SHAPES[i % 3], T, n_rs, i % 2 * min(2, n_rs)) for i, (T, n_rs) in enumerate(TN)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("S,H_k,H_v,dc,n_t,n_rs,read_plane", KERNEL_CASES)
def test_tile_vs_per_window_vs_reference(layout, S, H_k, H_v, dc, n_t, n_rs, read_plane):
    """Bitwise: the tile store, the per-window stores and the torch reference leave the same bytes everywhere, the
    bytes the spec says (and only written columns change: Arena.run checks nothing outside the outputs moves)."""
    case = (S, H_k, H_v, dc, n_t, n_rs, layout, read_plane)
    tiled, per_window, ref = chain(*case), chain(*case), chain(*case)
    before_r, before_w = tiled["cache_r"].clone(), tiled["cache_w"].clone()
    run(tiled, TRITON_BACKEND, tile=True)
    run(per_window, TRITON_BACKEND, tile=False)
    run(ref, TORCH_BACKEND, tile=True)
    want_r, want_w = expected_caches(tiled, before_r, before_w)
    for c, what in ((tiled, "tile"), (per_window, "per-window"), (ref, "torch reference")):
        assert_bits(c["cache_r"], want_r, f"{what}: conv cache")
        assert_bits(c["cache_w"], want_w, f"{what}: shared rows")
    for v in ("y", "q", "k"):
        assert not tiled[v].isnan().any()
        assert_bits(tiled[v], per_window[v], v)
        torch.testing.assert_close(tiled[v], ref[v], rtol=1e-5, atol=1e-5)


def test_tile_arguments():
    """The launch the tile path gets: exactly the written columns (first 0, T + dc - 2 of them) and the shared row's
    strides; without a tile zeros (TILE_N = 0: no stores); a "tile" whose windows are not one shared row is refused."""
    from gdnpass.kernels import triton_ssm as ssm

    c = chain(*SHAPES[0], 8, 8, "dedup", 1)
    wins = [r.view(1, c["C"], c["dc"] - 1) for r in c["rows"]]  # (sequence, channel, step), as the launcher's
    args, first, n = ssm._tile_args(c["cache_r"], wins, c["params"]["columns"], c["tile"], c["dc"])
    assert (first, n) == (0, 10) and args[1:3] == (1, c["W"])  # columns 0..9 (T + dc - 2 = 10), step 1, channel W
    assert ssm._tile_args(c["cache_r"], wins, c["params"]["columns"], None, c["dc"]) == ((0, 0, 0, 0), 0, 0)
    bad = {**c["tile"], "windows": [0, 1, 8]}  # plane 0's row is no window of the shared row
    with pytest.raises(KernelError, match="shared row"):
        ssm._tile_args(c["cache_r"], wins, c["params"]["columns"], bad, c["dc"])


# ---- graph level ----------------------------------------------------------------------------------------------------


def planned(layout="dedup", model="tiny-dc4-h64", n_t=4, n_rs=3, **kw):
    return graphs.planned(model, n_t, n_rs, snapshot_layout=layout, **{"ffn": False, **kw})


def fused_node(g):
    (f,) = [n for n in g.nodes if n.op is Op.GDN_CONV_CHAIN]
    return f


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n_t,n_rs,kv_head", [(1, 1, 0), (4, 3, 1), (3, 7, 0), (8, 2, 1), (16, 15, 0)])
def test_builder_layout_and_tile_description(layout, n_t, n_rs, kv_head):
    """Plane 0 stays a conv-cache row; planes 1..n_rs are windows of cache_w at column max(0, n_t - s); the fused
    node's tile covers CONCAT columns max(0, n_t - n_rs) .. n_t + dc - 3."""
    cfg, g = planned(layout, n_t=n_t, n_rs=n_rs, kv_head=kv_head, mem_size=3)
    cache_w = g.find("cache_w_l0")
    W, C = n_t + 2, 256
    assert cache_w.ne[:2] == (W * C, 3) and cache_w.buffer == "cache"
    fuse(g, enabled=True, patterns=CHAIN)
    f = fused_node(g)
    dsts = f.outs[2:]  # after q and k
    assert [d.base.name for d in dsts] == ["cache_w_l0"] * n_rs + ["cache_r_l0"]
    col_nb, ch_nb = (4, 4 * W) if layout == "dedup" else (4 * C, 4)
    for d, s in zip(dsts, range(n_rs, 0, -1)):
        assert (d.nb[0], d.nb[1]) == (col_nb, ch_nb)
        assert d.view_offs == kv_head * cache_w.nb[1] + max(0, n_t - s) * col_nb
    first = max(0, n_t - n_rs)
    if n_rs == 1:  # one window shares no column with another: the per-window path (measured faster)
        assert "tile" not in f.op_params
        return
    assert f.op_params["tile"] == {"windows": list(range(n_rs)), "base": "cache_w_l0",
                                   "offset": kv_head * cache_w.nb[1], "first": first, "n_cols": W - first}


def test_rows_layout_has_no_tile():
    _, g = planned("rows")
    assert not [t for t in g.leafs if t.name.startswith("cache_w")]
    fuse(g, enabled=True, patterns=CHAIN)
    assert "tile" not in fused_node(g).op_params


def test_bad_layout_is_a_config_error():
    with pytest.raises(GraphError, match="snapshot_layout"):
        VerifyConfig("tiny-dc4-h64", 4, 3, snapshot_layout="tiles").check()


ids_for = sweep_ids  # alternate: plane 1 of the own cell (an accepted-token offset), then the last plane of the other


def assert_identical(res):
    graphs.assert_identical(res, compared={"cache_w_l0"})


GRAPH_CASES = [(T, n_rs, model) for T, n_rs, model in [
    (1, 1, "tiny-dc4-h64"), (2, 5, "tiny-dc3-h32"), (3, 3, "tiny-dc5-h128"), (8, 3, "tiny-dc4-h32"),
    (9, 15, "tiny-dc4-h128"), (16, 15, "tiny-dc3-h32"), (16, 4, "tiny-dc5-h128")]]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", range(len(GRAPH_CASES)))
def test_fused_is_unfused_torch(layout, case):
    n_t, n_rs, model = GRAPH_CASES[case]
    cfg, g = planned(layout, model, n_t, n_rs)
    assert_identical(check_fusion(g, patterns=CHAIN, ids=ids_for(cfg, case), seed=case))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
@pytest.mark.parametrize("layout,case", [("dedup", 2), ("dedup-t", 1), ("dedup", 5)])
def test_fused_is_unfused_triton_interpreter(layout, case):
    n_t, n_rs, model = GRAPH_CASES[case]
    cfg, g = planned(layout, model, n_t, n_rs)
    table = triton_for(CHAIN_OPS)  # the chain's ops on Triton, the rest on torch
    assert_identical(check_fusion(g, patterns=CHAIN, backend=table, ids=ids_for(cfg, case), seed=case))
    assert "tile" in fused_node(g).op_params


# ---- what the gate refuses ------------------------------------------------------------------------------------------


def move_windows(g, offs=None, nb=None):
    """Give the shared-row windows (and their CPYs, which view them) new offsets offs(i, old) / strides nb(i, old)."""
    cpys = [n for n in g.nodes if n.op is Op.CPY and n.src[1].base.name.startswith("cache_w")]
    for i, cpy in enumerate(cpys):
        for t in (cpy, cpy.src[1]):
            t.view_offs = offs(i, t.view_offs) if offs else t.view_offs
            t.nb = nb(i, t.nb) if nb else t.nb


def m_step_stride(g):  # the planes step two columns, their windows one: step stride != window stride
    move_windows(g, offs=lambda i, o: 2 * o)


def m_channel_stride(g):  # one plane with another channel stride
    move_windows(g, nb=lambda i, nb: (nb[0], nb[1] + 4 * (i == 0), *nb[2:]))


@pytest.mark.parametrize("mutate", [m_step_stride, m_channel_stride])
def test_unequal_strides_are_refused(mutate):
    """Overlapping windows that are not one shared row would write different values to one address."""
    _, g = planned("dedup")
    mutate(g)
    report = fuse(g, enabled=True, patterns=CHAIN)
    assert [r.rule for r in report.refused] == ["cpy-run.row-written-twice"], [r.describe() for r in report.refused]
    assert report.refused[0].ranges is not None and not report.applied


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU tensors through the Triton interpreter"))])
def test_disjoint_windows_keep_the_per_window_path(backend):
    """Windows of another layout (each in its own cell, not one shared row) do not overlap: fused, no tile."""
    cfg, g = planned("dedup", n_t=2, n_rs=2, mem_size=3)
    row = g.find("cache_w_l0").nb[1]
    move_windows(g, offs=lambda i, o: o + i * row)
    res = check_fusion(g, patterns=CHAIN, backend=backend, ids=default_ids(cfg, read_plane=1))
    assert_identical(res)
    assert "tile" not in fused_node(g).op_params


def test_windows_on_the_cache_are_refused():
    """A shared row laid over the conv cache's plane rows: a program's tile could land on what another program
    gathers."""
    _, g = planned("dedup")
    cache_r, cache_w = g.find("cache_r_l0"), g.find("cache_w_l0")
    cache_w.offset = cache_r.offset + 2 * cache_r.nb[1]  # over plane 1 (rows 2, 3), clear of plane 0's row
    report = fuse(g, enabled=True, patterns=CHAIN)
    assert [r.rule for r in report.refused] == ["alias.output-overlaps-input"], [r.describe() for r in report.refused]


# ---- the CLI --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cli_flag(layout, capsys):
    args = ["--model", "tiny-dc4-h64", "--tokens", "4", "--rs-seq", "3", "--layers", "1", "--snapshot-layout", layout]
    assert cli.main(["run", *args, "--check", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["identical"] and "cache_w_l0" in {t["tensor"] for t in res["tensors"]}
    assert cli.verify_config(cli.make_parser().parse_args(["dump", *args])).snapshot_layout == layout
