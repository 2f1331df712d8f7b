"""The shape/type rule of every base op: given a node's sources, op_params and (for views) its requested shape, a rule
checks what ggml asserts and returns the result's type, ne, nb and view placement. The constructors
(:mod:`gdnpass.ops`) fill a new tensor from it and :func:`gdnpass.ops.validate_node` re-runs it on an existing node,
so a constructor can never build what the validator rejects. Each rule is its op's :attr:`OpSpec.shape`; it takes
the spec too, for the parameter keys it requires.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdnpass.ir import (GGML_MAX_DIMS, DType, Glu, GraphError, Op, Prec, Tensor, Unary, contiguous_strides,
                        is_contiguous_n)
from gdnpass.kernels.limits import mat_vec_weight
from gdnpass.opspec.vocab import OpSpec

NE = tuple[int, int, int, int]


@dataclass(frozen=True)
class Shape:
    """What a rule says a node must be."""

    type: DType
    ne: NE
    nb: NE
    view_of: Tensor | None = None  # the tensor the result views (its base becomes view_src)
    view_offs: int = 0             # offset relative to view_of


def req(cond: bool, node: Tensor, msg: str) -> None:
    if not cond:
        raise GraphError(f"node {node.name!r} ({node.op.value}): {msg}")


def pad4(ne) -> NE:
    ne = tuple(int(x) for x in ne)
    if len(ne) > GGML_MAX_DIMS:
        raise GraphError(f"too many dimensions: {ne}")
    return ne + (1,) * (GGML_MAX_DIMS - len(ne))  # type: ignore[return-value]


def _new_shape(type_: DType, ne) -> Shape:
    ne = pad4(ne)
    return Shape(type_, ne, contiguous_strides(type_, ne))


def can_repeat(b: Tensor, a: Tensor) -> bool:
    """ggml_can_repeat(b, a): b broadcasts to a."""
    if b.is_empty:
        return a.is_empty
    return all(b.ne[i] != 0 and a.ne[i] % b.ne[i] == 0 for i in range(GGML_MAX_DIMS))


def _nsrc(node: Tensor, n: int) -> None:
    req(len(node.src) == n and all(s is not None for s in node.src), node, f"expects {n} sources, has {len(node.src)}")


def _srcs(node: Tensor, need: int, most: int) -> list[Tensor | None]:
    """The ``most`` source slots (missing trailing ones are None); the first ``need`` must be set."""
    src = list(node.src)
    req(need <= len(src) <= most and all(s is not None for s in src[:need]), node,
         f"expects {need} to {most} sources (the first {need} set), has {len(src)}")
    return src + [None] * (most - len(src))


def _divides(d: int, n: int) -> bool:
    """``n % d == 0`` as ggml's broadcast asserts mean it; a zero divisor is rejected (ggml would divide by zero)."""
    return d != 0 and n % d == 0


def _rows_contiguous(t: Tensor) -> bool:
    """ggml_is_contiguous_rows (the block size of every type modelled here is 1)."""
    return t.ne[0] == 1 or t.nb[0] == t.type.size


def _params(node: Tensor, *keys: str) -> None:
    missing = [k for k in keys if k not in node.op_params]
    req(not missing, node, f"op_params lack {', '.join(map(repr, missing))}")


def _same_or_view(n: Tensor, a: Tensor) -> Shape:
    """The result of ggml_dup_tensor(a), or of ggml_view_tensor(a) for the in-place variant."""
    if n.op_params.get("inplace"):
        return Shape(a.type, a.ne, a.nb, a, 0)
    return _new_shape(a.type, a.ne)


# ---------------------------------------------------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------------------------------------------------


def rule_view(n: Tensor, spec: OpSpec) -> Shape:
    _nsrc(n, 1)
    a = n.src[0]
    off = int(n.op_params.get("offset", 0))
    req(off >= 0, n, f"negative view offset {off}")
    # strides may be 0 (empty views) or overlap (ggml allows both), never negative
    req(all(x >= 0 for x in n.ne) and n.nb[0] > 0 and all(x >= 0 for x in n.nb), n, f"bad view ne {n.ne} / nb {n.nb}")
    base = a.base
    end = a.view_offs + off + n.nbytes
    req(end <= base.nbytes or n.is_empty, n,
         f"view [{a.view_offs + off}, {end}) runs past its base {base.name!r} ({base.nbytes} bytes)")
    return Shape(a.type, n.ne, n.nb, a, off)


