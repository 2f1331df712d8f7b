"""Backends: tables mapping an :class:`~gdnpass.ir.Op` to an adapter ``fn(node, src, out) -> None``.

``src[i]`` is a 4-D torch view (ne3, ne2, ne1, ne0) of ``node.src[i]`` in its real memory and ``out`` the view of
the node's own memory (for CPY: the destination). An adapter computes from ``src`` and writes ``out``; since ``out``
may alias an input, every result is computed in full before it is written. Views and no-ops are the executor's job.
A fused node also writes the views ``src[n_inputs:]`` (see :func:`gdnpass.ir.outputs`).

:data:`TORCH_BACKEND` runs :mod:`gdnpass.kernels.reference`; :data:`TRITON_BACKEND` swaps in the Triton kernels where
they apply. Triton is imported on the first Triton call, so the torch backend works without it (and the interpreter
switch ``TRITON_INTERPRET`` can still be set after this import).
"""

from __future__ import annotations

from typing import Callable

import torch

from gdnpass.ir import Op, Unary
from gdnpass.kernels import reference as ref

Adapter = Callable[[object, "list[torch.Tensor]", torch.Tensor], None]

# op -> fn(node, out, *src) returning the whole result (``out`` only tells CPY its type and GDN its old bytes)
_REFERENCE: dict[Op, Callable] = {
    Op.CONT: lambda n, out, a: ref.cpy(a, out),
    Op.CPY: lambda n, out, a, dst: ref.cpy(a, out),
    Op.GET_ROWS: lambda n, out, a, ids: ref.get_rows(a, ids),
    Op.CONCAT: lambda n, out, a, b: ref.concat(a, b, int(n.op_params["dim"])),
    Op.SCALE: lambda n, out, x: ref.scale(x, float(n.op_params["s"]), float(n.op_params.get("b", 0.0))),
    Op.ADD: lambda n, out, a, b: ref.add(a, b),
    Op.MUL: lambda n, out, a, b: ref.mul(a, b),
    Op.UNARY: lambda n, out, x: ref.UNARY[Unary(n.op_params["kind"]).value](x),
    Op.RMS_NORM: lambda n, out, x: ref.rms_norm(x, float(n.op_params["eps"])),
    Op.L2_NORM: lambda n, out, x: ref.l2_norm(x, float(n.op_params["eps"])),
    Op.MUL_MAT: lambda n, out, w, x: ref.mul_mat(w, x),
    Op.SSM_CONV: lambda n, out, sx, c: ref.ssm_conv(sx, c),
    Op.GATED_DELTA_NET: lambda n, out, *s: ref.gated_delta_net(*s, int(n.op_params["K"]), out=out),
}


def _computed_then_written(fn: Callable) -> Adapter:
    def adapter(node, src, out):
        out.copy_(fn(node, out, *src))  # the result is complete before out (which may alias a src) is touched

    return adapter


def _chain_args(node, src) -> tuple:
    """GDN_CONV_CHAIN's src [states, ids, x, w, q_out, k_out, *rows] -> (states, ids, x, w, rows, columns, eps)."""
    p = node.op_params
    return (*src[:4], src[6:], p["columns"], float(p["eps"]))


def _ref_conv_chain(node, src, out):
    p = node.op_params
    # everything is computed before anything is written: rows and out may alias inputs. The snapshots are copied
    # window by window, in the CPYs' order, whatever the layout (op_params["tile"] only changes the Triton store)
    snapshots, y, q, k = ref.gdn_conv_chain_ref(*_chain_args(node, src), int(p["head_dim"]), int(p["n_k_heads"]))
    for row, value in zip(src[6:], snapshots):
        row.copy_(value)
    out.copy_(y)
    src[4].copy_(q)
    src[5].copy_(k)


def _ref_mat_vec_pair(node, src, out):
    w_a, x, w_b, out_b = src
    a, b = ref.mul_mat(w_a, x), ref.mul_mat(w_b, x)
    out.copy_(a)
    out_b.copy_(b)


TORCH_BACKEND: dict[Op, Adapter] = {
    **{op: _computed_then_written(fn) for op, fn in _REFERENCE.items()},
    Op.GDN_CONV_CHAIN: _ref_conv_chain,
    Op.MUL_MAT_VEC_PAIR: _ref_mat_vec_pair,
}


def _tri():
    from gdnpass.kernels import triton_ops  # lazy: needs triton, and TRITON_INTERPRET must be set before it loads

    return triton_ops


def _tri_unary(node, src, out):
    if Unary(node.op_params["kind"]) is Unary.SILU:
        _tri().silu(src[0], out)
    else:
        TORCH_BACKEND[Op.UNARY](node, src, out)


MAT_VEC_MAX_COLS = 8         # MUL_MAT at 1..8 columns runs the Triton mat-vec (as ggml-cuda's mmvf)
THIN_MAX_COLS, THIN_MAX_ROWS = 16, 256  # ... and thin products (alpha/beta: 32 rows) up to 16 columns, where the
                                        # pair still halves the time and beats two cuBLAS calls (docs/performance.md)


def runs_as_mat_vec(rows: int, cols: int) -> bool:
    """Whether a single-matrix MUL_MAT of ``rows`` outputs and ``cols`` columns runs the Triton mat-vec; the pair
    matcher accepts exactly these, so a pair is always byte-identical to its two unfused products."""
    return 1 <= cols <= MAT_VEC_MAX_COLS or (cols <= THIN_MAX_COLS and rows <= THIN_MAX_ROWS)


def _is_mat_vec(w, x) -> bool:
    return w.shape[0] * w.shape[1] == 1 and runs_as_mat_vec(w.shape[2], x.shape[0] * x.shape[1] * x.shape[2])


def _tri_mul_mat(node, src, out):
    w, x = src
    if _is_mat_vec(w, x):
        _tri().mul_mat_vec(w, x, out)
    else:
        TORCH_BACKEND[Op.MUL_MAT](node, src, out)


def _tri_mat_vec_pair(node, src, out):
    w_a, x, w_b, out_b = src
    if _is_mat_vec(w_a, x):
        _tri().mul_mat_vec_pair(w_a, w_b, x, out, out_b)
    else:
        TORCH_BACKEND[Op.MUL_MAT_VEC_PAIR](node, src, out)


def _tri_conv_chain(node, src, out):
    p = node.op_params
    _tri().gdn_conv_chain(*_chain_args(node, src), out, src[4], src[5], bool(p.get("l2_separate")), p.get("tile"))


TRITON_BACKEND: dict[Op, Adapter] = {
    **TORCH_BACKEND,
    Op.SSM_CONV: lambda node, src, out: _tri().ssm_conv(src[0], src[1], out),
    Op.UNARY: _tri_unary,
    Op.L2_NORM: lambda node, src, out: _tri().l2_norm(src[0], float(node.op_params["eps"]), out),
    Op.MUL_MAT: _tri_mul_mat,
    Op.MUL_MAT_VEC_PAIR: _tri_mat_vec_pair,
    Op.GDN_CONV_CHAIN: _tri_conv_chain,
    Op.GATED_DELTA_NET: lambda node, src, out: _tri().gated_delta_net(*src, int(node.op_params["K"]), out),
}

__all__ = ["Adapter", "TORCH_BACKEND", "TRITON_BACKEND"]
