"""The fused ops, one record each: everything gdnpass knows about a fused node lives here.

A record says which tensors the node reads (``src``, in order) and which it writes besides itself (``outs``), which
parameters it carries and how they must agree with those tensors, how many kernel launches it costs, how it runs
(the torch reference adapter and the Triton adapter) and the scope of its kernel (read by its matcher). The graph
file loader, the shape rules, the executor, the launch counts and ``gdnpass dump`` all ask the record, so adding a
pattern is one matcher file, one kernel and one record.

Adapters have the executor's signature ``fn(node, views, out)``: ``views`` are the torch views of ``node.src`` then
``node.outs``, ``out`` the view of the node's own (primary output) memory. They import torch and Triton only when a
graph runs: building, planning and fusing a graph need neither.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from gdnpass.errors import GraphError
from gdnpass.ir import DType, Op, Tensor
from gdnpass.kernels import limits

Adapter = Callable[[Tensor, list, Any], None]


@dataclass(frozen=True)
class Param:
    """One op_params key: a predicate on its value and how to say what it must be."""

    ok: Callable[[Any], bool]
    what: str
    optional: bool = False


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


INT = Param(_is_int, "an int")
NUM = Param(lambda x: (_is_int(x) or isinstance(x, float)) and math.isfinite(x) and x >= 0, "a finite number >= 0")
BOOL = Param(lambda x: isinstance(x, bool), "a bool")
NAMES = Param(lambda x: isinstance(x, list) and all(isinstance(s, str) for s in x), "a list of names")
INTS = Param(lambda x: isinstance(x, list) and all(_is_int(v) for v in x), "a list of ints")


@dataclass(frozen=True)
class FusedOp:
    op: Op
    src: tuple[str, ...]                 # what each src slot holds
    outs: str                            # what ``outs`` holds
    params: dict[str, Param]
    check: Callable[[Tensor], None]      # params vs the node's tensors; raises GraphError
    launches: Callable[[Tensor], int]    # kernel launches of one execution
    torch: Adapter
    triton: Adapter
    scope: Any = None                    # the kernel's limits (gdnpass.kernels.limits)
    doc: str = ""

    def validate(self, n: Tensor) -> None:
        """Everything a fused node must carry, so that a damaged or hand-edited graph file never reaches a kernel
        (its legality was decided by its matcher; this checks only that it is well formed)."""
        where = f"node {n.name!r} ({n.op.value})"
        if len(n.src) != len(self.src) or any(s is None for s in n.src):
            raise GraphError(f"{where}: needs {len(self.src)} sources ({', '.join(self.src)}), has {len(n.src)}")
        if n.view_src is None or n.view_src.view_src is not None or n.view_offs != 0:
            raise GraphError(f"{where}: must be a view of its primary output (offset 0)")
        for key, p in self.params.items():
            if key not in n.op_params:
                if p.optional:
                    continue
                raise GraphError(f"{where}: op_params lacks {key!r}")
            if not p.ok(n.op_params[key]):
                raise GraphError(f"{where}: op_params {key!r} must be {p.what}, got {n.op_params[key]!r}")
        self.check(n)


def _need(cond: bool, n: Tensor, msg: str) -> None:
    if not cond:
        raise GraphError(f"node {n.name!r} ({n.op.value}): {msg}")


# ---- GDN_CONV_CHAIN -------------------------------------------------------------------------------------------------


def _check_chain(n: Tensor) -> None:
    p, sc = n.op_params, limits.CHAIN
    states, ids, xt, w = n.src
    dc, n_t, cols, S, H_k = p["d_conv"], p["n_tokens"], p["columns"], p["head_dim"], p["n_k_heads"]
    C = w.ne[1]
    _need(dc in sc.d_conv, n, f"d_conv {dc} is not one of {sc.d_conv}")
    _need(1 <= n_t <= sc.max_tokens, n, f"n_tokens {n_t} is outside 1..{sc.max_tokens}")
    _need(1 <= len(cols) <= sc.max_rows and all(0 <= c <= n_t for c in cols), n,
          f"columns {cols} must be 1..{sc.max_rows} window columns in 0..n_tokens")
    _need(len(n.outs) == 2 + len(cols), n, f"outs must be q, k and one destination per column ({2 + len(cols)}), "
                                           f"has {len(n.outs)}")
    _need(all(t.type is DType.F32 for t in (states, xt, w, n, *n.outs)) and ids.type is DType.I32, n,
          "tensors must be f32 (ids i32)")
    _need(w.ne[:2] == (dc, C) and w.ne[2:] == (1, 1), n, f"weight {w.name!r} {w.ne} is not [d_conv={dc}, C]")
    _need(states.ne[0] == (dc - 1) * C, n, f"states {states.name!r} rows hold {states.ne[0]}, not (d_conv-1)*C")
    _need(xt.ne == (n_t, C, 1, 1), n, f"projection {xt.name!r} {xt.ne} is not [n_tokens={n_t}, C={C}]")
    _need(n.ne == (C, n_t, 1, 1), n, f"ne {n.ne} is not [C={C}, n_tokens={n_t}]")
    _need(ids.nelements >= 1, n, "ids is empty")
    _need(S >= 1 and S & (S - 1) == 0 and C % S == 0 and 1 <= H_k and 2 * S * H_k <= C, n,
          f"head_dim {S} / n_k_heads {H_k} do not split C = {C} into q and k heads")
    for out in n.outs[:2]:
        _need(out.ne == (S, H_k, n_t, 1), n, f"{out.name!r} {out.ne} is not [head_dim, n_k_heads, n_tokens]")
    for row in n.outs[2:]:
        _need(row.nelements == (dc - 1) * C, n, f"destination {row.name!r} does not hold (d_conv-1)*C elements")
    _need(p.get("norm", "l2") in NORMS, n, f"norm {p.get('norm')!r} is not one of {NORMS}")
    if p.get("norm") == "rms":
        _need(NUM.ok(p.get("scale")), n, "the RMS form needs op_params 'scale' (the SCALE after the RMS_NORM)")
    tile = p.get("tile")
    if tile is not None:
        _need(isinstance(tile, dict) and {"windows", "first", "n_cols"} <= set(tile), n,
              "op_params 'tile' must hold windows, first and n_cols")
        _need(all(_is_int(i) and 0 <= i < len(cols) for i in tile["windows"]), n, "tile windows index the columns")


NORMS = ("l2", "rms")  # L2_NORM(x, eps), or RMS_NORM(x, eps) then SCALE(scale): see matchers/conv_chain.py rule 9


def _chain_args(node: Tensor, views: list) -> tuple:
    """views [states, ids, x, w, q, k, *rows] -> (states, ids, x, w, rows, columns, eps)."""
    p = node.op_params
    return (*views[:4], views[6:], p["columns"], float(p["eps"]))


def _norm(p: dict) -> dict:
    """The q/k normalisation's form and SCALE factor; files written before the RMS form have no 'norm': L2."""
    form = p.get("norm", "l2")
    return {"norm": form, "qk_scale": float(p["scale"]) if form == "rms" else 1.0}


