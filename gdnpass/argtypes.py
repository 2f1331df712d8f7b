"""argparse value types shared by the ``gdnpass`` subcommands (``run``/``dump`` in :mod:`gdnpass.cli`, ``generate``
in :mod:`gdnpass.generate_cli`): one validator per flag, so a bad value is the same one-line error everywhere."""

from __future__ import annotations

import argparse


def alignment(text: str) -> int:
    """``--alignment``: the arena alignment in bytes, a power of two."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--alignment must be an integer, got {text!r}") from None
    from gdnpass.alloc import MAX_ALIGNMENT

    if v < 1 or v & (v - 1) or v > MAX_ALIGNMENT:
        raise argparse.ArgumentTypeError(f"--alignment must be a power of two, 1..{MAX_ALIGNMENT} (bytes), got {v}")
    return v
