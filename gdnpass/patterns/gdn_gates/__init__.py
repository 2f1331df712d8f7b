"""A GATED_DELTA_NET_CACHE node computing its decay and beta from the inputs of the elementwise nodes that made them
(the GDN gate's ELEMENTWISE_CHAIN, beta's SIGMOID), which then launch nothing. ``matcher.py``: the rule block, the
rules, the capture and the rewrite. The fused op is gdn_state_cache's (its record carries the steps); the kernel is
GATED_DELTA_NET's own (:func:`gdnpass.kernels.triton_ssm.gated_delta_net`, ``g_steps`` / ``beta_steps``), which runs
ELEMENTWISE_CHAIN's steps where it reads its gates (``triton_core.chain_at``).
"""

from gdnpass.patterns.gdn_gates import matcher
from gdnpass.patterns.gdn_gates.matcher import NAME, GatesCapture, GdnGates
from gdnpass.patterns.gdn_state_cache.record import KERNEL, RECORD
from gdnpass.patterns.pattern import Pattern

PATTERN = Pattern(NAME, GdnGates, GatesCapture, RECORD, matcher.__doc__, KERNEL,
                  example=dict(model="tiny-qwen35", n_tokens=4, n_rs_seq=3, whole=True),
                  needs=("gdn_state_cache", "elementwise_chain"))

__all__ = ["NAME", "PATTERN", "GatesCapture", "GdnGates"]
