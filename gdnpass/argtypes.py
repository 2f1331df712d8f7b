"""argparse pieces shared by the ``gdnpass`` subcommands (``run``/``dump`` in :mod:`gdnpass.cli`, ``generate`` in
:mod:`gdnpass.generate_cli`): one validator per flag, so a bad value is the same one-line error everywhere, and
:class:`Given`, which notes the flags a command line gave."""

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


class Given(argparse.Action):
    """argparse's ``store`` (``store_const`` with ``nargs=0``) that also notes the option in ``namespace.given``, so
    a command can refuse a flag its source ignores instead of dropping it without a word (:func:`given`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


def given(a: argparse.Namespace) -> frozenset[str]:
    """The dests of the flags noted by :class:`Given` that the command line gave."""
    return getattr(a, "given", frozenset())
