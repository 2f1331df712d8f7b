"""Build the GDN verify graph with ggml, import it, plan it, fuse it, run it with gdnpass and compare with ggml.

    python examples/ggml_roundtrip.py                        # tiny-dc4-h32, 8 tokens, 7 rollback planes, 2 layers
    python examples/ggml_roundtrip.py --model tiny-dc4-h128 --tokens 4 --rs-seq 3 --seqs 2 --referee
    python examples/ggml_roundtrip.py --layout dedup-t           # the time-major shared-window snapshot layout

Needs ggml-python (pip install 'ggml-python==0.0.45'). Steps:

1. ggml builds the graph (gdnpass's one builder, gdnpass.models.builder, through the ggml facade
   gdnpass.frontends.ggml.GgmlFacade), gallocr plans it on the CPU buffer type, and from_ggml imports it;
2. the import is compared with the same builder's graph through gdnpass.ops (gdnpass.models.build_verify_graph:
   node order, wiring, use counts), and gdnpass.alloc.plan at ggml's alignment with gallocr's offsets;
3. both sides get the same weights, caches and inputs; ggml computes on the CPU; gdnpass's Executor runs the import
   unfused, then fused (gdnpass.fusion.fuse), from the same bytes; outputs and caches are compared with ggml's.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from gdnpass.alloc import plan
from gdnpass.frontends import ggml as fg
from gdnpass.fusion import fuse
from gdnpass.ir import Flag
from gdnpass.models import SNAPSHOT_LAYOUTS, VerifyConfig, build_verify_graph
from gdnpass.models.fill import fill
from gdnpass.runtime import Executor


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    a, b = a.float(), b.float()
    if torch.equal(a, b):
        return "bit-identical"
    return f"max |diff| {float((a - b).abs().max()):.3g} (max |value| {float(b.abs().max()):.3g})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-dc4-h32")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--rs-seq", type=int, default=7)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seqs", type=int, default=1)
    p.add_argument("--no-ffn", action="store_true", help="build only the GDN sub-layers")
    p.add_argument("--layout", default="rows", choices=SNAPSHOT_LAYOUTS, help="conv snapshot layout (default: rows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--referee", action="store_true", help="also check every node against the torch reference")
    a = p.parse_args(argv)

    cfg = VerifyConfig(model=a.model, n_tokens=a.tokens, n_rs_seq=a.rs_seq, n_layers=a.layers, n_seqs=a.seqs,
                       ffn=not a.no_ffn, snapshot_layout=a.layout, wtype="f32")  # f32: with f16/bf16 weights ggml rounds activations too
    print(f"ggml {fg.version()}: {cfg.model}, {len(cfg.layer_ids())} GDN layers, n_t={cfg.n_tokens}, "
          f"n_rs_seq={cfg.n_rs_seq}, seqs={cfg.n_seqs}, snapshot layout {cfg.snapshot_layout}")

    # 1. build with ggml, let gallocr plan it, import
    t0 = time.perf_counter()
    session, _ = fg.build_ggml_verify_graph(cfg)
    with session as s:
        s.allocate()
        imp = s.import_graph(meta=fg.verify_meta(cfg))
        graph = imp.graph
        print(f"  built + allocated + imported in {1e3 * (time.perf_counter() - t0):.1f} ms: "
              f"{len(graph.nodes)} nodes, {len(graph.leafs)} leafs, gallocr arena {imp.arena_size} bytes "
              f"(alignment {s.alignment})")

        # 2. the referee on structure and memory
        ours = build_verify_graph(cfg)
        diffs = fg.diff_graphs(ours, graph)
        print(f"  vs gdnpass.models.build_verify_graph: {'identical node order, wiring, params and leafs' if not diffs else diffs}")
        counts, mine = fg.ggml_use_counts(s.gf, imp), ours.use_counts()
        same_counts = [counts.get(t.uid, 0) for t in [*graph.leafs, *graph.nodes]] == \
            [mine.get(t.uid, 0) for t in [*ours.leafs, *ours.nodes]]
        print(f"  use counts (ggml's cgraph->use_counts vs ours): {'equal' if same_counts else 'DIFFER'}")
        plan(graph, s.alignment)
        bad = [(n.name, n.offset, o) for n, o in zip(graph.nodes, imp.arena_offsets) if o is not None and n.offset != o]
        n_alloc = sum(o is not None for o in imp.arena_offsets)
        print(f"  gdnpass.alloc.plan vs gallocr: {n_alloc - len(bad)}/{n_alloc} node offsets equal, "
              f"arena {graph.buffers['arena']} vs {imp.arena_size} bytes"
              + (f"; first mismatch {bad[0]}" if bad else ""))

        # 3. same data on both sides
        ex = Executor(graph)
        fill(ex, seed=a.seed)
        fg.push_leafs(ex, imp, s)
        start = ex.snapshot()
        if a.referee:
            checks = s.referee(imp)
            worst: dict[str, list] = {}
            for c in checks:
                w = worst.setdefault(c.op, [0, 0, 0.0])
                w[0] += 1
                w[1] += c.exact
                w[2] = max(w[2], c.max_abs)
            print("  torch reference on ggml's inputs, node by node:")
            for op, (n, exact, mx) in sorted(worst.items()):
                print(f"    {op:16s} {n:4d} nodes, {exact:4d} bit-identical, max |diff| {mx:.3g}")
            for t in graph.leafs:  # the node-by-node run changed the caches: start again from the same bytes
                if t.buffer == "cache":
                    s.write(imp.ptr(t), ex.read(t))
        s.compute()
        ex.run()
        outputs = [n for n in graph.nodes if n.flags & Flag.OUTPUT]
        caches = [t for t in graph.leafs if t.buffer == "cache"]
        print("  gdnpass (unfused) vs ggml:")
        for t in outputs + caches:
            print(f"    {t.name:24s} {_diff(ex.read(t), s.read(imp.ptr(t)))}")

        # 4. fuse the import (decided on our plan, which is gallocr's) and run it from the same bytes
        report = fuse(graph, enabled=True)
        print(f"  fusion: {report.summary()}  (nodes {report.nodes_before} -> {report.nodes_after})")
        for ap in report.applied:
            print(f"    applied {ap.pattern} at layer {ap.layer}: {ap.node!r} replaces {len(ap.replaced)} nodes")
        for r in report.refused:
            print(f"    refused {r.describe()}")
        fused = Executor(graph)
        fused.restore(start)
        fused.run()
        print("  gdnpass (fused) vs ggml / vs gdnpass unfused:")
        worst = 0.0
        for t in outputs + caches:
            got = fused.read(t)
            worst = max(worst, float((got.float() - s.read(imp.ptr(t)).float()).abs().max()))
            print(f"    {t.name:24s} {_diff(got, s.read(imp.ptr(t)))} / {_diff(got, ex.read(t))}")
    ok = not diffs and same_counts and not bad and worst < 1e-4
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
