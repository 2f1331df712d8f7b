"""The device session's steps and their runner (benchmarks/device_session.py): each part of the session is a list of
commands, the benchmark scripts run by path from the repository root (with ``PYTHONPATH=.`` there, as the session
itself), each with a time limit that fits one 10-minute device call; :func:`run_step` runs one in its own process
group, tees its output to ``DIR/<step>.log`` and stops the whole group when it runs out of time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gdnpass.patterns import REGISTRY

PY = sys.executable
BASE = ".ab/e91a2a0"  # parts 13 and 14's A/B: the package before the Q4_K register cap (3e590c0), carried
PREV = ".ab/7edac5d"  # part 18's A/B: the package before part 17's tiles (ac91785), carried; made with
# `mkdir -p .ab/7edac5d && git archive 7edac5d gdnpass | tar -x -C .ab/7edac5d`
SHARED_QUANTS = ".ab/6b4e38c"  # part 19's A/B: the package whose Q8_0 / Q6_K quants went through shared memory (as
# PREV's line says how)
BEFORE_TILES = ".ab/bd422b0"  # part 21's A/B: the package before the sixteenth session's tiles (as PREV's)
BEFORE_GLU = ".ab/8b61a0b"  # part 20's A/B: the package before pair_glu and ROPE's per-token angles (as PREV's)
Q6_K_SPLIT = ".ab/q6k"  # part 22: branch probe/q6k-split's package and tests, Q6_K's rows held split (`mkdir -p
# .ab/q6k && git archive probe/q6k-split gdnpass tests | tar -x -C .ab/q6k`)
Q8_0_ALIGNED = ".ab/q8a"  # part 23: branch probe/q8-scales's package and tests, Q8_0's aligned form (as Q6_K_SPLIT's)
# (Both branches are gone, their forms on main: Q8_0's aligned form since the eighteenth session, Q6_K's rows held
# split since the nineteenth, written again. Parts 22 and 23 are kept as the record of what ran.)
# parts 26 and 27: Q8_0's scales a step ahead, the weights' and the activations' (the tree since the nineteenth
# session; .ab/q8both when part 26 ran: `git archive d37ae67 gdnpass`); the weights' only, the activations' at the
# step's start (.ab/q8x: ebf0e40's package); the package before either (as PREV's line says how)
Q8_0_SCALES = (("", "."), ("-x-at-start", ".ab/q8x"), ("-before", ".ab/789ae72"))
BEFORE_HAND_OFF = ".ab/8f6d616"  # part 30's A/B: the package before the FFN pair handed its SwiGLU on (as PREV's)


def _on_path(package: str, *command: str) -> list[str]:
    """``command`` run with ``package``'s gdnpass first on the path (``.``: the working tree's)."""
    return ["env", f"PYTHONPATH={package}:{os.environ.get('PYTHONPATH', '')}", *command]


def _branch_tests(package: str, keyword: str) -> list[str]:
    """A branch's kernel tests of one block type (``keyword``) against its own package: both archived into
    ``package`` (its ``tests`` beside its ``gdnpass``; ``-P``: the branch's gdnpass, not cwd's)."""
    return _on_path(package, PY, "-P", "-m", "pytest", "-q", "-x", "-k", keyword, "--rootdir", package,
                    f"{package}/tests/kernels/test_triton_quants.py")


def _at(package: str, script: str, *args: str) -> list[str]:
    """A benchmark script run with ``package``'s gdnpass first on the path (:func:`_on_path`)."""
    return _on_path(package, PY, script, *args)


def _tune(out: Path, name: str, wtypes: str, shapes: str, cols: str, budget_s: int, limit: int,
          *flags: str) -> tuple[str, list[str], int]:
    """A tile sweep step (``tune_matvec.py``): ``wtypes`` at ``shapes`` and ``cols`` within ``budget_s``, every tile's
    time into ``DIR/<name>.json``; ``flags`` (``--pair``, ``--deep``) its own."""
    return (name, [PY, "benchmarks/tune_matvec.py", "--wtypes", wtypes, "--shapes", shapes, "--cols", cols, *flags,
                   "--budget-s", str(budget_s), "--json", str(out / f"{name}.json")], limit)


QUANT_BASE = "/dev/shm/q9b.gguf"  # parts 6 and 15: the 9B in bf16, which llama.cpp's quantizer makes their files of


