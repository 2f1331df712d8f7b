"""The mat-vec's and the GEMM's tiles (:mod:`gdnpass.kernels.triton_matvec`): which launch shape each product runs,
a function of its shape and weight type alone. Pure Python (importing it loads neither torch nor Triton), so a matcher
can ask what a launch will do (whether its tile splits K, say) when it proves a rewrite.
"""

from __future__ import annotations

from typing import NamedTuple

from gdnpass.ir import DType

QK_K = DType.Q4_K.block  # a quantized tile's K step: one K-quant block (8 groups of 32)
Q8_1_GROUP = 32  # the q8_1 activations' group: Q8_0's block (a scale per 32 elements)
CHUNK_COLS = 16  # the activation workspace's columns a chunk (triton_core.XCOLS): every quantized product's, padded

# The bf16 tensor-core form takes x as three bf16 terms. Up to ONE_DOT_COLS padded columns they lie side by side in
# one operand of 4 * COLS columns (the fourth block zero), one dot per K step; at 16 columns that 64-wide operand
# ran 33-58% slower than three 16-wide dots (H200, 2026-12-03), so there each term is a dot of its own.
ONE_DOT_COLS = 8


def _pow2(n: int) -> int:
    """The least power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class MatVecTile(NamedTuple):
    """One mat-vec launch shape: BLOCK_M weight rows per program, COLS (the padded column count, a constexpr: one
    compile per power of two, so a 1-column product does not pay for 16), BLOCK_K per step, the DOT form, warps,
    ``split_k``, the K slices per row block, Triton's pipeline depth ``stages`` (its default, 3, unless tuned) and
    ``evict``, the weight loads marked evict-first in the L2, ``regs``, a cap on a thread's registers (ptxas's
    .maxnreg; 0: ptxas's own count), which decides how many programs an SM holds, and ``early``, how many of its
    slice's first K steps a program asks the L2 for before it waits for the kernel before it (:data:`EARLY_BYTES`;
    0: none; :data:`~gdnpass.kernels.triton_core.PREFETCH`). split_k, block_k, the form and the columns decide how a
    sum is grouped, so its bytes; regs, stages, evict and early are speed alone. A pair or a batch shares its single
    product's whole tile but regs (tests/kernels/test_tiles.py).

    split_k = 1: one program per row block sums all of K and stores y (no workspace, no atomics). split_k = S > 1 (a
    power of two) fills the GPU when the row blocks alone do not: S programs per row block, each summing one of S equal
    K slices (whole BLOCK_K steps, :func:`~gdnpass.kernels.triton_matvec.matvec_cols` over the sub-range) into an f32
    workspace slot, then drawing a ticket on the block's counter (an acq_rel atomic add). The program that draws the
    last ticket, whichever it is, adds the S partials in the fixed order 0..S-1 in f32, stores y and zeroes the counter.
    One launch, and bytes that depend on (shape, type, tile) only: run to run, and a pair's product against its single
    mat-vec. The workspace (:func:`~gdnpass.kernels.triton_core.split_workspace`) is shared by all launches on a device,
    so they must run on one stream in order, as the executor's do."""

    block_m: int
    cols: int
    block_k: int
    dot: bool   # tensor cores instead of CUDA-core FMAs: see triton_matvec.matvec_cols
    warps: int
    split_k: int = 1
    stages: int = 3
    evict: bool = False
    regs: int = 0
    early: int = 0

    def options(self) -> dict:
        """The launch's compile options (with :data:`~gdnpass.kernels.triton_core.LAUNCH`'s: triton_matvec._launch)."""
        return {"num_warps": self.warps, "num_stages": self.stages, **({"maxnreg": self.regs} if self.regs else {})}


