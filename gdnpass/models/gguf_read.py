"""Reading a GGUF file's header, bounded by the file: :func:`open_reader` (a ``gguf.GGUFReader`` that reads long
arrays in one pass and refuses, before building anything of that size, a count, length or offset past the end of
the file) and typed reads of its metadata (``_Header``: a value of the type its key needs, or a one-line
:class:`GgufError` naming the file and the key). :mod:`gdnpass.models.gguf_write` (the qwen35 shape of a header) and
:mod:`gdnpass.tokenizer` (a file's tokenizer) read through it. No torch.
"""

from __future__ import annotations

import os
import struct
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from gdnpass.errors import GdnpassError


class GgufError(GdnpassError, ValueError):
    """A GGUF file that cannot be written or read as asked: the path, the weight type, the shape, or the file's
    architecture and keys. The message is one line naming the file (or field) at fault."""


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - depends on the environment
        raise GgufError("writing or reading GGUF files needs the gguf package: pip install 'gdnpass[llama]'") from None
    return gguf


class _Truncated(Exception):
    """A read past the end of the file (open_reader turns it into a GgufError saying "truncated")."""


# the fewest bytes a key-value (key length, a 1-byte key, type, a 1-byte value) and a tensor info (name length, a
# 1-byte name, n_dims, type, offset) take: a header count larger than the file can hold is refused before parsing
_MIN_KV_BYTES, _MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 1, 8 + 1 + 4 + 4 + 8
GGML_MAX_DIMS = 4


@lru_cache(maxsize=1)
def _reader_class():
    gguf = _gguf()
    V = gguf.GGUFValueType

    class HeaderReader(gguf.GGUFReader):
        """``GGUFReader`` with arrays of strings or numbers read in one pass: the same fields, one part per value as
        GGUFReader makes them, but without a numpy read per value (a 248k-token vocabulary: 1 s instead of 24 s).
        Every read is bounded by the file: a count, length or offset past its end is refused (``_Truncated``, or a
        ValueError naming what is wrong) before anything of that size is built."""

        def _get(self, offset, dtype, count=1, override_order=None):
            count, offset = int(count), int(offset)
            n = count * np.dtype(dtype).itemsize
            if count < 0 or offset < 0 or offset + n > len(self.data):
                raise _Truncated(f"{count} x {np.dtype(dtype).name} at byte {offset}, past the end of its "
                                 f"{len(self.data)} bytes")
            return super()._get(offset, dtype, count, override_order)

        def _build_fields(self, offs, count):
            if int(count) * _MIN_KV_BYTES > len(self.data) - offs:
                raise _Truncated(f"its header lists {int(count)} key-values, more than its {len(self.data)} bytes "
                                 "can hold")
            return super()._build_fields(offs, count)

        def _build_tensor_info(self, offs, count):
            if int(count) * _MIN_TENSOR_INFO_BYTES > len(self.data) - offs:
                raise _Truncated(f"its header lists {int(count)} tensors, more than its {len(self.data)} bytes can "
                                 "hold")
            return super()._build_tensor_info(offs, count)

        def _get_tensor_info_field(self, orig_offs):
            n = int(self._get(orig_offs, np.uint64)[0])
            n_dims = int(self._get(orig_offs + 8 + n, np.uint32)[0])
            if n_dims > GGML_MAX_DIMS:  # (before reading that many dims)
                name = bytes(self._get(orig_offs + 8, np.uint8, n)).decode("utf-8", "replace")
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions (ggml has {GGML_MAX_DIMS})")
            return super()._get_tensor_info_field(orig_offs)

        def _build_tensors(self, start_offs, fields):
            for field in fields:  # each tensor's type, dims and bytes, in Python ints, before GGUFReader maps it
                _, _, _, dims, raw_type, offset = field.parts
                name = field.name
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise ValueError(f"tensor {name!r} has unknown ggml type {int(raw_type[0])}") from None
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                ne = [int(x) for x in dims]
                if ne and ne[0] % block:
                    raise ValueError(f"tensor {name!r} ({qtype.name}): rows of {ne[0]} values are not whole blocks "
                                     f"of {block}")
                lo = start_offs + int(offset[0])
                hi = lo + int(np.prod(ne, dtype=object)) // block * size
                if hi > len(self.data):
                    raise _Truncated(f"tensor {name!r} needs bytes [{lo}, {hi}), the file has {len(self.data)}")
            super()._build_tensors(start_offs, fields)

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != V.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            itype, n = (int(x) for x in (self._get(orig_offs, np.uint32)[0], self._get(orig_offs + 4, np.uint64)[0]))
            nptype = self.gguf_scalar_to_np.get(V(itype))
            if n == 0 or (itype != V.STRING and nptype is None):  # (arrays of arrays: GGUFReader's way)
                return super()._get_field_parts(orig_offs, raw_type)
            plain = self.data.view(np.ndarray)
            parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
            offs = orig_offs + 12
            size = 8 if itype == V.STRING else np.dtype(nptype).itemsize  # (a string: at least its length)
            if n * size > len(plain) - offs:
                raise _Truncated(f"an array of {n} values at byte {orig_offs}, past the end of its {len(plain)} bytes")
            if itype == V.STRING:
                unpack = struct.Struct("<Q").unpack_from
                for _ in range(n):
                    if offs + 8 > len(plain):
                        raise _Truncated(f"a string at byte {offs}, past the end of its {len(plain)} bytes")
                    (k,) = unpack(plain, offs)
                    if offs + 8 + k > len(plain):
                        raise _Truncated(f"a string of {k} bytes at byte {offs}, past the end of its {len(plain)} "
                                         "bytes")
                    parts += (plain[offs:offs + 8].view(np.uint64), plain[offs + 8:offs + 8 + k])
                    offs += 8 + k
                return offs - orig_offs, parts, list(range(3, len(parts), 2)), [V.ARRAY, V.STRING]
            values = plain[offs:offs + n * size].view(nptype)
            parts += (values[i:i + 1] for i in range(n))
            return 12 + n * size, parts, list(range(2, len(parts))), [V.ARRAY, V(itype)]

    return HeaderReader


