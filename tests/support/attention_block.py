"""A qwen35 attention block (llama.cpp's build_layer_attn + build_attn + build_ffn) written once as ggml calls, made
by :class:`IrCalls` with gdnpass's constructors or by :class:`GgmlCalls` on a ggml session (ggml-python's ggml
0.15.3): tests/test_ops.py builds and compares both, tests/kernels/test_attention_ops.py runs them."""

from __future__ import annotations

import ctypes

from gdnpass import ops
from gdnpass.ir import DType, Flag, Graph, Prec

F32, F16, I32, I64 = DType.F32, DType.F16, DType.I32, DType.I64
IMROPE = 40

HD, NH, NKV, T, KV, EMBD, FF, NROT, SECTIONS = 16, 4, 2, 3, 32, 32, 48, 8, (2, 1, 1, 0)


class IrCalls:
    """The ggml calls of the block, as gdnpass constructors."""

    def __init__(self) -> None:
        self.g = Graph()

    def leaf(self, buffer, name, type_, ne, input=False):
        return ops.new_tensor(name, type_, ne, buffer=buffer, flags=Flag.INPUT if input else Flag.NONE)

    nb = staticmethod(lambda t: t.nb)
    expand = property(lambda self: self.g.expand)

    def __getattr__(self, name):  # mul_mat, view_3d, rms_norm, ... are ops' functions of the same name
        return getattr(ops, name)

    def view_4d(self, a, ne0, ne1, ne2, ne3, nb1, nb2, nb3, offset):
        return ops.view_4d(a, (ne0, ne1, ne2, ne3), nb1, nb2, nb3, offset)

    def reshape_2d(self, a, *ne):
        return ops.reshape(a, *ne)

    reshape_3d = reshape_2d

    def cont_2d(self, a, *ne):
        return ops.cont(a, *ne)

    def mul_mat_f32(self, a, b):
        return ops.prec_set_acc(ops.mul_mat(a, b), Prec.F32)

    def flash_attn_f32(self, q, k, v, mask, scale):
        return ops.prec_set_acc(ops.flash_attn_ext(q, k, v, mask, scale, 0.0, 0.0), Prec.F32)

    def rope_multi(self, a, pos):
        return ops.rope_multi(a, pos, None, NROT, SECTIONS, IMROPE, 4096, 1e7, 1.0, 0.0, 1.0, 32.0, 1.0)

    def scale_inplace(self, a, s):
        return ops.scale(a, s, inplace=True)


