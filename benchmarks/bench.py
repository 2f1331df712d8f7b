"""GPU benchmarks of the fusion pass (issue 6), in one run, printing a short table per section.

    python benchmarks/bench.py [--quick] [--json OUT.json]

1. per-node GPU time of the unfused chain vs the fused node (qwen3.5-9b shapes), (T, rows) in (1,1) (4,4) (8,8) (16,16)
2. alpha/beta pair vs two single mat-vecs, 1-16 columns, f32 and bf16 weights (9-16: the scope question)
3. a whole verify forward of the 24 GDN layers as one CUDA graph: kernels and GPU time, fusion off vs on (ABBA)
4. references: an empty Triton kernel, device copy bandwidth, the fused kernel's bytes over that bandwidth
5. the Python cost of the pass (match + rewrite) on the 24-layer graph, on the CPU

Method (device README's METHOD.md): warm up, then time CUDA-graph replays of back-to-back launches with CUDA events;
medians over repeats; variants compared in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")

from gdnpass import pipeline  # noqa: E402
from gdnpass.fusion import fuse  # noqa: E402
from gdnpass.pipeline import PassOptions  # noqa: E402
from gdnpass.ir import Op, runs_kernel  # noqa: E402
from gdnpass.models import VerifyConfig, default_ids  # noqa: E402
from gdnpass.runtime import Executor, launches  # noqa: E402

REPS_IN_GRAPH = 20


def graph_time_us(fn, reps_in_graph=REPS_IN_GRAPH, replays=30) -> float:
    """Median GPU time of one ``fn()`` call: a CUDA graph of ``reps_in_graph`` calls, replayed, timed with events."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()  # warm up (compiles Triton kernels outside the capture)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps_in_graph):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps_in_graph)
    return statistics.median(times)


def node_runner(ex: Executor, n):
    fn = ex.kernels[n.op]
    srcs = [ex.view(s) if s is not None else None for s in [*n.src, *n.outs]]
    out = ex.view(n)
    return lambda: fn(n, srcs, out)


def label(n) -> str:
    return f"UNARY({n.op_params['kind']})" if n.op is Op.UNARY else n.op.value


def chain_operands(T: int, rows: int, seed: int = 0) -> dict:
    """The fused chain's operands at qwen3.5-9b size (C 8192, S 128, 16 k heads, d_conv 4), laid out as llama.cpp
    does: the destination rows are cells 0, 2, 4, .. of a cache of 2*rows cells, the gathered row is cell 1; x is
    the projection transposed. ``args`` are gdn_conv_chain's positional arguments."""
    C, S, H_k, dc = 8192, 128, 16, 4
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.randn(1, 1, 2 * rows, (dc - 1) * C, device="cuda", generator=g)
    ids = torch.tensor([1], dtype=torch.int32, device="cuda")
    x = torch.randn(1, 1, T, C, device="cuda", generator=g).transpose(2, 3)  # (1,1,C,T), strides (.., .., 1, C)
    w = torch.randn(1, 1, C, dc, device="cuda", generator=g)
    dst = [cache[:, :, 2 * r:2 * r + 1] for r in range(rows)]
    cols = [max(0, T - s) for s in range(rows - 1, -1, -1)]
    out = torch.empty(1, 1, T, C, device="cuda")
    q, k = torch.empty(1, T, H_k, S, device="cuda"), torch.empty(1, T, H_k, S, device="cuda")
    return dict(cache=cache, out=out, q=q, k=k, args=(cache, ids, x, w, dst, cols, 1e-6, out, q, k))


# ---- 1. chain kernels, unfused vs fused ----------------------------------------------------------------------------


def chain_nodes(g, il):
    """The nodes of layer il's conv chain (GET_ROWS .. L2_NORM(k)), plus its alpha/beta MUL_MATs and the GDN."""
    pos = {n.name: i for i, n in enumerate(g.nodes)}
    start, end = pos[f"conv_states-{il}"], pos[f"k_conv_predelta-{il}"]
    chain = [n for n in g.nodes[start:end + 1] if runs_kernel(n) and (n.layer == il)
             and not n.name.startswith(("cache_s", "ssm_state", f"blk.{il}.attn_qkv", "blk.*.attn_qkv"))
             and not (n.op is Op.MUL_MAT)]
    ab = [n for n in g.nodes if n.op is Op.MUL_MAT and n.layer == il and ("ssm_alpha" in n.src[0].name or "ssm_beta" in n.src[0].name)]
    gdn = [n for n in g.nodes if n.op is Op.GATED_DELTA_NET and n.layer == il]
    return chain, ab, gdn


