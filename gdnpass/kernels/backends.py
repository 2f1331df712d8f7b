"""Backends: tables mapping an :class:`~gdnpass.ir.Op` to an adapter ``fn(node, views, out) -> None``.

``views[i]`` is a 4-D torch view (ne3, ne2, ne1, ne0) of ``node.src[i]`` (then of ``node.outs``) in its real memory
and ``out`` the view of the node's own memory (for CPY: the destination). An adapter computes from ``views`` and
writes ``out``; since ``out`` may alias an input, every result is computed in full before it is written. Views and
no-ops are the executor's job. Fused ops come from their records (the registry, :mod:`gdnpass.patterns`).

:data:`TORCH_BACKEND` runs :mod:`gdnpass.kernels.reference`; :data:`TRITON_BACKEND` swaps in the Triton kernels where
they apply. Triton is imported on the first Triton call, so the torch backend works without it (and the interpreter
switch ``TRITON_INTERPRET`` can still be set after this import).
"""

from __future__ import annotations

from typing import Callable

import torch

from gdnpass.errors import KernelError
from gdnpass.ir import DType, Op, Unary, runs_kernel
from gdnpass.kernels import reference as ref
from gdnpass.kernels.limits import mat_vec_columns, runs_as_mat_vec
from gdnpass.patterns import RECORDS
from gdnpass.patterns.record import Adapter

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
    # the attention ops (issue 17); PERMUTE/TRANSPOSE/VIEW/RESHAPE are the executor's views, CONT is above
    Op.ROPE: lambda n, out, x, pos, ff=None: ref.rope(x, pos, ff, **_rope_params(n)),
    Op.SET_ROWS: lambda n, out, rows, ids, dst: ref.set_rows(dst, rows, ids),
    Op.SOFT_MAX: lambda n, out, a, mask=None, sinks=None: ref.soft_max(
        a, mask, sinks, float(n.op_params["scale"]), float(n.op_params["max_bias"])),
    Op.FLASH_ATTN_EXT: lambda n, out, q, k, v, mask=None, sinks=None: ref.flash_attn_ext(
        q, k, v, mask, sinks, *_fa_params(n)),
}

# ggml-cpu's rounding points where they differ from the f32 semantics above (reference.py, "attention ops"): MUL_MAT
# rounds its activation to an f16/bf16 weight's type, FLASH_ATTN_EXT rounds Q to K's type and accumulates an f16 V in
# f16, RMS_NORM sums its squares in double. GGML_CPU_BACKEND runs these: what llama.cpp's CPU backend computes
# (tests/test_attention_ops.py).
_GGML_CPU: dict[Op, Callable] = {
    Op.MUL_MAT: lambda n, out, w, x: ref.mul_mat_cpu(w, x),
    Op.RMS_NORM: lambda n, out, x: ref.rms_norm(x, float(n.op_params["eps"]), acc=torch.float64),
    Op.FLASH_ATTN_EXT: lambda n, out, q, k, v, mask=None, sinks=None: ref.flash_attn_ext(
        q, k, v, mask, sinks, *_fa_params(n), cpu=True),
}

_ROPE_KEYS = ("n_dims", "mode", "n_ctx_orig", "freq_base", "freq_scale", "ext_factor", "attn_factor", "beta_fast",
              "beta_slow", "sections", "n_offs")
_FA_PRECS = ("UNDEFINED", "F32")  # ggml-cpu runs these (both accumulate in f32) and aborts on the others


def _rope_params(n) -> dict:
    p = n.op_params
    return {k: (tuple(p[k]) if k == "sections" else p[k]) for k in _ROPE_KEYS}


def _fa_params(n) -> tuple[float, float, float]:
    p = n.op_params
    return float(p["scale"]), float(p["max_bias"]), float(p["logit_softcap"])


