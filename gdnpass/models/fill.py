"""Data for a graph that has none yet: reproducible contents for every leaf (weights, caches, inputs), for the
checks, the benchmarks and a preset's generated weights. Inputs llama.cpp sets get llama.cpp's values
(:mod:`gdnpass.models.inputs`, or the bytes a capture recorded); every other leaf gets seeded normals scaled to its
role, so the GDN recurrence and the norms stay finite. The executor itself only plans and runs
(:mod:`gdnpass.runtime`).
"""

from __future__ import annotations

import base64
import zlib
from typing import Callable, Collection

import numpy as np
import torch

from gdnpass.ir import DType, Graph, GraphError, Tensor
from gdnpass.models.hparams import check_meta, config_from_meta, ids_from_meta
from gdnpass.models.inputs import input_values
from gdnpass.runtime import TORCH_DTYPES, Executor


def fill(ex: Executor, seed: int = 0, ids: list[int] | None = None,
         progress: Callable[[int, int], None] | None = None, keep: Collection[str] = (),
         skip: Collection[str] = ()) -> None:
    """Reproducible contents for every leaf of ``ex``'s graph, and poison (NaN) in the arena.

    A leaf's bytes depend only on (seed, name, shape, type): two graphs built from one config get the same
    weights, and no tensor's fill depends on another's. Caches and inputs are random, never zeros (zeros hide
    unwritten outputs). Inputs llama.cpp sets (token ids, positions, row ids, the KQ mask, ``rs_s_copy``) get its
    values (:func:`gdnpass.models.inputs.input_values`; ``ids`` sets ``rs_s_copy``). ``progress(done_bytes,
    total_bytes)`` after each leaf. ``keep``: buffers left as they are (one another executor of the same leaves
    filled and shares); ``skip``: leafs, by name, left as they are (weights of a model's buffer another context
    loaded).
    """
    ex.buffers[ex.arena].fill_(0xFF)  # 0xFFFFFFFF is a NaN in f32
    leafs = [t for t in ex.graph.leafs if not t.is_view and not t.is_empty and t.base.buffer not in keep
             and t.name not in skip]
    total, done = sum(t.nbytes for t in leafs), 0
    known = _input_values(ex.graph, seed, ids, leafs)
    for t in leafs:
        if t.uid in known or t.type in (DType.I32, DType.I64):
            if t.uid not in known:
                raise GraphError(f"tensor {t.name!r}: an integer input gdnpass has no values for"
                                 + (" (this capture predates recorded inputs: capture it again)"
                                    if ex.graph.meta.get("builder") == "llama.cpp" else ""))
            vals = torch.tensor(known[t.uid], dtype=TORCH_DTYPES[t.type] if t.type is not DType.F16
                                else torch.float32)
            if vals.numel() != t.nelements:
                raise GraphError(f"tensor {t.name!r}: {vals.numel()} values given, needs {t.nelements}")
            ex.view(t).copy_(vals.reshape(ex.view(t).shape))
        else:
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{t.name}".encode()))
            _init_into(ex.view(t), t, g)
        done += t.nbytes
        if progress is not None:
            progress(done, total)


def _input_values(graph: Graph, seed: int, ids: list[int] | None, leafs: list[Tensor]) -> dict[int, list]:
    """Input leaf uid -> values: from the graph's build config (by input name); a graph without one has only the
    ``ids`` it was given or recorded (``meta["ids"]``) for its I32 inputs (by type: names may repeat)."""
    meta = graph.meta
    recorded = meta.get("input_bytes")  # a captured graph: llama.cpp's own input bytes
    cfg = config_from_meta(meta)
    if recorded is not None:
        by_name = _decode_inputs(graph, recorded)
    elif cfg is not None:  # a whole forward: every input as llama.cpp sets it
        by_name = input_values(cfg, seed, ids)
        if meta.get("token_input"):  # (the MTP head's token ids: an unnamed leaf, named by ggml's rule)
            by_name[meta["token_input"]] = by_name.pop("inp_tokens")
    else:
        vals = ids if ids is not None else ids_from_meta(meta)
        return {t.uid: vals for t in leafs if t.type is DType.I32} if vals is not None else {}
    return {t.uid: by_name[t.name] for t in leafs if t.name in by_name}


