"""GDN_CONV_CHAIN's record: what the fused node carries and writes, its launches, adapters, scope and cost.

The kernel is :func:`gdnpass.kernels.triton_ssm.gdn_conv_chain`: it stays in the SSM kernel family, beside SSM_CONV,
because it computes with the unfused kernels' helpers through the exactness core and launches the unfused norm
kernels itself for ``l2_separate`` (see :mod:`gdnpass.patterns`). Pure Python: the adapters and :func:`programs`
import torch and Triton when called.
"""

from __future__ import annotations

from gdnpass.ir import DType, Op, Tensor, fused_op
from gdnpass.kernels import limits
from gdnpass.opspec import BOOL, INT, INTS, NONNEG, REPLACED, Param
from gdnpass.opspec.vocab import is_int
from gdnpass.patterns.record import FusedOp, need

OP = fused_op("GDN_CONV_CHAIN")
NORMS = ("l2", "rms")  # L2_NORM(x, eps), or RMS_NORM(x, eps) then SCALE(scale): see matcher.py rule 7
KERNEL = "gdnpass.kernels.triton_ssm.gdn_conv_chain"


def _check(n: Tensor) -> None:
    p, sc = n.op_params, limits.CHAIN
    states, ids, xt, w = n.src
    dc, n_t, cols, S, H_k = p["d_conv"], p["n_tokens"], p["columns"], p["head_dim"], p["n_k_heads"]
    C, n_s = w.ne[1], n.ne[2]
    need(1 <= n_s <= sc.max_seqs, n, f"{n_s} sequences: outside 1..{sc.max_seqs}")
    need(dc in sc.d_conv, n, f"d_conv {dc} is not one of {sc.d_conv}")
    need(1 <= n_t <= sc.max_tokens, n, f"n_tokens {n_t} is outside 1..{sc.max_tokens}")
    need(1 <= len(cols) <= sc.max_rows and all(0 <= c <= n_t for c in cols), n,
         f"columns {cols} must be 1..{sc.max_rows} window columns in 0..n_tokens")
    need(len(n.outs) == 2 + len(cols), n, f"outs must be q, k and one destination per column ({2 + len(cols)}), "
                                          f"has {len(n.outs)}")
    need(all(t.type is DType.F32 for t in (states, xt, w, n, *n.outs)) and ids.type is DType.I32, n,
         "tensors must be f32 (ids i32)")
    need(w.ne[:2] == (dc, C) and w.ne[2:] == (1, 1), n, f"weight {w.name!r} {w.ne} is not [d_conv={dc}, C]")
    need(states.ne[0] == (dc - 1) * C, n, f"states {states.name!r} rows hold {states.ne[0]}, not (d_conv-1)*C")
    need(xt.ne == (n_t, C, n_s, 1), n, f"projection {xt.name!r} {xt.ne} is not [n_tokens={n_t}, C={C}, n_s={n_s}]")
    need(n.ne[:2] == (C, n_t) and n.ne[3] == 1, n, f"ne {n.ne} is not [C={C}, n_tokens={n_t}, n_s]")
    need(ids.ne == (n_s, 1, 1, 1), n, f"ids {ids.name!r} {ids.ne} is not one row id per sequence ({n_s})")
    heads = sc.heads(S, H_k, C)
    need(heads is None, n, f"head_dim {S} / n_k_heads {H_k}: {heads}")
    for out in n.outs[:2]:
        need(out.ne == (S, H_k, n_t, n_s), n, f"{out.name!r} {out.ne} is not [head_dim, n_k_heads, n_tokens, n_s]")
    for row in n.outs[2:]:
        need(row.nelements == (dc - 1) * C * n_s, n,
             f"destination {row.name!r} does not hold (d_conv-1)*C elements per sequence")
    need(p.get("norm", "l2") in NORMS, n, f"norm {p.get('norm')!r} is not one of {NORMS}")
    if p.get("norm") == "rms":
        need(NONNEG.ok(p.get("scale")), n, "the RMS form needs op_params 'scale' (the SCALE after the RMS_NORM)")
    tile = p.get("tile")
    if tile is not None:
        need(isinstance(tile, dict) and {"windows", "first", "n_cols"} <= set(tile), n,
             "op_params 'tile' must hold windows, first and n_cols")
        need(all(is_int(i) and 0 <= i < len(cols) for i in tile["windows"]), n, "tile windows index the columns")


def _args(node: Tensor, views: list) -> tuple:
    """views [states, ids, x, w, q, k, *rows] -> (states, ids, x, w, rows, columns, eps)."""
    p = node.op_params
    return (*views[:4], views[6:], p["columns"], float(p["eps"]))


