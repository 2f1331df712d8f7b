"""Everything the GPU host is for, in parts that each fit one 10-minute device call; a short table last.

    python benchmarks/device_session.py --part 1|6|7|9|11|15 [--source .llama-src] [--out DIR]
    python benchmarks/device_session.py --part 2|3|4|5|8|10|12|13|14|16-30 [--out DIR]
    python benchmarks/device_session.py --steps quant-tests,check-9b,...   # named steps of any parts, one call

Part 1 (issue 32): the forward's bytes under programmatic dependent launch (two GPU tests), then the ceilings, the
alpha/beta pair against the read bandwidth, the whole qwen3.5-9b verify, ours off / on / on without the newest
pattern (the registry's last) / on launched the other way (PDL or serial), next to upstream llama.cpp built with CUDA (``bench.py
--quick --only pair,whole,upstream --without PATTERN``; the CUDA build alone takes 3-4 minutes on a fresh host, made
while the GPU works).
Part 2 (issue 16): bench.py's per-op, mat-vec, chain, dedup and pair tables and our whole verify, compute-sanitizer
memcheck and racecheck over every kernel (``sanitize.py``), then the kernel test files compiled.
Part 3: the 800-case exactness sweep in both hint modes, in parallel (``warm_compile.py``: the check of
``test_sweep_gpu_all_800``, which takes over 250 s per mode in one pytest process), then the other GPU tests
(``pytest -m gpu``, the sweep test and the MoE ones, part 8's, left out: every model tile launched, the ceilings), and ``run --check`` of 8 layers
of the 9B at T = 8 on the GPU.

Part 4 (issue 34): the quantized kernels compiled (test_triton_quants.py), the quantized products at the 9B's
shapes (``bench.py --quick --only quant``), the whole 9B verify with Q4_K and with Q8_0 weights (``--only whole
--wtype``), ``run --check`` of 8 layers of the 9B with Q4_K weights, and ncu's reading of one Q4_K launch
(``one_matvec.py``).
Part 5 (issue 34, after part 4): the quantized tiles re-swept (``tune_matvec.py --wtypes q4_k,q6_k,q8_0``).
Part 6 (issue 34): ours and upstream llama.cpp on one real Q4_K_M file, the whole verify in one run (``bench.py
--quick --only whole,upstream --quantize q4_k_m``; carry ``.llama-src`` as for part 1), then the issue's acceptance on
that file: ``gdnpass generate --check`` on the GPU, fused and unfused identical.
Part 15 (issue 34): part 6 on the 9B quantized to Q8_0 (``--quantize q8_0``), the issue's other file.
Part 7 (issue 35): the MTP loop, gdnpass (fusion off and on) next to llama.cpp's ``--spec-type draft-mtp`` on one
file, the 9B shape as a cycle model with an MTP head (``generate_bench.py --draft mtp``; carry ``.llama-src``).
Part 8 (issue 36): the expert FFN's kernels compiled (``tests/kernels/test_moe_ops.py``, its GPU test at the 35B-A3B
and 512-expert shapes among them), then the whole tiny-qwen35moe forward on the Triton backend (``tests/
test_moe_triton.py``: run --check fused vs unfused, logits against the torch backend's; the gguf wheel needed),
then the fused router, MOE_ROUTER, compiled (``tests/patterns/moe_router``).
Part 9 (issue 37 item 4): several sequences at once, tokens/s over all sequences at S = 1, 8, 32, gdnpass (fusion
off and on) next to llama.cpp's library decoding the same batches, the 9B shape as a cycle model
(``seqs_bench.py``; carry ``.llama-src`` and ``.whl``).
Part 10 (issue 37 item 3): the dedup layouts at 128 sequences compiled, byte for byte (``test_seqs.py``'s GPU
test; part 3 leaves it here), then the deduplicated snapshot window at batch, seed 003's table (``tune_dedup.py``):
S 1, 8, 64, 128 x T 4, 8, 16 in the rows, dedup and dedup-t layouts and the per-token baseline, fused vs unfused
byte for byte before timing, at the seed's shape (qwen3.5-27b, C 10240), at qwen3.5-9b's (C 8192), and the seed's
bf16 bytes (f32 at half the heads, C 5120) at its points.
Part 11 (issue 36): the MoE table, qwen3.5-35b-a3b's first 8 layers at full width, ours off / on next to upstream
on one file, the chosen experts' bytes over the MUL_MAT_IDs' time (``bench.py --only whole,upstream --model
qwen3.5-35b-a3b --layers 8``; carry ``.llama-src``).
Part 13 (issues 34, 32): the quantized mat-vec of e91a2a0 (before the Q4_K register cap and the pair's one code
path) and of the working tree, each output's bytes hashed, then one 32-column launch against two of 16
(``probe_quant.py``; carry ``.ab``, made as the step's comment says); the whole bf16 9B verify of both.
Part 12 (issue 37 item 4): the GEMM of products over 16 columns compiled and checked at the 9B's shapes
(``tests/kernels/test_gemm.py -m gpu``), then its tile sweep next to the torch reference it replaced and cuBLAS
(``tune_gemm.py``); then part 9 again, for tokens/s at 8 and 32 sequences.
Part 14 (issue 34): the whole 9B verify with all-Q4_K and all-Q6_K weights, fusion on with and without
MUL_MAT_ADD (``bench.py --only whole --wtype W --without mul_mat_add``): whether its residual form pays on quantized
weights; Q4_K also at e91a2a0 (``.ab``, as part 13), before the register cap that gives it 4 programs an SM.
Part 16 (issue 32): the GDN computing its gates (gdn_gates), gathering its state (gdn_state_gather) and the z
product running the GDN's output gate (mul_mat_chain): the GDN's kernel tests compiled, ``run --check`` of 8 layers of
the 9B at T = 4 and 8, the whole bf16 verify with and without each of the last two (``bench.py --only whole --without
PATTERN``).
Part 17 (issues 32, 34): the two tiles the twelfth session's tables point at, swept (``tune_matvec.py``): bf16 4096 x
4096 at 4 and 8 columns (``--deep``; 55% of the read bandwidth in the whole verify) and Q8_0's 32-row alpha/beta pair
(twice upstream's time).
Part 18 (issues 32, 34): part 17's bf16 tiles in the whole verify against the package before them, in one run
(``.ab/7edac5d``, made as the step's comment says, carried); then the thin pairs part 17 left: f32, Q4_K and Q6_K
alpha/beta (32 x 4096) and bf16 attention k / v (1024 x 4096).
Part 19 (issues 34, 32): Q8_0's and Q6_K's quants loaded in the dot's layout, no trip through shared memory: the
quantized kernels compiled, then their products at the 9B's shapes against the package before (``.ab/6b4e38c``, made
as part 18's, carried; ``probe_quant.py``, bytes hashed), and ncu's reading of one Q8_0 launch of each.

Part 20 (issue 32): the FFN pair's SwiGLU in its launch (pair_glu) and ROPE's angles made once a token: their GPU
tests, the fused 9B layers checked, and the whole bf16 verify against the package before both (``.ab/8b61a0b``, made
as part 18's, carried).

Part 21 (issue 32): the bf16 tiles of the sixteenth session's sweeps (8 columns of 8192+ rows and of attention k / v,
9-16 columns): the pair's GPU tests, the fused 9B layers checked at 8 and 16 tokens, and the whole bf16 verify
against the package before them (``.ab/bd422b0``, made as part 18's, carried).
Part 22 (issue 34): Q6_K's rows held split, branch ``probe/q6k-split`` (``.ab/q6k``, made as session.Q6_K_SPLIT's line
says, carried): its Q6_K kernel tests there, its products against the tree's (``probe_quant.py --qtypes q6_k``, bytes
hashed), and its tiles swept (``tune_matvec.py --wtypes q6_k --deep``).
Part 23 (issue 34): Q8_0's aligned form, branch ``probe/q8-scales`` (``.ab/q8a``, made as session.Q8_0_ALIGNED's line
says, carried): its Q8_0 kernel tests there, its products against the tree's at both sum widths (bytes hashed), the
whole Q8_0 verify of both, and 8 of its fused layers checked.
Part 24 (issues 34, 32): ncu's issue reading (scheduler, warp states, instructions) of one quantized launch of each
block type, main's and the two branches' forms (``.ab/q6k``, ``.ab/q8a``, carried): are they bound by what they issue?
Part 25 (issues 34, 32): warps in flight for the quantized products: each block type's tiles with K split finer
(``probe_quant.py --vary split_k=1,2,4,8``), then with 8 warps a program (``--vary warps=4,8``).

Part 26 (issue 34): Q8_0's scales a step ahead, the weights' and the activations', against the weights' only and
the package before (``.ab/q8x``, ``.ab/789ae72``: session.Q8_0_SCALES): its kernel tests, the products (bytes
hashed), 8 fused 9B layers checked. Part 27: the same three packages in the whole Q8_0 verify.
Part 28 (issue 34): Q6_K's rows held split: its kernel and GET_ROWS tests, its products and the whole Q6_K verify
against the package before, 8 fused 9B layers checked.
Part 29 (issue 34): Q8_0's and Q6_K's tiles swept again on those forms (``tune_matvec.py``, single products at 4
and 8 columns, then the FFN pair), Q8_0's 8-column sum and its pair's split among the candidates.
Part 30 (issue 34): the Q8_0 FFN pair handing its SwiGLU on as ffn_down's activations: its tests compiled, its probe
(``probe_pair_glu.py --wtypes q8_0``), 8 fused 9B layers checked, the whole Q8_0 verify against the package before
(``.ab/8f6d616``, made as part 18's, carried).

Each step runs in its own process group with a time limit (a step that runs out is reported, the next one still
runs); its output goes to the terminal and to ``DIR/<step>.log`` (``$OUT`` by default, the device tool's folder), the
bench's numbers to ``DIR/<step>.json``. Run it from the repository root with ``PYTHONPATH=.``; carry ``.llama-src``
(``gdnpass llama-build --pack .llama-src``) and the gguf wheel for part 1 (docs/performance.md). The steps and their
runner are gdnpass.bench.session's.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gdnpass.bench.session import PARTS, named_steps, run_step, steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--part", type=int, choices=PARTS)
    which.add_argument("--steps", help="named steps of any parts, comma-separated, in that order")
    p.add_argument("--source", help="parts 1, 6, 7, 9, 11 and 15: a folder `gdnpass llama-build --pack` wrote")
    p.add_argument("--out", default=os.environ.get("OUT") or "device-session", help="logs and JSON (default: $OUT)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = steps(a.part, a.source, out) if a.part else named_steps(a.steps.split(","), a.source, out)
    results = [run_step(name, cmd, limit, out) for name, cmd, limit in chosen]
    print(f"\n## device session, {f'part {a.part}' if a.part else a.steps}")
    print("step | status | seconds | last line")
    for name, rc, secs, said in results:
        status = "ran out of time" if rc is None else "ok" if rc == 0 else f"exit {rc}"
        print(f"{name:15s} | {status:15s} | {secs:6.0f} | {said}")
    return 0 if all(rc == 0 for _, rc, _, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
