"""The exactness core of the Triton kernels: the ``@triton.jit`` helpers and launch conventions shared by the kernel
families, so that a fused kernel and the unfused kernels it stands for write identical bytes.

The kernels run the ops the executor runs, one launch per graph node (as ggml-cuda), each writing straight into a
(possibly strided) output view. They live by family: :mod:`~gdnpass.kernels.triton_elementwise` (the data movement,
GET_ROWS, CONCAT, CPY/CONT and SET_ROWS, and the elementwise ops, ADD, MUL, DIV, UNARY, GLU, SCALE and CLAMP),
:mod:`~gdnpass.kernels.triton_norms` (L2_NORM, RMS_NORM, SUM_ROWS), :mod:`~gdnpass.kernels.triton_sort` (ARGSORT),
:mod:`~gdnpass.kernels.triton_matvec` (MUL_MAT: the mat-vec of 1-16 columns, the GEMM beyond; the pair, a store's
epilogue, MUL_MAT_ID),
:mod:`~gdnpass.kernels.triton_ssm` (SSM_CONV, GATED_DELTA_NET and the fused
GDN_CONV_CHAIN), :mod:`~gdnpass.kernels.triton_rope` (ROPE) and :mod:`~gdnpass.kernels.triton_attention` (SOFT_MAX,
FLASH_ATTN_EXT). Wide MUL_MATs of f32 weights stay on torch (its matmul). Each family module holds its kernels,
their launchers and its ``programs`` (the launch sizes :func:`gdnpass.kernels.backends.programs` reports).

Tensors follow :mod:`gdnpass.kernels.reference`: 4-D torch views of shape (ne3, ne2, ne1, ne0), usually strided
windows into one uint8 buffer viewed as float32. Strides are passed in elements, in ggml order (s0 = stride of ne0).

The ``@triton.jit`` helpers here are the arithmetic more than one kernel does: :func:`silu_f32` (UNARY SILU, SWIGLU)
and :func:`silu_f32_unrolled` (the fused chain; the same bits), :func:`sum_sq_rows` under :func:`l2_scale_rows` and
:func:`rms_scale_rows` (L2_NORM, RMS_NORM and the fused chain's q/k), :func:`conv_dot` (SSM_CONV and the fused chain),
SOFT_MAX's :func:`soft_max_w` and :func:`soft_max_sum`, ARGSORT's :func:`argsort_rows` and CLAMP's :func:`clamp_f32`
(their kernels and the fused router, MOE_ROUTER),
exp, log, cos and sin as torch computes them (:func:`exp_f32`, :func:`log_f32`, :func:`cos_sin_f64`), the row
addressing :func:`_row_offset`; and the launch conventions every launcher follows (:data:`LAUNCH`, :func:`_require`,
:func:`_strides`, :func:`_repeats`, :func:`_alias_ok`). A fused kernel calls the same helpers so its results are
byte-identical to the unfused kernels'; a helper only one family uses stays in its family's module. Two things would
otherwise let the bytes depend on the kernel: FMA contraction (whether ``a*b + c`` rounds once or twice depends on what
the compiler sees around it), switched off for every launch (:data:`LAUNCH`), and ``tl.sum``, whose order follows the
register layout the compiler picks per kernel: the L2 sum is a fixed pairwise tree instead (:func:`sum_sq_rows`), and
the mat-vec pair runs the very kernel of the single mat-vec. Against the torch reference, the elementwise kernels write
its expressions operation for operation, with IEEE division (``tl.math.div_rn``; ``/`` is approximate compiled) and
CUDA's own expf/logf (:func:`exp_f32`, :func:`log_f32`): compiled, their bytes are the reference's on CUDA; the
data-movement kernels move bits (or convert as torch converts), so theirs are everywhere.

Every kernel loads all inputs of the elements it owns before storing them, so an output may alias its input element
for element (SiLU in place); the launchers refuse any other overlap of an output with an input (:func:`_alias_ok`).
Token counts stay runtime values, loop bounds or the mask of a fixed tile (no recompile per n_t), except in the fused
chain, where they are constants of the node (see :func:`gdnpass.kernels.triton_ssm.gdn_conv_chain`), and in SSM_CONV
and GATED_DELTA_NET up to MAX_UNROLLED_T tokens (a verify's loop unrolled: one compile per n_t); channels go on the
grid.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gdnpass.errors import KernelError
from gdnpass.ir import HELD_SPLIT, DType
from gdnpass.kernels.tiles import CHUNK_COLS, Q8_1_GROUP

NUM_WARPS = 4       # every launch but the mat-vec, the fused chain, GATED_DELTA_NET and flash attention (their own);
                    # a fused kernel reusing a reduction helper must launch with the same

# read when this module loads, as @triton.jit reads it: the interpreter runs every kernel defined below
INTERPRETED = bool(triton.knobs.runtime.interpret)

# Programmatic dependent launch (Hopper and later): each kernel may be launched while the one before it in the stream
# still runs, its programs made resident and its prologue run; :func:`wait_for_previous_kernels` (in every kernel
# before any load or store; only index arithmetic and an L2 prefetch may come first) then waits until the previous
# kernel has finished and its writes are visible, so no load or store of a kernel's body can overtake its
# predecessor, and it lets its own successor launch. What it saves is the gap and ramp
# between two kernels (docs/performance.md). Off in the interpreter and below sm_90 (no griddepcontrol there), and
# when GDN_PDL=0; :func:`programmatic_launch` switches it per capture (the benchmarks' A/B).
PDL_SUPPORTED = (not INTERPRETED and os.environ.get("GDN_PDL", "1") != "0" and torch.cuda.is_available()
                 and torch.cuda.get_device_capability() >= (9, 0))

# every launch: no FMA contraction, so each operation rounds as written, whichever kernel it is in
LAUNCH = dict(num_warps=NUM_WARPS, enable_fp_fusion=False, **({"launch_pdl": True} if PDL_SUPPORTED else {}))


@contextlib.contextmanager
def programmatic_launch(enabled: bool):
    """Launch (and so capture) the kernels with programmatic dependent launch on or off inside the block, where it is
    supported; the kernels' bytes are the same either way (it moves only when a kernel may start)."""
    before = LAUNCH.get("launch_pdl")
    if PDL_SUPPORTED:
        LAUNCH["launch_pdl"] = enabled
    try:
        yield
    finally:
        if PDL_SUPPORTED:
            LAUNCH["launch_pdl"] = before


