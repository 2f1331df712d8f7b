"""The RMS_NORM+MUL(+ADD) kernel: one launch for ``rms_norm(x) * w (+ a)``, with its torch reference beside it.

The tile is RMS_NORM's own (:func:`gdnpass.kernels.triton_norms.l2_tile`: whole rows, ``BLOCK_R`` of them per
program) and the row scale is the exactness core's :func:`~gdnpass.kernels.triton_core.rms_scale_rows`, the very
helper of the unfused RMS_NORM kernel: the normalised row is the same f32 value, then multiplied (and added) in the
operand order of the unfused MUL (and ADD), one rounding each (:data:`~gdnpass.kernels.triton_core.LAUNCH`: no FMA
contraction). So the bytes are the unfused Triton kernels', on the GPU and in the interpreter alike. The weight and
the addend repeat into the rows as ggml broadcasts (each of their ``ne`` divides the row tensor's).

A program loads all rows it owns (x, w, the addend) before storing them, so the output may be x or the addend itself
(element for element, as gallocr's in-place MUL/ADD over an in-place RMS_NORM leaves it); any other overlap is
refused (the matcher's ``rms-mul.output-overlaps-input``; the launcher's :func:`_alias_ok`).

Where the products after it read its output quantized (``quantize``: :mod:`gdnpass.prepasses` plans it, and the
form: the K-quants' q8_K blocks or Q8_0's q8_1 groups), the kernel also writes the output so quantized into the
activation workspace, as their pre-pass would (:func:`gdnpass.kernels.triton_core.store_activations`, the pre-pass's
own code on the same f32 values: the same bytes, the padding columns' zeros included), and the products launch no
pre-pass. It then runs the pre-pass's grid, a
program per row and block of 256: each takes its row's scale from the whole row (:func:`~gdnpass.kernels.
triton_core.rms_row_scales`, the scale of :func:`~gdnpass.kernels.triton_core.rms_scale_rows`: one value), then its
block alone. A row in one program would quantize its blocks one program a row (4 at a 4-token verify): on the H100
that made the 105 norms of a Q4_K_M verify 183 us slower, more than the pre-passes it saved. The output may not
overlap x then (another block's program reads the whole row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnpass.kernels import reference as ref
from gdnpass.kernels.reference import f32
from gdnpass.kernels.triton_core import (GROUPS_K, LAUNCH, QK_K, SUB, XCOLS, _alias_ok, _repeats, _require,
                                         _row_offset, _strides, activations_to_fill, product_columns, rms_row_scales,
                                         rms_scale_rows, store_activations, wait_for_previous_kernels)
from gdnpass.kernels.triton_norms import l2_tile
from gdnpass.patterns.rms_norm_mul.scope import quantizes_rows, row_fits


def reference(x: torch.Tensor, w: torch.Tensor, eps: float, addend: torch.Tensor | None = None,
              norm_first: bool = True, add_first: bool = False) -> torch.Tensor:
    """The unfused ops' torch references in the graph's operand order: MUL(norm, w) or MUL(w, norm), then
    ADD(y, addend) or ADD(addend, y)."""
    norm = ref.rms_norm(x, eps)
    y = ref.mul(norm, w) if norm_first else ref.mul(w, norm)
    if addend is not None:
        y = ref.add(addend, y) if add_first else ref.add(y, addend)
    return y


@triton.jit
def _repeat_offset(r, cols, ne1, ne2, b_ne0, b_ne1, b_ne2, b_ne3, s0, s1, s2, s3):
    """[BLOCK_R, BLOCK_D] element offsets of an operand repeated into flat rows r = i1 + ne1*(i2 + ne2*i3)."""
    i1, i2, i3 = r % ne1, r // ne1 % ne2, r // (ne1 * ne2)
    row = (i1 % b_ne1) * s1 + (i2 % b_ne2) * s2 + (i3 % b_ne3) * s3
    return row[:, None] + (cols % b_ne0)[None, :] * s0


@triton.jit
def _rms_norm_mul_kernel(x_ptr, w_ptr, a_ptr, y_ptr, n_rows, ne0, ne1, ne2, eps,
                         x_s1, x_s2, x_s3,                      # x rows are contiguous (nb0 == 4)
                         w_ne0, w_ne1, w_ne2, w_ne3, w_s0, w_s1, w_s2, w_s3,
                         a_ne0, a_ne1, a_ne2, a_ne3, a_s0, a_s1, a_s2, a_s3,
                         y_s0, y_s1, y_s2, y_s3, ws_ptr, chunk,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, NORM_FIRST: tl.constexpr,
                         HAS_ADD: tl.constexpr, ADD_FIRST: tl.constexpr, FORM: tl.constexpr):
    """Rows [BLOCK_R] whole; or, FORM ("q8_K" / "q8_1"; "": none), one row and one block of 256 of it (program
    (row, block): the row's scale from the whole row, as without, then the block's output and its quants, as the
    pre-pass's grid)."""
    wait_for_previous_kernels()
    QUANTIZE: tl.constexpr = FORM != ""
    PART: tl.constexpr = QK_K if QUANTIZE else BLOCK_D
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_x = _row_offset(rows, ne1, ne2, x_s1, x_s2, x_s3)[:, None]
    whole = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + row_x + whole[None, :], mask=(rows < n_rows)[:, None] & (whole < ne0)[None, :], other=0.0)
    cols = tl.program_id(1) * PART + tl.arange(0, PART)
    mask = (rows < n_rows)[:, None] & (cols < ne0)[None, :]
    w = tl.load(w_ptr + _repeat_offset(rows, cols, ne1, ne2, w_ne0, w_ne1, w_ne2, w_ne3, w_s0, w_s1, w_s2, w_s3),
                mask=mask)
    if HAS_ADD:
        a = tl.load(a_ptr + _repeat_offset(rows, cols, ne1, ne2, a_ne0, a_ne1, a_ne2, a_ne3, a_s0, a_s1, a_s2, a_s3),
                    mask=mask)
    if QUANTIZE:  # (the programs past the rows write the padding columns' zeros)
        norm = rms_row_scales(x, ne0, eps)[:, None] * tl.load(x_ptr + row_x + cols[None, :], mask=mask, other=0.0)
    else:
        norm = rms_scale_rows(x, ne0, eps)
    if NORM_FIRST:
        y = norm * w
    else:
        y = w * norm
    if HAS_ADD:
        if ADD_FIRST:
            y = a + y
        else:
            y = y + a
    tl.store(y_ptr + _row_offset(rows, ne1, ne2, y_s1, y_s2, y_s3)[:, None] + cols[None, :] * y_s0, y, mask=mask)
    if QUANTIZE:
        block = tl.program_id(1) + tl.arange(0, 1)
        store_activations(ws_ptr, tl.program_id(0), chunk, ne0, block,
                          tl.reshape(tl.where(mask, y, 0.0), (1, GROUPS_K, SUB)), block * QK_K < ne0, FORM)


