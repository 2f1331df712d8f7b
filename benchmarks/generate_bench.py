"""The speculative loop on the GPU: gdnpass (fusion off and on, ABBA) next to llama.cpp's own loop on one GGUF file,
one prompt, greedy, the same drafter (n-gram, or the model's own MTP head); and each lean step next to the verify's own
GPU time.

    python benchmarks/generate_bench.py --gguf cyc.gguf --write-cycle qwen3.5-9b --prompt "text" -K 3,7 -n 128 --peer
    python benchmarks/generate_bench.py --model qwen3.5-9b --draft planted -K 4 -n 64        # a preset, no peer
    python benchmarks/generate_bench.py --gguf mtp.gguf --write-cycle qwen3.5-9b --mtp 1 --draft mtp -K 1,2,3 --peer

Per K:

1. gdnpass, one engine per fusion setting: graphs built, fused and captured as CUDA graphs in an untimed warm-up
   run, which also records every step's logits sha256 (fusion off vs on compared byte for byte: the identity); then
   the timed runs, off on on off (ABBA, ``--reps`` rounds), lean: only the rows' greedy tokens come to the host;
2. the verify's own GPU time: each width's CUDA graph (forward and greedy head) replayed alone and timed with CUDA
   events; the GPU time of the steps a timed run made, next to its wall time per step (the rest is the host's);
3. with ``--peer``: llama.cpp's ``llama-speculative-simple`` (the pinned tree, CUDA build: ``gdnpass llama-build
   --cuda``, from ``--source`` on a host without registry access) before and after gdnpass's runs, its own
   ``decoded ... t/s``, its accept counts, and its text compared with gdnpass's detokenized tokens. With ``--draft
   mtp`` both sides draft with the file's MTP head (gdnpass: :class:`~gdnpass.mtp_drafter.MtpDrafter`, one head
   context per fusion setting, fused when the target is; llama.cpp: ``--spec-type draft-mtp``); the GPU time per
   step is then the target's verify alone (the head's draft steps are in the wall time).

``--write-cycle PRESET`` first writes ``--gguf`` (if missing) as a cycle model of that preset
(:mod:`gdnpass.models.cycle_model`: the greedy continuation follows cycles of ``--period`` tokens, which the n-gram
drafter predicts; the period must exceed K for full drafts; ``--mtp 1`` gives it an MTP head that agrees with the
trunk part of the time, :mod:`gdnpass.models.cycle_model`). Exit 1 if fusion off and on differ or the peer's text
differs from gdnpass's. ``--json FILE`` writes every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from gdnpass.drafters import NgramSimple, NoDraft, Planted, cycle_schedule, ngram_defaults
from gdnpass.engine import Engine, Model, Settings
from gdnpass.generate import differences, generate
from gdnpass.mtp_drafter import MtpDrafter, has_head


def gpu_ms(slot, reps: int = 20) -> float:
    """Median GPU time (ms) of one replay of a slot's CUDA graph, timed with CUDA events outside any profiler."""
    for _ in range(3):
        slot.cuda_graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        slot.cuda_graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def step_gpu_ms(engine: Engine, result, cache: dict) -> float:
    """The GPU time of a run's steps (ms per step): each step's width replayed alone (``cache``: slot -> ms)."""
    total = 0.0
    for s in result.steps:
        slot = engine.slots[(s.n_t, s.n_kv, s.n_t, 0, 1)]  # (one sequence: sequence 0 alone)
        if slot.cuda_graph is None:
            raise SystemExit("the GPU-time breakdown needs CUDA graphs (--cuda-graphs)")
        if id(slot) not in cache:
            cache[id(slot)] = gpu_ms(slot)
        total += cache[id(slot)]
    return total / len(result.steps)


class _TimedGraph:
    """A slot's CUDA graph whose replays record (host time at the call, after the call, CUDA events around it)."""

    def __init__(self, graph, log: list) -> None:
        self.graph, self.log = graph, log

    def replay(self) -> None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        self.graph.replay()
        b.record()
        self.log.append((t0, time.perf_counter(), a, b))


