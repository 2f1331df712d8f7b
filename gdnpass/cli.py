"""The ``gdnpass`` command: ``run`` (build, plan, fuse, execute a verify forward), ``dump`` (show it), ``capture``
(llama.cpp's own verify graph of a GGUF model), ``llama-build`` (the pinned llama.cpp, cached) and ``quantize``
(llama.cpp's own quantizer on a GGUF model).

Both go through :mod:`gdnpass.pipeline` and speak the same flags: the graph flags (or ``--graph FILE``), the pass
flags (``--fuse/--no-fuse`` over ``GDN_FUSION``, ``--between``, ``--alignment``), ``--json``, ``--save FILE``.
Every error a user can cause (unknown model, bad flag value, unreadable file) ends as one line on stderr and exit
code 2; a traceback means a bug in gdnpass. Heavy modules (torch, Triton) load only when a command needs them, so
``gdnpass --help`` is instant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from gdnpass.argtypes import Given, alignment, given
from gdnpass.errors import GdnpassError
from gdnpass.outputs import json_text

DESCRIPTION = ("A graph-rewrite fusion pass for the Gated-Delta-Net layers of Qwen3.5 / Qwen3-Next in a speculative "
               "verify step: build the graph llama.cpp builds, plan its memory as ggml's gallocr does, fuse the conv "
               "chain and the alpha/beta mat-vecs where the plan proves it legal, execute it.")
EPILOG = "GDN_FUSION=1 turns the pass on (--fuse / --no-fuse override it). 'gdnpass COMMAND --help' for each command."
DEFAULT_LAYERS = 4
# the types a projection weight may have: gdnpass.ir.DType's float and block types (spelled out: --help imports no
# IR; tests/test_cli.py holds it to DType)
WEIGHT_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_k", "q5_k", "q6_k"]


# ---------------------------------------------------------------------------------------------------------------------
# flags
# ---------------------------------------------------------------------------------------------------------------------


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _add_graph_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("graph (a flag here beside --graph is an error: the file holds the graph)")
    g.add_argument("--model", action=Given, default="qwen3.5-9b", help="shape preset (default: %(default)s)")
    g.add_argument("--tokens", action=Given, type=int, default=8,
                   help="tokens per sequence in the verify ubatch (default: 8)")
    g.add_argument("--rs-seq", action=Given, type=int, default=7,
                   help="rollback snapshot planes n_rs_seq (default: 7)")
    g.add_argument("--layers", action=Given, type=int, default=None,
                   help=f"GDN layers to build (default: {DEFAULT_LAYERS}, or all if the preset has fewer; 0 = all of "
                        "the preset's; qwen3.5-9b has 24: 10.2 GiB of buffers (9.8 GiB bf16 weights, 0.4 GiB caches), about "
                        "11.5 GB of RAM at peak, twice that with --check, which keeps a copy of every buffer). With "
                        "--gguf or --whole: the first N layers of the model's own pattern, and attention layers count "
                        "(qwen3.5-9b's first 4 are GDN 0, 1, 2 and attention 3), then the output norm and lm head "
                        "(default and 0: every layer)")
    g.add_argument("--seqs", action=Given, type=int, default=1,
                   help="sequences in the ubatch (default: 1; at most 256, llama.cpp's LLAMA_MAX_SEQ)")
    g.add_argument("--dflash", action=Given, nargs=0, const=True, default=False,
                   help="flag DFlash hidden-state taps OUTPUT (changes the plan)")
    g.add_argument("--whole", action=Given, nargs=0, const=True, default=False,
                   help="the whole forward of the preset (token embedding, every layer incl. full attention, lm head) "
                        "instead of its first --layers GDN layers; --gguf implies it")
    g.add_argument("--mtp", action=Given, nargs=0, const=True, default=False,
                   help="with --gguf: the model's MTP head instead of the trunk (one ubatch of --tokens tokens in "
                        "llama.cpp's MTP context: docs/mtp.md)")
    g.add_argument("--wtype", action=Given, default="bf16", choices=WEIGHT_TYPES,
                   help="type of the large projection weights and the token embedding (default: bf16; a block type: "
                        "ggml's blocks of random quants; with --gguf the file's types)")
    g.add_argument("--ab-wtype", action=Given, default="f32", choices=["f32", "f16", "bf16"],
                   help="type of the alpha/beta weights (default: f32)")
    g.add_argument("--snapshot-layout", action=Given, default="rows", choices=["rows", "dedup", "dedup-t"],
                   help="conv snapshot planes 1..n_rs_seq: one cache row each, or windows of one shared row per cell, "
                        "channel-major or time-major (default: rows; see gdnpass.models.SNAPSHOT_LAYOUTS)")
    g.add_argument("--qk-norm", action=Given, default=None, choices=["l2", "rms"],
                   help="q/k normalisation: L2_NORM (the seed's fork) or upstream llama.cpp's RMS_NORM + SCALE "
                        "(default: gdnpass.models.hparams.DEFAULT_QK_NORM)")
    p.add_argument("--graph", metavar="FILE", help="read a graph file (written by --save) instead of building one")
    p.add_argument("--gguf", metavar="FILE", help="build the whole verify forward of this qwen35 model file (shape, "
                   "layers and tensor types from its header; run loads its weights) instead of a preset's GDN layers")


def _add_pass_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the pass")
    g.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=None,
                   help="run the fusion pass (--no-fuse: don't; default: GDN_FUSION decides)")
    g.add_argument("--between", default="narrow", choices=["narrow", "broad"],
                   help="nodes-in-between check of the conv chain: the seed's narrow rules or the older broad one "
                        "(default: narrow)")
    g.add_argument("--alignment", action=Given, type=alignment, default=128,
                   help="arena alignment in bytes, a power of two (default: 128, as ggml-cuda; a graph file with a "
                        "plan keeps its own)")
    p.add_argument("--save", metavar="FILE", help="also write the graph (planned; fused when fusion is on) to FILE, "
                   "for --graph: written whole (a temporary file renamed into place) once the command has "
                   "succeeded, so a refused or interrupted run leaves an existing FILE as it was")


def verify_config(a: argparse.Namespace):
    """The graph flags as a :class:`gdnpass.models.VerifyConfig`."""
    from gdnpass.models import VerifyConfig, get_model

    layers = a.layers
    model = a.model
    if getattr(a, "whole", False):  # --layers N: the first N layers of the preset's pattern
        model, layers = _first_layers(get_model(a.model), layers, f"--model {a.model}"), 0
    if layers is None:
        layers = min(DEFAULT_LAYERS, len(get_model(a.model).gdn_layers))
    return VerifyConfig(model=model, n_tokens=a.tokens, n_rs_seq=a.rs_seq, n_layers=layers or None, n_seqs=a.seqs,
                        whole=getattr(a, "whole", False),
                        dflash=a.dflash, wtype=a.wtype, ab_wtype=a.ab_wtype, snapshot_layout=a.snapshot_layout,
                        **({"qk_norm": a.qk_norm} if getattr(a, "qk_norm", None) else {}))


def pass_options(a: argparse.Namespace, fusion: bool | None = None):
    """The pass flags as :class:`gdnpass.pipeline.PassOptions` (``fusion`` overrides --fuse and GDN_FUSION)."""
    from gdnpass.pipeline import PassOptions

    return PassOptions(fusion=a.fuse if fusion is None else fusion, alignment=a.alignment, between=a.between)


# graph flags a source does not read: every one with --graph (the file holds the graph), and with --gguf those the
# file decides (its shape, its tensor types) or the whole forward does not take
_GGUF_IGNORES = ("model", "wtype", "ab_wtype", "snapshot_layout", "dflash")


def _refuse_ignored(a: argparse.Namespace) -> None:
    """A flag the chosen source would ignore is an error naming it, not a silent no-op."""
    if getattr(a, "graph", None) and getattr(a, "gguf", None):
        raise GdnpassError("--graph and --gguf are two sources; pick one")
    if getattr(a, "graph", None):
        ignored = sorted(given(a) - {"alignment"})  # (--alignment: only a file with a plan ignores it; see _planned)
        if ignored:
            raise GdnpassError(f"{_flag(ignored[0])} does nothing with --graph {a.graph}: the file holds the graph "
                               "(its model, tokens, layers, ...); drop the flag")
    elif getattr(a, "gguf", None):
        ignored = [d for d in _GGUF_IGNORES if d in given(a)]
        if ignored:
            raise GdnpassError(f"{_flag(ignored[0])} does nothing with --gguf {a.gguf}: the file decides the model "
                               "and its tensor types (and builds the whole forward); drop the flag")


def _model(a: argparse.Namespace):
    """The --gguf model (header and tensor index, validated), or None."""
    _refuse_ignored(a)
    if not getattr(a, "gguf", None):
        return None
    from gdnpass.models.gguf_model import open_model

    return open_model(a.gguf)


def _first_layers(shape, n: int | None, what: str):
    """``shape`` cut after its first ``n`` layers (``--layers``; None or 0: all of them)."""
    if not n:
        return shape
    if not 1 <= n <= shape.n_layer:
        raise GdnpassError(f"--layers {n}: {what} has {shape.n_layer} layers (attention layers count)")
    return shape.first_layers(n)


def whole_title(name: str, n_all: int, cfg, weights: str) -> str:
    """What a whole forward holds, for the header of run and dump: the layers by kind, the lm head, the weights."""
    m = cfg.shape
    layers = f"{m.n_layer} layers" if m.n_layer == n_all else f"the first {m.n_layer} of {n_all} layers"
    head = "token_embd.weight (tied)" if m.tie_embeddings else "output.weight"
    return (f"{name}, whole forward: token embedding, {layers} (GDN {m.gdn_layers}, attention {m.attn_layers}), "
            f"lm head {head}; n_t={cfg.n_tokens}, n_rs_seq={cfg.n_rs_seq}; weights {weights}")


def _source(a: argparse.Namespace):
    model = _model(a)
    if getattr(a, "mtp", False):
        if model is None:
            raise GdnpassError("--mtp needs --gguf FILE: the MTP head is a model file's (its nextn blocks)")
        mixed = [d for d in ("rs_seq", "layers", "seqs", "qk_norm") if d in given(a)]
        if mixed:
            raise GdnpassError(f"{_flag(mixed[0])} does nothing with --mtp: the MTP head is one attention block of one "
                               "sequence, without rollback planes; drop the flag")
        graph = model.build(model.mtp_config(n_tokens=a.tokens))
        graph.meta["source"] = (f"{model.path.name}, MTP head (block {model.shape.mtp_layer}): n_t={a.tokens}; "
                                f"weights {model.weights_summary(graph)}")
        return graph
    if model is None:
        if a.graph or not getattr(a, "whole", False):
            return a.graph or verify_config(a)
        from gdnpass.models import build_verify_graph, get_model

        cfg = verify_config(a)
        graph = build_verify_graph(cfg)
        graph.meta["source"] = whole_title(a.model, get_model(a.model).n_layer, cfg,
                                           f"{a.wtype} (alpha/beta {a.ab_wtype}), seeded")
        return graph
    cfg = model.config(layers=_first_layers(model.shape, a.layers, model.path.name).n_layer, n_tokens=a.tokens,
                       n_rs_seq=a.rs_seq, n_seqs=a.seqs,
                       **({"qk_norm": a.qk_norm} if getattr(a, "qk_norm", None) else {}))
    graph = model.build(cfg)
    graph.meta["source"] = whole_title(model.path.name, model.shape.n_layer, cfg, model.weights_summary(graph))
    return graph


def _planned(a: argparse.Namespace, fuse_now: bool = True, fusion: bool | None = None):
    """The pipeline's result for the flags, and (with --save) the graph file's text, made now so that a graph JSON
    cannot hold is refused before anything runs; :func:`_save` writes it once the command has succeeded."""
    from gdnpass import pipeline

    res = pipeline.run(_source(a), pass_options(a, fusion), fuse_now=fuse_now)
    if a.graph and "alignment" in given(a) and res.graph.alignment != a.alignment:
        raise GdnpassError(f"--alignment {a.alignment} does nothing with --graph {a.graph}: the file's plan is kept "
                           f"(alignment {res.graph.alignment}); drop the flag")
    res.saved = None
    if a.save:
        from gdnpass.outputs import check_writable
        from gdnpass.serialize import dumps

        check_writable(a.save, "--save")
        try:
            res.saved = dumps(res.graph)
        except GdnpassError as e:
            raise GdnpassError(f"--save {a.save}: {e}") from None
    return res


def _save(a: argparse.Namespace, res) -> None:
    """Write --save's graph file (its text from :func:`_planned`), whole or not at all."""
    if a.save:
        from gdnpass.outputs import write_atomic

        write_atomic(a.save, res.saved)


