"""Build the pinned llama.cpp (ggml + libllama, and its speculative-simple loop) and cache it in the user's cache.

The pin is llama-cpp-python's sdist: PyPI has no wheel for it and ``pip install llama-cpp-python`` builds common,
tools and mtmd too (10-22 min on 2 cores). Here: download the sdist (``pip download``, or ``GDNPASS_LLAMA_SDIST``
naming a local copy), check that its vendored llama.cpp is the pinned commit, build CMake targets ``llama`` and
``llama-speculative-simple`` (with the common library it links) and keep:

    <cache>/llama.cpp-<commit12>[-cuda]/
        lib/        libllama.so, libggml*.so (LLAMA_CPP_LIB_PATH for the bindings)
        bin/        llama-speculative-simple (LD_LIBRARY_PATH=lib/ finds its libraries)
        py/llama_cpp/   the sdist's pure-Python ctypes bindings, with an empty ``__init__`` (the real one imports the
                        high-level API and its dependencies)
        install.json    pin, variant, build settings, the struct layout probed from the vendored headers, build time

Two variants (:data:`VARIANTS`): ``cpu``, the referee of the tests (-O0: about 4 min on 2 cores; -O0, Release and
the pip wheel give the same captures node for node), and ``cuda``, upstream's GPU peer for the benchmarks (Release,
ggml-cuda for sm_90, flash-attention kernels off: 207 s on the H200 host's 16 cores, docs/llama-cpp.md). Both also
build llama.cpp's own speculative loop, ``llama-speculative-simple`` (with the common library it links), into
``<cache>/bin``: the peer of ``gdnpass generate`` (:mod:`.speculative`).

A machine with no registry access (the GPU host) builds from a **packed source** instead of the sdist:
:func:`pack` writes the tree the build needs (the sdist's vendored tree without the other backends' folders: 21
MB of the sdist's 75 MB) plus the bindings and a ``COMMIT`` file; ``gdnpass llama-build --pack DIR`` here,
``gdnpass llama-build --cuda --source DIR`` there (or ``GDNPASS_LLAMA_SRC``).

``<cache>`` is ``$GDNPASS_CACHE``, else ``$XDG_CACHE_HOME/gdnpass``, else ``~/.cache/gdnpass``. A second call finds
``install.json`` and returns in milliseconds; concurrent callers wait on a lock. One command: ``gdnpass llama-build``.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gdnpass.errors import LlamaError

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # vendor/llama.cpp of the 0.3.36 sdist (2026-10-01)

# what the sdist must give us: the sources of ggml, libllama, common and the examples, and the bindings
_SOURCES = ("CMakeLists.txt", "cmake/", "ggml/", "src/", "include/", "vendor/", "licenses/", "common/", "examples/",
            "pocs/")
_BINDINGS = ("llama_cpp.py", "_ctypes_extensions.py", "_ggml.py", "llama_types.py")
# ggml's backend folders that no variant builds (ggml_add_backend only enters a folder whose GGML_<NAME> is on):
# a packed source leaves them out (16 of ggml's 25 MB)
_OTHER_BACKENDS = re.compile(r"ggml/src/ggml-(?!cpu/|cuda/)[\w-]+/")
# llama.cpp's own speculative loop (examples/speculative-simple: draft, verify, accept, roll back on one sequence,
# greedy, its n-gram drafters built in) and the common library it links: the peer of `gdnpass generate`
SPECULATIVE_TOOL = "llama-speculative-simple"
_COMMON_FLAGS = (
    "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_EXAMPLES=ON",  # (configured; only SPECULATIVE_TOOL is built)
    "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    f"-DLLAMA_BUILD_COMMIT={COMMIT[:7]}",
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",  # the libraries find each other after the copy into the cache
)


@dataclass(frozen=True)
class Variant:
    """One way of building the pinned tree: its CMake switches, the tools it needs, where it is cached."""

    name: str
    build_type: str          # for the logs and install.json
    flags: tuple[str, ...]
    tools: tuple[str, ...]   # what must be on PATH
    suffix: str              # of the cache folder (the cpu build keeps the plain name of earlier caches)
    targets: tuple[str, ...] = ("llama", SPECULATIVE_TOOL)  # CMake targets; executables land in <cache>/bin


VARIANTS = {
    "cpu": Variant("cpu", "Debug -O0", ("-DCMAKE_BUILD_TYPE=Debug", "-DCMAKE_C_FLAGS_DEBUG=-O0",
                                        "-DCMAKE_CXX_FLAGS_DEBUG=-O0", *_COMMON_FLAGS),
                   ("cmake", "cc", "c++"), ""),
    # upstream's GPU build as a user runs it, for one architecture (sm_90: H100 / H200); the flash-attention
    # template instances are most of ggml-cuda's compile time and upstream's CUDA verify does not need them
    "cuda": Variant("cuda", "Release, ggml-cuda sm_90, FA kernels off",
                    ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90",
                     "-DGGML_CUDA_FA=OFF", "-DGGML_CUDA_NCCL=OFF", *_COMMON_FLAGS),
                    ("cmake", "cc", "c++", "nvcc"), "-cuda"),
}
_PROBE = Path(__file__).with_name("layout_probe.c")


@dataclass(frozen=True)
class Install:
    """A built llama.cpp: where its libraries and bindings are, and what was probed from its headers."""

    root: Path
    commit: str
    layout: dict          # {"tensor": {...}, "graph": {...}} from layout_probe.c
    build_s: float
    variant: str = "cpu"  # a key of VARIANTS

    @property
    def lib_dir(self) -> Path:
        return self.root / "lib"

    @property
    def py_dir(self) -> Path:
        return self.root / "py"

    def tool(self, name: str) -> Path:
        """The path of an executable this build made (e.g. :data:`SPECULATIVE_TOOL`); LlamaError when it has none."""
        exe = self.root / "bin" / name
        if not exe.is_file():
            raise LlamaError(f"llama.cpp build {self.root} has no {name} (variant {self.variant} builds "
                             f"{', '.join(_variant(self.variant).targets)}): rebuild it with `gdnpass llama-build`")
        return exe

    def env(self) -> dict[str, str]:
        """Environment for a process that imports the bindings (``import llama_cpp.llama_cpp``)."""
        env = dict(os.environ)
        env["LLAMA_CPP_LIB_PATH"] = str(self.lib_dir)
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(self.lib_dir), *filter(None, [env.get("LD_LIBRARY_PATH")])])
        env["PYTHONPATH"] = os.pathsep.join([str(self.py_dir), *filter(None, [env.get("PYTHONPATH")])])
        return env


def cache_root() -> Path:
    if os.environ.get("GDNPASS_CACHE"):
        return Path(os.environ["GDNPASS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gdnpass"


def _variant(name: str) -> Variant:
    if name not in VARIANTS:
        raise LlamaError(f"llama.cpp build: unknown variant {name!r} (known: {', '.join(VARIANTS)})")
    return VARIANTS[name]


def install_dir(variant: str = "cpu") -> Path:
    return cache_root() / f"llama.cpp-{COMMIT[:12]}{_variant(variant).suffix}"


def find(variant: str = "cpu") -> Install | None:
    """The cached build of ``variant``, if it is complete; None otherwise."""
    root = install_dir(variant)
    try:
        meta = json.loads((root / "install.json").read_text())
    except (OSError, ValueError):
        return None
    built = meta.get("targets", ["llama"])  # (caches from before targets were recorded built the library only)
    if meta.get("commit") != COMMIT or meta.get("variant", "cpu") != variant \
            or not (root / "lib" / "libllama.so").exists() or not set(_variant(variant).targets) <= set(built) \
            or not (root / "bin" / SPECULATIVE_TOOL).is_file():
        return None
    return Install(root, meta["commit"], meta["layout"], float(meta.get("build_s", 0.0)), variant)


def toolchain_missing(variant: str = "cpu") -> str | None:
    """What of ``variant``'s toolchain is absent (a reason to skip), or None."""
    missing = [t for t in _variant(variant).tools if shutil.which(t) is None]
    return f"no {', '.join(missing)} on PATH" if missing else None