def bench_chain(T: int, rows: int) -> dict:
    cfg = VerifyConfig("qwen3.5-9b", T, rows - 1, n_layers=1, share_weights=True)
    g = pipeline.run(cfg, PassOptions(fusion=True), fuse_now=False).graph
    ex = Executor(g, device="cuda")
    ex.fill(seed=1, ids=default_ids(cfg))
    il = cfg.layer_ids()[0]
    chain, ab, gdn = chain_nodes(g, il)
    unfused = [(f"{label(n)} {n.name}", graph_time_us(node_runner(ex, n))) for n in chain]
    ab_unfused = [(f"MUL_MAT {n.src[0].name.split('.')[-2]}", graph_time_us(node_runner(ex, n))) for n in ab]
    gdn_t = graph_time_us(node_runner(ex, gdn[0]))
    fuse(g, enabled=True)
    fused_node = next(n for n in g.nodes if n.op is Op.GDN_CONV_CHAIN)
    pair_node = next((n for n in g.nodes if n.op is Op.MUL_MAT_VEC_PAIR and "ssm_alpha" in n.op_params["replaced"][0]),
                     None)  # none above 8 columns
    fused_t = graph_time_us(node_runner(ex, fused_node))
    pair_t = graph_time_us(node_runner(ex, pair_node)) if pair_node is not None else float("nan")
    C, dc, S, Hk = 8192, 4, 128, 16
    bytes_moved = 4 * ((dc - 1) * C + C * T + dc * C + C * T + 2 * S * Hk * T + rows * (dc - 1) * C)
    return dict(T=T, rows=rows, unfused=unfused, unfused_total=sum(t for _, t in unfused), fused=fused_t,
                l2_separate=bool(fused_node.op_params.get("l2_separate")), ab_unfused=ab_unfused,
                ab_unfused_total=sum(t for _, t in ab_unfused), pair=pair_t, gdn=gdn_t, fused_bytes=bytes_moved,
                unfused_launches=len(chain))


# ---- 2. the mat-vec pair ---------------------------------------------------------------------------------------------


def bench_pair(cols: list[int]) -> list[dict]:
    from gdnpass.kernels import triton_ops as tri

    E, M = 4096, 32
    out = []
    for wt in (torch.float32, torch.bfloat16):
        wa = (torch.randn(1, 1, M, E, device="cuda") / 64).to(wt)
        wb = (torch.randn(1, 1, M, E, device="cuda") / 64).to(wt)
        for n in cols:
            x = torch.randn(1, 1, n, E, device="cuda")
            ya, yb = torch.empty(1, 1, n, M, device="cuda"), torch.empty(1, 1, n, M, device="cuda")
            two = graph_time_us(lambda: (tri.mul_mat_vec(wa, x, ya), tri.mul_mat_vec(wb, x, yb)))
            pair = graph_time_us(lambda: tri.mul_mat_vec_pair(wa, wb, x, ya, yb))
            wa32, wb32 = wa[0, 0].float(), wb[0, 0].float()
            cublas = graph_time_us(lambda: (torch.matmul(x[0, 0], wa32.t(), out=ya[0, 0]),
                                            torch.matmul(x[0, 0], wb32.t(), out=yb[0, 0])))
            out.append(dict(wtype=str(wt).split(".")[-1], cols=n, two=two, pair=pair, ratio=pair / two,
                            cublas_two=cublas))
    return out


# ---- 3. whole verify forward ---------------------------------------------------------------------------------------


def forward_executor(cfg: VerifyConfig, fused: bool):
    res = pipeline.run(cfg, PassOptions(fusion=fused))
    g, report = res.graph, res.report
    ex = Executor(g, device="cuda")
    ex.fill(seed=2, ids=default_ids(cfg))
    return g, ex, report


def count_kernels(ex: Executor) -> int:
    from torch.profiler import ProfilerActivity, profile

    ex.run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ex.run()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def bench_forward(T: int, rows: int, rounds: int) -> dict:
    cfg = VerifyConfig("qwen3.5-9b", T, rows - 1, share_weights=True, dflash=True)
    res = {}
    runs = {}
    for name, fused in (("off", False), ("on", True)):
        g, ex, report = forward_executor(cfg, fused)
        kernels = count_kernels(ex)
        ex.capture()
        runs[name] = ex
        res[name] = dict(nodes=len(g.nodes), launches=sum(launches(g).values()), kernels=kernels,
                         fusion=report.summary() if fused else "off")
    times = {"off": [], "on": []}

    def replay_ms(ex):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        ex.run()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    for r in range(rounds):
        for name in ("off", "on", "on", "off"):  # ABBA
            times[name].append(statistics.median(replay_ms(runs[name]) for _ in range(10)))
    for name in times:
        res[name]["us_per_forward"] = statistics.median(times[name]) * 1e3
    res["T"], res["rows"] = T, rows
    return res


