"""MUL_MAT_ADD's record: what the fused node carries and writes, its launches, adapters, scope and cost.

The node reads ``(w, x, r)`` and writes the ADD's memory: w·x + r, the product with the addend (the residual) added
as the mat-vec (or, beyond 16 columns, the GEMM) stores it. op_params: ``replaced``. The kernel is :func:`gdnpass.kernels.triton_matvec.
mul_mat_vec_add`, the single mat-vec's (or the GEMM's) own kernel with that one add at its store (so the product's bytes are the
unfused MUL_MAT's, and their sum the unfused ADD's: IEEE addition is commutative, so which operand of the ADD the
product was does not change a bit): it stays in the mat-vec family. Pure Python: the adapters and :func:`programs`
import torch and Triton when called.
"""

from __future__ import annotations

from gdnpass.ir import DType, Op, Tensor, fused_op
from gdnpass.kernels import limits
from gdnpass.patterns.record import REPLACED, FusedOp, need

OP = fused_op("MUL_MAT_ADD")
KERNEL = "gdnpass.kernels.triton_matvec.mul_mat_vec_add"


def fits(t: Tensor, rows: int, cols: int) -> bool:
    """The kernel's scope for the sum and the addend: packed, ``rows`` (the product's) per column, ``cols`` columns
    (the kernel addresses both as the product's [rows, cols])."""
    return t.is_contiguous() and t.ne[0] == rows and t.nelements == rows * cols


def _check(n: Tensor) -> None:
    w, x, r = n.src
    need(not n.outs, n, "writes only its own memory (the ADD's)")
    M, cols = w.ne[1], x.ne[1] * x.ne[2] * x.ne[3]
    need(w.ne[0] == x.ne[0] and limits.runs_in_one_launch(w.type, w.ne[2] * w.ne[3], M, cols), n,
         f"{cols} columns of a {w.type.label} {w.ne[:2]} weight: not one launch of a single matrix")
    need(limits.mat_vec_weight(w.type) and x.type is DType.F32, n,
         f"weight {w.type.label} and x {x.type.label}: the mat-vec takes f32/f16/bf16 or ggml block weights and f32 "
         "columns")
    for t in (n, r):
        need(t.type is DType.F32 and fits(t, M, cols), n,
             f"{t.name!r} must be f32, packed, {M} x {cols}; is {t.type.label} {t.ne}")
    need(r.ne == n.ne, n, f"the addend {r.ne} must have the sum's shape {n.ne}")


def _torch(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels import reference as ref

    w, x, r = views
    out.copy_(ref.add(ref.mul_mat(w, x, node.src[0].type).reshape(r.shape), r))


def _triton(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels import triton_matvec

    w, x, r = views
    as_product = (*x.shape[:3], w.shape[2])  # (ne3, ne2, ne1, M): the kernel's view of the sum and the addend
    triton_matvec.mul_mat_vec_add(w, x, r.view(as_product), out.view(as_product), node.src[0].type)


def programs(node: Tensor) -> list[tuple[str, int, int]]:
    """The single product's programs (the same kernel and grid: the mat-vec's or the GEMM's)."""
    from gdnpass.kernels import triton_matvec

    return triton_matvec.product_programs(node.src[0], node.src[1])


def watch(n: Tensor) -> bool:
    """What ``run --check`` compares: every ADD (the fused node writes the sum; the product it never writes)."""
    return n.op is Op.ADD


RECORD = FusedOp(
    op=OP,
    src=("w", "x", "r"),
    outs="nothing: the node is a view of the ADD's output",
    params={"replaced": REPLACED},
    check=_check,
    launches=lambda n: limits.mul_mat_launches(n.src[0], n.src[1]),
    torch=_torch,
    triton=_triton,
    scope=fits,
    doc="a MUL_MAT and the ADD of its product (the residual), in one mat-vec or GEMM launch",
    programs=programs,
    interpreter_s={},  # the mat-vec's own ("mat_vec": gdnpass.cli.INTERPRETER_S)
    watch=watch,
)
