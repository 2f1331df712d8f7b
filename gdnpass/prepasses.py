"""Shared pre-passes: quantized products that read int8 activations already in the workspace.

A product of quantized weights first quantizes its activation columns (a launch of its own, the *pre-pass*) into
its device's activation workspace, then the mat-vec reads them there (:mod:`gdnpass.kernels.triton_matvec`, as
llama.cpp's ``quantize_q8_1`` before ``mul_mat_vec_q``). Several products often quantize one activation: a GDN
layer's qkv and z products both take the attention norm's output, an attention layer's q, k and v too; and that
activation is most often an RMS_NORM_MUL's or a SwiGLU's output, whose kernels can write it quantized themselves.
:func:`plan` finds both on the planned graph: the executor runs such a product with its pre-pass skipped
(:func:`skipping`) and such a producer writing the quantized activation in its reader's form (:func:`producing`);
:func:`gdnpass.launches.launches` counts what runs. Exact by construction: the same f32 values quantized by the same
code (``triton_core.store_activations``) are the same int8 bytes.

A product P reads the workspace as the node F before it filled it (F: an earlier product's pre-pass, or a
producer's blocks) when:

1. [one-pre-pass] P quantizes its whole activation in one pre-pass, for the quantized mat-vec: a MUL_MAT of a
   quantized weight over 1..32 columns (a MUL_MAT_VEC_PAIR, MUL_MAT_ADD or MUL_MAT_CHAIN: the mat-vec's 1..16), or
   a quantized MUL_MAT_ID on the kernel (its b one row a token, or one a slot); F is such a product, or a producer: an
   RMS_NORM_MUL whose rows the kernel quantizes (rms_norm_mul.scope.quantizes_rows: whole blocks of 256) and whose
   output overlaps no byte of its x (the quantizing kernel's programs each read a whole row of x, and store one
   block), a SWIGLU GLU of rows of whole blocks of 256, or a MUL_MAT_VEC_PAIR with SwiGLU's epilogue (pair_glu) or
   a MUL_MAT_CHAIN whose tile hands its output on as q8_1 (``kernels.tiles.hands_on_q8_1``: whole groups of 32 rows
   a row block; the *hand-off*), unless it reads its own activations from a hand-off.
2. [same-activation] P's activation is F's bytes in F's layout: one buffer, offset, ne and nb (a reshape that
   changes ne does not count: the columns' order could differ); a producer's are its output's.
3. [same-form] the same int8 form: the K-quants' q8_K blocks (Q4_K, Q5_K, Q6_K) or Q8_0's q8_1 groups; a producer
   writes the form of P, its first reader (a hand-off: q8_1 only, a Q8_0 P). (A MUL_MAT_ID's columns, slot by
   token, are its b's ne1 x ne2, as a MUL_MAT's: one order.)
4. [last-pre-pass] no node between them fills the workspace: no other pre-pass, no GEMM's bf16 terms; a product
   that skips its own pre-pass fills nothing. A producer fills it only for P, the first product after it that
   quantizes its output, and only when no product between them reads the workspace. (The workspace is one buffer
   a device, and a second for the hand-off, whose product reads the first while its epilogue writes: a fill of
   the first forgets the second, so the one rule covers both.)
5. [unwritten] no node from F (a product's own store included) up to P writes a byte of the activation, on the
   memory plan (a producer's own store is the activation).

The rules are checked on byte ranges of the plan, as the fusion matchers' are. At run time the kernels check rules
2-4 again: the workspace records the key of what filled it last (which view, quantized to which form:
:func:`gdnpass.kernels.triton_core.activation_workspace`), and a product that skips its pre-pass finds that key or
stops with a one-line error. Rule 5, the activation's bytes unwritten since, the plan alone checks: the key names a
view, not its contents.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace

from gdnpass.ir import (DType, Graph, Op, Tensor, byte_range, contiguous_strides, ranges_overlap, runs_kernel,
                         written)
from gdnpass.kernels import limits
from gdnpass.kernels.tiles import hands_on_q8_1, mat_vec_tile
from gdnpass.patterns.rms_norm_mul.scope import quantizes_rows

# the products: their sources the weight, the activation, ...
PRODUCTS = ("MUL_MAT", "MUL_MAT_VEC_PAIR", "MUL_MAT_ADD", "MUL_MAT_CHAIN")
PRODUCERS = ("RMS_NORM_MUL", "GLU")  # write their output quantized where the plan asks
RULES = ("one-pre-pass", "same-activation", "same-form", "last-pre-pass", "unwritten")


@dataclass(frozen=True)
class Activation:
    """What one pre-pass writes into the workspace: ``bytes`` (buffer, lo, hi) of the activation, laid out as
    ``layout`` (ne, nb), quantized to ``form`` ("q8_K" or "q8_1"; a producer's offer: None, either)."""

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
    """``shared``: product uid -> the node whose workspace fill it reads (a product, or a producer); ``producing``:
    the uid of each producer that fills it -> the form it writes (its first reader's; a hand-off's: q8_1);
    ``refused``: the products that quantize again an activation an earlier pre-pass quantized (its bytes unwritten
    since: rule 5 makes a new activation of them, not a refusal), and why; ``pre_passes``: the quantized products'
    pre-passes that still run; ``handed_on``: the products that read a hand-off."""

    shared: dict[int, Tensor]
    producing: dict[int, str]
    refused: list[Refusal]
    pre_passes: int
    handed_on: frozenset[int] = frozenset()

    def summary(self) -> str:
        return (f"{len(self.shared)} of {len(self.shared) + self.pre_passes} activation pre-passes skipped "
                f"({len(self.producing)} made by their producers)")


def form(wtype: DType) -> str:
    """The int8 form a product of ``wtype`` weights quantizes its activations to (triton_matvec): Q8_0's q8_1 groups
    of 32, the K-quants' q8_K blocks of 256."""
    return "q8_1" if wtype is DType.Q8_0 else "q8_K"


def activation(n: Tensor) -> Activation | None:
    """Rule 1: what node ``n``'s one pre-pass writes (None: it quantizes no whole activation in one pre-pass)."""
    if not runs_kernel(n) or len(n.src) < 2:
        return None
    w, x = n.src[0], n.src[1]
    if not w.type.is_quantized or not _planned(x):
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
    return Activation(byte_range(x), (x.ne, x.nb), form(w.type))


def producer_blocks(n: Tensor) -> Activation | None:
    """Rule 1's producer: node ``n``'s output, which its kernel can write quantized in either form, blocks of 256 at
    a time, or hand on in q8_1 (:func:`hand_off`; None: not such a node, or not planned in memory)."""
    if n.op in (Op.MUL_MAT_VEC_PAIR, Op.MUL_MAT_CHAIN):
        return hand_off(n)
    if n.op.value not in PRODUCERS or not runs_kernel(n) or n.nb[0] != 4 or n.type is not DType.F32 \
            or not _planned(n) or not _planned(n.src[0]):
        return None
    out = byte_range(n)
    if n.op is Op.GLU:
        ok = n.op_params.get("kind") == "SWIGLU" and n.ne[0] % DType.Q4_K.block == 0
    else:
        ok = quantizes_rows(n.ne[0]) and not ranges_overlap(out, byte_range(n.src[0]))
    return Activation(out, (n.ne, n.nb), None) if ok else None


def hand_off(n: Tensor) -> Activation | None:
    """Rule 1's hand-off: the output of node ``n``, a MUL_MAT_VEC_PAIR with SwiGLU's epilogue or a MUL_MAT_CHAIN on
    the mat-vec, whose tile hands it on as q8_1 activations (triton_matvec._hand_on), f32 with contiguous rows; laid
    out as the product (M rows, its columns), which a chain's node may view otherwise (the z chain's heads: [128, 32,
    T], its product [4096, T]: a contiguous chain's bytes are the product's). None: not such a node."""
    pair = n.op is Op.MUL_MAT_VEC_PAIR and bool(n.op_params.get("glu"))
    if not (pair or n.op is Op.MUL_MAT_CHAIN) or not runs_kernel(n) or n.type is not DType.F32 or not _planned(n):
        return None
    w, x = n.src[0], n.src[1]
    cols = limits.mat_vec_columns(w.ne[2] * w.ne[3], x.ne)
    if not limits.runs_as_mat_vec(w.ne[1], cols):
        return None
    if not hands_on_q8_1(mat_vec_tile(w.ne[1], cols, w.ne[0], w.type.label, products=2 if pair else 1)):
        return None
    if pair:
        return Activation(byte_range(n), (n.ne, n.nb), "q8_1") if n.nb[0] == 4 else None
    ne = (w.ne[1], *x.ne[1:])
    if n.nb != contiguous_strides(DType.F32, n.ne):
        return None
    return Activation(byte_range(n), (ne, contiguous_strides(DType.F32, ne)), "q8_1")


def _planned(t: Tensor) -> bool:
    return t.base.buffer is not None and t.base.offset is not None


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
    """Which products of ``graph`` (planned) skip their pre-pass and which producers fill the workspace, walking the
    nodes in order with what the workspace holds: rule 4 is that state, rule 5 clears it when a node writes the
    activation's bytes."""
    shared: dict[int, Tensor] = {}
    producing: dict[int, str] = {}
    handed_on: set[int] = set()
    refused: list[Refusal] = []
    pre_passes = 0
    holds: tuple[Activation, Tensor] | None = None    # the workspace's activation and the node that filled it
    offer: tuple[Activation, Tensor] | None = None    # a producer since the last fill, whose blocks nobody read yet
    live: dict[tuple, tuple[Activation, Tensor]] = {}  # activation bytes -> their last pre-pass, bytes unchanged
    for n in graph.nodes:
        if not runs_kernel(n):
            continue
        act = activation(n)
        if act is not None and holds is not None and holds[0] == act:
            shared[n.uid] = holds[1]
            offer = None  # (the producer's fill would take the workspace from this product)
        elif act is not None and offer is not None and _offers(offer[0], act):
            shared[n.uid], holds, offer = offer[1], (act, offer[1]), None
            producing[holds[1].uid] = act.form
        elif act is not None and act.bytes in live:
            refused.append(Refusal(n, *_why_not(act, *live[act.bytes])))
        handed = hand_off(shared[n.uid]) if n.uid in shared and shared[n.uid].uid in producing else None
        if handed is not None and _offers(handed, act):
            handed_on.add(n.uid)
        if n.uid not in shared and fills_workspace(n):
            pre_passes += n.src[0].type.is_quantized  # (a bf16 GEMM's terms fill it too: no pre-pass of int8)
            holds, offer = ((act, n) if act is not None else None), None
            if act is not None:
                live[act.bytes] = (act, n)
        outs = [byte_range(t) for t in written(n) if _planned(t)]
        for key in [k for k in live if any(ranges_overlap(o, k) for o in outs)]:
            del live[key]  # (rule 5: what a product reads there from now on is another activation)
        if holds is not None and any(ranges_overlap(o, holds[0].bytes) for o in outs):
            holds = None
        if offer is not None and any(ranges_overlap(o, offer[0].bytes) for o in outs):
            offer = None
        made = producer_blocks(n)  # (after its own store: the producer's output is the activation)
        if made is not None and n.uid not in handed_on:  # (one hand-off slot: a reader of one hands nothing on)
            offer = (made, n)
    return Plan(shared, producing, refused, pre_passes, frozenset(handed_on))


def _offers(made: Activation, act: Activation) -> bool:
    """Whether a producer's ``made`` (its form: None, either) is product activation ``act``."""
    return made.form in (None, act.form) and replace(made, form=None) == replace(act, form=None)


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
_PRODUCING: contextvars.ContextVar[str | None] = contextvars.ContextVar("gdnpass_pre_pass_produced", default=None)


@contextlib.contextmanager
def _set(var: contextvars.ContextVar, value=True):
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def skipping():
    """Within: the product being launched reads the activations its pre-pass would write from the workspace, as an
    earlier node filled it (the executor's, for :func:`plan`'s ``shared``)."""
    return _set(_SKIPPING)


def producing(form: str):
    """Within: the producer being launched also writes its output quantized to ``form`` into the workspace (the
    executor's, for :func:`plan`'s ``producing``)."""
    return _set(_PRODUCING, form)


def skipping_now() -> bool:
    """Whether the product being launched skips its pre-pass (:func:`skipping`)."""
    return _SKIPPING.get()


def producing_now() -> str | None:
    """The form the producer being launched writes its output in, if it does (:func:`producing`)."""
    return _PRODUCING.get()
