"""Backends: tables mapping an :class:`~gdnpass.ir.Op` to an adapter ``fn(node, views, out) -> None``.

``views[i]`` is a 4-D torch view (ne3, ne2, ne1, ne0) of ``node.src[i]`` (then of ``node.outs``) in its real memory
and ``out`` the view of the node's own memory (for CPY: the destination). An adapter computes from ``views`` and
writes ``out``; since ``out`` may alias an input, every result is computed in full before it is written. Views and
no-ops are the executor's job. The tables are derived: a base op's adapters are its spec's (:mod:`gdnpass.opspec`,
written in :mod:`gdnpass.opspec.adapters`), a fused op's its record's (the registry, :mod:`gdnpass.patterns`).

:data:`TORCH_BACKEND` runs :mod:`gdnpass.kernels.reference`; :data:`TRITON_BACKEND` swaps in the Triton kernels where
they apply. Triton is imported on the first Triton call, so the torch backend works without it (and the interpreter
switch ``TRITON_INTERPRET`` can still be set after this import).
"""

from __future__ import annotations

from gdnpass.ir import DType, Op, runs_kernel
from gdnpass.kernels import reference as ref
from gdnpass.opspec import SPECS, Adapter
from gdnpass.patterns import RECORDS

_FA_PRECS = ("UNDEFINED", "F32")  # ggml-cpu runs these (both accumulate in f32) and aborts on the others


def kernel(table: dict[Op, Adapter], node) -> Adapter | None:
    """``table``'s adapter for ``node``, or None where gdnpass has none: an op it only models (OPAQUE), a UNARY or
    GLU kind the reference does not implement, a ROPE mode other than NORMAL, NEOX, MROPE and IMROPE (VISION), a
    FLASH_ATTN_EXT precision ggml-cpu does not run."""
    if node.op is Op.UNARY and node.op_params.get("kind") not in ref.UNARY:
        return None
    if node.op is Op.GLU and node.op_params.get("kind") not in ref.GLU:
        return None
    if node.op is Op.ROPE and (int(node.op_params.get("mode", -1)) not in ref.ROPE_IMPLEMENTED
                               or node.type not in (DType.F32, DType.F16)):
        return None  # VISION (24) and any other mode: refused by name
    if node.op is Op.FLASH_ATTN_EXT and node.op_params.get("prec") not in _FA_PRECS:
        return None
    return table.get(node.op)


TORCH_BACKEND: dict[Op, Adapter] = {
    **{op: spec.torch for op, spec in SPECS.items() if spec.torch is not None},
    **{op: r.torch for op, r in RECORDS.items()},
}

# TORCH_BACKEND with ggml-cpu's rounding (each spec's ``ggml_cpu``): compare with llama.cpp / ggml on the CPU
GGML_CPU_BACKEND: dict[Op, Adapter] = {
    **TORCH_BACKEND,
    **{op: spec.ggml_cpu for op, spec in SPECS.items() if spec.ggml_cpu is not None},
}

# one Triton launch per node for every base op (MUL_MATs of more than 16 columns: the GEMM, or torch's matmul for f32
# and batched weights) and fused op
TRITON_BACKEND: dict[Op, Adapter] = {
    **TORCH_BACKEND,
    **{op: spec.triton for op, spec in SPECS.items() if spec.triton is not None},
    **{op: r.triton for op, r in RECORDS.items()},
}


def programs(node) -> list[tuple[str, int, int]]:
    """The Triton programs one execution of graph node ``node`` (a :class:`gdnpass.ir.Tensor`) launches under
    :data:`TRITON_BACKEND`, from the launchers' own block sizes: ``[(kernel, programs, steps)]``, ``steps`` being each
    program's loop trip count (tokens for ssm_conv, gdn and chain; K blocks for mat_vec; KV blocks for flash_attn,
    column blocks per pass for soft_max; 1 otherwise), as the family module of its op counts them (each one's
    ``programs``; a fused node's: its record's). Empty for nodes that run on torch (wide MUL_MATs of f32 weights) or
    launch nothing. Pure: reads shapes only (the interpreter's cost estimate reads them): a base op's spec names its
    family's ``programs``."""
    if not runs_kernel(node):
        return []
    if node.op.is_fused:
        return RECORDS[node.op].programs(node)
    spec = SPECS.get(node.op)
    return [] if spec is None or spec.programs is None else spec.programs(node)


__all__ = ["Adapter", "GGML_CPU_BACKEND", "TORCH_BACKEND", "TRITON_BACKEND", "programs"]
