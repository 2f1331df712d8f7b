"""A MUL_MAT_VEC_PAIR computing the SwiGLU of its two products in its own launch (the FFN's gate / up and their
GLU), which then launches nothing. ``matcher.py``: the rule block, the rules, the capture and the rewrite. The fused
op is mat_vec_pair's (its record carries ``glu``); the kernel is the pair's own
(:func:`gdnpass.kernels.triton_matvec.mul_mat_vec_pair_glu`), whose last program of a row block stores the GLU.
"""

from gdnpass.patterns.mat_vec_pair.record import RECORD
from gdnpass.patterns.pair_glu import matcher
from gdnpass.patterns.pair_glu.matcher import NAME, PairGlu, PairGluCapture
from gdnpass.patterns.pattern import Pattern

PATTERN = Pattern(NAME, PairGlu, PairGluCapture, RECORD, matcher.__doc__,
                  "gdnpass.kernels.triton_matvec.mul_mat_vec_pair_glu",
                  example=dict(model="tiny-dc4-h64-ff1024", n_tokens=8, n_rs_seq=3, n_layers=1,
                               mem_size=2), needs=("mul_mat_vec_pair",))

__all__ = ["NAME", "PATTERN", "PairGlu", "PairGluCapture"]
