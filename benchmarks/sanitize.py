"""One fused conv chain (both L2 modes) and one mat-vec pair at qwen3.5-9b size, for compute-sanitizer.

    compute-sanitizer --tool memcheck python benchmarks/sanitize.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize.py
"""

import sys

import torch

sys.path.insert(0, ".")

from gdnpass.fusion import fuse, prepare_and_plan  # noqa: E402
from gdnpass.models import VerifyConfig, build_verify_graph, default_ids  # noqa: E402
from gdnpass.runtime import Executor  # noqa: E402

for hints in (True, False):
    cfg = VerifyConfig("qwen3.5-9b", 8, 7, n_layers=1, share_weights=True, ffn=False)
    g = prepare_and_plan(build_verify_graph(cfg), enabled=hints)
    report = fuse(g, enabled=True)
    ex = Executor(g, device="cuda")
    ex.fill(seed=0, ids=default_ids(cfg))
    ex.run()
    torch.cuda.synchronize()
    sep = [n.op_params.get("l2_separate") for n in g.nodes if n.op_params.get("n_inputs") == 4]
    print(f"hints={hints}: {report.summary()}; l2_separate={sep}")
print("done")