def _norm(p: dict) -> dict:
    """The q/k normalisation's form and SCALE factor; files written before the RMS form have no 'norm': L2."""
    form = p.get("norm", "l2")
    return {"norm": form, "qk_scale": float(p["scale"]) if form == "rms" else 1.0}


def _torch(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels import reference as ref

    p = node.op_params
    # everything is computed before anything is written: rows and out may alias inputs. The snapshots are copied
    # window by window, in the CPYs' order, whatever the layout (op_params["tile"] only changes the Triton store)
    snapshots, y, q, k = ref.gdn_conv_chain_ref(*_args(node, views), int(p["head_dim"]), int(p["n_k_heads"]),
                                                **_norm(p))
    for row, value in zip(views[6:], snapshots):
        row.copy_(value)
    out.copy_(y)
    views[4].copy_(q)
    views[5].copy_(k)


def _triton(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels import triton_ssm

    p = node.op_params
    triton_ssm.gdn_conv_chain(*_args(node, views), out, views[4], views[5], bool(p.get("l2_separate")),
                              p.get("tile"), **_norm(p))


def _launches(n: Tensor) -> int:
    # l2_separate: the q/k outputs sit on the projection the kernel reads, so the unfused norm kernels write them
    # after (L2_NORM twice, or RMS_NORM and SCALE twice)
    return 1 + (2 * (2 if n.op_params.get("norm") == "rms" else 1) if n.op_params.get("l2_separate") else 0)


def programs(node: Tensor) -> list[tuple[str, int, int]]:
    """The Triton programs of one execution (steps: tokens); ``l2_separate`` adds the norm kernels' launches, as
    their own families count them. Pure: reads shapes only."""
    from gdnpass.kernels import triton_norms, triton_ssm

    p = node.op_params
    C, n_t, n_s, S, dc = node.ne[0], int(p["n_tokens"]), node.ne[2], int(p["head_dim"]), int(p["d_conv"])
    out = [(f"chain{dc}", C // triton_ssm.chain_block(n_s, S, dc, n_t), n_t)]
    if p.get("l2_separate"):
        block_r, _ = triton_norms.l2_tile(S)
        out.append(("l2_norm", 2 * -(-(n_t * n_s * int(p["n_k_heads"])) // block_r), 1))
    return out


def watch(n: Tensor) -> bool:
    """What ``run --check`` compares for the chain: the SiLU (any UNARY) of every SSM_CONV, and the q/k norms in
    either form (L2_NORM, or the SCALE of an RMS_NORM); the snapshot rows are compared with the whole caches."""
    return (n.op is Op.UNARY and n.src[0].op is Op.SSM_CONV
            or n.op is Op.L2_NORM or n.op is Op.SCALE and n.src[0].op is Op.RMS_NORM)


QK_FORMS = {"rms": "RMS_NORM + SCALE (upstream)", "l2": "L2_NORM"}


def variant(t: Tensor) -> str:
    """dump's note: the q/k form, and the later-launch fallback."""
    p = t.op_params
    return f" [q/k {QK_FORMS[p.get('norm', 'l2')]}{', l2_separate' if p.get('l2_separate') else ''}]"


RECORD = FusedOp(
    op=OP,
    src=("states", "ids", "projection_t", "weight"),
    outs="q and k normalised (the L2_NORMs, or the SCALEs of the RMS form), then one conv-state destination per "
         "snapshot column",
    params={"d_conv": INT, "n_tokens": INT, "columns": INTS, "eps": NONNEG, "head_dim": INT, "n_k_heads": INT,
            "norm": Param(lambda x: x in NORMS, f"one of {NORMS}", optional=True),
            "scale": Param(NONNEG.ok, NONNEG.what, optional=True),
            "l2_separate": BOOL, "tile": Param(lambda x: isinstance(x, dict), "an object", optional=True),
            "replaced": REPLACED},
    check=_check,
    launches=_launches,
    torch=_torch,
    triton=_triton,
    scope=limits.CHAIN,
    doc="GET_ROWS -> CONCAT -> snapshot CPYs -> SSM_CONV -> SILU -> q/k normalisation, in one kernel",
    programs=programs,
    # seconds per program: 4-tap conv ~60-95 ms at 8 tokens (gdnpass.cli.INTERPRETER_S measures the others)
    interpreter_s={"chain": (0.026, 0.010)},
    watch=watch,
    variant=variant,
    extra_launches=("l2_separate", "q/k norm"),
)
