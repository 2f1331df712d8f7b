"""Launch variants of the fused conv chain (warps per head) at qwen3.5-9b size, timed side by side; every variant's
output checked byte-identical to the default launch. python benchmarks/tune_chain.py"""

import sys

import torch
import triton

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")

from bench import graph_time_us  # noqa: E402

from gdnpass.kernels import triton_ops as tri  # noqa: E402

C, S, H_k, dc = 8192, 128, 16, 4
WARPS = (2, 4, 8)
print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}; default {tri.chain_warps(S)} warps")
print("T rows | " + " | ".join(f"{w} warps" for w in WARPS))
for T in (1, 4, 8, 16):
    rows_n = T
    g = torch.Generator(device="cuda").manual_seed(T)
    cache = torch.randn(1, 1, 2 * rows_n, (dc - 1) * C, device="cuda", generator=g)
    ids = torch.tensor([1], dtype=torch.int32, device="cuda")
    x = torch.randn(1, 1, T, C, device="cuda", generator=g).transpose(2, 3)  # (1,1,C,T), strides (.., .., 1, C)
    w = torch.randn(1, 1, C, dc, device="cuda", generator=g)
    rows = [cache[:, :, 2 * r:2 * r + 1] for r in range(rows_n)]
    cols = [max(0, T - s) for s in range(rows_n - 1, -1, -1)]
    ref, times = None, []
    for nw in WARPS:
        out = torch.empty(1, 1, T, C, device="cuda")
        q = torch.empty(1, T, H_k, S, device="cuda")
        k = torch.empty(1, T, H_k, S, device="cuda")
        c = cache.clone()
        rws = [c[:, :, 2 * r:2 * r + 1] for r in range(rows_n)]
        tri.gdn_conv_chain(c, ids, x, w, rws, cols, 1e-6, out, q, k, num_warps=nw)  # one run from the same state
        got = [out.clone(), q.clone(), k.clone(), c.clone()]
        ref = ref or got
        same = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(ref, got))
        t = graph_time_us(lambda: tri.gdn_conv_chain(cache, ids, x, w, rows, cols, 1e-6, out, q, k, num_warps=nw))
        times.append(f"{t:6.2f}{'' if same else ' DIFF'}")
    print(f"{T:2d} {rows_n:4d} | " + " | ".join(times), flush=True)
