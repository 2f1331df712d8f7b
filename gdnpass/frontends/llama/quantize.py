"""Quantize a GGUF model file with llama.cpp's own quantizer (``llama_model_quantize`` of the pinned libllama).

gguf (the Python package) quantizes Q8_0 only; the K-quants (Q4_K_M, Q5_K_M, Q6_K, ...) come from llama.cpp, so
gdnpass's quantized test and benchmark files are llama.cpp's. :func:`quantize` runs ``llama_model_quantize`` in the
worker subprocess (:mod:`.worker`, mode ``quantize``: a ggml abort cannot take gdnpass down) with
``llama_model_quantize_default_params()`` and the ftype of :data:`FTYPES` (its ``LLAMA_FTYPE_MOSTLY_*`` value read
from the build's bindings), then reads the output back with gguf and reports each tensor's type and each type's
count and share of the bytes. One command: ``gdnpass quantize IN.gguf OUT.gguf --type q4_k_m``.

What llama.cpp chooses (llama-quant.cpp at 0c1e570; docs/llama-cpp.md has the table for two tiny models):

* 1-D tensors, norms (``*_norm.weight``), ``ssm_conv1d``, ``ssm_a``, ``ssm_dt.bias`` stay as they are (F32);
* every other 2-D ``*.weight`` takes the ftype's type (Q8_0, Q4_K, Q5_K, Q6_K), ``ssm_alpha`` / ``ssm_beta``
  included; ``output.weight`` is Q6_K for every K mix (Q8_0 for q8_0); the ``_M`` mixes give ``attn_v`` and the GDN
  layers' ``attn_qkv`` (one counter over both) and ``ffn_down`` Q6_K where ``use_more_bits`` picks (the first and
  last eighth, every third between); q4_k_s gives the first four ``attn_qkv`` / ``attn_v`` and the first eighth's
  ``ffn_down`` Q5_K;
* a row (ne0) that is not a multiple of the type's block (256 for the K-quants) falls back: Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0 (:attr:`QuantizeResult.fallbacks`). A model whose every such row is a multiple of 256
  (:func:`tiny_k256`) has no fallback;
* no K mix needs an importance matrix (llama.cpp asks for one only for the IQ1/IQ2/IQ3_XXS types and Q2_K_S).

An input that is already quantized is refused by llama.cpp (``requantizing from type q8_0 is disabled``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from gdnpass.errors import GdnpassError, LlamaError
from gdnpass.frontends.llama import build

# (gdnpass.models loads lazily: the CLI's parser reads FTYPES, and `gdnpass --help` stays instant)

# gdnpass's name -> the llama_ftype constant of the bindings (include/llama.h): the mixes gdnpass uses
FTYPES: dict[str, str] = {
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q5_k_s": "LLAMA_FTYPE_MOSTLY_Q5_K_S",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
}
# the ggml type each mix's matrices take (before the _M / _S mixes' per-tensor choices and the fallbacks)
BASE_TYPES = {"q8_0": "Q8_0", "q4_k_m": "Q4_K", "q4_k_s": "Q4_K", "q5_k_m": "Q5_K", "q5_k_s": "Q5_K", "q6_k": "Q6_K"}
QK_K = 256  # elements per K-quant block (ggml's QK_K): a K-quant row is a multiple of it


_FALLBACK = re.compile(r"warning: (\S+)\s+- ncols\s+(\d+) not divisible by\s*(\d+) \(required for type\s+(\w+)\)"
                       r".*falling back to\s+(\w+)")


@dataclass(frozen=True)
class QuantTensor:
    """One tensor of the quantized file: its name, ggml type name (gguf's spelling: ``Q4_K``, ``F32``), ne, bytes."""

    name: str
    type: str
    ne: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Fallback:
    """A tensor llama.cpp gave another type than its mix wanted, because its rows (``ncols``) are not a multiple of
    the wanted type's block."""

    name: str
    ncols: int
    wanted: str
    got: str


@dataclass
class QuantizeResult:
    src: Path
    dst: Path
    ftype: str                # a key of FTYPES
    ftype_value: int          # its LLAMA_FTYPE_MOSTLY_* value, from the bindings
    tensors: list[QuantTensor]
    fallbacks: list[Fallback] = field(default_factory=list)
    seconds: float = 0.0      # llama_model_quantize's own time
    log: list[str] = field(default_factory=list)

    @property
    def types(self) -> dict[str, tuple[int, int]]:
        """type name -> (tensors, bytes), the largest share of the bytes first."""
        out: dict[str, tuple[int, int]] = {}
        for t in self.tensors:
            n, b = out.get(t.type, (0, 0))
            out[t.type] = (n + 1, b + t.nbytes)
        return dict(sorted(out.items(), key=lambda kv: (-kv[1][1], kv[0])))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def type_of(self, name: str) -> str:
        return next(t.type for t in self.tensors if t.name == name)

    def summary_lines(self) -> list[str]:
        """One line per type: ``Q4_K x96 (61.2% of bytes)``."""
        total = self.nbytes or 1
        return [f"{k} x{n} ({100 * b / total:.1f}% of bytes)" for k, (n, b) in self.types.items()]


def tiny_k256():
    """``tiny-qwen35`` with heads of 64 (value_dim 256), a :class:`~gdnpass.models.hparams.ModelShape`: every matrix
    row (ne0) is a multiple of 256, so llama.cpp's K mixes quantize every matrix to a K-quant with no fallback.
    11.6 MB in f32, written by ``write_gguf`` in ~0.05 s."""
    from gdnpass.models.hparams import PRESETS

    return dataclasses.replace(PRESETS["tiny-qwen35"], name="tiny-qwen35-k256", head_dim=64)


def check_ftype(ftype: str) -> str:
    """``ftype`` as a key of :data:`FTYPES` (case-insensitive); LlamaError listing the known ones otherwise."""
    key = str(ftype).lower()
    if key not in FTYPES:
        raise LlamaError(f"quantize: unknown type {ftype!r} (known: {', '.join(FTYPES)})")
    return key


def read_tensors(path: str | os.PathLike) -> list[QuantTensor]:
    """Every tensor of a GGUF file (name, type, ne, bytes), in file order; GgufError when gguf cannot read it."""
    from gdnpass.models.gguf_read import open_reader

    reader = open_reader(Path(path))
    return [QuantTensor(str(t.name), t.tensor_type.name, tuple(int(x) for x in t.shape), int(t.n_bytes))
            for t in reader.tensors]


def quantize(src: str | os.PathLike, dst: str | os.PathLike, ftype: str, *, install: build.Install | None = None,
             threads: int = min(4, os.cpu_count() or 1), force: bool = False, timeout_s: float | None = None,
             log=None) -> QuantizeResult:
    """Quantize the GGUF file ``src`` into ``dst`` with llama.cpp's quantizer, mix ``ftype`` (a key of
    :data:`FTYPES`), on ``threads`` threads, and read the result back. ``install``: default the CPU build, built
    first when missing (``log(line)`` receives its progress).

    Refused in one line before llama.cpp runs: an unknown ``ftype`` (the known ones listed), a missing ``src``, a
    ``dst`` that exists (unless ``force``), is ``src`` itself, or cannot be written. llama.cpp's own refusal (a file it
    cannot load, an already quantized input) is one LlamaError line with its last error. ``dst`` is written under a
    temporary name next to it and renamed into place once gguf has read it back, so a failure leaves no partial file
    and an existing ``dst`` untouched."""
    from gdnpass.frontends.llama.capture import _call_worker
    from gdnpass.models.gguf_read import GgufError
    from gdnpass.outputs import atomic_path, check_writable

    key = check_ftype(ftype)
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise GgufError(f"quantize: input {src} " + ("is not a file" if src.exists() else "does not exist"))
    if dst.exists() and dst.resolve() == src.resolve():
        raise GgufError(f"quantize: output {dst} is the input file; give another name")
    if dst.exists() and not force:
        raise GgufError(f"quantize: output {dst} exists; --force replaces it")
    try:
        check_writable(dst, "output")
    except GdnpassError as e:
        raise GgufError(f"quantize: {e}") from None
    if threads < 1:
        raise LlamaError(f"quantize: threads must be >= 1, is {threads}")
    install = install or build.ensure(log=log)
    with atomic_path(dst) as tmp:
        req = {"mode": "quantize", "src": str(src.resolve()), "dst": str(tmp.absolute()), "ftype": FTYPES[key],
               "n_threads": threads}
        out = _call_worker(req, src, install, timeout_s, what="quantize")
        tensors = read_tensors(tmp)
    fallbacks = [Fallback(m.group(1), int(m.group(2)), m.group(4).upper(), m.group(5).upper())
                 for m in map(_FALLBACK.search, out["log"]) if m]
    return QuantizeResult(src, dst, key, out["ftype_value"], tensors, fallbacks, out["seconds"], out["log"])


def summary_text(res: QuantizeResult) -> str:
    """What ``gdnpass quantize`` prints: the files, then one line per type, then the fallbacks."""
    lines = [f"gdnpass quantize: {res.src.name} -> {res.dst} ({res.ftype}, llama_ftype {res.ftype_value}): "
             f"{len(res.tensors)} tensors, {res.nbytes / 2**20:.2f} MiB of tensor data in {res.seconds:.2f} s of "
             "llama.cpp"]
    lines += [f"  {x}" for x in res.summary_lines()]
    if res.fallbacks:
        pairs = sorted({(f.wanted, f.got, f.ncols) for f in res.fallbacks})
        lines.append(f"  {len(res.fallbacks)} fallback(s), rows not a multiple of the block: "
                     + ", ".join(f"{w} -> {g} (ne0 {n})" for w, g, n in pairs)
                     + f": {', '.join(f.name for f in res.fallbacks[:4])}"
                     + (f", ... ({len(res.fallbacks) - 4} more)" if len(res.fallbacks) > 4 else ""))
    return "\n".join(lines)
