"""The conv chain at qwen3.5-9b size (C 8192, S 128, 16 k heads, d_conv 4): the fused chain's operands laid out as
llama.cpp lays them and the bytes it must move; one layer's unfused chain, kernel by kernel, next to upstream
ggml-cuda's (:data:`UPSTREAM`) and the fused node; the one-layer fused node in a snapshot layout
(:func:`fused_chain`) and the dedup layouts against the rows layout; and at batch (:func:`bench_dedup_seqs`,
benchmarks/tune_dedup.py's): S sequences x T tokens of any model, each layout's fused node and unfused chain checked
byte for byte, then timed, next to seed 003's per-token baseline (:func:`without_tile`) and figures
(:data:`SEED_003`)."""

from __future__ import annotations

import copy
import gc
from dataclasses import replace

import torch

from gdnpass import pipeline
from gdnpass.bench.floors import copy_us
from gdnpass.bench.timing import kernel_us, node_runner
from gdnpass.fusion import fuse
from gdnpass.errors import GraphError
from gdnpass.ir import Op, runs_kernel
from gdnpass.models import VerifyConfig, default_ids
from gdnpass.models.hparams import SNAPSHOT_LAYOUTS, ModelShape, get_model
from gdnpass.models.fill import fill
from gdnpass.patterns.conv_chain import ConvChain
from gdnpass.pipeline import PassOptions
from gdnpass.launches import node_launches
from gdnpass.runtime import Executor


def chain_operands(T: int, rows: int, seed: int = 0) -> dict:
    """The fused chain's operands at qwen3.5-9b size (C 8192, S 128, 16 k heads, d_conv 4), laid out as llama.cpp
    does: the destination rows are cells 0, 2, 4, .. of a cache of 2*rows cells, the gathered row is cell 1; x is
    the projection transposed. ``args`` are gdn_conv_chain's positional arguments."""
    C, S, H_k, dc = 8192, 128, 16, 4
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.randn(1, 1, 2 * rows, (dc - 1) * C, device="cuda", generator=g)
    ids = torch.tensor([1], dtype=torch.int32, device="cuda").view(1, 1, 1, 1)
    x = torch.randn(1, 1, T, C, device="cuda", generator=g).transpose(2, 3)  # (1,1,C,T), strides (.., .., 1, C)
    w = torch.randn(1, 1, C, dc, device="cuda", generator=g)
    dst = [cache[:, :, 2 * r:2 * r + 1] for r in range(rows)]
    cols = [max(0, T - s) for s in range(rows - 1, -1, -1)]
    out = torch.empty(1, 1, T, C, device="cuda")
    q, k = torch.empty(1, T, H_k, S, device="cuda"), torch.empty(1, T, H_k, S, device="cuda")
    return dict(cache=cache, out=out, q=q, k=k, args=(cache, ids, x, w, dst, cols, 1e-6, out, q, k))


def chain_bytes(T: int, rows: int, tile: dict | None = None, C: int = 8192, n_s: int = 1, H_k: int = 16,
                S: int = 128, dc: int = 4) -> int:
    """Bytes the fused chain must move (default: qwen3.5-9b's C, heads and d_conv, one sequence): the gathered
    state, the projection, the taps, the SiLU output, the q/k outputs and the snapshot rows of each of ``n_s``
    sequences (the taps once); with the node's ``tile`` (a dedup layout's shared row), the tile's windows stored as
    its columns once."""
    per_window = rows - len(tile["windows"]) if tile else rows  # rows stored window by window, dc-1 columns each
    snapshot_cols = per_window * (dc - 1) + (tile["n_cols"] if tile else 0)
    return 4 * (dc * C + n_s * ((dc - 1) * C + C * T + C * T + 2 * S * H_k * T + snapshot_cols * C))


def node_bytes(n, tile: dict | None = None) -> int:
    """:func:`chain_bytes` of GDN_CONV_CHAIN node ``n`` (its shape, sequences and heads), stored with ``tile``."""
    p = n.op_params
    return chain_bytes(p["n_tokens"], len(p["columns"]), tile, C=n.ne[0], n_s=n.ne[2], H_k=p["n_k_heads"],
                       S=p["head_dim"], dc=p["d_conv"])


# ---- upstream ggml-cuda on this H200 (2026-12-01, ncu kernel durations; ../shared/reference/llama-cpp.md) ---------

UPSTREAM = {  # per GDN layer, µs, at T = 4 and T = 8 (CPY: the fastest of its per-row copies)
    4: {"GET_ROWS": 3.10, "CONCAT": 7.74, "CPY": 3.07, "SSM_CONV+SILU": 3.49, "q norm": 2.91, "k norm": 2.75,
        "alpha+beta": 27.4, "chain": 32.7},
    8: {"GET_ROWS": 3.42, "CONCAT": 7.74, "CPY": 3.01, "SSM_CONV+SILU": 3.46, "q norm": 2.85, "k norm": 2.88,
        "alpha+beta": 29.3, "chain": 46.8},
}


# ---- the chain's kernels, unfused and fused --------------------------------------------------------------------------


