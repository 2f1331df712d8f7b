"""One fused conv chain (both L2 modes) and one mat-vec pair at qwen3.5-9b size, for compute-sanitizer.

    compute-sanitizer --tool memcheck python benchmarks/sanitize.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize.py
"""

import sys

import torch

sys.path.insert(0, ".")

from gdnpass import pipeline  # noqa: E402
from gdnpass.ir import Op  # noqa: E402
from gdnpass.pipeline import PassOptions  # noqa: E402
from gdnpass.models import VerifyConfig, default_ids  # noqa: E402
from gdnpass.runtime import Executor  # noqa: E402

for hints in (True, False):
    cfg = VerifyConfig("qwen3.5-9b", 8, 7, n_layers=1, share_weights=True, ffn=False)
    res = pipeline.run(cfg, PassOptions(fusion=True, hints=hints))
    g, report = res.graph, res.report
    ex = Executor(g, device="cuda")
    ex.fill(seed=0, ids=default_ids(cfg))
    ex.run()
    torch.cuda.synchronize()
    sep = [n.op_params.get("l2_separate") for n in g.nodes if n.op is Op.GDN_CONV_CHAIN]
    print(f"hints={hints}: {report.summary()}; l2_separate={sep}")
print("done")
