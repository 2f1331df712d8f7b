"""ggml's op and raw ``op_params`` words -> gdnpass's :class:`~gdnpass.ir.Op` and op_params: one decoder, shared by
every front end (the ggml-python importer, the llama.cpp capture).

A front end reads a ``ggml_tensor``'s op (as ``ggml_op_name`` spells it) and its int32 ``op_params`` words, and
:func:`ir_op` names them (the keys are :mod:`gdnpass.ops`'s). The word layouts below are ggml.c's at the pinned
llama.cpp commit (0c1e57098bba43ac29e6e3b677cdceebdd22334f). ggml 0.15.3 (ggml-python 0.0.45) lays out the ops
its importer meets the same way; a caller that can ask its library for a unary or GLU kind's name passes it, else
word 0 is read in the pinned commit's numbering.

A node is decoded only if its layout accounts for every non-zero word: a parameter gdnpass does not model (a
MUL_MAT hint, ROPE's legacy n_past, a XIELU's coefficients) keeps the node OPAQUE, with its raw words, rather than
being dropped. Floats are f32 bit patterns; ints are signed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from gdnpass.ir import Glu, Op, Prec, Unary

# ggml's own numbering (enum ggml_unary_op, ggml_glu_op, ggml_prec), used when the caller has no name for a kind
UNARY_OPS = ("ABS", "SGN", "NEG", "STEP", "TANH", "ELU", "RELU", "SIGMOID", "GELU", "GELU_QUICK", "SILU", "HARDSWISH",
             "HARDSIGMOID", "EXP", "EXPM1", "SOFTPLUS", "GELU_ERF", "XIELU", "FLOOR", "CEIL", "ROUND", "TRUNC")
GLU_OPS = ("REGLU", "GEGLU", "SWIGLU", "SWIGLU_OAI", "GEGLU_ERF", "GEGLU_QUICK", "SWIGLU_CLAMP")
PRECS = {0: Prec.UNDEFINED, 10: Prec.F32, 15: Prec.BF16, 20: Prec.F16, 30: Prec.Q8, 40: Prec.Q4}

# ggml_op_can_inplace (ggml-alloc.c): the ops gallocr may place over a dying parent. (ggml 0.15.3's list lacks
# CLAMP, but its CLAMP is always a view of its source, so this list serves both.)
GGML_INPLACE_OPS = frozenset({"FILL", "SCALE", "DIAG_MASK_ZERO", "DIAG_MASK_INF", "ADD", "ADD_ID", "ADD1", "SUB", "MUL",
                              "DIV", "SQR", "SQRT", "LOG", "UNARY", "ROPE", "ROPE_BACK", "SILU_BACK", "RMS_NORM",
                              "RMS_NORM_BACK", "CLAMP", "SOFT_MAX", "SOFT_MAX_BACK"})


@dataclass(frozen=True)
class _Field:
    word: int
    key: str
    kind: str               # i32 | f32 | bool | size (2 words) | i32x4 (4 words) | prec
    optional: bool = False  # left out of op_params when its words are 0 (ggml's "not set")

    @property
    def width(self) -> int:
        return {"size": 2, "i32x4": 4}.get(self.kind, 1)


def _fields(*specs) -> tuple[_Field, ...]:
    return tuple(_Field(*s) for s in specs)


# op -> where ggml.c puts each parameter (kind words, UNARY's and GLU's, are decoded apart)
_LAYOUTS: dict[Op, tuple[_Field, ...]] = {
    Op.VIEW: _fields((0, "offset", "size")),                                # ggml_view_impl: a size_t
    Op.PERMUTE: _fields((0, "axes", "i32x4")),
    Op.CONCAT: _fields((0, "dim", "i32")),
    Op.SCALE: _fields((0, "s", "f32"), (1, "b", "f32")),
    Op.RMS_NORM: _fields((0, "eps", "f32")),
    Op.L2_NORM: _fields((0, "eps", "f32")),
    Op.MUL_MAT: _fields((0, "prec", "prec", True)),                         # ggml_prec_set_acc
    Op.GATED_DELTA_NET: _fields((0, "K", "i32")),
    Op.SOFT_MAX: _fields((0, "scale", "f32"), (1, "max_bias", "f32")),
    # ggml_rope_impl: words 0 (n_past) and 3 (n_ctx) are legacy zeros; 15 is ggml_rope_set_offset's
    Op.ROPE: _fields((1, "n_dims", "i32"), (2, "mode", "i32"), (4, "n_ctx_orig", "i32"), (5, "freq_base", "f32"),
                     (6, "freq_scale", "f32"), (7, "ext_factor", "f32"), (8, "attn_factor", "f32"),
                     (9, "beta_fast", "f32"), (10, "beta_slow", "f32"), (11, "sections", "i32x4"),
                     (15, "n_offs", "i32")),
    Op.FLASH_ATTN_EXT: _fields((0, "scale", "f32"), (1, "max_bias", "f32"), (2, "logit_softcap", "f32"),
                               (3, "prec", "prec"), (4, "n_kv_max", "i32")),
}
_GLU_FIELDS = _fields((1, "swapped", "bool"))
_GLU_EXTRA = {Glu.SWIGLU_OAI: _fields((2, "alpha", "f32"), (3, "limit", "f32")),
              Glu.SWIGLU_CLAMP: _fields((3, "limit", "f32"))}

# ggml ops that are exactly one of ours (same name, same semantics); NONE is a leaf (or a dependency hint node)
_EXACT_OPS = {op.value: op for op in (Op.VIEW, Op.RESHAPE, Op.TRANSPOSE, Op.PERMUTE, Op.CONT, Op.CPY, Op.GET_ROWS,
                                      Op.SET_ROWS, Op.CONCAT, Op.SCALE, Op.ADD, Op.MUL, Op.UNARY, Op.GLU,
                                      Op.RMS_NORM, Op.L2_NORM, Op.MUL_MAT, Op.SOFT_MAX, Op.ROPE, Op.FLASH_ATTN_EXT,
                                      Op.SSM_CONV, Op.GATED_DELTA_NET)}
# ops whose in-place variant (a view of src[0]) is recorded as "inplace"; SCALE always says which it is
_INPLACE_KEY = frozenset({Op.UNARY, Op.RMS_NORM, Op.L2_NORM, Op.ADD, Op.MUL, Op.ROPE, Op.SOFT_MAX})


def _u32(w: int) -> int:
    return w & 0xFFFFFFFF  # words may come signed (ctypes c_int32) or unsigned


def _i32(w: int) -> int:
    return struct.unpack("<i", struct.pack("<I", _u32(w)))[0]


def _f32(w: int) -> float:
    return struct.unpack("<f", struct.pack("<I", _u32(w)))[0]


def _value(f: _Field, words: list[int]):
    """The field's value, or None when it cannot be named (a prec ggml does not define)."""
    w = words[f.word: f.word + f.width]
    if f.kind == "i32":
        return _i32(w[0])
    if f.kind == "f32":
        return _f32(w[0])
    if f.kind == "bool":
        return _i32(w[0]) != 0
    if f.kind == "size":
        return _u32(w[0]) | (_u32(w[1]) << 32)
    if f.kind == "i32x4":
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

    params: dict = {}
    fields = _LAYOUTS.get(op, ())
    explained = set()
    if op is Op.UNARY:
        kind = _kind(unary_name, padded[0], UNARY_OPS)
        if kind not in {u.value for u in Unary}:
            return _opaque(f"UNARY({kind})", words)
        params["kind"], explained = kind, {0}
    elif op is Op.GLU:
        kind = _kind(glu_name, padded[0], GLU_OPS)
        if kind not in {g.value for g in Glu}:
            return _opaque(f"GLU({kind})", words)
        params["kind"], explained = kind, {0}
        fields = _GLU_FIELDS + _GLU_EXTRA.get(Glu(kind), ())
    elif op is Op.TRANSPOSE:
        params["axes"] = (1, 0, 2, 3)  # ggml stores none; gdnpass.ops.transpose records the swap

    for f in fields:
        span = range(f.word, f.word + f.width)
        explained.update(span)
        if f.optional and not any(padded[i] for i in span):
            continue
        value = _value(f, padded)
        if value is None:
            return _opaque(op_name, words, f"op_params word {f.word} ({f.key}) = {padded[f.word]} is not a "
                                           f"{f.kind} ggml defines")
        params[f.key] = value
    stray = [i for i, w in enumerate(padded) if w and i not in explained]
    if stray:
        return _opaque(op_name, words, f"op_params word {stray[0]} = {padded[stray[0]]} is not modelled")

    if op is Op.SCALE:
        params["inplace"] = inplace
    elif op in _INPLACE_KEY and inplace:
        params["inplace"] = True
    return op, params