def rule_reshape(n: Tensor, spec: OpSpec) -> Shape:
    _nsrc(n, 1)
    a = n.src[0]
    req(a.is_contiguous(), n, f"source {a.name!r} is not contiguous")
    req(a.nelements == n.nelements, n, f"reshape {a.ne} -> {n.ne} changes the element count")
    return Shape(a.type, n.ne, contiguous_strides(a.type, n.ne), a, 0)


def rule_transpose(n: Tensor, spec: OpSpec) -> Shape:
    _nsrc(n, 1)
    a = n.src[0]
    return Shape(a.type, (a.ne[1], a.ne[0], a.ne[2], a.ne[3]), (a.nb[1], a.nb[0], a.nb[2], a.nb[3]), a, 0)


def rule_permute(n: Tensor, spec: OpSpec) -> Shape:
    _nsrc(n, 1)
    a = n.src[0]
    axes = tuple(n.op_params.get("axes", (0, 1, 2, 3)))
    req(sorted(axes) == [0, 1, 2, 3], n, f"permute axes {axes} are not a permutation of 0..3")
    ne = [0] * 4
    nb = [0] * 4
    for i, ax in enumerate(axes):
        ne[ax] = a.ne[i]
        nb[ax] = a.nb[i]
    return Shape(a.type, tuple(ne), tuple(nb), a, 0)  # type: ignore[arg-type]


def rule_cont(n: Tensor, spec: OpSpec) -> Shape:
    _nsrc(n, 1)
    a = n.src[0]
    req(a.nelements == n.nelements, n, f"cont {a.ne} -> {n.ne} changes the element count")
    return _new_shape(a.type, n.ne)


def rule_cpy(n: Tensor, spec: OpSpec) -> Shape:
    _nsrc(n, 2)
    a, b = n.src
    req(a.nelements == b.nelements, n, f"{a.name!r} has {a.nelements} elements, destination {b.name!r} {b.nelements}")
    req(a.type is DType.F32 or a.type is b.type, n, f"copy {a.type.label} -> {b.type.label} is not supported")
    req(b.type in (DType.F32, DType.F16, DType.BF16, DType.I32), n, f"bad destination type {b.type.label}")
    return Shape(b.type, b.ne, b.nb, b, 0)


def rule_get_rows(n: Tensor, spec: OpSpec) -> Shape:
    _nsrc(n, 2)
    a, b = n.src
    req(b.type is DType.I32, n, f"row ids {b.name!r} must be i32, not {b.type.label}")
    req(a.ne[2] == b.ne[1] and a.ne[3] == b.ne[2] and b.ne[3] == 1, n, f"ids {b.ne} do not match rows of {a.ne}")
    out = DType.I32 if a.type is DType.I32 else DType.F32  # ggml: "TODO: implement non F32 return"
    return _new_shape(out, (a.ne[0], b.ne[0], b.ne[1], b.ne[2]))


def rule_set_rows(n: Tensor, spec: OpSpec) -> Shape:
    """ggml_set_rows(a, b, c): row i of b goes to row c[i] of a. ``src`` is (b, c, a), ggml's (legacy) order, and the
    result is a view of the destination a (as CPY's is of its destination)."""
    _nsrc(n, 3)
    b, c, a = n.src
    req(a.ne[0] == b.ne[0] and a.ne[2] == b.ne[2] and a.ne[3] == b.ne[3], n,
         f"rows {b.name!r} {b.ne} do not fit destination {a.name!r} {a.ne}")
    req(b.ne[1] == c.ne[0], n, f"{b.ne[1]} rows but {c.ne[0]} ids")
    req(_divides(c.ne[1], b.ne[2]) and _divides(c.ne[2], b.ne[3]) and c.ne[3] == 1, n,
         f"ids {c.name!r} {c.ne} do not broadcast over rows {b.ne}")
    req(b.type in (DType.F32, DType.F16), n, f"rows {b.name!r} must be f32 or f16, not {b.type.label}")
    req(c.type in (DType.I64, DType.I32), n, f"row ids {c.name!r} must be i64 or i32, not {c.type.label}")
    req(_rows_contiguous(a) and _rows_contiguous(b), n, "destination and rows need contiguous rows")
    return Shape(a.type, a.ne, a.nb, a, 0)