def steps(part: int, source: str | None, out: Path) -> list[tuple[str, list[str], int]]:
    """(name, command, seconds allowed) of one part; the limits add up to under 9 minutes."""
    if part == 1:
        return [
            # the forward's bytes under programmatic dependent launch first: the timings below use it
            ("pdl", [PY, "-m", "pytest", "-q", "-x", "-k", "cuda_graph or programmatic", "tests/test_runtime.py"], 60),
            # the ceilings, the alpha/beta pair, the whole verify (fusion on without the newest pattern, and
            # launched the other way, too) next to upstream; llama.cpp's CUDA build (3-4 minutes on a fresh host) runs
            # while the GPU works. (The product table, --only matvec, takes ~100 s more: a call of its own.)
            ("whole-upstream", [PY, "benchmarks/bench.py", "--quick", "--only", "pair,whole,upstream",
                                "--without", REGISTRY[-1].name, *(["--source", source] if source else []),
                                "--json", str(out / "whole-upstream.json")], 460),
        ]
    if part == 4:
        return [
            # issue 34: the quantized kernels compiled (exactness first), the products of every block type at the 9B's
            # shapes, the whole 9B verify with Q4_K and with Q8_0 weights, the fused 9B layers with Q4_K weights
            # checked byte for byte, and ncu's reading of one launch
            ("quant-tests", [PY, "-m", "pytest", "-q", "-x", "tests/kernels/test_triton_quants.py"], 100),
            ("quant-bench", [PY, "benchmarks/bench.py", "--quick", "--only", "quant",
                             "--json", str(out / "quant-bench.json")], 180),
            *((f"whole-{w}", [PY, "benchmarks/bench.py", "--quick", "--only", "whole", "--wtype", w,
                              "--json", str(out / f"whole-{w}.json")], 110) for w in ("q4_k", "q8_0")),
            ("quant-check", [PY, "-m", "gdnpass.cli", "run", "--whole", "--model", "qwen3.5-9b", "--layers", "8",
                             "--tokens", "8", "--rs-seq", "7", "--wtype", "q4_k", "--device", "cuda", "--check"], 50),
            ("quant-ncu", ["ncu", "--section", "SpeedOfLight", "--section", "Occupancy", "--section",
                           "WarpStateStats", "--section", "MemoryWorkloadAnalysis", "-k", "regex:mul_mat_vec", "-c", "1",
                           PY, "benchmarks/one_matvec.py", "q4_k", "12288", "4096", "4"], 30),
        ]
    if part == 5:
        return [
            # issue 34, after part 4: the production tiles of the q8_K form re-swept (tune_matvec's candidates)
            _tune(out, "tune-quant", "q4_k,q6_k,q8_0", "4096x4096,12288x4096,4096x12288", "1,4,8,16", 300, 340),
        ]
    if part == 6:
        return [
            # issue 34: ours and upstream on one real Q4_K_M file (the 9B written in bf16, quantized by llama.cpp's
            # own quantizer), the whole verify of both in one run (2026-12-07, H100: 386 s with the CUDA build), then
            # the acceptance on that file: the loop fused and unfused, identical tokens and logits bytes (the
            # planted drafter: the n-gram one drafts nothing on random weights, and a verify of one token is no test)
            ("quant-upstream", [PY, "benchmarks/bench.py", "--quick", "--only", "whole,upstream", "--quantize",
                                "q4_k_m", "--gguf", QUANT_BASE, *(["--source", source] if source else []),
                                "--json", str(out / "quant-upstream.json")], 430),
            ("quant-generate-check", [PY, "-m", "gdnpass.cli", "generate", "--gguf",
                                      QUANT_BASE.replace(".gguf", "-q4_k_m.gguf"), "--prompt", "The quick brown fox",
                                      "--n-predict", "48", "--draft", "planted", "--device", "cuda", "--check"], 100),
        ]
    if part == 15:
        return [
            # issue 34's other file: ours and upstream on the 9B quantized to Q8_0 by llama.cpp's quantizer, as part 6
            # (never run against upstream in one run; all-Q8_0 weights of our own took 5.7x their floor, 2026-12-04)
            ("quant-upstream-q8_0", [PY, "benchmarks/bench.py", "--quick", "--only", "whole,upstream", "--quantize",
                                     "q8_0", "--gguf", QUANT_BASE, *(["--source", source] if source else []),
                                     "--json", str(out / "quant-upstream-q8_0.json")], 520),
        ]
    if part == 7:
        return [
            # issue 35: the MTP loop on the GPU, next to llama.cpp's own MTP loop on the same file (the 9B shape as a
            # cycle model with an MTP head, written there: ~60 s for the trunk; llama.cpp's CUDA build as in part 1)
            ("mtp-loop", [PY, "benchmarks/generate_bench.py", "--gguf", "/dev/shm/c9b-mtp.gguf", "--write-cycle",
                          "qwen3.5-9b", "--mtp", "1", "--mtp-h", "1.0", "--draft", "mtp", "-K", "1,3", "-n", "128",
                          "--peer",
                          *(["--source", source] if source else []), "--json", str(out / "mtp-loop.json")], 520),
        ]
    if part == 8:
        return [
            # issue 36: the expert FFN's kernels compiled (test_moe_ops.py, its GPU test at the 35B-A3B and 512-expert
            # shapes among them; not the llama.cpp captures: llama.cpp is not built there), then the whole
            # tiny-qwen35moe forward on the Triton backend, f32 / bf16 / Q8_0 (run --check, logits against torch's)
            ("moe-tests", [PY, "-m", "pytest", "-q", "-x", "tests/kernels/test_moe_ops.py", "tests/test_moe_triton.py",
                           "-k", "not capture and not llama"], 420),
            # the fused router compiled (tests/patterns/moe_router: against the six unfused kernels, the fused graph
            # on the Triton backend, its GPU test at the 35B-A3B router; not llama.cpp's capture). SOFT_MAX's new sum
            # order is checked compiled by test_triton_attention.py, part 2's kernel-tests.
            ("router-tests", [PY, "-m", "pytest", "-q", "-x", "tests/patterns/moe_router", "-k", "not llama"], 110),
        ]
    if part == 9:
        return [
            # issue 37 item 4: gdnpass's loop over 1, 8, 32 sequences at once (n-gram and planted drafters, each
            # sequence alone first, fusion off / on ABBA), next to llama.cpp's library on the same batches (its CUDA
            # build runs meanwhile, as in part 1; it measures each S once the build is ready, and the JSON is written
            # after every S, so a run out of time keeps the smaller S); the 9B shape as a cycle model written there
            # (~60 s, the file generate_bench.py writes too)
            ("seqs", [PY, "benchmarks/seqs_bench.py", "--gguf", "/dev/shm/c9b.gguf", "--write-cycle", "qwen3.5-9b",
                      "--seqs", "1,8,32", "-K", "3", "-n", "128", "--peer", *(["--source", source] if source else []),
                      "--json", str(out / "seqs.json")], 530),
        ]
    if part == 10:
        # issue 37 item 3: the deduplicated window at batch, seed 003's table (benchmarks/tune_dedup.py): S 1/8/64/128
        # x T 4/8/16, rows / dedup / dedup-t / the per-token baseline, each case fused vs unfused byte for byte
        # before it is timed, the seed's points first, the JSON rewritten after every case (a step cut short keeps
        # what it measured). The first step, the seed's shape (C 10240), compiles the 36 chain variants (3 a case:
        # rows, the per-window path, the tile; ~1-2 s each, no spills, ptxas on the CPU); the others reuse them.
        dedup = [PY, "benchmarks/tune_dedup.py"]
        return [
            # exactness first: the dedup layouts at 128 sequences of 8 tokens, compiled, ids rolled back (part 3
            # leaves this test to this part)
            ("seqs-dedup-tests", [PY, "-m", "pytest", "-q", "-x", "-m", "gpu", "-k", "snapshot_layouts_gpu",
                                  "tests/patterns/conv_chain/test_seqs.py"], 80),
            ("seqs-dedup-27b", [*dedup, "--model", "qwen3.5-27b", "--json", str(out / "seqs-dedup-27b.json")], 240),
            ("seqs-dedup-9b", [*dedup, "--model", "qwen3.5-9b", "--json", str(out / "seqs-dedup-9b.json")], 130),
            # seed 003's state is bf16, llama.cpp's and gdnpass's f32: its bytes as f32 at half the heads (C 5120)
            ("seqs-dedup-bf16", [*dedup, "--model", "qwen3.5-27b", "--state", "bf16-bytes", "--seqs", "1,64,128",
                                 "--tokens", "8,16", "--json", str(out / "seqs-dedup-bf16.json")], 80),
        ]
    if part == 11:
        return [
            # issue 36: the MoE verify forward (qwen3.5-35b-a3b's first 8 layers at full width: 6 GDN, 2 attention,
            # 256 experts), ours off / on next to upstream on the same file (written there, 14.4 GiB in bf16)
            ("moe-upstream", [PY, "benchmarks/bench.py", "--quick", "--only", "whole,upstream", "--model",
                              "qwen3.5-35b-a3b", "--layers", "8", *(["--source", source] if source else []),
                              "--json", str(out / "moe-upstream.json")], 520),
        ]
    if part == 12:
        return [
            # issue 37 item 4's products of over 16 columns on the Triton GEMM (never run on a GPU when written):
            # compiled at the 9B's shapes at 32 and 128 columns (against f64, the same bytes eagerly and replayed,
            # its time next to the torch reference it replaced), a whole 9B layer of 128 sequences through it
            # fused vs unfused, then the tile sweep (tune_gemm.py; gemm_tile's tiles are untimed). Part 9 after it
            # measures what it changes end to end.
            # (the whole file: its CPU tests run compiled there too, the pair's and the residual's among them)
            ("gemm-tests", [PY, "-m", "pytest", "-q", "-s", "tests/kernels/test_gemm.py"], 90),
            ("tune-gemm", [PY, "benchmarks/tune_gemm.py", "--budget-s", "300", "--json", str(out / "tune-gemm.json")],
             420),
        ]
    if part == 13:
        return [
            # issue 34: the quantized mat-vec, e91a2a0's package (no register cap; made here with `mkdir -p
            # .ab/e91a2a0 && git archive e91a2a0 gdnpass | tar -x -C .ab/e91a2a0`, carried) then the working tree's,
            # each output's bytes hashed; then one 32-column launch against two of 16 (2026-12-06, H100: 75 s in all)
            *((f"probe-quant-{tag}", _at(path, "benchmarks/probe_quant.py", "--qtypes", "q4_k,q6_k"), 90)
              for tag, path in (("base", BASE), ("tree", "."))),
            # issue 32: the whole bf16 9B verify, the tree and e91a2a0 (before the pair's one code path, which halved
            # every mat-vec's shared memory: the T = 4 products from 1 to 2 programs an SM, untimed)
            *((f"whole-bf16{tag}", _at(path, "benchmarks/bench.py", "--quick", "--only", "whole", "--json",
                                       str(out / f"whole-bf16{tag}.json")), 110)
              for tag, path in (("", "."), ("-base", BASE))),
            ("probe-quant-32", [PY, "benchmarks/probe_quant.py", "--qtypes", "q4_k,q6_k,q8_0", "--cols32"], 60),
        ]
    if part == 14:
        return [
            # issue 34: does MUL_MAT_ADD pay on quantized weights? The whole 9B verify with all-Q4_K and all-Q6_K
            # weights, fusion on with and without it in one run each; Q4_K also at e91a2a0, before the register cap
            # (as part 13 makes .ab/e91a2a0): the residual form there takes 134 registers, 3 programs an SM, and
            # ran the down projection 21-26% slower than the product and its ADD (2026-12-06, sixth session)
            *((f"whole-{w}-mma{tag}", _at(path, "benchmarks/bench.py", "--quick", "--only", "whole", "--wtype", w,
                                          "--without", "mul_mat_add", "--json", str(out / f"whole-{w}-mma{tag}.json")),
               150) for w, tag, path in (("q4_k", "", "."), ("q4_k", "-base", BASE), ("q6_k", "", "."))),
        ]
    if part == 17:
        return [
            # issues 32, 34: the two tiles the twelfth session's tables point at (docs/performance.md, 2026-12-07,
            # twelfth): bf16 4096 x 4096 (z and ssm_out, 48 launches a 9B verify) at 55% of the read bandwidth, and
            # Q8_0's alpha/beta pair (32 rows: the 128-row tile masks 3/4 of it) at twice upstream's time
            _tune(out, "tune-bf16-4096", "bf16", "4096x4096", "4,8", 200, 260, "--deep"),
            _tune(out, "tune-q8_0-thin", "q8_0", "32x4096", "4,8", 120, 170, "--pair"),
        ]
    if part == 18:
        return [
            # issue 32: part 17's bf16 4096 x 4096 tiles in the whole verify, against the package before them in one
            # run (the thirteenth session measured them only across runs); 110 s each
            *((f"whole-tiles{tag}", _at(path, "benchmarks/bench.py", "--quick", "--only", "whole", "--json",
                                        str(out / f"whole-tiles{tag}.json")), 140)
              for tag, path in (("", "."), ("-prev", PREV))),
            # issues 32, 34: the thin pairs part 17 did not sweep: the bf16 files' f32 alpha/beta (issue 32's 1.3x of
            # an empty kernel plus its bytes, missed), the Q4_K_M file's K-quant alpha/beta (64-row blocks half
            # masked, where Q8_0's 32-row block ran 36% faster), and bf16 attention k / v (51% of the read bandwidth)
            _tune(out, "tune-thin", "f32,q4_k,q6_k", "32x4096", "1,4,8", 60, 100, "--pair"),
            _tune(out, "tune-bf16-kv", "bf16", "1024x4096", "4,8", 90, 150, "--pair", "--deep"),
        ]
    if part == 19:
        return [
            # issues 34, 32: Q8_0's and Q6_K's quants loaded as 16-bit words in the dot's layout (af8add2; run
            # 2026-12-07, fourteenth session: Q6_K kept, Q8_0 undone): the quantized kernels compiled, then the products
            # at the 9B's shapes at the tree and at the package before, each output's bytes hashed, and ncu's reading
            # of one Q8_0 launch of each
            ("quant-tests-gpu", [PY, "-m", "pytest", "-q", "-x", "tests/kernels/test_triton_quants.py"], 120),
            *((f"probe-q8q6{tag}", _at(path, "benchmarks/probe_quant.py", "--qtypes", "q8_0,q6_k", "--cols", "4,8"),
               150) for tag, path in (("", "."), ("-prev", SHARED_QUANTS))),
            *((f"ncu-q8_0{tag}", _on_path(path, "ncu", "--section", "SpeedOfLight", "--section", "Occupancy",
                                          "--section", "WarpStateStats", "-k", "regex:mul_mat_vec", "-c", "1", PY,
                                          "benchmarks/one_matvec.py", "q8_0", "12288", "4096", "4"), 40)
              for tag, path in (("", "."), ("-prev", SHARED_QUANTS))),
        ]
    if part == 22:
        return [
            # issue 34: Q6_K's rows held split (branch probe/q6k-split, untimed): its quantized kernels compiled and
            # checked there, its Q6_K products against the tree's, each output's bytes hashed (equal hashes at equal
            # tiles: the layout moves no arithmetic), then its tiles swept (it compiled to 3 programs an SM at the
            # tree's tiles, where the tree holds 4)
            ("q6k-split-tests", _branch_tests(Q6_K_SPLIT, "q6_k"), 90),
            *((f"probe-q6k{tag}", _at(path, "benchmarks/probe_quant.py", "--qtypes", "q6_k", "--cols", "4,8"), 110)
              for tag, path in (("-split", Q6_K_SPLIT), ("", "."))),
            ("tune-q6k-split", _at(Q6_K_SPLIT, "benchmarks/tune_matvec.py", "--wtypes", "q6_k", "--shapes",
                                   "12288x4096,4096x12288", "--cols", "4", "--deep", "--budget-s", "90", "--json",
                                   str(out / "tune-q6k-split.json")), 220),
        ]
    if part == 23:
        return [
            # issue 34: Q8_0's aligned form (branch probe/q8-scales, untimed): a step's 8 scales of a row in one
            # 16-byte load (inline PTX, which the interpreter never runs), no group masked, the 8-column sum at <= 8
            # columns. Its Q8_0 kernel tests there first (the aligned form against the per-group one, bytes), then its
            # products against the tree's (bytes hashed; both sum widths), the whole Q8_0 verify of both, one after
            # the other, and 8 of its fused 9B layers checked against unfused
            ("q8a-tests", _branch_tests(Q8_0_ALIGNED, "q8_0"), 80),
            *((f"probe-q8_0{tag}", _at(path, "benchmarks/probe_quant.py", "--qtypes", "q8_0", "--vary", "cols=8,16",
                                       "--cols", "4"), 90)
              for tag, path in (("-aligned", Q8_0_ALIGNED), ("-tree", "."))),
            *((f"whole-q8_0{tag}", _at(path, "benchmarks/bench.py", "--quick", "--only", "whole", "--wtype", "q8_0",
                                       "--json", str(out / f"whole-q8_0{tag}.json")), 110)
              for tag, path in (("-aligned", Q8_0_ALIGNED), ("-tree", "."))),
            ("q8a-check", _on_path(Q8_0_ALIGNED, PY, "-P", "-m", "gdnpass.cli", "run", "--whole", "--model",
                                   "qwen3.5-9b", "--layers", "8", "--tokens", "4", "--rs-seq", "3", "--wtype", "q8_0",
                                   "--device", "cuda", "--check"), 50),
        ]
    if part == 25:
        return [
            # issues 34, 32: warps in flight for the quantized products (eighteenth session: ncu read 2.8 warps a
            # scheduler at 12288 x 4096, its 384 programs 2.9 an SM, the issue slots 31-43% busy): each block type's
            # production tiles with K split finer, then with 8 warps a program (other splits sum in another order:
            # their bytes differ from each other, as they must; equal widths of warps keep the bytes)
            ("probe-split-k", [PY, "benchmarks/probe_quant.py", "--qtypes", "q8_0,q4_k,q6_k", "--vary",
                               "split_k=1,2,4,8", "--cols", "4"], 240),
            ("probe-warps", [PY, "benchmarks/probe_quant.py", "--qtypes", "q8_0,q4_k,q6_k", "--vary", "warps=4,8",
                             "--cols", "4"], 150),
        ]
    if part == 26:
        return [
            # issue 34: Q8_0's scales off the step's critical path (the weights' 8 a row and the activations' 8 a
            # column were waited on in their own step: a memory round trip a step, an L2 one a group): both a step
            # ahead (the tree: 128 registers, the lm head 133, 3 programs an SM) or the weights' only, the
            # activations' at the step's start (.ab/q8x: 104, the lm head 83). Its kernel tests compiled, the products
            # of the three packages (equal hashes: the same arithmetic), 8 fused 9B layers checked. (Run 2026-12-07,
            # nineteenth session, when the tree held .ab/q8x's form and the step names were "", "-both-ahead" and
            # "-before".)
            ("q8-tests-gpu", [PY, "-m", "pytest", "-q", "-x", "-k", "q8_0", "tests/kernels/test_triton_quants.py"], 80),
            *((f"probe-q8_0{tag}", _at(path, "benchmarks/probe_quant.py", "--qtypes", "q8_0", "--cols", "4"), 70)
              for tag, path in Q8_0_SCALES),
            ("q8-check", [PY, "-m", "gdnpass.cli", "run", "--whole", "--model", "qwen3.5-9b", "--layers", "8",
                          "--tokens", "4", "--rs-seq", "3", "--wtype", "q8_0", "--device", "cuda", "--check"], 50),
        ]
    if part == 27:
        return [  # part 26's three packages in the whole Q8_0 verify, one after the other
            (f"whole-q8_0-scales{tag}", _at(path, "benchmarks/bench.py", "--quick", "--only", "whole", "--wtype",
                                            "q8_0", "--json", str(out / f"whole-q8_0-scales{tag}.json")), 120)
            for tag, path in Q8_0_SCALES]
    if part == 28:
        return [
            # issue 34: Q6_K's rows held split (four planes: ql, qh, scales, d; quants.held_rows) so its quants copy
            # ahead like Q4_K's (48 LDGSTS at 12288 x 4096, where the file's 210-byte blocks were loaded 16 bits at a
            # time and waited on in their step), its scales and d loaded a step ahead, 16 scales a row one load. Its
            # kernel and GET_ROWS tests compiled, its products against the package before (equal hashes: the same
            # arithmetic), the whole Q6_K verify of both one after the other, and 8 fused 9B layers checked
            ("q6-tests-gpu", [PY, "-m", "pytest", "-q", "-x", "-k", "q6_k or get_rows",
                              "tests/kernels/test_triton_quants.py", "tests/kernels/test_kernels.py"], 90),
            *((f"probe-q6_k{tag}", _at(path, "benchmarks/probe_quant.py", "--qtypes", "q6_k", "--cols", "4"), 70)
              for tag, path in (("", "."), ("-before", Q8_0_SCALES[-1][1]))),
            *((f"whole-q6_k{tag}", _at(path, "benchmarks/bench.py", "--quick", "--only", "whole", "--wtype", "q6_k",
                                       "--json", str(out / f"whole-q6_k{tag}.json")), 110)
              for tag, path in (("", "."), ("-before", Q8_0_SCALES[-1][1]))),
            ("q6-check", [PY, "-m", "gdnpass.cli", "run", "--whole", "--model", "qwen3.5-9b", "--layers", "8",
                          "--tokens", "4", "--rs-seq", "3", "--wtype", "q6_k", "--device", "cuda", "--check"], 50),
        ]
    if part == 29:
        return [
            # issue 34: Q8_0's and Q6_K's tiles swept again (tune_matvec.py) on the nineteenth session's forms, their
            # scales a step ahead, Q6_K's rows held split: the tiles were chosen when each step waited a round trip
            # for its scales (Q8_0's 16-column sum, slower at 8 then; its pair in 2 slices, 768 programs against the
            # 528 of a wave). Q4_K's form did not change. (~450 tiles compiled by 16 processes)
            _tune(out, "tune-q-single", "q8_0,q6_k", "4096x12288,8192x4096,4096x4096", "4,8", 250, 330),
            _tune(out, "tune-q-pair", "q8_0,q6_k", "12288x4096", "4,8", 110, 200, "--pair"),
        ]
    if part == 30:
        return [
            # issue 34: the Q8_0 FFN pair with its SwiGLU in its launch, handing y on as ffn_down's q8_1 activations
            # (the HAND_OFF_SLOT workspace), and the GDN's z chain its output to ssm_out (461 -> 405 launches at
            # T = 4). Its tests compiled (the hand-off under concurrent programs at the 9B's shape), the probe against
            # the pair and the quantizing GLU, 8 fused 9B layers checked, and the whole Q8_0 verify of the tree and
            # the package before it
            ("hand-tests", [PY, "-m", "pytest", "-q", "-x", "-k", "hand or pair_glu",
                            "tests/kernels/test_triton_quants.py",
                            "tests/kernels/test_kernels.py", "tests/test_prepasses.py"], 120),
            ("probe-hand", [PY, "benchmarks/probe_pair_glu.py", "--wtypes", "q8_0", "--cols", "1,4,8,16"], 90),
            ("hand-check", [PY, "-m", "gdnpass.cli", "run", "--whole", "--model", "qwen3.5-9b", "--layers", "8",
                            "--tokens", "4", "--rs-seq", "3", "--wtype", "q8_0", "--device", "cuda", "--check"], 60),
            *((f"whole-hand{tag}", _at(path, "benchmarks/bench.py", "--quick", "--only", "whole", "--wtype", "q8_0",
                                    "--json", str(out / f"whole-hand{tag}.json")), 110)
              for tag, path in (("", "."), ("-before", BEFORE_HAND_OFF))),
        ]
    if part == 24:
        return [
            # issues 34, 32: is a quantized product bound by what it issues? (eighteenth session: its loop's
            # instructions a byte, compiled as launched, would take 29-70% of the SMs' issue slots at the read
            # bandwidth, before stalls; bf16's 17%.) ncu's scheduler and warp-state reading of one launch each, 12288
            # x 4096 at 4 columns: the block types on main (whose Q6_K and Q8_0 forms the two branches' were; the
            # nineteenth session's scales a step ahead are among what it would now read)
            *((f"ncu-issue-{qtype}", ["ncu", "--section", "SpeedOfLight", "--section", "SchedulerStats", "--section",
                                      "WarpStateStats", "--section", "InstructionStats", "-k", "regex:mul_mat_vec",
                                      "-c", "1", PY, "benchmarks/one_matvec.py", qtype, "12288", "4096", "4"], 45)
              for qtype in ("q4_k", "q6_k", "q8_0")),
        ]
    if part == 21:
        return [
            # issue 32: the bf16 tiles of tune_matvec.py's H100 sweeps of 2026-12-07 (sixteenth session: 8 columns
            # of 8192+ rows and of attention k / v, 9-16 columns of 4096+ rows): the pair and the GLU compiled
            # against the unfused bytes at the FFN's shape, 8 fused 9B layers checked at 8 and 16 tokens, then the
            # whole bf16 verify against the package before them, in one run (98 and 96 s on 2026-12-07)
            ("tile-tests-gpu", [PY, "-m", "pytest", "-q", "-k", "pair_glu or split_k or every_model_tile",
                                "tests/kernels/test_kernels.py", "tests/kernels/test_triton_ops.py"], 95),
            *((f"tile-check-t{t}", [PY, "-m", "gdnpass.cli", "run", "--whole", "--model", "qwen3.5-9b", "--layers",
                                    "8", "--tokens", str(t), "--rs-seq", str(t - 1), "--device", "cuda", "--check"], 80)
              for t in (8, 16)),
            # the pair's SwiGLU epilogue on the new split-2 tile at 5 and 8 columns, fused against unfused (8 s for 12
            # cases on 2026-12-07)
            ("probe-glu-split2", [PY, "benchmarks/probe_pair_glu.py", "--cols", "5,8"], 35),
            *((f"whole-sweep{tag}", _at(path, "benchmarks/bench.py", "--quick", "--only", "whole", "--json",
                                        str(out / f"whole-sweep{tag}.json")), 120)
              for tag, path in (("", "."), ("-prev", BEFORE_TILES))),
        ]
    if part == 20:
        return [
            # issue 32: the FFN pair's SwiGLU in its launch (pair_glu) and ROPE's angles made once a token: their GPU
            # tests (the ticket of both products' slices, compiled, at the 9B's FFN shape), the fused 9B layers checked
            # byte for byte at 8 tokens (pair_glu's scope), then the whole bf16 verify against the package before
            # both, in one run (130 s each: they took 99 and 61 s on 2026-12-07 at a5f551e, fifteenth session)
            ("glu-tests-gpu", [PY, "-m", "pytest", "-q", "-k", "pair_glu or split_k or rope",
                               "tests/kernels/test_kernels.py", "tests/kernels/test_triton_ops.py"], 80),
            ("glu-check", [PY, "-m", "gdnpass.cli", "run", "--whole", "--model", "qwen3.5-9b", "--layers", "8",
                           "--tokens", "8", "--rs-seq", "7", "--device", "cuda", "--check"], 80),
            # the pair and the GLU against the fused launch at 1-16 columns, bf16 and f32, in one process (which
            # tiles the epilogue pays on: pair-glu.tile; run 2026-12-07, sixteenth session)
            ("probe-pair-glu", [PY, "benchmarks/probe_pair_glu.py", "--cols", "1,2,4,5,8,16"], 90),
            *((f"whole-glu{tag}", _at(path, "benchmarks/bench.py", "--quick", "--only", "whole", "--json",
                                      str(out / f"whole-glu{tag}.json")), 130)
              for tag, path in (("", "."), ("-prev", BEFORE_GLU))),
        ]
    if part == 16:
        return [
            # issue 32: the GDN computing its gates (gdn_gates), gathering its state (gdn_state_gather) and the z
            # product running its output gate (mul_mat_chain; the last two first timed 2026-12-07, twelfth session):
            # the GDN's and the product stores' kernels compiled against the unfused ones byte for byte, 8 fused 9B
            # layers checked at T = 4 and 8, then the whole bf16 verify with and without each of the last two
            ("gdn-tests", [PY, "-m", "pytest", "-q", "-x", "-k", "gated_delta_net or chain or mul_mat_add",
                           "tests/kernels/test_kernels.py", "tests/patterns/mul_mat_chain/test_mul_mat_chain.py",
                           "tests/patterns/mul_mat_add/test_mul_mat_add.py"], 120),
            *((f"gdn-check-t{t}", [PY, "-m", "gdnpass.cli", "run", "--whole", "--model", "qwen3.5-9b", "--layers",
                                   "8", "--tokens", str(t), "--rs-seq", str(t - 1), "--device", "cuda", "--check"], 60)
              for t in (4, 8)),
            *((f"whole-without-{p}", [PY, "benchmarks/bench.py", "--quick", "--only", "whole", "--without", p,
                                      "--json", str(out / f"whole-without-{p}.json")], 130)
              for p in ("gdn_state_gather", "mul_mat_chain")),
        ]
    if part == 3:
        return [
            # (2026-12-02: 95 s for one hint mode; the pytest sweep, serial, ran out of 290 s in its second mode)
            ("sweep", [PY, "benchmarks/warm_compile.py", "--hints", "both"], 240),  # (2026-12-03 night: 171 s)
            ("gpu-tests", [PY, "-m", "pytest", "-q", "-x", "-m", "gpu", "-k",
                           "not sweep_gpu_all_800 and not moe and not snapshot_layouts_gpu", "tests/"], 120),
            # the kernel tests of the patterns that the GPU tests above do not launch, compiled (the MoE ops': part 8)
            ("pattern-tests", [PY, "-m", "pytest", "-q", "-x", "tests/patterns/elementwise_chain"], 80),
            ("check-9b", [PY, "-m", "gdnpass.cli", "run", "--whole", "--model", "qwen3.5-9b", "--layers", "8",
                          "--tokens", "8", "--rs-seq", "7", "--wtype", "bf16", "--device", "cuda", "--check"], 90),
        ]
    sanitizer = "compute-sanitizer"
    return [
        ("bench-kernels", [PY, "benchmarks/bench.py", "--quick", "--only", "ops,matvec,chain,dedup,pair,whole",
                           "--json", str(out / "bench-kernels.json")], 150),  # (measured 74 s with whole: ours only)
        ("memcheck", [sanitizer, "--tool", "memcheck", "--error-exitcode", "3", PY, "benchmarks/sanitize.py"], 40),
        # (racecheck: 0 hazards in ~70 s on 2026-12-01 night; 2026-12-02, out of time at 80 s: its child ran to 120)
        ("racecheck", [sanitizer, "--tool", "racecheck", "--error-exitcode", "3", PY, "benchmarks/sanitize.py"], 180),
        ("kernel-tests", [PY, "-m", "pytest", "-q", "-x", "tests/kernels/test_kernels.py",
                          "tests/kernels/test_triton_ops.py", "tests/kernels/test_triton_attention.py"], 160),
    ]