def step_breakdown(engine: Engine, go) -> dict:
    """One more run (``go(on_tokens)``) with every step's phases timed: the host before the replay (draft, checks,
    inputs written and pushed), the replay call, the wait for the device (replay's return to the ids on the host,
    which includes the GPU's time), the host after (accept, roll back, bookkeeping), and the GPU time of the replay
    in the loop (CUDA events around it). Medians over the steps, in ms (the first step, which has no start mark,
    left out)."""
    replays, fetched, ends = [], [], []
    for slot in engine.slots.values():
        if slot.head is not None:
            slot.cuda_graph = _TimedGraph(slot.cuda_graph, replays)
            fetch = slot.head.fetch

            def timed_fetch(fetch=fetch):
                out = fetch()
                fetched.append(time.perf_counter())
                return out
            slot.head.fetch = timed_fetch
    try:
        go(lambda ids: ends.append(time.perf_counter()))
    finally:
        for slot in engine.slots.values():
            if isinstance(slot.cuda_graph, _TimedGraph):
                slot.cuda_graph = slot.cuda_graph.graph
                del slot.head.fetch
    torch.cuda.synchronize()
    rows = []
    for i in range(1, len(ends)):
        (t0, t1, a, b), tf = replays[i], fetched[i]
        rows.append({"wall": ends[i] - ends[i - 1], "host_before": t0 - ends[i - 1], "replay_call": t1 - t0,
                     "wait": tf - t1, "host_after": ends[i] - tf, "gpu": a.elapsed_time(b) / 1e3})
    return {k: round(1e3 * statistics.median(r[k] for r in rows), 4) for k in rows[0]} if rows else {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", help="the model file (with --write-cycle: written first if missing)")
    p.add_argument("--write-cycle", metavar="PRESET", help="write --gguf as a cycle model of this preset if missing")
    p.add_argument("--period", type=int, default=16, help="cycle length of --write-cycle (default 16)")
    # (a qwen3.5-9b-wide model's layers drown an embedding scaled by 4: 4 of its layers already break the cycle; at
    # 1000 the cycle holds with top-2 margins of ~75, measured on the CPU with 4 layers and a 1024-token vocabulary)
    p.add_argument("--scale", type=float, default=1000.0,
                   help="token-embedding scale of --write-cycle (default 1000)")
    p.add_argument("--wtype", default="bf16", help="weight type of --write-cycle or --model (default bf16)")
    p.add_argument("--model", default="tiny-qwen35", help="preset with generated weights (no --gguf)")
    p.add_argument("--draft", default="ngram", choices=["planted", "ngram", "mtp", "none"])
    p.add_argument("--mtp", type=int, default=0, help="MTP blocks of --write-cycle's file (1 for --draft mtp)")
    # (the module's default hidden-state gain was measured at scale 4; at this bench's scale 1000 its head agrees with
    # the trunk never, with 0.8 always, with 1.0 part of the time: tiny-qwen35, period 16, 32 tokens, 63% of the
    # drafts accepted at K = 1 and 57% at K = 3, on the CPU on 2026-12-06)
    p.add_argument("--mtp-h", type=float, default=1.0,
                   help="the MTP head's hidden-state gain of --write-cycle (cycle_model; default 1.0)")
    p.add_argument("-K", "--draft-max", default="3,7", help="comma-separated K values (default 3,7)")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--prompt", default="def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b",
                   help="text (needs the file's tokenizer) or, with --prompt-ids, token ids")
    p.add_argument("--prompt-ids", action="store_true", help="--prompt is comma-separated token ids")
    p.add_argument("--ngram-n", type=int, default=None, help="n-gram lookup size (default: min(12, K))")
    p.add_argument("--reps", type=int, default=1, help="ABBA rounds (default 1: off, on, on, off)")
    p.add_argument("--peer", action="store_true", help="also run llama.cpp's llama-speculative-simple")
    p.add_argument("--source", help="packed llama.cpp sources for the CUDA build (gdnpass llama-build --pack)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", metavar="FILE", help="write every number as JSON")
    a = p.parse_args(argv)
    cuda = a.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("generate_bench: no CUDA GPU here (--device cpu runs the same steps on the CPU, untimed "
                         "against the GPU)")
    if a.write_cycle and not Path(a.gguf).exists():
        from gdnpass.models.cycle_model import write_cycle_gguf

        t0 = time.perf_counter()
        write_cycle_gguf(a.write_cycle, a.gguf, period=a.period, scale=a.scale, wtype=a.wtype, mtp=a.mtp,
                         mtp_h=a.mtp_h)
        print(f"wrote {a.gguf} ({Path(a.gguf).stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.1f} s",
              flush=True)
    model = Model.from_gguf(a.gguf) if a.gguf else Model.preset(a.model, wtype=a.wtype)
    if a.draft == "mtp" and (why := has_head(model)):
        raise SystemExit(f"generate_bench: --draft mtp: {why}")
    tok = None
    if a.prompt_ids:
        prompt = [int(x) for x in a.prompt.replace(",", " ").split()]
    else:
        from gdnpass.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(a.gguf)
        prompt = tok.encode(a.prompt)
    eog = [t for t in range(model.shape.vocab_size) if tok.is_eog(t)] if tok else []
    install = None
    if a.peer:
        from gdnpass.frontends.llama import build

        t0 = time.perf_counter()
        install = build.ensure(log=lambda line: print(f"[llama.cpp build] {line}", flush=True),
                               variant="cuda" if cuda else "cpu", source=a.source)
        print(f"llama.cpp {install.variant} build ready in {time.perf_counter() - t0:.0f} s", flush=True)

    out = {"model": model.describe(), "gguf": a.gguf, "gpu": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "drafter": a.draft, "n_predict": a.n_predict, "prompt_tokens": len(prompt),
           "date": time.strftime("%Y-%m-%d %H:%M"), "cases": []}
    bad = False
    for K in [int(k) for k in a.draft_max.split(",")]:
        case, ok = run_case(a, model, prompt, eog, K, tok, install)
        out["cases"].append(case)
        bad |= not ok
    print_table(out)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 1 if bad else 0


