"""Several sequences at once on the GPU (issue 37 item 4): ``gdnpass generate``'s loop over S prompts in shared
ubatches, tokens/s over all sequences at S = 1, 8, 32, fusion off and on, next to llama.cpp's own library decoding
the same batches (``benchmarks/seqs_bench.py`` is its command line; docs/generate.md).

For each S (the first S prompts) and each drafter (n-gram, planted), each sequence drafting on its own:

1. **alone** (untimed, once per prompt): each prompt in a one-sequence context, fusion on, with the same drafter:
   the tokens and steps each sequence must have in the batch. The n-gram run's tokens are also the planted
   drafter's truth (the greedy continuation; a plain decode gives it when the n-gram drafter is not asked for).
2. **warm-up and identity** (untimed): the batch of S sequences, one engine per fusion setting, every graph built,
   fused and captured (a graph per ubatch shape), every step's logits hashed: fusion off vs on byte for byte, and
   every sequence's tokens and steps equal to its run alone.
3. **timed**: off on on off (ABBA, ``reps`` rounds), lean steps (only each row's greedy token comes back), tokens/s =
   every sequence's tokens over the loop's time (prefill excluded), as ``gdnpass generate`` reports it.
4. **llama.cpp** (``peer``): the same prompts (token ids), drafters (the same code, :mod:`gdnpass.drafters`), context
   (n_seq_max = S, a KV stream each, the same n_ctx, n_ubatch and K rollback planes: llama.cpp splits each batch
   into the same ubatches) on the same file and GPU, in llama.cpp's worker (:func:`~gdnpass.frontends.llama.capture.
   generate_cases`: one model load, a context per case, a warm-up run then the timed runs). Its tokens are compared
   with gdnpass's, sequence by sequence. Two ways of reading the greedy tokens: ``host`` (llama.cpp copies every
   row's logits to the host, where its samplers run; here numpy's argmax, cheaper than its sampler chain) and
   ``backend`` (its experimental backend sampling: a greedy chain per sequence runs on the device and only token ids
   come back, like gdnpass's greedy head).

Why not one of llama.cpp's tools: ``llama-speculative-simple`` (the one-sequence peer) decodes one sequence;
``llama-parallel`` and ``llama-batched`` decode several but draft nothing, and ``llama-parallel`` builds its own
prompts (a system prompt and a question it picks at random); ``llama-server`` drafts per slot behind HTTP. The
worker runs llama.cpp's own ``llama_decode`` over the very batches ``gdnpass generate`` decodes, from the same
Python loop (drafting, accepting and ``llama_memory_seq_rm`` per sequence), so the two differ only in what runs a
batch.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from gdnpass.drafters import cycle_schedule, from_spec, ngram_defaults, seq_schedule
from gdnpass.errors import GdnpassError

DRAFTERS = ("ngram", "planted")
SAMPLING = ("host", "backend")
KV_PAD = 256  # (llama.cpp pads n_ctx and each stream to 256 cells)

# 32 one-line prompts, each ending in a token of its own under the model writer's tokenizer (a cycle model's
# continuation follows the last token: the sequences diverge from their first generated token; test)
PROMPTS = (
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # the",
    "The quick brown fox jumps over the lazy dog and",
    "SELECT name, price FROM products WHERE price > 100 ORDER BY price DESC; -- list of",
    "for i in range(10): print(i * i)  # squares up to",
    "Once upon a time, in a kingdom by the sea, there lived a lighthouse keeper who",
    "import numpy as np; x = np.linspace(0, 1, 50)  # fifty points in",
    "The capital of France is Paris, and the capital of Italy is",
    "git commit -m 'fix the off-by-one error in the parser' and push it, for",
    "Photosynthesis turns light, water and carbon dioxide into sugar, with",
    "const add = (a, b) => a + b; // adds two numbers, as",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon; it",
    "matrix = [[1, 2, 3], [4, 5, 6]]  # rows at",
    "Dear team, the quarterly report is attached; please review it by",
    "A haiku: autumn moonlight, a worm digs silently into the chestnut, so",
    "public static int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); } // must be",
    "The mitochondria is the powerhouse of the cell; its membranes are",
    "docker run -it --rm python:3.12 bash  # a shell that",
    "To bake bread, mix flour, water, salt and yeast, then knead it all",
    "The stock market closed higher today as technology shares rallied, one",
    "CREATE TABLE users (id SERIAL PRIMARY KEY, email TEXT UNIQUE NOT NULL); -- it has",
    "Water boils at one hundred degrees Celsius at sea level, but on a mountain x",
    "Chess openings: the Sicilian Defence begins with e4 c5, and the French with e4 e6, then d",
    "awk -F, '{ total += $3 } END { print total / NR }' data.csv  # mean of column c",
    "The theory of relativity says that the speed of light is constant in every frame, or m",
    "let rec fact n = if n = 0 then 1 else n * fact (n - 1) (* factorial of k",
    "Rain fell all night on the tin roof of the cabin at the edge of the forest, p",
    "while (left < right) { int mid = left + (right - left) / 2; } // binary search over v",
    "fn main() { let v: Vec<i32> = (1..=5).collect(); } // a vector of five integers z",
    "The recipe calls for two cups of rice and three cups of water, boiled for twenty minutes, j",
    "Our meeting moved to Thursday at three in the afternoon, in room b",
    "Volcanoes form where tectonic plates pull apart or collide, pushing magma up through g",
    "async def fetch(url): return await client.get(url)  # one request per call, q",
)


# ---- the command line's pieces (pure) -------------------------------------------------------------------------------


def parse_seqs(text: str, max_seqs: int) -> list[int]:
    """``--seqs``: sequence counts, comma-separated, each 1..max_seqs, in increasing order; one-line errors."""
    try:
        seqs = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise GdnpassError(f"--seqs {text!r}: expected sequence counts separated by commas, e.g. 1,8,32") from None
    if not seqs:
        raise GdnpassError("--seqs: give at least one sequence count, e.g. 1,8,32")
    bad = [s for s in seqs if not 1 <= s <= max_seqs]
    if bad:
        raise GdnpassError(f"--seqs: {bad[0]} sequences: expected 1..{max_seqs}")
    if sorted(set(seqs)) != seqs:
        raise GdnpassError(f"--seqs {text!r}: give each count once, in increasing order")
    return seqs


def parse_choice(text: str, flag: str, choices: Sequence[str]) -> list[str]:
    """A comma-separated subset of ``choices`` (``--draft``, ``--peer-sampling``), in ``choices``' order."""
    got = [x for x in text.replace(" ", "").split(",") if x]
    bad = [x for x in got if x not in choices]
    if bad or not got:
        raise GdnpassError(f"{flag} {text!r}: expected one or more of {', '.join(choices)}, comma-separated")
    return [c for c in choices if c in got]