def rule_concat(n: Tensor, spec: OpSpec) -> Shape:
    _nsrc(n, 2)
    a, b = n.src
    dim = int(n.op_params.get("dim", -1))
    req(0 <= dim < GGML_MAX_DIMS, n, f"concat dim {dim} out of range")
    req(a.type is b.type, n, f"source types differ ({a.type.label}, {b.type.label})")
    for d in range(GGML_MAX_DIMS):
        if d != dim:
            req(a.ne[d] == b.ne[d], n, f"ne[{d}] differs ({a.ne[d]} vs {b.ne[d]})")
    ne = list(a.ne)
    ne[dim] = a.ne[dim] + b.ne[dim]
    return _new_shape(a.type, ne)


def rule_same(n: Tensor, spec: OpSpec) -> Shape:
    """SCALE, UNARY, norms: the result has the source's shape (in place: a view of it)."""
    a = n.src[0]
    if n.op is Op.UNARY:
        req(is_contiguous_n(a, 1), n, f"source {a.name!r} must have contiguous rows")
        req(n.op_params.get("kind") in {u.value for u in Unary}, n, f"unknown unary kind {n.op_params.get('kind')!r}")
    if n.op in (Op.RMS_NORM, Op.L2_NORM):
        req(a.has_contiguous_rows(), n, f"source {a.name!r} must have nb[0] == type size")
        req(float(n.op_params.get("eps", -1.0)) >= 0.0, n, "eps missing or negative")
    req(a.type is DType.F32, n, f"source {a.name!r} must be f32")
    if n.op_params.get("inplace"):
        return Shape(a.type, a.ne, a.nb, a, 0)
    return _new_shape(a.type, a.ne)


def rule_binary(n: Tensor, spec: OpSpec) -> Shape:
    """ADD, MUL, DIV (ggml_add_impl / mul / div): b broadcasts to a by tiling; the result is a's shape."""
    _nsrc(n, 2)
    a, b = n.src
    req(can_repeat(b, a), n, f"{b.name!r} {b.ne} does not broadcast to {a.name!r} {a.ne}")
    req(a.type is DType.F32 and b.type is DType.F32, n, f"{n.op.value} is modelled for f32 only")
    if n.op_params.get("inplace"):
        return Shape(a.type, a.ne, a.nb, a, 0)
    return _new_shape(a.type, a.ne)


def rule_unary_src(n: Tensor, spec: OpSpec) -> Shape:
    _nsrc(n, 1)
    return rule_same(n, spec)


def rule_mul_mat(n: Tensor, spec: OpSpec) -> Shape:
    _nsrc(n, 2)
    a, b = n.src
    req(a.ne[0] == b.ne[0], n, f"inner dims differ: {a.name!r} ne0={a.ne[0]}, {b.name!r} ne0={b.ne[0]}")
    req(_divides(a.ne[2], b.ne[2]) and _divides(a.ne[3], b.ne[3]), n, "batch dims do not broadcast")
    req(a.ne[0] % a.type.block == 0, n, f"weight {a.name!r}: rows of {a.ne[0]} are not whole {a.type.label} blocks "
                                        f"of {a.type.block}")
    req(a.nb[0] <= a.nb[1], n, f"weight {a.name!r} is transposed")
    req(mat_vec_weight(a.type), n, f"weight type {a.type.label} not supported")
    req(b.type is DType.F32, n, f"activation {b.name!r} must be f32")
    req(a.has_contiguous_rows() and b.has_contiguous_rows(), n, "sources need contiguous rows")
    req(n.op_params.get("prec", Prec.UNDEFINED.value) in {x.value for x in Prec}, n,
         f"unknown prec {n.op_params.get('prec')!r}")
    return _new_shape(DType.F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]))


def rule_soft_max(n: Tensor, spec: OpSpec) -> Shape:
    """ggml_soft_max_ext(a, mask, scale, max_bias) (+ ggml_soft_max_add_sinks): softmax(a * scale + mask) per row.
    ``src`` is (a, mask or None, sinks); the mask row i serves row i of a (it may have more rows: padding)."""
    a, mask, sinks = _srcs(n, 1, 3)
    _params(n, *spec.required())
    req(a.is_contiguous(), n, f"source {a.name!r} must be contiguous")
    if mask is not None:
        req(mask.ne[0] == a.ne[0] and mask.ne[1] >= a.ne[1], n, f"mask {mask.ne} does not cover {a.name!r} {a.ne}")
    _mask_and_sinks(n, mask, sinks, a, str(a.ne), (DType.F16, DType.F32))
    return _same_or_view(n, a)


