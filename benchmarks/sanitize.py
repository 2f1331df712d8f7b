"""Every Triton kernel the executor launches, once, for compute-sanitizer:

    compute-sanitizer --tool memcheck python benchmarks/sanitize.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize.py

1. the fused conv chain (both L2 modes) and the alpha/beta pair, qwen3.5-9b size, one layer;
2. the whole tiny-qwen35 verify forward, unfused and fused, with flash attention and (fused) with MUL_MAT + SOFT_MAX
   + MUL_MAT: GET_ROWS, CONCAT, CPY, SSM_CONV, the norms, the elementwise ops, GLU, ROPE, SET_ROWS, FLASH_ATTN_EXT,
   SOFT_MAX, GATED_DELTA_NET; the whole tiny-qwen35moe verify, bf16 and Q8_0 weights, fused: the expert FFN's
   ARGSORT, SUM_ROWS, CLAMP, DIV and MUL_MAT_ID (plain and quantized experts);
3. one mat-vec per distinct tile (form, rows per program, columns, K step, split) that qwen3.5-9b's product shapes
   take at 1, 4, 8 and 16 columns, f32 and bf16 weights.
"""

import argparse

import torch

from gdnpass import pipeline
from gdnpass.bench.matvec import product_shapes
from gdnpass.ir import Op
from gdnpass.kernels import triton_matvec as mv
from gdnpass.models import VerifyConfig, default_ids
from gdnpass.models.fill import fill
from gdnpass.pipeline import PassOptions
from gdnpass.launches import launches
from gdnpass.runtime import Executor


def run(cfg: VerifyConfig, fusion: bool) -> str:
    res = pipeline.run(cfg, PassOptions(fusion=fusion))
    ex = Executor(res.graph, device="cuda")
    fill(ex, seed=0, ids=default_ids(cfg))
    ex.run()
    torch.cuda.synchronize()
    return res.report.summary() + f"; {sum(launches(res.graph).values())} launches"


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    for hints in (True, False):
        cfg = VerifyConfig("qwen3.5-9b", 8, 7, n_layers=1, share_weights=True, ffn=False)
        res = pipeline.run(cfg, PassOptions(fusion=True, hints=hints))
        ex = Executor(res.graph, device="cuda")
        fill(ex, seed=0, ids=default_ids(cfg))
        ex.run()
        torch.cuda.synchronize()
        sep = [n.op_params.get("l2_separate") for n in res.graph.nodes if n.op is Op.GDN_CONV_CHAIN]
        print(f"chain, hints={hints}: {res.report.summary()}; l2_separate={sep}", flush=True)

    for flash, fusion in ((True, False), (True, True), (False, True)):
        print(f"tiny-qwen35 whole, flash_attn={flash}, fusion={fusion}: "
              + run(VerifyConfig("tiny-qwen35", 4, 3, whole=True, flash_attn=flash, n_past=8), fusion), flush=True)
    for wtype in ("bf16", "q8_0"):  # the expert FFN: ARGSORT, SUM_ROWS, CLAMP, DIV, MUL_MAT_ID (plain, quantized)
        print(f"tiny-qwen35moe whole, {wtype}: "
              + run(VerifyConfig("tiny-qwen35moe", 4, 3, whole=True, n_past=8, wtype=wtype), True), flush=True)

    tiles = {}
    for M, K, *_ in product_shapes("qwen3.5-9b"):
        for wt in (torch.float32, torch.bfloat16):
            for n in (1, 4, 8, 16):
                tiles.setdefault(mv.mat_vec_tile(M, n, K, mv.WTYPES[wt]), (M, K, wt, n))
    for tile, (M, K, wt, n) in tiles.items():
        w = (torch.randn(1, 1, M, K, device="cuda") / 64).to(wt)
        x = torch.randn(1, 1, n, K, device="cuda")
        y = torch.empty(1, 1, n, M, device="cuda")
        mv.mul_mat_vec(w, x, y)
        torch.cuda.synchronize()
        print(f"mat-vec {M}x{K} {mv.WTYPES[wt]} {n} columns: {tile}", flush=True)
        del w
    print(f"done: {len(tiles)} mat-vec tiles")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