if PDL_SUPPORTED:
    @triton.jit
    def wait_for_previous_kernels():
        """Wait for the kernel before it (all of its writes visible), then let the one after it launch: in every
        kernel before its first load or store. A kernel launched with ``launch_pdl`` that loaded or stored first could
        read an input before it is written, or overwrite what its predecessor still reads (tests/kernels/
        test_triton_ops.py: every kernel waits first, only index arithmetic and an L2 prefetch before it)."""
        gdc_wait()
        gdc_launch_dependents()
else:
    @triton.jit
    def wait_for_previous_kernels():
        pass  # launches are serialized by the stream


# L2 prefetch (Hopper's bulk prefetch, ``cp.async.bulk.prefetch.L2``): a kernel asks the L2 to fetch bytes it will read
# soon, one instruction a range, no register or shared memory held. A mat-vec program asks for its weight's first K
# steps before :func:`wait_for_previous_kernels`, so under programmatic dependent launch they come while the kernel
# before it still runs (:class:`~gdnpass.kernels.tiles.MatVecTile`'s ``early``; only weights, which no kernel
# writes). A hint only, safe even for bytes being written: the L2 is where every write lands, and the loads come after
# the wait. Off in the interpreter, below sm_90, and when GDN_PREFETCH=0;
# :func:`l2_prefetch` switches it per capture (the benchmarks' A/B).
PREFETCH_SUPPORTED = (not INTERPRETED and os.environ.get("GDN_PREFETCH", "1") != "0" and torch.cuda.is_available()
                      and torch.cuda.get_device_capability() >= (9, 0))
PREFETCH = {"on": PREFETCH_SUPPORTED}  # read by the launchers at each launch (and so at a capture)


@contextlib.contextmanager
def l2_prefetch(enabled: bool):
    """Launch (and so capture) the kernels with their L2 prefetches on or off inside the block, where supported (the
    benchmarks' A/B: the same bytes either way)."""
    before = PREFETCH["on"]
    PREFETCH["on"] = enabled and PREFETCH_SUPPORTED
    try:
        yield
    finally:
        PREFETCH["on"] = before


