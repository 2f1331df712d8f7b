"""The FFN pair's SwiGLU in its launch (pair_glu) against the pair and the GLU kernel it replaces, in one process:
qwen3.5-9b's gate / up (12288 x 4096), bf16 and f32, at 1-16 columns; bytes compared, then each form's GPU time (a
CUDA graph of 20 back-to-back calls, CUDA events, median of 30 replays: ``bench.timing.graph_time_us``).

    python benchmarks/probe_pair_glu.py [--cols 1,2,4,8,16] [--wtypes bf16,f32,q8_0]

Q8_0 (its down product Q8_0 too, as in a Q8_0 file): the unfused pair, then the GLU writing its output quantized
for the down product (q8_1, a producer of gdnpass.prepasses), against the pair handing it on from its epilogue
(``quantize``: the HAND_OFF_SLOT workspace); each with its pre-pass of x. Bytes compared: y, and the hand-off
against the GLU's activations, word for word.

Each call runs on fresh weights of its own (enough copies that every call reads its weights from memory, as in a
forward: ``bench.matvec.rotation``)."""

from __future__ import annotations

import argparse

import torch

from gdnpass.bench.matvec import rotation
from gdnpass.bench.timing import graph_time_us
from gdnpass.ir import DType
from gdnpass.kernels import triton_core as core
from gdnpass.kernels import triton_elementwise as elt
from gdnpass.kernels import triton_matvec as mv
from gdnpass.kernels.quants import held_rows, random_blocks

M, K = 12288, 4096
PLAIN = {"bf16": torch.bfloat16, "f32": torch.float32}


def _weights(wt: str, g: torch.Generator) -> torch.Tensor:
    if wt in PLAIN:
        return (torch.randn(1, 1, M, K, generator=g) / 64).to(PLAIN[wt]).cuda()
    q = DType.parse(wt)
    return held_rows(random_blocks(M, K, q, g, 0.05), q).view(1, 1, M, -1).cuda()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cols", default="1,2,4,8,16")
    ap.add_argument("--wtypes", default="bf16,f32", help="bf16, f32, q8_0 (comma-separated)")
    a = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}; us a call (pair + GLU: two launches; fused: one; Q8_0: each with its "
          f"pre-pass of x)")
    print("weights | cols | split | pair + GLU | fused | fused / unfused | bytes")
    g = torch.Generator().manual_seed(0)
    for wt in a.wtypes.split(","):
        q = DType.parse(wt) if wt not in PLAIN else None
        form = "q8_1" if q is DType.Q8_0 else None
        for n in map(int, a.cols.split(",")):
            tile = mv.mat_vec_tile(M, n, K, wt, 2)
            x = torch.randn(1, 1, n, K, device="cuda")
            one = _weights(wt, g)
            copies = rotation(2 * one.numel() * one.element_size())
            weights = [(_weights(wt, g), _weights(wt, g)) for _ in range(copies)]
            p, p2, want, y = (torch.empty(1, 1, n, M, device="cuda") for _ in range(4))
            w, w2 = weights[0]
            mv.mul_mat_vec_pair(w, w2, x, p, p2, q)
            elt.glu("SWIGLU", p, p2, False, want, quantize=form)
            size = mv.activation_bytes(M)
            made = core._ACTIVATION_WORKSPACE[x.device, core.FILL_SLOT][:size].clone() if form else None
            mv.mul_mat_vec_pair_glu(w, w2, x, y, dtype=q, quantize=form)
            same = torch.equal(y.view(torch.int32), want.view(torch.int32))
            if form:
                same &= torch.equal(core._ACTIVATION_WORKSPACE[x.device, core.HAND_OFF_SLOT][:size], made)
            it = iter(range(1 << 60))

            def unfused():
                w, w2 = weights[next(it) % len(weights)]
                mv.mul_mat_vec_pair(w, w2, x, p, p2, q)
                elt.glu("SWIGLU", p, p2, False, want, quantize=form)

            def fused():
                w, w2 = weights[next(it) % len(weights)]
                mv.mul_mat_vec_pair_glu(w, w2, x, y, dtype=q, quantize=form)

            u, f = graph_time_us(unfused), graph_time_us(fused)
            print(f"{wt} | {n} | {tile.split_k} | {u:.2f} | {f:.2f} | {f / u:.3f} | {'equal' if same else 'DIFFER'}",
                  flush=True)


if __name__ == "__main__":
    main()