# ---------------------------------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------------------------------


def _progress(a: argparse.Namespace, label: str, unit: str = "nodes", scale: float = 1.0):
    """The progress callback of one long step (gdnpass.progress: a bar on a terminal, plain lines otherwise)."""
    from gdnpass.progress import step

    return step(label, unit, quiet=getattr(a, "quiet", False), scale=scale)


# seconds per Triton program under TRITON_INTERPRET=1: (fixed, per loop step), steps as kernels.backends.programs says
# (tokens for the convolutions and GDN, K blocks for the mat-vec and the GEMM). Measured on the project's 2-core CPU
# machine (shared, so on the slow side) from single launches of the tiny-* models and direct launches of
# silu/mul_mat_vec: silu ~20 ms a program, L2 ~25 ms, 4-tap conv ~60-95 ms at 8 tokens, GDN ~120-185 ms at 8 tokens,
# mat-vec ~22 ms at 1 K block and ~35 ms at 4.
# (a fused kernel's own entries are its record's, gdnpass.patterns.interpreter_s)
INTERPRETER_S = {"silu": (0.026, 0.0), "scale": (0.026, 0.0), "l2_norm": (0.032, 0.0), "rms_norm": (0.032, 0.0),
                 "ssm_conv": (0.026, 0.012), "gdn": (0.026, 0.020), "mat_vec": (0.024, 0.005),
                 # the elementwise and data-movement kernels (one program per 1024 elements; measured as silu's)
                 "sigmoid": (0.026, 0.0), "softplus": (0.026, 0.0), "exp": (0.026, 0.0), "add": (0.026, 0.0),
                 "mul": (0.026, 0.0), "swiglu": (0.045, 0.0), "concat": (0.036, 0.0), "cpy": (0.03, 0.0),
                 "get_rows": (0.032, 0.0), "rope": (0.05, 0.0), "set_rows": (0.03, 0.0),
                 # attention (steps: KV blocks; column blocks): tiny-qwen35's, 16 / 12.8 ms and 33 ms a program
                 "flash_attn": (0.021, 0.017), "soft_max": (0.035, 0.01),
                 # quantized weights: GET_ROWS of their rows (a program per 256 elements) and a product's
                 # pre-pass (a program per column and 8 groups), measured as add's; the expert
                 # FFN's: DIV and CLAMP as add, SUM_ROWS (steps: the row's elements), ARGSORT (steps: stages x 256
                 # keys; 6 stages of 32 keys took 0.038 s, 36 of 2048 keys 2.1 s, 2026-12-05, this 2-core machine)
                 "get_rows_q": (0.04, 0.0), "quantize_x": (0.026, 0.0), "div": (0.026, 0.0), "clamp": (0.026, 0.0),
                 "sum_rows": (0.026, 0.001), "argsort": (0.04, 0.008),
                 # the GEMM (over 16 columns; steps: K blocks): 14 ms at 1 step, 37 at 4, 106 at 16 (1024 rows x 32
                 # columns of bf16, 2026-12-06, this 2-core machine; before its terms pre-pass: a program per column
                 # and 1024 of K, estimated as add's)
                 "gemm": (0.010, 0.008), "gemm_terms": (0.026, 0.0)}
