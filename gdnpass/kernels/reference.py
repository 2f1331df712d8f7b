"""Torch reference of every op: the semantic spec.

Convention: a ggml tensor with ``ne = (ne0, ne1, ne2, ne3)`` is a 4-D torch tensor of shape ``(ne3, ne2, ne1, ne0)``,
so ggml dim ``d`` is torch dim ``3 - d`` and a row (along ne0) is the last torch dim. Arithmetic is float32 (f16/bf16
weights are upcast first). Every function is pure: it returns a new tensor and never writes its inputs.
"""

from __future__ import annotations

import numpy as np
import torch

F32 = torch.float32


def f32(x: float) -> float:
    """A Python float rounded to float32, as ggml stores op params (eps, scale)."""
    return float(np.float32(x))


def gdn_scale(S: int) -> float:
    """ggml's ``1.0f / sqrtf((float) S_v)``, rounded in float32 like the C code."""
    return float(np.float32(1.0) / np.sqrt(np.float32(S)))


# ---- data movement (exact) ------------------------------------------------------------------------------------------


def get_rows(a: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """GET_ROWS: ids I32 ne [n, e1, e2]; ``out[:, i, j, k] = a[:, ids[i, j, k], j, k]`` (f32 unless a is I32)."""
    e2, e1 = ids.shape[1], ids.shape[2]
    k = torch.arange(e2, device=a.device).view(-1, 1, 1)
    j = torch.arange(e1, device=a.device).view(1, -1, 1)
    rows = a[k, j, ids[0].long()]  # advanced indexing copies: (e2, e1, n, ne0)
    return rows if a.dtype == torch.int32 else rows.to(F32)


def concat(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """CONCAT along ggml dim ``dim``: b follows a; the other dims are equal."""
    return torch.cat([a, b], dim=3 - dim)


def cpy(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """CPY / CONT: elements map by flat row-major index, so this is ``src`` reshaped to ``dst``'s shape (and cast to
    its type, round-to-nearest). The caller writes the result through dst's strides."""
    return src.reshape(dst.shape).to(dst.dtype, copy=True)


# ---- elementwise ----------------------------------------------------------------------------------------------------


def _tile(b: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """ggml broadcasts b by tiling (index i % b.ne[i]); plain torch broadcasting only stretches size-1 dims."""
    return b.repeat(*(n // m for n, m in zip(like.shape, b.shape)))


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ADD: a + b, b tiled to a's shape."""
    return a + _tile(b, a)


def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """MUL: a * b, b tiled to a's shape."""
    return a * _tile(b, a)


def scale(x: torch.Tensor, s: float, b: float = 0.0) -> torch.Tensor:
    """SCALE with op params (s, b), both f32.

    b == 0 (ggml_scale, the only form the builder makes): ``x * s``, one f32 multiply, as ggml's CPU op
    (``ggml_vec_scale_f32``; -0.0 stays -0.0, 0 * NaN stays NaN). (ggml-cuda's ``scale_f32`` computes
    ``scale * x[i] + bias`` for every b, which nvcc contracts to fma(s, x, 0): the same value except that a -0.0
    product comes out +0.0.)
    b != 0 (ggml_scale_bias): ``x * s + b`` rounded once, a fused multiply-add, as both backends round it: the CPU's
    ``ggml_vec_mad1_f32`` is GGML_F32_VEC_FMA on FMA builds (measured on ggml-python 0.15.3: bit-identical to the
    fma, 339 of 2368 elements off by an ulp from mul-then-add) and ggml-cuda's expression is contracted to an FMA.
    Computed as (x*s exact in f64) + b in f64, then rounded to f32: the fma but for double rounding, which can
    only move a result lying within 2^-53 relative of an f32 rounding midpoint.
    """
    if not b:
        return x * s
    return (x.to(torch.float64) * f32(s) + f32(b)).to(F32)


def silu(x: torch.Tensor) -> torch.Tensor:
    """UNARY SILU, ggml-cuda's form x / (1 + exp(-x))."""
    return x / (1.0 + torch.exp(-x))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """ggml: x if x > 20 else log(1 + exp(x))."""
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))


def exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x)


UNARY = {"SILU": silu, "SIGMOID": sigmoid, "SOFTPLUS": softplus, "EXP": exp}


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GLU SWIGLU (ggml_swiglu_split): silu(gate) * up, in the same two f32 roundings as SILU then MUL."""
    return silu(gate) * up


GLU = {"SWIGLU": swiglu}


def glu(kind: str, a: torch.Tensor, b: torch.Tensor | None, swapped: bool) -> torch.Tensor:
    """GLU of one source (its rows split in halves: gate first, unless swapped) or of two (gate, up)."""
    if b is None:
        n = a.shape[-1] // 2
        a, b = a[..., :n], a[..., n:]
    if swapped:
        a, b = b, a
    return GLU[kind](a, b)


# ---- row reductions -------------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, eps: float, acc: torch.dtype = F32) -> torch.Tensor:
    """RMS_NORM per row along ne0, ggml-cuda's form (``rms_norm_f32``, ggml-cuda/norm.cu): Σx² of f32 squares
    summed in f32, ``mean = Σ / ncols`` (f32 division), ``scale = rsqrtf(mean + eps)`` (eps f32), ``y = scale * x``.
    Only the order of the f32 sum is torch's (CUDA: lane-strided partial sums and an xor butterfly; the Triton
    kernel: the fixed pairwise tree of ``sum_sq_rows``).

    ggml's CPU op (ggml-cpu/ops.cpp ``ggml_compute_forward_rms_norm_f32``) rounds at the same points but
    accumulates the f32 squares in double: ``mean = (float)(sum / ne00)``, ``scale = 1.0f/sqrtf(mean + eps)``,
    ``y = x * scale`` (``ggml_vec_scale_f32``). ``acc=torch.float64`` gives that form (bit-identical to ggml's
    CPU on the CPU, where torch.rsqrt is 1/sqrt, both correctly rounded; tests/test_ggml_interop.py)."""
    ss = (x * x).to(acc).sum(-1, keepdim=True)
    mean = (ss / x.shape[-1]).to(F32)
    return x * torch.rsqrt(mean + f32(eps))


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """L2_NORM per row along ne0, ggml-cuda's form: x * rsqrt(max(Σx², eps²)) (eps² in f32)."""
    e = f32(eps)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True).clamp_min(f32(e * e)))


