"""How each base op runs: its torch reference adapter, its Triton adapter (and ggml-cpu's rounding where it differs),
and its family's cost estimate; the spec table (:mod:`gdnpass.opspec`) names them per op and
:mod:`gdnpass.kernels.backends` builds the executor's tables from it.

Adapters have the executor's signature ``fn(node, views, out)``: ``views[i]`` is a 4-D torch view (ne3, ne2, ne1,
ne0) of ``node.src[i]`` in its real memory, ``out`` the view of the node's own memory (for CPY: the destination).
``out`` may alias an input, so a torch adapter computes its whole result before writing it. torch, the reference and
Triton are imported on the first call: building, planning and dumping a graph import neither, and
``TRITON_INTERPRET`` can still be set after this module loads.
"""

from __future__ import annotations

import importlib
from typing import Callable

from gdnpass.errors import KernelError
from gdnpass.ir import Op, Unary
from gdnpass.kernels.limits import QUANT_MAT_VEC_COLS, mul_mat_path
from gdnpass.opspec.vocab import Adapter, Programs


def _ref():
    from gdnpass.kernels import reference

    return reference


def _family(name: str):
    """A Triton kernel family module (kernels/triton_<name>.py), imported on first use."""
    return importlib.import_module(f"gdnpass.kernels.triton_{name}")


def computed(fn: Callable) -> Adapter:
    """The adapter of ``fn(node, out, *src)``, which returns the whole result: written to ``out`` only once complete
    (``out`` only tells CPY its type and GATED_DELTA_NET its old bytes)."""

    def adapter(node, views, out):
        out.copy_(fn(node, out, *views))

    return adapter


def programs_of(family: str) -> Programs:
    """The cost estimate of an op of Triton kernel family ``family``: that module's ``programs(node)``."""
    return lambda node: _family(family).programs(node)


def _eps(n) -> float:
    return float(n.op_params["eps"])


def rope_params(n, keys) -> dict:
    """ROPE's keyword arguments, ``keys`` its spec's (``sections`` as a tuple)."""
    p = n.op_params
    return {k: (tuple(p[k]) if k == "sections" else p[k]) for k in keys}


def fa_params(n) -> tuple[float, float, float]:
    p = n.op_params
    return float(p["scale"]), float(p["max_bias"]), float(p["logit_softcap"])


# ---- the torch reference (kernels/reference.py): fn(node, out, *src) -> result -------------------------------------

def _rms_norm_cpu(n, out, x):
    import torch

    return _ref().rms_norm(x, _eps(n), acc=torch.float64)  # ggml-cpu sums the squares in double


_TORCH: dict[Op, Callable] = {
    Op.CONT: lambda n, out, a: _ref().cpy(a, out),
    Op.CPY: lambda n, out, a, dst: _ref().cpy(a, out),
    Op.GET_ROWS: lambda n, out, a, ids: _ref().get_rows(a, ids, n.src[0].type),
    Op.SET_ROWS: lambda n, out, rows, ids, dst: _ref().set_rows(dst, rows, ids),
    Op.CONCAT: lambda n, out, a, b: _ref().concat(a, b, int(n.op_params["dim"])),
    Op.SCALE: lambda n, out, x: _ref().scale(x, float(n.op_params["s"]), float(n.op_params.get("b", 0.0))),
    Op.ADD: lambda n, out, a, b: _ref().add(a, b),
    Op.MUL: lambda n, out, a, b: _ref().mul(a, b),
    Op.UNARY: lambda n, out, x: _ref().UNARY[Unary(n.op_params["kind"]).value](x),
    Op.GLU: lambda n, out, a, b=None: _ref().glu(n.op_params["kind"], a, b, bool(n.op_params.get("swapped"))),
    Op.RMS_NORM: lambda n, out, x: _ref().rms_norm(x, _eps(n)),
    Op.L2_NORM: lambda n, out, x: _ref().l2_norm(x, _eps(n)),
    Op.MUL_MAT: lambda n, out, w, x: _ref().mul_mat(w, x, n.src[0].type),
    Op.SOFT_MAX: lambda n, out, a, mask=None, sinks=None: _ref().soft_max(
        a, mask, sinks, float(n.op_params["scale"]), float(n.op_params["max_bias"])),
    Op.FLASH_ATTN_EXT: lambda n, out, q, k, v, mask=None, sinks=None: _ref().flash_attn_ext(
        q, k, v, mask, sinks, *fa_params(n)),
    Op.SSM_CONV: lambda n, out, sx, c: _ref().ssm_conv(sx, c),
    Op.ARGSORT: lambda n, out, x: _ref().argsort(x, int(n.op_params["order"])),
    Op.SUM_ROWS: lambda n, out, x: _ref().sum_rows(x),
    Op.CLAMP: lambda n, out, x: _ref().clamp(x, float(n.op_params["min"]), float(n.op_params["max"])),
    Op.DIV: lambda n, out, a, b: _ref().div(a, b),
    Op.MUL_MAT_ID: lambda n, out, w, x, ids: _ref().mul_mat_id(w, x, ids, n.src[0].type),
    Op.GATED_DELTA_NET: lambda n, out, *s: _ref().gated_delta_net(*s, int(n.op_params["K"]), out=out),
}
TORCH: dict[Op, Adapter] = {op: computed(fn) for op, fn in _TORCH.items()}

