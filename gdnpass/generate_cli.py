"""``gdnpass generate``: the speculative loop (:mod:`gdnpass.generate`) from the command line.

Kept apart from :mod:`gdnpass.cli` (which only registers it) and free of torch at import, so ``gdnpass --help``
stays instant. Flags follow ``gdnpass run``: ``--gguf FILE`` or ``--model PRESET``, ``--fuse/--no-fuse`` over
``GDN_FUSION``, ``--between``, ``--alignment``, ``--device``, ``--backend``, ``--json``, ``-q``; errors are one line.
"""

from __future__ import annotations

import argparse

from gdnpass.argtypes import Given, alignment, given  # (gdnpass run's: the same one-line errors)
from gdnpass.errors import GdnpassError
from gdnpass.outputs import json_text

DESCRIPTION = (
    "Generate N tokens with speculative decoding on a whole qwen35 model: prefill the prompt, then draft up to K "
    "tokens, verify them in one ubatch with K rollback planes, accept the greedy prefix and roll back as llama.cpp "
    "does (llama_memory_seq_rm: the next verify reads plane n_t - 1 - accepted). --check runs it with fusion off and "
    "on and compares tokens, accepted counts and every step's logits byte for byte. Several prompts (--prompt or "
    "--prompt-ids repeated, --prompts-file) run as several sequences at once, each drafting, accepting and rolling "
    "back on its own in ubatches shared as llama.cpp's split_equal shares them.")


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids separated by commas or spaces, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def add_parser(sub) -> argparse.ArgumentParser:
    g = sub.add_parser("generate", help="speculative decoding end to end: draft, verify, accept, roll back",
                       description=DESCRIPTION)
    m = g.add_argument_group("model")
    m.add_argument("--gguf", metavar="FILE", help="a qwen35 model file (weights loaded from it)")
    m.add_argument("--model", action=Given, default="tiny-qwen35",
                   help="a shape preset with generated weights, when no --gguf (default: %(default)s)")
    m.add_argument("--wtype", action=Given, default="bf16", choices=["f32", "f16", "bf16"],
                   help="preset weights' type (default: bf16)")
    m.add_argument("--seed", action=Given, type=int, default=0, help="seed of a preset's weights (default: 0)")
    d = g.add_argument_group("generation")
    d.add_argument("--prompt", metavar="TEXT", action="append", default=None,
                   help="the prompt as text, tokenized with the model file's own tokenizer (tokenizer.ggml.*), as "
                        "llama.cpp's llama_tokenize does; the output is then detokenized and streamed. Repeat it "
                        "for several sequences at once (one each, in shared ubatches)")
    d.add_argument("--prompts-file", metavar="FILE", default=None,
                   help="prompts as text, one per line (blank lines skipped): a sequence each, as repeated --prompt")
    d.add_argument("--prompt-ids", metavar="IDS", type=_ids, action="append", default=None,
                   help="the prompt as token ids, e.g. 1,2,3 (default, with neither: 1..8); repeat it for several "
                        "sequences")
    d.add_argument("-n", "--n-predict", type=int, default=32, help="tokens to generate (default: 32)")
    d.add_argument("--draft", default="ngram", choices=["ngram", "mtp", "planted", "none"],
                   help="drafter: llama.cpp's n-gram prompt lookup (common_ngram_simple_draft), the model's own MTP "
                        "head (a file with an MTP block; llama.cpp's draft-mtp), the planted test "
                        "drafter (the true greedy continuation with mistakes planted at chosen positions: runs a "
                        "plain greedy decode first), or none (plain one-token greedy decode) (default: ngram)")
    d.add_argument("--draft-max", type=int, default=4, metavar="K", help="most draft tokens per step (default: 4)")
    d.add_argument("--rs-seq", type=int, default=None, help="rollback planes n_rs_seq (default: K)")
    d.add_argument("--ngram-n", type=int, default=None, help="n-gram lookup size (llama.cpp's --spec-ngram-size-n; "
                   "default: min(12, K), 12 being llama.cpp's default: a draft needs n <= m)")
    d.add_argument("--ngram-m", type=int, default=None, help="m-gram draft size (llama.cpp's --spec-ngram-size-m, "
                   "which is ngram-simple's draft maximum there; default: K)")
    d.add_argument("--plant-accept", type=_ids, default=None, metavar="LIST",
                   help="planted drafter: accepted drafts per step, repeated (default: K, 0, 1, ..., K-1); "
                        "sequence s starts at entry s, so sequences accept different counts in one step")
    d.add_argument("--plant-lengths", type=_ids, default=None, metavar="LIST",
                   help="planted drafter: draft lengths per step, repeated (default: K)")
    d.add_argument("--vs-plain", action="store_true",
                   help="also run a plain greedy decode (n_rs_seq 0) and compare under the divergence rule")
    c = g.add_argument_group("context")
    c.add_argument("--ubatch", type=int, default=None,
                   help="n_ubatch (default: max(16, n_rs_seq + 2, sequences x (K + 1)), at most 512)")
    c.add_argument("--ctx", type=int, default=256, help="n_ctx, padded to 256, shared by the sequences' KV streams "
                   "(n_ctx / sequences each, padded to 256, as llama.cpp shares it; default: 256)")
    c.add_argument("--flash-attn", default="on", choices=["on", "off"], help="default: on (llama.cpp's CPU auto)")
    p = g.add_argument_group("the pass and execution")
    p.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=None,
                   help="run the fusion pass (--no-fuse: don't; default: GDN_FUSION decides)")
    p.add_argument("--between", default="narrow", choices=["narrow", "broad"])
    p.add_argument("--alignment", type=alignment, default=128,
                   help="arena alignment in bytes, a power of two (default: 128, as ggml-cuda)")
    p.add_argument("--check", action="store_true",
                   help="run with fusion off, then on; exit 1 unless tokens, accepted counts and every step's logits "
                        "bytes are identical")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--backend", default=None, choices=["torch", "triton"],
                   help="kernel table (default: torch on cpu, triton on cuda)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture each graph once as a CUDA graph and replay it (default: on with --device cuda)")
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    g.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    g.set_defaults(func=cmd_generate)
    return g


