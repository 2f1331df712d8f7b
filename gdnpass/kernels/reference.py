"""Torch reference of every op: the semantic spec.

Convention: a ggml tensor with ``ne = (ne0, ne1, ne2, ne3)`` is a 4-D torch tensor of shape ``(ne3, ne2, ne1, ne0)``,
so ggml dim ``d`` is torch dim ``3 - d`` and a row (along ne0) is the last torch dim. Arithmetic is float32 (f16/bf16
weights are upcast first). Every function is pure: it returns a new tensor and never writes its inputs.
"""

from __future__ import annotations

import numpy as np
import torch

from gdnpass.errors import KernelError
from gdnpass.kernels.limits import check_row_ids

F32 = torch.float32


def f32(x: float) -> float:
    """A Python float rounded to float32, as ggml stores op params (eps, scale)."""
    return float(np.float32(x))


def gdn_scale(S: int) -> float:
    """ggml's ``1.0f / sqrtf((float) S_v)``, rounded in float32 like the C code."""
    return float(np.float32(1.0) / np.sqrt(np.float32(S)))


# ---- data movement (exact) ------------------------------------------------------------------------------------------


def get_rows(a: torch.Tensor, ids: torch.Tensor, dtype=None) -> torch.Tensor:
    """GET_ROWS: ids I32 ne [n, e1, e2]; ``out[:, i, j, k] = a[:, ids[i, j, k], j, k]`` (f32 unless a is I32). A
    quantized ``dtype`` (a :class:`gdnpass.ir.DType`): ``a`` holds the rows' bytes (as gdnpass holds them:
    :func:`gdnpass.kernels.quants.held_rows`), and the rows taken are ggml's dequantization of them
    (:func:`gdnpass.kernels.quants.dequantize`)."""
    check_row_ids(ids, a.shape[2])  # (ggml asserts it; torch's indexing would raise IndexError, or wrap -1)
    e2, e1 = ids.shape[1], ids.shape[2]
    k = torch.arange(e2, device=a.device).view(-1, 1, 1)
    j = torch.arange(e1, device=a.device).view(1, -1, 1)
    rows = a[k, j, ids[0].long()]  # advanced indexing copies: (e2, e1, n, ne0)
    if dtype is not None and dtype.is_quantized:
        from gdnpass.kernels.quants import dequantize, file_rows

        return dequantize(file_rows(rows, dtype), dtype)
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
    """GLU of one source (its rows split in halves: gate first, unless swapped; an odd row's last element is read
    by neither, as ggml-cpu's nc = ne0 / 2 halves) or of two (gate, up)."""
    if b is None:
        n = a.shape[-1] // 2
        a, b = a[..., :n], a[..., n:2 * n]
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
    CPU on the CPU, where torch.rsqrt is 1/sqrt, both correctly rounded; tests/frontends/ggml/test_referee.py)."""
    ss = (x * x).to(acc).sum(-1, keepdim=True)
    mean = (ss / x.shape[-1]).to(F32)
    return x * torch.rsqrt(mean + f32(eps))


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """L2_NORM per row along ne0, ggml-cuda's form: x * rsqrt(max(Σx², eps²)) (eps² in f32)."""
    e = f32(eps)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True).clamp_min(f32(e * e)))