def _mask_and_sinks(n: Tensor, mask: Tensor | None, sinks: Tensor | None, ref: Tensor, over: str, types) -> None:
    """What SOFT_MAX and FLASH_ATTN_EXT both assert of their mask (a contiguous ``types`` tensor broadcasting over
    ``ref``'s ne[2], ne[3]; needed for ALiBi) and their sinks (f32, one per head, ``ref.ne[2]``)."""
    if mask is not None:
        req(mask.type in types, n, f"mask {mask.name!r} must be {' or '.join(t.label for t in types)}, "
                                    f"not {mask.type.label}")
        req(mask.is_contiguous(), n, f"mask {mask.name!r} must be contiguous")
        req(_divides(mask.ne[2], ref.ne[2]) and _divides(mask.ne[3], ref.ne[3]), n,
             f"mask {mask.ne} does not broadcast over {over}")
    req(float(n.op_params["max_bias"]) <= 0.0 or mask is not None, n, "max_bias > 0 (ALiBi) needs a mask")
    if sinks is not None:
        req(sinks.ne[0] == ref.ne[2] and sinks.type is DType.F32, n,
             f"sinks {sinks.name!r} must be f32 with one value per head ({ref.ne[2]})")


# ---- the expert FFN's ops (issue 36): ggml.c's constructors and ggml-cpu's asserts at the pinned commit -----------

SORT_ORDERS = {0: "ASC", 1: "DESC"}  # enum ggml_sort_order, ARGSORT's word 0


def rule_argsort(n: Tensor, spec: OpSpec) -> Shape:
    """ggml_argsort(a, order): per row (ne0) of an f32 a, the i32 indices that sort it; a's ne, a new tensor."""
    _nsrc(n, 1)
    a = n.src[0]
    _params(n, *spec.required())
    order = n.op_params["order"]
    req(order in SORT_ORDERS, n, f"order {order!r} is not a ggml_sort_order (0 ASC, 1 DESC)")
    # (ggml-cpu reads row i at i * nb01: rows packed one after the other)
    req(a.type is DType.F32 and a.is_contiguous(), n, f"source {a.name!r} must be a contiguous f32 tensor")
    req(a.ne[0] <= 2**31 - 1, n, f"rows of {a.ne[0]} do not fit i32 indices")
    return _new_shape(DType.I32, a.ne)


def rule_sum_rows(n: Tensor, spec: OpSpec) -> Shape:
    """ggml_sum_rows(a): each row's sum, ne [1, ne1, ne2, ne3] (f32: the only type ggml-cpu sums)."""
    _nsrc(n, 1)
    a = n.src[0]
    req(a.type is DType.F32 and a.has_contiguous_rows(), n, f"source {a.name!r} must be f32 with contiguous rows")
    return _new_shape(DType.F32, (1, *a.ne[1:]))


def rule_clamp(n: Tensor, spec: OpSpec) -> Shape:
    """ggml_clamp(a, min, max) (ggml_clamp_inplace: a view of a): a's shape; bounds may be ±inf (BOUND). (ggml does
    not ask min <= max: MAX(MIN(x, max), min) is then min.)"""
    _nsrc(n, 1)
    a = n.src[0]
    _params(n, *spec.required())
    req(a.type is DType.F32 and a.has_contiguous_rows(), n, f"source {a.name!r} must be f32 with contiguous rows")
    return _same_or_view(n, a)


def rule_mul_mat_id(n: Tensor, spec: OpSpec) -> Shape:
    """ggml_mul_mat_id(as, b, ids): as [K, M, n_as] one matrix per expert, b [K, n_b, n_t] (n_b broadcast over the
    slots: ids.ne0 % n_b == 0), ids i32 [n_used, n_t] -> f32 [M, n_used, n_t]; slot e of token t is
    as[:, :, ids[e, t]] @ b[:, e % n_b, t]. ``src`` is (as, b, ids), ggml's order."""
    _nsrc(n, 3)
    w, b, ids = n.src
    req(ids.type is DType.I32, n, f"expert ids {ids.name!r} must be i32, not {ids.type.label}")
    req(w.ne[3] == 1 and b.ne[3] == 1 and ids.ne[2] == 1 and ids.ne[3] == 1, n,
         f"as {w.ne} and b {b.ne} must be 3-D, ids {ids.ne} 2-D")
    req(ids.ne[1] == b.ne[2], n, f"{ids.ne[1]} expert lists for {b.ne[2]} tokens")
    req(w.ne[0] == b.ne[0], n, f"inner dims differ: {w.name!r} ne0={w.ne[0]}, {b.name!r} ne0={b.ne[0]}")
    req(_divides(b.ne[1], ids.ne[0]), n, f"b's {b.ne[1]} rows per token do not broadcast over {ids.ne[0]} slots")
    req(w.ne[0] % w.type.block == 0, n, f"weight {w.name!r}: rows of {w.ne[0]} are not whole {w.type.label} blocks "
                                        f"of {w.type.block}")
    req(w.nb[0] <= w.nb[1], n, f"weight {w.name!r} is transposed")
    req(mat_vec_weight(w.type), n, f"weight type {w.type.label} not supported")
    req(b.type is DType.F32, n, f"activation {b.name!r} must be f32")
    req(w.has_contiguous_rows() and b.has_contiguous_rows(), n, "sources need contiguous rows")
    return _new_shape(DType.F32, (w.ne[1], ids.ne[0], b.ne[2], 1))


