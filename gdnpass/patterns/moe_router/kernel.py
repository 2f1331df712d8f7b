"""The MOE_ROUTER kernel: the expert FFN's router in one launch, with its torch reference beside it.

    probs = SOFT_MAX(logits); order = ARGSORT(probs, DESC); w = GET_ROWS(probs, order[:n_used])
    y = w / CLAMP(SUM_ROWS(w), lo, hi)                      ->  writes order (all of it) and y

A program holds SOFT_MAX's own tile of rows (:func:`gdnpass.kernels.limits.soft_max_tile`: a row of up
to ARGSORT_MAX_ROW = SM_TILE experts in one column block) and computes each op with the exactness core's helper the
unfused kernel calls: SOFT_MAX's w, Σ (a fixed tree, in f64) and reciprocal (:func:`~triton_core.soft_max_w`,
:func:`~triton_core.soft_max_sum`, :func:`~triton_core.exp_f32`), ARGSORT's keys and network
(:func:`~triton_core.argsort_rows`), CLAMP's comparisons (:func:`~triton_core.clamp_f32`), SUM_ROWS' double sum from
0.0 in slot order, DIV's IEEE quotient. GET_ROWS moves bits: a chosen probability is picked from the row in
registers as its int32 bits (a sum of one value and zeros, exact). So the bytes are the unfused Triton kernels', on
the GPU and in the interpreter alike; the probabilities, the gathered weights and their sum are never written.

A program loads its tile's logits once, before it stores anything (a barrier between). The outputs overlap neither
each other nor, one program a tile, the logits; gallocr puts the DIV inside the logits (the probabilities are dead
by then) from 8 tokens on, which the serial form takes when every tile's stores stay clear of the logits of the
tiles after it (:func:`~gdnpass.patterns.moe_router.scope.serial_safe`; the matcher's
``moe-router.output-overlaps-input``, the launcher's guard).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnpass.kernels import reference as ref
from gdnpass.kernels.limits import ARGSORT_MAX_ROW, soft_max_tile
from gdnpass.kernels.reference import f32
from gdnpass.kernels.triton_core import (LAUNCH, _alias_ok, _extent, _require, _strides, argsort_rows, clamp_f32, exp_f32,
                                         soft_max_sum, soft_max_w, wait_for_previous_kernels)
from gdnpass.patterns.moe_router.scope import router_fits, serial_safe

def reference(logits: torch.Tensor, n_used: int, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused ops' torch references in the graph's order, on logits (1, 1, n_t, n_expert): (the ARGSORT's
    output, i32 (1, 1, n_t, n_expert); the normalised weights, f32 (1, 1, n_t, n_used))."""
    n_t, n_exp = logits.shape[2], logits.shape[3]
    probs = ref.soft_max(logits, None, None, 1.0, 0.0)
    order = ref.argsort(probs, 1)
    w = ref.get_rows(probs.reshape(1, n_t, n_exp, 1), order[..., :n_used])  # (1, n_t, n_used, 1)
    w = w.reshape(1, 1, n_t, n_used)
    return order, ref.div(w, ref.clamp(ref.sum_rows(w), lo, hi))


@triton.jit
def _pick(idx, pbits, cols, j):
    """Row by row, the probability at the row's j-th sorted slot: its f32 bits, exactly (one value plus zeros)."""
    sel = tl.sum(tl.where(cols[None, :] == j, idx, 0), 1)
    return tl.sum(tl.where(cols[None, :] == sel[:, None], pbits, 0), 1).to(tl.float32, bitcast=True)


