"""Another revision's ``gdnpass`` package loaded next to the working tree's, as a package of its own (benchmarks/
ab_kernels.py times their kernels in one process): a git revision (``git archive``) or a folder holding a revision's
package is copied under a name of its own, every ``import gdnpass...`` / ``from gdnpass... import`` of the copy
renamed to that name, so its kernels call its own helpers (and Triton, which keys its compiles by source, keeps the
revisions' kernels apart). The launchers compared are looked up where a revision's layout keeps them
(:data:`LAUNCHERS`); a revision without them is refused in one line."""

from __future__ import annotations

import importlib
import importlib.util
import io
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

# each launcher compared -> the modules of the package that may hold it, in order: the family modules (the layout
# since issue 31), then the single kernels module of older revisions
LAUNCHERS = {"gdn_conv_chain": ("kernels.triton_ssm", "kernels.triton_ops"),
             "unary": ("kernels.triton_elementwise", "kernels.triton_ops"),
             "glu": ("kernels.triton_elementwise", "kernels.triton_ops")}


def launchers(package: str, folder: Path | None, base: str) -> SimpleNamespace:
    """The launchers of ``package`` (an importable name; its source under ``folder``, None for the working tree's),
    by :data:`LAUNCHERS`."""
    found = {}
    for name, places in LAUNCHERS.items():
        for place in places:
            if folder is not None and not (folder / (place.replace(".", "/") + ".py")).is_file():
                continue
            try:
                module = importlib.import_module(f"{package}.{place}")
            except ModuleNotFoundError as e:
                if e.name == f"{package}.{place}":
                    continue
                raise SystemExit(f"ab_kernels: --base {base}: {package}.{place} does not load: {e}")
            except Exception as e:  # noqa: BLE001 (whatever an old revision's module raises on import)
                first = str(e).splitlines()[0] if str(e) else ""
                raise SystemExit(f"ab_kernels: --base {base}: {place} does not load: {type(e).__name__}: {first}")
            if callable(getattr(module, name, None)):
                found[name] = getattr(module, name)
                break
        else:
            raise SystemExit(f"ab_kernels: --base {base}: no {name} launcher in "
                             f"{' or '.join(p.replace('.', '/') + '.py' for p in places)}: a revision this tool cannot "
                             "compare")
    return SimpleNamespace(**found)


def _snapshot(rev: str, into: Path) -> Path:
    """The ``gdnpass`` package of ``rev`` (a git revision, or a folder holding the package) under ``into``."""
    if Path(rev).exists() or "/" in rev or rev.endswith(".py"):
        package = Path(rev) / "gdnpass"
        if not (package / "__init__.py").is_file():
            raise SystemExit(f"ab_kernels: --base {rev}: not a folder holding a gdnpass package (make one with "
                             "git archive REV gdnpass | tar -x -C FOLDER)")
        return package
    try:
        data = subprocess.run(["git", "archive", "--format=tar", rev, "gdnpass"], check=True,
                              capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        err = (getattr(e, "stderr", b"") or b"").decode(errors="replace").strip().splitlines()
        raise SystemExit(f"ab_kernels: --base {rev}: {err[0] if err else 'git archive failed'}")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                (into / member.name).parent.mkdir(parents=True, exist_ok=True)
                (into / member.name).write_bytes(tar.extractfile(member).read())
    return into / "gdnpass"


def revision_module(rev: str, folder: Path) -> SimpleNamespace:
    """The launchers of revision ``rev`` (a git revision, or a folder holding its ``gdnpass`` package): its package
    copied into ``folder`` under a name of its own, every ``import gdnpass...`` / ``from gdnpass... import`` of it
    renamed to that name (Triton keys its compiles by source, so the revisions' kernels stay apart)."""
    name = "ab_" + "".join(c if c.isalnum() else "_" for c in rev)
    while name in sys.modules:
        name += "_"
    source = _snapshot(rev, folder / f"{name}_src")
    target = folder / name
    for path in sorted(source.rglob("*.py")):
        out = target / path.relative_to(source)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(re.sub(r"(?m)^(\s*)(from|import)(\s+)gdnpass\b", rf"\1\2\3{name}", path.read_text()))
    spec = importlib.util.spec_from_file_location(name, target / "__init__.py",
                                                  submodule_search_locations=[str(target)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return launchers(name, target, rev)