ROPE_MODES = {0: "NORMAL", 2: "NEOX", 8: "MROPE", 24: "VISION", 40: "IMROPE"}  # GGML_ROPE_TYPE_*
ROPE_TYPE_MROPE = 8  # a bit of the mode: VISION and IMROPE (qwen35's) are M-RoPE modes too


def rule_rope(n: Tensor, spec: OpSpec) -> Shape:
    """ggml_rope_impl (rope_ext, rope_multi): rotate the first n_dims of each row of a by the positions b. ``src`` is
    (a, b, freq factors or None). M-RoPE modes take 4 positions per token (``ne[2] * 4``) and 4 ``sections``."""
    a, b, c = _srcs(n, 2, 3)
    _params(n, *spec.required())
    p = n.op_params
    mode, n_dims = int(p["mode"]), int(p["n_dims"])
    req(mode & 1 == 0, n, f"mode {mode}: mode & 1 is no longer supported")
    req(b.ne[1] == b.ne[2] == b.ne[3] == 1 and b.type is DType.I32, n, f"positions {b.name!r} must be an i32 vector")
    n_offs = int(p.get("n_offs", 0))
    req(n_dims > 0 and n_dims % 2 == 0 and n_offs % 2 == 0 and 0 <= n_offs and n_offs + n_dims <= a.ne[0], n,
         f"n_dims {n_dims}, n_offs {n_offs} do not fit rows of {a.ne[0]} (even, within the row)")
    sections = list(p["sections"])
    req(len(sections) == 4, n, f"sections {sections} must be 4 ints")
    if mode & ROPE_TYPE_MROPE:
        req(b.ne[0] == a.ne[2] * 4, n, f"M-RoPE needs 4 positions per token: {b.ne[0]} for {a.ne[2]} tokens")
        req(all(int(v) >= 0 for v in sections) and any(sections[:3]) and sum(sections) <= a.ne[0], n,
             f"M-RoPE sections {sections} do not fit rows of {a.ne[0]} (non-negative, t/h/w not all zero)")
    else:
        req(b.ne[0] == a.ne[2], n, f"{b.ne[0]} positions for {a.ne[2]} tokens")
        req(sections == [0, 0, 0, 0], n, f"sections {sections} without M-RoPE (ggml stores zeros)")
    if c is not None:
        req(c.type is DType.F32 and c.ne[0] >= n_dims // 2, n,
             f"freq factors {c.name!r} must be f32 with at least n_dims/2 = {n_dims // 2} values")
    return _same_or_view(n, a)


def rule_flash_attn_ext(n: Tensor, spec: OpSpec) -> Shape:
    """ggml_flash_attn_ext (+ add_sinks, set_prec, set_n_kv_max). q [d_k, n_batch, n_head, ne3], k [d_k, n_kv,
    n_head_kv, ne3], v [d_v, n_kv, n_head_kv, ne3] (not transposed), mask f16 [n_kv, n_batch, ne32, ne33]; the
    result is permuted: f32 [d_v, n_head, n_batch, ne3]. ``src`` is (q, k, v, mask or None, sinks)."""
    q, k, v, mask, sinks = _srcs(n, 3, 5)
    _params(n, *spec.required())
    req(k.ne[0] == q.ne[0] and _divides(k.ne[2], q.ne[2]) and _divides(k.ne[3], q.ne[3]), n,
         f"k {k.ne} cannot multiply q {q.ne}")
    req(q.ne[3] == k.ne[3] == v.ne[3], n, f"ne[3] of q, k, v differ ({q.ne[3]}, {k.ne[3]}, {v.ne[3]})")
    _mask_and_sinks(n, mask, sinks, q, f"q {q.ne}", (DType.F16,))
    req(n.op_params["prec"] in {x.value for x in Prec}, n, f"unknown prec {n.op_params['prec']!r}")
    req(int(n.op_params["n_kv_max"]) >= 0, n, "n_kv_max must be >= 0")
    return _new_shape(DType.F32, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]))


