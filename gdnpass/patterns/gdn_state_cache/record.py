"""GATED_DELTA_NET_CACHE's record: what the fused node carries and writes, its launches, adapters, scope and cost.

The node reads GATED_DELTA_NET's sources ``(q, k, v, g, beta, state)`` and writes the op's scores (its own memory: a
view of the GATED_DELTA_NET output's first ``S*H_v x n_t*n_s`` elements) and, through ``outs``, the CPY that copied
the op's first ``min(n_t, K)`` snapshot slots into the recurrent cache: the states go straight into the cache rows,
as upstream's ggml-cuda writes them since mid-2026. The op's own slots are never written. op_params: ``K`` (the
op's snapshot slots) and ``replaced``; after the gdn_gates pattern, ``g_steps`` / ``beta_steps``: g (beta) is then
the input of the elementwise node that made the op's operand, its steps those of ELEMENTWISE_CHAIN, their side
operands after ``state`` (g's, then beta's, :func:`operands`), and the kernel computes the operand where it reads it;
after the gdn_state_gather pattern, ``gather``: ``state`` is the recurrent cache's rows ([S*S*H_v, n_rows]) and the
source after it the i32 row ids (one a sequence) the GET_ROWS before the op gathered by, which the kernel now does.
The kernel is GATED_DELTA_NET's own (:func:`gdnpass.kernels.triton_ssm.gated_delta_net` with ``snapshots``), so the
states' bytes are the unfused op's: it stays in the ssm family. Pure Python: the adapters and :func:`programs`
import torch and Triton when called.
"""

from __future__ import annotations

from gdnpass.ir import DType, Op, Tensor, fused_op, one_to_one
from gdnpass.patterns.elementwise_chain.scope import BINARY, MAX_SIDES, steps_fit
from gdnpass.patterns.record import BOOL, INT, REPLACED, FusedOp, Param, need

OP = fused_op("GATED_DELTA_NET_CACHE")
KERNEL = "gdnpass.kernels.triton_ssm.gated_delta_net"


def snapshot_shape(v: Tensor, K: int) -> tuple[int, int, int, int]:
    """The cache destination's ne the kernel stores: a state row ``S*S*H_v`` per sequence, a slot per ne2."""
    S, H_v, n_t, n_s = v.ne
    return (S * S * H_v, n_s, min(n_t, K), 1)


def fits(dst: Tensor, v: Tensor, K: int) -> bool:
    """The kernel's scope: a destination of :func:`snapshot_shape` whose rows are contiguous, any seq and slot
    strides (cache rows, slots whole cache rows apart) that keep every (sequence, slot) row apart: the rows of
    different sequences never alias (programs of different sequences store them). Its type, f32, is the matcher's
    rule of its own."""
    return (dst.ne == snapshot_shape(v, K) and dst.has_contiguous_rows()
            and one_to_one((dst.nb[0], dst.ne[0]), (dst.nb[1], dst.ne[1]), (dst.nb[2], dst.ne[2]), elem=dst.nb[0]))


STEPS = Param(lambda x: isinstance(x, list) and (not x or steps_fit(x, least=1)),
              "the steps of an elementwise node or chain (ELEMENTWISE_CHAIN's)", optional=True)


def gate_steps(n: Tensor) -> tuple[list[str], list[str]]:
    """The steps the kernel computes g and beta with (none: it reads the operands)."""
    return list(n.op_params.get("g_steps", [])), list(n.op_params.get("beta_steps", []))


def gathers(n: Tensor) -> bool:
    """Whether the node gathers its state from the cache rows (gdn_state_gather)."""
    return bool(n.op_params.get("gather", False))


def operands(n: Tensor, src: list) -> tuple[list, object, tuple, tuple]:
    """``src`` (node ``n``'s sources, or their views) as (q, k, v, g, beta, state), the state's row ids (None but
    where the node gathers), g's side operands, beta's."""
    at, ng = 6 + gathers(n), sum(s in BINARY for s in gate_steps(n)[0])
    return list(src[:6]), src[6] if gathers(n) else None, tuple(src[at:at + ng]), tuple(src[at + ng:])


def rebuilt(old: Tensor, six: list, ids, g_sides, beta_sides, params: dict, layer) -> Tensor:
    """The GATED_DELTA_NET_CACHE node ``old`` again (same memory, outputs and name) with other sources, laid out as
    :func:`operands` reads them, and op_params: what gdn_gates and gdn_state_gather rewrite it to."""
    src = [*six, *([] if ids is None else [ids]), *g_sides, *beta_sides]
    return Tensor(name=old.name, type=old.type, ne=old.ne, nb=old.nb, op=OP, op_params=params, src=src,
                  outs=list(old.outs), view_src=old.view_src, view_offs=0, layer=layer)


def rewritten(gdn: Tensor) -> list[Tensor]:
    """What a rebuilt node writes (a capture's ``written``): the GDN output (its scores, the node's own memory), the
    node it replaces (a view of those) and the cache rows of its snapshots."""
    return [gdn.view_src, gdn, *gdn.outs]


