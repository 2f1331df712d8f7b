"""GATED_DELTA_NET_CACHE's record: what the fused node carries and writes, its launches, adapters, scope and cost.

The node reads GATED_DELTA_NET's sources ``(q, k, v, g, beta, state)`` and writes the op's scores (its own memory: a
view of the GATED_DELTA_NET output's first ``S*H_v x n_t*n_s`` elements) and, through ``outs``, the CPY that copied
the op's first ``min(n_t, K)`` snapshot slots into the recurrent cache: the states go straight into the cache rows,
as upstream's ggml-cuda writes them since mid-2026. The op's own slots are never written. op_params: ``K`` (the
op's snapshot slots) and ``replaced``. The kernel is GATED_DELTA_NET's own (:func:`gdnpass.kernels.triton_ssm.
gated_delta_net` with ``snapshots``), so the states' bytes are the unfused op's: it stays in the ssm family. Pure
Python: the adapters and :func:`programs` import torch and Triton when called.
"""

from __future__ import annotations

from gdnpass.ir import DType, Op, Tensor, fused_op, one_to_one
from gdnpass.patterns.record import INT, REPLACED, FusedOp, need

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


def _check(n: Tensor) -> None:
    need(len(n.outs) == 1, n, f"outs must hold the cache destination of the snapshots, has {len(n.outs)}")
    v, dst, K = n.src[2], n.outs[0], n.op_params["K"]
    S, H_v, n_t, n_s = v.ne
    need(K >= 1, n, f"K must be >= 1, is {K}")
    need(n.type is DType.F32 and n.ne == (S * H_v, n_t * n_s, 1, 1) and n.is_contiguous(), n,
         f"the scores must be f32 [{S * H_v}, {n_t * n_s}] packed, are {n.type.label} {n.ne}")
    need(dst.type is DType.F32 and fits(dst, v, K), n, f"the snapshots' destination {dst.name!r} must be f32 {list(snapshot_shape(v, K))} with "
                             f"contiguous rows, is {dst.type.label} {list(dst.ne)}")


def _views(views: list):
    *src, dst = views
    return src, dst


def _torch(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels import reference as ref

    src, dst = _views(views)
    K = node.op_params["K"]
    res = ref.gated_delta_net(*src, K).reshape(-1)  # computed in full before anything is written
    n_scores, n_snap = out.numel(), dst.numel()
    out.copy_(res[:n_scores].view(out.shape))
    dst.copy_(res[n_scores:n_scores + n_snap].view(dst.shape))


def _triton(node: Tensor, views: list, out) -> None:
    from gdnpass.kernels import triton_ssm

    src, dst = _views(views)
    triton_ssm.gated_delta_net(*src, node.op_params["K"], out, snapshots=dst)


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
    src=("q", "k", "v", "g", "beta", "state"),
    outs="the CPY of the first min(n_t, K) snapshot slots into the recurrent cache (its destination's bytes)",
    params={"K": INT, "replaced": REPLACED},
    check=_check,
    launches=lambda n: 1,
    torch=_torch,
    triton=_triton,
    scope=fits,
    doc="GATED_DELTA_NET writing its state snapshots straight into the cache rows (no CPY)",
    programs=programs,
    interpreter_s={},  # GATED_DELTA_NET's own ("gdn": gdnpass.cli.INTERPRETER_S)
    watch=watch,
)
