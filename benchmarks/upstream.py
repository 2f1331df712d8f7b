"""Upstream llama.cpp's own verify decode on this GPU, as the peer of ``bench.py --only whole``.

    python benchmarks/upstream.py [--model qwen3.5-9b] [--source DIR] [--gguf PATH] [--json OUT]

1. builds the pinned llama.cpp with ggml-cuda for sm_90 (``gdnpass llama-build --cuda``; from ``--source``, a folder
   ``gdnpass llama-build --pack`` wrote, where the machine has no registry access), once per cache;
2. writes the model as a GGUF file with the weights bench.py's whole forward uses (bf16 projections, f32 alpha/beta;
   random, tame) unless ``--gguf`` names one;
3. per verify width (T, rows) = (4, 4) and (8, 8) (n_rs_seq = rows - 1, the DFlash taps on, 16 prompt tokens,
   n_ctx 256), under ``ncu --clock-control none --cache-control none --profile-from-start off``: every kernel of
   one verify decode and its duration (ggml-cuda's CUDA graphs off there, so each kernel is launched and measured
   by itself; torch cannot share the process with ggml-cuda, so torch.profiler cannot be used);
4. wall-clock time per verify decode with ggml-cuda's CUDA graphs on (llama_decode + llama_synchronize, medians),
   each decode a speculative step that accepts no draft and is rolled back with ``llama_memory_seq_rm``.

It prints kernels and kernel time per verify, the per-GDN-layer chain table (``chain_table``, the same
classification bench.py applies to its own kernels) and the wall times. The steps are gdnpass.bench.upstream's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gdnpass.bench.upstream import measure, prepare, print_tables


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3.5-9b")
    p.add_argument("--source", help="a folder `gdnpass llama-build --pack` wrote (default: $GDNPASS_LLAMA_SRC or "
                                    "the sdist)")
    p.add_argument("--gguf", help="the model file (default: written once to /dev/shm or the temp dir)")
    p.add_argument("--json", help="write the numbers to this file")
    a = p.parse_args()
    install, gguf = prepare(a.model, a.source, a.gguf)
    up = measure(install, gguf, a.model)
    print_tables(up)
    if a.json:
        Path(a.json).write_text(json.dumps(up, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