def choose_prompts(lines: Sequence[str], n: int, where: str = "the built-in prompts") -> list[str]:
    """The first ``n`` prompts of ``lines``: distinct (equal prompts would give equal sequences), at least ``n``."""
    if len(lines) < n:
        raise GdnpassError(f"{n} sequences need {n} prompts; {where} have {len(lines)} (--prompts-file: one per line)")
    chosen = list(lines[:n])
    seen: dict[str, int] = {}
    for i, x in enumerate(chosen):
        if x in seen:
            raise GdnpassError(f"{where}: prompts {seen[x]} and {i} are the same ({x[:40]!r}): the sequences must "
                               "differ")
        seen[x] = i
    return chosen


def last_tokens(prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """Each prompt's last ``n`` tokens (``--prompt-tokens``; 0: whole). Prompts of one length make every S's
    prefill a few ubatches of one shape (llama.cpp's split of unequal prompts ends in a ubatch per sequence: a graph,
    and its capture, for each), and the last token, which a cycle model's continuation follows, is kept."""
    if n <= 0:
        return [list(p) for p in prompts]
    short = [i for i, p in enumerate(prompts) if len(p) < n]
    if short:
        raise GdnpassError(f"--prompt-tokens {n}: prompt {short[0]} has {len(prompts[short[0]])} tokens (give a "
                           "smaller count, or 0 for whole prompts)")
    return [list(p[-n:]) for p in prompts]


def ctx_per_seq(prompts: Sequence[Sequence[int]], n_predict: int, draft_max: int) -> int:
    """KV cells of each sequence's stream, the same for every S and for a sequence alone (so that every context
    gives a sequence the same draft budgets): its longest prompt, ``n_predict`` tokens and a last step's K + 2 cells,
    padded to 256."""
    need = max(len(p) for p in prompts) + n_predict + draft_max + 2
    return -(-need // KV_PAD) * KV_PAD


def drafter_spec(kind: str, seq: int, draft_max: int, truth: Sequence[int] | None = None) -> dict:
    """Sequence ``seq``'s drafter as the worker takes it (:func:`gdnpass.drafters.from_spec`): llama.cpp's n-gram
    lookup with size_n = min(12, K), size_m = K; or the planted drafter on the sequence's ``truth`` (its greedy
    continuation), K drafts every step, the acceptance schedule (all, none, 1 .. K-1) started at entry ``seq``, so
    that the sequences of one ubatch accept different counts and read different planes next."""
    if kind == "ngram":
        n, m = ngram_defaults(draft_max)
        return {"kind": "ngram", "size_n": n, "size_m": m}
    if kind == "planted":
        if truth is None:
            raise GdnpassError(f"the planted drafter of sequence {seq} needs its truth (the greedy continuation)")
        return {"kind": "planted", "truth": list(truth), "accept": seq_schedule(cycle_schedule(draft_max), seq)}
    raise GdnpassError(f"drafter {kind!r}: expected one of {', '.join(DRAFTERS)}")


def abba(reps: int) -> list[bool]:
    """The timed runs' fusion settings: off, on, on, off per round."""
    return [False, True, True, False] * reps


def throughput(results) -> tuple[int, float]:
    """(tokens of every sequence, the loop's seconds until the last one finished) of one run of several sequences."""
    return sum(len(r.tokens) for r in results), max(r.seconds for r in results)


def batch_steps(results) -> int:
    """The loop's steps (batches) of one run: the longest sequence's."""
    return max(len(r.steps) for r in results)


# ---- the run --------------------------------------------------------------------------------------------------


@dataclass
class Bench:
    """One benchmark: the model, its prompts (token ids), the loop's settings and what has been run alone."""

    model: object                 # gdnpass.engine.Model
    prompts: list[list[int]]
    draft_max: int
    n_predict: int
    device: str = "cuda"
    n_ubatch: int | None = None   # None: the engine's default for S sequences (and llama.cpp's with it)
    reps: int = 1
    say: object = print
    alone: dict = field(default_factory=dict)   # (drafter, s) -> Result of sequence s alone, fusion on
    truths: dict = field(default_factory=dict)  # s -> the greedy continuation of prompt s

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def engine(self, n_seqs: int, fusion: bool):
        """A context of ``n_seqs`` sequences on the model's weights (every engine of the model shares them: the 9B's
        17 GB loaded once)."""
        from gdnpass.engine import Engine

        return Engine(self.model, self.settings(n_seqs, fusion))

    def settings(self, n_seqs: int, fusion: bool):
        from gdnpass.engine import Settings

        return Settings(draft_max=self.draft_max, n_seqs=n_seqs, n_ubatch=self.n_ubatch if n_seqs > 1 else None,
                        n_ctx=n_seqs * ctx_per_seq(self.prompts, self.n_predict, self.draft_max),
                        device=self.device, cuda_graphs=self.cuda, fusion=fusion)

    def specs(self, kind: str, n_seqs: int) -> list[dict]:
        return [drafter_spec(kind, s, self.draft_max, self.truths.get(s)) for s in range(n_seqs)]

    def drafter(self, spec: dict, seq: int):
        return from_spec(spec, len(self.prompts[seq]), self.model.shape.vocab_size)

    def drafters(self, specs: list[dict]) -> list:
        return [self.drafter(d, s) for s, d in enumerate(specs)]

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()

    def run_alone(self, kinds: Sequence[str], n_seqs: int) -> None:
        """Sequences 0..n_seqs-1 alone (those not run yet), fusion on: the n-gram runs first, whose tokens are the
        planted drafter's truths (a plain decode gives them otherwise)."""
        from gdnpass.drafters import NoDraft
        from gdnpass.generate import generate

        todo = [(k, s) for k in kinds for s in range(n_seqs) if (k, s) not in self.alone]
        if not todo:
            return
        t0 = time.perf_counter()
        eng = self.engine(1, True)
        for k, s in todo:
            if k == "planted" and s not in self.truths:
                self.truths[s] = generate(eng, self.prompts[s], NoDraft(), self.n_predict).tokens
            spec = drafter_spec(k, s, self.draft_max, self.truths.get(s))
            r = generate(eng, self.prompts[s], self.drafter(spec, s), self.n_predict)
            self.alone[(k, s)] = r
            if k == "ngram":
                self.truths.setdefault(s, r.tokens)
        del eng
        self.free()
        self.say(f"alone: {len(todo)} runs (sequences {min(s for _, s in todo)}..{max(s for _, s in todo)}) in "
                 f"{time.perf_counter() - t0:.1f} s")

    def case(self, n_seqs: int, kinds: Sequence[str], building: Future | None = None) -> list[dict]:
        """S = ``n_seqs``: every drafter's warm-up and identity runs, then its timed runs (ABBA)."""
        from gdnpass.generate import differences, generate_batch

        prompts = self.prompts[:n_seqs]
        engines = {on: self.engine(n_seqs, on) for on in (False, True)}  # (off builds its graphs first)
        cases = []
        for kind in kinds:
            specs = self.specs(kind, n_seqs)
            t0 = time.perf_counter()
            warm = {on: generate_batch(engines[on], prompts, self.drafters(specs), self.n_predict, hash_logits=True)
                    for on in (False, True)}  # every graph built, fused and captured; logits hashed
            diffs = [d for s, (x, y) in enumerate(zip(warm[False], warm[True])) for d in
                     (f"sequence {s}: {e}" for e in differences(x, y))]
            if n_seqs == 1:  # (a context of one sequence is the sequence alone)
                self.alone.setdefault((kind, 0), warm[True][0])
                if kind == "ngram":
                    self.truths.setdefault(0, warm[True][0].tokens)
            alone = [s for s, r in enumerate(warm[True]) if not same_run(r, self.alone[(kind, s)])]
            self.say(f"S={n_seqs} {kind}: warm-up and identity runs {time.perf_counter() - t0:.1f} s; fusion off vs "
                     f"on: {'identical' if not diffs else '; '.join(diffs[:3])}; each sequence as alone: "
                     + ("yes" if not alone else f"NO (sequences {alone[:8]})"))
            build_before = building is not None and not building.done()
            runs: dict[bool, list] = {False: [], True: []}
            ubatches: dict[bool, list] = {False: [], True: []}
            for on in abba(self.reps):
                before = engines[on].ubatches
                res = generate_batch(engines[on], prompts, self.drafters(specs), self.n_predict)
                runs[on].append(res)
                ubatches[on].append(engines[on].ubatches - before - res[0].prefill_ubatches)
            lean_same = all(same_run(r, w) for on in (False, True) for res in runs[on]
                            for r, w in zip(res, warm[False]))
            case = {"S": n_seqs, "drafter": kind, "specs": specs_summary(specs),
                    "n_ubatch": engines[False].s.ubatch, "n_ctx_seq": engines[False].kv_size,
                    "identical_off_on": not diffs, "differences": diffs[:4], "same_as_alone": not alone,
                    "not_as_alone": alone, "lean_runs_same_tokens": lean_same,
                    "distinct_sequences": len({tuple(r.tokens) for r in warm[False]}),
                    "peer_build_running": build_before or (building is not None and not building.done()),
                    "order": ["on" if x else "off" for x in abba(self.reps)],
                    "tokens": [r.tokens for r in warm[False]]}
            for on in (False, True):
                rs = runs[on]
                tps = [n / s for n, s in map(throughput, rs)]
                steps = batch_steps(rs[0])
                drafted = sum(r.drafted for r in rs[0])
                case["fusion_" + ("on" if on else "off")] = {
                    "tokens_per_s": [round(x, 2) for x in tps], "median_tokens_per_s": round(statistics.median(tps), 2),
                    "ms_per_step": [round(1e3 * throughput(r)[1] / batch_steps(r), 3) for r in rs],
                    "steps": steps, "ubatches_per_step": round(statistics.median(ubatches[on]) / steps, 3),
                    "tokens": throughput(rs[0])[0], "drafted": drafted,
                    "accept_rate": round(sum(r.accepted for r in rs[0]) / drafted, 4) if drafted else 0.0,
                    "graphs": len(engines[on].slots)}
            cases.append(case)
        engines.clear()
        self.free()
        return cases


def same_run(a, b) -> bool:
    """Two runs of one sequence generated the same tokens in the same steps (widths and accepted counts)."""
    return a.tokens == b.tokens and [(s.n_t, s.accepted) for s in a.steps] == [(s.n_t, s.accepted) for s in b.steps]


def specs_summary(specs: list[dict]) -> dict:
    """A drafter's settings for the record (the planted truths left out)."""
    d = specs[0]
    if d["kind"] == "ngram":
        return {"kind": "ngram", "size_n": d["size_n"], "size_m": d["size_m"]}
    return {"kind": d["kind"], "accept": [x["accept"] for x in specs]}


def peer_cases(bench: Bench, seqs: Sequence[int], kinds: Sequence[str], sampling: Sequence[str], runs: int,
               n_threads: int = 4) -> list[dict]:
    """The worker's cases (:func:`gdnpass.frontends.llama.capture.generate_request`): per S, drafter and sampling,
    the S prompts with the same drafters and context as gdnpass's engine for S (n_seq_max S, n_ctx, n_ubatch, K
    rollback planes), a warm-up run and ``runs`` timed runs."""
    from gdnpass.frontends.llama.capture import generate_request

    out = []
    for n in seqs:
        s = bench.settings(n, False)
        for kind in kinds:
            for mode in sampling:
                out.append({"S": n, "drafter": kind, "sampling": mode,
                            "request": generate_request(bench.prompts[:n], bench.specs(kind, n), bench.n_predict,
                                                        draft_max=bench.draft_max, n_rs_seq=s.rs_seq,
                                                        n_ubatch=s.ubatch, n_ctx=s.n_ctx, n_threads=n_threads,
                                                        sampling=mode, runs=1 + runs)})
    return out


def peer_record(case: dict, got: dict, ours: list[list[int]], ours_tps: float) -> dict:
    """One llama.cpp case's numbers: tokens/s of its timed runs (the first run is its warm-up), its tokens against
    gdnpass's sequence by sequence."""
    timed = got["runs"][1:] or got["runs"]
    theirs = [q["tokens"] for q in got["sequences"]]
    tps = [r["tokens_per_second"] for r in timed]
    differ = [s for s, (a, b) in enumerate(zip(ours, theirs)) if a != b] + list(range(len(theirs), len(ours)))
    med = statistics.median(tps)
    return {"S": case["S"], "drafter": case["drafter"], "sampling": case["sampling"],
            "tokens_per_s": tps, "median_tokens_per_s": round(med, 2),
            "decode_seconds": [r["decode_seconds"] for r in timed],
            "warmup_tokens_per_s": got["runs"][0]["tokens_per_second"],
            "runs_same_tokens": all(r["same_tokens"] for r in got["runs"]), "same_tokens_as_gdnpass": not differ,
            "differing_sequences": differ[:8], "settings": got["settings"],
            "steps": max(len(q["steps"]) for q in got["sequences"]),
            "gdnpass_on_over_llama_cpp": round(ours_tps / med, 3) if med else None}


def start_build(variant: str, source: str | None, say=print) -> Future:
    """llama.cpp's build (cached: milliseconds once built) in a background thread at low priority, so that it runs
    while gdnpass works."""
    import os

    from gdnpass.frontends.llama import build

    def go():
        os.nice(10)  # (Linux: this thread, and the compilers it starts, yield to the timing)
        t0 = time.perf_counter()
        install = build.ensure(log=lambda line: say(f"[llama.cpp build] {line}"), variant=variant, source=source)
        say(f"llama.cpp {variant} build ready in {time.perf_counter() - t0:.0f} s")
        return install
    return ThreadPoolExecutor(1).submit(go)


def table(out: dict) -> list[str]:
    """The report: one row per S, drafter and loop."""
    lines = [f"several sequences: {out['model']}; {out['gpu']}, torch {out['torch']}; K = {out['K']}, "
             f"{out['n_predict']} tokens per sequence; {out['date']}",
             f"{'S':>3} {'drafter':<8} {'loop':<22} {'tok/s':>9} {'ms/step':>8} {'steps':>5} {'ubatch/step':>11} "
             f"{'accept':>6}  identical"]
    peers = {(p["S"], p["drafter"]): [] for p in out.get("llama_cpp", [])}
    for p in out.get("llama_cpp", []):
        peers[(p["S"], p["drafter"])].append(p)
    for c in out["cases"]:
        for name in ("fusion_off", "fusion_on"):
            f = c[name]
            ok = ("off=on" if c["identical_off_on"] else "OFF!=ON") + (", =alone" if c["same_as_alone"] else
                                                                        ", NOT AS ALONE")
            lines.append(f"{c['S']:>3} {c['drafter']:<8} {'gdnpass ' + name.replace('_', ' '):<22} "
                         f"{f['median_tokens_per_s']:>9.1f} {statistics.median(f['ms_per_step']):>8.2f} "
                         f"{f['steps']:>5} {f['ubatches_per_step']:>11.2f} {f['accept_rate']:>6.3f}  {ok}")
        for p in peers.get((c["S"], c["drafter"]), []):
            lines.append(f"{c['S']:>3} {c['drafter']:<8} {'llama.cpp ' + p['sampling']:<22} "
                         f"{p['median_tokens_per_s']:>9.1f} {'':>8} {p['steps']:>5} {'':>11} {'':>6}  "
                         f"{'same tokens' if p['same_tokens_as_gdnpass'] else 'TOKENS DIFFER'}; fusion on / this "
                         f"{p['gdnpass_on_over_llama_cpp']}")
    return lines


# ---- the command ----------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    """benchmarks/seqs_bench.py's command line."""
    p = argparse.ArgumentParser(prog="seqs_bench.py", description="Several sequences at once: gdnpass's speculative "
                                "loop over S prompts in shared ubatches, tokens/s over all sequences, fusion off and "
                                "on, next to llama.cpp decoding the same batches (docs/generate.md).")
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
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    try:
        return run(a)
    except GdnpassError as e:
        raise SystemExit(f"seqs_bench: {e}") from None


def run(a) -> int:
    from gdnpass.models.hparams import MAX_SEQS

    seqs = parse_seqs(a.seqs, MAX_SEQS)
    kinds = parse_choice(a.draft, "--draft", DRAFTERS)
    sampling = parse_choice(a.peer_sampling, "--peer-sampling", SAMPLING)
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

        texts = choose_prompts(read_prompts_file(a.prompts_file), seqs[-1], f"--prompts-file {a.prompts_file}")
    else:
        texts = choose_prompts(PROMPTS, seqs[-1])
    building = start_build("cuda" if cuda else "cpu", a.source,
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
    prompts = last_tokens([tok.encode(t) for t in texts], a.prompt_tokens)
    empty = [t for t, q in zip(texts, prompts) if not q]
    if empty:
        raise GdnpassError(f"prompt {empty[0]!r}: the tokenizer makes no tokens of it")
    bench = Bench(model, prompts, a.draft_max, a.n_predict, a.device, a.ubatch, a.reps,
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

        cases = peer_cases(bench, ns, kinds, sampling, a.peer_runs, n_threads=min(4, os.cpu_count() or 1))
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
            if "error" in g:
                print(f"S={c['S']} {c['drafter']}: llama.cpp ({c['sampling']}): {g['error']}", flush=True)
                out["llama_cpp_errors"].append({"S": c["S"], "drafter": c["drafter"], "sampling": c["sampling"],
                                                "error": g["error"]})
                continue
            mine = ours[(c["S"], c["drafter"])]
            out["llama_cpp"].append(peer_record(c, g, mine["tokens"], mine["fusion_on"]["median_tokens_per_s"]))
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
    print("\n" + "\n".join(table(out)), flush=True)
    save()
    ok = all(c["identical_off_on"] and c["same_as_alone"] and c["lean_runs_same_tokens"] for c in out["cases"])
    ok &= all(p["same_tokens_as_gdnpass"] and p["runs_same_tokens"] for p in out["llama_cpp"])
    return 0 if ok and not out["llama_cpp_errors"] else 1


__all__ = ["Bench", "DRAFTERS", "PROMPTS", "SAMPLING", "abba", "batch_steps", "choose_prompts", "ctx_per_seq",
           "drafter_spec", "last_tokens", "main", "parse_choice", "parse_seqs", "parser", "peer_cases", "peer_record",
           "run", "same_run", "start_build", "table", "throughput"]
