"""What the kernels can do, declared once: the launchers enforce these limits and the matchers read them (through
the fused-op records of :mod:`gdnpass.kernels.fused`), so a pattern never fuses what its kernel cannot run.

Pure Python: importing it loads neither torch nor Triton.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChainScope:
    """GDN_CONV_CHAIN (seed 000's scope): one sequence, ``max_tokens`` tokens, ``max_rows`` snapshot rows."""

    max_tokens: int = 16          # registers per thread: d_conv-1+n_t window columns and n_t outputs
    max_rows: int = 16            # snapshot destinations of one node
    d_conv: tuple[int, ...] = (3, 4, 5)


CHAIN = ChainScope()

MAT_VEC_COLS = 16        # the mat-vec kernel takes activations of 1..16 columns
WIDE_COLS = 8            # MUL_MAT at 1..8 columns runs the mat-vec (as ggml-cuda's mmvf) ...
THIN_ROWS = 256          # ... and thin products (alpha/beta: 32 rows) up to MAT_VEC_COLS, where the pair still halves
                         # the time and beats two cuBLAS calls (docs/performance.md)


def runs_as_mat_vec(rows: int, cols: int) -> bool:
    """Whether a single-matrix MUL_MAT of ``rows`` outputs and ``cols`` columns runs the Triton mat-vec; the pair
    matcher accepts exactly these, so a pair is always byte-identical to its two unfused products."""
    return 1 <= cols <= WIDE_COLS or (cols <= MAT_VEC_COLS and rows <= THIN_ROWS)