def mul_mat(w: torch.Tensor, x: torch.Tensor, dtype=None) -> torch.Tensor:
    """MUL_MAT: w ne [K, M, W2, W3], x ne [K, N, B2, B3] -> ne [M, N, B2, B3], out = x @ wᵀ in f32.
    Batch broadcast as ggml: x batch i2 uses weight batch i2 // (B2 // W2) (likewise dim 3). A quantized ``dtype``
    (w: the bytes of one matrix, as gdnpass holds them: :func:`gdnpass.kernels.quants.held_rows`): the activations
    quantized to int8 as llama.cpp does, in the kernels' scheme (:func:`gdnpass.kernels.quants.mul_mat_q`: ggml-cpu's
    q8_K blocks for the K-quants, CUDA's q8_1 for Q8_0)."""
    if dtype is not None and dtype.is_quantized:
        from gdnpass.kernels.quants import file_rows, mul_mat_q

        return mul_mat_q(file_rows(w, dtype), x, dtype)
    w, r1, r0 = w.to(F32), x.shape[1] // w.shape[1], x.shape[0] // w.shape[0]
    # (repeat_interleave copies even by 1: a whole f32 weight more, 4 GB for the 9B's lm head; contiguous() gives a
    # single weight the layout the copy gave it, so the product's bytes are the same)
    w = w.repeat_interleave(r1, 1).repeat_interleave(r0, 0) if r1 > 1 or r0 > 1 else w.contiguous()
    return x.to(F32) @ w.transpose(-1, -2)


# ---- the expert FFN's ops (issue 36), as the pinned ggml-cpu computes them (ggml-cpu/ops.cpp, vec.h) -------------


def argsort(x: torch.Tensor, order: int) -> torch.Tensor:
    """ARGSORT per row (ne0): i32 indices ordering the row ascending (order 0) or descending (1). ggml-cpu runs
    std::sort on the indices with ``x[a] < x[b]`` / ``x[a] > x[b]``, which leaves the order of equal values (and any
    NaN's place) unspecified; here ties keep index order (a stable sort). llama.cpp's router rows have no ties in
    practice (gdnpass's tiny files are written so: docs/moe.md)."""
    return torch.sort(x, dim=-1, descending=order == 1, stable=True).indices.to(torch.int32)


def sum_rows(x: torch.Tensor) -> torch.Tensor:
    """SUM_ROWS: each row's sum as ggml_vec_sum_f32 makes it: from 0.0, element by element in order, in double, then
    rounded once to f32. The order is part of it: a double sum of f32 values is exact only while their exponents lie
    close together (``[2^60, 1, -2^60, 1]`` sums to 1 in this order, to 0 pairwise), and torch's sum has its own."""
    acc = torch.zeros(x.shape[:-1], dtype=torch.float64, device=x.device)
    for i in range(x.shape[-1]):
        acc = acc + x[..., i].to(torch.float64)
    return acc.to(F32).unsqueeze(-1)