def ensure(log=None, sdist: str | os.PathLike | None = None, *, variant: str = "cpu",
           source: str | os.PathLike | None = None) -> Install:
    """The cached build of ``variant``, building it first when missing, from ``source`` (a folder :func:`pack`
    wrote; default ``$GDNPASS_LLAMA_SRC``) or else the sdist. ``log(line)`` receives progress lines (None: quiet)."""
    found = find(variant)
    if found is not None:
        return found
    say = log or (lambda line: None)
    root = install_dir(variant)
    root.parent.mkdir(parents=True, exist_ok=True)
    with _lock(root.parent / f".{root.name}.lock"):
        found = find(variant)  # another process may have built it while we waited
        if found is not None:
            return found
        return _build(root, say, _variant(variant), sdist, source or os.environ.get("GDNPASS_LLAMA_SRC"))


def pack(dest: str | os.PathLike, sdist: str | os.PathLike | None = None, log=None) -> Path:
    """Write the packed source into folder ``dest``: ``llama.cpp/`` (the sources a build needs), ``llama_cpp/`` (the
    bindings) and ``COMMIT``; what a machine without registry access builds from (``ensure(source=dest)``)."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise LlamaError(f"llama.cpp pack: {dest} exists and is not empty")
    say = log or (lambda line: None)
    with tempfile.TemporaryDirectory(prefix="gdnpass-llama-") as tmp_s:
        src, bindings = _extract(_sdist(Path(tmp_s), sdist, say), Path(tmp_s) / "src")
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dest / "llama.cpp")
        shutil.copytree(bindings, dest / "llama_cpp")
    (dest / "COMMIT").write_text(COMMIT + "\n")
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    say(f"packed llama.cpp {COMMIT[:12]} into {dest} ({size / 1e6:.1f} MB)")
    return dest


@contextmanager
def _lock(path: Path):
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(cmd: list[str], what: str, cwd: Path | None = None, say=None) -> str:
    """Run a build step; its output streams to ``say`` line by line; a failure is one LlamaError line with the
    first error the tool printed."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line.rstrip())
        if say is not None:
            say(line.rstrip())
    if proc.wait() != 0:
        first = next((x for x in lines if re.search(r"error|Error|ERROR", x)), lines[-1] if lines else "")
        raise LlamaError(f"llama.cpp build: {what} failed (exit {proc.returncode}): {first.strip()[:300]}")
    return "\n".join(lines)


