"""The expert FFN's router (SOFT_MAX, DESC ARGSORT, GET_ROWS, SUM_ROWS, CLAMP, DIV) fused into one MOE_ROUTER node.
``matcher.py``: the rule block, the rules, the capture and the rewrite; ``record.py``: the fused op; ``scope.py``: what
the kernel can run; ``kernel.py``: the Triton kernel, its launcher and its torch reference (it shares only the
exactness core's helpers, so it lives here, not in a kernel family).
"""

from gdnpass.patterns.moe_router import matcher, record
from gdnpass.patterns.moe_router.matcher import NAME, MoeRouter, RouterCapture
from gdnpass.patterns.moe_router.record import RECORD
from gdnpass.patterns.pattern import Pattern

PATTERN = Pattern(NAME, MoeRouter, RouterCapture, RECORD, matcher.__doc__, record.KERNEL,
                  example=dict(model="tiny-qwen35moe", n_tokens=4, n_rs_seq=3, n_layers=1))

__all__ = ["NAME", "PATTERN", "RECORD", "MoeRouter", "RouterCapture"]
