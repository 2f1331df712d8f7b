"""The fusion patterns, one folder each, and the registry everything else reads.

    gdnpass/patterns/
      common.py        the matcher vocabulary: rules, Capture, the generic confinement and between-rules, Context
      record.py        the record of a fused op (FusedOp) and its parameter types
      pattern.py       a registry entry (Pattern) and what a complete one has
      conv_chain/      GET_ROWS -> CONCAT -> CPYs -> SSM_CONV -> SILU -> q/k norm  => GDN_CONV_CHAIN
      mat_vec_pair/    MUL_MAT + MUL_MAT sharing x                                  => MUL_MAT_VEC_PAIR
      rms_norm_mul/    RMS_NORM -> MUL (-> ADD)                                     => RMS_NORM_MUL
      gdn_state_cache/ GATED_DELTA_NET -> CPY of its snapshots into the cache       => GATED_DELTA_NET_CACHE
      mul_mat_add/     MUL_MAT -> ADD of its product (the residual)                 => MUL_MAT_ADD
      moe_router/      SOFT_MAX -> ARGSORT -> GET_ROWS -> SUM_ROWS -> CLAMP -> DIV  => MOE_ROUTER
      elementwise_chain/ ADD / MUL / UNARY nodes, each reading the one before       => ELEMENTWISE_CHAIN
      gdn_gates/       the elementwise nodes of a GATED_DELTA_NET_CACHE's gates     => GATED_DELTA_NET_CACHE
      gdn_state_gather/ the GET_ROWS of a one-sequence GATED_DELTA_NET_CACHE's state  => GATED_DELTA_NET_CACHE
      mul_mat_chain/   MUL_MAT -> ELEMENTWISE_CHAIN of its product (GDN output gate) => MUL_MAT_CHAIN
      pair_glu/        MUL_MAT_VEC_PAIR -> GLU (SWIGLU) of its two products         => MUL_MAT_VEC_PAIR
      product_store.py the checks mul_mat_add and mul_mat_chain share (a product's store epilogue)

:data:`REGISTRY` lists the patterns in pass order. Who reads it: the pass (:mod:`gdnpass.fusion`: ``PATTERNS``, the
order of ``prepare`` and ``fuse``), the IR's fused op list (each record declares its op, ``ir.fused_op``), the shape
rules and the graph-file loader (:mod:`gdnpass.ops`: the record checks a fused node), the backends (the adapters),
the executor and ``gdnpass dump`` (launches, the variant note), the cost estimate
(:func:`gdnpass.kernels.backends.programs`, :func:`interpreter_s`) and ``run --check`` (:func:`watched`). Adding a
pattern is a folder and one line here (see docs/patterns.md).

A Triton kernel stays in its kernel family module (gdnpass/kernels/triton_*.py) when it shares that family's
helpers or launchers, the exactness core's rule; a pattern whose kernel shares nothing keeps it in its folder. The
record names it either way (:attr:`Pattern.kernel`).
"""

from __future__ import annotations

from gdnpass.errors import GraphError
from gdnpass.ir import Op, Tensor
from gdnpass.patterns import (conv_chain, elementwise_chain, gdn_gates, gdn_state_cache, gdn_state_gather,
                              mat_vec_pair, moe_router, mul_mat_add, mul_mat_chain, pair_glu, rms_norm_mul)
from gdnpass.patterns.pattern import Pattern
from gdnpass.patterns.record import FusedOp

REGISTRY: tuple[Pattern, ...] = (conv_chain.PATTERN, mat_vec_pair.PATTERN, rms_norm_mul.PATTERN,
                                  gdn_state_cache.PATTERN, mul_mat_add.PATTERN, moe_router.PATTERN,
                                  elementwise_chain.PATTERN, gdn_gates.PATTERN, gdn_state_gather.PATTERN,
                                  mul_mat_chain.PATTERN, pair_glu.PATTERN)
# the pass order: the router before the chain (its CLAMP); the gates after the cache fusion and the chain, the
# product's chain after the chain and after the pair and the residual ADD (their nodes, and the products they take);
# the pair's GLU after the pair

RECORDS: dict[Op, FusedOp] = {p.record.op: p.record for p in REGISTRY}  # (gdn_gates, gdn_state_gather: its op)


def matchers() -> list:
    """Fresh matchers of every registered pattern, in pass order (``fusion.PATTERNS``)."""
    return [p.matcher() for p in REGISTRY]


def by_name(name: str) -> Pattern:
    for p in REGISTRY:
        if p.name == name:
            return p
    raise GraphError(f"no pattern named {name!r} (registered: {', '.join(p.name for p in REGISTRY)})")


def record_of(op: Op) -> FusedOp:
    """The record of fused op ``op``; GraphError for any other op."""
    try:
        return RECORDS[op]
    except KeyError:
        raise GraphError(f"op {op.value} is not a fused op") from None


def watched(n: Tensor) -> bool:
    """Whether ``run --check`` compares unfused node ``n``'s output: some pattern's record asks for it."""
    return any(p.record.watch(n) for p in REGISTRY)


def interpreter_s() -> dict[str, tuple[float, float]]:
    """The registered fused kernels' seconds per program under Triton's interpreter, by kernel name."""
    return {k: v for p in REGISTRY for k, v in p.record.interpreter_s.items()}


__all__ = ["REGISTRY", "RECORDS", "FusedOp", "Pattern", "by_name", "interpreter_s", "matchers", "record_of",
           "watched"]