# ---- 4. references ---------------------------------------------------------------------------------------------------


def empty_kernel_us() -> float:
    """An empty Triton kernel's time in the CUDA-graph method: the floor of any launch."""
    import triton

    @triton.jit
    def _empty(x_ptr):
        pass

    x = torch.empty(1, device="cuda")
    return graph_time_us(lambda: _empty[(1,)](x))


def bench_references() -> dict:
    empty = empty_kernel_us()
    n = 1 << 28  # 1 GiB of f32
    a, b = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    copy_us = graph_time_us(lambda: b.copy_(a), reps_in_graph=5, replays=10)
    bw = 2 * 4 * n / (copy_us * 1e-6) / 1e9  # GB/s, read + write
    return dict(empty_triton_us=empty, copy_GBps=bw)


# ---- 5. the pass on the CPU -------------------------------------------------------------------------------------------


def bench_pass(n=10) -> dict:
    times = []
    for _ in range(n):
        cfg = VerifyConfig("qwen3.5-9b", 8, 7, dflash=True)
        g = pipeline.run(cfg, PassOptions(fusion=True), fuse_now=False).graph
        t0 = time.perf_counter()
        fuse(g, enabled=True)
        times.append((time.perf_counter() - t0) * 1e3)
    return dict(median_ms=statistics.median(times), min_ms=min(times), nodes=len(g.nodes))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer points and rounds")
    p.add_argument("--json", help="write all numbers to this file")
    a = p.parse_args()
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    out["triton"] = triton.__version__
    print(f"# {out['gpu']}, torch {out['torch']}, triton {out['triton']}", flush=True)

    out["references"] = ref = bench_references()
    print(f"\n## references\nempty Triton kernel {ref['empty_triton_us']:.2f} us; device copy {ref['copy_GBps']:.0f} GB/s")

    out["chain"] = []
    print("\n## conv chain, qwen3.5-9b (C 8192, d_conv 4), per-node GPU time (us)")
    print("T  rows | unfused kernels (sum, n nodes) | fused node | l2_separate | bytes/bw floor | alpha+beta -> pair | GDN")
    for T, rows in ((1, 1), (4, 4), (8, 8), (16, 16)):
        r = bench_chain(T, rows)
        out["chain"].append(r)
        floor = r["fused_bytes"] / (ref["copy_GBps"] * 1e3)
        print(f"{T:2d} {rows:4d} | {r['unfused_total']:8.2f} ({r['unfused_launches']:2d}) | {r['fused']:8.2f} | "
              f"{str(r['l2_separate']):5s} | {floor:6.2f} | {r['ab_unfused_total']:6.2f} -> {r['pair']:6.2f} | "
              f"{r['gdn']:7.2f}", flush=True)
        for name, t in r["unfused"]:
            print(f"        {t:7.2f}  {name}")

    cols = [1, 2, 4, 8] if a.quick else list(range(1, 17))
    out["pair"] = pr = bench_pair(cols)
    print("\n## alpha/beta mat-vec pair (E 4096, M 32): two launches vs one, us (cuBLAS pair for reference)")
    print("wtype cols | two | pair | pair/two | cuBLAS x2")
    for r in pr:
        print(f"{r['wtype']:8s} {r['cols']:2d} | {r['two']:6.2f} | {r['pair']:6.2f} | {r['ratio']:.2f} | {r['cublas_two']:6.2f}")

    out["forward"] = []
    print("\n## verify forward, 24 GDN layers (+FFN), DFlash taps, one CUDA graph, fusion off vs on (ABBA medians)")
    print("T rows | kernels off -> on (per layer) | GPU us off -> on")
    for T, rows in ((4, 4), (8, 8)):
        r = bench_forward(T, rows, rounds=2 if a.quick else 5)
        out["forward"].append(r)
        d = (r["off"]["kernels"] - r["on"]["kernels"]) / 24
        print(f"{T} {rows} | {r['off']['kernels']} -> {r['on']['kernels']} ({d:.1f} fewer/layer) | "
              f"{r['off']['us_per_forward']:.1f} -> {r['on']['us_per_forward']:.1f}", flush=True)

    out["pass"] = ps = bench_pass()
    print(f"\n## the pass on the CPU: fuse() on the 24-layer graph ({ps['nodes']} nodes after): "
          f"median {ps['median_ms']:.2f} ms, min {ps['min_ms']:.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
