"""The conv chain at qwen3.5-9b size (C 8192, S 128, 16 k heads, d_conv 4): the fused chain's operands laid out as
llama.cpp lays them and the bytes it must move; one layer's unfused chain, kernel by kernel, next to upstream
ggml-cuda's (:data:`UPSTREAM`) and the fused node; the one-layer fused node in a snapshot layout
(:func:`fused_chain`, benchmarks/tune_dedup.py's too) and the dedup layouts against the rows layout."""

from __future__ import annotations

import torch

from gdnpass import pipeline
from gdnpass.bench.floors import copy_us
from gdnpass.bench.timing import kernel_us, node_runner
from gdnpass.fusion import fuse
from gdnpass.ir import Op, runs_kernel
from gdnpass.models import VerifyConfig, default_ids
from gdnpass.models.fill import fill
from gdnpass.pipeline import PassOptions
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


def chain_bytes(T: int, rows: int, tile: dict | None = None) -> int:
    """Bytes the fused chain must move at qwen3.5-9b size: the gathered state, the projection, the taps, the SiLU
    output, the q/k outputs and the snapshot rows; with the node's ``tile`` (a dedup layout's shared row), the
    tile's windows stored as its columns once."""
    C, dc, S, Hk = 8192, 4, 128, 16
    per_window = rows - len(tile["windows"]) if tile else rows  # rows stored window by window, dc-1 columns each
    snapshot_cols = per_window * (dc - 1) + (tile["n_cols"] if tile else 0)
    return 4 * ((dc - 1) * C + C * T + dc * C + C * T + 2 * S * Hk * T + snapshot_cols * C)


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


def fused_chain(model: str, T: int, n_rs: int, layout: str):
    """One layer of ``model`` (no FFN), fused, in snapshot ``layout``: (its executor, with the Triton backend, on the
    GPU when there is one, else on the CPU; its GDN_CONV_CHAIN node). On the GPU the forward has run once, so the
    chain is timed on real intermediates (fill leaves them NaN, and NaN takes SiLU's slow division path)."""
    gpu = torch.cuda.is_available()
    cfg = VerifyConfig(model, T, n_rs, n_layers=1, share_weights=True, ffn=False, snapshot_layout=layout)
    g = pipeline.run(cfg, PassOptions(fusion=True)).graph
    ex = Executor(g, device="cuda" if gpu else "cpu", backend="triton")
    fill(ex, seed=1, ids=default_ids(cfg, read_plane=min(1, n_rs)))  # an accepted-token offset: plane 1 is read
    if gpu:
        ex.run()
    return ex, next(n for n in g.nodes if n.op is Op.GDN_CONV_CHAIN)


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
