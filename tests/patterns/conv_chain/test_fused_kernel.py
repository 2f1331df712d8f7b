"""The conv chain's fused kernel (GDN_CONV_CHAIN) against the unfused ops it replaces: byte for byte on each backend
(the Triton one in the interpreter here, compiled on a GPU), with the aliasing the fusion allows; and against
independent math. (The mat-vec pair's fused kernel: tests/patterns/mat_vec_pair/test_fused_kernel.py.)

Everything lives in one NaN-poisoned uint8 arena and the kernels get strided views of it, as from the executor.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gdnpass.ir import Op, Unary
from gdnpass.kernels.backends import TORCH_BACKEND, TRITON_BACKEND
from support.arena import Arena, assert_close, node, rnd
from support.compare import assert_same_bytes

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

BACKENDS = pytest.mark.parametrize("backend", [TORCH_BACKEND, TRITON_BACKEND], ids=["torch", "triton"])
EPS = 1e-6


# ---- GDN_CONV_CHAIN -------------------------------------------------------------------------------------------------


def chain(S, H_k, H_v, dc, n_t, K, alias=""):
    """A one-sequence conv chain in a fresh arena, laid out as build_conv_state builds it (1 cell, kv_head 0).

    Cache rows 0..K-1 are the snapshot planes (plane s gets the window after n_t - s tokens), row K a copy of row 0
    and row K+1 a bystander; ids[0] is row K. ``alias``, comma-separated: "row": ids[0] is row 0, which plane 0
    writes; "out" / "out+d": the SiLU output is the projection's memory, shifted by d tokens (same channel, another
    token); "qk": the L2 outputs lie on the projection (node param l2_separate, as the matcher sets it). Never both
    "out" and "qk": the SiLU and L2 outputs of one graph do not overlap. "rms": q/k normalised in upstream's form,
    RMS_NORM(eps/S) then SCALE(1/sqrt(S)), instead of L2_NORM(eps)."""
    opts = alias.split(",") if alias else []
    shift = next((int(o[3:] or 0) for o in opts if o.startswith("out")), None)
    torch.manual_seed(0)
    a = Arena()
    C = (2 * H_k + H_v) * S
    cache = a.put(rnd(1, 1, K + 2, (dc - 1) * C))
    cache[0, 0, K] = cache[0, 0, 0]
    pad = 4  # spare token rows around the projection, for a shifted SiLU output
    tokens = a.view((1, 1, n_t + 2 * pad, C))
    proj = tokens[:, :, pad:pad + n_t].copy_(rnd(1, 1, n_t, C))  # qkv_mixed ne [C, n_t]
    w = a.put(rnd(1, 1, C, dc))
    ids = a.view((1, 1, 1, 1)).view(torch.int32).fill_(0 if "row" in opts else K)  # (Arena poisons floats)
    slots = range(K - 1, -1, -1)                        # build_conv_state's order: t = 1..K, slot K - t
    columns = [max(0, n_t - s) for s in slots]          # window offset after n_t - s tokens
    if "qk" in opts:
        q, k = proj.reshape(2, -1)[:, :n_t * H_k * S].unflatten(-1, (n_t, H_k, S)).split(1)
    else:
        q, k = a.view((1, n_t, H_k, S)), a.view((1, n_t, H_k, S))
    norm = {"norm": "rms", "eps": float(np.float32(EPS) / np.float32(S)),
            "scale": float(np.float32(1) / np.sqrt(np.float32(S)))} if "rms" in opts else {"norm": "l2", "eps": EPS}
    params = dict(d_conv=dc, n_tokens=n_t, columns=columns, head_dim=S, n_k_heads=H_k, l2_separate="qk" in opts,
                  **norm)
    return SimpleNamespace(
        a=a, C=C, S=S, H_k=H_k, dc=dc, n_t=n_t, cache=cache, x=proj.transpose(-1, -2), w=w, ids=ids,
        rows=[cache[:, :, s:s + 1] for s in slots], columns=columns, node=node(Op.GDN_CONV_CHAIN, **params), norm=norm,
        y=a.view((1, 1, n_t, C)) if shift is None else tokens[:, :, pad + shift:pad + shift + n_t], q=q, k=k)


def run_unfused(c, backend) -> None:
    """GET_ROWS -> CONCAT -> snapshot CPYs -> SSM_CONV -> SILU -> the q and k norms, each into its own view."""
    a, dc, C = c.a, c.dc, c.C
    states = a.view((1, 1, 1, (dc - 1) * C))
    backend[Op.GET_ROWS](node(Op.GET_ROWS), [c.cache, c.ids], states)
    conv_input = a.view((1, 1, C, dc - 1 + c.n_t))
    backend[Op.CONCAT](node(Op.CONCAT, dim=0), [states.view(1, 1, C, dc - 1), c.x], conv_input)
    for col, row in zip(c.columns, c.rows):
        backend[Op.CPY](node(Op.CPY), [conv_input[..., col:col + dc - 1], row], row)
    conv = a.view((1, 1, c.n_t, C))
    backend[Op.SSM_CONV](node(Op.SSM_CONV), [conv_input, c.w], conv)
    backend[Op.UNARY](node(Op.UNARY, kind=Unary.SILU.value), [conv], c.y)
    heads = c.y[0, 0].unflatten(-1, (-1, c.S))[None]
    for part, out in ((heads[:, :, :c.H_k], c.q), (heads[:, :, c.H_k:2 * c.H_k], c.k)):
        if c.norm["norm"] == "rms":  # upstream's build_gdn_l2_norm: RMS_NORM, then an out-of-place SCALE
            normed = a.view(tuple(part.shape))
            backend[Op.RMS_NORM](node(Op.RMS_NORM, eps=c.norm["eps"]), [part], normed)
            backend[Op.SCALE](node(Op.SCALE, s=c.norm["scale"], b=0.0), [normed], out)
        else:
            backend[Op.L2_NORM](node(Op.L2_NORM, eps=EPS), [part], out)


def run_fused(c, backend) -> None:
    src = [c.cache, c.ids, c.x, c.w, c.q, c.k, *c.rows]
    c.a.run(lambda: backend[Op.GDN_CONV_CHAIN](c.node, src, c.y), c.y, c.q, c.k, *c.rows)


def results(c) -> dict[str, torch.Tensor]:
    return {"cache": c.cache.clone(), "silu": c.y.clone(), "q": c.q.clone(), "k": c.k.clone()}


CHAIN_CASES = [  # S, H_k, H_v, dc, n_t, K, alias
    (32, 2, 4, 3, 1, 1, "row"),            # one-token decode, plane 0 rewrites the gathered row
    (64, 1, 2, 4, 4, 4, "row,out"),        # MTP verify, both aliasings of the seed
    (32, 2, 2, 4, 7, 8, "qk"),             # more rows than tokens: clamped windows; q/k on the projection
    (64, 1, 4, 4, 3, 3, ""),
    (128, 1, 1, 5, 16, 16, "row,out-3"),   # widest verify, most rows, SiLU over earlier token columns
    (128, 1, 2, 4, 9, 1, "out+2"),         # no snapshots; SiLU over later token columns
    (64, 1, 2, 4, 4, 4, "row,out,rms"),    # upstream's q/k form
    (32, 2, 2, 4, 7, 8, "qk,rms"),         # ... with q/k on the projection: RMS_NORM + SCALE in later launches
    (128, 1, 1, 5, 16, 16, "rms"),
]


@BACKENDS
@pytest.mark.parametrize("S,H_k,H_v,dc,n_t,K,alias", CHAIN_CASES)
def test_conv_chain_fused_is_unfused(backend, S, H_k, H_v, dc, n_t, K, alias):
    """Same bytes as the unfused chain on the same backend: SiLU, q, k, every snapshot row, the rest of the cache."""
    unfused, fused = chain(S, H_k, H_v, dc, n_t, K, alias), chain(S, H_k, H_v, dc, n_t, K, alias)
    run_unfused(unfused, backend)
    run_fused(fused, backend)
    want = results(unfused)
    for name, got in results(fused).items():
        assert_same_bytes(got, want[name], name)


@BACKENDS
@pytest.mark.parametrize("alias", ["row", "out", "out-4", "out+4", "qk", "row,qk"])
def test_conv_chain_aliasing_changes_nothing(backend, alias):
    """Each aliasing the fusion allows gives the bytes of the run without it."""
    case = (64, 2, 2, 4, 13, 4)
    plain, aliased = chain(*case), chain(*case, alias)
    run_fused(plain, backend)
    run_fused(aliased, backend)
    want = results(plain)
    for name, got in results(aliased).items():
        assert_same_bytes(got, want[name], name)


@pytest.mark.parametrize("case", [(32, 2, 4, 3, 1, 1), (64, 1, 2, 4, 6, 4), (128, 1, 1, 5, 16, 3)])
def test_conv_chain_triton_vs_torch(case):
    tri, ref = chain(*case, "row"), chain(*case, "row")
    run_fused(tri, TRITON_BACKEND)
    run_fused(ref, TORCH_BACKEND)
    want = results(ref)
    for name, got in results(tri).items():
        assert_close(got, want[name])
    assert_same_bytes(tri.cache, ref.cache, "cache")  # snapshot rows are copies: exact


def test_conv_chain_reference_vs_f64():
    """The torch reference against the chain written out on explicit windows in float64."""
    c = chain(32, 1, 2, 4, 5, 3, "row")
    S, H_k, dc, n_t, C = c.S, c.H_k, c.dc, c.n_t, c.C
    cache = c.cache.double().cpu().numpy()[0, 0]
    window = np.concatenate([cache[0].reshape(C, dc - 1), c.x.double().cpu().numpy()[0, 0]], axis=1)  # (C, dc-1+n_t)
    w = c.w.double().cpu().numpy()[0, 0]
    conv = np.stack([(window[:, t:t + dc] * w).sum(1) for t in range(n_t)])  # (n_t, C)
    y = conv / (1 + np.exp(-conv))
    heads = y.reshape(n_t, -1, S)
    qk = heads / np.maximum(np.linalg.norm(heads, axis=-1, keepdims=True), EPS)
    run_fused(c, TORCH_BACKEND)
    np.testing.assert_allclose(c.y.cpu().numpy()[0, 0], y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c.q.cpu().numpy()[0], qk[:, :H_k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c.k.cpu().numpy()[0], qk[:, H_k:2 * H_k], rtol=1e-5, atol=1e-6)
    for col, row in zip(c.columns, c.rows):
        np.testing.assert_array_equal(row.double().cpu().numpy().reshape(C, dc - 1), window[:, col:col + dc - 1])
    np.testing.assert_array_equal(c.cache.double().cpu().numpy()[0, 0, -2:], cache[-2:])  # rows K, K+1 untouched
