"""GPU benchmarks of the kernels and the pass, in one run, each table with its targets and met/missed per row.

    python benchmarks/bench.py [--quick] [--json OUT.json]

1. references: device copy bandwidth (1 GiB, read + write) and an empty Triton kernel
2. per op of the unfused conv chain (qwen3.5-9b, upstream's q/k form) next to upstream ggml-cuda's kernels (T 4, 8)
3. thin MUL_MAT: every qwen3.5-9b weight shape, f32 and bf16, 1-16 columns, against the copy bandwidth
4. the fused chain against one copy kernel moving its bytes, T 1/4/8/16, both q/k forms, and the floor its data
   dependencies set (a copy after a dependent load, with a block norm)
5. the dedup snapshot layouts against the rows layout (fused node), and the copy ratio their bytes allow
6. the alpha/beta pair vs two single mat-vecs
7. the 24-layer verify forward: kernels and kernel time per forward (and the products alone), fusion off vs on;
   GPU time of the captured CUDA graph (ABBA medians)
8. the Python cost of the pass on the CPU

Method: per-kernel durations from torch.profiler (the seed's and upstream's method: no launch gaps), medians over
repeats, variants in the same process; the forward's wall time also as CUDA-graph replays timed with CUDA events.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")

from gdnpass import pipeline  # noqa: E402
from gdnpass.fusion import fuse  # noqa: E402
from gdnpass.pipeline import PassOptions  # noqa: E402
from gdnpass.ir import Op, op_label, runs_kernel  # noqa: E402
from gdnpass.models import VerifyConfig, default_ids  # noqa: E402
from gdnpass.models.fill import fill  # noqa: E402
from gdnpass.runtime import Executor, launches, node_launches  # noqa: E402

sys.path.insert(0, "benchmarks")
import upstream  # noqa: E402  (benchmarks/upstream.py: llama.cpp's own verify, and the chain table both use)

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


def kernel_us(fn, reps: int = 20) -> tuple[float, list[float]]:
    """Profiler kernel durations of one ``fn()`` call, captured as a CUDA graph and replayed (so host-side checks,
    e.g. GET_ROWS's id check, which is skipped under capture, launch nothing): (median over ``reps`` replays of the
    summed kernel time, the median duration of each of its kernels in launch order), in µs."""
    from torch.profiler import ProfilerActivity, profile

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()  # warm up: compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    ks = [e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per = len(ks) // reps
    if per == 0 or len(ks) % reps:
        raise RuntimeError(f"{len(ks)} kernels over {reps} replays: not one fixed launch sequence")
    calls = [ks[i * per:(i + 1) * per] for i in range(reps)]
    return statistics.median(sum(c) for c in calls), [statistics.median(c[j] for c in calls) for j in range(per)]


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


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


# ---- upstream ggml-cuda on this H200 (2026-12-01, ncu kernel durations; ../shared/reference/llama-cpp.md) ---------

UPSTREAM = {  # per GDN layer, µs, at T = 4 and T = 8 (CPY: the fastest of its per-row copies)
    4: {"GET_ROWS": 3.10, "CONCAT": 7.74, "CPY": 3.07, "SSM_CONV+SILU": 3.49, "q norm": 2.91, "k norm": 2.75,
        "alpha+beta": 27.4, "chain": 32.7},
    8: {"GET_ROWS": 3.42, "CONCAT": 7.74, "CPY": 3.01, "SSM_CONV+SILU": 3.46, "q norm": 2.85, "k norm": 2.88,
        "alpha+beta": 29.3, "chain": 46.8},
}


# ---- the chain's kernels, unfused and fused --------------------------------------------------------------------------


def chain_nodes(g, il):
    """The nodes of layer il's conv chain (GET_ROWS .. the k normalisation), plus its alpha/beta MUL_MATs and the
    GDN."""
    pos = {n.name: i for i, n in enumerate(g.nodes)}
    start, end = pos[f"conv_states-{il}"], pos[f"k_conv_predelta-{il}"]
    chain = [n for n in g.nodes[start:end + 1] if runs_kernel(n) and (n.layer == il)
             and not n.name.startswith(("cache_s", "ssm_state", f"blk.{il}.attn_qkv", "blk.*.attn_qkv"))
             and not (n.op is Op.MUL_MAT)]
    ab = [n for n in g.nodes if n.op is Op.MUL_MAT and n.layer == il and ("ssm_alpha" in n.src[0].name or "ssm_beta" in n.src[0].name)]
    gdn = [n for n in g.nodes if n.op is Op.GATED_DELTA_NET and n.layer == il]
    return chain, ab, gdn


def chain_bytes(T: int, rows: int, tile: dict | None = None) -> int:
    """Bytes the fused chain must move at qwen3.5-9b size: the gathered state, the projection, the taps, the SiLU
    output, the q/k outputs and the snapshot rows; with the node's ``tile`` (a dedup layout's shared row), the
    tile's windows stored as its columns once."""
    C, dc, S, Hk = 8192, 4, 128, 16
    per_window = rows - len(tile["windows"]) if tile else rows  # rows stored window by window, dc-1 columns each
    snapshot_cols = per_window * (dc - 1) + (tile["n_cols"] if tile else 0)
    return 4 * ((dc - 1) * C + C * T + dc * C + C * T + 2 * S * Hk * T + snapshot_cols * C)