def cmd_generate(a: argparse.Namespace) -> int:
    if a.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise GdnpassError(f"--device {a.device}: not available on this machine (no CUDA GPU); use --device cpu")
    elif a.device != "cpu":
        raise GdnpassError(f"--device {a.device!r}: unknown device (expected cpu or cuda)")
    if a.device == "cpu" and a.backend == "triton":
        raise GdnpassError("--backend triton on the CPU runs Triton's interpreter: far too slow for a generate loop; "
                           "use --backend torch or --device cuda")
    if a.n_predict < 1:
        raise GdnpassError(f"-n must be >= 1, is {a.n_predict}")
    preset_flags = sorted(given(a) & {"model", "wtype", "seed"})
    if a.gguf and preset_flags:
        raise GdnpassError(f"--{preset_flags[0]} does nothing with --gguf {a.gguf}: the file decides the model and its "
                           "weights; drop the flag")
    from gdnpass import generate as gen
    from gdnpass.engine import Engine, Model, Settings
    from gdnpass.drafters import NgramSimple, NoDraft, Planted, cycle_schedule, ngram_defaults, seq_schedule
    from gdnpass.fusion import env_enabled
    from gdnpass.mtp_drafter import MtpDrafter, has_head
    from gdnpass.progress import step

    model = Model.from_gguf(a.gguf) if a.gguf else Model.preset(a.model, wtype=a.wtype, seed=a.seed)
    why = has_head(model) if a.draft == "mtp" else None
    if why:
        raise GdnpassError(f"--draft mtp: {why}")
    fusion = env_enabled() if a.fuse is None else a.fuse
    K = a.draft_max
    if K < 0:
        raise GdnpassError(f"--draft-max must be >= 0, is {K}")
    base = dict(draft_max=K, n_rs_seq=a.rs_seq, n_ubatch=a.ubatch, n_ctx=a.ctx, flash_attn=a.flash_attn == "on",
                device=a.device, backend=a.backend, alignment=a.alignment, between=a.between,
                cuda_graphs=a.device.startswith("cuda") if a.cuda_graphs is None else a.cuda_graphs)
    vocab = model.shape.vocab_size
    tok = _tokenizer(a, model)
    prompts = _prompts(a, tok, vocab)
    n = len(prompts)
    if n > 1 and a.draft == "mtp":
        raise GdnpassError(f"--draft mtp: the MTP head drafts for one sequence, not {n} (give one prompt)")
    base["n_seqs"] = n
    eog = tok.eog if tok is not None else ()

    compare_plain = a.draft == "planted" or a.vs_plain
    base["margins"] = compare_plain  # the divergence rule needs each token's top-2 margin
    plain = None
    if compare_plain:
        with step("plain decode", "tokens", quiet=a.quiet) as prog:
            plain = gen.generate_batch(Engine(model, Settings(**{**base, "draft_max": 0, "n_rs_seq": 0,
                                                                       "cuda_graphs": False, "fusion": fusion})),
                                       prompts, [NoDraft()] * n, a.n_predict, eog=eog, progress=prog)

    default_n, default_m = ngram_defaults(K)
    ngram_n = a.ngram_n if a.ngram_n is not None else default_n
    ngram_m = a.ngram_m if a.ngram_m is not None else default_m
    accept = a.plant_accept or cycle_schedule(K)

    def drafter(settings, s: int):
        if a.draft == "ngram":
            return NgramSimple(ngram_n, ngram_m)
        if a.draft == "mtp":  # (its own context of the target's settings: fused when the target is)
            return MtpDrafter(model, settings)
        if a.draft == "planted":  # (sequence s starts its schedule at entry s)
            return Planted(plain[s].tokens, len(prompts[s]), vocab, seq_schedule(accept, s),
                           a.plant_lengths or ())
        return NoDraft()

    runs = [False, True] if a.check else [fusion]
    stream = tok is not None and not a.json and not a.check and n == 1  # the text as it is accepted, on stdout
    results = []
    for on in runs:
        settings = Settings(**base, fusion=on)
        eng, drafts = Engine(model, settings), [drafter(settings, s) for s in range(n)]
        label = f"generate (fusion {'on' if on else 'off'})" if a.check else "generate"
        on_tokens = None
        if stream:
            out = tok.stream()
            print(tok.decode(prompts[0]), end="", flush=True)
            on_tokens = lambda seq, ids: print(out.feed(ids), end="", flush=True)  # noqa: E731
        with step(label, "tokens", quiet=a.quiet or stream) as prog:
            results.append(gen.generate_batch(eng, prompts, drafts, a.n_predict, eog=eog, hash_logits=a.check,
                                              progress=prog, on_tokens=on_tokens))
        if stream:
            print(out.flush(), end="\n\n", flush=True)
    res = results[-1]  # (eng and drafts: the last run's)
    diffs = [gen.differences(x, y) for x, y in zip(*results)] if a.check else None
    vs_plain = ([gen.divergence(r.tokens, r.margins, p.tokens, p.margins, SELF_TOLERANCE) for r, p in zip(res, plain)]
                if plain is not None else None)
    common = {
        "model": model.describe(), "fusion": runs[-1] if not a.check else "off and on",
        "settings": {"draft_max": K, "n_rs_seq": eng.n_rs, "n_ubatch": eng.s.ubatch, "n_ctx": eng.kv_size,
                     "n_seqs": n, "flash_attn": a.flash_attn, "device": a.device,
                     "backend": a.backend or ("triton" if a.device.startswith("cuda") else "torch"),
                     "cuda_graphs": base["cuda_graphs"],
                     "drafter": {"ngram": {"size_n": ngram_n, "size_m": ngram_m}}.get(a.draft, a.draft)},
        "graphs": _graphs(eng),
        "reserve": {"n_tokens": eng.s.ubatch, "n_kv": eng.kv_size, "arena_bytes": eng.reserve.buffers["arena"]},
    }
    if n > 1:  # the n_ctx above is each sequence's stream
        common["settings"]["n_ctx_seq"] = common["settings"].pop("n_ctx")
    per_seq = []
    for s, r in enumerate(res):
        one = r.to_json()
        if tok is not None:
            one["text"] = tok.decode(r.tokens)
        if diffs is not None:
            one["check"] = {"identical": not diffs[s], "differences": diffs[s]}
        if vs_plain is not None:
            d = vs_plain[s]
            one["vs_plain"] = {"identical": d.index is None, "first_divergence": d.index,
                               "margins": list(d.margins) if d.index is not None else None,
                               "tolerance": d.tolerance, "ok": d.ok}
        per_seq.append(one)
    if n == 1:
        summary = {**per_seq[0], **common}
    else:
        seconds = max(r.seconds for r in res)
        tokens = sum(len(r.tokens) for r in res)
        summary = {"n_sequences": n, "n_tokens": tokens, "seconds": round(seconds, 6),
                   "tokens_per_second": round(tokens / seconds, 3) if seconds else 0.0,
                   "n_drafted": sum(r.drafted for r in res), "n_accepted": sum(r.accepted for r in res),
                   "prefill": per_seq[0]["prefill"], "sequences": per_seq, **common}
        if diffs is not None:
            summary["check"] = {"identical": not any(diffs)}
    if len(drafts) == 1 and isinstance(drafts[0], MtpDrafter):  # the head's own context: its graphs
        summary["mtp_graphs"] = _graphs(drafts[0].head)
    if a.json:
        print(json_text(summary, indent=1))  # (valid JSON: a non-finite margin becomes a string)
    elif n == 1:
        print(_text(summary, res[0], diffs and diffs[0], vs_plain and vs_plain[0]))
    else:
        print(_text_seqs(summary, res, tok, diffs, vs_plain))
    bad_check = diffs is not None and any(diffs)
    bad_plain = vs_plain is not None and not all(d.ok for d in vs_plain)
    return 1 if bad_check or bad_plain else 0