def _check(n: Tensor) -> None:
    need(len(n.outs) == 1, n, f"outs must hold the cache destination of the snapshots, has {len(n.outs)}")
    v, dst, K = n.src[2], n.outs[0], n.op_params["K"]
    S, H_v, n_t, n_s = v.ne
    g_steps, beta_steps = gate_steps(n)
    _, ids, g_sides, beta_sides = operands(n, n.src)
    need(len(beta_sides) == sum(s in BINARY for s in beta_steps) and len(g_sides) == sum(s in BINARY for s in g_steps),
         n, f"steps {g_steps} / {beta_steps} read a side operand each binary step after the state (and its ids), the "
            f"node has {len(n.src) - 6}")
    if ids is not None:
        cache = n.src[5]
        need(ids.type is DType.I32 and ids.nelements == n_s and cache.ne[0] == S * S * H_v
             and cache.has_contiguous_rows() and cache.ne[2] == cache.ne[3] == 1, n,
             f"gathers its state: {n_s} i32 ids into contiguous rows of {S * S * H_v}, has {ids.nelements} "
             f"{ids.type.label} into {list(cache.ne)}")
    heads = H_v * n_t * n_s
    need(n.src[3].nelements in (heads, S * heads) and n.src[4].nelements == heads, n,
         f"g must hold {heads} or {S * heads} elements and beta {heads}, have {n.src[3].nelements} and "
         f"{n.src[4].nelements}")
    need(K >= 1, n, f"K must be >= 1, is {K}")
    need(n.type is DType.F32 and n.ne == (S * H_v, n_t * n_s, 1, 1) and n.is_contiguous(), n,
         f"the scores must be f32 [{S * H_v}, {n_t * n_s}] packed, are {n.type.label} {n.ne}")
    need(dst.type is DType.F32 and fits(dst, v, K), n, f"the snapshots' destination {dst.name!r} must be f32 {list(snapshot_shape(v, K))} with "
                             f"contiguous rows, is {dst.type.label} {list(dst.ne)}")


def _views(views: list):
    *src, dst = views
    return src, dst


def _gates(node: Tensor, src: list) -> list:
    """The torch views of the six operands: g and beta computed by their elementwise references where the node has
    steps (then reshaped to the op's operand shapes: the operand was a packed reshape of that node's output)."""
    from gdnpass.patterns.elementwise_chain.record import reference as chain

    g_steps, beta_steps = gate_steps(node)
    (q, k, v, g, beta, state), ids, g_sides, beta_sides = operands(node, src)
    n_s, n_t, H_v, S = v.shape
    if ids is not None:  # the GET_ROWS the node took: its rows of the cache
        state = state[0, 0][ids.reshape(-1).long()].reshape(n_s, H_v, S, S)
    if g_steps:
        g = chain(g_steps, g, list(g_sides)).reshape(n_s, n_t, H_v, g.numel() // (H_v * n_t * n_s))
    if beta_steps:
        beta = chain(beta_steps, beta, list(beta_sides)).reshape(n_s, n_t, H_v, 1)
    return [q, k, v, g, beta, state]


def _torch(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels import reference as ref

    src, dst = _views(views)
    K = node.op_params["K"]
    res = ref.gated_delta_net(*_gates(node, src), K).reshape(-1)  # computed in full before anything is written
    n_scores, n_snap = out.numel(), dst.numel()
    out.copy_(res[:n_scores].view(out.shape))
    dst.copy_(res[n_scores:n_scores + n_snap].view(dst.shape))


def _triton(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels import triton_ssm

    src, dst = _views(views)
    g_steps, beta_steps = gate_steps(node)
    six, ids, g_sides, beta_sides = operands(node, src)
    if ids is not None:  # the cache's rows, each [S, S, H_v] (a view: the snapshots go into the same rows)
        S, H_v = six[2].shape[3], six[2].shape[2]
        six[5], ids = six[5][0, 0].unflatten(-1, (H_v, S, S)), ids.reshape(-1)
    triton_ssm.gated_delta_net(*six, node.op_params["K"], out, snapshots=dst, g_steps=tuple(g_steps), g_sides=g_sides,
                               beta_steps=tuple(beta_steps), beta_sides=beta_sides, state_ids=ids)


def programs(node: Tensor) -> list[tuple[str, int, int]]:
    """GATED_DELTA_NET's programs (the same kernel)."""
    from gdnpass.kernels import triton_ssm

    return triton_ssm.gdn_programs(node.src[2])


def watch(n: Tensor) -> bool:
    """What ``run --check`` compares: every GATED_DELTA_NET output (the fused node writes its scores) and every CPY
    of a view of one (the states, wherever they go; in a cache they are compared as the cache too)."""
    copies_gdn = n.op is Op.CPY and n.src[0].view_src is not None and n.src[0].view_src.op is Op.GATED_DELTA_NET
    return n.op is Op.GATED_DELTA_NET or copies_gdn


RECORD = FusedOp(
    op=OP,
    src=("q", "k", "v", "g", "beta", "state", "ids or side1", *(f"side{i}" for i in range(2, 2 * MAX_SIDES + 2))),
    optional_src=2 * MAX_SIDES + 1,  # the state's ids (gather), then the gates' side operands (g's, then beta's)
    outs="the CPY of the first min(n_t, K) snapshot slots into the recurrent cache (its destination's bytes)",
    params={"K": INT, "replaced": REPLACED, "g_steps": STEPS, "beta_steps": STEPS,
            "gather": Param(BOOL.ok, BOOL.what, optional=True)},
    check=_check,
    launches=lambda n: 1,
    torch=_torch,
    triton=_triton,
    scope=fits,
    doc="GATED_DELTA_NET writing its state snapshots straight into the cache rows (no CPY), computing its gates "
        "from their elementwise node's inputs (gdn_gates) and gathering its state row from the cache "
        "(gdn_state_gather)",
    programs=programs,
    interpreter_s={},  # GATED_DELTA_NET's own ("gdn": gdnpass.cli.INTERPRETER_S)
    watch=watch,
    variant=lambda n: " ".join([f"{k}={' -> '.join(v)}" for k, v in zip(("g", "beta"), gate_steps(n)) if v]
                               + (["state gathered"] if gathers(n) else [])),
)