def label(n) -> str:
    return f"UNARY({n.op_params['kind']})" if n.op is Op.UNARY else n.op.value


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


def bench_chain(T: int, rows: int, qk_norm: str = "rms") -> dict:
    """One qwen3.5-9b layer's chain, ``rows`` snapshot rows: each unfused kernel, the alpha/beta products, the GDN,
    then (fused) the fused chain and the pair; profiler us."""
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


# ---- the snapshot layouts ---------------------------------------------------------------------------------------------


def chain_layer(model, T: int, n_rs: int, layout: str, n_seqs: int = 1):
    """One layer of ``model`` (a preset's name or a ModelShape; no FFN, shared weights) verifying ``n_seqs``
    sequences of T tokens with ``n_rs`` rollback planes in snapshot ``layout``: planned unfused, filled, run once,
    then its chain fused (the chain pattern alone). Returns (its executor, with the Triton backend, on the GPU when
    there is one, else in the interpreter; the GDN_CONV_CHAIN node; the unfused chain's nodes that launch kernels, in
    order: they still run on the executor, made for the unfused plan, whose memory the fused node keeps). The forward
    ran first so that the chain is timed and checked on real intermediates (fill leaves them NaN, which takes SiLU's
    slow division path and compares equal too easily), on the torch references: its values need only be real, and
    the layer's other kernels then need no compile (on the GPU) and no interpreter (on the CPU). Each sequence
    gathers plane min(1, n_rs) of its own cell: an accepted-token offset."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = VerifyConfig(model, T, n_rs, n_layers=1, n_seqs=n_seqs, share_weights=True, ffn=False,
                       snapshot_layout=layout)
    g = pipeline.run(cfg, PassOptions(fusion=True), fuse_now=False).graph
    ex = Executor(g, device=device, backend="triton")
    fill(ex, seed=1, ids=default_ids(cfg, read_plane=min(1, n_rs)))
    Executor(g, device, backend="torch", buffers=ex.buffers).run()
    unfused = list(g.nodes)
    fuse(g, enabled=True, patterns=[ConvChain()])
    node = next(n for n in g.nodes if n.op is Op.GDN_CONV_CHAIN)
    replaced = set(node.op_params["replaced"])
    return ex, node, [n for n in unfused if n.name in replaced and runs_kernel(n)]


def fused_chain(model, T: int, n_rs: int, layout: str, n_seqs: int = 1):
    """:func:`chain_layer`'s executor and fused node."""
    ex, node, _ = chain_layer(model, T, n_rs, layout, n_seqs)
    return ex, node


def without_tile(n):
    """Fused chain node ``n`` with its dedup tile left out: the shared row's windows written window by window, d_conv
    - 1 element stores each (the kernel's per-window path; seed 003's kernel before its change)."""
    m = copy.copy(n)
    m.op_params = {k: v for k, v in n.op_params.items() if k != "tile"}
    return m


def norm_apart(n):
    """Fused chain node ``n`` with its q/k norms in launches of their own (``l2_separate``: the unfused norm kernels
    after the chain, over every row at once). At batch a head spans several programs (``triton_ssm.chain_block``)
    and the last of them to finish normalises the head for every sequence alone; this is the form without that
    tail, to time beside it (on 2026-12-06 the rows layout's fused node ran 1.2-1.6x slower than the unfused chain
    from 64 sequences)."""
    m = copy.copy(n)
    m.op_params = {**n.op_params, "l2_separate": True}
    return m


def nodes_runner(ex: Executor, nodes):
    """The kernels of ``nodes`` (of ``ex``'s graph), in order, as one call (the unfused chain)."""
    fns = [node_runner(ex, n) for n in nodes]
    return lambda: [fn() for fn in fns]


def chain_written(n) -> list:
    """What GDN_CONV_CHAIN node ``n`` writes (its SiLU output, q, k, the snapshot destinations) and the whole
    tensors its destinations are views of (the conv caches: a stray write there shows)."""
    written = [n.view_src, *n.outs]
    return written + list({t.base.uid: t.base for t in written if t.base is not t}.values())


def same_bytes(ex: Executor, a, b, over) -> bool:
    """Run ``a``, then ``b``, from the same starting bytes (restored afterwards): whether they leave the tensors
    ``over`` (of ``ex``'s graph) byte-identical. (Not every buffer: an unfused chain also writes its interior nodes'
    arena blocks, which its fused node does not; and a copy of every buffer is the memory of one more executor.)"""
    start = ex.snapshot()
    ends = []
    for fn in (a, b):
        ex.restore(start)
        fn()
        ends.append([ex.view(t).clone(memory_format=torch.contiguous_format).view(torch.uint8) for t in over])
    ex.restore(start)
    return all(torch.equal(x, y) for x, y in zip(*ends))


def bench_dedup(cases) -> list[dict]:
    """Per (T, n_rs_seq) of ``cases``: the fused node's profiler us and bytes in the rows, dedup and dedup-t layouts,
    and the copy ratio their bytes allow (a copy of the fewest bytes a layout moves over a copy of the rows
    layout's)."""
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