@triton.jit
def prefetch_l2(ptr, nbytes, mask):
    """Ask the L2 for [ptr, ptr + nbytes) of each element where ``mask`` (a byte pointer tensor): the range shrunk to
    whole 16-byte units, as the bulk prefetch takes them, so it never reaches past the bytes named (a partial unit at
    either end is left to the load). Compiled only where :data:`PREFETCH_SUPPORTED` (no PTX in the interpreter)."""
    a = ptr.to(tl.int64, bitcast=True)
    lo = (a + 15) & -16
    n = ((a + nbytes) & -16) - lo
    tl.inline_asm_elementwise(
        "{ .reg .pred q, p; setp.ne.b32 q, $3, 0; setp.gt.and.s32 p, $2, 0, q; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r", [lo, n.to(tl.int32), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


# ---- launch conventions ---------------------------------------------------------------------------------------------


def require_whole_rows(op: str, dtype: DType, w: torch.Tensor) -> None:
    """A launcher's refusal of a view of a held-split type's rows (ir.HELD_SPLIT; ``w``: their bytes, rows along
    dim -2) that does not take them whole: a row's scales lie after its K quants (quants.held_rows). (The launcher
    sees no base tensor, so it asks for packed rows; the runtime checks views against their base.)"""
    _require(dtype not in HELD_SPLIT or w.shape[-2] == 1 or w.stride(-2) == w.shape[-1],
             f"{op}: {dtype.name} rows are read whole (gdnpass holds them split, quants.held_rows: scales after "
             f"quants)")


def _require(cond: bool, msg: str) -> None:
    """A launcher's memory-safety check: raised, never ``assert`` (which ``python -O`` strips)."""
    if not cond:
        raise KernelError(msg)


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """Element strides in ggml order (s0, s1, s2, s3) of a 4-D (ne3, ne2, ne1, ne0) view."""
    _require(t.dim() == 4, f"expected a 4-D (ne3, ne2, ne1, ne0) view, got shape {tuple(t.shape)}")
    return t.stride()[::-1]


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte addresses [lo, hi) a non-empty view may touch."""
    lo = t.data_ptr()
    return lo, lo + (1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride()))) * t.element_size()


def _repeats(b: torch.Tensor, into: torch.Tensor) -> bool:
    """``b`` repeats into ``into`` as ggml broadcasts (each of its dims divides ``into``'s)."""
    return all(m > 0 and n % m == 0 for n, m in zip(into.shape, b.shape))


def _alias_ok(op: str, out: torch.Tensor, *srcs: torch.Tensor, same_ok: bool = True) -> None:
    """``out`` shares memory with an input only as the very same view (element i is read before element i is
    written, in one program; not even that unless ``same_ok``), never otherwise: one program could read what another
    has already written, where the torch reference reads everything first."""
    lo, hi = _extent(out)
    for s in srcs:
        s_lo, s_hi = _extent(s)
        if s_lo < hi and lo < s_hi:
            _require(same_ok and s.data_ptr() == out.data_ptr() and s.shape == out.shape
                     and s.stride() == out.stride() and s.element_size() == out.element_size(),
                     f"{op}: the output overlaps an input other than element for element")


# The split workspace of each device, (partials f32, tickets i32), for the kernels that split a reduction across
# programs and let the last one to arrive add the parts in a fixed order (the mat-vec's K slices, flash attention's KV
# slices). The tickets are zeroed once, here; every launch leaves them zero again. Shared by all launches on the
# device, so it assumes they run on one stream in order (the executor's case; under programmatic dependent launch
# each kernel waits for its predecessor before touching it). Grown (never shrunk) when a launch needs more; an
# outgrown pair stays alive in _RETIRED, since a captured CUDA graph keeps its addresses. Growing allocates, which
# CUDA-graph capture forbids: the first launch of a shape must come before capture (the executor warms up first).
_SPLIT_WORKSPACE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[tuple[torch.Tensor, ...]] = []


def split_workspace(device: torch.device, partials: int, tickets: int, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """At least ``partials`` f32 and ``tickets`` zeroed i32 of ``device``'s split workspace (``who``: the op, for the
    refusals)."""
    ws = _SPLIT_WORKSPACE.get(device)
    if ws is not None and ws[0].numel() >= partials and ws[1].numel() >= tickets:
        return ws
    _require(device.type != "cuda" or not torch.cuda.is_current_stream_capturing(),
             f"{who}: the split workspace would grow (to {partials} partials) inside CUDA-graph capture; "
             "launch the graph once before capturing it")
    _require(partials < 2 ** 31, f"{who}: a split workspace of {partials} partials overflows i32 offsets")
    if ws is not None:
        _RETIRED.append(ws)
        partials, tickets = max(partials, 2 * ws[0].numel()), max(tickets, 2 * ws[1].numel())
    ws = (torch.empty(partials, dtype=torch.float32, device=device),
          torch.zeros(tickets, dtype=torch.int32, device=device))
    _SPLIT_WORKSPACE[device] = ws
    return ws


# The activation workspace of each device: a product's activations as its pre-pass writes them and the product reads
# them (a quantized weight's: int8 groups with their scales and sums; a bf16 GEMM's: x's three bf16 terms), under the
# split workspace's rules: one stream, grown before capture, outgrown buffers kept alive. With it, what it holds: the
# key of the pre-pass that last filled it (None: unknown), which a product that skips its own pre-pass must find
# (gdnpass.prepasses: the plan's rules checked again as the launches are made). Two slots: FILL_SLOT, which every
# pre-pass and producer fills, and HAND_OFF_SLOT, which a product's own epilogue fills for the product after it (a
# Q8_0 FFN pair's SwiGLU, a z chain's output: their programs still read their activations in FILL_SLOT while the
# last of a row block writes). A fill of FILL_SLOT forgets what HAND_OFF_SLOT held: it holds only what a product
# handed on since.
FILL_SLOT, HAND_OFF_SLOT = 0, 1
_ACTIVATION_WORKSPACE: dict[tuple[torch.device, int], torch.Tensor] = {}
_ACTIVATIONS_HELD: dict[tuple[torch.device, int], tuple | None] = {}


def activation_workspace(device: torch.device, nbytes: int, who: str, holds: tuple | None = None,
                         slot: int = FILL_SLOT) -> torch.Tensor:
    """At least ``nbytes`` bytes (uint8, 16-byte aligned) of ``device``'s activation workspace ``slot``, which the
    caller fills with what key ``holds`` names (None: nothing a later product may reuse)."""
    _ACTIVATIONS_HELD[device, slot] = holds
    if slot == FILL_SLOT:
        _ACTIVATIONS_HELD[device, HAND_OFF_SLOT] = None
    ws = _ACTIVATION_WORKSPACE.get((device, slot))
    if ws is not None and ws.numel() >= nbytes:
        return ws
    _require(device.type != "cuda" or not torch.cuda.is_current_stream_capturing(),
             f"{who}: the activation workspace would grow (to {nbytes} bytes) inside CUDA-graph capture; launch the "
             "graph once before capturing it")
    if ws is not None:
        _RETIRED.append((ws,))
        nbytes = max(nbytes, 2 * ws.numel())
    ws = _ACTIVATION_WORKSPACE[device, slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return ws


def held_activations(device: torch.device, holds: tuple, who: str) -> torch.Tensor:
    """``device``'s activation workspace as the pre-pass (or hand-off) of key ``holds`` filled it, for a product that
    skips its own pre-pass; a KernelError (one line) where neither slot last took it."""
    for slot in (FILL_SLOT, HAND_OFF_SLOT):
        if _ACTIVATIONS_HELD.get((device, slot)) == holds:
            return _ACTIVATION_WORKSPACE[device, slot]
    raise KernelError(f"{who}: planned to read the activations an earlier pre-pass left, but the workspace holds "
                      f"others (the pre-pass plan is out of date with the nodes)")


@triton.jit
def last_to_arrive(cnt_ptr, tile, parts: tl.constexpr):
    """The split protocol's ticket (the mat-vec's K slices, flash attention's KV slices): a program that has stored
    its part of ``tile`` into the split workspace draws a ticket on the tile's counter (an acq_rel atomic add); True
    for the one that draws the last of ``parts``, whichever it is. That program merges the parts in their fixed
    order (read with .cg: at L2, never a line its SM's L1 kept from an earlier launch) and stores 0 to the counter
    for the next launch and the next CUDA-graph replay. Triton's scalar atomic is one thread's: a CTA barrier first,
    so the release covers every thread's stores (the ticket is broadcast through shared memory behind a barrier, so
    every thread's loads follow the acquire)."""
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == parts - 1


# ---- shared helpers -------------------------------------------------------------------------------------------------


# exp and log of f32 as torch computes them on the device the kernels run on. Compiled (CUDA): libdevice's __nv_expf
# and __nv_logf, CUDA's expf and logf, which torch's exp and log call: bit-identical to torch.exp / torch.log on all
# 2^32 f32 inputs (H200, torch 2.11+cu130, triton 3.6), where tl.exp (ex2.approx of x·log2 e) differs on 129 M of them.
# The interpreter has no libdevice: numpy's exp and log there, which are not torch's CPU functions (Sleef), so on the
# CPU these two differ from the reference in the last bits. (Division likewise: Triton's ``/`` on f32 is the
# approximate div.full.f32, 516 M inputs of x / (1 + x) off torch's IEEE quotient: the kernels divide with
# tl.math.div_rn.)
if INTERPRETED:
    @triton.jit
    def exp_f32(x):
        return tl.exp(x)

    @triton.jit
    def log_f32(x):
        return tl.log(x)

    @triton.jit
    def cos_sin_f64(x):
        return tl.cos(x), tl.sin(x)
else:
    @triton.jit
    def exp_f32(x):
        return libdevice.exp(x)

    @triton.jit
    def log_f32(x):
        return libdevice.log(x)

    @triton.jit
    def cos_sin_f64(x):  # CUDA's cos and sin of double, which torch's call
        return libdevice.cos(x), libdevice.sin(x)


if INTERPRETED:
    @triton.jit
    def silu_quotient(x, y):
        return tl.math.div_rn(x, y)
else:
    @triton.jit
    def silu_quotient(x, y):
        """x / y rounded to nearest even, as div_rn, for SiLU's operands (y = 1 + exp(-x)), without its branch.

        div_rn compiles to a fast path (reciprocal, one Newton step, quotient, residual, correction) and a branch
        to a slow subroutine for operands out of the fast path's range. The branch ends a basic block, so the
        compiler cannot interleave the fast paths of independent quotients: the fused chain's tokens then run one
        after another (H200 profile, docs/performance.md). Here the fast path runs for every element, and SiLU's
        operands out of its range are mapped into it or replaced, with every test on x or y (known before the
        reciprocal, off its dependency chain):
        x < -80 (y > 5e34; 1/y is subnormal from y = 2^126, which rcp flushes): x and y scaled by 2^-8, which
        leaves the quotient exact; x = +-0 or +inf: x itself (the residual is +0 or NaN there); y = inf (exp(-x)
        overflowed): x * 0, as x / inf. Bit-identical to div_rn on all 2^32 x (test_gpu_silu_unrolled_on_all_f32).
        """
        s = tl.where(x < -80.0, 0.00390625, 1.0)  # 2^-8
        keep = (x == 0.0) | (x == float("inf")) | (y == float("inf"))
        kept = tl.where(y == float("inf"), x * 0.0, x)
        xs, ys = x * s, y * s
        r0 = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [ys], dtype=tl.float32,
                                       is_pure=True, pack=1)
        r = tl.fma(r0, tl.fma(-ys, r0, 1.0), r0)
        q0 = xs * r
        return tl.where(keep, kept, tl.fma(r, tl.fma(-ys, q0, xs), q0))


@triton.jit
def silu_f32(x):
    """SiLU of each element, div_rn's quotient. (silu_quotient's bits too, but slower in the elementwise kernels:
    there the branch keeps a thread's loads issued together, H200, docs/performance.md.)"""
    return tl.math.div_rn(x, 1.0 + exp_f32(-x))


@triton.jit
def silu_f32_unrolled(x):
    """silu_f32, for a thread that computes many independent SiLUs (the fused chain's tokens): the same bits, its
    quotients free to interleave."""
    return silu_quotient(x, 1.0 + exp_f32(-x))


@triton.constexpr_function
def log2(n):
    return n.bit_length() - 1


@triton.jit
def tree_sum_rows(s):
    """Σ of each row of s [BLOCK_R, BLOCK_D] (BLOCK_D a power of two) as a fixed tree: adjacent pairs, level by
    level. Each level adds given element pairs, so the bits do not depend on the layout (unlike tl.sum's order)."""
    for _ in tl.static_range(log2(s.shape[1])):
        a, b = tl.split(tl.reshape(s, [s.shape[0], s.shape[1] // 2, 2]))
        s = a + b
    return tl.reshape(s, [s.shape[0]])


@triton.jit
def sum_sq_rows(x):
    """Σx² of each row of x [BLOCK_R, BLOCK_D] as :func:`tree_sum_rows`' fixed tree."""
    return tree_sum_rows(x * x)


# ---- elementwise steps: UNARY, ADD / MUL with a repeated src1, a chain of them (the elementwise kernels, and -------
# ---- GATED_DELTA_NET computing its gates, run the same) -------------------------------------------------------------


@triton.jit
def _src1_at(b_ptr, i0, i1, i2, i3, b_ne0, b_ne1, b_ne2, b_ne3, b_s0, b_s1, b_s2, b_s3, mask):
    """A binary op's src1 at element (i0, i1, i2, i3) of src0: ggml's broadcast tiles src1, element i of src0 meets
    element i % ne of src1 in every dim."""
    return tl.load(b_ptr + (i0 % b_ne0) * b_s0 + (i1 % b_ne1) * b_s1 + (i2 % b_ne2) * b_s2 + (i3 % b_ne3) * b_s3,
                   mask=mask)


@triton.jit
def unary_f32(x, KIND: tl.constexpr):
    """The reference's expression of each kind (reference.UNARY), operation for operation."""
    if KIND == "SILU":
        y = silu_f32(x)
    elif KIND == "SIGMOID":
        y = tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + exp_f32(-x))
    elif KIND == "SOFTPLUS":
        y = tl.where(x > 20.0, x, log_f32(1.0 + exp_f32(x)))
    else:  # EXP
        y = exp_f32(x)
    return y


@triton.jit
def chain_step(v, b, STEPS: tl.constexpr, I: tl.constexpr):
    """Step I of an elementwise chain's STEPS on its value ``v`` (``ADD`` / ``MUL``: value op side, ``RADD`` /
    ``RMUL``: side op value, a unary kind), ``b`` the side operand's value there (a binary step's; any tensor of
    v's shape for a unary one): the very expression of the unfused kernel (_binary_kernel, :func:`unary_f32`),
    rounded to f32 as the unfused node's output is."""
    if STEPS[I] == "SILU":  # (each kind by name: a tuple's element is not a constexpr argument)
        v = unary_f32(v, "SILU")
    elif STEPS[I] == "SIGMOID":
        v = unary_f32(v, "SIGMOID")
    elif STEPS[I] == "SOFTPLUS":
        v = unary_f32(v, "SOFTPLUS")
    elif STEPS[I] == "EXP":
        v = unary_f32(v, "EXP")
    elif STEPS[I] == "ADD":
        v = v + b
    elif STEPS[I] == "MUL":
        v = v * b
    elif STEPS[I] == "RADD":
        v = b + v
    else:
        tl.static_assert(STEPS[I] == "RMUL", "an elementwise chain: an unknown step")
        v = b * v
    return v


@triton.jit
def chain_at(i0, i1, i2, i3, mask, P, STEPS: tl.constexpr, SIDES: tl.constexpr):
    """An elementwise chain's value at (i0, i1, i2, i3) of the chain input x's shape, hence its output's: x there
    through STEPS in order (:func:`chain_step`), side operand SIDES[i] (1 or 2) for a binary step, repeated into x's
    shape as ggml broadcasts src1. ``P`` (:func:`chain_args`): x and its ne0..ne2 and strides, then each side operand
    with its ne and strides, one flat tuple. ELEMENTWISE_CHAIN (triton_elementwise) runs it over its elements;
    GATED_DELTA_NET_CACHE (triton_ssm) where it reads its gates (the gdn_gates pattern). A product's store runs the
    same steps on its sums (triton_matvec, MUL_MAT_CHAIN)."""
    v = tl.load(P[0] + i0 * P[4] + i1 * P[5] + i2 * P[6] + i3 * P[7], mask=mask)
    for i in tl.static_range(len(STEPS)):
        b = v
        if SIDES[i] == 1:
            b = _side_at(P, 8, i0, i1, i2, i3, mask)
        elif SIDES[i] == 2:
            b = _side_at(P, 8 + _SIDE_LEN, i0, i1, i2, i3, mask)
        v = chain_step(v, b, STEPS, i)
    return v


@triton.jit
def _side_at(P, AT: tl.constexpr, i0, i1, i2, i3, mask):
    """:func:`chain_at`'s side operand whose pointer is P[AT] (its ne and strides after it) at (i0, i1, i2, i3)."""
    return _src1_at(P[AT], i0, i1, i2, i3, P[AT + 1], P[AT + 2], P[AT + 3], P[AT + 4], P[AT + 5], P[AT + 6],
                    P[AT + 7], P[AT + 8], mask)


def chain_sides(steps: list[str]) -> tuple[int, ...]:
    """Which side operand (1, 2; 0 for a unary step) each step reads: the binary steps' in order."""
    from gdnpass.patterns.elementwise_chain.scope import BINARY

    out, k = [], 0
    for s in steps:
        k += s in BINARY
        out.append(k if s in BINARY else 0)
    return tuple(out)


_SIDE_LEN = tl.constexpr(9)  # a side operand's entries in chain_args: its pointer, ne, strides
CHAIN_ARGS = ("*fp32",) + ("i32",) * 7 + (("*fp32",) + ("i32",) * 8) * 2  # chain_args' types: a compiler signature


def chain_args(x: torch.Tensor, sides: list[torch.Tensor]) -> tuple:
    """:func:`chain_at`'s ``P``, one flat tuple: x (its ne0..ne2, strides), then the side operands (each its ne,
    strides; x again in place of a side a chain lacks: never read). Flat, not a tuple a side: Triton 3.6 miscompiles
    a nested tuple argument holding specialized ints (a stride of 1) passed to a call inside a runtime loop (the GDN's
    prompt loop: 'NoneType' object has no attribute 'type'), which a flat one does not."""
    b1, b2 = (list(sides) + [x, x])[:2]
    return (x, x.shape[3], x.shape[2], x.shape[1], *_strides(x),
            *(v for b in (b1, b2) for v in (b, *b.shape[::-1], *_strides(b))))


# ---- the expert router's arithmetic (SOFT_MAX, ARGSORT, CLAMP; the fused MOE_ROUTER calls the same) ----------------


@triton.jit
def soft_max_w(x_ptr, x_row, m_row, slope, cols, ok, x_s0, m_s0, scale, HAS_MASK: tl.constexpr,
               ALIBI: tl.constexpr):
    """SOFT_MAX's w = x·scale + slope·mask of a [BLOCK_R, BLOCK_C] tile, -inf outside the rows."""
    c64 = cols.to(tl.int64)[None, :]
    w = tl.load(x_ptr + x_row[:, None] + c64 * x_s0, mask=ok, other=0.0).to(tl.float32) * scale
    if HAS_MASK:
        mk = tl.load(m_row[:, None] + c64 * m_s0, mask=ok, other=0.0).to(tl.float32)
        if ALIBI:
            mk = slope[:, None] * mk
        w = w + mk
    return tl.where(ok, w, float("-inf"))


@triton.jit
def soft_max_sum(w, mx, ok):
    """SOFT_MAX's Σ exp(w - max) of each row of one column block, in f64, as a fixed tree (lanes past the row add
    nothing; an all -inf row is NaN, as the reference's)."""
    return tree_sum_rows(tl.where(ok, exp_f32(w - mx[:, None]), 0.0).to(tl.float64))


@triton.jit
def argsort_rows(x, mask, cols, DESC: tl.constexpr):
    """ARGSORT of each row of x [BLOCK_R, BLOCK_N] (f32, lanes outside ``mask`` last): i32 indices, ascending or
    descending, equal values in index order. The key of element i is (value, i) as one int64, the value's f32 bits
    above, mapped to a signed integer in the order of the values (negative floats' magnitude bits flipped); -0.0 is
    +0.0 (they compare equal) and every NaN the largest value (torch's sort puts NaNs after +inf); a descending sort
    flips the value half. Keys are distinct, so any sorting network gives the one stable order."""
    bits = tl.where(x != x, 0x7FFFFFFF, tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True)))
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order = the values' order
    if DESC:
        key = ~key
    k = (key.to(tl.int64) << 32) | cols[None, :].to(tl.int64)
    k = tl.sort(tl.where(mask, k, 0x7FFFFFFFFFFFFFFF))  # (the padding after every real key)
    return k.to(tl.int32)  # (the low half)


@triton.jit
def clamp_f32(x, lo, hi):
    """CLAMP: MAX(MIN(x, hi), lo) with C's macros (``a < b ? a : b``): a NaN fails MIN's comparison, comes out hi."""
    m = tl.where(x < hi, x, hi)
    return tl.where(m > lo, m, lo)


@triton.jit
def l2_scale_rows(x, eps):
    """x: [BLOCK_R, BLOCK_D] rows (masked lanes 0) -> x * rsqrt(max(Σx², eps²)) per row (ggml-cuda's form)."""
    return x * tl.math.rsqrt(tl.maximum(sum_sq_rows(x), eps * eps))[:, None]


@triton.jit
def rms_scale_rows(x, n, eps):
    """x: [BLOCK_R, BLOCK_D] rows of ``n`` elements (masked lanes 0) -> rsqrt(Σx² / n + eps) * x per row: ggml-cuda's
    rms_norm_f32 (mean = Σ / ncols in f32, rsqrtf(mean + eps), scale * x), Σ the same fixed tree as L2_NORM's."""
    return rms_row_scales(x, n, eps)[:, None] * x


@triton.jit
def rms_row_scales(x, n, eps):
    """The [BLOCK_R] scales of :func:`rms_scale_rows`, rsqrt(Σx² / n + eps), for a kernel that applies them to a
    part of each row (x: the whole rows, as there)."""
    mean = tl.math.div_rn(sum_sq_rows(x), n * 1.0)  # IEEE, as the reference's (``/`` is approximate compiled)
    return tl.math.rsqrt(mean + eps)


@triton.jit
def conv_dot(win, w):
    """Causal depthwise conv of one token: Σ_j win[j]·w[j], taps in order from 0.0 (win, w: tuples of D_CONV
    tensors, the window's columns and the tap weights). SSM_CONV and the fused chain both call it."""
    acc = tl.zeros(win[0].shape, tl.float32)
    for j in tl.static_range(len(w)):
        acc += win[j] * w[j]
    return acc


@triton.jit
def _row_offset(r, ne1, ne2, s1, s2, s3):
    """Element offset of flat row index r = i1 + ne1*(i2 + ne2*i3)."""
    return (r % ne1) * s1 + (r // ne1 % ne2) * s2 + (r // (ne1 * ne2)) * s3


# ---- ggml's block formats -------------------------------------------------------------------------------------------
# What the kernels that read a quantized weight's blocks (as gdnpass holds them, quants.held_rows) share (the
# mat-vec's int8 dots, triton_matvec.matvec_cols_q; GET_ROWS' decoded groups, triton_elementwise): the types'
# constants, groups of 32 elements (the unit each of these formats scales by; Q6_K's 16-element scales are two per
# group), the f16 fields and the K-quants' packed scales. The torch reference is gdnpass.kernels.quants (the layouts
# are described there).

SUB = tl.constexpr(Q8_1_GROUP)  # elements per group

# the kernels' QTYPE: each quantized type's label; the blocks' bytes (DType.size) of the types held as the file has
# them as the kernels' constants (the held-split types', ir.HELD_SPLIT, lie in planes: offsets in K, not blocks)
QTYPES = {t: t.label for t in DType if t.is_quantized}
Q4_K_BYTES, Q5_K_BYTES = (tl.constexpr(t.size) for t in (DType.Q4_K, DType.Q5_K))
# where a held Q6_K row's planes start (ir.HELD_SPLIT: ql, qh, scales, d), in bytes a block of 256: plane p of a row
# of K elements at (K // 256) * Q6_K_PLANES[p], block b's part of it at b times the plane's width
Q6_K_PLANES = tl.constexpr(tuple(sum(w for _, w in HELD_SPLIT[DType.Q6_K][:p]) for p in range(4)))
QK_K = tl.constexpr(DType.Q4_K.block)
GROUPS_K = tl.constexpr(DType.Q4_K.block // 32)  # groups of a K-quant block


@triton.jit
def _byte(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def f16_bits(h):
    """An f16 given as the low 16 bits of an int32, as f32."""
    return (h & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16(p, mask):
    """The little-endian f16 at byte address ``p`` (any even address), as f32."""
    return f16_bits(_byte(p, mask) | (_byte(p + 1, mask) << 8))


@triton.jit
def _scales_mins_k4(s0, s1, s2):
    """get_scale_min_k4 for all 8 sub-blocks of Q4_K / Q5_K blocks at once, their 12 packed scale bytes given as
    three little-endian int32 words (bytes 0-3, 4-7, 8-11): the 6-bit scales of sub-blocks 0-3 and 4-7 and their
    mins, each as the 4 bytes of a word (sub-block j in byte j % 4). Bytewise: no bit crosses a byte, so 11
    operations a block instead of a dozen a sub-block."""
    sc_lo = s0 & 0x3F3F3F3F                                          # scales[j] & 63
    m_lo = s1 & 0x3F3F3F3F                                           # scales[j + 4] & 63
    sc_hi = (s2 & 0x0F0F0F0F) | ((s0 >> 2) & 0x30303030)              # scales[j + 8] & 0xF | (scales[j] >> 6) << 4
    m_hi = ((s2 >> 4) & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030)        # scales[j + 8] >> 4 | (scales[j + 4] >> 6) << 4
    return sc_lo, sc_hi, m_lo, m_hi


@triton.jit
def _byte_of(word, i):
    """Byte ``i`` (0..3) of the int32 ``word``, as int32 (0..255)."""
    return (word >> (8 * i)) & 0xFF


@triton.jit
def _scale_min_k4(s0, s1, s2, j):
    """get_scale_min_k4: sub-block ``j``'s 6-bit scale and min of Q4_K / Q5_K blocks (:func:`_scales_mins_k4`),
    elementwise over the words and ``j`` (0..7: a constant or a tensor), as int32."""
    sc_lo, sc_hi, m_lo, m_hi = _scales_mins_k4(s0, s1, s2)
    lo = j < 4
    return _byte_of(tl.where(lo, sc_lo, sc_hi), j % 4), _byte_of(tl.where(lo, m_lo, m_hi), j % 4)


# ---- the activation workspace's layout: the quantized products' int8 activations ---------------------------------
# (written by their pre-passes, triton_matvec, or by a producer of them, RMS_NORM_MUL / SwiGLU: gdnpass.prepasses)

XCOLS = tl.constexpr(CHUNK_COLS)  # the activations' columns in the workspace: every product's, padded with zeros


# The quantized product's activations, as its pre-pass leaves them in the activation workspace: the quants of group g
# (elements [32 g, 32 g + 32)) of column c at byte (16 g + c) * 32, each group's [32, 16] dot operand 512 contiguous
# bytes read unmasked (the columns past N are zeros); from byte 16 K, f32 / i32 words: Q8_0's q8_1 scale d per
# (group, column) at 16 g + c; the K-quants' q8_K scale d per (block, column) at 16 b + c, then the quants' sum per
# (group, column) at 16 K / 256 + 16 g + c. More than 16 columns (a product's of 17-32, MUL_MAT_ID's, one a slot and
# token) lie in chunks of 16 columns, each so laid out, one after another: column c is column c % 16 of chunk c // 16.
def activation_bytes(K: int, form: str | None = None) -> int:
    """The workspace bytes a quantized product's activations take (a chunk of 16 columns), for any block type; of
    them, those ``form`` writes ("q8_1": the quants and a scale a group; "q8_K": the quants, a scale a block and a
    sum a group)."""
    return 16 * K + 4 * 16 * (K // SUB.value + (0 if form == "q8_1" else K // QK_K.value))


@triton.jit
def _round_even(v):
    """rint: to the nearest integer, halves to even (exact: the truncation and the fraction are; |v| < 2^31)."""
    t = v.to(tl.int32)
    f = v - t.to(tl.float32)
    odd = (t & 1) != 0
    up = (f > 0.5) | ((f == 0.5) & odd)
    down = (f < -0.5) | ((f == -0.5) & odd)
    return (t + up.to(tl.int32) - down.to(tl.int32)).to(tl.float32)


@triton.jit
def _column_chunk(ws_ptr, c, chunk):
    """Column ``c``'s chunk of the activation workspace (``chunk`` bytes each), and its place there (0..15)."""
    return ws_ptr + (c // XCOLS).to(tl.int64) * chunk, c % XCOLS


@triton.jit
def store_q8_K(ws_ptr, c, chunk, K, b, xt, ok):
    """Blocks ``b`` ([B]) of 256 of activation column ``c``, ``xt`` [B, GROUPS_K, SUB] (f32), as ggml-cpu's q8_K
    (quantize_row_q8_K_ref) into the column's place of the activation workspace (``chunk`` bytes a chunk of 16
    columns, K elements a column): mx the first element of the largest magnitude, iscale = -127 / mx, q = min(127,
    rint(iscale * x)) as int8, d = 1 / iscale (0 and 0 where mx is 0), and each group's sum of quants (int32); only
    the blocks where ``ok`` ([B] or a scalar) holds. The pre-pass's, and a producer's that writes its output's
    blocks itself (RMS_NORM_MUL, SwiGLU: gdnpass.prepasses): one expression, so one set of bytes."""
    ws_ptr, cc = _column_chunk(ws_ptr, c, chunk)
    k = tl.reshape(tl.arange(0, QK_K), (1, GROUPS_K, SUB))
    ax = tl.abs(xt)
    amax = tl.max(tl.max(ax, axis=2), axis=1)
    first = tl.min(tl.min(tl.where(ax == amax[:, None, None], k, QK_K), axis=2), axis=1)
    mx = tl.sum(tl.sum(tl.where(k == first[:, None, None], xt, 0.0), axis=2), axis=1)
    on = mx != 0
    iscale = tl.where(on, tl.math.div_rn(tl.full(mx.shape, -127.0, tl.float32), tl.where(on, mx, 1.0)), 0.0)
    q = tl.minimum(_round_even(xt * iscale[:, None, None]), 127.0).to(tl.int32)
    at = (b[:, None] * GROUPS_K + tl.arange(0, GROUPS_K)[None, :]) * XCOLS + cc  # [B, group]
    ok = ok & (b >= 0)  # ([B])
    tl.store(ws_ptr + at[:, :, None].to(tl.int64) * SUB + tl.arange(0, SUB)[None, None, :], q.to(tl.int8),
             mask=ok[:, None, None])
    xd = (ws_ptr + XCOLS * K).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(xd + b * XCOLS + cc, tl.where(on, tl.math.div_rn(tl.full(mx.shape, 1.0, tl.float32),
                                                              tl.where(on, iscale, 1.0)), 0.0), mask=ok)
    xb = (ws_ptr + XCOLS * K + 4 * XCOLS * (K // QK_K)).to(tl.pointer_type(tl.int32), bitcast=True)
    tl.store(xb + at, tl.sum(q, axis=2), mask=ok[:, None])


@triton.jit
def _round_away(v):
    """roundf: to the nearest integer, halves away from zero (exact: the truncation and the fraction are)."""
    t = v.to(tl.int32).to(tl.float32)
    f = v - t
    return t + tl.where(f >= 0.5, 1.0, tl.where(f <= -0.5, -1.0, 0.0))


@triton.jit
def _store_q8_1(ws_ptr, K, xt, at, inside):
    """llama.cpp's q8_1 of the groups of 32 on ``xt``'s last axis (f32, [..., groups, 32]; CUDA's quantize_q8_1,
    mmvq's): q = roundf(x * (127 / amax)) as int8 (0 where amax is 0) at byte ``at`` * 32 of the activation workspace
    ``ws_ptr`` (K elements a column), d = amax / 127 at f32 word ``at`` past the quants; the groups where ``inside``."""
    amax = tl.max(tl.abs(xt), axis=2)
    inv = tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.where(amax > 0, amax, 1.0))
    q = tl.where(amax[:, :, None] > 0, _round_away(xt * inv[:, :, None]), 0.0)
    tl.store(ws_ptr + at[:, :, None].to(tl.int64) * SUB + tl.arange(0, SUB)[None, None, :], q.to(tl.int8),
             mask=inside[:, :, None])
    xd = (ws_ptr + XCOLS * K).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(xd + at, tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), mask=inside)


@triton.jit
def store_q8_1(ws_ptr, c, chunk, K, b, xt, ok):
    """Blocks ``b`` ([B]) of 256 of activation column ``c``, ``xt`` [B, GROUPS_K, SUB] (f32), as q8_1 groups of 32
    (:func:`_store_q8_1`) into the column's place of the activation workspace; the groups inside K of the blocks
    where ``ok`` ([B] or a scalar) holds. The Q8_0 products' pre-pass's, and a producer's that writes its output's
    groups itself: one expression, so one set of bytes."""
    ws_ptr, cc = _column_chunk(ws_ptr, c, chunk)
    g = b[:, None] * GROUPS_K + tl.arange(0, GROUPS_K)[None, :]     # [B, group]
    _store_q8_1(ws_ptr, K, xt, g * XCOLS + cc, (g * SUB < K) & (ok & (b >= 0))[:, None])


@triton.jit
def store_q8_1_rows(ws_ptr, K, g0, yt):
    """A product's output, groups [g0, g0 + G) of 32 rows of all its columns, ``yt`` [G, C, 32] (f32; C = XCOLS: one
    chunk, the columns past the product's zeros), as the activations of a product after it that reads them as its K
    elements (K: the rows there are): :func:`store_q8_1`'s groups and bytes (:func:`_store_q8_1`), for a product's
    epilogue that hands its output on quantized (the HAND_OFF_SLOT workspace); the groups inside K only."""
    tl.static_assert(yt.shape[1] == XCOLS and yt.shape[2] == SUB, "store_q8_1_rows: whole groups of one chunk")
    g = g0 + tl.arange(0, yt.shape[0])
    _store_q8_1(ws_ptr, K, yt, g[:, None] * XCOLS + tl.arange(0, XCOLS)[None, :], (g * SUB < K)[:, None])


@triton.jit
def store_activations(ws_ptr, c, chunk, K, b, xt, ok, FORM: tl.constexpr):
    """:func:`store_q8_K` or :func:`store_q8_1` (FORM "q8_K" / "q8_1": gdnpass.prepasses.form) of the blocks."""
    if FORM == "q8_1":
        store_q8_1(ws_ptr, c, chunk, K, b, xt, ok)
    else:
        tl.static_assert(FORM == "q8_K", "store_activations: an unknown form")
        store_q8_K(ws_ptr, c, chunk, K, b, xt, ok)


def product_columns(x: torch.Tensor) -> tuple[int, tuple]:
    """(N, cols_x): the columns of an unbatched product's activations ``x`` (torch (ne3, ne2, ne1, K)), all of them,
    and as the mat-vec and its pre-pass address them: ne1, ne2 and the strides s1, s2, s3."""
    xs = _strides(x)
    return x.shape[0] * x.shape[1] * x.shape[2], (x.shape[2], x.shape[1], xs[1], xs[2], xs[3])


def chunk_columns(N: int) -> int:
    """The columns of the activation chunks a pre-pass writes for N columns (chunks of 16; a program a column)."""
    return XCOLS.value * triton.cdiv(N, XCOLS.value)


def activations_to_fill(x: torch.Tensor, form: str, N: int, cols_x: tuple, who: str,
                        slot: int = FILL_SLOT) -> tuple[torch.Tensor, int, int]:
    """The activation workspace ``slot`` about to hold x's N columns (``cols_x``) quantized to ``form``, recorded as
    such (:func:`activations_key`): (workspace, its bytes a chunk of 16 columns, the chunks). What every writer of them
    claims: a product's pre-pass, a producer (gdnpass.prepasses), a product's hand-off (HAND_OFF_SLOT)."""
    chunk, chunks = activation_bytes(x.shape[3]), chunk_columns(N) // XCOLS.value
    ws = activation_workspace(x.device, chunks * chunk, who, holds=activations_key(x, form, N, cols_x), slot=slot)
    return ws, chunk, chunks


def activations_key(x: torch.Tensor, form: str, N: int, cols_x: tuple) -> tuple:
    """Which activations fill the workspace once x's N columns (``cols_x``, as
    :func:`~gdnpass.kernels.triton_matvec.quantize_activations` takes them) are quantized to ``form`` ("q8_K" /
    "q8_1": gdnpass.prepasses.form): the key of :func:`activation_workspace`. It names the view, not its contents:
    that they are unwritten since is the plan's rule 5."""
    return x.data_ptr(), tuple(x.shape), x.stride(), form, N, tuple(cols_x)
