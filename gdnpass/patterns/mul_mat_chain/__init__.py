"""A thin MUL_MAT and the elementwise chain of its product (Qwen3.5's GDN output gate), fused into one MUL_MAT_CHAIN
node. ``matcher.py``: the rule block, the rules, the capture and the rewrite; ``record.py``: the fused op. The kernel,
:func:`gdnpass.kernels.triton_matvec.mul_mat_vec_chain`, is the single mat-vec's kernel running the chain's steps at
its store (MUL_MAT_ADD's residual is its one-step case), so it stays in the mat-vec family.
"""

from gdnpass.patterns.mul_mat_chain import matcher, record
from gdnpass.patterns.mul_mat_chain.matcher import NAME, MatChainCapture, MatMulChain
from gdnpass.patterns.mul_mat_chain.record import RECORD
from gdnpass.patterns.pattern import Pattern

PATTERN = Pattern(NAME, MatMulChain, MatChainCapture, RECORD, matcher.__doc__, record.KERNEL,
                  example=dict(model="tiny-qwen35", n_tokens=4, n_rs_seq=3, whole=True),
                  needs=("elementwise_chain",))

__all__ = ["NAME", "PATTERN", "RECORD", "MatChainCapture", "MatMulChain"]
