"""Consecutive ADD / MUL / UNARY nodes, each reading the one before, fused into one ELEMENTWISE_CHAIN node (the GDN
gate's ADD -> SOFTPLUS -> MUL, the output gate's SILU -> MUL). ``matcher.py``: the rule block, the rules, the capture
and the rewrite; ``record.py``: the fused op; ``scope.py``: what its kernel computes. The kernel is the elementwise
family's (``gdnpass.kernels.triton_elementwise.elementwise_chain``): it runs those ops' own expressions.
"""

from gdnpass.patterns.elementwise_chain import matcher, record
from gdnpass.patterns.elementwise_chain.matcher import NAME, ChainCapture, ElementwiseChain
from gdnpass.patterns.elementwise_chain.record import RECORD
from gdnpass.patterns.pattern import Pattern

PATTERN = Pattern(NAME, ElementwiseChain, ChainCapture, RECORD, matcher.__doc__, record.KERNEL,
                  example=dict(model="tiny-qwen35", n_tokens=4, n_rs_seq=3, whole=True))

__all__ = ["NAME", "PATTERN", "RECORD", "ChainCapture", "ElementwiseChain"]
