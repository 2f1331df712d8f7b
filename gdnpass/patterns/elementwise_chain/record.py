"""ELEMENTWISE_CHAIN's record: what the fused node carries and writes, its launches, adapters, scope and cost.

The node reads ``(x, b1[, b2])`` — the chain's input, then the binary steps' other operands in order — and writes
the last replaced node's memory; op_params: ``steps`` (one name a node: ``ADD`` / ``MUL`` with the chain's value as
src0, ``RADD`` / ``RMUL`` with it as src1, or a UNARY kind, :mod:`.scope`) and ``replaced``. The kernel is
:func:`gdnpass.kernels.triton_elementwise.elementwise_chain`: it is the elementwise family's ops in one pass, so it
lives with them. Pure Python: the adapters and :func:`programs` import torch and Triton when called.
"""

from __future__ import annotations

from gdnpass.ir import DType, Op, Tensor, fused_op
from gdnpass.opspec.shapes import can_repeat
from gdnpass.patterns.elementwise_chain.scope import BINARY, sides_fit, steps_fit
from gdnpass.patterns.record import NAMES, REPLACED, FusedOp, need

OP = fused_op("ELEMENTWISE_CHAIN")
KERNEL = "gdnpass.kernels.triton_elementwise.elementwise_chain"


def _check(n: Tensor) -> None:
    x, *sides = n.src
    steps = n.op_params["steps"]
    need(not n.outs, n, "writes only its own memory (the last replaced node's)")
    need(sides_fit(steps, len(sides)), n,
         f"steps {steps} with {len(sides)} side operands: outside the kernel's scope")
    need(all(t.type is DType.F32 for t in (n, *n.src)), n, "every operand must be f32")
    need(n.ne == x.ne, n, f"output {n.ne} is not the chain input's shape {x.ne}")
    binary = [s for s in steps if s in BINARY]
    for s, b in zip(binary, sides):
        need(b.ne == x.ne if s.startswith("R") else can_repeat(b, x), n,
             f"side operand {b.name!r} {b.ne} does not {'have' if s.startswith('R') else 'repeat into'} {x.ne}")


def reference(steps: list[str], x, sides: list):
    """The unfused ops' torch references, step by step in the graph's operand order."""
    from gdnpass.kernels import reference as ref

    it, v = iter(sides), x
    for s in steps:
        if s in BINARY:
            b = next(it)
            fn = ref.add if BINARY[s] == "ADD" else ref.mul
            v = fn(b, v) if s.startswith("R") else fn(v, b)
        else:
            v = ref.UNARY[s](v)
    return v


def _torch(node: Tensor, views: list, out) -> None:
    x, *sides = views
    out.copy_(reference(node.op_params["steps"], x, sides))


def _triton(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels.triton_elementwise import elementwise_chain

    x, *sides = views
    elementwise_chain(node.op_params["steps"], x, sides, out)


def programs(node: Tensor) -> list[tuple[str, int, int]]:
    """One program per ELT_BLOCK elements, one step each (the elementwise kernels'). Pure: reads shapes only."""
    import triton

    from gdnpass.kernels.triton_elementwise import ELT_BLOCK

    return [("elementwise_chain", triton.cdiv(node.nelements, ELT_BLOCK), 1)]


ELEMENTWISE = (Op.ADD, Op.MUL, Op.UNARY)


def feeds(p: Tensor, e: Tensor) -> bool:
    """Whether ``e`` reads ``p`` as a chain's value: UNARY's source, or exactly one source of ADD / MUL."""
    if e.op is Op.UNARY:
        return e.src[0] is p
    return e.op in (Op.ADD, Op.MUL) and (e.src[0] is p) != (e.src[1] is p)


def watch(n: Tensor) -> bool:
    """What ``run --check`` compares: every elementwise node fed by an elementwise node, the nodes a chain can end
    with (the fused node writes the last of a chain; its interior is left out of the comparison)."""
    return n.op in ELEMENTWISE and any(s is not None and s.op in ELEMENTWISE and feeds(s, n) for s in n.src[:2])


RECORD = FusedOp(
    op=OP,
    src=("x", "b1", "b2"),
    optional_src=2,  # a side operand per binary step: none, one or two
    outs="nothing: the node is a view of the chain's last node's output",
    params={"steps": NAMES, "replaced": REPLACED},
    check=_check,
    launches=lambda n: 1,
    torch=_torch,
    triton=_triton,
    scope=steps_fit,
    doc="consecutive ADD / MUL / UNARY nodes, each reading the one before, in one elementwise launch",
    programs=programs,
    interpreter_s={"elementwise_chain": (0.026, 0.0)},  # the elementwise kernels' figure (gdnpass.cli.INTERPRETER_S)
    watch=watch,
    variant=lambda n: " -> ".join(n.op_params["steps"]),
)