def run_case(a, model: Model, prompt: list[int], eog: list[int], K: int, tok, install) -> tuple[dict, bool]:
    size_n = a.ngram_n if a.ngram_n is not None else ngram_defaults(K)[0]
    truth = None
    if a.draft == "planted":  # the true greedy continuation, from a plain decode of the same model
        truth = generate(Engine(model, Settings(draft_max=0, n_rs_seq=0, device=a.device)), prompt, NoDraft(),
                         a.n_predict, eog=eog).tokens

    cuda = a.device.startswith("cuda")
    base = dict(draft_max=K, device=a.device, cuda_graphs=cuda)
    engines = {on: Engine(model, Settings(**base, fusion=on)) for on in (False, True)}
    # the MTP head's context, one per fusion setting and kept across runs (its graphs built and captured once; the
    # loop resets it at each run's start)
    heads = {on: MtpDrafter(model, engines[on].s) for on in (False, True)} if a.draft == "mtp" else {}

    def drafter(on: bool):
        if a.draft == "mtp":
            return heads[on]
        if a.draft == "planted":
            return Planted(truth, len(prompt), model.shape.vocab_size, cycle_schedule(K))
        if a.draft == "ngram":
            return NgramSimple(size_n, K)
        return NoDraft()

    t0 = time.perf_counter()
    checked = {on: generate(engines[on], prompt, drafter(on), a.n_predict, eog=eog, hash_logits=True)
               for on in (False, True)}  # warm-up: every graph built, fused, captured; logits hashed
    diffs = differences(checked[False], checked[True])
    print(f"K={K}: warm-up and identity runs {time.perf_counter() - t0:.1f} s; fusion off vs on: "
          + ("identical" if not diffs else "; ".join(diffs)), flush=True)

    peer_runs = []

    def peer():
        if install is not None:
            from gdnpass.frontends.llama import speculative

            text = a.prompt if not a.prompt_ids else None
            if text is None:
                raise SystemExit("--peer needs a text prompt (llama-speculative-simple tokenizes it)")
            peer_runs.append(speculative.run(install, a.gguf, text, a.n_predict, size_n, K,
                                             draft_mtp=K if a.draft == "mtp" else None,
                                             n_gpu_layers=99 if cuda else 0))
            print(f"K={K}: llama.cpp {peer_runs[-1].tokens_per_second:.1f} t/s", flush=True)

    peer()
    order = [False, True, True, False] * a.reps
    runs: dict[bool, list] = {False: [], True: []}
    for on in order:
        runs[on].append(generate(engines[on], prompt, drafter(on), a.n_predict, eog=eog))
    peer()
    lean = [r for on in (False, True) for r in runs[on]]
    same = all(r.tokens == checked[False].tokens and [s.accepted for s in r.steps] ==
               [s.accepted for s in checked[False].steps] for r in lean)
    case = {"K": K, "ngram": {"size_n": size_n, "size_m": K} if a.draft == "ngram" else None,
            "identical_off_on": not diffs, "differences": diffs[:4], "lean_runs_same_tokens": same,
            "order": ["on" if x else "off" for x in order]}
    gpu_cache: dict = {}
    for on in (False, True):
        rs = runs[on]
        gpu = [step_gpu_ms(engines[on], r, gpu_cache) if cuda else float("nan") for r in rs]
        case["fusion_" + ("on" if on else "off")] = {
            "tokens_per_s": [round(r.tokens_per_second, 2) for r in rs],
            "median_tokens_per_s": round(statistics.median(r.tokens_per_second for r in rs), 2),
            "ms_per_step": [round(r.ms_per_step, 3) for r in rs], "gpu_ms_per_step": [round(g, 3) for g in gpu],
            "wall_over_gpu": round(statistics.median(r.ms_per_step / g for r, g in zip(rs, gpu)), 3),
            "accept_rate": round(rs[0].accept_rate, 4), "steps": len(rs[0].steps), "tokens": len(rs[0].tokens),
            "drafted": rs[0].drafted, "accepted": rs[0].accepted, "graphs": len(engines[on].slots)}
    if cuda:  # the lean step's phases, fusion on
        try:
            case["step_breakdown_ms"] = step_breakdown(engines[True], lambda on_tokens: generate(
                engines[True], prompt, drafter(True), a.n_predict, eog=eog, on_tokens=on_tokens))
        except Exception as e:  # (a diagnostic: it must not cost the case's other numbers)
            print(f"K={K}: step breakdown failed: {type(e).__name__}: {e}", flush=True)
    ok = not diffs and same
    if peer_runs:
        ours = tok.decode_bytes(checked[True].tokens)
        texts = [r.generated(a.prompt) for r in peer_runs]
        match = [t.startswith(ours) for t in texts]  # byte for byte, on gdnpass's N tokens
        case["llama_cpp"] = {
            "tokens_per_s": [round(r.tokens_per_second, 2) for r in peer_runs],
            "median_tokens_per_s": round(statistics.median(r.tokens_per_second for r in peer_runs), 2),
            "n_predict": peer_runs[0].n_predict, "n_drafted": peer_runs[0].n_drafted,
            "n_accept": peer_runs[0].n_accept, "accept_rate": round(peer_runs[0].accept_rate, 4),
            "identical_text": all(match), "n_prompt": peer_runs[0].n_prompt, "command": peer_runs[0].command,
            "log": peer_runs[0].log[-16:], "text_ours": ours[:200].decode(errors="replace"),
            "text_theirs": texts[0][:200].decode(errors="replace")}
        ok &= peer_runs[0].n_prompt == len(prompt)
        ok &= all(match)
        for on in (False, True):
            f = case["fusion_" + ("on" if on else "off")]
            f["vs_llama_cpp"] = round(f["median_tokens_per_s"] / case["llama_cpp"]["median_tokens_per_s"], 3)
    engines.clear()  # free this K's graphs and buffers before the next
    heads.clear()
    if cuda:
        torch.cuda.empty_cache()
    return case, ok


