"""The RMS_NORM_MUL kernel against the unfused Triton kernels (byte for byte) and its torch reference (to the f32
sum order), in every operand order, broadcast, row layout and alias the matcher lets through; and what the launcher
refuses. Small grids: the interpreter runs each program on the CPU."""

import pytest
import torch

from gdnpass.errors import KernelError
from gdnpass.kernels import triton_elementwise as elt
from gdnpass.kernels import triton_norms as norms
from gdnpass.patterns.rms_norm_mul import kernel
from gdnpass.patterns.rms_norm_mul.scope import ROW_MAX
from support.arena import Arena, assert_close, rnd
from support.compare import assert_same_bytes

EPS = 1e-6


def unfused(a: Arena, x, w, addend, norm_first, add_first):
    """RMS_NORM, MUL (and ADD) as three launches of the unfused kernels, in the graph's operand order."""
    n = a.view(tuple(x.shape))
    norms.rms_norm(x, EPS, n)
    y = a.view(tuple(x.shape))
    elt.mul(n, w, y) if norm_first else elt.mul(w, n, y)
    if addend is None:
        return y
    z = a.view(tuple(x.shape))
    elt.add(addend, y, z) if add_first else elt.add(y, addend, z)
    return z


# (rows shape (ne3, ne2, ne1, ne0), the weight's, the addend's or None, norm_first, add_first, x's row stride)
CASES = [
    ((1, 1, 4, 256), (1, 1, 1, 256), None, True, False, None),      # a hidden-state norm at 4 tokens
    ((1, 4, 3, 32), (1, 1, 1, 32), None, True, False, 96),          # head norms over a strided projection view
    ((1, 1, 2, 100), (1, 1, 1, 100), None, True, False, None),      # a row that is no power of two
    ((1, 1, 3, 64), (1, 1, 3, 64), None, False, False, None),       # the norm as the MUL's src1: same shapes
    ((1, 2, 2, 64), (1, 1, 2, 64), (1, 1, 1, 64), True, False, None),  # a broadcast weight and addend
    ((1, 1, 2, 64), (1, 1, 1, 64), (1, 1, 2, 64), True, True, None),   # the MUL as the ADD's src1
    ((1, 1, 2, 48), (1, 1, 1, 16), None, True, False, None),        # the weight repeated along ne0 too
    ((2, 1, 1, 4096), (1, 1, 1, 4096), None, True, False, None),    # the 9B's hidden size, one row a program
]


@pytest.mark.parametrize("shape,w_shape,a_shape,norm_first,add_first,stride", CASES)
def test_fused_is_the_unfused_kernels_bytes(shape, w_shape, a_shape, norm_first, add_first, stride):
    a = Arena()
    x = a.put(rnd(*shape) * 3, row_stride=stride)
    w, addend = a.put(rnd(*w_shape)), a.put(rnd(*a_shape)) if a_shape else None
    want = unfused(a, x, w, addend, norm_first, add_first)
    out = a.view(shape)
    a.run(lambda: kernel.rms_norm_mul(x, w, EPS, out, addend, norm_first, add_first), out)
    assert_same_bytes(out, want, "fused vs unfused kernels")
    assert_close(out, kernel.reference(x, w, EPS, addend, norm_first, add_first))


def _bits(*words: int) -> torch.Tensor:
    return torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("norm_first,add_first", [(True, False), (False, True)])
def test_edge_values_keep_their_bytes(norm_first, add_first):
    """Rows of zeros (signed), of overflowing squares, with a NaN payload, an infinity or subnormals; a weight and an
    addend with -0.0, infinities and NaN payloads: the same bytes as the unfused kernels in either operand order
    (which NaN payload survives depends on the order where the hardware keeps the first operand's)."""
    a = Arena()
    rows = torch.stack([
        torch.tensor([0.0, -0.0] * 16),
        torch.full((32,), 3e38),
        torch.cat([_bits(0x7FC01234), torch.ones(31)]),
        torch.cat([torch.tensor([float("-inf")]), torch.ones(31)]),
        torch.cat([_bits(0x00000001, 0x807FFFFF), torch.zeros(30)]),
        torch.linspace(-4, 4, 32),
    ]).view(1, 1, 6, 32)
    special = torch.cat([_bits(0xFFC00000, 0x7FC0BEEF), torch.tensor([-0.0, float("inf"), float("-inf"), 0.0]),
                         torch.linspace(-2, 2, 26)])
    x, w = a.put(rows), a.put(special.view(1, 1, 1, 32) if norm_first else special.repeat(6).view(1, 1, 6, 32))
    addend = a.put(special.flip(0).repeat(6).view(1, 1, 6, 32))
    want = unfused(a, x, w, addend, norm_first, add_first)
    out = a.view((1, 1, 6, 32))
    kernel.rms_norm_mul(x, w, EPS, out, addend, norm_first, add_first)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32)), "fused vs unfused kernels: bytes differ"


def test_in_place_over_x_and_over_the_addend():
    """gallocr's in-place chain: the output is x (or the addend) element for element; the bytes do not change."""
    for over in ("x", "addend"):
        a = Arena()
        x, w, addend = a.put(rnd(1, 2, 8, 64)), a.put(rnd(1, 1, 1, 64)), a.put(rnd(1, 2, 8, 64))
        want = kernel.reference(x, w, EPS, addend).clone()
        check = a.view((1, 2, 8, 64))
        kernel.rms_norm_mul(x, w, EPS, check, addend)
        out = x if over == "x" else addend
        kernel.rms_norm_mul(x, w, EPS, out, addend)
        assert_same_bytes(out, check, f"in place over {over}")
        assert_close(out, want)


def test_the_launcher_refuses_what_the_kernel_cannot_run():
    a = Arena()
    x, w = a.put(rnd(1, 1, 4, 64)), a.put(rnd(1, 1, 1, 64))
    shifted = a.buf[x.storage_offset() * 4 + 256:].view(torch.float32)[:4 * 64].view(1, 1, 4, 64)  # x, one row on
    with pytest.raises(KernelError, match="overlaps an input other than element for element"):
        kernel.rms_norm_mul(x, w, EPS, shifted)
    with pytest.raises(KernelError, match="does not repeat"):
        kernel.rms_norm_mul(x, a.put(rnd(1, 1, 1, 48)), EPS, a.view((1, 1, 4, 64)))
    with pytest.raises(KernelError, match="contiguous rows"):
        kernel.rms_norm_mul(x.transpose(2, 3), w, EPS, a.view((1, 1, 64, 4)))
    with pytest.raises(KernelError, match="scope"):
        big = torch.zeros(1, 1, 1, ROW_MAX + 1)
        kernel.rms_norm_mul(big, torch.ones(1, 1, 1, 1), EPS, torch.empty_like(big))
