"""Upstream llama.cpp's verify on a quantized 9B file, walls only (no ncu): the CUDA build, the bf16 file and its
quantization by llama.cpp's own quantizer (each made when missing), then its verify decode timed per width.

    python benchmarks/upstream_quantized.py --quantize q4_k_m --source .llama-src
"""

from __future__ import annotations

import argparse
import sys

from gdnpass.bench import upstream


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quantize", default="q4_k_m", help="llama.cpp's mix (q4_k_m, q8_0, ...)")
    p.add_argument("--source", help="a packed llama.cpp source (machines without a registry)")
    a = p.parse_args()
    say = (lambda line: print(line, file=sys.stderr, flush=True))  # noqa: E731
    install, gguf = upstream.prepare("qwen3.5-9b", a.source, None, say, a.quantize)
    upstream.print_tables(upstream.measure(install, gguf, "qwen3.5-9b", say, kernels=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
