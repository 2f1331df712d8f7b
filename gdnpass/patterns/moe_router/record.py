"""MOE_ROUTER's record: what the fused node carries and writes, its launches, adapters, scope and cost.

The node reads ``(logits,)`` and writes the DIV's memory (the normalised weights, its primary output) and, in
``outs``, the ARGSORT's (all of it: the top-k view and the MUL_MAT_IDs read its head). op_params: ``n_used``, the
CLAMP's ``min`` and ``max``, ``serial`` (one program walks the tiles: an output overlaps the logits), ``replaced``. The kernel is :func:`gdnpass.patterns.moe_router.kernel.moe_router`, in
this folder: it shares only the exactness core's helpers. Pure Python: the adapters and :func:`programs` import
torch and Triton when called.
"""

from __future__ import annotations

from gdnpass.ir import DType, Op, Tensor, fused_op
from gdnpass.patterns.moe_router.scope import router_fits
from gdnpass.opspec.vocab import BOUND  # (CLAMP's: ±inf written by name in a graph file)
from gdnpass.patterns.record import BOOL, INT, REPLACED, FusedOp, need

OP = fused_op("MOE_ROUTER")
KERNEL = "gdnpass.patterns.moe_router.kernel.moe_router"


def _check(n: Tensor) -> None:
    (x,) = n.src
    need(len(n.outs) == 1, n, "writes the ARGSORT's output besides its own (outs: exactly one)")
    (order,) = n.outs
    n_exp, n_t, n_used = x.ne[0], x.ne[1], n.op_params["n_used"]
    need(x.ne[2:] == (1, 1) and router_fits(n_exp, n_used), n,
         f"logits {x.ne}, {n_used} used: outside the kernel's scope (2-D, 2..1024 experts, 1..all used)")
    need(x.type is n.type is DType.F32 and order.type is DType.I32, n, "logits and weights f32, the order i32")
    need(order.ne == x.ne and n.ne == (n_used, n_t, 1, 1), n,
         f"the order {order.ne} must have the logits' shape {x.ne}, the weights {n.ne} be [{n_used}, {n_t}]")
    for t in (x, order, n):
        need(t.nb[0] == 4, n, f"{t.name!r} must have contiguous rows")


def _views(node: Tensor, views: list):
    x, order = views
    p = node.op_params
    return x, p["n_used"], p["min"], p["max"], order


def _torch(node: Tensor, views: list, out) -> None:
    import gdnpass.patterns.moe_router.kernel as kernel

    x, n_used, lo, hi, order = _views(node, views)
    o, w = kernel.reference(x, n_used, lo, hi)
    order.copy_(o)
    out.copy_(w)


def _triton(node: Tensor, views: list, out) -> None:
    import gdnpass.patterns.moe_router.kernel as kernel

    x, n_used, lo, hi, order = _views(node, views)
    kernel.moe_router(x, n_used, lo, hi, order, out, node.op_params["serial"])


def programs(node: Tensor) -> list[tuple[str, int, int]]:
    import gdnpass.patterns.moe_router.kernel as kernel

    return kernel.programs(node)


def watch(n: Tensor) -> bool:
    """What ``run --check`` compares: every ARGSORT, and every DIV by a CLAMP (the router's normalised weights)."""
    return n.op is Op.ARGSORT or n.op is Op.DIV and n.src[1] is not None and n.src[1].op is Op.CLAMP


RECORD = FusedOp(
    op=OP,
    src=("logits",),
    outs="the ARGSORT's output (the top-k view reads its head)",
    params={"n_used": INT, "serial": BOOL, "min": BOUND, "max": BOUND, "replaced": REPLACED},
    check=_check,
    launches=lambda n: 1,
    torch=_torch,
    triton=_triton,
    scope=router_fits,
    doc="the expert router: SOFT_MAX, DESC ARGSORT, GET_ROWS of the top k, SUM_ROWS, CLAMP, DIV in one launch",
    programs=programs,
    interpreter_s={"moe_router": (0.0, 0.06)},  # a tile: SOFT_MAX's and ARGSORT's in one step
    watch=watch,
)
