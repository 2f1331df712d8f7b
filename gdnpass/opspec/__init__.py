"""One spec per base op: the one place a base op's facts live.

    gdnpass/opspec/
      vocab.py      the parameter types (shared with the fused ops' records), Arg, OpSpec, ggml's in-place list
      shapes.py     the shape/type rule of each base op
      adapters.py   how each runs: torch reference, Triton kernel, ggml-cpu's rounding, its family's cost estimate
      __init__.py   SPECS: one OpSpec per base op, naming all of the above

An op's :class:`OpSpec` holds its parameters (key, type, the op_params word ggml keeps it in, whether the shape rule
requires it), its shape rule, its adapters and its cost. What reads it: the constructors and
:func:`gdnpass.ops.validate_node` (the rule), the graph-file loader (:mod:`gdnpass.serialize`: the types), the
ggml/llama decoder (:mod:`gdnpass.frontends.decode`: the words), the planner (:mod:`gdnpass.alloc`:
``can_inplace``, ggml_op_can_inplace), the backends (:mod:`gdnpass.kernels.backends`: adapters, ``programs``) and
``gdnpass dump`` (the parameters it lists). Every member of :class:`gdnpass.ir.Op` that is not NONE, OPAQUE or a fused
op has one (tests/test_opspec.py). Fused ops have records instead (:mod:`gdnpass.patterns.record`), in the same
parameter-type vocabulary.

Pure Python: importing it loads neither torch nor Triton (the adapters import them when a graph runs).
"""

from __future__ import annotations

from gdnpass.errors import GraphError
from gdnpass.ir import Op
from gdnpass.opspec import shapes as s
from gdnpass.opspec.adapters import GGML_CPU, TORCH, TRITON, programs_of, rope
from gdnpass.opspec.shapes import ROPE_MODES, ROPE_TYPE_MROPE, Shape
from gdnpass.opspec.vocab import (BOOL, BOUND, GGML_INPLACE_OPS, INPLACE, INT, INT4, INTS, NAMES, NONNEG, NUM, PREC,
                                  REPLACED, SIZE, STR, WORDS, Adapter, Arg, OpSpec, Param, Programs)

_ROPE_ARGS = (Arg("n_dims", INT, 1, True), Arg("mode", INT, 2, True), Arg("n_ctx_orig", INT, 4, True),
              *(Arg(k, NUM, w, True) for w, k in enumerate(("freq_base", "freq_scale", "ext_factor", "attn_factor",
                                                             "beta_fast", "beta_slow"), start=5)),
              Arg("sections", INT4, 11, True), Arg("n_offs", INT, 15, True),  # ggml_rope_set_offset's word
              INPLACE)  # (words 0, n_past, and 3, n_ctx, are legacy zeros)
ROPE_KEYS = tuple(a.key for a in _ROPE_ARGS if a is not INPLACE)  # the reference's and the kernel's keywords
_ROPE_TORCH, _ROPE_TRITON = rope(ROPE_KEYS)


def _spec(op: Op, args: tuple[Arg, ...], shape, family: str | None = None, doc: str = "", **run) -> OpSpec:
    """An op's spec; a kernel op (``family``: its Triton module) takes its adapters from :mod:`.adapters`."""
    if family is None:
        return OpSpec(op, args, shape, doc=doc)
    return OpSpec(op, args, shape, torch=run.get("torch", TORCH.get(op)), triton=run.get("triton", TRITON.get(op)),
                  programs=programs_of(family), ggml_cpu=GGML_CPU.get(op), doc=doc)