def attention_block(F, flash: bool):
    """qwen35 build_layer_attn for T tokens, the KV cache store and build_attn_mha, then the gated output and the
    FFN (swiglu_split), the out_ids gather, and build_rs's zero-size state clear."""
    x = F.leaf("input", "inp_embd", F32, (EMBD, T), input=True)
    pos = F.leaf("input", "inp_pos", I32, (4 * T,), input=True)
    k_idxs = F.leaf("input", "attn_inp_k_idxs", I64, (T,), input=True)
    v_idxs = F.leaf("input", "attn_inp_v_idxs", I64, (T,) if flash else (T * HD * NKV,), input=True)
    mask = F.leaf("input", "attn_inp_kq_mask", F16 if flash else F32, (KV, T, 1, 1), input=True)
    out_ids = F.leaf("input", "out_ids", I32, (1,), input=True)
    wq, wk, wv = (F.leaf("weights", f"blk.3.attn_{n}.weight", F16, (EMBD, m))
                  for n, m in (("q", 2 * HD * NH), ("k", HD * NKV), ("v", HD * NKV)))
    wo = F.leaf("weights", "blk.3.attn_output.weight", F16, (HD * NH, EMBD))
    q_norm, k_norm = (F.leaf("weights", f"blk.3.attn_{n}_norm.weight", F32, (HD,)) for n in "qk")
    w_gate, w_up = (F.leaf("weights", f"blk.3.ffn_{n}.weight", F16, (EMBD, FF)) for n in ("gate", "up"))
    w_down = F.leaf("weights", "blk.3.ffn_down.weight", F16, (FF, EMBD))
    cache_k = F.leaf("cache", "cache_k_l3", F16, (HD * NKV, KV))
    cache_v = F.leaf("cache", "cache_v_l3", F16, (HD * NKV, KV))
    states = F.leaf("cache", "cache_s_l0", F32, (64, 4))

    q_full = F.mul_mat(wq, x)
    q = F.view_3d(q_full, HD, NH, T, 4 * HD * 2, 4 * HD * 2 * NH, 0)
    q = F.mul(F.rms_norm(q, 1e-6), q_norm)
    k = F.reshape_3d(F.mul_mat(wk, x), HD, NKV, T)
    k = F.mul(F.rms_norm(k, 1e-6), k_norm)
    gate = F.cont_2d(F.view_3d(q_full, HD, NH, T, 4 * HD * 2, 4 * HD * 2 * NH, 4 * HD), HD * NH, T)
    v = F.reshape_3d(F.mul_mat(wv, x), HD, NKV, T)
    q, k = F.rope_multi(q, pos), F.rope_multi(k, pos)
    F.expand(q)
    F.expand(v)
    F.expand(k)
    F.expand(F.set_rows(cache_k, F.view_2d(k, HD * NKV, T, F.nb(k)[2], 0), k_idxs))
    if flash:
        F.expand(F.set_rows(cache_v, F.view_2d(v, HD * NKV, T, F.nb(v)[2], 0), v_idxs))
        vv = F.view_4d(cache_v, HD, NKV, KV, 1, 2 * HD, 2 * HD * NKV, 2 * HD * NKV * KV, 0)
    else:  # the transposed V cache: one element per row
        flat = F.reshape_2d(F.reshape_2d(v, HD * NKV, T), 1, HD * NKV * T)
        F.expand(F.set_rows(F.reshape_2d(cache_v, 1, HD * NKV * KV), flat, v_idxs))
        vv = F.view_4d(cache_v, KV, NKV, HD, 1, 2 * KV * HD, 2 * KV, 2 * KV * HD * NKV, 0)
    kk = F.view_4d(cache_k, HD, NKV, KV, 1, 2 * HD, 2 * HD * NKV, 2 * HD * NKV * KV, 0)
    qq = F.view_4d(q, HD, NH, T, 1, F.nb(q)[1], F.nb(q)[2], F.nb(q)[2] * T, 0)
    qq, kk, vv = (F.permute(t, 0, 2, 1, 3) for t in (qq, kk, vv))
    if flash:
        cur = F.flash_attn_f32(qq, kk, vv, mask, 0.25)
        cur = F.reshape_2d(cur, HD * NH, T)
    else:
        kq = F.soft_max_ext(F.mul_mat_f32(kk, qq), mask, 0.25, 0.0)
        cur = F.cont_2d(F.permute(F.mul_mat(vv, kq), 0, 2, 1, 3), HD * NH, T)
    F.expand(cur)
    cur = F.mul_mat(wo, F.mul(cur, F.sigmoid(gate)))
    cur = F.mul_mat(w_down, F.swiglu_split(F.mul_mat(w_gate, cur), F.mul_mat(w_up, cur)))
    F.expand(F.get_rows(cur, out_ids))
    F.expand(F.scale_inplace(F.view_1d(states, 0, 0), 0.0))


class GgmlCalls:
    """The ggml calls of the block, made on a ggml session."""

    def __init__(self, session) -> None:
        self.s, self.g = session, session.g

    def leaf(self, buffer, name, type_, ne, input=False):
        return self.s.new_tensor(buffer, name, type_, ne, input=input)

    def nb(self, t):
        return tuple(int(x) for x in t.contents.nb)

    def expand(self, t):
        self.s.expand(t)

    def __getattr__(self, name):
        fn = getattr(self.g, f"ggml_{name}")
        return lambda *a: fn(self.s.ctx, *a)

    def mul_mat_f32(self, a, b):
        t = self.g.ggml_mul_mat(self.s.ctx, a, b)
        self.g.ggml_mul_mat_set_prec(t, self.g.GGML_PREC_F32)
        return t

    def flash_attn_f32(self, q, k, v, mask, scale):
        t = self.g.ggml_flash_attn_ext(self.s.ctx, q, k, v, mask, scale, 0.0, 0.0)
        self.g.ggml_flash_attn_ext_set_prec(t, self.g.GGML_PREC_F32)
        return t

    def rope_multi(self, a, pos):
        sections = (ctypes.c_int * 4)(*SECTIONS)
        return self.g.ggml_rope_multi(self.s.ctx, a, pos, None, NROT, sections, IMROPE, 4096, 1e7, 1.0, 0.0, 1.0,
                                      32.0, 1.0)