# (1.3x the single-launch figures: whole runs of tiny-dc4-h64 --layers 1 --fuse took 26-29 s, against 21 s summed)
SLOW_LIMIT_S = 60.0
# the graph the refusal suggests: ~18 s on the interpreter, under the limit checked too (unfused, then fused: twice
# that; tests/test_cli.py keeps this honest)
SMALL_GRAPH = ("--model", "tiny-dc4-h64", "--layers", "1")


def interpreter_seconds(nodes) -> float:
    """Estimated seconds of one execution of ``nodes`` on Triton's interpreter, from the programs each launch runs
    (:func:`gdnpass.kernels.backends.programs`; a kernel name ending in a number, ``chain4``, scales its per-step
    cost by that many taps / 4). Needs TRITON_INTERPRET set (it imports the kernels)."""
    from gdnpass.kernels.backends import programs

    table = interpreter_table()
    total = 0.0
    for n in nodes:
        for kernel, count, steps in programs(n):
            name = kernel.rstrip("0123456789")
            taps = int(kernel[len(name):] or 4)
            fixed, per_step = table[name]
            total += count * (fixed + per_step * steps * taps / 4)
    return total


def interpreter_table() -> dict[str, tuple[float, float]]:
    """:data:`INTERPRETER_S` and the registered fused kernels' own entries (their records')."""
    from gdnpass.patterns import interpreter_s

    return {**INTERPRETER_S, **interpreter_s()}