def clamp(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """CLAMP: ``MAX(MIN(x, max), min)`` with ggml's macros (``a < b ? a : b``): NaN comes out as ``max`` (MIN's
    comparison is false), where torch.clamp would keep the NaN. Bounds in f32, either may be ±inf."""
    m = torch.where(x < f32(hi), x, torch.full_like(x, f32(hi)))
    return torch.where(m > f32(lo), m, torch.full_like(m, f32(lo)))


def div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """DIV: a / b, b tiled to a's shape, one correctly rounded f32 division per element (ggml_vec_div_f32). Computed
    in double and rounded once, which for a quotient of two f32 values is the f32 division exactly (double keeps
    more than twice f32's 24 bits plus 2), whatever form torch's f32 division takes."""
    return (a.to(torch.float64) / _tile(b, a).to(torch.float64)).to(F32)


def mul_mat_id(w: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, dtype=None, cpu: bool = False) -> torch.Tensor:
    """MUL_MAT_ID: w ne [K, M, n_as] (one matrix per expert; a quantized ``dtype``: each matrix's bytes), x ne
    [K, n_b, n_t], ids i32 ne [n_used, n_t] -> ne [M, n_used, n_t] with out[:, e, t] = w[:, :, ids[e, t]] @ x[:, e % n_b,
    t]. Each expert's rows are gathered and multiplied by :func:`mul_mat` (``cpu``: :func:`mul_mat_cpu`, ggml-cpu's
    rounding of the activation to the weight's vec_dot type), so only the selected experts' weights are read."""
    n_t, n_used = ids.shape[2], ids.shape[3]
    n_b = x.shape[2]
    sel = ids[0, 0].long()  # (n_t, n_used)
    if sel.numel() and not (0 <= int(sel.min()) and int(sel.max()) < w.shape[1]):  # (ggml asserts it)
        raise KernelError(f"MUL_MAT_ID: expert id {int(sel.min()) if int(sel.min()) < 0 else int(sel.max())} is "
                          f"outside the {w.shape[1]} experts")
    rows = x[0][:, torch.arange(n_used, device=x.device) % n_b]  # (n_t, n_used, K): slot e reads row e % n_b
    out = torch.zeros(1, n_t, n_used, w.shape[2], dtype=F32, device=x.device)
    product = mul_mat_cpu if cpu else mul_mat
    for e in torch.unique(sel).tolist():
        at = sel == e
        out[0][at] = product(w[:, e:e + 1], rows[at][None, None], dtype)[0, 0]
    return out


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
    """GDN_CONV_CHAIN of n_s sequences, composed of the unfused ops on the unfused graph's shapes and layouts (so
    its bytes are theirs): GET_ROWS of the conv states, CONCAT with the transposed projection, one CPY per snapshot
    row, SSM_CONV, SILU, and the normalisation of the q and k heads: L2_NORM(eps) (``norm="l2"``), or upstream's
    RMS_NORM(eps) then SCALE(qk_scale) (``norm="rms"``).

    states (1,1,R,(dc-1)*C), ids int32 (1,1,1,n_s), x (1,n_s,C,n_t), w (1,1,C,dc); rows: the destinations (cache
    rows (1,1,n_s,(dc-1)*C) or windows (1,n_s,C,dc-1)), of which only the shape is used; row r gets window columns
    columns[r] .. columns[r]+dc-2 of every sequence.
    Returns (snapshot row values, SiLU output (1,n_s,n_t,C), q, k (n_s,n_t,H_k,S)).
    """
    n_s, C, dc = x.shape[1], w.shape[2], w.shape[3]
    conv_input = concat(get_rows(states, ids).reshape(1, n_s, C, dc - 1), x, 0)
    snapshots = [cpy(conv_input[..., c:c + dc - 1], row) for c, row in zip(columns, rows)]
    y = silu(ssm_conv(conv_input, w).contiguous())  # contiguous: the SSM_CONV node's output as SILU reads it
    heads = y[0].unflatten(-1, (-1, head_dim))  # the head views (n_s, n_t, C/S, S) the graph takes of it
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


# ---- attention ops (issue 17): ROPE, SET_ROWS, SOFT_MAX, FLASH_ATTN_EXT ---------------------------------------------
#
# What each models, as the pinned llama.cpp's ggml-cpu computes it (0c1e570, ggml/src/ggml-cpu/ops.cpp), and where the
# reference departs from it: ROPE, SET_ROWS and SOFT_MAX follow the CPU's rounding points (f32 arithmetic, the
# CPU's order of roundings); FLASH_ATTN_EXT and MUL_MAT come in two forms: the f32 semantics (``cpu=False``: Q, K, V
# as f32, softmax and V·P in f32) and the CPU's (``cpu=True``: Q and the MUL_MAT activation rounded to the K/weight
# type as ggml-cpu's vec_dot_type does, V·P accumulated in f16 for an f16 V, online softmax in KV order).
# gdnpass.kernels.backends: TORCH_BACKEND runs the f32 forms, GGML_CPU_BACKEND the CPU's (and rms_norm's double sum).
# Checked against ggml-python's CPU op by op and against the pinned llama.cpp node by node
# (tests/kernels/test_attention_ops.py).

ROPE_NORMAL, ROPE_NEOX, ROPE_MROPE, ROPE_VISION, ROPE_IMROPE = 0, 2, 8, 24, 40
ROPE_IMPLEMENTED = frozenset({ROPE_NORMAL, ROPE_NEOX, ROPE_MROPE, ROPE_IMROPE})  # not VISION (24)

_f = np.float32


def rope_yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float,
                        beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims (ggml.c), in the C code's float32: the first and last rotary dimension YaRN ramps
    between, ``n_dims * logf(n_ctx_orig / (n_rot * 2π)) / (2 * logf(base))`` floored / ceiled and clamped."""
    with np.errstate(all="ignore"):
        def corr_dim(n_rot: float) -> np.float32:
            inner = _f(n_ctx_orig) / (_f(n_rot) * _f(2) * _f(np.pi))
            return _f(n_dims) * np.log(_f(inner)) / (_f(2) * np.log(_f(freq_base)))

        start, end = np.floor(corr_dim(beta_fast)), np.ceil(corr_dim(beta_slow))
    return float(max(_f(0), _f(start))), float(min(_f(n_dims - 1), _f(end)))


def rope_scalars(n_dims: int, n_ctx_orig: int, freq_base: float, freq_scale: float, ext_factor: float,
                 attn_factor: float, beta_fast: float, beta_slow: float) -> dict[str, float]:
    """ROPE's per-node constants, in the C code's float32 (each exactly an f32, returned as Python floats):
    theta_scale = powf(freq_base, -2.0f/n_dims); YaRN's ramp start ``corr0`` and width ``corr_den`` (rope_yarn_ramp's
    ``max(0.001f, high - low)``); the magnitude ``mscale`` (attn_factor, x(1 + 0.1 ln(1/freq_scale)) when ext_factor
    != 0). The reference and the Triton kernel both take them from here."""
    corr = rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
    m = _f(attn_factor)
    if ext_factor != 0.0:
        m = _f(m * _f(_f(1) + _f(0.1) * np.log(_f(1) / _f(freq_scale))))
    return dict(theta_scale=float(_f(freq_base) ** (_f(-2.0) / _f(n_dims))), corr0=float(_f(corr[0])),
                corr_den=float(max(_f(0.001), _f(corr[1]) - _f(corr[0]))), mscale=float(m))


def _rope_yarn(theta_extrap: torch.Tensor, k: int, freq_scale: float, ext_factor: float,
               c: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml-cpu's rope_yarn for pair k (i0 = 2k): (cos θ·mscale, sin θ·mscale), float32 as in C (cos/sin of the f32
    angle correctly rounded: computed in f64, rounded once); ``c``: :func:`rope_scalars`."""
    theta = theta_extrap * f32(freq_scale)
    if ext_factor != 0.0:
        y = (_f(k) - _f(c["corr0"])) / _f(c["corr_den"])  # rope_yarn_ramp: (i0/2 - low) / max(0.001, high - low)
        ramp_mix = _f(_f(1) - min(_f(1), max(_f(0), _f(y)))) * _f(ext_factor)
        theta = theta * f32(_f(1) - ramp_mix) + theta_extrap * f32(ramp_mix)
    t = theta.to(torch.float64)
    return torch.cos(t).to(F32) * c["mscale"], torch.sin(t).to(F32) * c["mscale"]