def rms_norm_mul(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor, addend: torch.Tensor | None = None,
                 norm_first: bool = True, add_first: bool = False, quantize: str | None = None) -> None:
    """``out = rms_norm(x, eps) * w (+ addend)`` in the operand order of the unfused MUL (``norm_first``: the norm is
    its src0) and ADD (``add_first``: the addend is its src0), all f32; x with contiguous rows (nb0 == 4, rows
    anywhere), w and the addend repeating into x, ``out`` x's shape with any strides (it may be x or the addend
    itself). One launch, RMS_NORM's tile. ``quantize``, a form ("q8_K", "q8_1": gdnpass.prepasses.form): also
    ``out`` quantized to it, its rows the columns, into the activation workspace, as a product's pre-pass of ``out``
    would write it (rows of :func:`~gdnpass.patterns.rms_norm_mul.scope.quantizes_rows`, contiguous)."""
    if out.numel() == 0:
        return
    ops = [x, w, out] + ([addend] if addend is not None else [])
    _require(all(t.dtype == torch.float32 for t in ops), "RMS_NORM+MUL: every operand must be f32")
    _require(_strides(x)[0] == 1, "RMS_NORM+MUL needs x with contiguous rows")
    _require(row_fits(x.shape[3]), f"RMS_NORM+MUL: rows of {x.shape[3]} elements are outside the kernel's scope")
    _require(tuple(out.shape) == tuple(x.shape), f"RMS_NORM+MUL output {tuple(out.shape)} != {tuple(x.shape)}")
    for name, b, first in (("weight", w, not norm_first), ("addend", addend, add_first)):
        if b is not None:  # ggml repeats src1 into src0: an operand in src0 has the rows' shape
            _require(tuple(b.shape) == tuple(x.shape) if first else _repeats(b, x),
                     f"RMS_NORM+MUL: the {name} {tuple(b.shape)} does not repeat into {tuple(x.shape)}")
    _alias_ok("RMS_NORM+MUL", out, *(t for t in (x, w, addend) if t is not None))
    a = x if addend is None else addend  # (not read without the ADD)
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    block_r, block_d = l2_tile(x.shape[3])
    xs = _strides(x)
    grid, acts, chunk = (triton.cdiv(n_rows, block_r), 1), None, 0
    if quantize:
        K = x.shape[3]
        _require(quantizes_rows(K) and block_r == 1 and out.stride(-1) == 1,
                 f"RMS_NORM+MUL: rows of {K} elements (stride {out.stride(-1)}) are not quantized in the kernel")
        _alias_ok("RMS_NORM+MUL quantizing", out, x, same_ok=False)  # (a block's program reads the whole row)
        N, cols = product_columns(out)
        acts, chunk, chunks = activations_to_fill(out, quantize, N, cols, "RMS_NORM+MUL")
        grid = (XCOLS.value * chunks, K // QK_K.value)
    _rms_norm_mul_kernel[grid](
        x, w, a, out, n_rows, x.shape[3], x.shape[2], x.shape[1], f32(eps), xs[1], xs[2], xs[3],
        *w.shape[::-1], *_strides(w), *a.shape[::-1], *_strides(a), *_strides(out), acts, chunk,
        BLOCK_R=block_r, BLOCK_D=block_d, NORM_FIRST=norm_first, HAS_ADD=addend is not None, ADD_FIRST=add_first,
        FORM=quantize or "", **LAUNCH)


def programs(node) -> list[tuple[str, int, int]]:
    """The programs of one execution (RMS_NORM's: one step each). Pure: reads shapes only."""
    ne = node.ne
    block_r, _ = l2_tile(ne[0])
    return [("rms_norm_mul", triton.cdiv(ne[1] * ne[2] * ne[3], block_r), 1)]


def variants():
    """(kernel, constexprs, warps) to compile ahead of time (tests/kernels' sm_90 check): the model's rows (the
    hidden size and the attention heads) in both operand orders, with and without the ADD."""
    for ne0, norm_first, has_add, add_first, form in ((4096, True, False, False, ""),
                                                      (4096, True, False, False, "q8_K"),
                                                      (4096, True, False, False, "q8_1"),
                                                      (256, True, False, False, ""),
                                                      (128, False, True, True, ""),
                                                      (5120, True, True, False, ""),
                                                      (5120, True, False, False, "q8_K")):
        block_r, block_d = l2_tile(ne0)
        yield (_rms_norm_mul_kernel, dict(BLOCK_R=block_r, BLOCK_D=block_d, NORM_FIRST=norm_first, HAS_ADD=has_add,
                                          ADD_FIRST=add_first, FORM=form), LAUNCH["num_warps"],
               *([dict(ws_ptr="*u8")] if form else []))  # (the activation workspace's bytes, as launched)