def open_reader(path: Path, mode: str = "r"):
    """A ``gguf.GGUFReader`` of ``path`` (memory-mapped: the header and tensor index are read, no tensor data; long
    arrays in bulk); GgufError, one line, when the file is missing, not GGUF, truncated (its header, or a tensor's
    data, runs past its end) or corrupt (a count larger than the file, an unknown type, a duplicate key)."""
    try:
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            raise _Truncated("the file is empty")
        return _reader_class()(path, mode)
    except FileNotFoundError:
        raise GgufError(f"{path}: no such file") from None
    except _Truncated as e:
        raise GgufError(f"{path}: truncated: {e}") from None
    except (OSError, ValueError, KeyError, IndexError, OverflowError, TypeError, struct.error) as e:
        msg = ((e.strerror if isinstance(e, OSError) else e.args[0] if isinstance(e, KeyError) and e.args else None)
               or str(e) or type(e).__name__)
        raise GgufError(f"{path}: not a readable GGUF file ({msg})".replace("\n", " ")) from None


# GGUF value types by what a key holds
_INTS = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")
_FLOATS = ("FLOAT32", "FLOAT64")


class _Header:
    """Typed reads of a file's metadata: each value of the type its key needs, or a GgufError naming the file and
    the key (a string where a count belongs, a negative count, an array of the wrong length)."""

    def __init__(self, reader, path: Path) -> None:
        self.fields, self.path = reader.fields, path

    def fail(self, msg: str):
        raise GgufError(f"{self.path}: {msg}")

    def _types(self, key: str) -> list[str]:
        return [t.name for t in self.fields[key].types]

    def _contents(self, key: str) -> Any:
        try:
            return self.fields[key].contents()
        except (ValueError, IndexError) as e:  # (a string that is not UTF-8)
            self.fail(f"{key} cannot be read ({e})")

    def has(self, key: str) -> bool:
        return key in self.fields

    def text(self, key: str, default: str | None = None) -> str | None:
        if key not in self.fields:
            return default
        if self._types(key) != ["STRING"]:
            self.fail(f"{key} must be a string, is a {'/'.join(self._types(key)).lower()}")
        return self._contents(key)

    def number(self, key: str, kinds: tuple[str, ...], what: str, default: Any = None, per_layer: int = 0) -> Any:
        """A scalar of one of ``kinds``; with ``per_layer`` (block_count) also an array of that many equal ones, as
        llama.cpp's get_key_or_arr takes them."""
        if key not in self.fields:
            return default
        t = self._types(key)
        if len(t) == 1 and t[0] in kinds:
            v = self._contents(key)
        elif per_layer and len(t) == 2 and t[0] == "ARRAY" and t[1] in kinds:
            vals = self._contents(key)
            if len(vals) != per_layer:
                self.fail(f"{key} has {len(vals)} per-layer values, block_count is {per_layer}")
            if len(set(vals)) != 1:
                self.fail(f"{key} differs per layer ({vals[:8]}{' ...' if len(vals) > 8 else ''}); a ModelShape has "
                          "one value")
            v = vals[0]
        else:
            self.fail(f"{key} must be {what}, is a {'/'.join(t).lower()}")
        if kinds is _INTS:
            v = int(v)
            if v < 0:
                self.fail(f"{key} must be >= 0, is {v}")
            return v
        return float(v)

    def count(self, key: str, default: Any = None, per_layer: int = 0) -> Any:
        return self.number(key, _INTS, "an integer", default, per_layer)

    def real(self, key: str, default: Any = None) -> Any:
        return self.number(key, _FLOATS + _INTS, "a number", default)

    def array(self, key: str, kinds: tuple[str, ...], what: str) -> list | None:
        if key not in self.fields:
            return None
        t = self._types(key)
        if not (len(t) == 2 and t[0] == "ARRAY" and t[1] in kinds):
            if t == ["ARRAY"]:  # an empty array has no element type
                return []
            self.fail(f"{key} must be an array of {what}, is a {'/'.join(t).lower()}")
        return list(self._contents(key))