def rule_glu(n: Tensor, spec: OpSpec) -> Shape:
    """ggml_glu_impl: act(x) * g. Fused form (one source): x and g are the two halves of each row of a (``swapped``
    exchanges them) and ne[0] halves; split form (ggml_*_split): x = a, g = b, same shape."""
    a, b = _srcs(n, 1, 2)
    _params(n, *spec.required())
    kind = n.op_params["kind"]
    req(kind in {g.value for g in Glu}, n, f"unknown glu kind {kind!r}")
    _params(n, *spec.required(kind))
    req(is_contiguous_n(a, 1), n, f"source {a.name!r} must be contiguous in its rows (ggml_is_contiguous_1)")
    if b is None:
        return _new_shape(a.type, (a.ne[0] // 2, *a.ne[1:]))
    req(is_contiguous_n(b, 1), n, f"gate {b.name!r} must be contiguous in its rows (ggml_is_contiguous_1)")
    req(b.ne == a.ne and b.type is a.type, n, f"gate {b.name!r} {b.type.label} {b.ne} differs from "
                                              f"{a.name!r} {a.type.label} {a.ne}")
    return _new_shape(a.type, a.ne)


def rule_ssm_conv(n: Tensor, spec: OpSpec) -> Shape:
    _nsrc(n, 2)
    sx, c = n.src
    req(sx.ne[3] == 1, n, f"sx {sx.name!r} must be 3-D")
    req(c.ne[2] == 1 and c.ne[3] == 1, n, f"weight {c.name!r} must be a matrix")
    d_conv, d_inner = c.ne[0], c.ne[1]
    n_t = sx.ne[0] - d_conv + 1
    req(n_t >= 0, n, f"sx has {sx.ne[0]} columns, fewer than d_conv-1 = {d_conv - 1}")
    req(sx.ne[1] == d_inner, n, f"sx has {sx.ne[1]} channels, weight {d_inner}")
    req(sx.type is DType.F32 and c.type is DType.F32, n, "SSM_CONV is f32 only")
    req(sx.nb[0] == 4 and sx.nb[1] == 4 * sx.ne[0], n, "sx rows must be contiguous (nb0 == 4, nb1 == 4*ne0)")
    req(c.is_contiguous(), n, f"weight {c.name!r} must be contiguous")
    return _new_shape(DType.F32, (d_inner, n_t, sx.ne[2]))


def rule_gdn(n: Tensor, spec: OpSpec) -> Shape:
    _nsrc(n, 6)
    q, k, v, g, beta, state = n.src
    K = int(n.op_params.get("K", 1))
    S_k, H_k, n_t, n_s = q.ne
    S_v, H_v = v.ne[0], v.ne[1]
    req(K >= 1, n, f"K must be >= 1, is {K}")
    req(S_k == S_v, n, f"S_k ({S_k}) != S_v ({S_v})")
    req(_divides(H_k, H_v), n, f"H_v ({H_v}) is not a multiple of H_k ({H_k})")
    req(k.ne == q.ne, n, f"k {k.ne} != q {q.ne}")
    req(v.ne[2] == n_t and v.ne[3] == n_s, n, f"v {v.ne} token/seq dims differ from q {q.ne}")
    req(g.ne[0] in (1, S_v) and g.ne[1:] == (H_v, n_t, n_s), n, f"g {g.ne} has the wrong shape")
    req(beta.ne == (1, H_v, n_t, n_s), n, f"beta {beta.ne} has the wrong shape")
    req(state.ne == (S_v, S_v, H_v, n_s), n, f"state {state.ne} has the wrong shape")
    for t in (q, k, v, g, beta, state):
        req(t.type is DType.F32, n, f"{t.name!r} must be f32")
        req(t.has_contiguous_rows(), n, f"{t.name!r} must have contiguous rows")
    req(q.nb == k.nb, n, "q and k must have the same strides")
    for t in (g, beta, state):
        req(t.is_contiguous(), n, f"{t.name!r} must be contiguous")
    return _new_shape(DType.F32, (S_v * H_v, n_t * n_s + K * S_v * n_s))