@triton.jit
def _moe_router_kernel(x_ptr, s_ptr, y_ptr, n_rows, ne0, n_used, per_program, scale, lo, hi, x_s0, x_s1, s_s0, s_s1,
                       y_s0, y_s1, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    wait_for_previous_kernels()
    c = tl.arange(0, BLOCK_C)
    for t in range(0, per_program):  # the program's tiles, in order (serial: all of them)
        tl.debug_barrier()  # (every warp done with the tile before: its stores may cover the logits behind it)
        r = (tl.program_id(0) * per_program + t) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < n_rows
        r64 = r.to(tl.int64)
        ok = rmask[:, None] & (c < ne0)[None, :]
        # SOFT_MAX (its kernel's passes, on the one column block; scale 1.0 passed as that kernel gets it)
        w = soft_max_w(x_ptr, r64 * x_s1, x_ptr, 1.0, c, ok, x_s0, 0, scale, False, False)
        mx = tl.maximum(tl.full([BLOCK_R], float("-inf"), tl.float32), tl.max(w, 1))
        total = tl.zeros([BLOCK_R], tl.float64)
        total += soft_max_sum(w, mx, ok)
        inv = (1.0 / total).to(tl.float32)
        probs = exp_f32(w - mx[:, None]) * inv[:, None]
        tl.debug_barrier()  # (the tile's logits all loaded before any store: the outputs may cover them)
        # ARGSORT (DESC), all of it: the top-k view reads its head
        idx = argsort_rows(probs, ok, c, True)
        tl.store(s_ptr + r64[:, None] * s_s1 + c.to(tl.int64)[None, :] * s_s0, idx, mask=ok)
        # GET_ROWS of the first n_used, SUM_ROWS (f64 from 0.0, slot order), CLAMP, DIV
        pbits = probs.to(tl.int32, bitcast=True)
        acc = tl.zeros([BLOCK_R], tl.float64)
        for j in range(0, n_used):
            acc += _pick(idx, pbits, c, j).to(tl.float64)
        den = clamp_f32(acc.to(tl.float32), lo, hi)
        for j in range(0, n_used):
            tl.store(y_ptr + r64 * y_s1 + j * y_s0, tl.math.div_rn(_pick(idx, pbits, c, j), den), mask=rmask)


def moe_router(logits: torch.Tensor, n_used: int, lo: float, hi: float, order: torch.Tensor,
               out: torch.Tensor, serial: bool = False) -> None:
    """The router of f32 ``logits`` (1, 1, n_t, n_expert; any strides) into ``order`` (i32, its shape: the DESC
    argsort) and ``out`` (f32 (1, 1, n_t, n_used): the first n_used probabilities, normalised by their clamped sum):
    bit for bit the unfused Triton kernels (and :func:`reference` but for SOFT_MAX's f64 sum order). A program a tile
    of rows, or, ``serial``, one program walking the tiles in order: then the outputs may cover the logits of the tiles
    already done (:func:`serial_safe`)."""
    n_t, n_exp = logits.shape[2], logits.shape[3]
    _require(logits.dim() == 4 and logits.shape[:2] == (1, 1), f"MOE_ROUTER: logits {tuple(logits.shape)} not 2-D")
    _require(router_fits(n_exp, n_used),
             f"MOE_ROUTER: {n_used} of {n_exp} experts (the kernel: 2..{ARGSORT_MAX_ROW} experts, 1..all used)")
    _require(logits.dtype == torch.float32 and order.dtype == torch.int32 and out.dtype == torch.float32
             and tuple(order.shape) == tuple(logits.shape) and tuple(out.shape) == (1, 1, n_t, n_used),
             f"MOE_ROUTER of {logits.dtype} {tuple(logits.shape)} into {order.dtype} {tuple(order.shape)}, "
             f"{out.dtype} {tuple(out.shape)}")
    _require(lo == lo and hi == hi, "MOE_ROUTER: a NaN bound")
    if n_t == 0:
        return
    block_r, block_c = soft_max_tile(n_exp)
    _alias_ok("MOE_ROUTER", order, out, same_ok=False)
    if not (serial and serial_safe(_extent(logits), (_extent(order), _extent(out)), logits.stride(2) * 4,
                                   (order.stride(2) * 4, out.stride(2) * 4), block_r, n_t)):
        _alias_ok("MOE_ROUTER", order, logits, same_ok=False)
        _alias_ok("MOE_ROUTER", out, logits, same_ok=False)
    tiles = triton.cdiv(n_t, block_r)
    per = tiles if serial else 1
    xs, ss, ys = _strides(logits), _strides(order), _strides(out)
    _moe_router_kernel[(tiles // per,)](
        logits, order, out, n_t, n_exp, n_used, per, f32(1.0), f32(lo), f32(hi), xs[0], xs[1], ss[0], ss[1], ys[0], ys[1],
        BLOCK_R=block_r, BLOCK_C=block_c, **LAUNCH)


def programs(node) -> list[tuple[str, int, int]]:
    """The programs of one execution (SOFT_MAX's tile; steps: tiles a program, all of them when serial). Pure: reads
    shapes only."""
    ne = node.src[0].ne
    tiles = triton.cdiv(ne[1], soft_max_tile(ne[0])[0])
    return [("moe_router", 1, tiles)] if node.op_params.get("serial") else [("moe_router", tiles, 1)]


def variants():
    """(kernel, constexprs, warps) to compile ahead of time (tests/kernels' sm_90 check): the models' routers (8
    experts: the tiny ones; 128, 256 and 512: qwen3.5's MoE models) and the scope's widest row."""
    for n_exp in (8, 128, 256, 512, ARGSORT_MAX_ROW):
        block_r, block_c = soft_max_tile(n_exp)
        yield _moe_router_kernel, dict(BLOCK_R=block_r, BLOCK_C=block_c), LAUNCH["num_warps"]