def print_table(out: dict) -> None:
    print(f"\ngenerate bench: {out['model']}; {out['gpu']}, torch {out['torch']}; drafter {out['drafter']}, "
          f"{out['n_predict']} tokens, prompt {out['prompt_tokens']} tokens; {out['date']}")
    print(f"{'K':>3} {'run':<12} {'tok/s':>8} {'ms/step':>8} {'GPU ms':>7} {'wall/GPU':>8} {'accept':>7} "
          f"{'steps':>5} {'vs llama':>8}  identical")
    for c in out["cases"]:
        for name in ("fusion_off", "fusion_on"):
            f = c[name]
            print(f"{c['K']:>3} {name.replace('_', ' '):<12} {f['median_tokens_per_s']:>8.1f} "
                  f"{statistics.median(f['ms_per_step']):>8.3f} {statistics.median(f['gpu_ms_per_step']):>7.3f} "
                  f"{f['wall_over_gpu']:>8.3f} {f['accept_rate']:>7.3f} {f['steps']:>5} "
                  f"{f.get('vs_llama_cpp', float('nan')):>8.3f}  "
                  f"{'off=on' if c['identical_off_on'] else 'DIFFERENT'}")
        if c.get("step_breakdown_ms"):
            print(f"{c['K']:>3} fusion on, one step's phases (medians, ms): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in c["step_breakdown_ms"].items()))
        if "llama_cpp" in c:
            lc = c["llama_cpp"]
            print(f"{c['K']:>3} {'llama.cpp':<12} {lc['median_tokens_per_s']:>8.1f} {'':>8} {'':>7} {'':>8} "
                  f"{lc['accept_rate']:>7.3f} {'':>5} {'':>8}  "
                  f"{'same text' if lc['identical_text'] else 'TEXT DIFFERS'} (its n_drafted {lc['n_drafted']}, "
                  f"n_accept {lc['n_accept']}, {lc['n_predict']} tokens)")


if __name__ == "__main__":
    sys.exit(main())