def mat_vec_tile(M: int, N: int, K: int, wtype: str, products: int = 1) -> MatVecTile:
    """The tile for an M-row, N-column product over K of ``wtype`` ("f32", "f16", "bf16" or a block type's label)
    weights (:func:`_sum_tile`), a plain type's asking the L2 early for its first :data:`EARLY_BYTES`."""
    t = _sum_tile(M, N, K, wtype, products)
    if wtype in _QUANTIZED:
        return t
    return t._replace(early=max(1, EARLY_BYTES // (t.block_m * DType.parse(wtype).row_bytes(t.block_k))))


# What a plain-type mat-vec program asks the L2 for before it waits for the kernel before it (MatVecTile.early): the
# whole K steps of about its slice's first 32 KB (at least one), fetched while that kernel still runs where the
# program is resident by then (programmatic dependent launch); 528 programs' 17 MB stay well inside the H100's and
# H200's 50 MB of L2. It made the bf16 verify faster and the quantized ones slower, and asking inside the loop for a
# step a few steps ahead made every launch slower (docs/performance.md, 2026-12-07).
EARLY_BYTES = 32 << 10


def _sum_tile(M: int, N: int, K: int, wtype: str, products: int = 1) -> MatVecTile:
    """:func:`mat_vec_tile`'s sum: its bytes a function of the shape and type alone, so both products of a pair (one
    launch, one tile) are byte-identical to their single mat-vecs. ``products``: how many the launch runs (a pair's
    2, MUL_MAT_ID's slots x tokens), which only a block type's register cap reads (:func:`_quantized_tile`), never
    the bytes.

    Chosen from H200 timings (``benchmarks/tune_matvec.py``; the sweeps and tables in docs/performance.md). Thin
    outputs (alpha/beta: 32 rows): one row per program with K in few steps up to 4 columns; from 8 columns two rows
    per program and K split 8 ways (the column loads, not the weight, bound them). bf16 weights (the models'): one
    column in the FMA form, 4-8 rows per program in long K steps, at K a multiple of 4096 the weight's lines evicted
    first from the L2 (each is read once); from 2 columns the tensor-core form with its three activation terms in
    one operand up to 8 columns (one dot per K step; 8-28% faster than three dots; from 9 columns three dots,
    :data:`ONE_DOT_COLS`), K split where the row blocks alone leave SMs idle (:func:`_split`), 64-row blocks in K
    steps of 128 for 8192+ rows at 2-4 columns, 128-row at 5-8 in K split 2 (the FFN pair's 12288 x 4096 in K steps
    of 64, 4 warps: 72.1 us a pair against 78.0 for the 256-row blocks split 4 before; qkv's 8192 x 4096 in steps of
    128, 8 warps: 26.4 against 27.7; H100 sweep, 2026-12-07, sixteenth session), at 9-16 in K steps of 128, the
    FFN pair unsplit in 256-row blocks (72.6 us a pair against 79.8), 4096-8192 rows in 128-row blocks split 4 or 2
    (5-7% faster; the same sweep); attention k / v (1024 rows) at 8 columns in 128-row blocks of K steps of 128 (the
    same sweep). Those are qwen3.5-9b's K (4096, 12288); -27b's K (5120-17408) keeps its own tiles, swept apart at 4
    and 8 columns, and at 9-16 the 2026-12-02 ones; 4096 x 4096 (z, ssm_out, attn_output) in K steps
    of 128 split 4, 64-row blocks (the weight evicted first) at 2-4 columns, 128-row at 5-8 (also ffn_down's 4096 x
    12288 there): 8% faster than the tiles before (H100 sweep, 2026-12-07, thirteenth session). f32 and f16 weights:
    up to 4 columns the FMA form (one column of up to 1024 rows with two rows and K steps of 2048, as the thin
    products), beyond it 3xTF32 tensor-core tiles (split up to 8192 rows). f16 weights take f32's tiles (not timed
    apart). With fusion on, FFN gate / up and attention k / v run only as pairs (twice the programs of one product):
    their bf16 tiles were timed as pairs."""
    cols = _pow2(N)
    if wtype in _QUANTIZED:
        return _quantized_tile(M, cols, K, wtype, products)
    if M <= 256:
        if cols >= 8:
            return MatVecTile(2, cols, 512, False, 4, _split(K, 512, 8))
        return MatVecTile(1, cols, min(_pow2(K), max(256, 8192 // cols)), False, 8)
    if wtype == "bf16" and M > 1024 and cols == 1 and M <= 65536 and K % 4096 == 0:
        # FMA, the weight's lines evicted first: 3-28% faster at qwen3.5-9b's K (4096, 12288) where it was tuned,
        # 2-14% slower at -27b's (5120-17408), which keep the tile below (H200, 2026-12-03)
        return MatVecTile(4, 1, 256, False, 4, 1, 4, True) if M >= 8192 else \
            MatVecTile(8, 1, 1024, False, 4, 1, 4, True)
    if wtype == "bf16" and cols >= 2:  # the tensor-core form, its three terms in one operand of max(4, cols) x 4
        c = max(4, cols)
        if M > 65536:  # the lm head fills the GPU unsplit
            return MatVecTile(256, c, 64, True, 8) if c == 8 else MatVecTile(128, c, 64, True, 4)
        if c > ONE_DOT_COLS:  # 9-16 columns, three dots (ONE_DOT_COLS)
            if M >= 4096 and K % 4096 == 0:  # qwen3.5-9b's K: the FFN pair unsplit, 256-row blocks; else 128-row
                # blocks, split 2 (8192 rows) or 4 (4096)
                return MatVecTile(256, c, 128, True, 8) if M > 8192 else \
                    MatVecTile(128, c, 128, True, 4, _split(K, 128, 2 if M >= 8192 else 4))
            if M >= 4096:  # other K (-27b's): the tiles timed for 16 columns on 2026-12-02
                return MatVecTile(128, c, 64, True, 8, _split(K, 64, 4 if M >= 8192 else 8))
            if M >= 1024:
                return MatVecTile(128, c, 128, True, 8, _split(K, 128, 8))
        if M >= 4096 and K % 4096:  # qwen3.5-27b's K (5120, 6144, 17408): its own sweep (2026-12-03)
            if c == 4:
                if M >= 8192:
                    return MatVecTile(128, c, 128, True, 4)
                return MatVecTile(128, c, 64, True, 4, _split(K, 64, 16)) if K > 8192 else \
                    MatVecTile(64, c, 64, True, 4, _split(K, 64, 4))
            return MatVecTile(256, c, 64, True, 8, _split(K, 64, 2 if M >= 8192 else 16 if K > 8192 else 4))
        if M >= 4096 and c == 4:  # one K step of 128 for 8192+ rows (and the FFN gate / up pair); split below
            if M >= 8192:
                return MatVecTile(64, c, 128, True, 4, 1, 4, True)
            return MatVecTile(64, c, 128, True, 4, _split(K, 128, 4), 3, True) if K <= 4096 else \
                MatVecTile(128, c, 128, True, 4, _split(K, 128, 4))
        if M > 8192:  # 8 columns, the FFN gate / up pair (12288 rows): 128-row blocks in K steps of 64 split 2
            return MatVecTile(128, c, 64, True, 4, _split(K, 64, 2))
        if M >= 8192:  # 8 columns, qkv (8192 rows): 128-row blocks of 8 warps in K steps of 128 split 2
            return MatVecTile(128, c, 128, True, 8, _split(K, 128, 2))
        if M >= 4096:  # 4096 rows at 8 columns: 128-row blocks in K steps of 128 split 4 (swept at 4096 x 4096;
            # ffn_down's 4096 x 12288 timed in the verify only: 41.1 -> 39.1 us a launch, across runs)
            return MatVecTile(128, c, 128, True, 4, _split(K, 128, 4))
        if M >= 1024:  # attention k / v (timed as the pair; at 8 columns and the 9B's K, 128-row blocks of 8 warps in
            # K steps of 128: 9.2 us a pair against 10.6, H100 sweep, 2026-12-07, sixteenth session)
            if c == 4:
                return MatVecTile(128, c, 64, True, 8, _split(K, 64, 16))
            return MatVecTile(128, c, 128, True, 8, _split(K, 128, 8)) if K % 4096 == 0 else \
                MatVecTile(64, c, 64, True, 4, _split(K, 64, 8))
    if wtype != "bf16" and cols >= 8 and M >= 8192:
        return MatVecTile(64, 16, 64, True, 4, _split(K, 64, 1 if M > 8192 else 2))
    if wtype != "bf16" and cols >= 8 and M >= 1024:  # (attention k / v, 1024 rows: 8 slices, timed as the pair)
        return MatVecTile(64, 16, 64, True, 4, _split(K, 64, 4 if M >= 4096 else 8))
    small = M <= 1024  # (an accumulator of 4 x 16 x 512 would spill: 16 columns take K steps of 256)
    if small and cols == 1:  # one column of few rows: the thin products' shape, two rows and K in long steps
        return MatVecTile(2, 1, min(_pow2(K), 2048), False, 8)
    return MatVecTile(4 if small else 8, cols, 512 if cols <= 2 or small and cols <= 8 else 256, False, 4)


_QUANTIZED = frozenset(t.label for t in DType if t.is_quantized)


def _quantized_tile(M: int, cols: int, K: int, wtype: str, products: int = 1) -> MatVecTile:
    """A quantized weight's tile (:func:`~gdnpass.kernels.triton_matvec.matvec_cols_q`, its columns padded to 8, 16 or
    32): a K-quant block (8 groups of 32) per K step, 64-row blocks, 4 warps, Triton's 3 pipeline stages (Q8_0's 2),
    K split until the launch has at least :data:`QUANTIZED_PROGRAMS` programs but, from 64 row blocks and K >= 4096,
    Q4_K in no more slices than K has steps of 4 blocks; the K-quants' registers capped up to 16 columns
    (:data:`QUANT_REGS`), Q6_K's only in launches of more than :data:`Q6_K_CAPPED_PAST` programs (all ``products``' row
    blocks and K slices); the cap changes no byte. The K-quants from the H200 sweep of 2026-12-04 of the q8_K form (a
    probe of this kernel with 16 tiles: 1, 4 and 16 columns of 4096 x 4096, 12288 x 4096, 4096 x 12288; within 10% of
    each case's best; docs/performance.md), Q8_0 as below; the 32-column tiles are the 16-column ones, untuned. Q4_K's
    K-split cap from the H100 sweep of 2026-12-06 (sixth session); the register caps and Q6_K's split from the H100
    sweep of the seventh (4 and 8 columns of 4096 x 4096, 8192 x 4096, 12288 x 4096 and 4096 x 12288: each type at its
    best tile or within 3.5% of it), applied untimed to the other models' shapes. Q8_0 (its rows held split): 64-row
    blocks in 2 pipeline stages, K split into the most slices whose programs fit one wave (:data:`Q8_0_WAVE`); its
    thin products (:data:`Q8_0_THIN_ROWS`) one block of their rows at 8 columns."""
    thin = wtype == "q8_0" and M <= Q8_0_THIN_ROWS
    block_m = Q8_0_THIN_ROWS if thin else 64
    want, blocks = 1, _cdiv(M, block_m)
    if wtype == "q8_0":
        while blocks * want * 2 <= Q8_0_WAVE and want < 16:
            want *= 2
    else:
        while blocks * want < QUANTIZED_PROGRAMS[wtype] and want < 16:
            want *= 2
    if blocks >= 64 and K >= 4096 and wtype == "q4_k":  # no more slices than K has steps of 4 blocks
        want = _split(K, 4 * QK_K, want)
    split = _split(K, QK_K, want)
    programs = blocks * split * products  # (the launch's: its products share the tile, never its split)
    capped = cols <= 16 and (wtype == "q6_k" and programs > Q6_K_CAPPED_PAST or wtype in ("q4_k", "q5_k"))
    return MatVecTile(block_m, max(8 if thin else QUANT_MIN_COLS[wtype], cols), QK_K, True, 4, split,
                      2 if wtype == "q8_0" else 3, regs=QUANT_REGS[wtype] if capped else 0)


# The quantized sum's narrowest width (COLS): 8 where the product has 8 columns or fewer, not the activation chunk's
# 16, since every column costs its scale arithmetic a group (the dot itself stays 16 wide: triton_matvec._group_dots).
# Timed only in a form since changed (docs/performance.md, tenth session: Q4_K 2-5% a launch). Q8_0 stays at 16: on
# its split rows, aligned, 8 halves its f32 step (431 instructions a K step against 541) but ran slower at 4 columns
# where it matters (12288 x 4096 35.8 against 33.2 us, the lm head 554.7 against 511.5; 4096 x 4096 even; H100,
# eighteenth session): its launches are bound by stalls, not issue.
QUANT_MIN_COLS = {"q4_k": 8, "q5_k": 8, "q6_k": 8, "q8_0": CHUNK_COLS}


def hands_on_q8_1(t: MatVecTile) -> bool:
    """Whether a product's epilogue on tile ``t`` can hand its output on as q8_1 activations (triton_matvec._hand_on:
    the FFN pair's SwiGLU, the z chain's output, for the Q8_0 product after it; gdnpass.prepasses): each row block
    whole groups of 32 rows, its columns one activation chunk's."""
    return t.block_m % Q8_1_GROUP == 0 and t.cols == CHUNK_COLS


QUANTIZED_PROGRAMS = {"q4_k": 384, "q5_k": 384, "q6_k": 256}  # the programs K is split to reach
# Q8_0's programs in one wave on the H100's and H200's 132 SMs, its rows held split (quants.held_rows): 64-row blocks
# in 2 pipeline stages take 40 KB of shared memory and, split, 105 registers: 4 programs an SM (launched_sm90.py; the
# lm head, unsplit, 74: 5). The probe of the split rows (H100, 2026-12-07, seventeenth session, 4 columns, us a
# launch; the file's layout at its own tile in brackets): 12288 x 4096 in 2 slices 35.7 (45.4), in 4 39.7;
# 4096 x 12288 in 8 34.1 (47.5), in 16 37.5; 4096 x 4096 in 8 16.0 (20.9); the lm head unsplit 535 (723), in 2 512.
# 128-row blocks (3 stages: 110 KB, 2 an SM; 2 stages: 74 KB, 3) and 32-row ones were slower at every shape. The
# aligned form (triton_matvec.aligned_rows) took the split launches to 76 registers, 5 an SM; its scales loaded a
# step ahead (nineteenth session) to 128, 4 an SM, as the wave counts (the lm head 133: 3, and faster so).
Q8_0_WAVE = 528

# Q8_0's thin products (alpha / beta, 32 rows): one 32-row block, 8 columns, K split to one step a program. Their
# launch of 16-32 programs is bound by each program's latency (a K step ~3.7 us: 1 slice 59.7 us, 16 slices 6.3), not
# by occupancy; the pair at 4 and 8 columns 6.34 us against 9.98 with the 128-row block at 16 columns (H100, 2026-12-07,
# thirteenth session). The K-quants' thin tiles were not timed: 64-row blocks.
Q8_0_THIN_ROWS = 32

# The K-quants' registers a thread up to 16 columns, which decide how many programs an SM holds (shared memory allows
# 4 or more): Q4_K and Q5_K at 128, 4 programs (uncapped: up to 136, 3); Q6_K at 128, 4, unspilled since its rows
# are held split (nineteenth session: 149-153 uncapped, 3; before that 168, 3, at 8-16 bytes of spill). Held by
# tests/kernels/test_occupancy.py, compiled as the launches specialize them; what each cap was worth:
# docs/performance.md, sixth and seventh sessions. Not at 32 columns: Q4_K's would spill at 128 (176).
# Q8_0's split rows take no cap (Q8_0_WAVE).
QUANT_REGS = {"q4_k": 128, "q5_k": 128, "q6_k": 128}
# Q6_K's cap pays only where the launch fills more than 2 programs an SM (the H100's and H200's 132 SMs hold 264):
# with 256 programs or fewer it ran 2-4% slower, the spill's cost without an SM's third program to win
Q6_K_CAPPED_PAST = 256


def _split(K: int, block_k: int, want: int) -> int:
    """K slices of a row block: ``want`` (a power of two), but never more slices than K steps (the launcher
    requires a power of two)."""
    return min(want, 1 << max(_cdiv(K, block_k).bit_length() - 1, 0))  # (K = 0: one empty slice, y = 0)


class GemmTile(NamedTuple):
    """One GEMM launch shape: BLOCK_M weight rows x BLOCK_N columns per program, BLOCK_K per step, warps, Triton's
    pipeline depth, and ``split_k``: the K slices per (row block, column tile), summed as the mat-vec sums its
    slices (:class:`MatVecTile`: a workspace, a ticket, the slices added in a fixed order; no atomics on the
    values). Bytes depend on block_k and split_k (the K steps and slices), on nothing else."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int = 3
    split_k: int = 1


GEMM_PROGRAMS = 256  # the programs a launch should reach by splitting K (about two per SM of an H100's 132)
GEMM_MIN_STEPS = 4   # ... while each K slice keeps at least this many K steps
GEMM_MAX_SPLIT = 8   # ... and in at most this many slices


def gemm_tile(M: int, N: int, K: int, wtype: str) -> GemmTile:
    """The GEMM's tile for an M-row, N-column (N > 16) product over K of ``wtype`` ("bf16" or "f16") weights, from
    the H100 sweep of 2026-12-06 (``benchmarks/tune_gemm.py``, docs/performance.md: within 6% of the best tile
    swept at 14 of the 18 qwen3.5-9b shapes x 32, 64, 128 columns, at most 1.2x). bf16: 64-row blocks, 4 warps; up to
    32 columns 32 a program in K steps of 128, 4 stages (K steps of 64, 3 stages, where the row blocks fill the GPU
    many times over: the lm head's 691 against 850 us); beyond, 64 columns in K steps of 64, 3 stages. K split in
    two until the launch has :data:`GEMM_PROGRAMS` programs, up to :data:`GEMM_MAX_SPLIT` slices of at least
    :data:`GEMM_MIN_STEPS` steps each (the 9B's 4096-row down projection at 32 columns: 64 row blocks on 132 SMs
    otherwise: 57 us split in 4, 91 unsplit). f16 (an f32 dot on the CUDA cores; untimed): K
    steps of 32, two stages, split alike."""
    block_n = 64 if N > 32 else 32
    programs = _cdiv(M, 64) * _cdiv(N, block_n)
    if wtype != "bf16":
        t = GemmTile(64, block_n, 32, 4, 2)
    elif N > 32 or programs >= 8 * GEMM_PROGRAMS:
        t = GemmTile(64, block_n, 64, 4, 3)
    else:
        t = GemmTile(64, 32, 128, 4, 4)
    split = 1
    while (programs * split < GEMM_PROGRAMS and split < GEMM_MAX_SPLIT
           and K // (t.block_k * split * 2) >= GEMM_MIN_STEPS):
        split *= 2
    return t._replace(split_k=split)
