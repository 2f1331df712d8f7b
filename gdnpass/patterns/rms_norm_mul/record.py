"""RMS_NORM_MUL's record: what the fused node carries and writes, its launches, adapters, scope and cost.

The node reads ``(x, w)`` or ``(x, w, addend)`` and writes the last replaced node's memory (the MUL's, or the ADD's
when the ADD joins); op_params: ``eps`` (the RMS_NORM's), ``norm_first`` (the norm is the MUL's src0),
``add_first`` (the addend is the ADD's src0; only with an addend) and ``replaced``. The kernel is
:func:`gdnpass.patterns.rms_norm_mul.kernel.rms_norm_mul`, in this folder: it shares only the exactness core's
helpers. Pure Python: the adapters and :func:`programs` import torch and Triton when called.
"""

from __future__ import annotations

from gdnpass.ir import DType, Op, Tensor, fused_op
from gdnpass.opspec.shapes import can_repeat
from gdnpass.patterns.record import BOOL, NONNEG, REPLACED, FusedOp, Param, need
from gdnpass.patterns.rms_norm_mul.scope import row_fits

OP = fused_op("RMS_NORM_MUL")
KERNEL = "gdnpass.patterns.rms_norm_mul.kernel.rms_norm_mul"

def _check(n: Tensor) -> None:
    x, w, *rest = n.src
    need(not n.outs, n, "writes only its own memory (the last replaced node's)")
    need(all(t.type is DType.F32 for t in (n, *n.src)), n, "every operand must be f32")
    need(n.ne == x.ne and row_fits(x.ne[0]), n, f"output {n.ne} of rows {x.ne} outside the kernel's scope")
    need(w.ne == x.ne if not n.op_params["norm_first"] else can_repeat(w, x), n,
         f"the weight {w.ne} does not repeat into {x.ne}")
    need(("add_first" in n.op_params) == bool(rest), n, "'add_first' goes with an addend, and only with one")
    if rest:
        need(rest[0].ne == x.ne if n.op_params["add_first"] else can_repeat(rest[0], x), n,
             f"the addend {rest[0].ne} does not repeat into {x.ne}")
    for t in (x, w, *rest):
        need(t.nb[0] == 4, n, f"{t.name!r} must have contiguous rows")


def _views(node: Tensor, views: list):
    x, w, *rest = views
    p = node.op_params
    return x, w, p["eps"], (rest[0] if rest else None), p["norm_first"], p.get("add_first", False)


def _torch(node: Tensor, views: list, out) -> None:
    import gdnpass.patterns.rms_norm_mul.kernel as kernel

    x, w, eps, addend, norm_first, add_first = _views(node, views)
    out.copy_(kernel.reference(x, w, eps, addend, norm_first, add_first))


def _triton(node: Tensor, views: list, out) -> None:
    """The kernel; writing the output quantized too where the executor's pre-pass plan asks it to
    (gdnpass.prepasses)."""
    import gdnpass.patterns.rms_norm_mul.kernel as kernel
    from gdnpass import prepasses

    x, w, eps, addend, norm_first, add_first = _views(node, views)
    kernel.rms_norm_mul(x, w, eps, out, addend, norm_first, add_first, quantize=prepasses.producing_now())


def programs(node: Tensor) -> list[tuple[str, int, int]]:
    import gdnpass.patterns.rms_norm_mul.kernel as kernel

    return kernel.programs(node)


def watch(n: Tensor) -> bool:
    """What ``run --check`` compares: every MUL of an RMS_NORM, and every ADD of such a MUL (the fused node writes
    the last of them)."""
    def norm_mul(t: Tensor) -> bool:
        return t.op is Op.MUL and any(s is not None and s.op is Op.RMS_NORM for s in t.src)

    return norm_mul(n) or n.op is Op.ADD and any(s is not None and norm_mul(s) for s in n.src)


RECORD = FusedOp(
    op=OP,
    src=("x", "w", "addend"),
    optional_src=1,  # the addend: only with the ADD
    outs="nothing: the node is a view of the MUL's (or the ADD's) output",
    params={"eps": NONNEG, "norm_first": BOOL, "add_first": Param(BOOL.ok, BOOL.what, optional=True),
            "replaced": REPLACED},
    check=_check,
    launches=lambda n: 1,
    torch=_torch,
    triton=_triton,
    scope=row_fits,
    doc="RMS_NORM, MUL by a weight (and ADD), in one launch: ggml-cuda's rms_norm fusion",
    programs=programs,
    interpreter_s={"rms_norm_mul": (0.032, 0.0)},  # RMS_NORM's figure: the same tile, one more load
    watch=watch,
)