def kernel(table: dict[Op, Adapter], node) -> Adapter | None:
    """``table``'s adapter for ``node``, or None where gdnpass has none: an op it only models (OPAQUE), a UNARY or
    GLU kind the reference does not implement, a ROPE mode other than NORMAL, NEOX, MROPE and IMROPE (VISION), a
    FLASH_ATTN_EXT precision ggml-cpu does not run."""
    if node.op is Op.UNARY and node.op_params.get("kind") not in ref.UNARY:
        return None
    if node.op is Op.GLU and node.op_params.get("kind") not in ref.GLU:
        return None
    if node.op is Op.ROPE and (int(node.op_params.get("mode", -1)) not in ref.ROPE_IMPLEMENTED
                               or node.type not in (DType.F32, DType.F16)):
        return None  # VISION (24) and any other mode: refused by name
    if node.op is Op.FLASH_ATTN_EXT and node.op_params.get("prec") not in _FA_PRECS:
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

# TORCH_BACKEND with ggml-cpu's rounding (see _GGML_CPU): compare with llama.cpp / ggml on the CPU
GGML_CPU_BACKEND: dict[Op, Adapter] = {
    **TORCH_BACKEND,
    **{op: _computed_then_written(fn) for op, fn in _GGML_CPU.items()},
}


# the Triton kernel modules, by family; lazy: they need triton, and TRITON_INTERPRET must be set before they load


def _tri_elt():
    from gdnpass.kernels import triton_elementwise

    return triton_elementwise


def _tri_norms():
    from gdnpass.kernels import triton_norms

    return triton_norms


def _tri_matvec():
    from gdnpass.kernels import triton_matvec

    return triton_matvec


def _tri_ssm():
    from gdnpass.kernels import triton_ssm

    return triton_ssm


def _tri_rope():
    from gdnpass.kernels import triton_rope

    return triton_rope


def _tri_unary(node, views, out):
    _tri_elt().unary(Unary(node.op_params["kind"]).value, views[0], out)


def _tri_glu(node, views, out):
    p = node.op_params
    _tri_elt().glu(p["kind"], views[0], views[1] if len(views) > 1 else None, bool(p.get("swapped")), out)


def _tri_mul_mat(node, views, out):
    """The mat-vec for 1-16 columns (of each batch, for attention's batched KQ / KQV); torch's matmul beyond (a
    prompt's ubatch)."""
    w, x = views
    if runs_as_mat_vec(w.shape[2], mat_vec_columns(w.shape[0] * w.shape[1], x.shape[::-1])):
        _tri_matvec().mul_mat_vec(w, x, out)
    else:
        TORCH_BACKEND[Op.MUL_MAT](node, views, out)


def _tri_attn():
    from gdnpass.kernels import triton_attention

    return triton_attention


def _tri_soft_max(node, views, out):
    """SOFT_MAX on its Triton kernel (views: x, mask or None, sinks). The torch reference runs the node instead where
    the kernel refuses its operands (triton_attention.soft_max_refusal): a non-float type, a mask narrower than the
    row or with fewer rows (the reference stretches a 1-wide or 1-tall one), an output overlapping an input other
    than in place; none of which the graph rules let through."""
    x, mask, sinks = (*views, None, None)[:3]
    p = node.op_params
    if _tri_attn().soft_max_refusal(x, mask, sinks, out) is not None:
        TORCH_BACKEND[Op.SOFT_MAX](node, views, out)
    else:
        _tri_attn().soft_max(x, mask, sinks, float(p["scale"]), float(p["max_bias"]), out)


def _tri_flash_attn_ext(node, views, out):
    """FLASH_ATTN_EXT on its Triton kernel (views: q, k, v, mask or None, sinks). The torch reference runs the node
    instead where the kernel refuses its operands (triton_attention.flash_attn_ext_refusal): quantized K/V (the
    reference has no such type either), a head wider than FA_MAX_D (512: the tiles would not fit), no KV positions,
    K/V that do not broadcast over q (the reference raises), a mask not n_kv wide or with fewer rows than queries
    (the reference stretches a 1-wide or 1-tall one; the graph rule does not check them), an output overlapping an
    input (the planner never makes one: FLASH_ATTN_EXT is not in place)."""
    q, k, v, mask, sinks = (*views, None, None)[:5]
    if _tri_attn().flash_attn_ext_refusal(q, k, v, mask, sinks, out) is not None:
        TORCH_BACKEND[Op.FLASH_ATTN_EXT](node, views, out)
    else:
        _tri_attn().flash_attn_ext(q, k, v, mask, sinks, *_fa_params(node), out)