def _refuse_slow(a: argparse.Namespace, seconds: float, check: bool = False) -> None:
    if seconds <= SLOW_LIMIT_S or a.allow_slow:
        return
    from gdnpass.errors import ResourceError

    small = " ".join(SMALL_GRAPH)
    raise ResourceError("--backend triton on the CPU runs Triton's interpreter: this "
                        + ("check (the graph twice, unfused then fused)" if check else "graph")
                        + f" would take about {_duration(seconds)} (over {SLOW_LIMIT_S:.0f} s); pass --allow-slow to "
                        + f"run it anyway, or use a smaller graph ({small}), --backend torch, or --device cuda")


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def hints(nodes) -> int:
    """Allocator-hint nodes (keep-alive NONE nodes that ``prepare`` added) among ``nodes``."""
    from gdnpass.ir import Op

    return sum(1 for n in nodes if n.op is Op.NONE and n.op_params.get("hint"))


def _nodes_line(before, after) -> str:
    h = hints(before)
    return f"nodes {len(before)}" + (f" ({h} allocator hint{'s' if h != 1 else ''})" if h else "") + f" -> {len(after)}"


def _check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GdnpassError(f"--device {device}: not available on this machine (no CUDA GPU); use --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise GdnpassError(f"--device {device!r}: unknown device (expected cpu or cuda)")


def cmd_run(a: argparse.Namespace) -> int:
    _check_device(a.device)
    interpreted = a.device == "cpu" and a.backend == "triton"
    if interpreted:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' definition
    from gdnpass.models.fill import fill
    from gdnpass import prepasses
    from gdnpass.launches import launches, nodes_launches
    from gdnpass.runtime import Executor

    t0 = time.perf_counter()
    res = _planned(a, fuse_now=not a.check, fusion=True if a.check else None)
    t_build = time.perf_counter() - t0
    graph = res.graph
    if a.check:
        rc = _run_check(a, res, interpreted)
        _save(a, res)  # (a check that found a difference ran to the end: its graph is worth keeping)
        return rc
    if interpreted:
        _refuse_slow(a, interpreter_seconds(graph.nodes))

    report = res.report
    before = nodes_launches(res.before)
    model = _model(a)
    ex = Executor(graph, device=a.device, backend=a.backend,
                  extra={"loading a weight": model.load_extra_bytes(graph)} if model else None)
    t0 = time.perf_counter()
    with _progress(a, "fill", "GB", scale=1e-9) as p:
        fill(ex, seed=a.seed, progress=p)
    if model is not None:  # the model's own weights over the seeded fill
        model.load_weights(ex, graph)
    t_fill = time.perf_counter() - t0
    t0 = time.perf_counter()
    with _progress(a, "execute") as p:
        ex.run(progress=p)
        if ex.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
    t_exec = time.perf_counter() - t0

    counts = launches(graph)
    pre = prepasses.plan(graph)
    summary = {
        "source": res.source, "device": str(ex.device), "backend": _backend_name(a),
        "layers": graph.meta.get("layers"), "dflash_taps": graph.meta.get("dflash_taps"),
        "nodes": len(graph.nodes), "nodes_unfused": len(res.before), "allocator_hints": hints(res.before),
        "leafs": len(graph.leafs),
        "buffers": graph.buffers, "launches": sum(counts.values()), "launches_unfused": before,
        "launches_per_op": dict(sorted(counts.items())), "fusion": report.to_json(),
        "pre_passes": {"run": pre.pre_passes, "skipped": len(pre.shared), "made_by_producers": len(pre.producing),
                       "refused": [r.describe() for r in pre.refused]},
        "seconds": {"build_and_plan": round(t_build - report.seconds, 4), "fuse": round(report.seconds, 4),
                    "fill": round(t_fill, 4), "execute": round(t_exec, 4)},
    }
    _save(a, res)
    if a.json:
        print(json_text(summary, indent=2))
        return 0
    mib = 1 << 20
    print(f"gdnpass run: {res.source}; on {ex.device}, backend {summary['backend']}")
    print(f"  fusion: {report.summary()}")
    print(f"  {_nodes_line(res.before, graph.nodes)}, launches {before} -> {summary['launches']}, "
          f"leafs {len(graph.leafs)}")
    print("  buffers: " + ", ".join(f"{k} {v / mib:.2f} MiB" for k, v in graph.buffers.items()))
    print("  launches per op: " + ", ".join(f"{k} {v}" for k, v in summary["launches_per_op"].items()))
    if pre.pre_passes or pre.shared:
        print(f"  quantized products (Triton): {pre.summary()}" +
              "".join(f"\n    {r.describe()}" for r in pre.refused))
    s = summary["seconds"]
    print(f"  time: build+plan {s['build_and_plan'] * 1e3:.1f} ms, fuse {s['fuse'] * 1e3:.1f} ms, "
          f"fill {s['fill']:.2f} s, execute {s['execute']:.2f} s")
    return 0


def _backend_name(a: argparse.Namespace) -> str:
    name = a.backend or ("triton" if a.device.startswith("cuda") else "torch")
    if name == "triton" and a.device == "cpu":
        return "triton (Triton's interpreter, on the CPU)"
    return name


def _run_check(a: argparse.Namespace, res, interpreted: bool = False) -> int:
    """``run --check``: unfused then fused from identical inputs; exit 1 on any differing byte."""
    from gdnpass.check import check_fusion

    fused = sorted({n.op.value for n in res.graph.nodes if n.op.is_fused})
    if fused:
        raise GdnpassError(f"--check compares the unfused graph with its fusion, but {res.source} is already fused "
                           f"({', '.join(fused)}); save an unfused graph with 'gdnpass run --no-fuse --save FILE'")
    if interpreted:
        _refuse_slow(a, 2 * interpreter_seconds(res.graph.nodes), check=True)  # unfused, then fused (as slow)
    with _progress(a, "check") as p:
        model = _model(a)
        out = check_fusion(res.graph, device=a.device, backend=a.backend, seed=a.seed, between=a.between,
                           progress=p, weights=(lambda ex: model.load_weights(ex, res.graph)) if model else None,
                           extra={"loading a weight": model.load_extra_bytes(res.graph)} if model else None)
    if a.json:
        print(json_text(out.to_json(), indent=2))
    else:
        print(f"gdnpass run --check: {res.source}: {out.report.summary()}")
        for c in out.compared:
            if c.identical:
                print(f"  identical  {c.name} ({c.nbytes} bytes)")
            else:
                print(f"  DIFFERS    {c.name}: first differing byte {c.first_diff} "
                      f"(unfused {c.values[0]!r}, fused {c.values[1]!r})")
        n_bad = sum(not c.identical for c in out.compared)
        print(f"{len(out.compared) - n_bad} identical, {n_bad} differing")
    return 0 if out.identical else 1


# ---------------------------------------------------------------------------------------------------------------------
# dump
# ---------------------------------------------------------------------------------------------------------------------


DUMP_DESCRIPTION = "Print a graph node by node, with its memory, what fusion did to it and why."


def _add_dump_args(p: argparse.ArgumentParser) -> None:
    _add_graph_args(p)
    _add_pass_args(p)
    v = p.add_argument_group("what to show")
    v.add_argument("--format", default="text", choices=["text", "dot", "json"], help="output (default: text)")
    v.add_argument("--json", dest="format", action="store_const", const="json", help="the same as --format json")
    v.add_argument("--render", nargs=2, metavar=("FORMAT", "FILE"),
                   help="render the DOT graph to FILE with Graphviz's dot (FORMAT: svg or png)")
    v.add_argument("--explain", action="store_true",
                   help="every fusion candidate by layer: applied, or the rule that refused it and the byte ranges")
    v.add_argument("--diff", action="store_true", help="nodes before vs after fusion (- replaced, + fused)")
    v.add_argument("--layer", type=int, default=None, metavar="N", help="only layer N (nodes and candidates)")
    v.add_argument("--around", metavar="NODE", help="only the 8 nodes either side of NODE (index or name)")


def cmd_dump(a: argparse.Namespace) -> int:
    from gdnpass import dump

    shows = [f for f, on in (("--explain", a.explain), ("--diff", a.diff)) if on]
    if len(shows) > 1:
        raise GdnpassError("--explain and --diff are two views; pick one")
    if shows and (a.format != "text" or a.render):
        raise GdnpassError(f"{shows[0]} prints text; it cannot be combined with "
                           + ("--render" if a.render else f"--format {a.format}"))
    res = _planned(a)
    rc = dump.cmd_dump(a, res)
    h = hints(res.before)
    if h and a.format == "text" and not a.render:
        dump.emit(f"{_nodes_line(res.before, res.graph.nodes)}: the {h} allocator hint{'s' if h != 1 else ''} "
                  "(keep-alive NONE nodes from the pass's prepare) launch nothing\n")
    _save(a, res)
    return rc


# ---------------------------------------------------------------------------------------------------------------------
# llama.cpp: build it, capture its verify graph
# ---------------------------------------------------------------------------------------------------------------------

CAPTURE_DESCRIPTION = (
    "Run the pinned llama.cpp on a GGUF file: decode a prompt, then one verify ubatch of --tokens tokens with "
    "--rs-seq rollback planes, recording every node the scheduler computes (op, shape, strides, views, op params, "
    "buffer and byte offset), and write it as a gdnpass graph file. Then: gdnpass dump --graph FILE --fuse --explain.")


def _add_capture_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf", required=True, metavar="FILE", help="the model (arch qwen35)")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="write the verify graph here")
    p.add_argument("--reserve", metavar="FILE", help="also write the reserve graph (n_ubatch tokens, unplanned): the "
                   "graph gallocr planned the compute buffer for")
    g = p.add_argument_group("context settings (llama_context_params)")
    g.add_argument("--tokens", type=int, default=4, help="tokens in the verify ubatch (default: 4)")
    g.add_argument("--rs-seq", type=int, default=3, help="n_rs_seq, rollback snapshot planes (default: 3)")
    g.add_argument("--ubatch", type=int, default=512, help="n_ubatch; must exceed rs-seq + 1 (default: 512)")
    g.add_argument("--batch", type=int, default=None, help="n_batch (default: max(2048, n_ubatch))")
    g.add_argument("--ctx", type=int, default=256, help="n_ctx (default: 256; with --seqs S and no --kv-unified "
                   "llama.cpp gives each sequence's KV stream n_ctx / S cells, padded to 256)")
    g.add_argument("--seqs", type=int, default=1, help="sequences in the verify ubatch (n_seq_max): each prompt "
                   "decoded alone, then one batch of seqs x tokens that split_equal makes one ubatch (default: 1)")
    g.add_argument("--kv-unified", action="store_true", help="one KV stream for all sequences (kv_unified)")
    g.add_argument("--prompt", type=int, default=8, help="prompt tokens decoded before the verify (default: 8)")
    g.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"], help="default: auto")
    g.add_argument("--threads", type=int, default=2, help="default: 2")
    g.add_argument("--mtp", action="store_true",
                   help="capture the model's MTP head instead: an MTP context (LLAMA_CONTEXT_TYPE_MTP, ctx_other = the "
                        "target) decodes the verify tokens after the target, each with the target's hidden state of "
                        "the token before (docs/mtp.md); --rs-seq is the target's")
    g.add_argument("--mtp-outputs", default="all", choices=["all", "last", "none"],
                   help="with --mtp: the MTP ubatch's rows with logits (llama.cpp's draft step asks for its one token, "
                        "its process hook for none; default: all)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


# capture.Settings field -> the flag that sets it
CAPTURE_FLAGS = {"n_tokens": "--tokens", "n_rs_seq": "--rs-seq", "n_ubatch": "--ubatch", "n_batch": "--batch",
                 "n_ctx": "--ctx", "n_prompt": "--prompt", "flash_attn": "--flash-attn", "n_threads": "--threads",
                 "mtp": "--mtp", "mtp_outputs": "--mtp-outputs", "n_seqs": "--seqs", "kv_unified": "--kv-unified"}


def cmd_capture(a: argparse.Namespace) -> int:
    from gdnpass.frontends.llama import build, capture
    from gdnpass.models.gguf_model import open_model
    from gdnpass.outputs import check_writable, write_atomic
    from gdnpass.serialize import dumps

    settings = capture.Settings(n_tokens=a.tokens, n_rs_seq=a.rs_seq, n_ubatch=a.ubatch,
                                n_batch=a.batch or max(2048, a.ubatch), n_ctx=a.ctx, n_prompt=a.prompt,
                                flash_attn=a.flash_attn, n_threads=a.threads, mtp=a.mtp, mtp_outputs=a.mtp_outputs,
                                n_seqs=a.seqs, kv_unified=a.kv_unified)
    # everything a user can get wrong, before llama.cpp is built (a first build downloads and compiles for minutes)
    settings.check(lambda field: CAPTURE_FLAGS[field])
    shape = open_model(a.gguf).shape  # the header and every tensor, validated
    if a.mtp and shape.nextn_predict_layers != 1:
        raise GdnpassError(f"--mtp: {a.gguf} has {shape.nextn_predict_layers} MTP blocks (qwen35.nextn_predict_layers)"
                           "; llama.cpp's qwen35 MTP graph runs exactly one")
    if a.mtp_outputs != "all" and not a.mtp:
        raise GdnpassError(f"--mtp-outputs {a.mtp_outputs} does nothing without --mtp; drop the flag")
    if a.ctx > shape.context_length:
        raise GdnpassError(f"--ctx {a.ctx}: more than the model's context_length {shape.context_length} ({a.gguf})")
    outputs = [(a.output, "-o")] + ([(a.reserve, "--reserve")] if a.reserve else [])
    for path, flag in outputs:
        check_writable(path, flag)
    if a.reserve and os.path.abspath(a.reserve) == os.path.abspath(a.output):
        raise GdnpassError(f"--reserve {a.reserve} is -o's file too; give it another name")
    install = build.ensure(log=lambda line: print(f"gdnpass capture: {line}", file=sys.stderr))
    cap = capture.capture(a.gguf, settings, install=install)
    texts = [dumps(cap.verify)] + ([dumps(cap.reserve)] if a.reserve else [])  # (both made before either is written)
    for (path, _), text in zip(outputs, texts):
        write_atomic(path, text)
    summary = capture.summary(cap)
    if a.json:
        print(json_text(summary, indent=1))
    else:
        print(capture.summary_text(summary, a.output))
    return 0


def cmd_llama_build(a: argparse.Namespace) -> int:
    from gdnpass.errors import LlamaError
    from gdnpass.frontends.llama import build

    say = lambda line: print(f"gdnpass llama-build: {line}", file=sys.stderr)  # noqa: E731
    if a.pack:
        if a.cuda or a.source:
            raise LlamaError("llama-build: --pack writes sources and builds nothing; build them with "
                             "--source DIR (and --cuda) on the machine that builds")
        dest = build.pack(a.pack, sdist=a.sdist, log=say)
        print(f"llama.cpp {build.COMMIT[:12]} sources and bindings: {dest} (build there with "
              f"`gdnpass llama-build --source {dest}`)")
        return 0
    variant = "cuda" if a.cuda else "cpu"
    found = build.find(variant)
    inst = found or build.ensure(log=say, sdist=a.sdist, variant=variant, source=a.source)
    print(f"llama.cpp {inst.commit[:12]} ({build.PACKAGE}=={build.VERSION}, libllama + {build.SPECULATIVE_TOOL}, "
          f"{build.VARIANTS[variant].build_type}): {inst.root}"
          + (" (cached)" if found else f", built in {inst.build_s:.0f} s"))
    return 0


QUANTIZE_DESCRIPTION = (
    "Quantize a GGUF model file with the pinned llama.cpp's own quantizer (llama_model_quantize, default parameters: "
    "the mix llama-quantize makes), in a worker process, and print each tensor type's count and share of the bytes. "
    "gguf (Python) writes Q8_0 only; the K-quants come from here. Rows that are not a multiple of 256 fall back to "
    "Q5_0 / Q5_1 / Q8_0 (listed). The input must be unquantized (f32, f16 or bf16).")


def cmd_quantize(a: argparse.Namespace) -> int:
    from gdnpass.frontends.llama import quantize

    quantize.check_ftype(a.type)  # (before llama.cpp is built: a first build takes minutes)
    if a.threads < 1:
        raise GdnpassError(f"--threads {a.threads}: must be >= 1")
    res = quantize.quantize(a.input, a.output, a.type, threads=a.threads, force=a.force,
                            log=lambda line: print(f"gdnpass quantize: {line}", file=sys.stderr))
    if a.json:
        print(json_text({"input": str(res.src), "output": str(res.dst), "type": res.ftype,
                         "llama_ftype": res.ftype_value, "seconds": res.seconds, "bytes": res.nbytes,
                         "types": {k: {"tensors": n, "bytes": b} for k, (n, b) in res.types.items()},
                         "tensors": {t.name: t.type for t in res.tensors},
                         "fallbacks": [vars(f) for f in res.fallbacks]}, indent=1))
    else:
        print(quantize.summary_text(res))
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gdnpass", description=DESCRIPTION, epilog=EPILOG)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    r = sub.add_parser("run", help="build, plan, fuse and execute a GDN verify forward; print a summary",
                       description="Build, plan, fuse (when fusion is on) and execute a GDN verify forward.")
    _add_graph_args(r)
    _add_pass_args(r)
    x = r.add_argument_group("execution")
    x.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    x.add_argument("--backend", default=None, choices=["torch", "triton"],
                   help="kernel table (default: torch on cpu, triton on cuda; triton on cpu runs Triton's interpreter)")
    x.add_argument("--seed", type=int, default=0, help="seed of weights, caches and inputs (default: 0)")
    x.add_argument("--check", action="store_true",
                   help="run unfused and fused from identical inputs and compare the bytes (exit 1 on a difference)")
    x.add_argument("--allow-slow", action="store_true",
                   help="run even when Triton's interpreter (--backend triton on cpu) is estimated over a minute")
    r.add_argument("--json", action="store_true", help="print the summary as JSON")
    r.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    r.set_defaults(func=cmd_run)

    d = sub.add_parser("dump", help="print the graph, what fusion did and why (text, DOT or JSON)",
                       description=DUMP_DESCRIPTION)
    _add_dump_args(d)
    d.set_defaults(func=cmd_dump)

    c = sub.add_parser("capture", help="capture llama.cpp's own verify graph of a GGUF model as a graph file",
                       description=CAPTURE_DESCRIPTION)
    _add_capture_args(c)
    c.set_defaults(func=cmd_capture)

    b = sub.add_parser("llama-build", help="build the pinned llama.cpp (libllama, llama-speculative-simple) into the cache",
                       description="Download llama-cpp-python's sdist, build ggml + libllama of its vendored llama.cpp "
                                   "and its speculative loop llama-speculative-simple "
                                   "(-O0 for the CPU: about 4 min on 2 cores; --cuda: Release with ggml-cuda for "
                                   "sm_90) and cache it under ~/.cache/gdnpass ($GDNPASS_CACHE); a cached build "
                                   "returns at once. --pack writes the sources for a machine without registry access.")
    b.add_argument("--sdist", metavar="FILE", help="a local llama_cpp_python-0.3.36.tar.gz instead of downloading")
    b.add_argument("--cuda", action="store_true", help="the CUDA variant: Release, ggml-cuda for sm_90, FA kernels off")
    b.add_argument("--source", metavar="DIR", help="build from a folder --pack wrote (default: $GDNPASS_LLAMA_SRC, "
                                                   "else the sdist)")
    b.add_argument("--pack", metavar="DIR", help="write the sources a build needs (~21 MB) and the bindings into "
                                                 "DIR, and build nothing")
    b.set_defaults(func=cmd_llama_build)

    from gdnpass.frontends.llama.quantize import FTYPES  # (no llama.cpp, no torch at import)

    q = sub.add_parser("quantize", help="quantize a GGUF model with llama.cpp's own quantizer (Q8_0, the K-quants)",
                       description=QUANTIZE_DESCRIPTION)
    q.add_argument("input", metavar="IN.gguf", help="the model to quantize (f32 / f16 / bf16 weights)")
    q.add_argument("output", metavar="OUT.gguf", help="the quantized model (written whole, or not at all)")
    q.add_argument("--type", required=True, metavar="TYPE",
                   help=f"the llama.cpp mix: {', '.join(FTYPES)} (llama-quantize's Q8_0, Q4_K_M, ...)")
    q.add_argument("--force", action="store_true", help="replace OUT.gguf if it exists")
    q.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1),
                   help="quantizer threads (default: %(default)s)")
    q.add_argument("--json", action="store_true", help="print the result as JSON (every tensor's type)")
    q.set_defaults(func=cmd_quantize)

    from gdnpass.generate_cli import add_parser as add_generate  # (no torch at import: --help stays instant)

    add_generate(sub)
    return p


