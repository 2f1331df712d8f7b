"""What the commands write: JSON that is always valid JSON, and files that appear whole or not at all.

- :func:`json_text` is ``json.dumps`` for reports (``run --json``, ``dump --format json``, ``capture --json``,
  ``generate --json``): a non-finite float (a NaN logit, an infinite rope base echoed from a header) becomes the
  string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (what Python's json would have written bare, which is not JSON;
  ``float()`` reads the strings back), tuples become lists, numpy scalars plain numbers.
- :func:`write_atomic` / :func:`atomic_path` write a file under a temporary name next to it and rename it into place
  only when everything succeeded: a failed, refused or interrupted command leaves an existing file untouched (a
  device or pipe such as ``/dev/null`` is written in place; a symbolic link keeps pointing at the new file).
- :func:`check_writable` refuses an output path that cannot be written (no such folder, a directory) before a long
  step runs, naming the flag.

Every error is a one-line :class:`~gdnpass.errors.GdnpassError` naming the path.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, Iterator

from gdnpass.errors import GdnpassError

NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def json_safe(x: Any) -> Any:
    """``x`` with every non-finite float replaced by its name as a string (``"NaN"``, ``"Infinity"``,
    ``"-Infinity"``), tuples as lists and numpy numbers as Python numbers; dict keys are kept."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        f = float(x)
        return f if math.isfinite(f) else NON_FINITE[repr(f)]
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x  # (json.dumps names anything else it cannot hold)


def json_text(x: Any, **kw: Any) -> str:
    """``json.dumps(json_safe(x), **kw)``: valid JSON whatever floats ``x`` holds."""
    return json.dumps(json_safe(x), allow_nan=False, **kw)


def check_writable(path: str | os.PathLike, flag: str) -> None:
    """Refuse, before any work, an output ``path`` that cannot be created: its folder is missing or not a folder,
    or the path is a directory (``flag`` names the option in the message)."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise GdnpassError(f"{flag} {p}: is a directory")
    if not parent.is_dir():
        raise GdnpassError(f"{flag} {p}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise GdnpassError(f"{flag} {p}: folder {parent} is not writable")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path next to ``path`` for the caller (or a program it runs) to write; renamed over ``path`` when
    the block ends normally, removed when it raises (KeyboardInterrupt included), so ``path`` is never left
    half-written and an existing file is kept on any failure."""
    p = Path(path)
    if p.is_dir():
        raise GdnpassError(f"cannot write {p}: it is a directory")
    if p.exists() and not p.is_file() or p.absolute().parts[1:2] in (("dev",), ("proc",)):
        # a device or a pipe (/dev/null, /dev/stdout, even when it names a file): written in place, never replaced
        try:
            yield p
        except OSError as e:
            raise GdnpassError(f"cannot write {p}: {e.strerror or e}") from None
        return
    target = p.resolve() if p.is_symlink() else p  # (a link stays a link: the file it names is replaced)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, target)
    except OSError as e:
        raise GdnpassError(f"cannot write {p}: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through :func:`atomic_path`."""
    with atomic_path(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