PARTS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30)


def named_steps(names: list[str], source: str | None, out: Path) -> list[tuple[str, list[str], int]]:
    """The steps of any parts by name, in the order given (one device call that mixes parts)."""
    known = {s[0]: s for part in PARTS for s in steps(part, source, out)}
    missing = [n for n in names if n not in known]
    if missing:
        raise SystemExit(f"device_session: --steps: no step {', '.join(missing)} (steps: {', '.join(known)})")
    return [known[n] for n in names]


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # the whole group ended between the limit and the timer's cancel
        pass


def run_step(name: str, cmd: list[str], limit: float, out: Path) -> tuple[str, int | None, float, str]:
    """One step: (name, exit status or None when it ran out of time, seconds, its last line that says something)."""
    t0 = time.perf_counter()
    lines: list[str] = []
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    except FileNotFoundError as e:
        return name, 127, 0.0, f"cannot start: {e}"
    # the step's whole process group: compute-sanitizer's or a pool's children would otherwise run on, holding the
    # output pipe open (a step that hangs silently is stopped too)
    timer = threading.Timer(limit, _kill_group, (proc.pid,))
    timer.start()
    with open(out / f"{name}.log", "w") as log:
        for line in proc.stdout:  # type: ignore[union-attr]
            print(line, end="", flush=True)
            log.write(line)
            lines.append(line.rstrip())
    rc = proc.wait()
    timer.cancel()
    secs = time.perf_counter() - t0
    said = next((x for x in reversed(lines) if x.strip() and not x.startswith(" ")), "")
    return name, None if secs >= limit else rc, secs, said[:100]