def _decode_inputs(graph: Graph, recorded: dict[str, str]) -> dict[str, list]:
    """Leaf name -> flat values, from a front end's recorded input bytes (base64, the leaf's type)."""
    np_types = {DType.F32: np.float32, DType.F16: np.float16, DType.I32: np.int32, DType.I64: np.int64}
    check_meta(graph.meta)
    out = {}
    for t in graph.leafs:
        if t.name in recorded and t.view_src is None:
            if t.type not in np_types:
                raise GraphError(f"tensor {t.name!r}: recorded input bytes of type {t.type.label} cannot be read")
            try:
                raw = base64.b64decode(recorded[t.name], validate=True)
                vals = np.frombuffer(raw, dtype=np_types[t.type])
            except (TypeError, ValueError) as e:  # (binascii.Error is a ValueError)
                raise GraphError(f"meta.input_bytes[{t.name!r}]: not base64 {t.type.label} values ({e})") from None
            out[t.name] = vals.astype(np.float32 if t.type is DType.F16 else vals.dtype).tolist()
    return out


_TILE = 1 << 20        # leafs above this many elements repeat one random block ...
_BLOCK = (1 << 16) + 97  # ... of this many values: an odd period, so no two rows of a matrix are equal
_QROWS = 67              # a quantized leaf's rows repeat with this (odd) period


def _init_into(dst: torch.Tensor, t: Tensor, g: torch.Generator) -> None:
    """Write ``t``'s initial values (:func:`_init_values`) into its view ``dst``. A big contiguous leaf is written
    in one broadcast copy of its block (cache-resident source: a fill of gigabytes runs at memory bandwidth). A
    quantized leaf gets random blocks (:func:`gdnpass.kernels.quants.random_blocks`) at its role's magnitude, up to
    _QROWS rows of them repeated, as gdnpass holds them (:func:`~gdnpass.kernels.quants.held_rows`)."""
    if t.type.is_quantized:
        from gdnpass.kernels.quants import held_rows, random_blocks

        rows = dst.reshape(-1, dst.shape[-1])  # (a leaf's rows: packed)
        std = float(_role(t, torch.ones(1)))
        tile = held_rows(random_blocks(min(rows.shape[0], _QROWS), t.ne[0], t.type, g, std), t.type).to(rows.device)
        rows.copy_(tile.repeat(-(-rows.shape[0] // tile.shape[0]), 1)[: rows.shape[0]])
        return
    if t.nelements > _TILE and dst.is_contiguous():
        block = _role(t, torch.randn(_BLOCK, generator=g)).to(dst.dtype)
        flat = dst.reshape(-1)  # a view: dst is contiguous
        q = flat.numel() // _BLOCK
        flat[: q * _BLOCK].view(q, _BLOCK).copy_(block.expand(q, _BLOCK))
        flat[q * _BLOCK:].copy_(block[: flat.numel() - q * _BLOCK])
        return
    dst.copy_(_init_values(t, g).reshape(dst.shape))


def _init_values(t: Tensor, g: torch.Generator) -> torch.Tensor:
    """A leaf's initial values, from (its generator, name, shape, buffer) alone: normals at a plausible magnitude per
    tensor role (so the GDN recurrence and norms stay finite); above _TILE elements one block of _BLOCK, repeated
    (drawing gigabytes of normals would dominate a CPU run)."""
    if t.nelements > _TILE:
        block = _role(t, torch.randn(_BLOCK, generator=g)).to(TORCH_DTYPES[t.type])
        return block.repeat(t.nelements // _BLOCK + 1)[: t.nelements]
    return _role(t, torch.randn(t.nelements, generator=g))


def _role(t: Tensor, r: torch.Tensor) -> torch.Tensor:
    """Standard normals ``r`` scaled (in place) to ``t``'s role."""
    name = t.name
    if name.endswith("norm.weight"):
        return r.mul_(0.1).add_(1.0)
    if name.endswith(".ssm_a"):
        return r.mul_(0.5).exp_().neg_()
    if name.endswith("ssm_dt.bias") or name.endswith("ssm_conv1d.weight"):
        return r.mul_(0.5)
    if t.buffer == "weights":
        return r.mul_(t.ne[0] ** -0.5)  # fan-in scaled projections
    if name.startswith("cache_s"):
        return r.mul_(0.1)
    return r
