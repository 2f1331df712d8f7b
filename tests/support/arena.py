"""Kernel-test memory: one NaN-poisoned uint8 arena handing out strided views, as the executor gives kernels their
operands, and the small helpers the kernel tests (kernels/test_kernels, patterns/*/test_fused_kernel,
patterns/conv_chain/test_dedup) share."""

from types import SimpleNamespace

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN = float("nan")


class Arena:
    """One uint8 buffer handing out typed strided 4-D views (torch shape (ne3, ne2, ne1, ne0)), NaN-poisoned."""

    def __init__(self, nbytes: int = 1 << 22):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
        self.top = 0

    def view(self, shape, dtype=torch.float32, row_stride=None) -> torch.Tensor:
        """A new view; rows (along ne0) are ``row_stride`` elements apart (default: packed), packed above."""
        d3, d2, d1, d0 = shape
        r = row_stride or d0
        strides = (r * d1 * d2, r * d1, r, 1)
        size = torch.empty(0, dtype=dtype).element_size()
        n = 1 + sum((d - 1) * s for d, s in zip(shape, strides))
        self.top = -(-self.top // 64) * 64
        t = self.buf[self.top:self.top + n * size].view(dtype).as_strided(shape, strides)
        self.top += n * size
        return t.fill_(NAN if dtype.is_floating_point else 0xFF)  # (integer bytes: all ones)

    def put(self, x: torch.Tensor, row_stride=None) -> torch.Tensor:
        return self.view(tuple(x.shape), x.dtype, row_stride).copy_(x)

    def run(self, fn, *outs: torch.Tensor) -> None:
        """fn(), checking that it changed no byte outside the elements of ``outs``."""
        before = self.buf.clone()
        fn()
        allowed = torch.zeros_like(self.buf)
        for o in outs:
            as_int = {4: torch.int32, 2: torch.int16}[o.element_size()]
            allowed.view(as_int).as_strided(o.shape, o.stride(), o.storage_offset()).fill_(-1)
        stray = (self.buf != before) & (allowed == 0)
        assert not stray.any(), f"{int(stray.sum())} bytes written outside the outputs"


def rnd(*shape, lo=None, hi=None):
    if lo is None:
        return torch.randn(shape, device=DEVICE)
    return lo + (hi - lo) * torch.rand(shape, device=DEVICE)


def assert_close(got, want, rtol=1e-5):
    """f32 agreement up to summation order: rtol, plus an absolute slack relative to the largest magnitude."""
    assert not got.isnan().any(), f"{int(got.isnan().sum())} elements not written"
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().max()))


def node(op, src_types=(), **params):
    """A stand-in graph node for calling a backend table entry directly: ``backend[op](node(op, ...), src, dst)``.
    Its sources say only their types (``src_types``; f32 by default: what the adapters read of a plain type is that
    it is not quantized)."""
    from gdnpass.ir import DType

    types = list(src_types) + [DType.F32] * (6 - len(src_types))
    return SimpleNamespace(op=op, op_params=params, src=[SimpleNamespace(type=t) for t in types])