def _sdist(tmp: Path, sdist, say) -> Path:
    given = sdist or os.environ.get("GDNPASS_LLAMA_SDIST")
    if given:
        p = Path(given)
        if not p.is_file():
            raise LlamaError(f"llama.cpp build: sdist {p} does not exist (GDNPASS_LLAMA_SDIST / --sdist)")
        return p
    say(f"downloading {PACKAGE}=={VERSION} (sdist, ~75 MB)")
    _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
          f"{PACKAGE}=={VERSION}", "-d", str(tmp)], f"pip download {PACKAGE}=={VERSION}")
    found = sorted(tmp.glob(f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz")) + sorted(tmp.glob("*.tar.gz"))
    if not found:
        raise LlamaError(f"llama.cpp build: pip download left no sdist in {tmp}")
    return found[0]


def wanted(relpath: str) -> bool:
    """Whether a file of the vendored tree (path relative to its root) is one a build needs."""
    return relpath.startswith(_SOURCES) and not _OTHER_BACKENDS.match(relpath)


def _extract(archive: Path, dest: Path) -> tuple[Path, Path]:
    """The vendored sources and the bindings out of the sdist; checks the vendored commit."""
    top = f"{PACKAGE.replace('-', '_')}-{VERSION}"
    vendor = f"{top}/vendor/llama.cpp/"
    head = f"{top}/.git/modules/vendor/llama.cpp/HEAD"
    try:
        with tarfile.open(archive) as tf:
            try:
                commit = tf.extractfile(head).read().decode().strip()  # type: ignore[union-attr]
            except KeyError:
                raise LlamaError(f"llama.cpp build: {archive.name} has no {head}; cannot tell its llama.cpp commit")
            _check_commit(commit, archive.name)
            keep = [m for m in tf.getmembers()
                    if (m.name.startswith(vendor) and wanted(m.name[len(vendor):]))
                    or m.name in {f"{top}/llama_cpp/{b}" for b in _BINDINGS}]
            tf.extractall(dest, members=keep, filter="data")
    except (tarfile.TarError, OSError) as err:
        raise LlamaError(f"llama.cpp build: cannot read {archive}: {err}") from None
    return dest / vendor, dest / top / "llama_cpp"


def _check_commit(commit: str, where: str) -> None:
    if commit != COMMIT:
        raise LlamaError(f"llama.cpp build: {where} holds llama.cpp {commit[:12] or '(nothing)'}, gdnpass is pinned "
                         f"to {COMMIT[:12]}")


def _packed(source: Path) -> tuple[Path, Path]:
    """The sources and bindings of a folder :func:`pack` wrote; checks its commit."""
    try:
        commit = (source / "COMMIT").read_text().strip()
    except OSError:
        raise LlamaError(f"llama.cpp build: source {source} has no COMMIT file (write it with `gdnpass llama-build "
                         "--pack DIR`)") from None
    _check_commit(commit, f"source {source}")
    missing = [p for p in ("llama.cpp/CMakeLists.txt", *(f"llama_cpp/{b}" for b in _BINDINGS))
               if not (source / p).is_file()]
    if missing:
        raise LlamaError(f"llama.cpp build: source {source} lacks {missing[0]}")
    return source / "llama.cpp", source / "llama_cpp"


def _build(root: Path, say, variant: Variant, sdist, source) -> Install:
    missing = toolchain_missing(variant.name)
    if missing:
        raise LlamaError(f"llama.cpp build ({variant.name}): {missing} (install cmake and a C/C++ compiler"
                         + (", and CUDA's nvcc" if "nvcc" in variant.tools else "") + ")")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gdnpass-llama-") as tmp_s:
        tmp = Path(tmp_s)
        src, bindings = _packed(Path(source)) if source else _extract(_sdist(tmp, sdist, say), tmp / "src")
        build = tmp / "build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        say(f"configuring llama.cpp {COMMIT[:12]} ({variant.build_type})")
        _run(["cmake", "-S", str(src), "-B", str(build), *gen, *variant.flags], "cmake configure")
        jobs = str(os.cpu_count() or 2)
        say(f"building {', '.join(variant.targets)} with {jobs} jobs")
        steps = re.compile(r"^\[(\d+)/(\d+)\]")
        last = [0.0]

        def progress(line: str) -> None:  # one line every 15 s is enough for a log
            if steps.match(line) and time.perf_counter() - last[0] > 15:
                last[0] = time.perf_counter()
                say(f"  {line[:100]}")
        _run(["cmake", "--build", str(build), "--target", *variant.targets, "-j", jobs], "cmake --build",
             say=progress)
        layout = _probe(src, tmp)
        staging = root.with_name(root.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "lib").mkdir(parents=True)
        (staging / "py" / "llama_cpp").mkdir(parents=True)
        for so in build.rglob("*.so*"):
            if so.is_file() and not so.is_symlink():
                shutil.copy2(so, staging / "lib" / so.name)
        for so in build.rglob("*.so*"):  # the unversioned names the bindings open
            if so.is_symlink():
                target = staging / "lib" / so.name
                if not target.exists():
                    os.symlink(os.readlink(so), target)
        executables = [t for t in variant.targets if (build / "bin" / t).is_file()]
        if executables:
            (staging / "bin").mkdir()
        for t in executables:
            shutil.copy2(build / "bin" / t, staging / "bin" / t)
        for b in _BINDINGS:
            shutil.copy2(bindings / b, staging / "py" / "llama_cpp" / b)
        (staging / "py" / "llama_cpp" / "__init__.py").write_text(
            "# gdnpass: the low-level ctypes bindings only (the sdist's __init__ imports the high-level API)\n")
        build_s = time.perf_counter() - t0
        meta = {"package": PACKAGE, "version": VERSION, "commit": COMMIT, "variant": variant.name,
                "build_type": variant.build_type, "cmake_flags": list(variant.flags),
                "targets": list(variant.targets), "layout": layout,
                "build_s": round(build_s, 1)}
        (staging / "install.json").write_text(json.dumps(meta, indent=1) + "\n")
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
    say(f"llama.cpp {COMMIT[:12]} ({variant.name}) built in {build_s:.0f} s: {root}")
    return Install(root, COMMIT, layout, build_s, variant.name)


def _probe(src: Path, tmp: Path) -> dict:
    """The struct layout of this tree's ggml, from layout_probe.c compiled against its headers (-O1: unused static
    inline helpers of ggml-impl.h are then not emitted, so nothing needs linking)."""
    exe = tmp / "layout_probe"
    _run(["cc", "-O1", "-I", str(src / "ggml" / "include"), "-I", str(src / "ggml" / "src"), str(_PROBE), "-o",
          str(exe)], "compiling the layout probe")
    out = _run([str(exe)], "running the layout probe")
    try:
        return json.loads(out)
    except ValueError:
        raise LlamaError(f"llama.cpp build: the layout probe printed {out[:200]!r}") from None
