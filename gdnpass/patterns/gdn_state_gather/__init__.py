"""A one-sequence GATED_DELTA_NET_CACHE reading its starting state straight from the recurrent cache's row (the
GET_ROWS before it, which then launches nothing). ``matcher.py``: the rule block, the rules, the capture and the
rewrite. The fused op is gdn_state_cache's (its record carries ``gather`` and the ids); the kernel is GATED_DELTA_NET's
own (:func:`gdnpass.kernels.triton_ssm.gated_delta_net`, ``state_ids``).
"""

from gdnpass.patterns.gdn_state_cache.record import KERNEL, RECORD
from gdnpass.patterns.gdn_state_gather import matcher
from gdnpass.patterns.gdn_state_gather.matcher import NAME, GatherCapture, GdnStateGather
from gdnpass.patterns.pattern import Pattern

PATTERN = Pattern(NAME, GdnStateGather, GatherCapture, RECORD, matcher.__doc__, KERNEL,
                  example=dict(model="tiny-qwen35", n_tokens=4, n_rs_seq=3, whole=True),
                  needs=("gdn_state_cache",))

__all__ = ["NAME", "PATTERN", "GatherCapture", "GdnStateGather"]