def _chain_torch(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels import reference as ref

    p = node.op_params
    # everything is computed before anything is written: rows and out may alias inputs. The snapshots are copied
    # window by window, in the CPYs' order, whatever the layout (op_params["tile"] only changes the Triton store)
    snapshots, y, q, k = ref.gdn_conv_chain_ref(*_chain_args(node, views), int(p["head_dim"]), int(p["n_k_heads"]),
                                                **_norm(p))
    for row, value in zip(views[6:], snapshots):
        row.copy_(value)
    out.copy_(y)
    views[4].copy_(q)
    views[5].copy_(k)


def _chain_triton(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels import triton_ssm

    p = node.op_params
    triton_ssm.gdn_conv_chain(*_chain_args(node, views), out, views[4], views[5], bool(p.get("l2_separate")),
                              p.get("tile"), **_norm(p))


CONV_CHAIN = FusedOp(
    op=Op.GDN_CONV_CHAIN,
    src=("states", "ids", "projection_t", "weight"),
    outs="q and k normalised (the L2_NORMs, or the SCALEs of the RMS form), then one conv-state destination per "
         "snapshot column",
    params={"d_conv": INT, "n_tokens": INT, "columns": INTS, "eps": NUM, "head_dim": INT, "n_k_heads": INT,
            "norm": Param(lambda x: x in NORMS, f"one of {NORMS}", optional=True),
            "scale": Param(NUM.ok, NUM.what, optional=True),
            "l2_separate": BOOL, "tile": Param(lambda x: isinstance(x, dict), "an object", optional=True),
            "replaced": Param(NAMES.ok, NAMES.what, optional=True)},
    check=_check_chain,
    # l2_separate: the q/k outputs sit on the projection the kernel reads, so the unfused norm kernels write them
    # after (L2_NORM twice, or RMS_NORM and SCALE twice)
    launches=lambda n: 1 + (2 * (2 if n.op_params.get("norm") == "rms" else 1) if n.op_params.get("l2_separate")
                            else 0),
    torch=_chain_torch,
    triton=_chain_triton,
    scope=limits.CHAIN,
    doc="GET_ROWS -> CONCAT -> snapshot CPYs -> SSM_CONV -> SILU -> q/k normalisation, in one kernel",
)


# ---- MUL_MAT_VEC_PAIR -----------------------------------------------------------------------------------------------


def _check_pair(n: Tensor) -> None:
    w_a, x, w_b = n.src
    _need(len(n.outs) == 1, n, f"outs must hold the second product, has {len(n.outs)}")
    b = n.outs[0]
    _need(w_a.type is w_b.type and w_a.ne == w_b.ne, n, f"weights {w_a.name!r} and {w_b.name!r} differ in type/shape")
    want = (w_a.ne[1], x.ne[1], x.ne[2], x.ne[3])
    _need(w_a.ne[0] == x.ne[0] and n.ne == want and b.ne == want and b.nb == n.nb, n,
          f"products {n.ne} / {b.ne} are not [{want}] of one layout")
    cols = x.ne[1] * x.ne[2] * x.ne[3]
    _need(w_a.ne[2] * w_a.ne[3] == 1 and limits.runs_as_mat_vec(w_a.ne[1], cols), n,
          f"{cols} columns of a {w_a.ne[:2]} weight: not a single-matrix mat-vec")


def _pair_torch(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels import reference as ref

    w_a, x, w_b, out_b = views
    a, b = ref.mul_mat(w_a, x), ref.mul_mat(w_b, x)
    out.copy_(a)
    out_b.copy_(b)


def _pair_triton(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels import triton_matvec

    w_a, x, w_b, out_b = views
    triton_matvec.mul_mat_vec_pair(w_a, w_b, x, out, out_b)


MAT_VEC_PAIR = FusedOp(
    op=Op.MUL_MAT_VEC_PAIR,
    src=("w_a", "x", "w_b"),
    outs="the second product",
    params={"replaced": Param(NAMES.ok, NAMES.what, optional=True)},
    check=_check_pair,
    launches=lambda n: 1,
    torch=_pair_torch,
    triton=_pair_triton,
    scope=limits.runs_as_mat_vec,
    doc="two thin MUL_MATs sharing their input, in one mat-vec launch",
)


RECORDS: dict[Op, FusedOp] = {r.op: r for r in (CONV_CHAIN, MAT_VEC_PAIR)}


def record(op: Op) -> FusedOp:
    try:
        return RECORDS[op]
    except KeyError:
        raise GraphError(f"op {op.value} is not a fused op") from None