def bench_chain(T: int, rows: int, qk_norm: str = "rms") -> dict:
    cfg = VerifyConfig("qwen3.5-9b", T, rows - 1, n_layers=1, share_weights=True, qk_norm=qk_norm)
    g = pipeline.run(cfg, PassOptions(fusion=True), fuse_now=False).graph
    ex = Executor(g, device="cuda")
    fill(ex, seed=1, ids=default_ids(cfg))
    ex.run()  # the chain's inputs as a forward leaves them: fill leaves intermediates NaN (slow division paths)
    il = cfg.layer_ids()[0]
    chain, ab, gdn = chain_nodes(g, il)
    unfused = [(label(n), n.name, kernel_us(node_runner(ex, n))[0]) for n in chain]
    ab_unfused = sum(kernel_us(node_runner(ex, n))[0] for n in ab)
    gdn_t = kernel_us(node_runner(ex, gdn[0]))[0]
    fuse(g, enabled=True)
    fused_node = next(n for n in g.nodes if n.op is Op.GDN_CONV_CHAIN)
    pair_node = next(n for n in g.nodes if n.op is Op.MUL_MAT_VEC_PAIR and "ssm_alpha" in n.op_params["replaced"][0])
    return dict(T=T, rows=rows, qk_norm=qk_norm, unfused=unfused, unfused_total=sum(t for *_, t in unfused),
                fused=kernel_us(node_runner(ex, fused_node))[0], l2_separate=bool(fused_node.op_params.get("l2_separate")),
                ab_unfused=ab_unfused, pair=kernel_us(node_runner(ex, pair_node))[0], gdn=gdn_t,
                fused_bytes=chain_bytes(T, rows), unfused_launches=len(chain))


def per_op(r: dict) -> dict[str, float]:
    """The unfused chain's kernels grouped as upstream's table: SSM_CONV with its SILU, each q/k norm with its SCALE,
    CPY the slowest of the snapshot copies."""
    ops = r["unfused"]
    norms = [t for lab, _, t in ops if lab in ("RMS_NORM", "SCALE", "L2_NORM")]
    half = len(norms) // 2
    return {"GET_ROWS": sum(t for lab, _, t in ops if lab == "GET_ROWS"),
            "CONCAT": sum(t for lab, _, t in ops if lab == "CONCAT"),
            "CPY": max((t for lab, _, t in ops if lab == "CPY"), default=float("nan")),
            "SSM_CONV+SILU": sum(t for lab, _, t in ops if lab in ("SSM_CONV", "UNARY(SILU)")),
            "q norm": sum(norms[:half]), "k norm": sum(norms[half:]),
            "alpha+beta": r["ab_unfused"], "chain": r["unfused_total"]}


# ---- thin MUL_MAT -------------------------------------------------------------------------------------------------

# qwen3.5-9b's product shapes (rows M, inner K): GDN qkv, z/ssm_out/attention output, alpha/beta, attention K/V,
# attention Q with its gate, FFN gate/up, FFN down, lm head
MAT_SHAPES = {"qkv, attn q+gate": (8192, 4096), "z, ssm_out, attn o": (4096, 4096), "attn k, v": (1024, 4096),
              "ffn gate, up": (12288, 4096), "ffn down": (4096, 12288), "lm head": (248320, 4096),
              "alpha, beta": (32, 4096)}


