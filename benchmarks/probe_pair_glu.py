"""The FFN pair's SwiGLU in its launch (pair_glu) against the pair and the GLU kernel it replaces, in one process:
qwen3.5-9b's gate / up (12288 x 4096), bf16 and f32, at 1-16 columns; bytes compared, then each form's GPU time (a
CUDA graph of 20 back-to-back calls, CUDA events, median of 30 replays: ``bench.timing.graph_time_us``).

    python benchmarks/probe_pair_glu.py [--cols 1,2,4,8,16]

Each call runs on fresh weights of its own (enough copies that every call reads its weights from memory, as in a
forward: ``bench.matvec.rotation``)."""

from __future__ import annotations

import argparse

import torch

from gdnpass.bench.matvec import rotation
from gdnpass.bench.timing import graph_time_us
from gdnpass.kernels import triton_elementwise as elt
from gdnpass.kernels import triton_matvec as mv

M, K = 12288, 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cols", default="1,2,4,8,16")
    a = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}; us a call (pair + GLU: two launches; fused: one)")
    print("weights | cols | split | pair + GLU | fused | fused / unfused | bytes")
    for wt in (torch.bfloat16, torch.float32):
        for n in map(int, a.cols.split(",")):
            tile = mv.mat_vec_tile(M, n, K, mv.WTYPES[wt], 2)
            x = torch.randn(1, 1, n, K, device="cuda")
            weights = [tuple((torch.randn(1, 1, M, K, device="cuda") / 64).to(wt) for _ in range(2))
                       for _ in range(rotation(2 * M * K * wt.itemsize))]
            p, p2, want, y = (torch.empty(1, 1, n, M, device="cuda") for _ in range(4))
            w, w2 = weights[0]
            mv.mul_mat_vec_pair(w, w2, x, p, p2)
            elt.glu("SWIGLU", p, p2, False, want)
            mv.mul_mat_vec_pair_glu(w, w2, x, y)
            same = torch.equal(y.view(torch.int32), want.view(torch.int32))
            it = iter(range(1 << 60))

            def unfused():
                w, w2 = weights[next(it) % len(weights)]
                mv.mul_mat_vec_pair(w, w2, x, p, p2)
                elt.glu("SWIGLU", p, p2, False, want)

            def fused():
                w, w2 = weights[next(it) % len(weights)]
                mv.mul_mat_vec_pair_glu(w, w2, x, y)

            u, f = graph_time_us(unfused), graph_time_us(fused)
            print(f"{mv.WTYPES[wt]} | {n} | {tile.split_k} | {u:.2f} | {f:.2f} | {f / u:.3f} | "
                  f"{'equal' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