# ggml-cpu's rounding points where they differ from the f32 semantics above (reference.py, "attention ops"): MUL_MAT
# rounds its activation to an f16/bf16 weight's type (a quantized weight's: to ggml-cpu's q8_0 / q8_K blocks), FLASH_ATTN_EXT rounds Q to K's type and accumulates an f16 V in
# f16, RMS_NORM sums its squares in double: what llama.cpp's CPU backend computes (GGML_CPU_BACKEND;
# tests/kernels/test_attention_ops.py).
GGML_CPU: dict[Op, Adapter] = {op: computed(fn) for op, fn in {
    Op.MUL_MAT: lambda n, out, w, x: _ref().mul_mat_cpu(w, x, n.src[0].type),
    Op.RMS_NORM: _rms_norm_cpu,
    Op.MUL_MAT_ID: lambda n, out, w, x, ids: _ref().mul_mat_id(w, x, ids, n.src[0].type, cpu=True),
    Op.FLASH_ATTN_EXT: lambda n, out, q, k, v, mask=None, sinks=None: _ref().flash_attn_ext(
        q, k, v, mask, sinks, *fa_params(n), cpu=True),
}.items()}


# ---- the Triton kernels: fn(node, views, out) ----------------------------------------------------------------------

def _tri_unary(node, views, out):
    _family("elementwise").unary(Unary(node.op_params["kind"]).value, views[0], out)


def _tri_glu(node, views, out):
    """GLU, writing its output quantized too where the executor's pre-pass plan asks (gdnpass.prepasses)."""
    from gdnpass import prepasses

    p = node.op_params
    _family("elementwise").glu(p["kind"], views[0], views[1] if len(views) > 1 else None, bool(p.get("swapped")), out,
                               quantize=prepasses.producing_now())


def _tri_scale(node, views, out):
    _family("elementwise").scale(views[0], float(node.op_params["s"]), float(node.op_params.get("b", 0.0)), out)


def _tri_mul_mat(node, views, out):
    """The mat-vec for 1-16 columns (of each batch, for attention's batched KQ / KQV); beyond (several sequences'
    verify, a prompt's ubatch) the GEMM for a single f16 / bf16 matrix (torch's matmul would convert the whole weight
    to f32 on every call), the mat-vec per 32 columns for a quantized one (torch would first dequantize the whole
    weight: 4 GB of f32 for a 9B's lm head), torch's matmul for the rest (f32 weights, batched products)."""
    w, x = views
    wtype = node.src[0].type
    path = mul_mat_path(wtype, w.shape[0] * w.shape[1], w.shape[2], x.shape[::-1])
    if path == "mat_vec":
        _family("matvec").mul_mat_vec(w, x, out, wtype)
    elif path == "gemm":
        _family("matvec").mul_mat_gemm(w, x, out)
    elif path == "chunks":
        for c in range(0, x.shape[2], QUANT_MAT_VEC_COLS):
            _family("matvec").mul_mat_vec(w, x[:, :, c:c + QUANT_MAT_VEC_COLS], out[:, :, c:c + QUANT_MAT_VEC_COLS],
                                          wtype)
    else:
        TORCH[Op.MUL_MAT](node, views, out)


def _tri_mul_mat_id(node, views, out):
    """MUL_MAT_ID on the mat-vec kernel (plain and quantized experts), the experts' matrices found from the ids on
    the device; a b of rows that neither is one nor one a slot (which no llama.cpp graph makes) on the torch
    reference, which reads the ids on the host."""
    w, x, ids = views
    if x.shape[2] not in (1, ids.shape[3]):
        TORCH[Op.MUL_MAT_ID](node, views, out)
    else:
        _family("matvec").mul_mat_id(w, x, ids, out, node.src[0].type)


def _tri_argsort(node, views, out):
    """ARGSORT on its Triton kernel; rows longer than the kernel sorts in registers (triton_sort.argsort_refusal:
    over limits.ARGSORT_MAX_ROW elements) on the torch reference."""
    if _family("sort").argsort_refusal(views[0], out) is not None:
        TORCH[Op.ARGSORT](node, views, out)
    else:
        _family("sort").argsort(views[0], int(node.op_params["order"]), out)


