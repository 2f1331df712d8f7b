"""The record of a fused op: everything gdnpass knows about a fused node, declared by its pattern's folder.

A record says which tensors the node reads (``src``, in order) and which it writes besides itself (``outs``), which
parameters it carries and how they must agree with those tensors, how many kernel launches it costs, how it runs
(the torch reference adapter and the Triton adapter), the scope of its kernel (read by its matcher), the Triton
programs one execution launches (the interpreter's cost estimate), which unfused nodes ``run --check`` must compare,
and what ``gdnpass dump`` says about its variant. The graph-file loader, the shape rules, the executor, the launch
counts, the check, the cost estimate and ``gdnpass dump`` all ask the record, through the registry
(:mod:`gdnpass.patterns`). It is the fused op's counterpart of a base op's spec (:mod:`gdnpass.opspec`), and types
its parameters in the same vocabulary (``NUM`` any finite number, ``NONNEG`` one >= 0).

Adapters have the executor's signature ``fn(node, views, out)``: ``views`` are the torch views of ``node.src`` then
``node.outs``, ``out`` the view of the node's own (primary output) memory. They import torch and Triton only when a
graph runs: building, planning and fusing a graph need neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from gdnpass.errors import GraphError
from gdnpass.ir import Op, Tensor
# the parameter types are the one vocabulary every op shares (base ops' specs too): gdnpass.opspec.vocab
from gdnpass.opspec.vocab import BOOL, INT, INTS, NAMES, NONNEG, NUM, REPLACED, Adapter, Param, Programs


@dataclass(frozen=True)
class FusedOp:
    op: Op
    src: tuple[str, ...]                 # what each src slot holds
    outs: str                            # what ``outs`` holds: the bytes it writes besides its primary output
    params: dict[str, Param]
    check: Callable[[Tensor], None]      # params vs the node's tensors; raises GraphError
    launches: Callable[[Tensor], int]    # kernel launches of one execution
    torch: Adapter
    triton: Adapter
    scope: Any = None                    # the kernel's limits (what its matcher asks)
    doc: str = ""
    programs: Programs | None = None     # the Triton programs of one execution: [(kernel, programs, steps)]
    interpreter_s: dict[str, tuple[float, float]] = field(default_factory=dict)  # its own kernels' seconds per
    #                                      program under TRITON_INTERPRET: (fixed, per step), as gdnpass.cli counts
    watch: Callable[[Tensor], bool] | None = None  # an unfused node whose output ``run --check`` must compare
    variant: Callable[[Tensor], str] = lambda n: ""  # dump: the kernel variant of a fused node worth a reader's eye
    extra_launches: tuple[str, str] | None = None  # (op_params flag, what the launches after the first run) when a
    #                                                flagged node launches more than once, as dump explains it
    optional_src: int = 0                # how many of the last ``src`` slots a node may leave out

    def validate(self, n: Tensor) -> None:
        """Everything a fused node must carry, so that a damaged or hand-edited graph file never reaches a kernel
        (its legality was decided by its matcher; this checks only that it is well formed)."""
        where = f"node {n.name!r} ({n.op.value})"
        least = len(self.src) - self.optional_src
        if not least <= len(n.src) <= len(self.src) or any(s is None for s in n.src):
            want = f"{least}..{len(self.src)}" if self.optional_src else f"{len(self.src)}"
            raise GraphError(f"{where}: needs {want} sources ({', '.join(self.src)}), has {len(n.src)}")
        if n.view_src is None or n.view_src.view_src is not None or n.view_offs != 0:
            raise GraphError(f"{where}: must be a view of its primary output (offset 0)")
        for key, p in self.params.items():
            if key not in n.op_params:
                if p.optional:
                    continue
                raise GraphError(f"{where}: op_params lacks {key!r}")
            if not p.ok(n.op_params[key]):
                raise GraphError(f"{where}: op_params {key!r} must be {p.what}, got {n.op_params[key]!r}")
        self.check(n)


def need(cond: bool, n: Tensor, msg: str) -> None:
    """A record's check: GraphError naming the node unless ``cond``."""
    if not cond:
        raise GraphError(f"node {n.name!r} ({n.op.value}): {msg}")


__all__ = ["Adapter", "BOOL", "FusedOp", "INT", "INTS", "NAMES", "NONNEG", "NUM", "Param", "Programs", "REPLACED",
           "need"]
