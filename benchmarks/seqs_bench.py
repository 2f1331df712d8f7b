"""Several sequences at once: gdnpass's speculative loop over S prompts in shared ubatches, tokens/s over all
sequences at each S, fusion off and on (ABBA), next to llama.cpp decoding the same batches on the same file and GPU.

    python benchmarks/seqs_bench.py --gguf c9b.gguf --write-cycle qwen3.5-9b --seqs 1,8,32 -K 3 -n 128 --peer \\
        --source .llama-src --json seqs.json
    python benchmarks/seqs_bench.py --device cpu --gguf tiny.gguf --write-cycle tiny-qwen35 --wtype f32 \\
        --period 5 --seqs 1,2,3 -n 24 --peer                               # the same steps on the CPU

Per S (the first S prompts: ``--prompts-file``, one per line, or 32 built-in ones) and per drafter (``--draft``:
n-gram and planted, each sequence drafting on its own): each sequence alone (untimed, once per prompt); the batch's
warm-up with every step's logits hashed (every graph built and captured: fusion off vs on byte for byte, and every
sequence's tokens and steps as alone); then the timed runs, off on on off (``--reps`` rounds), lean. With ``--peer``,
llama.cpp's library on the same batches (its worker: the same prompts, drafters and context), its greedy tokens read
on the host and with its backend sampling (``--peer-sampling``), a warm-up run then ``--peer-runs`` timed runs, its
tokens compared with gdnpass's. gdnpass.bench.seqs says what each step does and why this peer.

``--write-cycle PRESET`` writes ``--gguf`` first (if missing) as a cycle model (:mod:`gdnpass.models.cycle_model`:
the n-gram drafter's drafts are accepted). Each prompt is cut to its last ``--prompt-tokens`` tokens (one length:
few prefill graphs; each keeps its own last token, which a cycle model's continuation follows). ``--ubatch`` sets
n_ubatch on both sides (default: the engine's, max(16, S x (K + 1)): a step of full drafts is one ubatch). The
numbers go to ``--json FILE`` after every S (a run stopped by a time limit keeps what it measured) and to a table
at the end. Exit 1 if fusion off and on differ, a sequence differs from its run alone, a timed run's tokens differ,
or llama.cpp's tokens differ from gdnpass's (or it failed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from gdnpass.bench import seqs as sb
from gdnpass.errors import GdnpassError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True, help="the model file (with --write-cycle: written first if missing)")
    p.add_argument("--write-cycle", metavar="PRESET", help="write --gguf as a cycle model of this preset if missing")
    p.add_argument("--period", type=int, default=16, help="cycle length of --write-cycle (default 16)")
    p.add_argument("--scale", type=float, default=1000.0, help="token-embedding scale of --write-cycle (default "
                                                               "1000, as benchmarks/generate_bench.py)")
    p.add_argument("--wtype", default="bf16", help="weight type of --write-cycle (default bf16)")
    p.add_argument("--seqs", default="1,8,32", help="sequence counts, comma-separated (default 1,8,32)")
    p.add_argument("--draft", default="ngram,planted", help="drafters, comma-separated (default ngram,planted)")
    p.add_argument("-K", "--draft-max", type=int, default=3, help="most drafts per step and sequence (default 3)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--prompts-file", metavar="FILE", help="text prompts, one per line (default: 32 built-in ones)")
    p.add_argument("--prompt-tokens", type=int, default=25, help="each prompt's last N tokens, one length for all "
                                                                 "(default 25; 0: whole prompts)")
    p.add_argument("--ubatch", type=int, default=None, help="n_ubatch of both loops (default: the engine's)")
    p.add_argument("--reps", type=int, default=1, help="ABBA rounds (default 1: off, on, on, off)")
    p.add_argument("--peer", action="store_true", help="also run llama.cpp on the same batches")
    p.add_argument("--peer-sampling", default="host,backend", help="how llama.cpp's greedy tokens are read: host, "
                                                                   "backend or both (default)")
    p.add_argument("--peer-runs", type=int, default=2, help="llama.cpp's timed runs per case, after a warm-up")
    p.add_argument("--source", help="packed llama.cpp sources for the CUDA build (gdnpass llama-build --pack)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", metavar="FILE", help="write every number as JSON")
    a = p.parse_args(argv)
    try:
        return run(a)
    except GdnpassError as e:
        raise SystemExit(f"seqs_bench: {e}") from None


def run(a) -> int:
    from gdnpass.models.hparams import MAX_SEQS

    seqs = sb.parse_seqs(a.seqs, MAX_SEQS)
    kinds = sb.parse_choice(a.draft, "--draft", sb.DRAFTERS)
    sampling = sb.parse_choice(a.peer_sampling, "--peer-sampling", sb.SAMPLING)
    for flag, v, lo in (("-K", a.draft_max, 1), ("-n", a.n_predict, 1), ("--reps", a.reps, 1),
                        ("--peer-runs", a.peer_runs, 1), ("--prompt-tokens", a.prompt_tokens, 0)):
        if v < lo:
            raise GdnpassError(f"{flag} must be >= {lo}, is {v}")
    import torch

    cuda = a.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise GdnpassError("no CUDA GPU here (--device cpu runs the same steps on the CPU)")
    if a.prompts_file:
        from gdnpass.generate_cli import read_prompts_file

        texts = sb.choose_prompts(read_prompts_file(a.prompts_file), seqs[-1], f"--prompts-file {a.prompts_file}")
    else:
        texts = sb.choose_prompts(sb.PROMPTS, seqs[-1])
    building = sb.start_build("cuda" if cuda else "cpu", a.source,
                              lambda line: print(line, flush=True)) if a.peer else None
    if a.write_cycle and not Path(a.gguf).exists():
        from gdnpass.models.cycle_model import write_cycle_gguf

        t0 = time.perf_counter()
        write_cycle_gguf(a.write_cycle, a.gguf, period=a.period, scale=a.scale, wtype=a.wtype)
        print(f"wrote {a.gguf} ({Path(a.gguf).stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.1f} s",
              flush=True)
    if not Path(a.gguf).is_file():
        raise GdnpassError(f"--gguf {a.gguf}: no such file (--write-cycle PRESET writes one)")
    from gdnpass.engine import Model
    from gdnpass.tokenizer import Tokenizer, TokenizerError

    model = Model.from_gguf(a.gguf)
    try:
        tok = Tokenizer.from_gguf(a.gguf)
    except TokenizerError as e:
        raise GdnpassError(f"--gguf {a.gguf}: the prompts are text and need the file's tokenizer ({e})") from None
    prompts = sb.last_tokens([tok.encode(t) for t in texts], a.prompt_tokens)
    empty = [t for t, q in zip(texts, prompts) if not q]
    if empty:
        raise GdnpassError(f"prompt {empty[0]!r}: the tokenizer makes no tokens of it")
    bench = sb.Bench(model, prompts, a.draft_max, a.n_predict, a.device, a.ubatch, a.reps,
                     say=lambda line: print(line, flush=True))
    out = {"model": model.describe(), "gguf": a.gguf, "gpu": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "K": a.draft_max, "n_predict": a.n_predict, "seqs": seqs, "drafters": kinds,
           "prompt_tokens": [len(q) for q in prompts], "date": time.strftime("%Y-%m-%d %H:%M"), "cases": [],
           "llama_cpp": [], "llama_cpp_errors": []}

    def save() -> None:  # (after every S: a run stopped by its time limit keeps what it measured)
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))

    def peer(ns: list[int]) -> None:
        """llama.cpp on S in ``ns``: one worker process, one model load (after gdnpass has freed the GPU)."""
        from gdnpass.frontends.llama.capture import generate_cases

        cases = sb.peer_cases(bench, ns, kinds, sampling, a.peer_runs, n_threads=min(4, os.cpu_count() or 1))
        t0 = time.perf_counter()
        try:
            got = generate_cases(a.gguf, [c["request"] for c in cases], n_gpu_layers=99 if cuda else 0,
                                 install=building.result(), timeout_s=480)
        except GdnpassError as e:  # (one line; gdnpass's numbers stand)
            print(f"llama.cpp, S = {ns}: {e}", flush=True)
            out["llama_cpp_errors"].append({"S": ns, "error": str(e)})
            return
        ours = {(c["S"], c["drafter"]): c for c in out["cases"]}
        for c, g in zip(cases, got):
            mine = ours[(c["S"], c["drafter"])]
            out["llama_cpp"].append(sb.peer_record(c, g, mine["tokens"], mine["fusion_on"]["median_tokens_per_s"]))
            p = out["llama_cpp"][-1]
            print(f"S={p['S']} {p['drafter']}: llama.cpp ({p['sampling']}) {p['median_tokens_per_s']:.1f} t/s, "
                  f"{'same tokens' if p['same_tokens_as_gdnpass'] else 'TOKENS DIFFER'}", flush=True)
        print(f"llama.cpp, S = {ns}: {len(cases)} cases in {time.perf_counter() - t0:.1f} s", flush=True)
        save()

    waiting: list[int] = []  # S measured by gdnpass, not yet by llama.cpp (it runs once its build is ready)
    for n in seqs:
        t0 = time.perf_counter()
        if n > 1:
            bench.run_alone(kinds, n)
        out["cases"] += bench.case(n, kinds, building)
        print(f"S={n}: {time.perf_counter() - t0:.1f} s", flush=True)
        save()
        waiting.append(n)
        if a.peer and building.done():
            peer(waiting)
            waiting = []
    if a.peer and waiting:
        peer(waiting)
    print("\n" + "\n".join(sb.table(out)), flush=True)
    save()
    ok = all(c["identical_off_on"] and c["same_as_alone"] and c["lean_runs_same_tokens"] for c in out["cases"])
    ok &= all(p["same_tokens_as_gdnpass"] and p["runs_same_tokens"] for p in out["llama_cpp"])
    return 0 if ok and not out["llama_cpp_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
