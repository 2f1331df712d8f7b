"""The conv chain's fused kernel (GDN_CONV_CHAIN) against the unfused ops it replaces: byte for byte on each backend
(the Triton one in the interpreter here, compiled on a GPU), with the aliasing the fusion allows; and against
independent math. (The mat-vec pair's fused kernel: tests/patterns/mat_vec_pair/test_fused_kernel.py.)

Everything lives in one NaN-poisoned uint8 arena and the kernels get strided views of it, as from the executor.
"""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton

from gdnpass.errors import KernelError
from gdnpass.ir import Op, Unary
from gdnpass.kernels import triton_ssm
from gdnpass.kernels.backends import TORCH_BACKEND, TRITON_BACKEND
from support.arena import Arena, assert_close, node, rnd
from support.compare import assert_same_bytes

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

BACKENDS = pytest.mark.parametrize("backend", [TORCH_BACKEND, TRITON_BACKEND], ids=["torch", "triton"])
EPS = 1e-6


# ---- GDN_CONV_CHAIN -------------------------------------------------------------------------------------------------


def chain(S, H_k, H_v, dc, n_t, K, alias="", n_s=1, nbytes=1 << 22):
    """A conv chain of ``n_s`` sequences in a fresh arena, laid out as build_conv_state builds it (cells 0..n_s-1,
    kv_head 0).

    Cache rows 0..K*n_s-1 are the snapshot planes (plane s of cell c: row s*n_s + c; plane s gets the window after
    n_t - s tokens), rows K*n_s + c copies of row c and the last row a bystander; sequence c gathers row K*n_s + c.
    ``alias``, comma-separated: "row": each sequence gathers plane 0 of its own cell, which its plane 0 writes;
    "swap": plane 0 of the next cell (sequence c the row sequence c+1 writes: find_slot's swap); "rollback": plane
    c % K of the next cell (a rolled-back sequence reads another plane, which another sequence writes); "out" /
    "out+d": the SiLU output is the projection's memory, shifted by d token rows (same channel, another token, of
    any sequence); "qk": the L2 outputs lie on the projection (node param l2_separate, as the matcher sets it).
    Never both "out" and "qk": the SiLU and L2 outputs of one graph do not overlap. "rms": q/k normalised in
    upstream's form, RMS_NORM(eps/S) then SCALE(1/sqrt(S)), instead of L2_NORM(eps). ``nbytes``: the arena."""
    opts = alias.split(",") if alias else []
    shift = next((int(o[3:] or 0) for o in opts if o.startswith("out")), None)
    torch.manual_seed(0)
    a = Arena(nbytes)
    C = (2 * H_k + H_v) * S
    cache = a.put(rnd(1, 1, (K + 1) * n_s + 1, (dc - 1) * C))
    cache[0, 0, K * n_s:(K + 1) * n_s] = cache[0, 0, :n_s]
    pad = 4  # spare token rows around the projection, for a shifted SiLU output
    tokens = a.view((1, 1, n_s * n_t + 2 * pad, C))[0, 0]
    proj = tokens[pad:pad + n_s * n_t].copy_(rnd(n_s * n_t, C)).view(1, n_s, n_t, C)  # qkv_mixed ne [C, n_t, n_s]
    w = a.put(rnd(1, 1, C, dc))
    if "rollback" in opts:
        gathered = [(c % K) * n_s + (c + 1) % n_s for c in range(n_s)]
    elif "swap" in opts:
        gathered = [(c + 1) % n_s for c in range(n_s)]
    else:
        gathered = [c if "row" in opts else K * n_s + c for c in range(n_s)]
    ids = a.view((1, 1, 1, n_s)).view(torch.int32)  # (Arena poisons floats)
    ids.copy_(torch.tensor(gathered, dtype=torch.int32).view(1, 1, 1, n_s))
    slots = range(K - 1, -1, -1)                        # build_conv_state's order: t = 1..K, slot K - t
    columns = [max(0, n_t - s) for s in slots]          # window offset after n_t - s tokens
    if "qk" in opts:
        q, k = (t[0] for t in proj.reshape(2, -1)[:, :n_s * n_t * H_k * S].unflatten(-1, (n_s, n_t, H_k, S)).split(1))
    else:
        q, k = a.view((n_s, n_t, H_k, S)), a.view((n_s, n_t, H_k, S))
    norm = {"norm": "rms", "eps": float(np.float32(EPS) / np.float32(S)),
            "scale": float(np.float32(1) / np.sqrt(np.float32(S)))} if "rms" in opts else {"norm": "l2", "eps": EPS}
    params = dict(d_conv=dc, n_tokens=n_t, columns=columns, head_dim=S, n_k_heads=H_k, l2_separate="qk" in opts,
                  **norm)
    y = a.view((1, n_s, n_t, C)) if shift is None else tokens[pad + shift:pad + shift + n_s * n_t].view(1, n_s, n_t, C)
    return SimpleNamespace(
        a=a, C=C, S=S, H_k=H_k, dc=dc, n_t=n_t, n_s=n_s, cache=cache, x=proj.transpose(-1, -2), w=w, ids=ids,
        rows=[cache[:, :, s * n_s:(s + 1) * n_s] for s in slots], columns=columns, gathered=gathered,
        node=node(Op.GDN_CONV_CHAIN, **params), norm=norm, y=y, q=q, k=k)


