"""What the kernels can do, declared once: the launchers enforce these limits and the matchers read them (through
the fused-op records of :mod:`gdnpass.patterns`), so a pattern never fuses what its kernel cannot run.

Pure Python: importing it loads neither torch nor Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from gdnpass.errors import KernelError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ChainScope:
    """GDN_CONV_CHAIN: ``max_seqs`` sequences of ``max_tokens`` tokens, ``max_rows`` snapshot rows."""

    max_seqs: int = 128           # sequences of one ubatch (the channel block shrinks with them: chain_block)
    max_tokens: int = 16          # registers per thread: d_conv-1+n_t window columns and n_t outputs
    max_rows: int = 16            # snapshot destinations of one node
    d_conv: tuple[int, ...] = (3, 4, 5)

    @staticmethod
    def heads(S: int, H_k: int, C: int) -> str | None:
        """Why q and k heads of S channels (H_k of each, in C channels) are outside the kernel, or None. It runs one
        program of S threads per head (``tl.arange(0, S)``, C / S programs), so S is a power of two dividing C;
        llama.cpp accepts any head size (80, say), the fused kernel does not."""
        if S < 1 or S & (S - 1):
            return f"head size {S} is not a power of two"
        if C % S:
            return f"head size {S} does not divide C = {C}"
        if H_k < 1 or 2 * S * H_k > C:
            return f"{H_k} q and {H_k} k heads of {S} do not fit in C = {C}"
        return None


CHAIN = ChainScope()

def gate_input_flat(x_ne: Sequence[int], operand_ne: Sequence[int]) -> bool | None:
    """GATED_DELTA_NET computing a gate (the gdn_gates pattern) reads the elementwise node's input x at the operand's
    (row, head, token, seq), x in the operand's shape ``operand_ne`` ([S or 1, H_v, n_t, n_s]) or, where that starts
    with 1, in it without that 1 ([H_v, n_t, n_s, 1]): whether x lies flat so; None where it lies otherwise (the
    kernel does not unravel flat indices)."""
    x, o = tuple(x_ne), tuple(operand_ne)
    if x == o:
        return False
    if o[0] == 1 and x == (*o[1:], 1):
        return True
    return None


def snapshots_on_whole_rows(snapshots: Sequence[int], size: int, rows: tuple[int, int], stride: int) -> bool:
    """GATED_DELTA_NET gathering its state (gdn_state_gather): whether every snapshot row (starting at ``snapshots``,
    ``size`` long) that overlaps the gathered rows' span ``rows`` (start, end) lies exactly on one of those rows
    (``stride`` apart, each at least ``size`` long): then each program's slice of a snapshot row is its own slice of a
    state row, which it reads before it writes any (any address unit, the same for all)."""
    lo, hi = rows
    return stride >= size and all((s - lo) % stride == 0 for s in snapshots if s < hi and lo < s + size)


MAT_VEC_COLS = 16        # MUL_MAT of 1..16 activation columns (a verify of up to 16 tokens) runs the mat-vec
GEMM_WEIGHTS = ("f16", "bf16")  # beyond, a single matrix of these runs the GEMM (triton_matvec.mul_mat_gemm); f32
                                # weights need no conversion (torch's matmul), block types run the mat-vec per 32
QUANT_MAT_VEC_COLS = 32  # columns of one quantized mat-vec launch (two chunks of its activation workspace): the
                         # weight read and decoded once for all of them


ARGSORT_MAX_ROW = 1024  # ARGSORT sorts a row in registers (a bitonic network of 64-bit keys): up to 1024 elements, as
                       # a router's n_expert (256 for qwen3.5-35b-a3b, 512 for -397b-a17b); the torch reference beyond
SM_TILE = 1024  # SOFT_MAX's elements per program and pass (soft_max_tile; the fused router's tile)


def soft_max_tile(ne0: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of SOFT_MAX for rows of ne0 elements (and of the fused router, MOE_ROUTER): a row in one
    tile up to SM_TILE, longer ones in SM_TILE steps."""
    block_c = min(SM_TILE, 1 << (max(1, ne0) - 1).bit_length())  # (the next power of two)
    return SM_TILE // block_c, block_c


def mat_vec_weight(dtype) -> bool:
    """Whether the mat-vec reads weights of ``dtype`` (a :class:`gdnpass.ir.DType`): f32, f16, bf16 and ggml's
    block types (their bytes, decoded in the kernel)."""
    return dtype.label in ("f32", "f16", "bf16") or dtype.is_quantized


def runs_as_mat_vec(rows: int, cols: int) -> bool:  # noqa: ARG001 - every row count: thin and wide products alike
    """Whether a single-matrix MUL_MAT of ``rows`` outputs and ``cols`` columns runs the Triton mat-vec; the pair
    matcher accepts exactly these, so a pair is always byte-identical to its two unfused products."""
    return 1 <= cols <= MAT_VEC_COLS


