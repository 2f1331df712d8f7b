"""Triton kernels of the GDN layer's recurrent ops: SSM_CONV, GATED_DELTA_NET and the fused GDN_CONV_CHAIN
(GET_ROWS -> CONCAT -> snapshot CPYs -> SSM_CONV -> SILU -> q/k normalisation in one launch). The chain computes
with the unfused kernels' helpers (:func:`~gdnpass.kernels.triton_core.conv_dot`, SiLU, the L2 / RMS row scales of
:mod:`gdnpass.kernels.triton_core`) and, with ``l2_separate``, launches the unfused norm kernels themselves, so its
bytes are the unfused chain's. Conventions: :mod:`gdnpass.kernels.triton_core`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnpass.kernels.limits import CHAIN, check_row_ids, gate_input_flat, snapshots_on_whole_rows
from gdnpass.kernels.reference import f32, gdn_scale
from gdnpass.kernels.triton_core import (LAUNCH, _alias_ok, _require, _strides, chain_args, chain_at, chain_sides,
                                         conv_dot, l2_scale_rows, last_to_arrive, rms_scale_rows, silu_f32_unrolled,
                                         split_workspace, wait_for_previous_kernels)
from gdnpass.kernels.triton_elementwise import scale
from gdnpass.kernels.triton_norms import l2_norm, rms_norm

CONV_BLOCK_C = 256  # channels per program (SSM_CONV; taps need no reduction tree, any block gives the same bytes)
MAX_UNROLLED_T = tl.constexpr(16)  # SSM_CONV and GATED_DELTA_NET unroll their token loops up to a verify's width
GDN_BLOCK_V = 16    # value columns per GDN program (the state slice is [S, GDN_BLOCK_V]), in GDN_WARPS warps
GDN_WARPS = 8       # (H200, S 128: 16 columns x 8 warps beat 32 x 4 at 1-16 tokens, docs/performance.md)


# ---- SSM_CONV -------------------------------------------------------------------------------------------------------


@triton.jit
def _ssm_conv_kernel(sx_ptr, c_ptr, y_ptr, C, n_t,
                     sx_s0, sx_s1, sx_s2,  # sx [dc-1+n_t, C, n_s]
                     c_s0, c_s1,           # c  [dc, C]
                     y_s0, y_s1, y_s2,     # y  [C, n_t, n_s]
                     D_CONV: tl.constexpr, BLOCK_C: tl.constexpr, N_T: tl.constexpr):
    wait_for_previous_kernels()
    seq = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = ch < C
    s_ptrs = sx_ptr + seq * sx_s2 + ch * sx_s1
    y_ptrs = y_ptr + seq * y_s2 + ch * y_s0
    w = ()
    for j in tl.static_range(D_CONV):
        w = w + (tl.load(c_ptr + ch * c_s1 + j * c_s0, mask=mask, other=0.0),)
    if N_T > 0:  # a verify's few tokens, unrolled: every window column loaded once, all loads in one round trip
        cols = ()
        for i in tl.static_range(D_CONV - 1 + N_T):
            cols = cols + (tl.load(s_ptrs + i * sx_s0, mask=mask, other=0.0),)
        for t in tl.static_range(N_T):
            win = ()
            for j in tl.static_range(D_CONV):
                win = win + (cols[t + j],)
            tl.store(y_ptrs + t * y_s1, conv_dot(win, w), mask=mask)
    else:  # a prompt's many tokens
        for t in range(n_t):
            win = ()
            for j in tl.static_range(D_CONV):
                win = win + (tl.load(s_ptrs + (t + j) * sx_s0, mask=mask, other=0.0),)
            tl.store(y_ptrs + t * y_s1, conv_dot(win, w), mask=mask)


def ssm_conv(sx: torch.Tensor, c: torch.Tensor, out: torch.Tensor, block_c: int = CONV_BLOCK_C) -> None:
    """SSM_CONV into ``out`` (ne [C, n_t, n_s]); sx ne [dc-1+n_t, C, n_s], c ne [dc, C], all f32. Up to
    MAX_UNROLLED_T tokens the token loop is unrolled (one compile per n_t); the same taps in the same order
    either way (conv_dot), so the bytes do not depend on it."""
    n_s, n_t, C = out.shape[1], out.shape[2], out.shape[3]
    d_conv = c.shape[-1]
    if out.numel() == 0:
        return
    sx_s, c_s, y_s = _strides(sx), _strides(c), _strides(out)
    _ssm_conv_kernel[(n_s, triton.cdiv(C, block_c))](
        sx, c, out, C, n_t, sx_s[0], sx_s[1], sx_s[2], c_s[0], c_s[1], y_s[0], y_s[1], y_s[2],
        D_CONV=d_conv, BLOCK_C=block_c, N_T=n_t if n_t <= MAX_UNROLLED_T else 0, **LAUNCH)


# ---- GATED_DELTA_NET ------------------------------------------------------------------------------------------------


@triton.jit
def _gdn_inputs(q_ptr, k_ptr, v_ptr, t, seq, h, H_k, i, imask, col, cmask, strides):
    """Token t's q, k (as a column) and v for head h (key rows past the head size: zeros)."""
    qk_s1, qk_s2, qk_s3, v_s1, v_s2, v_s3 = strides
    qk = seq * qk_s3 + t * qk_s2 + (h % H_k) * qk_s1
    q = tl.load(q_ptr + qk + i, mask=imask, other=0.0)
    kk = tl.load(k_ptr + qk + i, mask=imask, other=0.0)[:, None]
    v = tl.load(v_ptr + seq * v_s3 + t * v_s2 + h * v_s1 + col, mask=cmask, other=0.0)
    return q, kk, v


