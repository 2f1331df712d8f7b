"""MUL_MAT_VEC_PAIR's record: what the fused node carries and writes, its launches, adapters, scope and cost.

The kernel is :func:`gdnpass.kernels.triton_matvec.mul_mat_vec_pair`, the single mat-vec's (or, beyond 16
columns, the GEMM's) own kernel with a second product on the grid (each product byte-identical to its single one):
it stays in the mat-vec family. After the pair_glu pattern a node may carry ``glu`` ("SWIGLU") and ``swapped``: it
then writes only y = silu(gate)·up of its products (gate the second one when ``swapped``), as the GLU node it
replaced did (:func:`gdnpass.kernels.triton_matvec.mul_mat_vec_pair_glu`), and has no ``outs``; of block-type
weights, it may hand y on quantized for the Q8_0 product after it (a hand-off of ``gdnpass.prepasses``). Pure
Python: the adapters and :func:`programs` import torch and Triton when called.
"""

from __future__ import annotations

from gdnpass.ir import Op, Tensor, fused_op
from gdnpass.kernels import limits
from gdnpass.opspec.vocab import BOOL, Param
from gdnpass.patterns.record import REPLACED, FusedOp, need

OP = fused_op("MUL_MAT_VEC_PAIR")
KERNEL = "gdnpass.kernels.triton_matvec.mul_mat_vec_pair"
GLU = Param(lambda x: x == "SWIGLU", "SWIGLU (the GLU the epilogue computes)", optional=True)


def glu_of(n: Tensor) -> str | None:
    """The GLU a pair node computes of its products (pair_glu), or None: it stores them."""
    return n.op_params.get("glu")


def _check(n: Tensor) -> None:
    w_a, x, w_b = n.src
    glu = glu_of(n)
    holds = "nothing (the node writes the GLU)" if glu else "the second product"
    need(len(n.outs) == (0 if glu else 1), n, f"outs must hold {holds}, has {len(n.outs)}")
    need(not glu or "swapped" in n.op_params, n, "a SwiGLU epilogue needs op_params 'swapped'")
    need(w_a.type is w_b.type and w_a.ne == w_b.ne, n, f"weights {w_a.name!r} and {w_b.name!r} differ in type/shape")
    want = (w_a.ne[1], x.ne[1], x.ne[2], x.ne[3])
    b = n if glu else n.outs[0]
    need(w_a.ne[0] == x.ne[0] and n.ne == want and b.ne == want and b.nb == n.nb, n,
         f"products {n.ne} / {b.ne} are not [{want}] of one layout")
    cols = x.ne[1] * x.ne[2] * x.ne[3]
    need(limits.runs_in_one_launch(w_a.type, w_a.ne[2] * w_a.ne[3], w_a.ne[1], cols), n,
         f"{cols} columns of a {w_a.type.label} {w_a.ne[:2]} weight: not one launch of a single matrix")
    need(not glu or limits.runs_as_mat_vec(w_a.ne[1], cols), n,
         f"a SwiGLU epilogue at {cols} columns (the mat-vec's only, 1..{limits.MAT_VEC_COLS})")


def _torch(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels import reference as ref

    w_a, x, w_b, *out_b = views
    wtype = node.src[0].type
    a, b = ref.mul_mat(w_a, x, wtype), ref.mul_mat(w_b, x, wtype)
    if glu_of(node):
        out.copy_(ref.glu(glu_of(node), a, b, node.op_params["swapped"]))
        return
    out.copy_(a)
    out_b[0].copy_(b)


def _triton(node: Tensor, views: list, out) -> None:
    from gdnpass import prepasses
    from gdnpass.kernels import triton_matvec

    w_a, x, w_b, *out_b = views
    if glu_of(node):  # (handing y on quantized where the pre-pass plan makes the node its reader's producer)
        triton_matvec.mul_mat_vec_pair_glu(w_a, w_b, x, out, node.op_params["swapped"], node.src[0].type,
                                           prepasses.producing_now())
        return
    triton_matvec.mul_mat_vec_pair(w_a, w_b, x, out, out_b[0], node.src[0].type)


def programs(node: Tensor) -> list[tuple[str, int, int]]:
    """The single product's kernel's programs for two products of the weights' shape (steps: K blocks)."""
    from gdnpass.kernels import triton_matvec

    return triton_matvec.product_programs(node.src[0], node.src[1], products=2)


def watch(n: Tensor) -> bool:
    """What ``run --check`` compares for the pair: every MUL_MAT the mat-vec or the GEMM runs (a pair's product is
    one), and every SWIGLU of two sources (what a pair with its epilogue writes)."""
    if n.op is Op.GLU:
        return n.op_params.get("kind") == "SWIGLU" and len(n.src) == 2
    if n.op is not Op.MUL_MAT:
        return False
    w, cols = n.src[0], n.ne[1] * n.ne[2] * n.ne[3]
    return limits.runs_as_mat_vec(n.ne[0], cols) or limits.runs_as_gemm(w.type, w.ne[2] * w.ne[3], cols)


RECORD = FusedOp(
    op=OP,
    src=("w_a", "x", "w_b"),
    outs="the second product (nothing with ``glu``: the node writes the GLU's output)",
    params={"replaced": REPLACED, "glu": GLU, "swapped": Param(BOOL.ok, BOOL.what, optional=True)},
    check=_check,
    launches=lambda n: limits.mul_mat_launches(n.src[0], n.src[1]),
    torch=_torch,
    triton=_triton,
    scope=limits.runs_in_one_launch,
    doc="two MUL_MATs sharing their input, in one mat-vec or GEMM launch",
    programs=programs,
    interpreter_s={},  # the mat-vec's own ("mat_vec": gdnpass.cli.INTERPRETER_S)
    watch=watch,
    variant=lambda n: f"{glu_of(n)}({'up, gate' if n.op_params['swapped'] else 'gate, up'})" if glu_of(n) else "",
)