def runs_as_gemm(dtype, w_batches: int, cols: int) -> bool:
    """Whether a MUL_MAT of ``cols`` activation columns (:func:`mat_vec_columns`) against ``w_batches`` weight
    matrices of ``dtype`` (a :class:`gdnpass.ir.DType`) runs the Triton GEMM: more columns than the mat-vec takes
    (several sequences' verify, a prompt's ubatch), one matrix (not attention's batched KQ / KQV), f16 or bf16."""
    return cols > MAT_VEC_COLS and w_batches == 1 and dtype.label in GEMM_WEIGHTS


def runs_in_one_launch(dtype, w_batches: int, rows: int, cols: int) -> bool:
    """Whether a MUL_MAT of one weight matrix runs as one launch of the Triton mat-vec (:func:`runs_as_mat_vec`)
    or of the GEMM (:func:`runs_as_gemm`): the products whose store runs an epilogue (MUL_MAT_ADD's residual ADD,
    MUL_MAT_CHAIN's chain)."""
    return w_batches == 1 and (runs_as_mat_vec(rows, cols) or runs_as_gemm(dtype, w_batches, cols))


def mul_mat_path(dtype, w_batches: int, rows: int, x_ne: Sequence[int]) -> str:
    """How the Triton backend runs a MUL_MAT of ``w_batches`` weight matrices of ``dtype`` and ``rows`` rows, x ne
    [K, N1, N2, N3] (what its adapter launches, its launch count and its programs all read this): "mat_vec" (1..16
    columns, :func:`runs_as_mat_vec`), "gemm" (:func:`runs_as_gemm`), "chunks" (a quantized weight's columns, all in
    ne1, by the mat-vec 32 at a time, :func:`mat_vec_chunks`: torch would first dequantize the whole weight, 4 GB of
    f32 for a 9B's lm head) or "torch" (its matmul: f32 and batched weights beyond 16 columns)."""
    cols = mat_vec_columns(w_batches, x_ne)
    if runs_as_mat_vec(rows, cols):
        return "mat_vec"
    if runs_as_gemm(dtype, w_batches, cols):
        return "gemm"
    if dtype.is_quantized and w_batches == 1 and x_ne[2] * x_ne[3] == 1:
        return "chunks"
    return "torch"


def mat_vec_chunks(cols: int) -> int:
    """The mat-vec launches of a "chunks" product (:func:`mul_mat_path`) of ``cols`` columns: one per
    :data:`QUANT_MAT_VEC_COLS`."""
    return -(-cols // QUANT_MAT_VEC_COLS)


def pre_pass(dtype, path: str) -> bool:
    """Whether a product of ``dtype`` weights on ``path`` (:func:`mul_mat_path`'s "mat_vec", "chunks" or "gemm")
    launches a pre-pass of its activations first (triton_matvec): a quantized weight's q8 groups for the mat-vec, a
    bf16 weight's three bf16 terms for the GEMM."""
    return dtype.is_quantized or path == "gemm" and dtype.label == "bf16"


def mul_mat_launches(w, x) -> int:
    """Kernel launches of one MUL_MAT of weight ``w`` over ``x`` (graph tensors; a pair's, a MUL_MAT_ADD's or a
    MUL_MAT_CHAIN's alike)
    on :func:`mul_mat_path`'s kernel: the mat-vec or the GEMM, each after a pre-pass of the activations where it
    takes one (a quantized weight's q8 activations; a bf16 weight's three bf16 terms for the GEMM: triton_matvec),
    a "chunks" product's per :data:`QUANT_MAT_VEC_COLS` columns; torch's matmul one."""
    path = mul_mat_path(w.type, w.ne[2] * w.ne[3], w.ne[1], x.ne)
    if path == "torch":
        return 1
    launches = 1 + pre_pass(w.type, path)
    return launches * mat_vec_chunks(mat_vec_columns(1, x.ne)) if path == "chunks" else launches


def mat_vec_columns(w_batches: int, x_ne: Sequence[int]) -> int:
    """The activation columns of a MUL_MAT as the mat-vec counts them, x ne [K, N1, N2, N3]: all N1·N2·N3 against a
    single weight matrix (``w_batches`` 1); N1 per batch against a weight with batch dimensions (attention's KQ and
    KQV, whose batches run on a grid axis)."""
    return x_ne[1] if w_batches > 1 else x_ne[1] * x_ne[2] * x_ne[3]


def check_row_ids(ids: torch.Tensor, n_rows: int, op: str = "GET_ROWS") -> None:
    """Every row id of a GET_ROWS (or the fused chain's gather) / SET_ROWS names a row of its source / destination
    (ggml asserts it): KernelError, one line, otherwise. Skipped while a CUDA graph is being captured (no host sync
    there; the ids are only read at replay)."""
    import torch

    if ids.numel() == 0 or ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    lo, hi = (int(v) for v in ids.aminmax())
    if not (0 <= lo and hi < n_rows):
        raise KernelError(f"{op}: row id {lo if lo < 0 else hi} is outside the "
                          f"{'destination' if op == 'SET_ROWS' else 'source'}'s {n_rows} rows")