@triton.jit
def _gdn_gates(t, tmask, seq, h, i, imask, G, B, G_STEPS: tl.constexpr, G_SIDES: tl.constexpr, G_ROW: tl.constexpr,
               G_FLAT: tl.constexpr, B_STEPS: tl.constexpr, B_SIDES: tl.constexpr, B_FLAT: tl.constexpr):
    """The decay exp(g) and beta of token t (or of the tokens of a vector t), head h. g and beta are read through
    :func:`~gdnpass.kernels.triton_core.chain_at` at their (key row, head, token, seq) (g [S or 1, H_v, n_t,
    n_s], beta [1, H_v, n_t, n_s]): with no steps, the operand's own element; with the steps of the elementwise node
    that produced it (the gdn_gates pattern), that node's value there, computed from its inputs, which lie in the
    operand's shape or (``*_FLAT``) in it without its leading 1 ([H_v, n_t, n_s]). A decay a key row (G_ROW, one
    token t) is a vector over the rows i."""
    if G_ROW:
        gate = tl.exp(tl.where(imask, chain_at(i, h, t, seq, imask, G, G_STEPS, G_SIDES), 0.0))
    elif G_FLAT:
        gate = tl.exp(chain_at(h, t, seq, 0, tmask, G, G_STEPS, G_SIDES))
    else:
        gate = tl.exp(chain_at(0, h, t, seq, tmask, G, G_STEPS, G_SIDES))
    if B_FLAT:
        beta = chain_at(h, t, seq, 0, tmask, B, B_STEPS, B_SIDES)
    else:
        beta = chain_at(0, h, t, seq, tmask, B, B_STEPS, B_SIDES)
    return gate, beta


@triton.jit
def _lane(x, lanes, t):
    """Element t of an f32 vector (over ``lanes``), bit for bit: its bits plus zeros elsewhere (a float sum would
    turn -0.0 into +0.0)."""
    return tl.sum(tl.where(lanes == t, x.to(tl.int32, bitcast=True), 0), axis=0).to(tl.float32, bitcast=True)


@triton.jit
def _gdn_step(st, q, kk, v, gate, beta, scale, o_ptrs, snap_ptrs, smask, cmask, slot, K, G_ROW: tl.constexpr):
    """One token of the recurrence on a [BLOCK_S, BLOCK_V] state slice (rows past the head size stay zero): stores
    its scores and, into snapshot ``slot`` (slot 0 = the state after the last token; slots >= K are not written),
    the new slice; returns the slice."""
    if G_ROW:  # a decay a key row, or one a head
        st = st * gate[:, None]
    else:
        st = st * gate
    delta = (v - tl.sum(st * kk, axis=0)) * beta
    st = st + kk * delta[None, :]
    tl.store(o_ptrs, tl.sum(st * q[:, None], axis=0) * scale, mask=cmask)
    tl.store(snap_ptrs, st, mask=smask & (slot < K))
    return st


