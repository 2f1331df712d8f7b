"""Backends: tables mapping an :class:`~gdnpass.ir.Op` to an adapter ``fn(node, views, out) -> None``.

``views[i]`` is a 4-D torch view (ne3, ne2, ne1, ne0) of ``node.src[i]`` (then of ``node.outs``) in its real memory
and ``out`` the view of the node's own memory (for CPY: the destination). An adapter computes from ``views`` and
writes ``out``; since ``out`` may alias an input, every result is computed in full before it is written. Views and
no-ops are the executor's job. Fused ops come from their records (:mod:`gdnpass.kernels.fused`).

:data:`TORCH_BACKEND` runs :mod:`gdnpass.kernels.reference`; :data:`TRITON_BACKEND` swaps in the Triton kernels where
they apply. Triton is imported on the first Triton call, so the torch backend works without it (and the interpreter
switch ``TRITON_INTERPRET`` can still be set after this import).
"""

from __future__ import annotations

from typing import Callable

from gdnpass.ir import Op, Unary
from gdnpass.kernels import reference as ref
from gdnpass.kernels.fused import RECORDS, Adapter
from gdnpass.kernels.limits import runs_as_mat_vec

# op -> fn(node, out, *src) returning the whole result (``out`` only tells CPY its type and GDN its old bytes)
_REFERENCE: dict[Op, Callable] = {
    Op.CONT: lambda n, out, a: ref.cpy(a, out),
    Op.CPY: lambda n, out, a, dst: ref.cpy(a, out),
    Op.GET_ROWS: lambda n, out, a, ids: ref.get_rows(a, ids),
    Op.CONCAT: lambda n, out, a, b: ref.concat(a, b, int(n.op_params["dim"])),
    Op.SCALE: lambda n, out, x: ref.scale(x, float(n.op_params["s"]), float(n.op_params.get("b", 0.0))),
    Op.ADD: lambda n, out, a, b: ref.add(a, b),
    Op.MUL: lambda n, out, a, b: ref.mul(a, b),
    Op.GLU: lambda n, out, a, b=None: ref.glu(n.op_params["kind"], a, b, bool(n.op_params.get("swapped"))),
    Op.UNARY: lambda n, out, x: ref.UNARY[Unary(n.op_params["kind"]).value](x),
    Op.RMS_NORM: lambda n, out, x: ref.rms_norm(x, float(n.op_params["eps"])),
    Op.L2_NORM: lambda n, out, x: ref.l2_norm(x, float(n.op_params["eps"])),
    Op.MUL_MAT: lambda n, out, w, x: ref.mul_mat(w, x),
    Op.SSM_CONV: lambda n, out, sx, c: ref.ssm_conv(sx, c),
    Op.GATED_DELTA_NET: lambda n, out, *s: ref.gated_delta_net(*s, int(n.op_params["K"]), out=out),
}


def kernel(table: dict[Op, Adapter], node) -> Adapter | None:
    """``table``'s adapter for ``node``, or None where gdnpass has none: an op it only models (ROPE, SOFT_MAX, ...,
    OPAQUE) or a UNARY kind the reference does not implement."""
    if node.op is Op.UNARY and node.op_params.get("kind") not in ref.UNARY:
        return None
    if node.op is Op.GLU and node.op_params.get("kind") not in ref.GLU:
        return None
    return table.get(node.op)


def _computed_then_written(fn: Callable) -> Adapter:
    def adapter(node, views, out):
        out.copy_(fn(node, out, *views))  # the result is complete before out (which may alias a src) is touched

    return adapter


TORCH_BACKEND: dict[Op, Adapter] = {
    **{op: _computed_then_written(fn) for op, fn in _REFERENCE.items()},
    **{op: r.torch for op, r in RECORDS.items()},
}


def _tri():
    from gdnpass.kernels import triton_ops  # lazy: needs triton, and TRITON_INTERPRET must be set before it loads

    return triton_ops


def _tri_unary(node, views, out):
    if Unary(node.op_params["kind"]) is Unary.SILU:
        _tri().silu(views[0], out)
    else:
        TORCH_BACKEND[Op.UNARY](node, views, out)


def _tri_mul_mat(node, views, out):
    w, x = views
    if w.shape[0] * w.shape[1] == 1 and runs_as_mat_vec(w.shape[2], x.shape[0] * x.shape[1] * x.shape[2]):
        _tri().mul_mat_vec(w, x, out)
    else:
        TORCH_BACKEND[Op.MUL_MAT](node, views, out)


TRITON_BACKEND: dict[Op, Adapter] = {
    **TORCH_BACKEND,
    Op.SSM_CONV: lambda node, views, out: _tri().ssm_conv(views[0], views[1], out),
    Op.UNARY: _tri_unary,
    Op.L2_NORM: lambda node, views, out: _tri().l2_norm(views[0], float(node.op_params["eps"]), out),
    Op.RMS_NORM: lambda node, views, out: _tri().rms_norm(views[0], float(node.op_params["eps"]), out),
    Op.SCALE: lambda node, views, out: _tri().scale(views[0], float(node.op_params["s"]),
                                                    float(node.op_params.get("b", 0.0)), out),
    Op.MUL_MAT: _tri_mul_mat,
    Op.GATED_DELTA_NET: lambda node, views, out: _tri().gated_delta_net(*views, int(node.op_params["K"]), out),
    **{op: r.triton for op, r in RECORDS.items()},
}

__all__ = ["Adapter", "TORCH_BACKEND", "TRITON_BACKEND"]