def _prompts(a: argparse.Namespace, tok, vocab: int) -> list[list[int]]:
    """The prompts, one per sequence: --prompt (repeated) and --prompts-file as text, or --prompt-ids (repeated);
    default one prompt of ids 1..8."""
    texts = list(a.prompt or [])
    if a.prompts_file is not None:
        texts += read_prompts_file(a.prompts_file)
    if texts and a.prompt_ids is not None:
        raise GdnpassError("--prompt / --prompts-file and --prompt-ids: give the prompts one way")
    prompts = [tok.encode(t) for t in texts] if texts else (a.prompt_ids or [[1, 2, 3, 4, 5, 6, 7, 8]])
    for t, p in zip(texts, prompts):
        if not p:
            raise GdnpassError(f"--prompt {t!r}: the tokenizer makes no tokens of it")
    for p in prompts:
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise GdnpassError(f"--prompt-ids: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return prompts


def read_prompts_file(path) -> list[str]:
    """``--prompts-file``: text prompts, one per line, blank lines skipped; one-line errors naming the file."""
    from pathlib import Path

    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise GdnpassError(f"--prompts-file {path}: cannot read it as UTF-8 text "
                           f"({getattr(e, 'strerror', None) or e.__class__.__name__})") from None
    lines = [x for x in lines if x.strip()]
    if not lines:
        raise GdnpassError(f"--prompts-file {path}: no prompt in it (one per line, blank lines skipped)")
    return lines


# The divergence rule's tolerance for two runs of gdnpass's own executor (speculative vs plain decode): logits of
# the same tokens through ubatches of other widths differ by float rounding only (measured on the tiny models: at
# most 1e-5 absolute, f32 weights); a divergence needs both top-2 margins below twice that bound. docs/generate.md.
SELF_TOLERANCE = 1e-4


def _graphs(eng) -> list[dict]:
    """Each cached graph of an engine: its shape, runs, binding and fusion counts."""
    return [{"n_t": s.n_t, "n_kv": s.n_kv, "n_outputs": s.n_out,
             **({"seqs": [s.seq0, s.seq0 + s.n_seqs - 1]} if eng.n_seqs > 1 else {}),
             "nodes": len(s.graph.nodes), "runs": s.runs, "bound_to_reserve": not s.reallocated,
             "fusion": s.report.counts() if s.report and s.report.enabled else None}
            for s in sorted(eng.slots.values(), key=lambda s: (s.n_kv, s.n_t, s.n_out, s.n_seqs, s.seq0))]


def _tokenizer(a: argparse.Namespace, model):
    """The model file's own tokenizer; None for a preset or a file without one, unless text prompts (--prompt,
    --prompts-file) need it (then a one-line error naming the file)."""
    from gdnpass.tokenizer import Tokenizer, TokenizerError

    text = "--prompt" if a.prompt is not None else "--prompts-file" if a.prompts_file is not None else None
    if a.gguf is None:
        if text:
            raise GdnpassError(f"{text}: preset {a.model!r} has no tokenizer; give token ids with --prompt-ids, or "
                               "a model file with --gguf")
        return None
    try:
        return Tokenizer.from_gguf(a.gguf)
    except TokenizerError:
        if text:
            raise
        return None


def _text(s: dict, res, diffs, vs_plain) -> str:
    st = s["settings"]
    ms = sorted(x.seconds for x in res.steps)
    lines = [
        f"gdnpass generate: {s['model']}; drafter {res.drafter}, K={st['draft_max']} (n_rs_seq {st['n_rs_seq']}, "
        f"n_ubatch {st['n_ubatch']}, n_ctx {st['n_ctx']}), fusion {_onoff(s['fusion'])}; {st['device']}, "
        f"backend {st['backend']}",
        f"  prompt {len(res.prompt)} tokens, prefill {res.prefill_seconds:.3f} s in {res.prefill_ubatches} ubatch"
        f"{'es' if res.prefill_ubatches != 1 else ''}",
        "  tokens: " + " ".join(map(str, res.tokens)) + (" (stopped at end of generation)" if res.stop == "eog" else ""),
        f"  steps {len(res.steps)}, accepted per step: " + " ".join(str(x.accepted) for x in res.steps),
        "  acceptance histogram (drafting steps): " + ", ".join(f"{k}: {v}" for k, v in res.histogram().items()),
        f"  accept rate {res.accept_rate:.3f} ({res.accepted} of {res.drafted} drafted), "
        f"{len(res.tokens) / max(1, len(res.steps)):.2f} tokens/step",
        f"  time: {1e3 * sum(ms) / max(1, len(ms)):.1f} ms/step (min {1e3 * ms[0]:.1f}, max {1e3 * ms[-1]:.1f})"
        if ms else "  time: no steps",
        f"  graphs: {len(s['graphs'])} (n_t, n_kv) " + ", ".join(
            f"({g['n_t']}, {g['n_kv']}{'' if g['n_outputs'] else ', prefill: no logits'})" for g in s["graphs"])
        + f", bound to one reserve plan of {st['n_ubatch']} tokens ({s['reserve']['arena_bytes'] / 2**20:.2f} MiB "
          "arena)",
    ]
    if "mtp_graphs" in s:  # (the MTP head's context: one-token draft steps, and the target's batches without outputs)
        lines.append(f"  MTP head graphs: {len(s['mtp_graphs'])} (n_t, n_kv, n_outputs) " + ", ".join(
            f"({g['n_t']}, {g['n_kv']}, {g['n_outputs']})" for g in s["mtp_graphs"]))
    # the closing line, as llama.cpp's speculative-simple closes (its "decoded ... speed", n_drafted, n_accept)
    lines.append(f"decoded {len(res.tokens)} tokens in {res.seconds:.3f} s, speed: {res.tokens_per_second:.1f} t/s; "
                 f"{len(res.steps)} steps, {res.ms_per_step:.2f} ms/step; n_drafted {res.drafted}, n_accept "
                 f"{res.accepted}, accept {100 * res.accept_rate:.1f}%")
    if diffs is not None:
        lines.append("  fusion off vs on: " + ("identical tokens, accepted counts and logits bytes at every step"
                                                if not diffs else "DIFFERENT: " + "; ".join(diffs)))
    if vs_plain is not None:
        lines.append(f"  vs plain greedy decode: {vs_plain}")
    return "\n".join(lines)


def _text_seqs(s: dict, res: list, tok, diffs, vs_plain) -> str:
    """Several sequences: each one's text (or tokens) under its label, its steps, then the totals."""
    st = s["settings"]
    lines = [
        f"gdnpass generate: {s['model']}; {len(res)} sequences, drafter {res[0].drafter}, K={st['draft_max']} "
        f"(n_rs_seq {st['n_rs_seq']}, n_ubatch {st['n_ubatch']}, n_ctx {st['n_ctx_seq']} per sequence), fusion "
        f"{_onoff(s['fusion'])}; {st['device']}, backend {st['backend']}",
        f"  prompts {' '.join(str(len(r.prompt)) for r in res)} tokens, prefill {res[0].prefill_seconds:.3f} s in "
        f"{res[0].prefill_ubatches} ubatch{'es' if res[0].prefill_ubatches != 1 else ''}"]
    for i, r in enumerate(res):
        body = (repr(tok.decode(r.prompt)) + " -> " + repr(tok.decode(r.tokens)) if tok is not None else
                " ".join(map(str, r.tokens)))
        lines += [f"[sequence {i}] {body}" + (" (stopped at end of generation)" if r.stop == "eog" else ""),
                  f"  steps {len(r.steps)}, accepted per step: " + " ".join(str(x.accepted) for x in r.steps)
                  + f"; accept rate {r.accept_rate:.3f} ({r.accepted} of {r.drafted} drafted); sequences in its "
                  "ubatches: " + " ".join(str(x.ubatch_seqs) for x in r.steps)]
        if diffs is not None:
            lines.append("  fusion off vs on: " + ("identical tokens, accepted counts and logits bytes at every step"
                                                    if not diffs[i] else "DIFFERENT: " + "; ".join(diffs[i])))
        if vs_plain is not None:
            lines.append(f"  vs plain greedy decode: {vs_plain[i]}")
    lines.append(f"  graphs: {len(s['graphs'])}, bound to one reserve plan of {st['n_ubatch']} tokens "
                 f"({s['reserve']['arena_bytes'] / 2**20:.2f} MiB arena)")
    lines.append(f"decoded {s['n_tokens']} tokens of {len(res)} sequences in {s['seconds']:.3f} s, speed: "
                 f"{s['tokens_per_second']:.1f} t/s; n_drafted {s['n_drafted']}, n_accept {s['n_accepted']}")
    return "\n".join(lines)


def _onoff(v) -> str:
    return v if isinstance(v, str) else ("on" if v else "off")