@triton.jit
def _gdn_kernel(q_ptr, k_ptr, v_ptr, G, B, s_ptr, ids_ptr, o_ptr,
                snap_ptr, snap_seq, snap_slot,  # snapshot slot j of seq s at snap + s*snap_seq + j*snap_slot (f32)
                n_t, n_s, H_v, H_k, K, scale,
                qk_s1, qk_s2, qk_s3,        # q, k [S, H_k, n_t, n_s], contiguous rows, same strides
                v_s1, v_s2, v_s3,           # v    [S, H_v, n_t, n_s], contiguous rows
                st_s1, st_s2, st_s3,        # state [S, S, H_v, n_s]: (i0=i, i1=col) = S[i][col]; GATHER: a cache of
                #                             rows [S, S, H_v], sequence seq's the row ids[seq] (gdn_state_gather)
                S: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, N_T: tl.constexpr,
                G_STEPS: tl.constexpr, G_SIDES: tl.constexpr, G_ROW: tl.constexpr,  # g [S or 1, H_v, n_t, n_s]
                G_FLAT: tl.constexpr, B_STEPS: tl.constexpr, B_SIDES: tl.constexpr,  # beta [1, H_v, n_t, n_s]
                B_FLAT: tl.constexpr, GATHER: tl.constexpr):
    # G, B: g's and beta's reads (:func:`_gdn_gates`, triton_core.chain_args)
    # BLOCK_S: the head size S rounded up to a power of two (tl.arange's), the rows past S masked: any head size
    # llama.cpp accepts runs (80, say); for a power of two the masks are all true and the code is the unmasked one
    wait_for_previous_kernels()
    cb, h, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i = tl.arange(0, BLOCK_S)                         # key index: tile rows
    imask = i < S
    col = cb * BLOCK_V + tl.arange(0, BLOCK_V)        # value index: tile columns
    cmask = col < S
    smask = imask[:, None] & cmask[None, :]
    tile = col[None, :] * st_s1 + i[:, None]          # state-layout offsets of the [BLOCK_S, BLOCK_V] slice
    st_row = tl.load(ids_ptr + seq).to(tl.int64) if GATHER else seq.to(tl.int64)
    st = tl.load(s_ptr + st_row * st_s3 + h * st_s2 + tile, mask=smask, other=0.0)  # (read before any store: a
    # gathered row may be a snapshot row, this program's slice of it its own alone)
    if GATHER:
        tl.debug_barrier()  # (every thread's loads of the slice done before any thread stores, whatever the layout)
    slot_size = snap_slot.to(tl.int64)  # (a cache's slots lie whole cache rows apart)
    snap_ptrs = snap_ptr + seq.to(tl.int64) * snap_seq + h * S * S + tile
    o_ptrs = o_ptr + (seq * n_t * H_v + h) * S + col
    strides = (qk_s1, qk_s2, qk_s3, v_s1, v_s2, v_s3)
    if N_T > 0:  # a verify's few tokens, unrolled: every token's inputs loaded before the first store (a load
        # after a store that may alias it waits for it: one memory round trip per token otherwise)
        # Computed gates (the gdn_gates pattern) are computed for all tokens at once, a token a lane: once a warp,
        # not once a token; then each token's is picked out of its lane
        AT_ONCE: tl.constexpr = (len(G_STEPS) > 0 or len(B_STEPS) > 0) and not G_ROW
        if AT_ONCE:
            lanes = tl.arange(0, MAX_UNROLLED_T)
            gate_v, beta_v = _gdn_gates(lanes, lanes < N_T, seq, h, i, imask, G, B, G_STEPS, G_SIDES, G_ROW,
                                        G_FLAT, B_STEPS, B_SIDES, B_FLAT)
        qs, ks, vs, gates, betas = (), (), (), (), ()
        for t in tl.static_range(N_T):
            q, kk, v = _gdn_inputs(q_ptr, k_ptr, v_ptr, t, seq, h, H_k, i, imask, col, cmask, strides)
            if AT_ONCE:
                gate, beta = _lane(gate_v, lanes, t), _lane(beta_v, lanes, t)
            else:
                gate, beta = _gdn_gates(t, t < n_t, seq, h, i, imask, G, B, G_STEPS, G_SIDES, G_ROW, G_FLAT,
                                        B_STEPS, B_SIDES, B_FLAT)
            qs, ks, vs, gates, betas = qs + (q,), ks + (kk,), vs + (v,), gates + (gate,), betas + (beta,)
        for t in tl.static_range(N_T):
            slot = N_T - 1 - t
            st = _gdn_step(st, qs[t], ks[t], vs[t], gates[t], betas[t], scale, o_ptrs + t * H_v * S,
                           snap_ptrs + slot * slot_size, smask, cmask, slot, K, G_ROW)
    else:  # a prompt's many tokens
        for t in range(n_t):
            q, kk, v = _gdn_inputs(q_ptr, k_ptr, v_ptr, t, seq, h, H_k, i, imask, col, cmask, strides)
            gate, beta = _gdn_gates(t, t < n_t, seq, h, i, imask, G, B, G_STEPS, G_SIDES, G_ROW, G_FLAT,
                                    B_STEPS, B_SIDES, B_FLAT)  # (a mask of None does not compile in a loop)
            slot = n_t - 1 - t
            st = _gdn_step(st, q, kk, v, gate, beta, scale, o_ptrs + t * H_v * S, snap_ptrs + slot * slot_size,
                           smask, cmask, slot, K, G_ROW)