# ---- the snapshot layouts at batch (issue 37 item 3; seed 003's table) ----------------------------------------------

# Seed 003's kernel time per call, us (GB300, dim 10240, K 4, bf16 state, CUDA graph), at (bs, T): (before: the
# deduplicated window stored per token, three element stores each; after: stored once as a tile; a dense window)
SEED_003 = {(1, 8): (5.35, 2.49, 3.71), (64, 8): (57.39, 9.96, 21.08), (128, 8): (106.45, 17.55, 38.58),
            (128, 16): (322.63, 39.10, 74.12)}


def seqs_cases(seqs, tokens) -> list[tuple[int, int]]:
    """(S, T) of every S in ``seqs`` and T in ``tokens``, seed 003's points first (a run cut short has those)."""
    grid = [(S, T) for S in seqs for T in tokens]
    return [c for c in SEED_003 if c in grid] + [c for c in grid if c not in SEED_003]


def half_channels(model) -> ModelShape:
    """``model`` with half its GDN heads (k and v; the same head size): its chain in f32 moves the bytes the chain of
    ``model`` would move with bf16 state and inputs (seed 003's bf16 row in gdnpass's f32 terms: llama.cpp's
    recurrent caches are f32, and so is gdnpass's chain), with half the stores of that bf16 chain."""
    m = get_model(model)
    if m.n_k_heads % 2 or m.n_v_heads % 2:
        raise GraphError(f"model {m.name!r}: {m.n_k_heads} k and {m.n_v_heads} v heads do not halve")
    return replace(m, name=f"{m.name}/2", n_k_heads=m.n_k_heads // 2, n_v_heads=m.n_v_heads // 2)


def timed(fn) -> tuple[float, int | None]:
    """Kernel time per call of ``fn``, us, and its kernels (:func:`kernel_us`: profiler durations of one call captured
    as a CUDA graph, median over replays); without a GPU one call, untimed: (nan, None)."""
    if not torch.cuda.is_available():
        fn()
        return float("nan"), None
    us, per = kernel_us(fn)
    return us, len(per)


def _layout_case(model, S: int, T: int, layout: str) -> dict:
    """One layout of :func:`bench_dedup_seqs`'s (S, T): checked, then timed (a case whose bytes differ is not
    timed: NaN). Its executor dies with this call (the next layout's needs the memory)."""
    ex, node, chain = chain_layer(model, T, T - 1, layout, S)
    fused, unfused = node_runner(ex, node), nodes_runner(ex, chain)
    tile = node.op_params.get("tile")
    r = {f"{layout} identical": same_bytes(ex, unfused, fused, over=chain_written(node)),
         f"{layout} tile": tile is not None, f"{layout} bytes": node_bytes(node, tile)}
    if layout == "rows":  # the same node with its q/k norms in launches of their own (norm_apart)
        apart = node_runner(ex, norm_apart(node))
        r["norm-apart identical"] = r["rows identical"] and same_bytes(ex, fused, apart, chain_written(node))
    if layout == "dedup":  # the seed's baseline: this shared row written window by window (without a tile, the node)
        per_token = node_runner(ex, without_tile(node)) if tile else fused
        r["per-token identical"] = r["dedup identical"] and (
            not tile or same_bytes(ex, fused, per_token, chain_written(node)))
        r["per-token bytes"] = node_bytes(node)
    us, kernels = timed(unfused) if r[f"{layout} identical"] else (float("nan"), None)
    # (its kernels: the profiler's count, else its nodes' launches)
    r[f"{layout} unfused"] = us
    r[f"{layout} unfused kernels"] = kernels if kernels is not None else sum(node_launches(n) for n in chain)
    r[layout] = timed(fused)[0] if r[f"{layout} identical"] else float("nan")
    if layout == "rows":
        r["norm-apart"] = timed(apart)[0] if r["norm-apart identical"] else float("nan")
    if layout == "dedup":
        r["per-token"] = timed(per_token)[0] if r["per-token identical"] else float("nan")
    return r


def bench_dedup_seqs(model, cases):
    """Issue 37 item 3, seed 003's table in gdnpass: per (S, T) of ``cases``, one ``model`` layer (a preset's name or
    a ModelShape) verifying S sequences of T tokens with T - 1 rollback planes (T windows a sequence: the seed's
    verify of T tokens), in each snapshot layout: the fused GDN_CONV_CHAIN node's kernel time per call, the unfused
    chain's (its kernels) and the bytes the node moves; in the dedup layout also the node without its tile
    ("per-token": the shared row written window by window, d_conv - 1 element stores a window, as the seed's kernel
    before its change). Before any timing, fused vs unfused (the chain's nodes, then the node, from the same bytes:
    its outputs and whole conv caches) and per-token vs tile are compared byte for byte. Yields one dict per case,
    as it is measured."""
    m = get_model(model)
    for S, T in cases:
        r = dict(model=m.name, C=m.conv_channels, S=S, T=T, planes=T)
        for layout in SNAPSHOT_LAYOUTS:
            r.update(_layout_case(model, S, T, layout))
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        yield r
