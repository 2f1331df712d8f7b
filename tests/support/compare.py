"""Byte-for-byte asserts on tensors (f32 / f16 / bf16 / i32 elements compared as integers, so NaN == NaN and
-0.0 != 0.0)."""

import torch

_INT = {4: torch.int32, 2: torch.int16}


def int_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements reinterpreted as integers of the same width (a contiguous copy)."""
    return t.contiguous().view(_INT[t.element_size()])


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """``got`` holds exactly ``want``'s bytes."""
    assert torch.equal(int_bits(got), int_bits(want)), f"{what}: bytes differ"


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Every element of ``got`` was written (the arena poisons with NaN) and holds exactly ``want``'s bytes."""
    assert not got.isnan().any(), f"{what}: {int(got.isnan().sum())} elements not written"
    assert_bits(got, want, what)