def gated_delta_net(q, k, v, g, beta, state, K: int, out: torch.Tensor, block_v: int = GDN_BLOCK_V,
                    num_warps: int = GDN_WARPS, unrolled: bool = True, snapshots: torch.Tensor | None = None,
                    g_steps: tuple[str, ...] = (), g_sides: tuple = (), beta_steps: tuple[str, ...] = (),
                    beta_sides: tuple = (), state_ids: torch.Tensor | None = None) -> None:
    """GATED_DELTA_NET into ``out`` (contiguous, ne [S*H_v, n_t*n_s + K*S*n_s]); see the reference for semantics.
    One program per (value-column block, v-head, seq) keeps its [S, block_v] state slice in registers; any head
    size S runs (a tile of the next power of two, the rows past S masked; llama.cpp accepts 80, say). Up to
    MAX_UNROLLED_T tokens the token loop is unrolled (one compile per n_t; ``unrolled=False`` keeps the loop): the
    same steps in the same order either way, so the bytes do not depend on it.

    ``snapshots``: the state snapshots go there instead of ``out``'s slots (GATED_DELTA_NET_CACHE: straight into the
    recurrent cache's rows), ne [S*S*H_v, n_s, min(n_t, K)], rows contiguous, any seq and slot strides; ``out``
    then gets the scores alone. The same kernel either way: the states' bytes do not depend on where they go.

    ``g_steps`` (``beta_steps``): ``g`` (``beta``) is not the operand but the input of the elementwise node or chain
    that made it, any shape of as many elements (the operand a packed reshape of that node's output), with its
    steps and other operands ``g_sides`` (``beta_sides``) as ELEMENTWISE_CHAIN takes them (GATED_DELTA_NET_CACHE of
    the gdn_gates pattern): the kernel computes the operand's elements as that node's kernel does, where it reads
    them (:func:`~gdnpass.kernels.triton_core.chain_at`), and launches no elementwise kernel.

    ``state_ids`` (i32, one a sequence): ``state`` is a cache of rows ([n_rows, H_v, S, S], rows contiguous) and
    sequence s starts from its row ``state_ids[s]`` (the GET_ROWS before the op, done by the kernel: the
    gdn_state_gather pattern). With one sequence that row may be one the snapshots overwrite, where the snapshot rows
    lie exactly on the cache's rows (``limits.snapshots_on_whole_rows``): each program reads its slice of it before
    it writes any, and no other program touches that slice. Otherwise, or with several sequences (a sequence's row
    may be another's snapshot row, another program's), an overlap of the snapshots with the rows is refused."""
    n_s, n_t, H_v, S = v.shape
    heads = H_v * n_t * n_s
    _require(out.is_contiguous(), "the GDN output must be contiguous")
    qs, ks, vs, ss = (_strides(t) for t in (q, k, v, state))
    _require(qs == ks and qs[0] == vs[0] == 1 and ss[0] == 1, "q, k share strides; q, k, v, state rows contiguous")
    row = int(g.numel() == S * heads and S > 1)
    g_flat = gate_input_flat(g.shape[::-1], (S if row else 1, H_v, n_t, n_s))
    b_flat = gate_input_flat(beta.shape[::-1], (1, H_v, n_t, n_s))
    _require(g_flat is not None and b_flat is not None and (not g_flat or g_steps) and (not b_flat or beta_steps),
             f"GDN gates: g ne {list(g.shape[::-1])} and beta ne {list(beta.shape[::-1])} must be [S or 1, {H_v}, "
             f"{n_t}, {n_s}] and [1, {H_v}, {n_t}, {n_s}] (an elementwise node's input: also [{H_v}, {n_t}, {n_s}])")
    g_reads, b_reads = chain_sides(list(g_steps)), chain_sides(list(beta_steps))  # (each step's side operand)
    _require(len(g_sides) == max(g_reads, default=0) and len(beta_sides) == max(b_reads, default=0),
             "GDN gates: one side operand per binary step")
    reads = (q, k, v, g, beta, state, *g_sides, *beta_sides, *(() if state_ids is None else (state_ids,)))
    _alias_ok("GATED_DELTA_NET", out, *reads, same_ok=False)  # (another program reads them all)
    if state_ids is not None:
        _require(state_ids.dtype == torch.int32 and state_ids.numel() == n_s and state.shape[1:] == (H_v, S, S),
                 f"GDN state gather: {n_s} i32 row ids into rows of [{S}, {S}, {H_v}], got {state_ids.numel()} "
                 f"{state_ids.dtype} ids into {list(state.shape[::-1])}")
        check_row_ids(state_ids, state.shape[0], "GATED_DELTA_NET's state gather")
    block_v = min(block_v, triton.next_power_of_2(S))
    D = S * S * H_v
    if snapshots is None:  # the op's own layout: K slots after the scores, each [D, n_s] packed
        snap, snap_seq, snap_slot = out.view(-1)[S * H_v * n_t * n_s:], D, D * n_s
    else:
        sn = _strides(snapshots)
        _require(tuple(snapshots.shape) == (1, min(n_t, K), n_s, D) and sn[0] == 1,
                 f"GDN snapshots into ne [{D}, {n_s}, {min(n_t, K)}] with contiguous rows, got "
                 f"{list(snapshots.shape[::-1])}")
        over_state = state_ids is not None and n_s == 1 and snapshots_on_whole_rows(
            [snapshots.data_ptr() + 4 * j * sn[2] for j in range(snapshots.shape[1])], 4 * D,
            (state.data_ptr(), state.data_ptr() + 4 * state.stride(0) * state.shape[0]), 4 * state.stride(0))
        _alias_ok("GATED_DELTA_NET", snapshots, *(r for r in reads if not (over_state and r is state)), out,
                  same_ok=False)  # (the gathered row may be a snapshot row: whole rows, see above)
        snap, snap_seq, snap_slot = snapshots, sn[1], sn[2]
    _gdn_kernel[(triton.cdiv(S, block_v), H_v, n_s)](
        q, k, v, chain_args(g, list(g_sides)), chain_args(beta, list(beta_sides)), state,
        state if state_ids is None else state_ids, out, snap, snap_seq,
        snap_slot, n_t, n_s, H_v, q.shape[2], K, gdn_scale(S), qs[1], qs[2], qs[3], vs[1], vs[2], vs[3],
        ss[1], ss[2], ss[3], S=S, BLOCK_S=triton.next_power_of_2(S), BLOCK_V=block_v,
        N_T=n_t if unrolled and n_t <= MAX_UNROLLED_T else 0, G_STEPS=tuple(g_steps), G_SIDES=g_reads, G_ROW=row,
        G_FLAT=g_flat, B_STEPS=tuple(beta_steps), B_SIDES=b_reads, B_FLAT=b_flat, GATHER=state_ids is not None,
        **{**LAUNCH, "num_warps": num_warps})