def _mrope_stream(k: int, sections, imrope: bool) -> int:
    """Which of the 4 position streams (t, h, w, e) pair k rotates by: ggml_mrope_cache_init's sector rule. IMROPE
    (qwen3-vl / qwen35) interleaves t, h, w by sector % 3 within 3 * section; MROPE takes contiguous sections."""
    s0, s1, s2, s3 = sections
    sector = k % (s0 + s1 + s2 + s3)
    if imrope:
        if sector % 3 == 1 and sector < 3 * s1:
            return 1
        if sector % 3 == 2 and sector < 3 * s2:
            return 2
        if sector % 3 == 0 and sector < 3 * s0:
            return 0
        return 3
    if s0 <= sector < s0 + s1:
        return 1
    if s0 + s1 <= sector < s0 + s1 + s2:
        return 2
    if sector >= s0 + s1 + s2:
        return 3
    return 0


def rope(x: torch.Tensor, pos: torch.Tensor, freq_factors: torch.Tensor | None, *, n_dims: int, mode: int,
         n_ctx_orig: int, freq_base: float, freq_scale: float, ext_factor: float, attn_factor: float,
         beta_fast: float, beta_slow: float, sections=(0, 0, 0, 0), n_offs: int = 0) -> torch.Tensor:
    """ROPE (ggml_rope_ext / ggml_rope_multi), forward, modes NORMAL 0, NEOX 2, MROPE 8 and IMROPE 40; x ne
    [ne0, heads, tokens, ne3] (f32 or f16), pos I32 ne [tokens] (M-RoPE: [4 * tokens]: the t, h, w, e streams one
    after the other). Rows are rotated in pairs starting at ``n_offs``: NORMAL pairs (2k, 2k+1), the others
    (k, k + n_dims/2), k < n_dims/2; the rest of the row is copied.

    Angles as ggml-cpu's rope cache makes them (ggml_rope_cache_init / ggml_mrope_cache_init): θ_k = p·s^k with
    s = powf(freq_base, -2.0f/n_dims) applied by repeated f32 multiplication from θ_0 = (float) p (M-RoPE: one
    running θ per stream, pair k taking its stream's), divided by freq_factors[k], then YaRN's rope_yarn:
    θ·freq_scale, blended toward θ by the ramp when ext_factor != 0 (θ_interp·(1 - r) + θ_extrap·r), magnitude
    attn_factor, ×(1 + 0.1·ln(1/freq_scale)) when ext_factor != 0. Rotation in f32: x0·cos - x1·sin,
    x0·sin + x1·cos. Every product and sum rounded on its own, as the pinned -O0 build computes them (a build that
    contracts them into FMAs, like ggml-python's, is an ulp apart). (ggml-cuda computes θ_k = p·powf(s, k)
    directly: not bit-identical at large positions.)
    """
    if mode not in ROPE_IMPLEMENTED:
        raise ValueError(f"ROPE mode {mode} is not implemented (have {sorted(ROPE_IMPLEMENTED)})")
    n3, n2, n1, ne0 = x.shape
    if n_dims % 2 or n_offs % 2 or n_offs < 0 or n_offs + n_dims > ne0:
        raise ValueError(f"ROPE: n_dims {n_dims}, n_offs {n_offs} do not fit rows of {ne0}")
    mrope = bool(mode & ROPE_MROPE)
    flat = pos.reshape(-1)
    streams = [flat[j * n2:(j + 1) * n2].to(F32) for j in range(4 if mrope else 1)]
    if mrope and (sum(sections) > ne0 or not any(sections[:3])):
        raise ValueError(f"ROPE: M-RoPE sections {tuple(sections)} do not fit rows of {ne0}")
    c = rope_scalars(n_dims, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow)
    theta_scale = f32(c["theta_scale"])
    ff = freq_factors.reshape(-1).to(F32) if freq_factors is not None else None
    half = n_dims // 2
    cos = torch.empty(n2, half, dtype=F32, device=x.device)
    sin = torch.empty_like(cos)
    for k in range(half):
        theta = streams[_mrope_stream(k, sections, mode == ROPE_IMROPE) if mrope else 0]
        if ff is not None:
            theta = theta / ff[k]
        cos[:, k], sin[:, k] = _rope_yarn(theta, k, freq_scale, ext_factor, c)
        streams = [t * theta_scale for t in streams]
    xf = x.to(F32)
    out = xf.clone()
    if mode == ROPE_NORMAL:
        i0 = n_offs + 2 * torch.arange(half, device=x.device)
        i1 = i0 + 1
    else:
        i0 = n_offs + torch.arange(half, device=x.device)
        i1 = i0 + half
    x0, x1 = xf[..., i0], xf[..., i1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out[..., i0] = x0 * c - x1 * s
    out[..., i1] = x0 * s + x1 * c
    return out.to(x.dtype)


def set_rows(dst: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """SET_ROWS (ggml_set_rows(a=dst, b=rows, c=ids)): the destination with row ``ids[i, i02 % ne11, i03 % ne12]`` of
    each (i02, i03) plane replaced by row i of ``rows``, converted to dst's type (f32 -> f16/bf16: round to nearest
    even, as ggml's from_float). Row ids are I64 or I32. (Two equal ids in one plane: ggml's threads race; here one
    of the rows wins.)"""
    n3, n2 = rows.shape[:2]
    i3 = torch.arange(n3, device=dst.device).view(-1, 1)
    i2 = torch.arange(n2, device=dst.device).view(1, -1)
    idx = ids[0].long()[i3 % ids.shape[1], i2 % ids.shape[2]]  # (n3, n2, n1): plane (i2, i3) reads ids[i3%, i2%]
    i3, i2 = i3[..., None], i2[..., None]
    check_row_ids(idx, dst.shape[2], "SET_ROWS")
    out = dst.clone()
    out[i3, i2, idx] = rows.to(dst.dtype)
    return out


def alibi_slopes(n_head: int, max_bias: float, device=None) -> torch.Tensor:
    """Per-head ALiBi slopes as ggml-cpu's soft_max / flash_attn_ext compute them (1.0 when max_bias is 0):
    m0 = 2^(-max_bias/n_head_log2), m1 = 2^(-(max_bias/2)/n_head_log2); head h < n_head_log2: m0^(h+1), else
    m1^(2(h - n_head_log2) + 1); f32 powf."""
    if max_bias <= 0.0:
        return torch.ones(n_head, dtype=F32, device=device)
    log2 = 1 << int(np.floor(np.log2(n_head)))
    m0 = _f(2.0) ** (-_f(max_bias) / _f(log2))
    m1 = _f(2.0) ** (-(_f(max_bias) / _f(2.0)) / _f(log2))
    s = [m0 ** _f(h + 1) if h < log2 else m1 ** _f(2 * (h - log2) + 1) for h in range(n_head)]
    return torch.tensor(np.array(s, dtype=np.float32), device=device)


def _mask_rows(mask: torch.Tensor, n3: int, n2: int, n1: int) -> torch.Tensor:
    """The mask row each (i3, i2, i1) reads: row i1 of plane (i2 % ne2, i3 % ne3), as f32 (ne32/ne33 broadcast by
    modulo; a mask may have more rows than there are queries: padding)."""
    m = mask.to(F32)
    i3 = torch.arange(n3, device=m.device) % m.shape[0]
    i2 = torch.arange(n2, device=m.device) % m.shape[1]
    return m[i3][:, i2][:, :, :n1]


def soft_max(x: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor | None, scale: float,
             max_bias: float) -> torch.Tensor:
    """SOFT_MAX (ggml_soft_max_ext, + ggml_soft_max_add_sinks) along ne0, as ggml-cpu's soft_max_f32: w = x·scale
    (f32) + slope·mask (mask f16/f32, row i1 of plane (i2 % ne12, i3 % ne13); slope from ALiBi, 1 without);
    e = exp(w - max) in f32 (max over the row and the head's sink); Σe accumulated in double (plus exp(sink - max));
    y = e · (float)(1/Σ), a multiply by the rounded reciprocal, not a division. (The CPU's exp is its SIMD expf:
    within an ulp of torch's.) A row of all -inf is NaN, as on the CPU."""
    n3, n2, n1, _ = x.shape
    w = x.to(F32) * f32(scale)
    if mask is not None:
        w = w + alibi_slopes(n2, max_bias, x.device).view(1, -1, 1, 1) * _mask_rows(mask, n3, n2, n1)
    mx = w.amax(-1, keepdim=True)
    sk = sinks.reshape(-1).to(F32).view(1, -1, 1, 1) if sinks is not None else None
    if sk is not None:
        mx = torch.maximum(mx, sk)
    e = torch.exp(w - mx)
    total = e.to(torch.float64).sum(-1, keepdim=True)
    if sk is not None:
        total = total + torch.exp(sk - mx).to(torch.float64)
    return e * (1.0 / total).to(F32)


def _round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to ``dtype`` (f16/bf16: nearest even) and back to f32; f32 unchanged."""
    return x.to(F32) if dtype == F32 else x.to(dtype).to(F32)


def _expf(x: torch.Tensor) -> torch.Tensor:
    """libm's expf, correctly rounded (f64 exp, rounded once; torch's f32 exp may be an ulp off), where one ulp
    decides an f16 rounding of the CPU's accumulator."""
    return torch.exp(x.to(torch.float64)).to(F32)


def flash_attn_ext(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   sinks: torch.Tensor | None, scale: float, max_bias: float = 0.0, logit_softcap: float = 0.0,
                   *, cpu: bool = False) -> torch.Tensor:
    """FLASH_ATTN_EXT: q ne [DK, n_q, H, ne3], k ne [DK, n_kv, H_kv, ne3k], v ne [DV, n_kv, H_kv, ne3v] (views, any
    strides), mask f16 ne [n_kv, >= n_q, ne32, ne33] (broadcast by modulo), sinks f32 [H]. Query head h reads K/V head
    h // (H / H_kv) (likewise ne3). Per query row: s_j = (q·k_j)·scale (logit_softcap c != 0: c·tanh(s_j·scale/c)),
    plus slope·mask_j (ALiBi slope, 1 without); out = Σ_j softmax(s)_j v_j, a sink joining the softmax's sum as
    exp(sink - max) with no value; a row whose every s_j is -inf (and no sink) gives 0, as the CPU's S == 0 case.
    Result f32 ne [DV, H, n_q, ne3] (the permute(0, 2, 1, 3) ggml defines): torch shape (ne3, n_q, H, DV).
    ``n_kv_max`` (a sparsity hint) and ``prec`` do not change the result (the CPU accumulates in f32 for both precs).

    ``cpu=False``: f32 semantics: Q, K, V as f32 (f16 K/V widen exactly), s in f32, exp(s - max), Σ and P·V in f32.

    ``cpu=True``: the pinned ggml-cpu (ops.cpp flash_attn_ext_f16), per path:
    - one-chunk path (fewer than 64 query rows, or K/V types differ): Q rounded to K's vec_dot type (f16 for an f16
      K: ``q_to_vec_dot``), s_j from that dot (f32, the sum taken in f64 here, ggml's SIMD lanes in f32); KV positions
      in order, those with mask -inf skipped; online softmax: a new maximum rescales the accumulator by
      exp(M_old - M), every position adds v_j·exp(s_j - M); for an f16 V that accumulator is f16 (ggml_vec_scale_f16,
      ggml_vec_mad_f16: each step rounded to f16), else f32; S = S·ms + vs in f32; out = acc · (1/S);
    - tiled path (64 or more query rows, K and V both f16 or both f32): Q, K, V in f32, which is ``cpu=False``
      (up to the order of the f32 sums over KV tiles of 64);
    - split-KV path (one query row, n_kv >= 512): chunks per thread, combined in f32; modelled as one thread (the
      one-chunk path over all of KV).
    """
    n3, H, n_q, DK = q.shape
    r3, rk = n3 // k.shape[0], H // k.shape[1]
    kk = k.repeat_interleave(rk, 1).repeat_interleave(r3, 0) if (rk, r3) != (1, 1) else k
    vv = v.repeat_interleave(H // v.shape[1], 1).repeat_interleave(n3 // v.shape[0], 0)
    sc = f32(scale)
    if logit_softcap != 0.0:
        sc = f32(_f(scale) / _f(logit_softcap))
    mv = None
    if mask is not None:
        mv = alibi_slopes(H, max_bias, q.device).view(1, -1, 1, 1) * _mask_rows(mask, n3, H, n_q)
    sk = sinks.reshape(-1).to(F32).view(1, -1, 1) if sinks is not None else None  # (1, H, 1)
    tiled = n_q >= 64 and k.dtype == v.dtype and k.dtype in (F32, torch.float16)
    if not cpu or tiled:
        s = (q.to(F32) @ kk.to(F32).transpose(-1, -2)) * sc
        if logit_softcap != 0.0:
            s = torch.tanh(s) * f32(logit_softcap)
        if mv is not None:
            s = s + mv
        mx = s.amax(-1)
        if sk is not None:
            mx = torch.maximum(mx, sk)
        live = mx > float("-inf")
        p = torch.exp(s - torch.where(live, mx, torch.zeros_like(mx))[..., None])
        total = p.sum(-1)
        if sk is not None:
            total = total + torch.where(live, torch.exp(sk - mx), torch.zeros_like(mx))
        o = (p @ vv.to(F32)) / torch.where(total == 0, torch.ones_like(total), total)[..., None]
        o = torch.where((total == 0)[..., None], torch.zeros_like(o), o)
        return o.transpose(1, 2).contiguous()
    # the one-chunk path, position by position
    qq = _round_to(q, k.dtype if k.dtype in (torch.float16, torch.bfloat16) else F32)
    s_all = (qq.to(torch.float64) @ kk.to(torch.float64).transpose(-1, -2)).to(F32) * sc
    if logit_softcap != 0.0:
        s_all = torch.tanh(s_all) * f32(logit_softcap)
    if mv is not None:
        s_all = s_all + mv
    # positions whose mask is -inf are skipped (without a mask, none)
    live = mv > float("-inf") if mv is not None else torch.ones_like(s_all, dtype=torch.bool)
    f16_acc = v.dtype == torch.float16
    M = torch.full((n3, H, n_q), float("-inf"), dtype=F32, device=q.device)
    S = torch.zeros_like(M)
    acc = torch.zeros(n3, H, n_q, v.shape[-1], dtype=F32, device=q.device)
    vf = vv.to(F32)
    for j in range(s_all.shape[-1]):
        sj, ok = s_all[..., j], live[..., j]
        up = ok & (sj > M)
        ms = torch.where(up, _expf(M - sj), torch.ones_like(M))
        vs = torch.where(up | ~ok, torch.ones_like(M), _expf(sj - M))
        scaled = acc * ms[..., None]
        acc = torch.where(up[..., None], _round_to(scaled, torch.float16) if f16_acc else scaled, acc)
        mad = (acc.to(torch.float64) + vf[:, :, j, None, :].to(torch.float64) * vs[..., None].to(torch.float64)).to(F32)
        acc = torch.where(ok[..., None], _round_to(mad, torch.float16) if f16_acc else mad, acc)
        S = torch.where(ok, S * ms + vs, S)
        M = torch.where(up, sj, M)
    if sk is not None:
        hi = sk > M
        ms = torch.where(hi, _expf(M - sk), torch.ones_like(M))
        vs = torch.where(hi, torch.ones_like(M), _expf(sk - M))
        acc = acc * ms[..., None]
        S = S * ms + vs
    inv = torch.where(S == 0, torch.zeros_like(S), 1.0 / torch.where(S == 0, torch.ones_like(S), S))
    return (acc * inv[..., None]).transpose(1, 2).contiguous()


def mul_mat_cpu(w: torch.Tensor, x: torch.Tensor, dtype=None) -> torch.Tensor:
    """MUL_MAT as ggml-cpu computes it: the activation x rounded to the weight's vec_dot type first (f16 weights:
    x to f16; bf16: x to bf16, nearest even: ``from_float`` of ggml_compute_forward_mul_mat; a quantized weight:
    x in q8_0 / q8_K blocks, :func:`gdnpass.kernels.quants.quantize_x_ggml_cpu`), then the f32 product of
    :func:`mul_mat` (the CPU's f32 sums run in its own order: SIMD lanes or llamafile tiles)."""
    if dtype is not None and dtype.is_quantized:  # the activation in ggml-cpu's q8_0 / q8_K blocks
        from gdnpass.kernels.quants import file_rows, mul_mat_q

        return mul_mat_q(file_rows(w, dtype), x, dtype, cpu=True)
    return mul_mat(w, _round_to(x, w.dtype if w.dtype in (torch.float16, torch.bfloat16) else F32))
