"""A thin MUL_MAT and the ADD of its product (the residual), fused into one MUL_MAT_ADD node. ``matcher.py``: the rule
block, the rules, the capture and the rewrite; ``record.py``: the fused op. The kernel,
:func:`gdnpass.kernels.triton_matvec.mul_mat_vec_add`, is the single mat-vec's kernel adding the addend at its
store, so it stays in the mat-vec family.
"""

from gdnpass.patterns.mul_mat_add import matcher, record
from gdnpass.patterns.mul_mat_add.matcher import NAME, MatAddCapture, MatMulAdd
from gdnpass.patterns.mul_mat_add.record import RECORD
from gdnpass.patterns.pattern import Pattern

PATTERN = Pattern(NAME, MatMulAdd, MatAddCapture, RECORD, matcher.__doc__, record.KERNEL,
                  example=dict(model="tiny-dc4-h64", n_tokens=4, n_rs_seq=3, n_layers=1, mem_size=2))

__all__ = ["NAME", "PATTERN", "RECORD", "MatAddCapture", "MatMulAdd"]
