"""ggml's op and raw ``op_params`` words -> gdnpass's :class:`~gdnpass.ir.Op` and op_params: one decoder, shared by
every front end (the ggml-python importer, the llama.cpp capture).

A front end reads a ``ggml_tensor``'s op (as ``ggml_op_name`` spells it) and its int32 ``op_params`` words, and
:func:`ir_op` names them. The word layouts are the op specs' (:mod:`gdnpass.opspec`: each parameter's first word
and its type's encoding), ggml.c's at the pinned llama.cpp commit (0c1e57098bba43ac29e6e3b677cdceebdd22334f).
ggml 0.15.3 (ggml-python 0.0.45) lays out the ops its importer meets the same way; a caller that can ask its
library for a unary or GLU kind's name passes it, else word 0 is read in the pinned commit's numbering.

A node is decoded only if its layout accounts for every non-zero word: a parameter gdnpass does not model (a
MUL_MAT hint, ROPE's legacy n_past, a XIELU's coefficients) keeps the node OPAQUE, with its raw words, rather than
being dropped. Floats are f32 bit patterns; ints are signed.
"""

from __future__ import annotations

import struct

from gdnpass.ir import Glu, Op, Prec, Unary
from gdnpass.opspec import GGML_INPLACE_OPS, SPECS, WORDS, Arg

# ggml's own numbering (enum ggml_unary_op, ggml_glu_op, ggml_prec), used when the caller has no name for a kind
UNARY_OPS = ("ABS", "SGN", "NEG", "STEP", "TANH", "ELU", "RELU", "SIGMOID", "GELU", "GELU_QUICK", "SILU", "HARDSWISH",
             "HARDSIGMOID", "EXP", "EXPM1", "SOFTPLUS", "GELU_ERF", "XIELU", "FLOOR", "CEIL", "ROUND", "TRUNC")
GLU_OPS = ("REGLU", "GEGLU", "SWIGLU", "SWIGLU_OAI", "GEGLU_ERF", "GEGLU_QUICK", "SWIGLU_CLAMP")
PRECS = {0: Prec.UNDEFINED, 10: Prec.F32, 15: Prec.BF16, 20: Prec.F16, 30: Prec.Q8, 40: Prec.Q4}

# ggml ops that are exactly one of ours (same name, same semantics): every base op's spec; NONE is a leaf (or a
# dependency hint node)
_EXACT_OPS = {op.value: op for op in SPECS}


def _u32(w: int) -> int:
    return w & 0xFFFFFFFF  # words may come signed (ctypes c_int32) or unsigned


def _i32(w: int) -> int:
    return struct.unpack("<i", struct.pack("<I", _u32(w)))[0]


def _f32(w: int) -> float:
    return struct.unpack("<f", struct.pack("<I", _u32(w)))[0]


def _width(a: Arg) -> int:
    return WORDS.get(a.type.ggml, 1)


def _value(a: Arg, words: list[int]):
    """The parameter's value from its words (its type's ggml encoding), or None when it cannot be named (a prec ggml
    does not define)."""
    kind, w = a.type.ggml, words[a.word: a.word + _width(a)]
    if kind == "i32":
        return _i32(w[0])
    if kind == "f32":
        return _f32(w[0])
    if kind == "bool":
        return _i32(w[0]) != 0
    if kind == "size":
        return _u32(w[0]) | (_u32(w[1]) << 32)
    if kind == "i32x4":
        return tuple(_i32(x) for x in w)
    prec = PRECS.get(_i32(w[0]))
    return None if prec is None else prec.value


def _kind(name: str | None, word: int, numbering: tuple[str, ...]) -> str:
    """A kind's name: the caller's (ggml_*_op_name), else ggml's numbering of the pinned commit."""
    if name is not None:
        return name
    i = _i32(word)
    return numbering[i] if 0 <= i < len(numbering) else f"#{i}"


def _opaque(op_name: str, words: list[int], why: str | None = None) -> tuple[Op, dict]:
    """A node gdnpass keeps as ggml made it and never fuses; ``can_inplace`` tells the planner what gallocr would do
    with it (ggml_op_can_inplace)."""
    params = {"ggml_op": op_name, "ggml_op_params": [int(w) for w in words],
              "can_inplace": op_name.split("(")[0] in GGML_INPLACE_OPS}
    if why is not None:
        params["why"] = why
    return Op.OPAQUE, params


def ir_op(op_name: str, words: list[int], *, unary_name: str | None = None, glu_name: str | None = None,
          inplace: bool, is_node: bool) -> tuple[Op, dict]:
    """gdnpass's op and op_params for a ggml tensor.

    ``op_name``: ``ggml_op_name(t->op)`` ("MUL_MAT", "UNARY", ...). ``words``: ``t->op_params`` as int32s (signed or
    unsigned; missing trailing words count as 0). ``unary_name`` / ``glu_name``: ``ggml_unary_op_name`` /
    ``ggml_glu_op_name`` of a UNARY / GLU node when the caller's ggml can say (else word 0 is read in the pinned
    commit's numbering). ``inplace``: the tensor is a view (``t->view_src != NULL``), i.e. an ``*_inplace`` variant.
    ``is_node``: it is in ``cgraph->nodes`` (an op NONE there is ggml-backend's dependency node). Ops gdnpass does not
    model, and modelled ops with parameters it does not, come back as ``Op.OPAQUE``."""
    words = [int(w) for w in words]
    padded = words + [0] * max(0, 16 - len(words))
    if op_name == "NONE":
        # in the node list: ggml-backend's dependency node (an allocator hint); gdnpass models it the same way
        return Op.NONE, ({"hint": "dependency"} if is_node else {})
    op = _EXACT_OPS.get(op_name)
    if op is None:
        return _opaque(op_name, words)

    spec = SPECS[op]
    params: dict = {}
    kind = None
    if op is Op.UNARY:
        kind = _kind(unary_name, padded[0], UNARY_OPS)
        if kind not in {u.value for u in Unary}:
            return _opaque(f"UNARY({kind})", words)
    elif op is Op.GLU:
        kind = _kind(glu_name, padded[0], GLU_OPS)
        if kind not in {g.value for g in Glu}:
            return _opaque(f"GLU({kind})", words)
    elif op is Op.TRANSPOSE:
        params["axes"] = (1, 0, 2, 3)  # ggml stores none; gdnpass.ops.transpose records the swap

    explained = set()
    for a in spec.words(kind):  # the spec's layout: each parameter's first word, its type's encoding
        span = range(a.word, a.word + _width(a))
        explained.update(span)
        if a.key == "kind":  # UNARY's and GLU's word 0, named above
            params["kind"] = kind
            continue
        if a.sparse and not any(padded[i] for i in span):
            continue
        value = _value(a, padded)
        if value is None:
            return _opaque(op_name, words, f"op_params word {a.word} ({a.key}) = {padded[a.word]} is not a "
                                           f"{a.type.ggml} ggml defines")
        params[a.key] = value
    stray = [i for i, w in enumerate(padded) if w and i not in explained]
    if stray:
        return _opaque(op_name, words, f"op_params word {stray[0]} = {padded[stray[0]]} is not modelled")

    flag = next((a for a in spec.args if a.key == "inplace"), None)  # the *_inplace variant, a view of src[0]
    if flag is not None and (inplace or not flag.sparse):
        params["inplace"] = inplace
    return op, params
