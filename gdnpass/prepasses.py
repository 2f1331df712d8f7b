"""Shared pre-passes: a quantized product that reads the int8 activations an earlier product's pre-pass left.

A product of quantized weights first quantizes its activation columns (a launch of its own, the *pre-pass*) into
its device's activation workspace, then the mat-vec reads them there (:mod:`gdnpass.kernels.triton_matvec`, as
llama.cpp's ``quantize_q8_1`` before ``mul_mat_vec_q``). Several products often quantize one activation: a GDN
layer's qkv, z and alpha/beta products all take the attention norm's output, an attention layer's q, k and v too.
Every pre-pass after the first of such a run writes the bytes the workspace holds already. :func:`plan` finds
those on the planned graph; the executor runs each such product with its pre-pass skipped (:func:`skipping`), and
:func:`gdnpass.runtime.launches` does not count it. Exact by construction: the same f32 bytes quantized by the same
rule are the same int8 bytes.

A product P reads the workspace as the pre-pass of the product Q before it left it when:

1. [one-pre-pass] P and Q each quantize their whole activation in one pre-pass, for the quantized mat-vec: a
   MUL_MAT, MUL_MAT_VEC_PAIR or MUL_MAT_ADD of a quantized weight over 1..32 columns, or a quantized MUL_MAT_ID
   on the kernel (its b one row a token, or one a slot).
2. [same-activation] P's activation is Q's bytes in Q's layout: one buffer, offset, ne and nb (a reshape that
   changes ne does not count: the columns' order could differ).
3. [same-form] the same int8 form: the K-quants' q8_K blocks (Q4_K, Q5_K, Q6_K) or Q8_0's q8_1 groups. (A
   MUL_MAT_ID's columns, slot by token, are its b's ne1 x ne2, as a MUL_MAT's: one layout, one order.)
4. [last-pre-pass] no node between them fills the workspace (it is one buffer a device): no other pre-pass, no
   GEMM's bf16 terms; a product that skips its own pre-pass fills nothing.
5. [unwritten] no node from Q (its own store included) up to P writes a byte of the activation, on the memory plan.

The rules are checked on byte ranges of the plan, as the fusion matchers' are. The kernels check rules 2-4 again at
run time (the workspace records what it holds: :func:`gdnpass.kernels.triton_core.activation_workspace`), so a plan
that went wrong is a one-line error, never stale activations.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

from gdnpass.ir import Graph, Op, Tensor, byte_range, ranges_overlap, runs_kernel, written
from gdnpass.kernels import limits

PRODUCTS = ("MUL_MAT", "MUL_MAT_VEC_PAIR", "MUL_MAT_ADD")  # their sources: the weight, the activation, ...
RULES = ("one-pre-pass", "same-activation", "same-form", "last-pre-pass", "unwritten")


@dataclass(frozen=True)
class Activation:
    """What one pre-pass writes into the workspace: ``bytes`` (buffer, lo, hi) of the activation, laid out as
    ``layout`` (ne, nb), quantized to ``form`` ("q8_K" or "q8_1")."""

    bytes: tuple[str, int, int]
    layout: tuple
    form: str


@dataclass(frozen=True)
class Refusal:
    """A product whose activation an earlier pre-pass quantized, unwritten since, that runs its own pre-pass all the
    same: ``rule`` (2-4's) says why."""

    node: Tensor
    rule: str
    reason: str

    def describe(self) -> str:
        return f"pre-pass of {self.node.name!r} not shared ({self.rule}): {self.reason}"


@dataclass
class Plan:
    """``shared``: product uid -> the product whose pre-pass it reads; ``refused``: the products that quantize
    again an activation an earlier pre-pass quantized (its bytes unwritten since: rule 5 makes a new activation of
    them, not a refusal), and why; ``pre_passes``: the pre-passes that still run."""

    shared: dict[int, Tensor]
    refused: list[Refusal]
    pre_passes: int

    def summary(self) -> str:
        return f"{len(self.shared)} of {len(self.shared) + self.pre_passes} activation pre-passes shared"


def form(w: Tensor) -> str:
    """The int8 form a product of quantized weight ``w`` quantizes its activations to (triton_matvec)."""
    return "q8_1" if w.type.label == "q8_0" else "q8_K"


def activation(n: Tensor) -> Activation | None:
    """Rule 1: what node ``n``'s one pre-pass writes (None: it quantizes no whole activation in one pre-pass)."""
    if not runs_kernel(n) or len(n.src) < 2:
        return None
    w, x = n.src[0], n.src[1]
    if not w.type.is_quantized or x.base.buffer is None or x.base.offset is None:
        return None
    if n.op is Op.MUL_MAT_ID:
        ids = n.src[2]
        if x.ne[1] not in (1, ids.ne[0]):  # (the torch reference runs those: no pre-pass)
            return None
    elif n.op.value in PRODUCTS:
        path = limits.mul_mat_path(w.type, w.ne[2] * w.ne[3], w.ne[1], x.ne)
        cols = limits.mat_vec_columns(w.ne[2] * w.ne[3], x.ne)
        if path not in ("mat_vec", "chunks") or limits.mat_vec_chunks(cols) != 1:
            return None
    else:
        return None
    return Activation(byte_range(x), (x.ne, x.nb), form(w))


def fills_workspace(n: Tensor) -> bool:
    """Whether node ``n``'s launches write the activation workspace (a product's pre-pass of its activations:
    limits.pre_pass; conservatively every quantized MUL_MAT_ID)."""
    if not runs_kernel(n) or len(n.src) < 2:
        return False
    w, x = n.src[0], n.src[1]
    if n.op is Op.MUL_MAT_ID:
        return w.type.is_quantized
    if n.op.value not in PRODUCTS:
        return False
    return limits.pre_pass(w.type, limits.mul_mat_path(w.type, w.ne[2] * w.ne[3], w.ne[1], x.ne))


def plan(graph: Graph) -> Plan:
    """Which products of ``graph`` (planned) skip their pre-pass, walking the nodes in order with what the workspace
    holds: rule 4 is that state, rule 5 clears it when a node writes the activation's bytes."""
    shared: dict[int, Tensor] = {}
    refused: list[Refusal] = []
    pre_passes = 0
    holds: tuple[Activation, Tensor] | None = None  # the workspace's activation and the product that filled it
    live: dict[tuple, tuple[Activation, Tensor]] = {}  # activation bytes -> their last pre-pass, bytes unchanged
    for n in graph.nodes:
        if not runs_kernel(n):
            continue
        act = activation(n)
        if act is not None and holds is not None and holds[0] == act:
            shared[n.uid] = holds[1]
        elif act is not None and act.bytes in live:
            refused.append(Refusal(n, *_why_not(act, *live[act.bytes])))
        if n.uid not in shared and fills_workspace(n):
            pre_passes += 1
            holds = (act, n) if act is not None else None
            if act is not None:
                live[act.bytes] = (act, n)
        outs = [byte_range(t) for t in written(n) if t.base.buffer is not None and t.base.offset is not None]
        if holds is not None and any(ranges_overlap(o, holds[0].bytes) for o in outs):
            holds = None
        for key in [k for k in live if any(ranges_overlap(o, k) for o in outs)]:
            del live[key]  # (rule 5: what a product reads there from now on is another activation)
    return Plan(shared, refused, pre_passes)


def _why_not(act: Activation, prev: Activation, q: Tensor) -> tuple[str, str]:
    """The rule that keeps ``act`` from the workspace that product ``q``'s pre-pass of the same bytes, ``prev``,
    filled (its bytes unchanged since)."""
    if prev.layout != act.layout:
        return "same-activation", f"ne {act.layout[0]} here, {prev.layout[0]} at {q.name!r}"
    if prev.form != act.form:
        return "same-form", f"{act.form} here, {prev.form} at {q.name!r}"
    return "last-pre-pass", f"another pre-pass filled the workspace after {q.name!r}'s"


# ---- what the executor tells the kernels -------------------------------------------------------------------------

_SKIPPING: contextvars.ContextVar[bool] = contextvars.ContextVar("gdnpass_pre_pass_skipped", default=False)


@contextlib.contextmanager
def skipping():
    """Within: the product being launched reads the activations its pre-pass would write from the workspace, as an
    earlier product's pre-pass left them (the executor's, for the products of :func:`plan`'s ``shared``)."""
    token = _SKIPPING.set(True)
    try:
        yield
    finally:
        _SKIPPING.reset(token)


def skipped() -> bool:
    """Whether the product being launched skips its pre-pass (:func:`skipping`)."""
    return _SKIPPING.get()
