"""A qwen35 model from its GGUF file: the shape and tensor types from the header, the weights on demand.

:func:`open_model` reads only the header and the tensor index (the ``gguf`` package memory-maps the file; nothing
is read from the data section, and torch is not imported), so ``gdnpass dump --gguf`` of a large file is quick.
:meth:`GgufModel.config` gives the :class:`VerifyConfig` of a whole verify forward of the model,
:meth:`GgufModel.build` its graph with every weight in the file's type (ggml's block types the kernels read, Q8_0
and the K-quants Q4_K, Q5_K, Q6_K, stay blocks: the file's bytes, Q8_0's and Q6_K's rows split as gdnpass holds
them, quants.held_rows; the other quantized types become f32: they are dequantized on load),
:meth:`GgufModel.load_weights` writes the weights into an executor's buffers.

Archs ``qwen35`` and ``qwen35moe`` (Qwen3.5's MoE models: the same trunk, an expert FFN; its header and tensors are
read and checked, the builder refuses its expert FFN by name until it builds it) are read. ``qwen3next`` is refused
with what gdnpass lacks for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection

from gdnpass.errors import GraphError
from gdnpass.ir import HELD_SPLIT, DType, Graph
from gdnpass.models.gguf_read import GgufError, _gguf, _Header, open_reader
from gdnpass.models.gguf_write import ARCHS, check_tensors, header_shape
from gdnpass.models.hparams import ModelShape, VerifyConfig

# GGML types gdnpass holds as they are (the block types: their bytes), and the quantized ones it dequantizes to f32
# on load (gguf.quants does it)
_PLAIN = {t.name: t for t in (DType.F32, DType.F16, DType.BF16, *(d for d in DType if d.is_quantized))}
DEQUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K")

# what the other archs of the family need that gdnpass does not build (issue 17; qwen35moe is read since issue 36)
_REFUSED = {
    "qwen3next": "a mixture-of-experts FFN in every layer and the fused ssm_in / ssm_ba projections; llama.cpp also "
                 "has no rollback (n_rs_seq) for it",
}


@dataclass
class GgufModel:
    path: Path
    shape: ModelShape
    types: dict[str, str]                 # tensor name -> GGML type name, as the file has it
    dequantized: list[str] = field(default_factory=list)  # tensors held as f32 after dequantizing
    nbytes: dict[str, int] = field(default_factory=dict)  # tensor name -> its bytes in the file

    def weight_types(self) -> dict[str, DType]:
        """The DType the graph gives each weight: the file's, or f32 for one dequantized on load."""
        return {n: _PLAIN.get(t, DType.F32) for n, t in self.types.items()}

    def config(self, layers: int | None = None, **kw) -> VerifyConfig:
        """A whole verify forward of this model, or of its first ``layers`` layers (:meth:`ModelShape.first_layers`;
        ``kw``: n_tokens, n_rs_seq, ... as VerifyConfig takes them)."""
        return VerifyConfig(model=self.shape.first_layers(layers) if layers else self.shape, whole=True, **kw)

    def mtp_config(self, **kw) -> VerifyConfig:
        """One ubatch of the model's MTP head (llama.cpp's LLAMA_CONTEXT_TYPE_MTP graph: docs/mtp.md); ``kw`` as
        :meth:`config`. GraphError naming the file when it has no MTP block."""
        if self.shape.nextn_predict_layers != 1:
            raise GgufError(f"{self.path}: qwen35.nextn_predict_layers is {self.shape.nextn_predict_layers}: no MTP "
                            "head to build (llama.cpp's qwen35 MTP graph runs exactly one MTP block)")
        return VerifyConfig(model=self.shape, whole=True, mtp=True, **kw)

    def weights_summary(self, graph: Graph | None = None) -> str:
        """The weights ``graph`` takes from the file (default: every tensor gdnpass reads), by type, with each type's
        share of their bytes in the file: 'Q4_K x28 (74.1%), Q6_K x5 (23.0%), F32 x23 (2.9%)'; a type dequantized
        on load says so."""
        from collections import Counter

        names = self.types if graph is None else \
            [t.name for t in graph.leafs if t.buffer == "weights" and t.name in self.types]
        n, size = Counter(), Counter()
        for name in names:
            n[self.types[name]] += 1
            size[self.types[name]] += self.nbytes.get(name, 0)
        total = sum(size.values()) or 1
        return ", ".join(f"{k} x{n[k]} ({100 * size[k] / total:.1f}%)" + (" dequantized to f32" if k in DEQUANTIZED
                                                                        else "") for k in sorted(n, key=lambda k: -size[k]))

    def build(self, cfg: VerifyConfig) -> Graph:
        from gdnpass.models.ir_facade import build_verify_graph

        g = build_verify_graph(cfg, weight_types=self.weight_types())
        missing = [t.name for t in g.leafs if t.buffer == "weights" and t.name not in self.types]
        if missing:
            raise GraphError(f"{self.path}: the graph needs {', '.join(missing[:4])}"
                             + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else "") + ", absent from the file")
        g.meta["gguf"] = {"file": str(self.path), "dequantized": self.dequantized}
        return g

    def load_extra_bytes(self, graph: Graph) -> int:
        """Memory :meth:`load_weights` holds besides the executor's buffers: one weight at a time, its copy out of
        the file (f32 when dequantized, then converted to the buffer's type when that differs; Q8_0's and Q6_K's
        rows then split, :func:`~gdnpass.kernels.quants.held_rows`): the largest such copy, for the executor's memory
        check (``Executor(..., extra=...)``)."""
        most = 0
        for t in graph.leafs:
            if t.buffer == "weights" and t.view_src is None and t.name in self.types:
                file_t = self.types[t.name]
                held = t.nelements * 4 if file_t in DEQUANTIZED else _PLAIN[file_t].row_bytes(t.nelements)
                converted = _PLAIN.get(file_t, DType.F32) is not t.type or t.type in HELD_SPLIT
                most = max(most, held + (t.nbytes if converted else 0))
        return most

    def load_weights(self, executor, graph: Graph, skip: Collection[str] = ()) -> int:
        """Write every weight leaf of ``graph`` but those named in ``skip`` (loaded already into a buffer the
        executor shares) from the file into ``executor``'s buffers (the block types the kernels read as gdnpass holds
        them, :func:`~gdnpass.kernels.quants.held_rows`; the other quantized types dequantized); returns the bytes
        written."""
        import numpy as np
        import torch

        from gdnpass.kernels.quants import held_rows

        gguf = _gguf()
        reader = open_reader(self.path)  # (a 248k-token vocabulary: 1 s, not GGUFReader's 24)
        by_name = {t.name: t for t in reader.tensors}
        done = 0
        for t in graph.leafs:
            if t.buffer != "weights" or t.view_src is not None or t.name in skip:
                continue
            src = by_name[t.name]
            if src.tensor_type.name in DEQUANTIZED:
                arr = gguf.quants.dequantize(src.data, src.tensor_type)  # (a new array)
            else:
                arr = np.array(src.data, copy=True)  # (the memmap is read-only; torch wants a writable array)
            view = executor.view(t)
            if t.type.is_quantized:  # the blocks' bytes, as gdnpass holds them (the view: the rows' bytes)
                value = torch.from_numpy(arr.view(np.uint8).reshape(-1))
                if value.numel() != t.nbytes:
                    raise GgufError(f"{self.path}: tensor {t.name!r} has {value.numel()} bytes, the graph "
                                    f"{t.nbytes}")
                view.copy_(held_rows(value.reshape(view.shape), t.type))
                done += t.nbytes
                continue
            if src.tensor_type.name == "BF16":  # numpy has no bfloat16: the file's uint16 words are the bits
                value = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
            else:
                value = torch.from_numpy(arr)
            want = tuple(reversed(t.ne))
            if value.numel() != t.nelements:
                raise GgufError(f"{self.path}: tensor {t.name!r} has {value.numel()} elements, the graph {t.nelements}")
            view.copy_(value.reshape(want).to(view.dtype))
            done += t.nbytes
        return done


