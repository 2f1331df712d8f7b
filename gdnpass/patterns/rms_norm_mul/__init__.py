"""RMS_NORM, MUL by a weight (and ADD), fused into one RMS_NORM_MUL node (ggml-cuda's rms_norm fusion).
``matcher.py``: the rule block, the rules, the capture and the rewrite; ``record.py``: the fused op and its scope;
``kernel.py``: the Triton kernel, its launcher and its torch reference (it shares only the exactness core's helpers,
so it lives here, not in a kernel family).
"""

from gdnpass.patterns.pattern import Pattern
from gdnpass.patterns.rms_norm_mul import matcher, record
from gdnpass.patterns.rms_norm_mul.matcher import NAME, NormCapture, RmsNormMul
from gdnpass.patterns.rms_norm_mul.record import RECORD

PATTERN = Pattern(NAME, RmsNormMul, NormCapture, RECORD, matcher.__doc__, record.KERNEL,
                  example=dict(model="tiny-qwen35", n_tokens=4, n_rs_seq=3, whole=True))

__all__ = ["NAME", "PATTERN", "RECORD", "NormCapture", "RmsNormMul"]
