"""A GGUF file rewritten with some tensors dropped or changed (tests of bad and stripped files)."""

from __future__ import annotations

import numpy as np


def rewrite_gguf(src, dst, keep=lambda name: True, change=lambda name, a: a):
    """``src`` written to ``dst`` with its metadata, the tensors ``keep`` keeps, each through ``change``."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())  # (qwen35 or qwen35moe: the source's)
    for f in r.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        if keep(t.name):
            w.add_tensor(t.name, change(t.name, np.array(t.data)), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
