"""A GATED_DELTA_NET_CACHE node's decay and beta computed in its own kernel, from the inputs of the elementwise nodes
that made them: those nodes launch no kernel.

    g = ELEMENTWISE_CHAIN(alpha, dt_bias, ssm_a)        [ADD -> SOFTPLUS -> MUL]
    b = SIGMOID(beta_raw)                               ->   GATED_DELTA_NET_CACHE(q, k, v, alpha, beta_raw, s,
    GATED_DELTA_NET_CACHE(q, k, v, reshape(g), b, s)         dt_bias, ssm_a; g_steps, beta_steps)

Qwen3.5's GDN layer makes its decay ``ssm_a * softplus(alpha + dt_bias)`` and its beta ``sigmoid(beta)`` from the
alpha/beta mat-vec pair, two launches of a few hundred elements each (2 of a GDN layer's 16). The GDN kernel reads
each of those elements anyway: it now reads the pair's outputs there and runs the elementwise node's very steps on
them (``triton_core.chain_at``, ELEMENTWISE_CHAIN's own code), so its gates are the same f32 values. The
fused node runs at the GDN's place; the elementwise nodes' outputs are never written. It takes a GATED_DELTA_NET_CACHE
(gdn_state_cache's node, whose op carries the steps): a GDN the cache fusion refused keeps its gates' launches.

Legality rules, in the order they run (the bracketed name is what a refusal reports; structural 1-4, hazards 5-7):
 1. [gdn-gates.type] the elementwise node's input, output and side operands are f32 (the kernels').
 2. [gdn-gates.layout] the operand is a packed reshape of all of the elementwise node's packed output (through
    RESHAPE / VIEW nodes), so an element's flat index is the same in both, and the node's input lies in the
    operand's shape or in it without its leading 1 (``limits.gate_input_flat``: the kernel indexes it by the
    operand's row, head, token and sequence, never by a flat index): it computes the node's element there.
 3. [scope.gate-steps] a lone elementwise node is a step ELEMENTWISE_CHAIN's shape and scope rules take
    (elementwise_chain's ``STEP_RULES``): an ADD or MUL whose src1 repeats into its src0 (the value), or a UNARY kind
    the kernel computes; with its value's shape.
 4. [gdn-gate.user-count] the elementwise node's output and the views between it and the operand are read by the
    GDN alone and are not OUTPUT (``patterns.common.confined``).
 5. [gdn-gates.between] no node between the elementwise node and the GDN writes its input or side operands (the
    fused node reads them at the GDN's place, later than the node did) or touches its output's bytes.
 6. [gdn-gates.output-overlaps-input] the GDN's scores and cache rows overlap none of the elementwise nodes' inputs
    and side operands: a program stores its results while others still read theirs.
 7. [gdn-gates.output-read-later] no node after the GDN reads the elementwise nodes' output bytes before a node
    writes them again: the fused node never writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gdnpass.ir import DType, Graph, Op, Tensor
from gdnpass.kernels.limits import gate_input_flat
from gdnpass.patterns.common import (HAZARD, Capture, Clause, Context, Match, Why, between, collision, confined,
                                     first_collision, read_before_written, rule)
from gdnpass.patterns.elementwise_chain.matcher import STEP_RULES, ChainCapture
from gdnpass.patterns.elementwise_chain.record import ELEMENTWISE, OP as CHAIN_OP
from gdnpass.patterns.gdn_state_cache.matcher import scores_range
from gdnpass.patterns.gdn_state_cache.record import OP as CACHE_OP
from gdnpass.patterns.gdn_state_cache.record import gate_steps, operands, rebuilt, rewritten

NAME = "gdn_gates"
VIEWS = (Op.RESHAPE, Op.VIEW)


@dataclass
class Gate:
    """One operand's elementwise producer: ``node`` (an ELEMENTWISE_CHAIN or a lone ADD / MUL / UNARY), the tensor
    it writes (``output``: the chain's last node, else the node itself) and the view nodes from it to the operand."""

    node: Tensor
    output: Tensor
    views: list[Tensor]

    @property
    def steps(self) -> list[str]:
        if self.node.op is CHAIN_OP:
            return list(self.node.op_params["steps"])
        return [s for s, _ in ChainCapture([self.node]).steps()]

    @property
    def x(self) -> Tensor:
        """The value it starts from (a lone binary node's src0, as ggml's binary ops: src1 repeats into it)."""
        return self.node.src[0]

    @property
    def sides(self) -> list[Tensor]:
        return list(self.node.src[1:]) if self.node.op is CHAIN_OP else list(self.node.src[1:2])

    @property
    def operand(self) -> Tensor:
        return self.views[-1] if self.views else self.output


@dataclass
class GatesCapture(Capture):
    gdn: Tensor                 # the GATED_DELTA_NET_CACHE node
    g: Gate | None
    beta: Gate | None
    interior_g: list[Tensor] = field(default_factory=list)
    interior_beta: list[Tensor] = field(default_factory=list)

    ROLES = (("gdn-gate", ("interior_g", "interior_beta")),)

    def __post_init__(self) -> None:
        for gate, into in ((self.g, self.interior_g), (self.beta, self.interior_beta)):
            if gate is not None:
                into += [gate.node, *gate.views] + ([gate.output] if gate.output is not gate.node else [])

    @property
    def gates(self) -> list[Gate]:
        return [x for x in (self.g, self.beta) if x is not None]

    # ---- what the rewrite does (patterns.common.Capture) -----------------------------------------------------------
    @property
    def anchor(self) -> Tensor:
        return self.gdn

    def removed(self) -> list[Tensor]:
        return [n for x in self.gates for n in (x.node, *x.views)] + [self.gdn]

    def written(self) -> list[Tensor]:
        return rewritten(self.gdn)

    def span(self, ctx: Context) -> tuple[int, int, int]:
        """The first elementwise node .. the GDN; the fused node runs at the GDN."""
        at = ctx.pos[self.gdn.uid]
        return min(ctx.pos[x.node.uid] for x in self.gates), at, at

    # ---- the operands ----------------------------------------------------------------------------------------------
    def reads(self) -> list[Tensor]:
        """What the fused node reads that the GDN did not: the elementwise nodes' inputs and side operands."""
        return [t for x in self.gates for t in (x.x, *x.sides)]

    def outputs(self) -> list[Tensor]:
        """The elementwise nodes' outputs: never written any more."""
        return [x.output for x in self.gates]


def _producer(graph: Graph, ctx: Context, operand: Tensor) -> Gate | None:
    """The elementwise node that wrote ``operand``, through view nodes; None if another kind of node did."""
    views, t = [], operand
    while t.op in VIEWS and t.view_src is not None and t.src and t.src[0] is not None:
        views.append(t)
        t = t.src[0]
    views.reverse()
    if t.op in ELEMENTWISE and t.uid in ctx.pos:
        return Gate(t, t, views)
    chain = next((n for n in graph.nodes if n.op is CHAIN_OP and n.view_src is t), None)
    return Gate(chain, t, views) if chain is not None else None


@rule("gdn-gates.type")
def _type(c: GatesCapture, ctx):
    for x in c.gates:
        for t in (x.x, x.output, *x.sides):
            if t.type is not DType.F32:
                return Why(t, f"{t.name!r} is {t.type.label}: the kernels compute the gates in f32")


@rule("gdn-gates.layout")
def _layout(c: GatesCapture, ctx):
    for x in c.gates:
        if not x.output.is_contiguous() or x.output.view_src is not None:
            return Why(x.output, f"{x.output.name!r} is not a packed tensor of its own: its flat index is not the "
                                 f"operand's")
        for v in x.views:
            if v.view_offs != 0 or not v.is_contiguous() or v.nelements != x.output.nelements:
                return Why(v, f"{v.name!r} is not a packed reshape of all of {x.output.name!r}: the kernel would "
                              f"compute other elements than it reads")
        if gate_input_flat(x.x.ne, x.operand.ne) is None:
            return Why(x.x, f"{x.x.name!r} ne {list(x.x.ne)}: the kernel reads it in the operand's shape "
                            f"{list(x.operand.ne)} or in it without its leading 1")


@rule("scope.gate-steps")
def _scope(c: GatesCapture, ctx):
    for x in c.gates:
        if x.node.op is not CHAIN_OP:  # (a chain's own rules held it so)
            for step_rule in STEP_RULES:
                why = step_rule.check(ChainCapture([x.node]), ctx)
                if why:
                    return why


_between = between(
    "gdn-gates.between",
    Clause("before", "w", lambda c: c.reads(), "{node} writes {hit}, which the fused node reads after it"),
    Clause("before", "rw", lambda c: c.outputs(), "{node} touches the bytes of {hit}, which the fused node never "
                                                  "writes"),
)


@rule("gdn-gates.output-overlaps-input", HAZARD)
def _output_overlaps_input(c: GatesCapture, ctx):
    scores = (scores_range(c.gdn.view_src), c.gdn.view_src)
    hit = first_collision(ctx.ranges(c.gdn.outs) + [scores], ctx.ranges(c.reads()))
    if hit:
        return collision(c.gdn, f"the GDN's results overlap {hit[3].name!r}, which it now reads", hit)


@rule("gdn-gates.output-read-later", HAZARD)
def _output_read_later(c: GatesCapture, ctx):
    return read_before_written(ctx, ctx.ranges(c.outputs()), ctx.pos[c.gdn.uid])


RULES = (_type, _layout, _scope, confined(GatesCapture), _between, _output_overlaps_input, _output_read_later)


class GdnGates:
    name = NAME

    def rules(self, ctx: Context) -> tuple:
        return RULES

    def candidates(self, graph: Graph) -> list[Tensor]:
        """Every GATED_DELTA_NET_CACHE node that still reads its gates."""
        return [n for n in graph.nodes if n.op is CACHE_OP and gate_steps(n) == ([], [])]

    def capture(self, graph: Graph, gdn: Tensor, ctx: Context) -> GatesCapture | None:
        """The GDN and the elementwise producers of its g and beta; None when neither has one."""
        g, beta = (_producer(graph, ctx, gdn.src[i]) for i in (3, 4))
        return GatesCapture(gdn, g, beta) if g or beta else None

    def plan(self, c: GatesCapture, ctx: Context) -> None:
        return None  # one variant

    def rewrite(self, graph: Graph, m: Match) -> Tensor:
        """The GDN node again, reading the elementwise nodes' inputs and computing its gates (the pass puts it in
        place of ``m.removed``)."""
        c = m.capture
        old = c.gdn
        six, ids, _, _ = operands(old, old.src)  # (no steps yet: no sides)
        params = dict(old.op_params)
        for i, (key, x) in enumerate((("g_steps", c.g), ("beta_steps", c.beta))):
            if x is not None:
                six[3 + i] = x.x
                params[key] = x.steps
        params["replaced"] = [*old.op_params.get("replaced", [old.name]),
                              *(n for x in c.gates for n in (*x.node.op_params.get("replaced", [x.node.name]),
                                                             *(v.name for v in x.views)))]
        return rebuilt(old, six, ids, c.g.sides if c.g else [], c.beta.sides if c.beta else [], params, m.layer)


__all__ = ["NAME", "Gate", "GatesCapture", "GdnGates"]