# ---- GDN_CONV_CHAIN (fused) ----------------------------------------------------------------------------------------

CHAIN_TILE = 16384  # f32 of the CONCAT tile one chain program holds, d_conv-1+n_t columns of [sequences, channels]
                    # (64 a thread at 8 warps, chain_warps): the channel block shrinks as the sequences grow


@triton.jit
def _chain_qk_norms(y_ptr, q_ptr, k_ptr, head, H_k, n_seqs, eps, scale, head_n, y_s0, y_s1, y_s2, qk_s1, qk_s2,
                    qk_s3, S: tl.constexpr, SEQS: tl.constexpr, N_T: tl.constexpr, L2_ROWS: tl.constexpr,
                    RMS: tl.constexpr, CG: tl.constexpr):
    """q or k head ``head`` of every sequence from the SiLU output y, written after every y element of the head.
    The L2 tree sums a row within a thread; the chain spreads its rows one channel per thread. Read them back from y
    as [tokens, S] tiles instead: 16-byte vector loads, tokens to warps, the tree's first levels within a thread.
    ``CG``: y was written by other programs of this launch (read at L2, never a line this SM's L1 kept)."""
    i = tl.arange(0, S)[None, :]
    tok = tl.arange(0, L2_ROWS)[:, None]
    mask = tl.broadcast_to(tok < N_T, [L2_ROWS, S])
    src = y_ptr + (head * S + i) * y_s0 + tok * y_s1
    dst = tl.where(head < H_k, q_ptr + head * qk_s1, k_ptr + (head - H_k) * qk_s1) + tok * qk_s2 + i
    if SEQS == 1:  # (a loop, even of one turn, holds more registers: 54 -> 80 at 8 tokens, sm_90)
        _chain_qk_norm(src, dst, mask, eps, scale, head_n, RMS, CG)
    else:
        for sq in range(n_seqs):
            _chain_qk_norm(src + sq * y_s2, dst + sq * qk_s3, mask, eps, scale, head_n, RMS, CG)