def _main(parser: argparse.ArgumentParser, argv: Sequence[str] | None, prog: str) -> int:
    a = parser.parse_args(argv)
    if getattr(a, "func", None) is None:
        parser.print_help()
        return 0
    try:
        return a.func(a)
    except GdnpassError as e:
        print(_one_line(f"{prog}: error: {e}"), file=sys.stderr)
        return 2
    except BrokenPipeError:  # `gdnpass ... | head`: the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush stays quiet
        return 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        print(_one_line(f"{prog}: error: {e.filename or ''}: {e.strerror or e}"), file=sys.stderr)
        return 2


def _one_line(msg: str) -> str:
    """An error as one line, whatever it quotes (a file name with a newline in it, say)."""
    return msg.replace("\r", "\\r").replace("\n", "\\n")


def main(argv: Sequence[str] | None = None) -> int:
    return _main(make_parser(), argv, "gdnpass")


def dump_main(argv: Sequence[str] | None = None) -> int:
    """The ``gdnpass-dump`` entry point (the same as ``gdnpass dump``)."""
    p = argparse.ArgumentParser(prog="gdnpass-dump", description=DUMP_DESCRIPTION)
    _add_dump_args(p)
    p.set_defaults(func=cmd_dump)
    return _main(p, argv, "gdnpass-dump")


if __name__ == "__main__":
    sys.exit(main())
