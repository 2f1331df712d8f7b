"""The mat-vec pair: two thin MUL_MATs sharing their input (alpha/beta; the FFN's gate/up), fused into one
MUL_MAT_VEC_PAIR node. ``matcher.py``: the rule block, the rules, the capture, ``prepare`` and the rewrite;
``record.py``: the fused op. The kernel, :func:`gdnpass.kernels.triton_matvec.mul_mat_vec_pair`, is the single
mat-vec's kernel with a second product on the grid, so it stays in the mat-vec family.
"""

from gdnpass.patterns.mat_vec_pair import matcher, record
from gdnpass.patterns.mat_vec_pair.matcher import NAME, MatVecPair, PairCapture
from gdnpass.patterns.mat_vec_pair.record import RECORD
from gdnpass.patterns.pattern import Pattern

PATTERN = Pattern(NAME, MatVecPair, PairCapture, RECORD, matcher.__doc__, record.KERNEL,
                  example=dict(model="tiny-dc4-h64", n_tokens=4, n_rs_seq=3, n_layers=1, mem_size=2))

__all__ = ["NAME", "PATTERN", "RECORD", "MatVecPair", "PairCapture"]