@triton.jit
def _chain_qk_norm(src, dst, mask, eps, scale, head_n, RMS: tl.constexpr, CG: tl.constexpr):
    """One sequence's rows of a q or k head: y at ``src`` normalised into ``dst``."""
    if CG:
        y = tl.load(src, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        y = tl.load(src, mask=mask, other=0.0)
    if RMS:  # upstream's RMS_NORM then SCALE: the unfused kernels' expressions, in their order
        qk = rms_scale_rows(y, head_n, eps) * scale
    else:
        qk = l2_scale_rows(y, eps)
    tl.store(dst, qk, mask=mask)


@triton.jit
def _gdn_conv_chain_kernel(st_ptr, ids_ptr, x_ptr, w_ptr, y_ptr, q_ptr, k_ptr, table_ptr, cnt_ptr,
                           n_seqs, n_rows, H_k, n_l2, eps, scale, head_n,  # q/k norm: L2 (eps), or RMS (eps/S, scale)
                           st_s1,               # states [(dc-1)*C, R]: a row holds dc-1 steps a channel, channel-major
                           x_s0, x_s1, x_s2,    # x [n_t, C, n_s] (the projection, transposed)
                           w_s0, w_s1,          # w [dc, C]
                           y_s0, y_s1, y_s2,    # y [C, n_t, n_s] (the SiLU output)
                           qk_s1, qk_s2, qk_s3,  # q, k [S, H_k, n_t, n_s]: contiguous rows, same strides
                           tile_off, tile_sc, tile_sch, tile_sseq,  # the shared row (TILE_N > 0)
                           D_CONV: tl.constexpr, S: tl.constexpr, SEQS: tl.constexpr, BLOCK_C: tl.constexpr,
                           N_T: tl.constexpr, COLUMNS: tl.constexpr, TILE_C0: tl.constexpr, TILE_N: tl.constexpr,
                           WHOLE_ROWS: tl.constexpr, L2_ROWS: tl.constexpr, RMS: tl.constexpr):
    # One program per block of BLOCK_C channels (a head of S, or a part of one), for every sequence: the CONCAT rows
    # of its channels (dc-1 state columns, then N_T tokens) live in registers as a tuple of [SEQS, BLOCK_C] tiles, so
    # every tap, window and tile column is picked at compile time. Programs own channels, never sequences: the rows
    # the ids gather are runtime data (any sequence may read the row another writes), and channel ch of every cache
    # row, read or written, is this program's alone.
    wait_for_previous_kernels()
    pid = tl.program_id(0)
    PARTS: tl.constexpr = S // BLOCK_C  # programs of a head
    seq = tl.arange(0, SEQS)[:, None]
    ch = pid * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    # the sequences past n_seqs of the power-of-two tile (one sequence: none, and no sequence strides below)
    live = tl.broadcast_to(seq < n_seqs, [SEQS, BLOCK_C]) if SEQS > 1 else tl.full([SEQS, BLOCK_C], 1, tl.int1)

    # Every read first, of every sequence: the writes below may land on what was read, within this program's
    # channels (a snapshot row on a row some sequence gathers, the SiLU output on token columns of the projection).
    w = ()
    for j in tl.static_range(D_CONV):
        w = w + (tl.load(w_ptr + ch * w_s1 + j * w_s0),)
    st = st_ptr + tl.load(ids_ptr + seq, mask=seq < n_seqs, other=0).to(tl.int64) * st_s1 + ch * (D_CONV - 1)
    cat = ()
    for c in tl.static_range(D_CONV - 1):
        cat = cat + (tl.load(st + c, mask=live, other=0.0),)
    xs = x_ptr + seq * x_s2 + ch * x_s1
    for t in tl.static_range(N_T):
        cat = cat + (tl.load(xs + t * x_s0, mask=live, other=0.0),)
    # per-window destinations (table rows [offset, channel stride, step stride, sequence stride]); loaded now: a
    # load after the stores below would wait for them (it may alias them), one more round trip on the critical path
    offsets = ()
    for r in tl.static_range(len(COLUMNS)):
        offsets = offsets + (tl.load(table_ptr + r),)
    seq_offsets = ()
    if SEQS > 1:
        for r in tl.static_range(len(COLUMNS)):
            seq_offsets = seq_offsets + (seq.to(tl.int64) * tl.load(table_ptr + 3 * n_rows + r),)
    ys = ()
    for t in tl.static_range(N_T):
        win = ()
        for j in tl.static_range(D_CONV):
            win = win + (cat[t + j],)
        ys = ys + (silu_f32_unrolled(conv_dot(win, w)),)
    tl.debug_barrier()  # every thread's reads happen before any thread's writes

    y = y_ptr + seq * y_s2 + ch * y_s0
    for t in tl.static_range(N_T):
        tl.store(y + t * y_s1, ys[t], mask=live)
    for r in tl.static_range(len(COLUMNS)):  # window r = CONCAT columns COLUMNS[r] .. +dc-2
        row = st_ptr + offsets[r]
        if SEQS > 1:
            row = row + seq_offsets[r]
        if WHOLE_ROWS:  # llama.cpp's cache rows: [C, dc-1] contiguous
            dst, s_step = row + ch * (D_CONV - 1), 1
        else:
            dst = row + ch * tl.load(table_ptr + n_rows + r)
            s_step = tl.load(table_ptr + 2 * n_rows + r)
        for s in tl.static_range(D_CONV - 1):
            tl.store(dst + s * s_step, cat[COLUMNS[r] + s], mask=live)
    # the shared row of overlapping windows (matcher rule 5b): columns TILE_C0 .. +TILE_N-1, each stored once
    shared = st_ptr + tile_off + ch * tile_sch
    if SEQS > 1:
        shared = shared + seq.to(tl.int64) * tile_sseq
    for c in tl.static_range(TILE_N):
        tl.store(shared + (TILE_C0 + c) * tile_sc, cat[TILE_C0 + c], mask=live)

    head = pid // PARTS
    if head < n_l2:  # a q or a k head
        if PARTS == 1:  # this program wrote the whole head: its writes are visible to it after a barrier
            tl.debug_barrier()
            _chain_qk_norms(y_ptr, q_ptr, k_ptr, head, H_k, n_seqs, eps, scale, head_n, y_s0, y_s1, y_s2, qk_s1,
                            qk_s2, qk_s3, S, SEQS, N_T, L2_ROWS, RMS, False)
        elif last_to_arrive(cnt_ptr, head, PARTS):  # the head's last program to finish its part normalises it
            _chain_qk_norms(y_ptr, q_ptr, k_ptr, head, H_k, n_seqs, eps, scale, head_n, y_s0, y_s1, y_s2, qk_s1,
                            qk_s2, qk_s3, S, SEQS, N_T, L2_ROWS, RMS, True)
            tl.store(cnt_ptr + head, 0)  # zero for the next launch (and the next CUDA-graph replay)


def _offset(states: torch.Tensor, v: torch.Tensor) -> int:
    """Element offset of view ``v`` from ``states`` (both views of the cache buffer)."""
    _require(v.untyped_storage().data_ptr() == states.untyped_storage().data_ptr(),
             "destinations must be cache views")
    return v.storage_offset() - states.storage_offset()


_chain_tables: dict[tuple, torch.Tensor] = {}


def _chain_table(states: torch.Tensor, wins: list[torch.Tensor]) -> torch.Tensor:
    """int32 [offsets from ``states``, channel strides, step strides, sequence strides] of the per-window
    destinations (views [n_s, C, dc-1]), on the device, built once per distinct table: a later run (or its
    CUDA-graph capture) then does no host->device copy."""
    vals = ([_offset(states, v) for v in wins] + [v.stride(1) for v in wins] + [v.stride(2) for v in wins]
            + [v.stride(0) for v in wins]) or [0]
    _require(all(-2**31 <= v < 2**31 for v in vals), "cache offsets must fit in int32")
    key = (states.device, *vals)
    table = _chain_tables.get(key)
    if table is None:
        table = _chain_tables[key] = torch.tensor(vals, dtype=torch.int32, device=states.device)
    return table


def _tile_args(states, wins, columns, tile, d_conv) -> tuple[tuple, int, int]:
    """The kernel's shared-row arguments (offset of CONCAT column 0 from ``states``, step stride, channel stride,
    sequence stride), its first column and its column count; zeros without a tile."""
    if not tile:
        return (0, 0, 0, 0), 0, 0
    idx = tile["windows"]
    s_seq, s_ch, s_col = wins[idx[0]].stride()
    off = _offset(states, wins[idx[0]]) - columns[idx[0]] * s_col
    first, n = tile["first"], tile["n_cols"]
    one = wins[idx[0]].shape[0] == 1  # (one sequence: its stride is never used)
    # rule 5b, re-checked on the real views: every window is columns column .. +dc-2 of the one shared row
    _require(all(wins[j].stride()[one:] == (s_seq, s_ch, s_col)[one:]
                 and _offset(states, wins[j]) == off + columns[j] * s_col
                 and first <= columns[j] <= first + n - (d_conv - 1) for j in idx), "windows are not one shared row")
    return (off, s_col, s_ch, s_seq), first, n


def chain_warps(S: int, tile: int = 1) -> int:
    """Warps of the fused chain for heads of S channels and a CONCAT column tile of ``tile`` elements ([sequences,
    channels]): one thread per channel of a head (H200: 4 warps for S = 128 beat 2 and 8, and beat spreading a long
    verify's tokens over more warps, docs/performance.md), up to 8 as a tile of several sequences grows past 256
    elements (sm_90, no spills: 128 sequences of 8 tokens 238 -> 128 registers a thread, of 16 tokens 254 -> 176;
    not yet timed)."""
    return min(max(S // 32, tile // 64, 1), 8)


def chain_block(n_seqs: int, S: int, d_conv: int, n_t: int) -> int:
    """Channels a chain program owns, for every one of ``n_seqs`` sequences: a whole head of S while the CONCAT tile
    ([next power of two of n_seqs, block] x (d_conv-1+n_t) columns) fits CHAIN_TILE, else the largest power of two
    whose tile does (S / block programs then share a head; the last to finish normalises its q/k). qwen3.5's
    S = 128, d_conv 4: one sequence up to 16 tokens, 8 up to 13 tokens keep a head a program; 128 sequences of 8
    tokens run blocks of 8 channels (11 x 128 x 8 = 11264 f32)."""
    tile = triton.next_power_of_2(n_seqs) * (d_conv - 1 + n_t)
    block = S
    while block > 1 and tile * block > CHAIN_TILE:
        block //= 2
    return block


def chain_launch(n_t: int, S: int, num_warps: int | None = None, n_seqs: int = 1,
                 d_conv: int = 4) -> tuple[dict, int]:
    """The fused chain's launch shape for n_seqs sequences of n_t tokens and heads of S channels: (its SEQS,
    BLOCK_C and L2_ROWS constexprs, num_warps); ``num_warps`` overrides chain_warps (a benchmark's variants)."""
    seqs, block = triton.next_power_of_2(n_seqs), chain_block(n_seqs, S, d_conv, n_t)
    num_warps = num_warps or chain_warps(S, seqs * block)
    # L2_ROWS: at least a row per warp
    return dict(SEQS=seqs, BLOCK_C=block, L2_ROWS=max(triton.next_power_of_2(n_t), num_warps)), num_warps


def gdn_conv_chain(states, ids, x, w, rows, columns, eps: float, out, q_out, k_out, l2_separate: bool = False,
                   tile: dict | None = None, num_warps: int | None = None, norm: str = "l2",
                   qk_scale: float = 1.0) -> None:
    """GDN_CONV_CHAIN of n_s sequences (semantics: :func:`reference.gdn_conv_chain_ref`) in one launch (three, or
    five in the RMS form, with ``l2_separate``). ``norm``: the q/k normalisation, "l2" (L2_NORM(eps)) or "rms"
    (RMS_NORM(eps) then SCALE(qk_scale), upstream's form), computed by the same helpers as the unfused kernels.

    states torch (1,1,R,(dc-1)*C), ids int32 (1,1,1,n_s) (each sequence's gathered row), x (1,n_s,C,n_t) any
    strides, w (1,1,C,dc); rows: the destinations, views into the storage of ``states`` of n_s*C*(dc-1) elements
    that view as [n_s, C, dc-1] (sequence, channel, step): whole cache rows (1,1,n_s,(dc-1)*C), a sequence's row
    any whole number of rows after the previous, or windows (1,n_s,C,dc-1) of any strides; row r gets window
    columns columns[r] .. columns[r]+dc-2. ``tile`` (the node's op_params["tile"], matcher rule 5b): the rows
    tile["windows"] are windows of one shared row, written once column by column (tile["first"] ..
    +tile["n_cols"]-1); the other rows (or all, without it) are written window by window.
    Writes out (1,n_s,n_t,C), q_out and k_out (n_s,n_t,H_k,S).

    The token count, the window columns and the tile's columns are compile-time constants (they are static
    properties of the graph node): one compile per (n_t, columns) of a model, e.g. 16 for llama.cpp's verify step
    at 1..16 tokens, and per power of two of n_s. In exchange every register index is static (H200, T=8: 3.6 ->
    2.3 us, docs/performance.md).

    Programs own channels (:func:`chain_block` of them), each for every sequence, and read
    all their inputs before they write, so within their channels anything may alias, whatever the ids: a row one
    sequence writes the row another gathers, ``out`` the projection (same layout, shifted by whole tokens, of any
    sequence). Across programs nothing may: q_out and k_out must not overlap the projection unless ``l2_separate``,
    where a second launch (the L2_NORM kernel) computes them from ``out`` once the first has read the projection.
    When a head spans several programs, the last of them to finish (a ticket of the split workspace) normalises it.
    """
    n_s, C, n_t, d_conv = x.shape[1], x.shape[2], x.shape[3], w.shape[3]
    H_k, S = q_out.shape[2], q_out.shape[3]
    _require(norm in ("l2", "rms"), f"q/k norm {norm!r} is not l2 or rms")
    heads = CHAIN.heads(S, H_k, C)
    _require(heads is None, f"{heads}")
    _require(1 <= n_t <= CHAIN.max_tokens, f"1..{CHAIN.max_tokens} tokens")
    _require(1 <= n_s <= CHAIN.max_seqs, f"1..{CHAIN.max_seqs} sequences")
    _require(ids.numel() == n_s and ids.dtype == torch.int32 and ids.is_contiguous(),
             f"ids: {n_s} contiguous i32 row ids, one per sequence")
    _require(1 <= len(rows) == len(columns) <= CHAIN.max_rows, f"1..{CHAIN.max_rows} snapshot rows")
    _require(all(0 <= c <= n_t for c in columns), "window columns lie in 0..n_t")
    _require(states.stride(3) == 1, "cache rows must be contiguous")
    check_row_ids(ids, states.shape[2], "GDN_CONV_CHAIN")
    wins = [row.view(n_s, C, d_conv - 1) for row in rows]
    qs, xs, ws, ys = _strides(q_out), _strides(x), _strides(w), _strides(out)
    _require(qs == _strides(k_out) and qs[0] == 1 and ys[0] == 1,
             "q and k share strides; q, k, out rows contiguous")
    tile_args, first, n_cols = _tile_args(states, wins, columns, tile, d_conv)
    per = [j for j in range(len(rows)) if not tile or j not in tile["windows"]]
    shape, num_warps = chain_launch(n_t, S, num_warps, n_s, d_conv)
    block, n_l2 = shape["BLOCK_C"], 0 if l2_separate else 2 * H_k
    tickets = split_workspace(states.device, 0, n_l2, "GDN_CONV_CHAIN")[1] if block < S and n_l2 else None
    _gdn_conv_chain_kernel[(C // block,)](
        states, ids, x, w, out, q_out, k_out, _chain_table(states, [wins[j] for j in per]), tickets,
        n_s, len(per), H_k, n_l2, f32(eps), f32(qk_scale), S, states.stride(2),
        xs[0], xs[1], xs[2], ws[0], ws[1], ys[0], ys[1], ys[2], qs[1], qs[2], qs[3], *tile_args,
        D_CONV=d_conv, S=S, N_T=n_t, COLUMNS=tuple(columns[j] for j in per), TILE_C0=first, TILE_N=n_cols,
        WHOLE_ROWS=all(wins[j].stride()[1:] == (d_conv - 1, 1) for j in per), RMS=norm == "rms", **shape,
        **{**LAUNCH, "num_warps": num_warps})
    if l2_separate:
        heads = out[0].unflatten(-1, (-1, S))  # the q/k head views L2_NORM reads: (n_s, n_t, C/S, S)
        for part, dst in ((heads[:, :, :H_k], q_out), (heads[:, :, H_k:2 * H_k], k_out)):
            if norm == "rms":
                rms_norm(part, eps, dst)
                scale(dst, qk_scale, 0.0, dst)
            else:
                l2_norm(part, eps, dst)


# ---- launch sizes (for cost estimates) ------------------------------------------------------------------------------


def programs(node) -> list[tuple[str, int, int]]:
    """:func:`gdnpass.kernels.backends.programs` for SSM_CONV and GATED_DELTA_NET (steps: tokens); empty for other
    ops (the fused GDN_CONV_CHAIN's are its record's: gdnpass.patterns.conv_chain). Pure: reads shapes only."""
    from gdnpass.ir import Op

    op, ne = node.op, node.ne
    if op is Op.SSM_CONV:
        C, n_t, n_s = ne[0], ne[1], ne[2]
        return [(f"ssm_conv{node.src[1].ne[0]}", n_s * triton.cdiv(C, CONV_BLOCK_C), n_t)]
    if op is Op.GATED_DELTA_NET:
        return gdn_programs(node.src[2])
    return []


def gdn_programs(v) -> list[tuple[str, int, int]]:
    """The GATED_DELTA_NET kernel's programs for values ``v`` (a graph tensor, ne [S, H_v, n_t, n_s]), wherever
    its snapshots go (GATED_DELTA_NET_CACHE's too)."""
    S, H_v, n_t, n_s = v.ne
    return [("gdn", triton.cdiv(S, min(GDN_BLOCK_V, triton.next_power_of_2(S))) * H_v * n_s, n_t)]