def open_model(path: str | os.PathLike) -> GgufModel:
    """The model in a GGUF file, from its header and tensor index; GgufError naming what is wrong otherwise: the
    metadata is validated as a whole (:func:`gdnpass.models.gguf_write.header_shape`) and every tensor's ``ne``
    checked against the shape's (:func:`gdnpass.models.gguf_write.check_tensors`) before anything is built."""
    path = Path(path)
    reader = open_reader(path)
    arch = _Header(reader, path).text("general.architecture")
    if arch in _REFUSED:
        raise GgufError(f"{path}: architecture {arch!r} is not built by gdnpass: it needs {_REFUSED[arch]}")
    if arch not in ARCHS:
        raise GgufError(f"{path}: architecture {arch!r}; gdnpass builds {' and '.join(map(repr, ARCHS))} models")
    shape, n_block = header_shape(reader, path)  # the metadata, validated as a whole
    check_tensors(reader, shape, n_block, path)  # every tensor llama.cpp's shape, before anything is built
    types = {t.name: t.tensor_type.name for t in reader.tensors}  # (the MTP blocks' too: the MTP head reads them)
    nbytes = {t.name: int(t.n_bytes) for t in reader.tensors if t.name in types}
    bad = sorted({v for v in types.values() if v not in _PLAIN and v not in DEQUANTIZED})
    if bad:
        raise GgufError(f"{path}: tensor types {', '.join(bad)} are not supported (gdnpass reads F32, F16, BF16 and "
                        f"dequantizes {', '.join(DEQUANTIZED)})")
    return GgufModel(path, shape, types, sorted(n for n, t in types.items() if t in DEQUANTIZED), nbytes)

