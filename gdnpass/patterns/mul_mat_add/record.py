"""MUL_MAT_ADD's record: what the fused node carries and writes, its launches, adapters, scope and cost.

The node reads ``(w, x, r)`` and writes the ADD's memory: w·x + r, the product with the addend (the residual) added
as the mat-vec (or, beyond 16 columns, the GEMM) stores it. op_params: ``replaced``. The kernel is
:func:`gdnpass.kernels.triton_matvec.mul_mat_vec_add`, the single mat-vec's (or the GEMM's) own kernel with that one
add at its store, the one-step epilogue MUL_MAT_CHAIN's store generalises (so the product's bytes are the unfused
MUL_MAT's, and their sum the unfused ADD's: IEEE addition is commutative, so which operand of the ADD the product was
does not change a bit): it stays in the mat-vec family. The scope and the check it shares with MUL_MAT_CHAIN are
``patterns.product_store``'s. Pure Python: the adapters and :func:`programs` import torch and Triton when called.
"""

from __future__ import annotations

from gdnpass.ir import Op, Tensor, fused_op
from gdnpass.kernels import limits
from gdnpass.patterns.product_store import check_product, fits
from gdnpass.patterns.record import REPLACED, FusedOp, need

OP = fused_op("MUL_MAT_ADD")
KERNEL = "gdnpass.kernels.triton_matvec.mul_mat_vec_add"


def _check(n: Tensor) -> None:
    need(not n.outs, n, "writes only its own memory (the ADD's)")
    check_product(n, n, [n.src[2]])  # (the addend in the sum's shape)


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