def _tri_set_rows(node, views, out):
    rows, ids, dst = views
    if out.data_ptr() != dst.data_ptr() or out.shape != dst.shape or out.stride() != dst.stride():
        raise KernelError(f"node {node.name!r}: SET_ROWS is planned in place (a view of its destination)")
    _tri_elt().set_rows(rows, ids, out)


TRITON_BACKEND: dict[Op, Adapter] = {
    **TORCH_BACKEND,
    # one Triton launch per node for every op below (MUL_MATs of more than 16 columns stay torch's matmul)
    Op.GET_ROWS: lambda node, views, out: _tri_elt().get_rows(views[0], views[1], out),
    Op.CONCAT: lambda node, views, out: _tri_elt().concat(views[0], views[1], int(node.op_params["dim"]), out),
    Op.CPY: lambda node, views, out: _tri_elt().cpy(views[0], out),  # views[1] is the destination, out its view
    Op.CONT: lambda node, views, out: _tri_elt().cpy(views[0], out),
    Op.ADD: lambda node, views, out: _tri_elt().add(views[0], views[1], out),
    Op.MUL: lambda node, views, out: _tri_elt().mul(views[0], views[1], out),
    Op.GLU: _tri_glu,
    Op.SSM_CONV: lambda node, views, out: _tri_ssm().ssm_conv(views[0], views[1], out),
    Op.UNARY: _tri_unary,
    Op.L2_NORM: lambda node, views, out: _tri_norms().l2_norm(views[0], float(node.op_params["eps"]), out),
    Op.RMS_NORM: lambda node, views, out: _tri_norms().rms_norm(views[0], float(node.op_params["eps"]), out),
    Op.SCALE: lambda node, views, out: _tri_elt().scale(views[0], float(node.op_params["s"]),
                                                        float(node.op_params.get("b", 0.0)), out),
    Op.MUL_MAT: _tri_mul_mat,
    Op.GATED_DELTA_NET: lambda node, views, out: _tri_ssm().gated_delta_net(*views, int(node.op_params["K"]), out),
    Op.SET_ROWS: _tri_set_rows,
    Op.ROPE: lambda node, views, out: _tri_rope().rope(views[0], views[1], views[2] if len(views) > 2 else None, out,
                                                       **_rope_params(node)),
    Op.SOFT_MAX: _tri_soft_max,
    Op.FLASH_ATTN_EXT: _tri_flash_attn_ext,
    **{op: r.triton for op, r in RECORDS.items()},
}

def programs(node) -> list[tuple[str, int, int]]:
    """The Triton programs one execution of graph node ``node`` (a :class:`gdnpass.ir.Tensor`) launches under
    :data:`TRITON_BACKEND`, from the launchers' own block sizes: ``[(kernel, programs, steps)]``, ``steps`` being each
    program's loop trip count (tokens for ssm_conv, gdn and chain; K blocks for mat_vec; KV blocks for flash_attn,
    column blocks per pass for soft_max; 1 otherwise), as the family module of its op counts them (each one's
    ``programs``; a fused node's: its record's). Empty for nodes that run on torch (MUL_MATs of over 16 columns) or
    launch nothing. Pure: reads shapes only (the interpreter's cost estimate reads them)."""
    from gdnpass.kernels import (triton_attention, triton_elementwise, triton_matvec, triton_norms, triton_rope,
                                 triton_ssm)

    if node.op in (Op.FLASH_ATTN_EXT, Op.SOFT_MAX):
        return triton_attention.programs(node)
    if not runs_kernel(node):
        return []
    if node.op.is_fused:
        return RECORDS[node.op].programs(node)
    for family in (triton_elementwise, triton_norms, triton_matvec, triton_ssm, triton_rope):
        found = family.programs(node)
        if found:
            return found
    return []


__all__ = ["Adapter", "GGML_CPU_BACKEND", "TORCH_BACKEND", "TRITON_BACKEND", "programs"]
