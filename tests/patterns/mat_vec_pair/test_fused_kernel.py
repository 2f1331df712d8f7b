"""The mat-vec pair's fused kernel (MUL_MAT_VEC_PAIR) against the two MUL_MATs it replaces: byte for byte on each
backend (the Triton one in the interpreter here, compiled on a GPU), and against independent math.

Everything lives in one NaN-poisoned uint8 arena and the kernels get strided views of it, as from the executor.
"""

import pytest
import torch

from gdnpass.ir import Op
from gdnpass.kernels.backends import TORCH_BACKEND, TRITON_BACKEND
from support.arena import Arena, assert_close, node, rnd
from support.compare import assert_same_bytes

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


WTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
COLS = [(n, 1, 1) for n in range(1, 10)] + [(2, 2, 2)]
# every column count on torch and, for f32, on Triton; the 16-bit weights on Triton at the compile variants'
# edges (1, 2 and 8 padded columns, the thin 9-column path, a batched activation): the interpreter is slow
PAIR_CASES = ([("torch", w, c) for w in WTYPES for c in COLS] + [("triton", "f32", c) for c in COLS]
              + [("triton", w, c) for w in ("f16", "bf16") for c in [(1, 1, 1), (2, 1, 1), (8, 1, 1), (9, 1, 1),
                                                                     (2, 2, 2)]])


@pytest.mark.parametrize("backend,wtype,cols", PAIR_CASES, ids=[f"{b}-{w}-{c}" for b, w, c in PAIR_CASES])
def test_mat_vec_pair(backend, wtype, cols):
    """Each product of the pair has the bytes of its MUL_MAT alone (up to 16 columns of these 12 rows: the Triton
    mat-vec's thin path)."""
    backend, wtype = {"torch": TORCH_BACKEND, "triton": TRITON_BACKEND}[backend], WTYPES[wtype]
    a = Arena()
    M, K = 12, 200  # K is not a multiple of the K step; few rows: one interpreter program each
    w_a, w_b = a.put(rnd(1, 1, M, K).to(wtype)), a.put(rnd(1, 1, M, K).to(wtype))
    n1, n2, n3 = cols
    x = a.put(rnd(n3, n2, n1, K), row_stride=K + 24)  # activation columns with gaps
    out_a, out_b, want_a, want_b = (a.view((n3, n2, n1, M)) for _ in range(4))
    a.run(lambda: backend[Op.MUL_MAT_VEC_PAIR](node(Op.MUL_MAT_VEC_PAIR), [w_a, x, w_b, out_b], out_a),
          out_a, out_b)
    backend[Op.MUL_MAT](node(Op.MUL_MAT), [w_a, x], want_a)
    backend[Op.MUL_MAT](node(Op.MUL_MAT), [w_b, x], want_b)
    assert_same_bytes(out_a, want_a, "first product")
    assert_same_bytes(out_b, want_b, "second product")
    for got, w in ((out_a, w_a), (out_b, w_b)):
        assert_close(got, (x.double() @ w.double().transpose(-1, -2)).float())  # the same upcast weights, in f64