_SPECS = (
    # views: the executor's, no kernel
    _spec(Op.VIEW, (Arg("offset", SIZE, 0),), s.rule_view, doc="ggml_view_*: a size_t byte offset"),
    _spec(Op.RESHAPE, (), s.rule_reshape),
    _spec(Op.TRANSPOSE, (Arg("axes", INT4),), s.rule_transpose, doc="ggml stores no words: axes are (1, 0, 2, 3)"),
    _spec(Op.PERMUTE, (Arg("axes", INT4, 0),), s.rule_permute),
    # data movement and elementwise (kernels/triton_elementwise.py)
    _spec(Op.CONT, (), s.rule_cont, "elementwise"),
    _spec(Op.CPY, (), s.rule_cpy, "elementwise", doc="a view of its destination, src[1]"),
    _spec(Op.GET_ROWS, (), s.rule_get_rows, "elementwise"),
    _spec(Op.SET_ROWS, (), s.rule_set_rows, "elementwise", doc="src (rows, ids, destination); a view of it"),
    _spec(Op.CONCAT, (Arg("dim", INT, 0),), s.rule_concat, "elementwise"),
    _spec(Op.SCALE, (Arg("s", NUM, 0), Arg("b", NUM, 1), Arg("inplace", BOOL)), s.rule_unary_src, "elementwise",
          doc="records inplace either way"),
    _spec(Op.ADD, (INPLACE,), s.rule_binary, "elementwise"),
    _spec(Op.MUL, (INPLACE,), s.rule_binary, "elementwise"),
    _spec(Op.UNARY, (Arg("kind", STR, 0), INPLACE), s.rule_unary_src, "elementwise",
          doc="kind: enum ggml_unary_op in word 0"),
    _spec(Op.GLU, (Arg("kind", STR, 0, True), Arg("swapped", BOOL, 1, True),
                   Arg("alpha", NUM, 2, kinds=("SWIGLU_OAI",)),
                   Arg("limit", NUM, 3, kinds=("SWIGLU_OAI", "SWIGLU_CLAMP"))),
          s.rule_glu, "elementwise", doc="kind: enum ggml_glu_op in word 0"),
    # norms (kernels/triton_norms.py)
    _spec(Op.RMS_NORM, (Arg("eps", NUM, 0), INPLACE), s.rule_unary_src, "norms"),
    _spec(Op.L2_NORM, (Arg("eps", NUM, 0), INPLACE), s.rule_unary_src, "norms"),
    # the mat-vec (kernels/triton_matvec.py): 1-16 columns; the GEMM beyond (f16 / bf16), torch's matmul for the rest
    _spec(Op.MUL_MAT, (Arg("prec", PREC, 0, sparse=True),), s.rule_mul_mat, "matvec",
          doc="prec: ggml_prec_set_acc, recorded only when set"),
    # attention (kernels/triton_attention.py, triton_rope.py)
    _spec(Op.SOFT_MAX, (Arg("scale", NUM, 0, True), Arg("max_bias", NUM, 1, True), INPLACE), s.rule_soft_max,
          "attention", doc="src (a, mask or None, sinks)"),
    _spec(Op.ROPE, _ROPE_ARGS, s.rule_rope, "rope", torch=_ROPE_TORCH, triton=_ROPE_TRITON,
          doc="src (a, positions, freq factors or None)"),
    _spec(Op.FLASH_ATTN_EXT, (Arg("scale", NUM, 0, True), Arg("max_bias", NUM, 1, True),
                              Arg("logit_softcap", NUM, 2, True), Arg("prec", PREC, 3, True),
                              Arg("n_kv_max", INT, 4, True)), s.rule_flash_attn_ext, "attention",
          doc="src (q, k, v, mask or None, sinks)"),
    # the GDN ops (kernels/triton_ssm.py)
    _spec(Op.SSM_CONV, (), s.rule_ssm_conv, "ssm"),
    _spec(Op.GATED_DELTA_NET, (Arg("K", INT, 0),), s.rule_gdn, "ssm", doc="src (q, k, v, g, beta, state)"),
    # the expert FFN (llama.cpp's build_moe_ffn, issue 36): the router's sort (kernels/triton_sort.py), the weights'
    # sum (triton_norms.py), clamp and division (triton_elementwise.py), the experts' products (the mat-vec's)
    _spec(Op.ARGSORT, (Arg("order", INT, 0, True),), s.rule_argsort, "sort",
          doc="order: enum ggml_sort_order, 0 ASC, 1 DESC (ggml_argsort_top_k: DESC)"),
    _spec(Op.SUM_ROWS, (), s.rule_sum_rows, "norms"),
    _spec(Op.CLAMP, (Arg("min", BOUND, 0, True), Arg("max", BOUND, 1, True), INPLACE), s.rule_clamp, "elementwise",
          doc="max may be inf (build_moe_ffn's weight sum)"),
    _spec(Op.DIV, (INPLACE,), s.rule_binary, "elementwise"),
    _spec(Op.MUL_MAT_ID, (), s.rule_mul_mat_id, "matvec", doc="src (as, b, ids)"),
)

SPECS: dict[Op, OpSpec] = {sp.op: sp for sp in _SPECS}

INPLACE_OPS = frozenset(op for op, sp in SPECS.items() if sp.can_inplace)  # the modelled ops gallocr may put in place


def spec_of(op: Op) -> OpSpec:
    """The spec of base op ``op``; GraphError for NONE, OPAQUE and the fused ops (their records are the patterns')."""
    try:
        return SPECS[op]
    except KeyError:
        raise GraphError(f"op {op.value} has no base-op spec") from None


__all__ = ["Adapter", "Arg", "BOOL", "BOUND", "GGML_INPLACE_OPS", "INPLACE", "INPLACE_OPS", "INT", "INT4", "INTS", "NAMES",
           "NONNEG", "NUM", "OpSpec", "PREC", "Param", "Programs", "REPLACED", "ROPE_KEYS", "ROPE_MODES",
           "ROPE_TYPE_MROPE", "SIZE", "SPECS", "STR", "Shape", "WORDS", "spec_of"]
