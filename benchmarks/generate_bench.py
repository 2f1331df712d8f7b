"""The speculative loop on the GPU, fusion off vs on, in ABBA order (issue 19, item 6's benchmark).

    python benchmarks/generate_bench.py --gguf model.gguf --draft planted -K 4 -n 128
    python benchmarks/generate_bench.py --model qwen3.5-9b -K 7 -n 64 --reps 2

Per run: tokens/s of the decode loop (prefill excluded), ms per step, accept rate; then whether fusion off and on
gave identical tokens, accepted counts and logits bytes at every step. Each setting has its own engine (graphs built,
fused and, with --cuda-graphs (default on cuda), captured once per (width, n_kv) in an untimed warm-up run); the
timed runs go off, on, on, off (ABBA) so that drift (clocks, other tenants) cancels out of the comparison.

Run on the H200 once (qwen3.5-9b, planted K = 4, 24 tokens; docs/generate.md and docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from gdnpass.drafters import NgramSimple, NoDraft, Planted, cycle_schedule, ngram_defaults
from gdnpass.generate import Engine, Model, Settings, differences, generate


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf")
    p.add_argument("--model", default="tiny-qwen35", help="preset with generated weights (no --gguf)")
    p.add_argument("--wtype", default="bf16")
    p.add_argument("--draft", default="planted", choices=["planted", "ngram", "none"])
    p.add_argument("-K", "--draft-max", type=int, default=4)
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("--prompt", default="1,2,3,4,5,6,7,8")
    p.add_argument("--ngram-n", type=int, default=None)
    p.add_argument("--reps", type=int, default=1, help="ABBA rounds (default 1: off, on, on, off)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default=None, help="default: triton on cuda, torch on cpu")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="one CUDA graph per (width, n_kv) (default: on with cuda)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    prompt = [int(x) for x in a.prompt.replace(",", " ").split()]
    cuda_graphs = a.device.startswith("cuda") if a.cuda_graphs is None else a.cuda_graphs
    model = Model.from_gguf(a.gguf) if a.gguf else Model.preset(a.model, wtype=a.wtype)
    K = a.draft_max
    base = dict(draft_max=K, device=a.device, backend=a.backend, cuda_graphs=cuda_graphs)

    truth = None
    if a.draft == "planted":  # the true greedy continuation, from a plain decode of the same model
        truth = generate(Engine(model, Settings(**{**base, "draft_max": 0, "n_rs_seq": 0})), prompt, NoDraft(),
                         a.n_predict).tokens

    def drafter():
        if a.draft == "planted":
            return Planted(truth, len(prompt), model.shape.vocab_size, cycle_schedule(K))
        if a.draft == "ngram":
            default_n, default_m = ngram_defaults(K)
            return NgramSimple(default_n if a.ngram_n is None else a.ngram_n, default_m)
        return NoDraft()

    engines = {on: Engine(model, Settings(**base, fusion=on)) for on in (False, True)}
    for eng in engines.values():  # warm-up: every graph the run needs built, fused, captured
        generate(eng, prompt, drafter(), a.n_predict)
    order = [False, True, True, False] * a.reps
    runs: dict[bool, list] = {False: [], True: []}
    for on in order:
        runs[on].append(generate(engines[on], prompt, drafter(), a.n_predict, keep_logits=False))
    ref = runs[False][0]
    diffs = [d for on in (False, True) for r in runs[on] for d in differences(ref, r)]
    out = {"model": model.describe(), "device": a.device, "backend": a.backend or "default",
           "cuda_graphs": cuda_graphs, "drafter": a.draft, "draft_max": K, "n_predict": a.n_predict,
           "order": ["on" if x else "off" for x in order], "identical": not diffs, "differences": diffs[:4]}
    for on in (False, True):
        tps = [r.tokens_per_second for r in runs[on]]
        ms = [1e3 * r.seconds / len(r.steps) for r in runs[on]]
        out["fusion_" + ("on" if on else "off")] = {
            "tokens_per_s": [round(x, 2) for x in tps], "median_tokens_per_s": round(statistics.median(tps), 2),
            "ms_per_step": [round(x, 3) for x in ms], "accept_rate": round(runs[on][0].accept_rate, 4),
            "steps": len(runs[on][0].steps), "graphs": len(engines[on].slots)}
    off, on = out["fusion_off"], out["fusion_on"]
    out["speedup"] = round(on["median_tokens_per_s"] / off["median_tokens_per_s"], 4) if off["median_tokens_per_s"] \
        else None
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"generate bench: {out['model']}; {a.device}, backend {out['backend']}, CUDA graphs {cuda_graphs}; "
              f"drafter {a.draft}, K={K}, {a.n_predict} tokens; order {' '.join(out['order'])}")
        for name, r in (("fusion off", off), ("fusion on", on)):
            print(f"  {name:10s}: {r['median_tokens_per_s']:8.2f} tokens/s (runs {r['tokens_per_s']}), "
                  f"{statistics.median(r['ms_per_step']):.3f} ms/step, accept rate {r['accept_rate']:.3f}, "
                  f"{r['steps']} steps, {r['graphs']} graphs")
        print(f"  speedup (on / off): {out['speedup']}")
        print("  identity: " + ("identical tokens, accepted counts and logits bytes at every step, every run"
                                if not diffs else "DIFFERENT: " + "; ".join(diffs[:4])))
    return 0 if not diffs else 1


if __name__ == "__main__":
    sys.exit(main())
