"""The GDN conv chain: GET_ROWS -> CONCAT -> snapshot CPYs -> SSM_CONV -> SILU -> q/k normalisation, fused into one
GDN_CONV_CHAIN node (seed 000). ``matcher.py``: the rule block, the rules, the capture, ``prepare`` and the rewrite;
``record.py``: the fused op. The kernel, :func:`gdnpass.kernels.triton_ssm.gdn_conv_chain`, stays in the SSM family
beside SSM_CONV (it shares the exactness core's helpers and launches the unfused norm kernels for ``l2_separate``).
"""

from gdnpass.patterns.conv_chain import matcher, record
from gdnpass.patterns.conv_chain.matcher import NAME, ChainCapture, ChainPlan, ConvChain, Norm
from gdnpass.patterns.conv_chain.record import RECORD
from gdnpass.patterns.pattern import Pattern

PATTERN = Pattern(NAME, ConvChain, ChainCapture, RECORD, matcher.__doc__, record.KERNEL,
                  example=dict(model="tiny-dc4-h64", n_tokens=4, n_rs_seq=3, n_layers=1, mem_size=2),
                  modes=("narrow", "broad"))

__all__ = ["NAME", "PATTERN", "RECORD", "ChainCapture", "ChainPlan", "ConvChain", "Norm"]