def _tri_soft_max(node, views, out):
    """SOFT_MAX on its Triton kernel (views: x, mask or None, sinks). The torch reference runs the node instead where
    the kernel refuses its operands (triton_attention.soft_max_refusal): a non-float type, a mask narrower than the
    row or with fewer rows (the reference stretches a 1-wide or 1-tall one), an output overlapping an input other
    than in place; none of which the graph rules let through."""
    x, mask, sinks = (*views, None, None)[:3]
    p = node.op_params
    if _family("attention").soft_max_refusal(x, mask, sinks, out) is not None:
        TORCH[Op.SOFT_MAX](node, views, out)
    else:
        _family("attention").soft_max(x, mask, sinks, float(p["scale"]), float(p["max_bias"]), out)


def _tri_flash_attn_ext(node, views, out):
    """FLASH_ATTN_EXT on its Triton kernel (views: q, k, v, mask or None, sinks). The torch reference runs the node
    instead where the kernel refuses its operands (triton_attention.flash_attn_ext_refusal): quantized K/V (the
    reference has no such type either), a head wider than FA_MAX_D (512: the tiles would not fit), no KV positions,
    K/V that do not broadcast over q (the reference raises), a mask not n_kv wide or with fewer rows than queries
    (the reference stretches a 1-wide or 1-tall one; the graph rule does not check them), an output overlapping an
    input (the planner never makes one: FLASH_ATTN_EXT is not in place)."""
    q, k, v, mask, sinks = (*views, None, None)[:5]
    if _family("attention").flash_attn_ext_refusal(q, k, v, mask, sinks, out) is not None:
        TORCH[Op.FLASH_ATTN_EXT](node, views, out)
    else:
        _family("attention").flash_attn_ext(q, k, v, mask, sinks, *fa_params(node), out)


def _tri_set_rows(node, views, out):
    rows, ids, dst = views
    if out.data_ptr() != dst.data_ptr() or out.shape != dst.shape or out.stride() != dst.stride():
        raise KernelError(f"node {node.name!r}: SET_ROWS is planned in place (a view of its destination)")
    _family("elementwise").set_rows(rows, ids, out)


def rope(keys: tuple[str, ...]) -> tuple[Adapter, Adapter]:
    """ROPE's torch and Triton adapters; ``keys``: its spec's parameters, the reference's and the kernel's keywords."""

    def triton(node, views, out):
        _family("rope").rope(views[0], views[1], views[2] if len(views) > 2 else None, out, **rope_params(node, keys))

    return computed(lambda n, out, x, pos, ff=None: _ref().rope(x, pos, ff, **rope_params(n, keys))), triton


# one Triton launch per node for every op below (MUL_MATs of more than 16 columns: the GEMM for f16 / bf16 weights,
# see _tri_mul_mat)
TRITON: dict[Op, Adapter] = {
    Op.CONT: lambda node, views, out: _family("elementwise").cpy(views[0], out),
    Op.CPY: lambda node, views, out: _family("elementwise").cpy(views[0], out),  # views[1] is the destination
    Op.GET_ROWS: lambda node, views, out: _family("elementwise").get_rows(views[0], views[1], out, node.src[0].type),
    Op.SET_ROWS: _tri_set_rows,
    Op.CONCAT: lambda node, views, out: _family("elementwise").concat(views[0], views[1],
                                                                      int(node.op_params["dim"]), out),
    Op.SCALE: _tri_scale,
    Op.ADD: lambda node, views, out: _family("elementwise").add(views[0], views[1], out),
    Op.MUL: lambda node, views, out: _family("elementwise").mul(views[0], views[1], out),
    Op.DIV: lambda node, views, out: _family("elementwise").div(views[0], views[1], out),
    Op.CLAMP: lambda node, views, out: _family("elementwise").clamp(views[0], float(node.op_params["min"]),
                                                                    float(node.op_params["max"]), out),
    Op.UNARY: _tri_unary,
    Op.GLU: _tri_glu,
    Op.RMS_NORM: lambda node, views, out: _family("norms").rms_norm(views[0], _eps(node), out),
    Op.L2_NORM: lambda node, views, out: _family("norms").l2_norm(views[0], _eps(node), out),
    Op.SUM_ROWS: lambda node, views, out: _family("norms").sum_rows(views[0], out),
    Op.ARGSORT: _tri_argsort,
    Op.MUL_MAT: _tri_mul_mat,
    Op.MUL_MAT_ID: _tri_mul_mat_id,
    Op.SOFT_MAX: _tri_soft_max,
    Op.FLASH_ATTN_EXT: _tri_flash_attn_ext,
    Op.SSM_CONV: lambda node, views, out: _family("ssm").ssm_conv(views[0], views[1], out),
    Op.GATED_DELTA_NET: lambda node, views, out: _family("ssm").gated_delta_net(*views, int(node.op_params["K"]), out),
}