def run_unfused(c, backend) -> None:
    """GET_ROWS -> CONCAT -> snapshot CPYs -> SSM_CONV -> SILU -> the q and k norms, each into its own view."""
    a, dc, C, n_s = c.a, c.dc, c.C, c.n_s
    states = a.view((1, 1, n_s, (dc - 1) * C))
    backend[Op.GET_ROWS](node(Op.GET_ROWS), [c.cache, c.ids], states)
    conv_input = a.view((1, n_s, C, dc - 1 + c.n_t))
    backend[Op.CONCAT](node(Op.CONCAT, dim=0), [states.view(1, n_s, C, dc - 1), c.x], conv_input)
    for col, row in zip(c.columns, c.rows):
        backend[Op.CPY](node(Op.CPY), [conv_input[..., col:col + dc - 1], row], row)
    conv = a.view((1, n_s, c.n_t, C))
    backend[Op.SSM_CONV](node(Op.SSM_CONV), [conv_input, c.w], conv)
    backend[Op.UNARY](node(Op.UNARY, kind=Unary.SILU.value), [conv], c.y)
    heads = c.y[0].unflatten(-1, (-1, c.S))
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


# ---- several sequences ----------------------------------------------------------------------------------------------

SEQ_CASES = [  # S, H_k, H_v, dc, n_t, K, alias, n_s
    (32, 2, 4, 3, 1, 1, "row", 2),             # one-token decode of two sequences, each rewriting its gathered row
    (64, 1, 2, 4, 4, 4, "swap,out", 3),        # each gathers the row the next sequence writes
    (32, 2, 2, 4, 7, 8, "rollback,qk", 2),     # other planes of other cells; q/k on the projection
    (64, 1, 2, 4, 4, 4, "rollback,out+3,rms", 3),  # the SiLU output shifted into the next sequence's tokens
    (32, 1, 2, 5, 3, 2, "swap,out-4", 5),      # ... into the previous one's; 5 sequences (a masked tile of 8)
    (128, 1, 1, 4, 8, 8, "rollback", 8),
]
SEQ_IDS = [f"{c[7]}x{c[4]}-K{c[5]}-{c[6]}" for c in SEQ_CASES]


@BACKENDS
@pytest.mark.parametrize("S,H_k,H_v,dc,n_t,K,alias,n_s", SEQ_CASES, ids=SEQ_IDS)
def test_conv_chain_of_several_sequences_fused_is_unfused(backend, S, H_k, H_v, dc, n_t, K, alias, n_s):
    """n_s sequences in one launch, whichever rows the ids gather (their own, the one another sequence writes,
    another plane): the bytes of the unfused chain on the same backend."""
    case = (S, H_k, H_v, dc, n_t, K, alias, n_s)
    unfused, fused = chain(*case), chain(*case)
    run_unfused(unfused, backend)
    run_fused(fused, backend)
    want = results(unfused)
    for name, got in results(fused).items():
        assert_same_bytes(got, want[name], name)


@pytest.mark.parametrize("S,H_k,H_v,dc,n_t,K,alias,n_s", SEQ_CASES[1:4], ids=SEQ_IDS[1:4])
@pytest.mark.parametrize("tile", [64, 16])
def test_a_head_over_several_programs_changes_nothing(monkeypatch, tile, S, H_k, H_v, dc, n_t, K, alias, n_s):
    """A smaller CONCAT tile (so a head spans 2..64 programs, the last of which normalises its q and k) gives the
    bytes of the head-a-program launch, and of the unfused Triton kernels."""
    case = (S, H_k, H_v, dc, n_t, K, alias, n_s)
    whole, unfused, split = chain(*case), chain(*case), chain(*case)
    run_fused(whole, TRITON_BACKEND)
    run_unfused(unfused, TRITON_BACKEND)
    monkeypatch.setattr(triton_ssm, "CHAIN_TILE", tile)
    assert triton_ssm.chain_block(n_s, S, dc, n_t) < S  # (the path under test)
    run_fused(split, TRITON_BACKEND)
    want, same = results(whole), results(unfused)
    for name, got in results(split).items():
        assert_same_bytes(got, want[name], name)
        assert_same_bytes(got, same[name], name)


@pytest.mark.parametrize("S,H_k,H_v,dc,n_t,K,alias,n_s", SEQ_CASES[:3], ids=SEQ_IDS[:3])
def test_conv_chain_of_several_sequences_triton_vs_torch(S, H_k, H_v, dc, n_t, K, alias, n_s):
    """The Triton kernel against its torch reference: the snapshot rows exactly (copies); the SiLU and q/k to the
    interpreter's exp (numpy's, not torch's: bit for bit only compiled, tests/patterns/conv_chain/test_seqs.py)."""
    case = (S, H_k, H_v, dc, n_t, K, alias, n_s)
    tri, ref = chain(*case), chain(*case)
    run_fused(tri, TRITON_BACKEND)
    run_fused(ref, TORCH_BACKEND)
    want = results(ref)
    for name, got in results(tri).items():
        assert_close(got, want[name])
    assert_same_bytes(tri.cache, ref.cache, "cache")


