"""Progress of the long steps (fill, execute, check) on stderr.

A step shows nothing for its first second (most runs are shorter). Then: a tqdm bar when stderr is a terminal,
otherwise plain lines (no carriage returns) every few seconds and one when the step ends, so a log or a CI console
stays readable. ``quiet`` shows nothing. A :class:`Step` is the ``progress(done, total)`` callback that
``models.fill.fill`` and ``Executor.run`` take; a count going back (``check`` runs the graph twice) starts a new pass.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

DELAY_S = 1.0         # steps shorter than this show nothing
LINE_EVERY_S = 5.0    # line mode: at most one line per this many seconds


class Step:
    def __init__(self, label: str, unit: str = "nodes", quiet: bool = False, stream: TextIO | None = None,
                 tty: bool | None = None, scale: float = 1.0) -> None:
        self.label, self.unit, self.quiet, self.scale = label, unit, quiet, scale
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.t0 = time.perf_counter()
        self.last_line = self.t0
        self.done = 0
        self.passes = 1
        self.bar = None
        self.shown = False

    def _what(self) -> str:
        return self.label if self.passes == 1 else f"{self.label} (pass {self.passes})"

    def __call__(self, done: int, total: int) -> None:
        if self.quiet:
            return
        if done < self.done:  # a new pass over the same work
            self.close()
            self.passes += 1
            self.t0 = self.last_line = time.perf_counter()
            self.shown = False
        self.done = done
        now = time.perf_counter()
        if now - self.t0 < DELAY_S and done < total:
            return
        if now - self.t0 < DELAY_S and not self.shown:
            return  # finished within the delay: nothing to say
        if self.tty:
            self._bar(done, total)
        elif not self.shown or now - self.last_line >= LINE_EVERY_S or done == total:
            self.last_line = now
            self.shown = True
            pct = 100.0 * done / total if total else 100.0
            self.stream.write(f"{self._what()}: {self._n(done)}/{self._n(total)} {self.unit} ({pct:.0f}%), "
                              f"{now - self.t0:.1f} s\n")
            self.stream.flush()
        if done == total:
            self.close()

    def _n(self, x: int) -> str:
        return f"{x * self.scale:.2f}" if self.scale != 1.0 else str(x)

    def _bar(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total * self.scale, desc=self._what(), unit=self.unit, file=self.stream,
                            leave=True, initial=0, dynamic_ncols=True,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.4g}/{total:.4g} {unit} "
                                       "[{elapsed}<{remaining}]")
            self.shown = True
        self.bar.n = done * self.scale
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def step(label: str, unit: str = "nodes", quiet: bool = False, scale: float = 1.0) -> Step:
    """A progress callback for one step on stderr (see the module docstring)."""
    return Step(label, unit, quiet, scale=scale)
