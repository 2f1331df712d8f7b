"""GATED_DELTA_NET and the CPY of its state snapshots into the recurrent cache, fused into one GATED_DELTA_NET_CACHE
node that writes the states straight into the cache rows (upstream ggml-cuda's form). ``matcher.py``: the rule
block, the rules, the capture and the rewrite; ``record.py``: the fused op and its scope. The kernel is
GATED_DELTA_NET's own, in the ssm family (:func:`gdnpass.kernels.triton_ssm.gated_delta_net`, ``snapshots``).
"""

from gdnpass.patterns.gdn_state_cache import matcher, record
from gdnpass.patterns.gdn_state_cache.matcher import NAME, GdnCacheCapture, GdnStateCache
from gdnpass.patterns.gdn_state_cache.record import RECORD
from gdnpass.patterns.pattern import Pattern

PATTERN = Pattern(NAME, GdnStateCache, GdnCacheCapture, RECORD, matcher.__doc__, record.KERNEL,
                  example=dict(model="tiny-qwen35", n_tokens=4, n_rs_seq=3, whole=True))

__all__ = ["NAME", "PATTERN", "RECORD", "GdnCacheCapture", "GdnStateCache"]
