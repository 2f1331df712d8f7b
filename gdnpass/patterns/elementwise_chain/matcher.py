"""Consecutive elementwise nodes, each reading the one before, fused into one ELEMENTWISE_CHAIN node.

    y1 = ADD(x, b1); y2 = SOFTPLUS(y1); y3 = MUL(y2, b2)      ->      ELEMENTWISE_CHAIN(x, b1, b2) writes y3

A chain is a run of consecutive ADD, MUL and UNARY nodes in which each reads the node before it (a binary node as
its src0 or its src1, the other source being a side operand the fused kernel loads); it starts at a node the one
before does not feed and takes up to MAX_STEPS nodes. Qwen3.5 has two per GDN layer: the gate
``MUL(SOFTPLUS(ADD(alpha, dt_bias)), ssm_a)`` and the output gate ``MUL(norm, SILU(z))``. The patterns that absorb
an ADD or a MUL of their own (RMS_NORM_MUL, MUL_MAT_ADD) run first. The node runs at the chain's first node and
writes the last one's memory; the nodes before the last are never written.

Legality rules, in the order they run (the bracketed name is what a refusal reports; structural 1-5, hazards 6-7):
 1. [elt-chain.views] no node of the chain is a view (an in-place op): the fused node is a view of the last node's
    own memory.
 2. [elt-chain.type] the chain's input, its nodes and their side operands are f32 (the kernels' scope).
 3. [elt-chain.shape] every node has the chain input's shape (the chain's value is never broadcast) and each side
    operand repeats into it as ggml broadcasts src1, or has its shape where it is the node's src0.
 4. [scope.chain-length] the UNARY kinds are ones the kernel computes and at most MAX_SIDES nodes are binary (the
    record's scope).
 5. [elt-chain.user-count] each node but the last is read by the next alone and is not OUTPUT
    (``patterns.common.confined``).
 6. [elt-chain.output-overlaps-input] the output overlaps the chain's input or a side operand only element for
    element: a program writes its elements only after reading them, so any other overlap lets one program overwrite
    elements another has yet to read.
 7. [elt-chain.interior-read-later] no later node reads the bytes of a node before the last before a node writes
    them again: the fused node never writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdnpass.ir import DType, Graph, Op, Tensor
from gdnpass.opspec.shapes import can_repeat
from gdnpass.patterns.common import (HAZARD, Capture, Context, Match, Why, collision, confined, first_collision,
                                     read_before_written, rule, same_elements)
from gdnpass.patterns.elementwise_chain.record import ELEMENTWISE, RECORD, feeds
from gdnpass.patterns.elementwise_chain.scope import MAX_SIDES, MAX_STEPS, UNARY

NAME = "elementwise_chain"


def _chain_from(nodes: list[Tensor], at: int) -> list[Tensor]:
    """The run of consecutive elementwise nodes from index ``at``, each fed by the one before, up to MAX_STEPS."""
    run = [nodes[at]]
    while len(run) < MAX_STEPS and at + len(run) < len(nodes):
        nxt = nodes[at + len(run)]
        if nxt.op not in ELEMENTWISE or not feeds(run[-1], nxt):
            break
        run.append(nxt)
    return run


@dataclass
class ChainCapture(Capture):
    nodes: list[Tensor]  # the chain, in graph order

    ROLES = (("elt-chain", ("fed",)),)

    # ---- what the rewrite does (patterns.common.Capture) -----------------------------------------------------------
    @property
    def anchor(self) -> Tensor:
        return self.nodes[0]

    def removed(self) -> list[Tensor]:
        return list(self.nodes)

    def written(self) -> list[Tensor]:
        """The last node's output: the fused node's only one."""
        return [self.nodes[-1]]

    def span(self, ctx: Context) -> tuple[int, int, int]:
        """First node .. last node, consecutive; the fused node runs at the first."""
        return ctx.pos[self.nodes[0].uid], ctx.pos[self.nodes[0].uid], ctx.pos[self.nodes[-1].uid]

    # ---- the operands ----------------------------------------------------------------------------------------------
    @property
    def fed(self) -> list[Tensor]:
        """The nodes before the last: each feeds the next."""
        return self.nodes[:-1]

    @property
    def x(self) -> Tensor:
        """The chain's input: the first node's chain value (src0; a first binary node's src1 is a side operand)."""
        return self.nodes[0].src[0]

    def steps(self) -> list[tuple[str, Tensor | None]]:
        """(step name, its side operand or None) of every node: ADD / MUL (value is src0), RADD / RMUL (value is
        src1), or the UNARY kind."""
        out, value = [], self.x
        for n in self.nodes:
            if n.op is Op.UNARY:
                out.append((n.op_params["kind"], None))
            elif n.src[0] is value:
                out.append((n.op.value, n.src[1]))
            else:
                out.append(("R" + n.op.value, n.src[0]))
            value = n
        return out

    @property
    def sides(self) -> list[Tensor]:
        return [b for _, b in self.steps() if b is not None]


@rule("elt-chain.views")
def _views(c: ChainCapture, ctx):
    for t in c.nodes:
        if t.view_src is not None:
            return Why(t, f"{t.name!r} is a view of {t.view_src.name!r} (an in-place op)")


@rule("elt-chain.type")
def _type(c: ChainCapture, ctx):
    for t in (c.x, *c.nodes, *c.sides):
        if t.type is not DType.F32:
            return Why(t, f"{t.name!r} is {t.type.label}: the kernel is f32")


@rule("elt-chain.shape")
def _shape(c: ChainCapture, ctx):
    for n, (step, b) in zip(c.nodes, c.steps()):
        if n.ne != c.x.ne:
            return Why(n, f"{n.name!r} {n.ne}: not the chain input's shape {c.x.ne}")
        if b is not None and not (b.ne == c.x.ne if step.startswith("R") else can_repeat(b, c.x)):
            return Why(n, f"{n.name!r}: its operand {b.name!r} {b.ne} does not "
                          f"{'have' if step.startswith('R') else 'repeat into'} the shape {c.x.ne}")


@rule("scope.chain-length")
def _scope(c: ChainCapture, ctx):
    steps = [s for s, _ in c.steps()]
    odd = next((n for n, s in zip(c.nodes, steps) if n.op is Op.UNARY and s not in UNARY), None)
    if odd is not None:
        return Why(odd, f"UNARY {odd.op_params['kind']}: the kernel computes {', '.join(UNARY)}")
    if len(c.sides) > MAX_SIDES:
        return Why(c.nodes[-1], f"{len(c.sides)} binary nodes: the kernel reads at most {MAX_SIDES} side operands")


@rule("elt-chain.output-overlaps-input", HAZARD)
def _output_overlaps_input(c: ChainCapture, ctx):
    last = c.nodes[-1]
    hit = first_collision(ctx.ranges([last]), ctx.ranges([c.x, *c.sides]))
    if hit and not same_elements(last, hit[3]):
        return collision(last, f"{last.name!r} overlaps {hit[3].name!r}, not element for element", hit)


@rule("elt-chain.interior-read-later", HAZARD)
def _interior_read_later(c: ChainCapture, ctx):
    return read_before_written(ctx, ctx.ranges(c.interior()), ctx.pos[c.nodes[-1].uid], ctx.ranges(c.written()))


RULES = (_views, _type, _shape, _scope, confined(ChainCapture), _output_overlaps_input, _interior_read_later)
STEP_RULES = (_shape, _scope)  # what a lone node's step must satisfy as well (gdn_gates' scope.gate-steps)


class ElementwiseChain:
    name = NAME

    def rules(self, ctx: Context) -> tuple:
        return RULES

    def candidates(self, graph: Graph) -> list[Tensor]:
        """The first node of every chain of two or more: an elementwise node that the node before it does not feed
        and that feeds the node after it."""
        nodes = graph.nodes
        return [n for i, n in enumerate(nodes) if n.op in ELEMENTWISE
                and not (i > 0 and nodes[i - 1].op in ELEMENTWISE and feeds(nodes[i - 1], n))
                and len(_chain_from(nodes, i)) >= 2]

    def capture(self, graph: Graph, first: Tensor, ctx: Context) -> ChainCapture:
        return ChainCapture(_chain_from(graph.nodes, ctx.pos[first.uid]))

    def plan(self, c: ChainCapture, ctx: Context) -> None:
        return None  # one variant

    def rewrite(self, graph: Graph, m: Match) -> Tensor:
        """The fused node for ``m`` (the pass puts it in place of ``m.removed``)."""
        c = m.capture
        (primary,) = c.written()
        return Tensor(name=f"elementwise_chain({primary.name})", type=DType.F32, ne=primary.ne, nb=primary.nb,
                      op=RECORD.op, op_params={"steps": [s for s, _ in c.steps()],
                                               "replaced": [t.name for t in c.removed()]},
                      src=[c.x, *c.sides], view_src=primary, view_offs=0, layer=m.layer)
