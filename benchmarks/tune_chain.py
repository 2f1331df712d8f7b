"""Variants of the fused conv-chain launch (token tile, warps) at qwen3.5-9b size, timed side by side; every variant's
output checked byte-identical to the default launch. python benchmarks/tune_chain.py"""

import sys

import torch
import triton

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")

from bench import graph_time_us  # noqa: E402

from gdnpass.kernels import triton_ops as tri  # noqa: E402

C, S, H_k, dc = 8192, 128, 16, 4
print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}")
print("T rows | " + " | ".join(f"bt={bt} w={w}" for bt in ("16", "np2") for w in (1, 2, 4, 8)))
for T in (1, 4, 8, 16):
    rows_n = T
    R = 2 * rows_n
    cache = torch.randn(1, 1, R, (dc - 1) * C, device="cuda")
    ids = torch.tensor([1], dtype=torch.int32, device="cuda")
    proj = torch.randn(1, 1, T, C, device="cuda")
    x = proj.transpose(2, 3)  # (1,1,C,T) with strides (.., .., 1, C)
    w = torch.randn(1, 1, C, dc, device="cuda")
    rows = [cache[:, :, 2 * r:2 * r + 1] for r in range(rows_n)]
    cols = [max(0, T - s) for s in range(rows_n - 1, -1, -1)]
    ref = None
    times = []
    for bt in ("16", "np2"):
        for nw in (1, 2, 4, 8):
            out = torch.empty(1, 1, T, C, device="cuda")
            q = torch.empty(1, T, H_k, S, device="cuda")
            k = torch.empty(1, T, H_k, S, device="cuda")
            block_t = 16 if bt == "16" else triton.next_power_of_2(T)
            fn = lambda: tri.gdn_conv_chain(cache, ids, x, w, rows, cols, 1e-6, out, q, k, False, None, block_t, nw)
            t = graph_time_us(fn)
            got = [out.clone(), q.clone(), k.clone(), cache.clone()]
            if ref is None:
                ref = got
            same = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(ref, got))
            times.append(f"{t:6.2f}{'' if same else ' DIFF'}")
    print(f"{T:2d} {rows_n:4d} | " + " | ".join(times), flush=True)
