"""The vocabulary of op specs: the parameter types every op shares (base ops here, fused ops in their records,
:mod:`gdnpass.patterns.record`), a base op's parameter (:class:`Arg`) and its spec (:class:`OpSpec`).

One parameter-type vocabulary, so that the loader, the decoder, the shape rules and the fused records cannot mean
different things by one word: ``NUM`` is any finite number, ``NONNEG`` a finite number >= 0 (where a negative value
is meaningless: the fused chain's eps and scale). A type also says how ggml stores a value of it in a node's int32
``op_params`` words (``ggml``), which is what the ggml/llama decoder reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from gdnpass.ir import VIEW_OPS, Op, Tensor
from gdnpass.outputs import NON_FINITE

Adapter = Callable[[Tensor, list, Any], None]               # fn(node, views, out): the executor's signature
Programs = Callable[[Tensor], list[tuple[str, int, int]]]   # node -> [(kernel, programs, steps)]: the cost estimate


@dataclass(frozen=True)
class Param:
    """A parameter type: a predicate on a value, how to say what it must be, whether a node may leave it out (fused
    records), and how ggml encodes it in op_params words (None: ggml has no word for it)."""

    ok: Callable[[Any], bool]
    what: str
    optional: bool = False
    ggml: str | None = None  # i32 | f32 | bool | size (a size_t: 2 words) | i32x4 (4 words) | prec (enum ggml_prec)
    # a graph file's form of a value JSON cannot hold (BOUND's ±inf), and back; None: the value as it is
    to_json: Callable[[Any], Any] | None = None
    from_json: Callable[[Any], Any] | None = None


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is not 1


def _is_num(x) -> bool:
    return (is_int(x) or isinstance(x, float)) and math.isfinite(x)


# word widths of the ggml encodings (one word otherwise)
WORDS = {"size": 2, "i32x4": 4}

INT = Param(is_int, "an int", ggml="i32")
SIZE = Param(is_int, "an int", ggml="size")
NUM = Param(_is_num, "a finite number", ggml="f32")
NONNEG = Param(lambda x: _is_num(x) and x >= 0, "a finite number >= 0", ggml="f32")
# A float that may be ±inf but never NaN: CLAMP's bounds (llama.cpp's build_moe_ffn clamps to [6.1e-5, INFINITY]).
# JSON has no infinity, so a graph file writes ±inf by name, "Infinity" / "-Infinity" as every gdnpass JSON output
# names them (outputs.NON_FINITE); serialize refuses a NaN.
_INFS = {NON_FINITE["inf"]: math.inf, NON_FINITE["-inf"]: -math.inf}


def _bound_to_json(x):
    return NON_FINITE[repr(float(x))] if isinstance(x, float) and math.isinf(x) else x


BOUND = Param(lambda x: (is_int(x) or isinstance(x, float)) and not math.isnan(x),
              'a number or ±inf (in a graph file "Infinity" / "-Infinity")', ggml="f32", to_json=_bound_to_json,
              from_json=lambda x: _INFS.get(x, x) if isinstance(x, str) else x)
BOOL = Param(lambda x: isinstance(x, bool), "a bool", ggml="bool")
STR = Param(lambda x: isinstance(x, str), "a string")
PREC = Param(STR.ok, STR.what, ggml="prec")  # a Prec's name; which names exist is the shape rule's to say
INT4 = Param(lambda x: isinstance(x, (list, tuple)) and len(x) == 4 and all(is_int(v) for v in x),
             "a list of 4 ints", ggml="i32x4")  # the IR holds a tuple, a graph file a list
NAMES = Param(lambda x: isinstance(x, list) and all(isinstance(s, str) for s in x), "a list of names")
INTS = Param(lambda x: isinstance(x, list) and all(is_int(v) for v in x), "a list of ints")
REPLACED = Param(NAMES.ok, NAMES.what, optional=True)  # every fused node: the names of the nodes it replaced


@dataclass(frozen=True)
class Arg:
    """One op_params key of a base op."""

    key: str
    type: Param
    word: int | None = None      # the first op_params word ggml keeps it in (None: ggml keeps none)
    required: bool = False       # the shape rule refuses a node without it
    sparse: bool = False         # the decoder records it only when set (its words non-zero; ``inplace``: a view)
    kinds: tuple[str, ...] = ()  # only nodes of these kinds carry it (GLU's alpha and limit); () every node


# ggml_op_can_inplace (ggml-alloc.c of the pinned llama.cpp), by ggml's op names: the ops gallocr may place over a
# dying parent, ours and those gdnpass keeps OPAQUE. (ggml 0.15.3's list lacks CLAMP, but its CLAMP is always a view
# of its source, so this list serves both.)
GGML_INPLACE_OPS = frozenset({"FILL", "SCALE", "DIAG_MASK_ZERO", "DIAG_MASK_INF", "ADD", "ADD_ID", "ADD1", "SUB", "MUL",
                              "DIV", "SQR", "SQRT", "LOG", "UNARY", "ROPE", "ROPE_BACK", "SILU_BACK", "RMS_NORM",
                              "RMS_NORM_BACK", "CLAMP", "SOFT_MAX", "SOFT_MAX_BACK"})

INPLACE = Arg("inplace", BOOL, sparse=True)  # the *_inplace variant: the result is a view of src[0]


@dataclass(frozen=True)
class OpSpec:
    """Everything gdnpass knows about one base op: its parameters (keys, types, ggml words), its shape rule, its torch
    reference and Triton adapters and the Triton programs one execution launches. View ops (VIEW, RESHAPE,
    TRANSPOSE, PERMUTE) have no adapters: the executor makes them as views."""

    op: Op
    args: tuple[Arg, ...]
    shape: Callable[[Tensor, "OpSpec"], Any]      # the rule (opspec/shapes.py): what ggml asserts -> a Shape
    torch: Adapter | None = None                  # the torch reference (kernels/reference.py)
    triton: Adapter | None = None                 # the Triton kernel (kernels/triton_*.py)
    programs: Programs | None = None              # its family's cost estimate (kernels.backends.programs)
    ggml_cpu: Adapter | None = None               # ggml-cpu's rounding where it differs from ``torch``
    doc: str = ""

    @property
    def name(self) -> str:
        return self.op.value

    @property
    def can_inplace(self) -> bool:
        """ggml_op_can_inplace: gallocr may give the node its dying parent's block (:mod:`gdnpass.alloc`)."""
        return self.name in GGML_INPLACE_OPS

    @property
    def types(self) -> dict[str, Param]:
        return {a.key: a.type for a in self.args}

    def required(self, kind: str | None = None) -> tuple[str, ...]:
        """The keys the shape rule needs: every node's, or (``kind``) those of that kind only."""
        if kind is None:
            return tuple(a.key for a in self.args if a.required)
        return tuple(a.key for a in self.args if kind in a.kinds)

    def words(self, kind: str | None = None) -> tuple[Arg, ...]:
        """The parameters ggml keeps in op_params words, for a node of ``kind``."""
        return tuple(a for a in self.args if a.word is not None and (not a.kinds or kind in a.kinds))

    def missing(self) -> list[str]:
        """The parts this spec lacks (a test fails on any): a shape rule, and unless the op is a view (the executor
        makes those) a torch reference, a Triton adapter and a cost estimate."""
        parts = ("shape",) if self.op in VIEW_OPS else ("shape", "torch", "triton", "programs")
        return [p for p in parts if not callable(getattr(self, p))]
