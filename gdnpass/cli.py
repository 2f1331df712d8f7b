"""The ``gdnpass`` command: ``run`` (build, plan, execute a verify forward) and friends.

Every error a user can cause (unknown model, bad flag value, unreadable file) ends as one line on stderr and exit
code 2; a traceback means a bug in gdnpass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Sequence

from gdnpass.ir import GraphError


def _add_graph_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("graph")
    g.add_argument("--model", default="qwen3.5-9b", help="shape preset (default: %(default)s)")
    g.add_argument("--tokens", type=int, default=8, help="tokens per sequence in the verify ubatch (default: 8)")
    g.add_argument("--rs-seq", type=int, default=7, help="rollback snapshot planes n_rs_seq (default: 7)")
    g.add_argument("--layers", type=int, default=None,
                   help="GDN layers to build (default: 4, or all if the preset has fewer; 0 = all of the preset's, "
                        "e.g. 24 for qwen3.5-9b, which needs ~3.5 GiB of bf16 weights)")
    g.add_argument("--seqs", type=int, default=1, help="sequences in the ubatch (default: 1)")
    g.add_argument("--dflash", action="store_true", help="flag DFlash hidden-state taps OUTPUT (changes the plan)")
    g.add_argument("--wtype", default="bf16", choices=["f32", "f16", "bf16"],
                   help="type of the large projection weights (default: bf16)")
    g.add_argument("--ab-wtype", default="f32", choices=["f32", "f16", "bf16"],
                   help="type of the alpha/beta weights (default: f32)")
    g.add_argument("--alignment", type=int, default=128, help="arena alignment in bytes (default: 128, as CUDA)")
    g.add_argument("--snapshot-layout", default="rows", choices=["rows", "dedup", "dedup-t"],
                   help="conv snapshot planes 1..n_rs_seq: one cache row each, or windows of one shared row per cell, "
                        "channel-major or time-major (default: rows; see models.SNAPSHOT_LAYOUTS)")


def _config(a: argparse.Namespace):
    from gdnpass.models import VerifyConfig, get_model

    layers = a.layers
    if layers is None:
        layers = min(4, len(get_model(a.model).gdn_layers))
    return VerifyConfig(model=a.model, n_tokens=a.tokens, n_rs_seq=a.rs_seq, n_layers=layers or None, n_seqs=a.seqs,
                        dflash=a.dflash, wtype=a.wtype, ab_wtype=a.ab_wtype, snapshot_layout=a.snapshot_layout)


def build_planned(a: argparse.Namespace, fusion: bool | None = None):
    """Build, run the pre-plan fusion step if fusion is on (``None``: GDN_FUSION decides), plan."""
    from gdnpass.fusion import prepare_and_plan
    from gdnpass.models import build_verify_graph

    return prepare_and_plan(build_verify_graph(_config(a)), fusion, a.alignment)


def _progress(label: str):
    """A throttled progress line on stderr for long runs (only when stderr is a terminal)."""
    if not sys.stderr.isatty():
        return None
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.perf_counter()
        if done == total or now - last[0] > 0.25:
            last[0] = now
            end = "\n" if done == total else ""
            print(f"\r{label}: {done}/{total} nodes", end=end, file=sys.stderr, flush=True)

    return report


def _check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GraphError(f"device {device!r} is not available on this machine (no CUDA GPU); use --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise GraphError(f"unknown device {device!r} (expected cpu or cuda)")


def cmd_run(a: argparse.Namespace) -> int:
    from gdnpass.fusion import fuse
    from gdnpass.runtime import Executor, launches

    _check_device(a.device)
    if a.device == "cpu" and a.backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' definition
    t0 = time.perf_counter()
    graph = build_planned(a, fusion=True if a.check else None)
    t_build = time.perf_counter() - t0
    if a.check:
        return _run_check(a, graph)

    nodes_unfused, launches_unfused = len(graph.nodes), sum(launches(graph).values())
    report = fuse(graph, between=a.between)  # GDN_FUSION decides
    ex = Executor(graph, device=a.device, backend=a.backend)
    t0 = time.perf_counter()
    ex.fill(seed=a.seed)
    t_fill = time.perf_counter() - t0
    t0 = time.perf_counter()
    ex.run(progress=_progress("execute"))
    if ex.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    t_exec = time.perf_counter() - t0

    counts = launches(graph)
    summary = {
        "model": a.model, "tokens": a.tokens, "rs_seq": a.rs_seq, "seqs": a.seqs,
        "layers": len(graph.meta["layers"]), "dflash_taps": graph.meta["dflash_taps"], "device": str(ex.device),
        "nodes": len(graph.nodes), "nodes_unfused": nodes_unfused, "leafs": len(graph.leafs),
        "buffers": graph.buffers, "launches": sum(counts.values()), "launches_unfused": launches_unfused,
        "launches_per_op": dict(sorted(counts.items())), "fusion": report.to_json(),
        "seconds": {"build_and_plan": round(t_build, 4), "fuse": round(report.seconds, 4), "fill": round(t_fill, 4),
                    "execute": round(t_exec, 4)},
    }
    if a.json:
        print(json.dumps(summary, indent=2))
        return 0
    mib = 1 << 20
    print(f"gdnpass run: {a.model}, {summary['layers']} GDN layers, n_t={a.tokens}, n_rs_seq={a.rs_seq}, "
          f"seqs={a.seqs}{', dflash taps ' + str(summary['dflash_taps']) if a.dflash else ''} on {ex.device}")
    print(f"  fusion: {report.summary()}")
    print(f"  nodes {nodes_unfused} -> {len(graph.nodes)}, launches {launches_unfused} -> {summary['launches']}, "
          f"leafs {len(graph.leafs)}")
    print("  buffers: " + ", ".join(f"{k} {v / mib:.2f} MiB" for k, v in graph.buffers.items()))
    print("  launches per op: " + ", ".join(f"{k} {v}" for k, v in summary["launches_per_op"].items()))
    s = summary["seconds"]
    print(f"  time: build+plan {s['build_and_plan'] * 1e3:.1f} ms, fuse {s['fuse'] * 1e3:.1f} ms, "
          f"fill {s['fill']:.2f} s, execute {s['execute']:.2f} s")
    return 0


def _run_check(a: argparse.Namespace, graph) -> int:
    """``run --check``: unfused then fused from identical inputs; exit 1 on any differing byte."""
    from gdnpass.check import check_fusion

    res = check_fusion(graph, device=a.device, backend=a.backend, seed=a.seed, between=a.between,
                       progress=_progress("check"))
    if a.json:
        print(json.dumps(res.to_json(), indent=2))
    else:
        print(f"gdnpass run --check: {a.model}, n_t={a.tokens}, n_rs_seq={a.rs_seq}: {res.report.summary()}")
        for c in res.compared:
            if c.identical:
                print(f"  identical  {c.name} ({c.nbytes} bytes)")
            else:
                print(f"  DIFFERS    {c.name}: first differing byte {c.first_diff} "
                      f"(unfused {c.values[0]!r}, fused {c.values[1]!r})")
        n_bad = sum(not c.identical for c in res.compared)
        print(f"{len(res.compared) - n_bad} identical, {n_bad} differing")
    return 0 if res.identical else 1


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gdnpass", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="build, plan and execute a GDN verify forward; print a summary")
    _add_graph_args(r)
    r.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    r.add_argument("--backend", default=None, choices=["torch", "triton"],
                   help="kernel table (default: torch on cpu, triton on cuda)")
    r.add_argument("--seed", type=int, default=0, help="seed of weights, caches and inputs (default: 0)")
    r.add_argument("--json", action="store_true", help="print the summary as JSON")
    r.add_argument("--check", action="store_true",
                   help="run unfused and fused from identical inputs and compare the bytes (exit 1 on a difference)")
    r.add_argument("--between", default="narrow", choices=["narrow", "broad"],
                   help="nodes-in-between check: the seed's narrow rules or the older broad one (default: narrow)")
    r.set_defaults(func=cmd_run)

    from gdnpass.dump import add_parser as add_dump_parser  # dump imports cli only inside functions: no cycle

    add_dump_parser(sub)
    return p


def dump_main(argv: Sequence[str] | None = None) -> int:
    """The ``gdnpass-dump`` entry point (the same as ``gdnpass dump``)."""
    from gdnpass.dump import main as dump

    return dump(argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    a = parser.parse_args(argv)
    try:
        return a.func(a)
    except GraphError as e:
        print(f"gdnpass: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `gdnpass ... | head`: the reader left, which is not an error
        sys.stdout = open(os.devnull, "w")
        return 0
    except OSError as e:
        print(f"gdnpass: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
