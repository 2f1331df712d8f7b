"""One mat-vec launch of a quantized weight (for ncu): python benchmarks/one_matvec.py q4_k 4096 4096 4."""
import sys, torch
from gdnpass.ir import DType
from gdnpass.bench.matvec import quantized_weight
from gdnpass.kernels import triton_matvec as mv
wt, M, K, N = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
d = DType.parse(wt)
w = quantized_weight(d, M, K)
x = torch.randn(1, 1, N, K, device="cuda")
y = torch.empty(1, 1, N, M, device="cuda")
for _ in range(3):
    mv.mul_mat_vec(w, x, y, d)
torch.cuda.synchronize()
