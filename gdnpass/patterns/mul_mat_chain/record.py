"""MUL_MAT_CHAIN's record: what the fused node carries and writes, its launches, adapters, scope and cost.

The node reads ``(w, x, b1[, b2])`` — the product's weight and activation, then the chain's side operands in order —
and writes the chain's memory: w·x through the chain's steps, run by the single mat-vec's (or, beyond 16 columns,
the GEMM's) store on each sum (:class:`gdnpass.kernels.triton_matvec.Epilogue`, the steps ELEMENTWISE_CHAIN's kernel
runs: ``triton_core.chain_step``), so the product's bytes are the unfused MUL_MAT's and the output the unfused
chain's. op_params: ``steps`` (ELEMENTWISE_CHAIN's, the product the chain's value) and ``replaced``. The kernel is
:func:`gdnpass.kernels.triton_matvec.mul_mat_vec_chain`: it stays in the mat-vec family. Pure Python: the adapters
and :func:`programs` import torch and Triton when called. Where a Q8_0 product reads the chain's output next, the
node may hand it on as that product's q8_1 activations (a hand-off of ``gdnpass.prepasses``: the GDN's z chain for
ssm_out).
"""

from __future__ import annotations

from gdnpass.ir import Tensor, fused_op
from gdnpass.kernels import limits
from gdnpass.patterns.elementwise_chain.record import reference as chain_reference
from gdnpass.patterns.elementwise_chain.record import watch
from gdnpass.patterns.elementwise_chain.scope import sides_fit
from gdnpass.patterns.mul_mat_add.record import programs as product_programs
from gdnpass.patterns.product_store import check_product, fits
from gdnpass.patterns.record import NAMES, REPLACED, FusedOp, need

OP = fused_op("MUL_MAT_CHAIN")
KERNEL = "gdnpass.kernels.triton_matvec.mul_mat_vec_chain"


def _check(n: Tensor) -> None:
    steps, sides = n.op_params["steps"], n.src[2:]
    need(not n.outs, n, "writes only its own memory (the chain's)")
    need(sides_fit(steps, len(sides), least=1), n,
         f"steps {steps} with {len(sides)} side operands: outside the epilogue's scope")
    check_product(n, n, sides)


def _torch(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels import reference as ref

    w, x, *sides = views
    product = ref.mul_mat(w, x, node.src[0].type).reshape(out.shape)
    out.copy_(chain_reference(node.op_params["steps"], product, sides))


def _triton(node: Tensor, views: list, out) -> None:
    from gdnpass import prepasses
    from gdnpass.kernels import triton_matvec

    w, x, *sides = views
    as_product = (*x.shape[:3], w.shape[2])  # (ne3, ne2, ne1, M): the kernel's view of the output and the sides
    triton_matvec.mul_mat_vec_chain(w, x, node.op_params["steps"], [b.view(as_product) for b in sides],
                                    out.view(as_product), node.src[0].type,
                                    prepasses.producing_now())  # (a hand-off: the plan's, gdnpass.prepasses)


RECORD = FusedOp(
    op=OP,
    src=("w", "x", "b1", "b2"),
    optional_src=2,  # a side operand per binary step: none, one or two
    outs="nothing: the node is a view of the chain's last node's output",
    params={"steps": NAMES, "replaced": REPLACED},
    check=_check,
    launches=lambda n: limits.mul_mat_launches(n.src[0], n.src[1]),
    torch=_torch,
    triton=_triton,
    scope=fits,  # (the steps: the chain's own scope held them)
    doc="a MUL_MAT and the elementwise chain of its product, in one mat-vec or GEMM launch",
    programs=product_programs,
    interpreter_s={},  # the mat-vec's own ("mat_vec": gdnpass.cli.INTERPRETER_S)
    watch=watch,  # (what it writes: a chain's last node, as ELEMENTWISE_CHAIN; the product it never writes)
    variant=lambda n: " -> ".join(n.op_params["steps"]),
)