def rotation(nbytes: int) -> int:
    """How many copies of a weight of ``nbytes`` one timing cycles through, so that every launch reads its weight
    from memory as in a forward (which reads each of its ~16 GB of weights once): together at least twice the L2
    (H200: 50 MB), at most 256 copies. Timing one weight over and over would read one of 8-32 MB from L2."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return min(256, max(1, -(-2 * l2 // nbytes)))


def bench_mat_vec(cols: list[int], ref: dict) -> list[dict]:
    from gdnpass.kernels import triton_matvec as mv

    out = []
    for wt in (torch.float32, torch.bfloat16):
        for name, (M, K) in MAT_SHAPES.items():
            w = (torch.randn(1, 1, M, K, device="cuda") / 64).to(wt)
            ws = [w] + [w.clone() for _ in range(rotation(w.numel() * w.element_size()) - 1)]
            for n in cols:
                x = torch.randn(1, 1, n, K, device="cuda")
                y = torch.empty(1, 1, n, M, device="cuda")
                # the median launch over the copies (each read from memory)
                us = statistics.median(kernel_us(lambda ws=ws: [mv.mul_mat_vec(v, x, y) for v in ws], reps=10)[1])
                nbytes = w.numel() * w.element_size() + x.numel() * 4 + y.numel() * 4
                gbps = nbytes / (us * 1e3)
                big = w.numel() * w.element_size() >= 8 << 20
                target = nbytes / (0.8 * ref["copy_GBps"] * 1e3) if big else \
                    1.2 * (ref["empty_us"] + nbytes / (ref["copy_GBps"] * 1e3))
                out.append(dict(wtype=str(wt).split(".")[-1], name=name, M=M, K=K, cols=n, us=us, GBps=gbps,
                                target_us=target, met=us <= target, tile=mv.mat_vec_tile(M, n, K, mv.WTYPES[w.dtype])))
            del w, ws
    return out


# ---- the dedup layouts ------------------------------------------------------------------------------------------------


def bench_dedup(cases) -> list[dict]:
    from tune_dedup import fused_chain  # (tune_dedup imports this module)

    out = []
    for T, n_rs in cases:
        r = dict(T=T, planes=n_rs + 1)
        for layout in ("rows", "dedup", "dedup-t"):
            ex, n = fused_chain("qwen3.5-9b", T, n_rs, layout)
            r[layout] = kernel_us(node_runner(ex, n))[0]
            r[f"{layout} bytes"] = chain_bytes(T, n_rs + 1, n.op_params.get("tile"))
            del ex
        # the floor the bytes set: a copy of the fewest bytes a layout moves over a copy of the rows layout's
        r["copy ratio"] = copy_us(min(r["dedup bytes"], r["dedup-t bytes"])) / copy_us(r["rows bytes"])
        out.append(r)
    return out


# ---- the mat-vec pair ---------------------------------------------------------------------------------------------


def bench_pair(cols: list[int]) -> list[dict]:
    from gdnpass.kernels import triton_matvec as mv

    E, M = 4096, 32
    out = []
    for wt in (torch.float32, torch.bfloat16):
        wa = (torch.randn(1, 1, M, E, device="cuda") / 64).to(wt)
        wb = (torch.randn(1, 1, M, E, device="cuda") / 64).to(wt)
        for n in cols:
            x = torch.randn(1, 1, n, E, device="cuda")
            ya, yb = torch.empty(1, 1, n, M, device="cuda"), torch.empty(1, 1, n, M, device="cuda")
            two = kernel_us(lambda: (mv.mul_mat_vec(wa, x, ya), mv.mul_mat_vec(wb, x, yb)))[0]
            pair = kernel_us(lambda: mv.mul_mat_vec_pair(wa, wb, x, ya, yb))[0]
            out.append(dict(wtype=str(wt).split(".")[-1], cols=n, two=two, pair=pair, ratio=pair / two))
    return out


# ---- whole verify forward ---------------------------------------------------------------------------------------


def forward_executor(cfg: VerifyConfig, fused: bool):
    res = pipeline.run(cfg, PassOptions(fusion=fused))
    g, report = res.graph, res.report
    ex = Executor(g, device="cuda")
    fill(ex, seed=2, ids=default_ids(cfg))
    return g, ex, report


def product_kind(n) -> str | None:
    """'alpha/beta' or 'ffn' for the products the forward table reports alone."""
    names = [n.src[0].name, n.src[2].name] if n.op is Op.MUL_MAT_VEC_PAIR else \
        [n.src[0].name] if n.op is Op.MUL_MAT else []  # (a pair's sources: w_a, x, w_b, out_b)
    if any("ssm_alpha" in m or "ssm_beta" in m for m in names):
        return "alpha/beta"
    if any(".ffn_" in m for m in names):
        return "ffn"
    return None


def forward_kernels(g, ex: Executor) -> dict:
    """Kernels per forward and their summed duration, the same for the alpha/beta and FFN products, and the
    per-GDN-layer chain table (upstream.chain_table, the classification upstream's kernels get): the profiled
    kernels are the nodes' launches in order (runtime.launches), so each duration has its node."""
    total, ks = kernel_us(ex.run, reps=3)
    nodes = [n for n in g.nodes for _ in range(node_launches(n))]
    if len(nodes) != len(ks):  # a node on a torch composite launches more than one kernel: count them
        nodes = measured_launches(g, ex)
    res = dict(kernels=len(ks), kernel_us=total)
    if len(nodes) == len(ks):
        for kind in ("alpha/beta", "ffn"):
            d = [t for n, t in zip(nodes, ks) if product_kind(n) == kind]
            res[kind] = dict(kernels=len(d), kernel_us=sum(d))
        res["chain"] = upstream.chain_table([(node_class(n), t) for n, t in zip(nodes, ks)])
        res["by_op"] = upstream.kernel_totals(list(zip(nodes, ks)), group=kernel_group)
    return res


def kernel_group(n) -> str:
    """A kernel's group in the by-op line: its op as reports name it, a product with its weights' names, the layer
    cut ("MUL_MAT ffn_down", "MUL_MAT_VEC_PAIR ssm_alpha+ssm_beta")."""
    if n.op not in (Op.MUL_MAT, Op.MUL_MAT_VEC_PAIR):
        return op_label(n)
    ws = [n.src[0], n.src[2]] if n.op is Op.MUL_MAT_VEC_PAIR else [n.src[0]]  # (a pair's: w_a, x, w_b, out_b)
    # "blk.3.ffn_down.weight" -> "ffn_down", "output.weight" (the lm head) -> "output"
    return f"{n.op.value} " + "+".join(w.base.name.removesuffix(".weight").split(".")[-1] for w in ws)


def measured_launches(g, ex: Executor) -> list:
    """The nodes' launches in order as the profiler counts them: each node run alone (as a CUDA graph), once per
    distinct (op, shapes, types, parameters); for forwards where runtime.node_launches is not exact."""
    counts: dict[str, int] = {}
    out = []
    for n in g.nodes:
        if not runs_kernel(n):
            continue
        key = repr((n.op, n.ne, n.type, sorted(n.op_params.items(), key=str),
                    [(s.ne, s.type, s.nb) if s is not None else None for s in n.src]))
        if key not in counts:
            counts[key] = len(kernel_us(node_runner(ex, n), reps=1)[1])
        out += [n] * counts[key]
    return out


_NODE_CLASSES = {Op.GDN_CONV_CHAIN: "FUSED", Op.MUL_MAT_VEC_PAIR: "PAIR", Op.GATED_DELTA_NET: "GDN"}


def node_class(n) -> str:
    """A node's class for upstream.chain_table (its op, with the fused ops and SILU named as there)."""
    if n.op is Op.UNARY and n.op_params.get("kind") == "SILU":
        return "SILU"
    return _NODE_CLASSES.get(n.op, n.op.name)


def weight_bytes_read(g) -> int:
    """Bytes of the weights one forward reads: every weights-buffer leaf whole, but the rows GET_ROWS gathers of a
    leaf only GET_ROWS reads (the token embedding)."""
    readers: dict[int, list] = {}
    for n in g.nodes:
        for s in n.src:
            if s is not None and s.base.buffer == "weights":
                readers.setdefault(s.base.uid, []).append((n, s.base))
    total = 0
    for uses in readers.values():
        base = uses[0][1]
        if all(n.op is Op.GET_ROWS for n, _ in uses):
            total += sum(n.ne[1] * n.ne[2] * n.ne[3] for n, _ in uses) * base.nb[1]
        else:
            total += base.nbytes
    return total


def bench_forward(T: int, rows: int, rounds: int, whole: bool = False) -> dict:
    """The 24 GDN layers with their FFNs (one shared set of weights), or ``whole``: the whole 32-layer forward with
    its own bf16 weights (token embedding, attention layers, lm head), after upstream.py's prompt (n_past)."""
    cfg = VerifyConfig("qwen3.5-9b", T, rows - 1, share_weights=not whole, dflash=True, whole=whole,
                       n_past=upstream.N_PROMPT if whole else 0)
    res = {}
    runs = {}
    for name, fused in (("off", False), ("on", True)):
        g, ex, report = forward_executor(cfg, fused)
        res[name] = dict(nodes=len(g.nodes), launches=sum(launches(g).values()), **forward_kernels(g, ex),
                         fusion=report.summary() if fused else "off", weight_bytes=weight_bytes_read(g))
        ex.capture()
        runs[name] = ex
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
    res["T"], res["rows"], res["gdn_layers"] = T, rows, len(cfg.shape.gdn_layers)
    return res


# ---- references ---------------------------------------------------------------------------------------------------


def bench_references() -> dict:
    @triton.jit
    def _empty(x_ptr):
        pass

    x = torch.empty(1, device="cuda")
    empty = kernel_us(lambda: _empty[(1,)](x))[0]
    n = 1 << 28  # 1 GiB of f32
    a, b = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    copy_us = kernel_us(lambda: b.copy_(a), reps=10)[0]
    return dict(empty_us=empty, copy_GBps=2 * 4 * n / (copy_us * 1e3))


def copy_us(nbytes: int) -> float:
    """One device copy kernel moving ``nbytes`` (read + written)."""
    a = torch.randn(max(1, nbytes // 8), device="cuda")
    b = torch.empty_like(a)
    return kernel_us(lambda: b.copy_(a))[0]


@triton.jit
def _floor_copy_kernel(src_ptr, dst_ptr, off_ptr, n, BLOCK: tl.constexpr, GATHER: tl.constexpr, NORM: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    base = tl.multiple_of(tl.load(off_ptr), 16) if GATHER else 0  # (so the loads stay 16-byte vectors)
    x = tl.load(src_ptr + base + i, mask=i < n, other=0.0)
    if NORM:
        x = x * tl.math.rsqrt(tl.sum(x * x) + 1e-6)
    tl.store(dst_ptr + i, x, mask=i < n)


FLOOR_BLOCK = 1024  # elements per program of the floor kernels (4 warps: two 16-byte vectors per thread)


def floor_copy(src: torch.Tensor, dst: torch.Tensor, off: torch.Tensor, gather: bool, norm: bool) -> None:
    """dst = src[o : o + len(dst)] (f32, flat), o = ``off`` (an int64 tensor of a multiple of 16) when ``gather``,
    else 0; with ``norm``, each block of FLOOR_BLOCK elements scaled by 1 / sqrt(its Σx² + 1e-6). The kernels of
    :func:`gather_copy_us`."""
    grid = (triton.cdiv(dst.numel(), FLOOR_BLOCK),)
    _floor_copy_kernel[grid](src, dst, off, dst.numel(), BLOCK=FLOOR_BLOCK, GATHER=gather, NORM=norm, num_warps=4)


def gather_copy_us(nbytes: int) -> tuple[float, float, float]:
    """The floor the fused chain's two dependencies set, us: a Triton copy of ``nbytes``; the same copy with its
    source offset read from device memory first (the chain reads the cache cell id before the gathered row); and
    that, with each program's block scaled by its root sum of squares before the store (the chain's q/k norm needs
    a head's SiLU outputs from all its threads)."""
    a = torch.randn(max(1, nbytes // 8), device="cuda")
    b, off = torch.empty_like(a), torch.zeros(1, dtype=torch.int64, device="cuda")  # (offset 0: the same bytes)
    return tuple(kernel_us(lambda v=v: floor_copy(a, b, off, *v))[0]
                 for v in ((False, False), (True, False), (True, True)))


# ---- the pass on the CPU -------------------------------------------------------------------------------------------


def bench_pass(n=10) -> dict:
    times = []
    for _ in range(n):
        cfg = VerifyConfig("qwen3.5-9b", 8, 7, dflash=True)
        g = pipeline.run(cfg, PassOptions(fusion=True), fuse_now=False).graph
        t0 = time.perf_counter()
        fuse(g, enabled=True)
        times.append((time.perf_counter() - t0) * 1e3)
    return dict(median_ms=statistics.median(times), min_ms=min(times), nodes=len(g.nodes))


def print_chain(title: str, tables: dict) -> None:
    """The per-GDN-layer chain table (upstream.chain_table) of several runs side by side: us (kernels) per row."""
    tables = {k: v for k, v in tables.items() if v and v.get("layers")}
    if not tables:
        print(f"\n(no chain table for {title}: kernels and nodes did not line up)")
        return
    print(f"\n### per-GDN-layer chain, {title}: median kernel us (kernels) over "
          + ", ".join(f"{k} {v['layers']}" for k, v in tables.items()) + " GDN layers")
    print("kernel | " + " | ".join(tables))
    for row in (*upstream.CHAIN_ROWS, "chain total"):
        cells = [tables[k][row] for k in tables]
        if any(c["kernels"] for c in cells):
            print(f"{row:50s} | " + " | ".join(f"{c['us']:6.2f} ({c['kernels']:g})" if c["kernels"] else "-"
                                                for c in cells))


def print_versus(whole: list | None, up: dict, ref: dict) -> None:
    """Issue 18's targets: ours (fusion on) against the weights' bytes over the copy bandwidth and against
    upstream's kernel time; kernels per GDN layer off -> on."""
    if not whole:
        print("\n(run with the whole section too for ours vs upstream)")
        return
    print("\n## whole qwen3.5-9b verify: ours (fusion off / on) vs upstream llama.cpp, same GPU, same run")
    print("T rows | kernels ours off / on / upstream | kernel us ours off / on / upstream | ours on / upstream "
          "(target <= 0.8) | GPU us ours on (CUDA graph) / floor = weight bytes / copy BW (target <= 1.3) | "
          "upstream wall us per decode | fewer kernels per GDN layer (target >= 5)")
    for r in whole:
        u = next((c for c in up["cases"] if (c["T"], c["rows"]) == (r["T"], r["rows"])), None)
        if u is None or "kernel_us" not in u:
            continue
        off, on = r["off"], r["on"]
        floor = on["weight_bytes"] / (ref["copy_GBps"] * 1e3)
        ratio, bw = on["kernel_us"] / u["kernel_us"], on["us_per_forward"] / floor
        fewer = (off["kernels"] - on["kernels"]) / r["gdn_layers"]
        print(f"{r['T']} {r['rows']} | {off['kernels']} / {on['kernels']} / {u['kernels']} | "
              f"{off['kernel_us']:.0f} / {on['kernel_us']:.0f} / {u['kernel_us']:.0f} | {ratio:.2f} "
              f"{verdict(ratio <= 0.8)} | {on['us_per_forward']:.0f} / {floor:.0f} = {bw:.2f} {verdict(bw <= 1.3)} | "
              f"{u['wall_us']:.0f} | {fewer:.1f} {verdict(fewer >= 5)}")
        print_chain(f"T={r['T']} rows={r['rows']}, ours vs upstream",
                    {"ours off": off.get("chain"), "ours on": on.get("chain"), "upstream": u.get("chain")})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer points and rounds")
    p.add_argument("--json", help="write all numbers to this file")
    p.add_argument("--only", help="comma-separated sections: ops,matvec,chain,dedup,pair,forward,whole,upstream,pass "
                                  "(upstream: llama.cpp built with CUDA and timed on the same GPU, next to whole)")
    p.add_argument("--source", help="upstream: a folder `gdnpass llama-build --pack` wrote (machines without a "
                                    "registry)")
    p.add_argument("--gguf", help="upstream: the model file (default: written once, see benchmarks/upstream.py)")
    a = p.parse_args()
    only = set(a.only.split(",")) if a.only else None
    want = (lambda s: only is None or s in only)
    prepared = None
    if want("upstream"):  # llama.cpp's CUDA build and the GGUF file take minutes of CPU: made while the GPU works
        from concurrent.futures import ThreadPoolExecutor

        def prepare():
            os.nice(10)  # (Linux: this thread, and the compilers and writer threads it starts, yield to the timing)
            return upstream.prepare("qwen3.5-9b", a.source, a.gguf, lambda line: print(line, file=sys.stderr,
                                                                                         flush=True))
        prepared = ThreadPoolExecutor(1).submit(prepare)
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    out["triton"] = triton.__version__
    print(f"# {out['gpu']}, torch {out['torch']}, triton {out['triton']}; profiler kernel durations, us", flush=True)

    out["references"] = ref = bench_references()
    print(f"\n## references\nempty Triton kernel {ref['empty_us']:.2f} us; device copy {ref['copy_GBps']:.0f} GB/s "
          f"(1 GiB, read + write)", flush=True)

    if want("ops"):
        out["ops"] = []
        print("\n## per op of the unfused chain (qwen3.5-9b, RMS_NORM+SCALE q/k) vs upstream ggml-cuda (ncu)")
        print("op | T=4 ours / upstream | T=8 ours / upstream")
        rs = {T: bench_chain(T, T, "rms") for T in (4, 8)}
        grouped = {T: per_op(r) for T, r in rs.items()}
        for op in UPSTREAM[4]:
            cells = []
            for T in (4, 8):
                ours, up = (grouped[T][op], UPSTREAM[T][op]) if op != "alpha+beta" else (rs[T]["pair"], UPSTREAM[T][op])
                cells.append(f"{ours:6.2f} / {up:5.2f} {verdict(ours <= up)}")
                out["ops"].append(dict(op=op, T=T, ours=ours, upstream=up, met=ours <= up))
            name = op if op != "alpha+beta" else "alpha+beta (ours: the pair)"
            print(f"{name:28s} | " + " | ".join(cells), flush=True)

    if want("matvec"):
        cols = [1, 4, 8, 16] if a.quick else list(range(1, 17))
        out["matvec"] = mv = bench_mat_vec(cols, ref)
        print("\n## thin MUL_MAT (Triton mat-vec): bytes / kernel time; target >= 80% of copy bandwidth for weights of "
              ">= 8 MB, else <= 1.2 x (empty + bytes / bandwidth)")
        print("wtype shape (rows x K) cols | us | GB/s | % of copy | target us | tile")
        for r in mv:
            print(f"{r['wtype']:8s} {r['name']:20s} {r['M']:6d}x{r['K']:<5d} {r['cols']:2d} | {r['us']:8.2f} | "
                  f"{r['GBps']:5.0f} | {r['GBps'] / ref['copy_GBps']:4.0%} | {r['target_us']:8.2f} {verdict(r['met'])} | "
                  f"{tuple(r['tile'])}", flush=True)

    if want("chain"):
        out["chain"] = []
        print("\n## fused chain vs one copy kernel moving its bytes (target <= 1.2 x the copy); the floor its "
              "dependencies set (gather_copy_us): a Triton copy of those bytes, the same after one dependent load, "
              "and that with a norm per block")
        print("q/k T rows | unfused (n kernels) | fused | copy of its bytes | fused/copy | Triton copy | after a load "
              "| and a norm | floor / copy | l2_separate")
        floors = {}
        for qk in ("rms", "l2"):
            for T in (1, 4, 8, 16):
                r = bench_chain(T, T, qk)
                c = copy_us(r["fused_bytes"])
                if T not in floors:
                    floors[T] = gather_copy_us(r["fused_bytes"])
                r["copy_us"], (r["triton_copy_us"], r["gather_copy_us"], r["gather_norm_us"]) = c, floors[T]
                out["chain"].append(r)
                print(f"{qk:3s} {T:2d} {T:4d} | {r['unfused_total']:7.2f} ({r['unfused_launches']:2d}) | {r['fused']:6.2f} | "
                      f"{c:6.2f} | {r['fused'] / c:4.2f} {verdict(r['fused'] <= 1.2 * c)} | "
                      + " | ".join(f"{v:6.2f}" for v in floors[T]) + f" | {floors[T][2] / c:4.2f} | {r['l2_separate']}",
                      flush=True)

    if want("dedup"):
        out["dedup"] = dd = bench_dedup([(1, 0), (4, 3), (8, 7), (16, 15)])
        print("\n## snapshot layouts, fused node (target: faster of dedup / dedup-t <= 0.85 x rows, T 4, 8, 16)")
        print("T rows | rows | dedup | dedup-t | best/rows | bytes rows -> fewest | copy of the fewest / copy of rows")
        for r in dd:
            best = min(r["dedup"], r["dedup-t"]) / r["rows"]
            v = verdict(best <= 0.85) if r["T"] > 1 else "(reported)"
            fewest = min(r["dedup bytes"], r["dedup-t bytes"])
            print(f"{r['T']:2d} {r['planes']:4d} | {r['rows']:6.2f} | {r['dedup']:6.2f} | {r['dedup-t']:6.2f} | "
                  f"{best:4.2f} {v} | {r['rows bytes']} -> {fewest} | {r['copy ratio']:4.2f}", flush=True)

    if want("pair"):
        cols = [1, 2, 4, 8, 16] if a.quick else list(range(1, 17))
        out["pair"] = pr = bench_pair(cols)
        print("\n## alpha/beta mat-vec pair (E 4096, M 32): two launches vs one")
        print("wtype cols | two | pair | pair/two")
        for r in pr:
            print(f"{r['wtype']:8s} {r['cols']:2d} | {r['two']:6.2f} | {r['pair']:6.2f} | {r['ratio']:.2f}")

    for section, whole in (("forward", False), ("whole", True)):
        if not want(section):
            continue
        out[section] = []
        print("\n## verify forward, " + ("whole qwen3.5-9b (32 layers, own bf16 weights, lm head)" if whole else
                                         "24 GDN layers (+FFN, shared weights)") + ", DFlash taps, fusion off vs on")
        print("T rows | kernels off -> on (per GDN layer) | kernel us off -> on | alpha/beta us off -> on | "
              "FFN products us off -> on | CUDA-graph GPU us off -> on (ABBA)")
        for T, rows in upstream.CASES:
            r = bench_forward(T, rows, rounds=2 if a.quick else 5, whole=whole)
            out[section].append(r)
            off, on = r["off"], r["on"]
            d = (off["kernels"] - on["kernels"]) / r["gdn_layers"]

            def pick(k, f):
                return f"{off[k][f]:.1f} -> {on[k][f]:.1f}" if k in off and k in on else "n/a"
            print(f"{T} {rows} | {off['kernels']} -> {on['kernels']} ({d:.1f} fewer) | "
                  f"{off['kernel_us']:.1f} -> {on['kernel_us']:.1f} | {pick('alpha/beta', 'kernel_us')} "
                  f"({pick('alpha/beta', 'kernels')} kernels) | {pick('ffn', 'kernel_us')} | "
                  f"{off['us_per_forward']:.1f} -> {on['us_per_forward']:.1f}", flush=True)
        for r in out[section]:
            print_chain(f"{section}, T={r['T']} rows={r['rows']}", {"off": r["off"].get("chain"),
                                                                    "on": r["on"].get("chain")})
            for name in ("off", "on"):
                if "by_op" in r[name]:
                    print(f"\nT={r['T']} fusion {name}: kernels by op (count, us): " +
                          "; ".join(f"{g['kernel']} {g['count']} {g['us']:.0f}" for g in r[name]["by_op"][:24]))

    if prepared is not None:
        install, gguf = prepared.result()
        torch.cuda.empty_cache()  # (llama.cpp runs in its own process: leave it the GPU memory)
        out["upstream"] = up = upstream.measure(install, gguf, "qwen3.5-9b",
                                                lambda line: print(line, file=sys.stderr, flush=True))
        upstream.print_tables(up)
        print_versus(out.get("whole"), up, out["references"])

    if want("pass"):
        out["pass"] = ps = bench_pass()
        print(f"\n## the pass on the CPU: fuse() on the 24-layer graph ({ps['nodes']} nodes after): "
              f"median {ps['median_ms']:.2f} ms, min {ps['min_ms']:.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