def mul_mat(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """MUL_MAT: w ne [K, M, W2, W3], x ne [K, N, B2, B3] -> ne [M, N, B2, B3], out = x @ wᵀ in f32.
    Batch broadcast as ggml: x batch i2 uses weight batch i2 // (B2 // W2) (likewise dim 3)."""
    w = w.to(F32).repeat_interleave(x.shape[1] // w.shape[1], 1).repeat_interleave(x.shape[0] // w.shape[0], 0)
    return x.to(F32) @ w.transpose(-1, -2)


# ---- recurrent ops --------------------------------------------------------------------------------------------------


def ssm_conv(sx: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """SSM_CONV: sx ne [dc-1+n_t, C, n_s], c ne [dc, C] -> y ne [C, n_t, n_s] with
    y[ch, t, s] = Σ_{j=0..dc-1} sx[t+j, ch, s]·c[j, ch], taps summed in order from 0.0 (mul, then add)."""
    dc = c.shape[-1]
    n_t = sx.shape[-1] - dc + 1
    acc = torch.zeros_like(sx[..., :n_t], dtype=F32)
    for j in range(dc):
        acc = acc + sx[..., j:j + n_t] * c[0, 0, :, j, None]
    return acc.transpose(-1, -2)  # (1, n_s, C, n_t) -> (1, n_s, n_t, C)


def gdn_conv_chain_ref(states, ids, x, w, rows, columns, eps: float, head_dim: int, n_k_heads: int,
                       norm: str = "l2", qk_scale: float = 1.0):
    """GDN_CONV_CHAIN of one sequence, composed of the unfused ops on the unfused graph's shapes and layouts (so
    its bytes are theirs): GET_ROWS of the conv state, CONCAT with the transposed projection, one CPY per snapshot
    row, SSM_CONV, SILU, and the normalisation of the q and k heads: L2_NORM(eps) (``norm="l2"``), or upstream's
    RMS_NORM(eps) then SCALE(qk_scale) (``norm="rms"``).

    states (1,1,R,(dc-1)*C), ids int32 (1,1,1,1), x (1,1,C,n_t), w (1,1,C,dc); rows: the destinations (a cache row
    (1,1,1,(dc-1)*C) or a window (1,1,C,dc-1)), of which only the shape is used; row r gets window columns
    columns[r] .. columns[r]+dc-2.
    Returns (snapshot row values, SiLU output (1,1,n_t,C), q, k (1,n_t,H_k,S)).
    """
    C, dc = w.shape[2], w.shape[3]
    conv_input = concat(get_rows(states, ids).reshape(1, 1, C, dc - 1), x, 0)
    snapshots = [cpy(conv_input[..., c:c + dc - 1], row) for c, row in zip(columns, rows)]
    y = silu(ssm_conv(conv_input, w).contiguous())  # contiguous: the SSM_CONV node's output as SILU reads it
    heads = y[0, 0].unflatten(-1, (-1, head_dim))[None]  # the head views (1, n_t, C/S, S) the graph takes of it
    qk = [heads[:, :, :n_k_heads], heads[:, :, n_k_heads:2 * n_k_heads]]
    if norm == "rms":
        q, k = (scale(rms_norm(h, eps), qk_scale) for h in qk)
    else:
        q, k = (l2_norm(h, eps) for h in qk)
    return snapshots, y, q, k


def gated_delta_net(q, k, v, g, beta, state, K: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """GATED_DELTA_NET. q, k ne [S, H_k, n_t, n_s]; v ne [S, H_v, n_t, n_s]; g ne [1 or S, H_v, n_t, n_s];
    beta ne [1, H_v, n_t, n_s]; state ne [S, S, H_v, n_s] holding S[i][col] at (i0=i, i1=col), i the key index
    and col the value index. v-head h reads k-head h % H_k. Per token:

        S = exp(g)·S                                (g ne0 == S: row i gated by exp(g[i]), as ggml's KDA mode)
        δ[col] = (v[col] - Σ_i S[i][col]·k[i])·β
        S[i][col] += k[i]·δ[col]
        o[col] = (Σ_i S[i][col]·q[i])·(1/sqrt(S))

    Returns ne [S*H_v, n_t*n_s + K*S*n_s]: the scores laid out [S, H_v, n_t, n_s], then K snapshot slots laid out
    like the state. The state after token t goes to slot n_t-1-t when that slot < K (slot 0: the final state).
    Slots >= n_t are not written: they keep what ``out`` held (zeros when ``out`` is None), as the real op leaves
    the destination's old bytes there.
    """
    n_s, n_t, H_v, S = v.shape
    hk = torch.arange(H_v, device=v.device) % q.shape[2]
    qh, kh = q[:, :, hk, None, :], k[:, :, hk, None, :]  # (n_s, n_t, H_v, 1, S): broadcast over col
    M = state.to(F32).clone()  # (n_s, H_v, col, i)
    shape = (1, 1, n_t * n_s + K * S * n_s, S * H_v)
    res = torch.zeros(shape, device=v.device) if out is None else out.clone(memory_format=torch.contiguous_format)
    flat = res.view(-1)
    n_scores = v.numel()
    scores = torch.empty_like(v, dtype=F32)
    for t in range(n_t):
        M = M * torch.exp(g[:, t, :, None, :])
        delta = (v[:, t] - (M * kh[:, t]).sum(-1)) * beta[:, t]
        M = M + delta[..., None] * kh[:, t]
        scores[:, t] = (M * qh[:, t]).sum(-1) * gdn_scale(S)
        slot = n_t - 1 - t
        if slot < K:
            flat[n_scores + slot * M.numel():][:M.numel()] = M.reshape(-1)
    flat[:n_scores] = scores.reshape(-1)
    return res