@pytest.mark.gpu
def test_128_sequences_of_8_tokens_compiled_gpu():
    """qwen3.5-9b's chain (C = 8192, heads of 128, d_conv 4) of 128 sequences of 8 tokens, 8 snapshot planes, the
    ids rolled back across sequences, upstream's q/k form, compiled (blocks of 8 channels, a head over 16 programs):
    fused vs unfused Triton byte for byte; against the torch reference the cache and the SiLU output bit for bit
    (copies; the conv taps in order, libdevice's exp and an IEEE quotient, as torch's), q/k to the sum order (the
    reference's torch sum, the kernel's fixed tree)."""
    case = (128, 16, 32, 4, 8, 8, "rollback,rms", 128)
    unfused, fused, ref = (chain(*case, nbytes=1 << 29) for _ in range(3))
    assert triton_ssm.chain_launch(8, 128, n_seqs=128, d_conv=4)[0]["BLOCK_C"] == 8
    run_unfused(unfused, TRITON_BACKEND)
    run_fused(fused, TRITON_BACKEND)
    run_fused(ref, TORCH_BACKEND)
    want, torch_ref = results(unfused), results(ref)
    for name, got in results(fused).items():
        assert_same_bytes(got, want[name], name)
        if name in ("cache", "silu"):
            assert_same_bytes(got, torch_ref[name], name)
        else:
            assert_close(got, torch_ref[name])


def test_chain_block_keeps_the_tile_in_budget():
    """A head a program while the CONCAT tile of every sequence fits CHAIN_TILE; then halved until it does."""
    assert triton_ssm.chain_block(1, 128, 4, 16) == 128
    assert triton_ssm.chain_block(8, 128, 4, 13) == 128 and triton_ssm.chain_block(8, 128, 4, 14) == 64
    assert triton_ssm.chain_block(128, 128, 4, 8) == 8  # 11 columns x 128 x 8 = 11264 <= 16384
    assert triton_ssm.chain_block(128, 128, 5, 16) == 4
    for n_s, n_t in itertools.product((1, 2, 3, 8, 33, 128), (1, 4, 16)):
        b = triton_ssm.chain_block(n_s, 128, 4, n_t)
        assert triton.next_power_of_2(n_s) * b * (3 + n_t) <= triton_ssm.CHAIN_TILE < \
            triton.next_power_of_2(n_s) * 2 * b * (3 + n_t) or b == 128


def test_the_launcher_refuses_ids_outside_the_cache():
    c = chain(32, 1, 2, 4, 2, 2, "swap", 3)
    c.ids[0, 0, 0, 1] = c.cache.shape[2]
    with pytest.raises(KernelError, match=f"GDN_CONV_CHAIN: row id {c.cache.shape[2]} is outside the source's"):
        run_fused(c, TRITON_BACKEND)


@pytest.mark.parametrize("n_s,alias", [(1, "row"), (3, "swap"), (3, "rollback")])
def test_conv_chain_reference_vs_f64(n_s, alias):
    """The torch reference against the chain written out on explicit windows in float64, each sequence's window
    from the row it gathers before any is written."""
    c = chain(32, 1, 2, 4, 5, 3, alias, n_s)
    S, H_k, dc, n_t, C = c.S, c.H_k, c.dc, c.n_t, c.C
    cache = c.cache.double().cpu().numpy()[0, 0]
    x = c.x.double().cpu().numpy()[0]  # (n_s, C, n_t)
    w = c.w.double().cpu().numpy()[0, 0]
    run_fused(c, TORCH_BACKEND)
    for sq, row in enumerate(c.gathered):
        window = np.concatenate([cache[row].reshape(C, dc - 1), x[sq]], axis=1)  # (C, dc-1+n_t)
        conv = np.stack([(window[:, t:t + dc] * w).sum(1) for t in range(n_t)])  # (n_t, C)
        y = conv / (1 + np.exp(-conv))
        heads = y.reshape(n_t, -1, S)
        qk = heads / np.maximum(np.linalg.norm(heads, axis=-1, keepdims=True), EPS)
        np.testing.assert_allclose(c.y.cpu().numpy()[0, sq], y, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(c.q.cpu().numpy()[sq], qk[:, :H_k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(c.k.cpu().numpy()[sq], qk[:, H_k:2 * H_k], rtol=1e-5, atol=1e-6)
        for col, rows in zip(c.columns, c.rows):
            np.testing.assert_array_equal(rows[0, 0, sq].double().cpu().numpy().reshape(C, dc - 1),
                                          window[:, col:col + dc - 1])
    rest = slice(3 * n_s, None)  # the copies and the bystander: untouched
    np.testing.assert_array_equal(c.cache.double().cpu().numpy()[0, 0, rest], cache[rest])
