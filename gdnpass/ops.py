"""ggml-style op constructors and the shape/type rules behind them.

Each op has one *rule*: given a node's sources, op_params and (for views) its requested shape, it checks what ggml
asserts and returns the result's type, ne, nb and view placement. Constructors use the rule to fill a new tensor;
:func:`validate_node` re-runs it on an existing node (a loaded file, a rewritten graph) and compares. One source of
truth, so a constructor can never build what the validator rejects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gdnpass.ir import (
    GGML_MAX_DIMS,
    DType,
    Flag,
    Glu,
    Graph,
    GraphError,
    Op,
    Prec,
    Tensor,
    Unary,
    contiguous_strides,
    is_contiguous_n,
    keep_alive,  # noqa: F401 (an allocator hint, constructed with the others: ops.keep_alive)
)
from gdnpass.patterns import record_of

NE = tuple[int, int, int, int]


@dataclass(frozen=True)
class Shape:
    """What a rule says a node must be."""

    type: DType
    ne: NE
    nb: NE
    view_of: Tensor | None = None  # the tensor the result views (its base becomes view_src)
    view_offs: int = 0             # offset relative to view_of


def _req(cond: bool, node: Tensor, msg: str) -> None:
    if not cond:
        raise GraphError(f"node {node.name!r} ({node.op.value}): {msg}")


def _pad4(ne) -> NE:
    ne = tuple(int(x) for x in ne)
    if len(ne) > GGML_MAX_DIMS:
        raise GraphError(f"too many dimensions: {ne}")
    return ne + (1,) * (GGML_MAX_DIMS - len(ne))  # type: ignore[return-value]


def _new_shape(type_: DType, ne) -> Shape:
    ne = _pad4(ne)
    return Shape(type_, ne, contiguous_strides(type_, ne))


def _can_repeat(b: Tensor, a: Tensor) -> bool:
    """ggml_can_repeat(b, a): b broadcasts to a."""
    if b.is_empty:
        return a.is_empty
    return all(b.ne[i] != 0 and a.ne[i] % b.ne[i] == 0 for i in range(GGML_MAX_DIMS))


def _nsrc(node: Tensor, n: int) -> None:
    _req(len(node.src) == n and all(s is not None for s in node.src), node, f"expects {n} sources, has {len(node.src)}")


def _srcs(node: Tensor, need: int, most: int) -> list[Tensor | None]:
    """The ``most`` source slots (missing trailing ones are None); the first ``need`` must be set."""
    src = list(node.src)
    _req(need <= len(src) <= most and all(s is not None for s in src[:need]), node,
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
    _req(not missing, node, f"op_params lack {', '.join(map(repr, missing))}")


def _same_or_view(n: Tensor, a: Tensor) -> Shape:
    """The result of ggml_dup_tensor(a), or of ggml_view_tensor(a) for the in-place variant."""
    if n.op_params.get("inplace"):
        return Shape(a.type, a.ne, a.nb, a, 0)
    return _new_shape(a.type, a.ne)


# ---------------------------------------------------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------------------------------------------------


def _rule_view(n: Tensor) -> Shape:
    _nsrc(n, 1)
    a = n.src[0]
    off = int(n.op_params.get("offset", 0))
    _req(off >= 0, n, f"negative view offset {off}")
    # strides may be 0 (empty views) or overlap (ggml allows both), never negative
    _req(all(x >= 0 for x in n.ne) and n.nb[0] > 0 and all(x >= 0 for x in n.nb), n, f"bad view ne {n.ne} / nb {n.nb}")
    base = a.base
    end = a.view_offs + off + n.nbytes
    _req(end <= base.nbytes or n.is_empty, n,
         f"view [{a.view_offs + off}, {end}) runs past its base {base.name!r} ({base.nbytes} bytes)")
    return Shape(a.type, n.ne, n.nb, a, off)


def _rule_reshape(n: Tensor) -> Shape:
    _nsrc(n, 1)
    a = n.src[0]
    _req(a.is_contiguous(), n, f"source {a.name!r} is not contiguous")
    _req(a.nelements == n.nelements, n, f"reshape {a.ne} -> {n.ne} changes the element count")
    return Shape(a.type, n.ne, contiguous_strides(a.type, n.ne), a, 0)


def _rule_transpose(n: Tensor) -> Shape:
    _nsrc(n, 1)
    a = n.src[0]
    return Shape(a.type, (a.ne[1], a.ne[0], a.ne[2], a.ne[3]), (a.nb[1], a.nb[0], a.nb[2], a.nb[3]), a, 0)


def _rule_permute(n: Tensor) -> Shape:
    _nsrc(n, 1)
    a = n.src[0]
    axes = tuple(n.op_params.get("axes", (0, 1, 2, 3)))
    _req(sorted(axes) == [0, 1, 2, 3], n, f"permute axes {axes} are not a permutation of 0..3")
    ne = [0] * 4
    nb = [0] * 4
    for i, ax in enumerate(axes):
        ne[ax] = a.ne[i]
        nb[ax] = a.nb[i]
    return Shape(a.type, tuple(ne), tuple(nb), a, 0)  # type: ignore[arg-type]


def _rule_cont(n: Tensor) -> Shape:
    _nsrc(n, 1)
    a = n.src[0]
    _req(a.nelements == n.nelements, n, f"cont {a.ne} -> {n.ne} changes the element count")
    return _new_shape(a.type, n.ne)


def _rule_cpy(n: Tensor) -> Shape:
    _nsrc(n, 2)
    a, b = n.src
    _req(a.nelements == b.nelements, n, f"{a.name!r} has {a.nelements} elements, destination {b.name!r} {b.nelements}")
    _req(a.type is DType.F32 or a.type is b.type, n, f"copy {a.type.label} -> {b.type.label} is not supported")
    _req(b.type in (DType.F32, DType.F16, DType.BF16, DType.I32), n, f"bad destination type {b.type.label}")
    return Shape(b.type, b.ne, b.nb, b, 0)


def _rule_get_rows(n: Tensor) -> Shape:
    _nsrc(n, 2)
    a, b = n.src
    _req(b.type is DType.I32, n, f"row ids {b.name!r} must be i32, not {b.type.label}")
    _req(a.ne[2] == b.ne[1] and a.ne[3] == b.ne[2] and b.ne[3] == 1, n, f"ids {b.ne} do not match rows of {a.ne}")
    out = DType.I32 if a.type is DType.I32 else DType.F32  # ggml: "TODO: implement non F32 return"
    return _new_shape(out, (a.ne[0], b.ne[0], b.ne[1], b.ne[2]))


def _rule_set_rows(n: Tensor) -> Shape:
    """ggml_set_rows(a, b, c): row i of b goes to row c[i] of a. ``src`` is (b, c, a), ggml's (legacy) order, and the
    result is a view of the destination a (as CPY's is of its destination)."""
    _nsrc(n, 3)
    b, c, a = n.src
    _req(a.ne[0] == b.ne[0] and a.ne[2] == b.ne[2] and a.ne[3] == b.ne[3], n,
         f"rows {b.name!r} {b.ne} do not fit destination {a.name!r} {a.ne}")
    _req(b.ne[1] == c.ne[0], n, f"{b.ne[1]} rows but {c.ne[0]} ids")
    _req(_divides(c.ne[1], b.ne[2]) and _divides(c.ne[2], b.ne[3]) and c.ne[3] == 1, n,
         f"ids {c.name!r} {c.ne} do not broadcast over rows {b.ne}")
    _req(b.type in (DType.F32, DType.F16), n, f"rows {b.name!r} must be f32 or f16, not {b.type.label}")
    _req(c.type in (DType.I64, DType.I32), n, f"row ids {c.name!r} must be i64 or i32, not {c.type.label}")
    _req(_rows_contiguous(a) and _rows_contiguous(b), n, "destination and rows need contiguous rows")
    return Shape(a.type, a.ne, a.nb, a, 0)


def _rule_concat(n: Tensor) -> Shape:
    _nsrc(n, 2)
    a, b = n.src
    dim = int(n.op_params.get("dim", -1))
    _req(0 <= dim < GGML_MAX_DIMS, n, f"concat dim {dim} out of range")
    _req(a.type is b.type, n, f"source types differ ({a.type.label}, {b.type.label})")
    for d in range(GGML_MAX_DIMS):
        if d != dim:
            _req(a.ne[d] == b.ne[d], n, f"ne[{d}] differs ({a.ne[d]} vs {b.ne[d]})")
    ne = list(a.ne)
    ne[dim] = a.ne[dim] + b.ne[dim]
    return _new_shape(a.type, ne)


def _rule_same(n: Tensor) -> Shape:
    """SCALE, UNARY, norms: the result has the source's shape (in place: a view of it)."""
    a = n.src[0]
    if n.op is Op.UNARY:
        _req(is_contiguous_n(a, 1), n, f"source {a.name!r} must have contiguous rows")
        _req(n.op_params.get("kind") in {u.value for u in Unary}, n, f"unknown unary kind {n.op_params.get('kind')!r}")
    if n.op in (Op.RMS_NORM, Op.L2_NORM):
        _req(a.has_contiguous_rows(), n, f"source {a.name!r} must have nb[0] == type size")
        _req(float(n.op_params.get("eps", -1.0)) >= 0.0, n, "eps missing or negative")
    _req(a.type is DType.F32, n, f"source {a.name!r} must be f32")
    if n.op_params.get("inplace"):
        return Shape(a.type, a.ne, a.nb, a, 0)
    return _new_shape(a.type, a.ne)


def _rule_binary(n: Tensor) -> Shape:
    _nsrc(n, 2)
    a, b = n.src
    _req(_can_repeat(b, a), n, f"{b.name!r} {b.ne} does not broadcast to {a.name!r} {a.ne}")
    _req(a.type is DType.F32 and b.type is DType.F32, n, "ADD/MUL are modelled for f32 only")
    if n.op_params.get("inplace"):
        return Shape(a.type, a.ne, a.nb, a, 0)
    return _new_shape(a.type, a.ne)


def _rule_unary_src(n: Tensor) -> Shape:
    _nsrc(n, 1)
    return _rule_same(n)


def _rule_mul_mat(n: Tensor) -> Shape:
    _nsrc(n, 2)
    a, b = n.src
    _req(a.ne[0] == b.ne[0], n, f"inner dims differ: {a.name!r} ne0={a.ne[0]}, {b.name!r} ne0={b.ne[0]}")
    _req(_divides(a.ne[2], b.ne[2]) and _divides(a.ne[3], b.ne[3]), n, "batch dims do not broadcast")
    _req(a.nb[0] <= a.nb[1], n, f"weight {a.name!r} is transposed")
    _req(a.type in (DType.F32, DType.F16, DType.BF16), n, f"weight type {a.type.label} not supported")
    _req(b.type is DType.F32, n, f"activation {b.name!r} must be f32")
    _req(a.has_contiguous_rows() and b.has_contiguous_rows(), n, "sources need contiguous rows")
    _req(n.op_params.get("prec", Prec.UNDEFINED.value) in {x.value for x in Prec}, n,
         f"unknown prec {n.op_params.get('prec')!r}")
    return _new_shape(DType.F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]))


def _rule_soft_max(n: Tensor) -> Shape:
    """ggml_soft_max_ext(a, mask, scale, max_bias) (+ ggml_soft_max_add_sinks): softmax(a * scale + mask) per row.
    ``src`` is (a, mask or None, sinks); the mask row i serves row i of a (it may have more rows: padding)."""
    a, mask, sinks = _srcs(n, 1, 3)
    _params(n, "scale", "max_bias")
    _req(a.is_contiguous(), n, f"source {a.name!r} must be contiguous")
    if mask is not None:
        _req(mask.ne[0] == a.ne[0] and mask.ne[1] >= a.ne[1], n, f"mask {mask.ne} does not cover {a.name!r} {a.ne}")
    _mask_and_sinks(n, mask, sinks, a, str(a.ne), (DType.F16, DType.F32))
    return _same_or_view(n, a)


def _mask_and_sinks(n: Tensor, mask: Tensor | None, sinks: Tensor | None, ref: Tensor, over: str, types) -> None:
    """What SOFT_MAX and FLASH_ATTN_EXT both assert of their mask (a contiguous ``types`` tensor broadcasting over
    ``ref``'s ne[2], ne[3]; needed for ALiBi) and their sinks (f32, one per head, ``ref.ne[2]``)."""
    if mask is not None:
        _req(mask.type in types, n, f"mask {mask.name!r} must be {' or '.join(t.label for t in types)}, "
                                    f"not {mask.type.label}")
        _req(mask.is_contiguous(), n, f"mask {mask.name!r} must be contiguous")
        _req(_divides(mask.ne[2], ref.ne[2]) and _divides(mask.ne[3], ref.ne[3]), n,
             f"mask {mask.ne} does not broadcast over {over}")
    _req(float(n.op_params["max_bias"]) <= 0.0 or mask is not None, n, "max_bias > 0 (ALiBi) needs a mask")
    if sinks is not None:
        _req(sinks.ne[0] == ref.ne[2] and sinks.type is DType.F32, n,
             f"sinks {sinks.name!r} must be f32 with one value per head ({ref.ne[2]})")


ROPE_MODES = {0: "NORMAL", 2: "NEOX", 8: "MROPE", 24: "VISION", 40: "IMROPE"}  # GGML_ROPE_TYPE_*
ROPE_TYPE_MROPE = 8  # a bit of the mode: VISION and IMROPE (qwen35's) are M-RoPE modes too
ROPE_PARAMS = ("n_dims", "mode", "n_ctx_orig", "freq_base", "freq_scale", "ext_factor", "attn_factor", "beta_fast",
               "beta_slow", "sections", "n_offs")


def _rule_rope(n: Tensor) -> Shape:
    """ggml_rope_impl (rope_ext, rope_multi): rotate the first n_dims of each row of a by the positions b. ``src`` is
    (a, b, freq factors or None). M-RoPE modes take 4 positions per token (``ne[2] * 4``) and 4 ``sections``."""
    a, b, c = _srcs(n, 2, 3)
    _params(n, *ROPE_PARAMS)
    p = n.op_params
    mode, n_dims = int(p["mode"]), int(p["n_dims"])
    _req(mode & 1 == 0, n, f"mode {mode}: mode & 1 is no longer supported")
    _req(b.ne[1] == b.ne[2] == b.ne[3] == 1 and b.type is DType.I32, n, f"positions {b.name!r} must be an i32 vector")
    n_offs = int(p.get("n_offs", 0))
    _req(n_dims > 0 and n_dims % 2 == 0 and n_offs % 2 == 0 and 0 <= n_offs and n_offs + n_dims <= a.ne[0], n,
         f"n_dims {n_dims}, n_offs {n_offs} do not fit rows of {a.ne[0]} (even, within the row)")
    sections = list(p["sections"])
    _req(len(sections) == 4, n, f"sections {sections} must be 4 ints")
    if mode & ROPE_TYPE_MROPE:
        _req(b.ne[0] == a.ne[2] * 4, n, f"M-RoPE needs 4 positions per token: {b.ne[0]} for {a.ne[2]} tokens")
        _req(all(int(v) >= 0 for v in sections) and any(sections[:3]) and sum(sections) <= a.ne[0], n,
             f"M-RoPE sections {sections} do not fit rows of {a.ne[0]} (non-negative, t/h/w not all zero)")
    else:
        _req(b.ne[0] == a.ne[2], n, f"{b.ne[0]} positions for {a.ne[2]} tokens")
        _req(sections == [0, 0, 0, 0], n, f"sections {sections} without M-RoPE (ggml stores zeros)")
    if c is not None:
        _req(c.type is DType.F32 and c.ne[0] >= n_dims // 2, n,
             f"freq factors {c.name!r} must be f32 with at least n_dims/2 = {n_dims // 2} values")
    return _same_or_view(n, a)


FLASH_ATTN_PARAMS = ("scale", "max_bias", "logit_softcap", "prec", "n_kv_max")


def _rule_flash_attn_ext(n: Tensor) -> Shape:
    """ggml_flash_attn_ext (+ add_sinks, set_prec, set_n_kv_max). q [d_k, n_batch, n_head, ne3], k [d_k, n_kv,
    n_head_kv, ne3], v [d_v, n_kv, n_head_kv, ne3] (not transposed), mask f16 [n_kv, n_batch, ne32, ne33]; the
    result is permuted: f32 [d_v, n_head, n_batch, ne3]. ``src`` is (q, k, v, mask or None, sinks)."""
    q, k, v, mask, sinks = _srcs(n, 3, 5)
    _params(n, *FLASH_ATTN_PARAMS)
    _req(k.ne[0] == q.ne[0] and _divides(k.ne[2], q.ne[2]) and _divides(k.ne[3], q.ne[3]), n,
         f"k {k.ne} cannot multiply q {q.ne}")
    _req(q.ne[3] == k.ne[3] == v.ne[3], n, f"ne[3] of q, k, v differ ({q.ne[3]}, {k.ne[3]}, {v.ne[3]})")
    _mask_and_sinks(n, mask, sinks, q, f"q {q.ne}", (DType.F16,))
    _req(n.op_params["prec"] in {x.value for x in Prec}, n, f"unknown prec {n.op_params['prec']!r}")
    _req(int(n.op_params["n_kv_max"]) >= 0, n, "n_kv_max must be >= 0")
    return _new_shape(DType.F32, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]))


GLU_PARAMS = {Glu.SWIGLU_OAI: ("alpha", "limit"), Glu.SWIGLU_CLAMP: ("limit",)}  # beyond kind and swapped


def _rule_glu(n: Tensor) -> Shape:
    """ggml_glu_impl: act(x) * g. Fused form (one source): x and g are the two halves of each row of a (``swapped``
    exchanges them) and ne[0] halves; split form (ggml_*_split): x = a, g = b, same shape."""
    a, b = _srcs(n, 1, 2)
    _params(n, "kind", "swapped")
    kind = n.op_params["kind"]
    _req(kind in {g.value for g in Glu}, n, f"unknown glu kind {kind!r}")
    _params(n, *GLU_PARAMS.get(Glu(kind), ()))
    _req(is_contiguous_n(a, 1), n, f"source {a.name!r} must be contiguous in its rows (ggml_is_contiguous_1)")
    if b is None:
        return _new_shape(a.type, (a.ne[0] // 2, *a.ne[1:]))
    _req(is_contiguous_n(b, 1), n, f"gate {b.name!r} must be contiguous in its rows (ggml_is_contiguous_1)")
    _req(b.ne == a.ne and b.type is a.type, n, f"gate {b.name!r} {b.type.label} {b.ne} differs from "
                                              f"{a.name!r} {a.type.label} {a.ne}")
    return _new_shape(a.type, a.ne)


def _rule_ssm_conv(n: Tensor) -> Shape:
    _nsrc(n, 2)
    sx, c = n.src
    _req(sx.ne[3] == 1, n, f"sx {sx.name!r} must be 3-D")
    _req(c.ne[2] == 1 and c.ne[3] == 1, n, f"weight {c.name!r} must be a matrix")
    d_conv, d_inner = c.ne[0], c.ne[1]
    n_t = sx.ne[0] - d_conv + 1
    _req(n_t >= 0, n, f"sx has {sx.ne[0]} columns, fewer than d_conv-1 = {d_conv - 1}")
    _req(sx.ne[1] == d_inner, n, f"sx has {sx.ne[1]} channels, weight {d_inner}")
    _req(sx.type is DType.F32 and c.type is DType.F32, n, "SSM_CONV is f32 only")
    _req(sx.nb[0] == 4 and sx.nb[1] == 4 * sx.ne[0], n, "sx rows must be contiguous (nb0 == 4, nb1 == 4*ne0)")
    _req(c.is_contiguous(), n, f"weight {c.name!r} must be contiguous")
    return _new_shape(DType.F32, (d_inner, n_t, sx.ne[2]))


def _rule_gdn(n: Tensor) -> Shape:
    _nsrc(n, 6)
    q, k, v, g, beta, state = n.src
    K = int(n.op_params.get("K", 1))
    S_k, H_k, n_t, n_s = q.ne
    S_v, H_v = v.ne[0], v.ne[1]
    _req(K >= 1, n, f"K must be >= 1, is {K}")
    _req(S_k == S_v, n, f"S_k ({S_k}) != S_v ({S_v})")
    _req(_divides(H_k, H_v), n, f"H_v ({H_v}) is not a multiple of H_k ({H_k})")
    _req(k.ne == q.ne, n, f"k {k.ne} != q {q.ne}")
    _req(v.ne[2] == n_t and v.ne[3] == n_s, n, f"v {v.ne} token/seq dims differ from q {q.ne}")
    _req(g.ne[0] in (1, S_v) and g.ne[1:] == (H_v, n_t, n_s), n, f"g {g.ne} has the wrong shape")
    _req(beta.ne == (1, H_v, n_t, n_s), n, f"beta {beta.ne} has the wrong shape")
    _req(state.ne == (S_v, S_v, H_v, n_s), n, f"state {state.ne} has the wrong shape")
    for t in (q, k, v, g, beta, state):
        _req(t.type is DType.F32, n, f"{t.name!r} must be f32")
        _req(t.has_contiguous_rows(), n, f"{t.name!r} must have contiguous rows")
    _req(q.nb == k.nb, n, "q and k must have the same strides")
    for t in (g, beta, state):
        _req(t.is_contiguous(), n, f"{t.name!r} must be contiguous")
    return _new_shape(DType.F32, (S_v * H_v, n_t * n_s + K * S_v * n_s))


def _rule_kept(n: Tensor) -> Shape:
    """Fused and opaque nodes keep the layout they were given; a fused node's record checks what it carries."""
    if n.op.is_fused:
        record_of(n.op).validate(n)
    return Shape(n.type, n.ne, n.nb, n.view_src, n.view_offs)


_RULES: dict[Op, Callable[[Tensor], Shape]] = {
    Op.VIEW: _rule_view,
    Op.RESHAPE: _rule_reshape,
    Op.TRANSPOSE: _rule_transpose,
    Op.PERMUTE: _rule_permute,
    Op.CONT: _rule_cont,
    Op.CPY: _rule_cpy,
    Op.GET_ROWS: _rule_get_rows,
    Op.SET_ROWS: _rule_set_rows,
    Op.CONCAT: _rule_concat,
    Op.SCALE: _rule_unary_src,
    Op.UNARY: _rule_unary_src,
    Op.RMS_NORM: _rule_unary_src,
    Op.L2_NORM: _rule_unary_src,
    Op.ADD: _rule_binary,
    Op.MUL: _rule_binary,
    Op.MUL_MAT: _rule_mul_mat,
    Op.SOFT_MAX: _rule_soft_max,
    Op.ROPE: _rule_rope,
    Op.FLASH_ATTN_EXT: _rule_flash_attn_ext,
    Op.GLU: _rule_glu,
    Op.SSM_CONV: _rule_ssm_conv,
    Op.GATED_DELTA_NET: _rule_gdn,
    Op.OPAQUE: _rule_kept,
}  # (and every fused op: _rule_kept, its record's checks)


def validate_node(n: Tensor) -> None:
    """Re-derive the node's type, shape, strides and view placement from its sources; GraphError on any mismatch."""
    if n.op is Op.NONE:
        _req(bool(n.op_params.get("hint")) and n.is_empty and n.view_src is not None and len(n.src) >= 1, n,
             "op NONE in the node list must be an empty allocator hint viewing its first source")
        return
    rule = _rule_kept if n.op.is_fused else _RULES.get(n.op)
    if rule is None:
        raise GraphError(f"node {n.name!r}: op {n.op.value} is not modelled")
    want = rule(n)
    _req(n.type is want.type, n, f"type {n.type.label}, expected {want.type.label}")
    _req(tuple(n.ne) == want.ne, n, f"ne {n.ne}, expected {want.ne}")
    _req(tuple(n.nb) == want.nb, n, f"nb {n.nb}, expected {want.nb}")
    if n.op.is_fused or n.op is Op.OPAQUE:
        return
    if want.view_of is None:
        _req(n.view_src is None, n, "computes new data but is marked as a view")
    else:
        _req(n.view_src is want.view_of.base, n,
             f"view_src is {getattr(n.view_src, 'name', None)!r}, expected base {want.view_of.base.name!r}")
        offs = want.view_of.view_offs + want.view_offs
        _req(n.view_offs == offs, n, f"view_offs {n.view_offs}, expected {offs}")


def validate(graph: Graph) -> None:
    """Every node's shape/type rules (as ggml asserts them), then execution order and acyclicity. Raises GraphError."""
    for n in graph.nodes:
        validate_node(n)
    graph.check_order()


# ---------------------------------------------------------------------------------------------------------------------
# constructors (ggml_* equivalents). Names follow ggml's automatic naming where ggml has one.
# ---------------------------------------------------------------------------------------------------------------------


def _make(op: Op, src: list[Tensor | None], name: str, params: dict | None = None, ne=None, nb=None) -> Tensor:
    src = list(src)
    while src and src[-1] is None:  # optional trailing sources (a mask, sinks) left out, as ggml leaves NULL
        src.pop()
    t = Tensor(name=name, type=src[0].type, ne=_pad4(ne) if ne is not None else src[0].ne,
               nb=_pad4(nb) if nb is not None else src[0].nb, op=op, op_params=dict(params or {}), src=src,
               layer=next((s.layer for s in src if s is not None and s.layer is not None and s.layer >= 0),
                          src[0].layer))
    want = _RULES[op](t)
    t.type, t.ne, t.nb = want.type, want.ne, want.nb
    if want.view_of is not None:
        t.view_src = want.view_of.base
        t.view_offs = want.view_of.view_offs + want.view_offs
    return t


def new_tensor(name: str, type_: DType, ne, *, buffer: str, flags: Flag = Flag.NONE, layer: int | None = None) -> Tensor:
    """A leaf with its own memory in ``buffer`` (weights / cache / input)."""
    ne = _pad4(ne)
    return Tensor(name=name, type=type_, ne=ne, nb=contiguous_strides(type_, ne), buffer=buffer, flags=flags,
                  layer=layer)


def view(a: Tensor, ne, nb, offset: int, name: str | None = None) -> Tensor:
    """ggml_view_4d with explicit ne[0..3], nb[1..3] (nb0 is the type size)."""
    ne = _pad4(ne)
    strides = [a.type.size] + [int(x) for x in nb]
    while len(strides) < GGML_MAX_DIMS:  # ggml_view_Nd fills the outer strides densely
        strides.append(strides[-1] * ne[len(strides) - 1])
    return _make(Op.VIEW, [a], name or f"{a.name} (view)", {"offset": int(offset)}, ne, strides)


def view_1d(a: Tensor, ne0: int, offset: int, name: str | None = None) -> Tensor:
    return view(a, (ne0,), (), offset, name)


def view_2d(a: Tensor, ne0: int, ne1: int, nb1: int, offset: int, name: str | None = None) -> Tensor:
    return view(a, (ne0, ne1), (nb1,), offset, name)


def view_3d(a: Tensor, ne0: int, ne1: int, ne2: int, nb1: int, nb2: int, offset: int, name: str | None = None) -> Tensor:
    return view(a, (ne0, ne1, ne2), (nb1, nb2), offset, name)


def view_4d(a: Tensor, ne, nb1: int, nb2: int, nb3: int, offset: int, name: str | None = None) -> Tensor:
    return view(a, ne, (nb1, nb2, nb3), offset, name)


def reshape(a: Tensor, *ne: int) -> Tensor:
    return _make(Op.RESHAPE, [a], f"{a.name} (reshaped)", ne=ne)


def transpose(a: Tensor) -> Tensor:
    return _make(Op.TRANSPOSE, [a], f"{a.name} (transposed)", {"axes": (1, 0, 2, 3)})


def permute(a: Tensor, *axes: int) -> Tensor:
    return _make(Op.PERMUTE, [a], f"{a.name} (permuted)", {"axes": tuple(axes)})


def cont(a: Tensor, *ne: int) -> Tensor:
    return _make(Op.CONT, [a], f"{a.name} (cont)", ne=ne or a.ne)


def cpy(a: Tensor, b: Tensor) -> Tensor:
    """ggml_cpy: the result is a view of ``b`` (the destination) that, when computed, holds a's elements."""
    return _make(Op.CPY, [a, b], f"{b.name} (copy of {a.name})")


def get_rows(a: Tensor, b: Tensor) -> Tensor:
    return _make(Op.GET_ROWS, [a, b], f"{a.name} (get_rows)")


def set_rows(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """ggml_set_rows(a, b, c): write the rows of ``b`` into destination ``a`` at the row ids ``c`` (i64 or i32); the
    result views ``a``. Its sources are (b, c, a), as ggml orders them."""
    return _make(Op.SET_ROWS, [b, c, a], f"{a.name} (view)")


def concat(a: Tensor, b: Tensor, dim: int) -> Tensor:
    return _make(Op.CONCAT, [a, b], f"{a.name} (concat)", {"dim": int(dim)})


def scale(a: Tensor, s: float, b: float = 0.0, inplace: bool = False) -> Tensor:
    return _make(Op.SCALE, [a], f"{a.name} (scaled)", {"s": float(s), "b": float(b), "inplace": inplace})


def add(a: Tensor, b: Tensor, inplace: bool = False) -> Tensor:
    return _make(Op.ADD, [a, b], f"{a.name} (add)", {"inplace": inplace} if inplace else {})


def mul(a: Tensor, b: Tensor, inplace: bool = False) -> Tensor:
    return _make(Op.MUL, [a, b], f"{a.name} (mul)", {"inplace": inplace} if inplace else {})


def unary(a: Tensor, kind: Unary) -> Tensor:
    return _make(Op.UNARY, [a], f"{a.name} ({kind.value.lower()})", {"kind": kind.value})


def silu(a: Tensor) -> Tensor:
    return unary(a, Unary.SILU)


def sigmoid(a: Tensor) -> Tensor:
    return unary(a, Unary.SIGMOID)


def softplus(a: Tensor) -> Tensor:
    return unary(a, Unary.SOFTPLUS)


def exp(a: Tensor) -> Tensor:
    return unary(a, Unary.EXP)


def neg(a: Tensor) -> Tensor:
    return unary(a, Unary.NEG)


def glu(a: Tensor, kind: Glu, swapped: bool = False, **params: float) -> Tensor:
    """ggml_glu: the fused form; each row of ``a`` holds x then g (g then x when ``swapped``), the result half as
    wide. ``params``: ``alpha``/``limit`` for SWIGLU_OAI, ``limit`` for SWIGLU_CLAMP."""
    return _make(Op.GLU, [a], f"{a.name} ({kind.value.lower()})",
                 {"kind": kind.value, "swapped": bool(swapped), **{k: float(v) for k, v in params.items()}})


def glu_split(a: Tensor, b: Tensor, kind: Glu, **params: float) -> Tensor:
    """ggml_glu_split: act(a) * b."""
    return _make(Op.GLU, [a, b], f"{a.name} ({kind.value.lower()})",
                 {"kind": kind.value, "swapped": False, **{k: float(v) for k, v in params.items()}})


def swiglu(a: Tensor) -> Tensor:
    return glu(a, Glu.SWIGLU)


def swiglu_split(a: Tensor, b: Tensor) -> Tensor:
    """ggml_swiglu_split: silu(a) * b (llama.cpp's build_ffn with LLM_FFN_SILU and LLM_FFN_PAR)."""
    return glu_split(a, b, Glu.SWIGLU)


def soft_max_ext(a: Tensor, mask: Tensor | None, scale: float, max_bias: float = 0.0, *, sinks: Tensor | None = None,
                 inplace: bool = False) -> Tensor:
    """ggml_soft_max_ext (+ ggml_soft_max_add_sinks): softmax(a * scale + mask) along ne[0]."""
    params = {"scale": float(scale), "max_bias": float(max_bias), **({"inplace": True} if inplace else {})}
    return _make(Op.SOFT_MAX, [a, mask, sinks], f"{a.name} (soft_max)", params)


def soft_max(a: Tensor) -> Tensor:
    return soft_max_ext(a, None, 1.0, 0.0)


def rope_ext(a: Tensor, pos: Tensor, freq_factors: Tensor | None, n_dims: int, mode: int, n_ctx_orig: int,
             freq_base: float, freq_scale: float, ext_factor: float, attn_factor: float, beta_fast: float,
             beta_slow: float, *, sections=(0, 0, 0, 0), inplace: bool = False) -> Tensor:
    """ggml_rope_ext (with ``sections``: ggml_rope_multi), the argument order of ggml."""
    params = {"n_dims": int(n_dims), "mode": int(mode), "n_ctx_orig": int(n_ctx_orig), "freq_base": float(freq_base),
              "freq_scale": float(freq_scale), "ext_factor": float(ext_factor), "attn_factor": float(attn_factor),
              "beta_fast": float(beta_fast), "beta_slow": float(beta_slow),
              "sections": tuple(int(x) for x in sections), "n_offs": 0, **({"inplace": True} if inplace else {})}
    return _make(Op.ROPE, [a, pos, freq_factors], f"{a.name} (rope)", params)


def rope_multi(a: Tensor, pos: Tensor, freq_factors: Tensor | None, n_dims: int, sections, mode: int,
               n_ctx_orig: int, freq_base: float, freq_scale: float, ext_factor: float, attn_factor: float,
               beta_fast: float, beta_slow: float, inplace: bool = False) -> Tensor:
    """ggml_rope_multi: M-RoPE (mode MROPE 8, IMROPE 40 as qwen35 uses, VISION 24); ``pos`` holds 4 positions per
    token, ``sections`` the 4 section sizes."""
    return rope_ext(a, pos, freq_factors, n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor,
                    beta_fast, beta_slow, sections=sections, inplace=inplace)


def flash_attn_ext(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, max_bias: float = 0.0,
                   logit_softcap: float = 0.0, *, sinks: Tensor | None = None, prec: Prec = Prec.UNDEFINED,
                   n_kv_max: int = 0) -> Tensor:
    """ggml_flash_attn_ext, with what llama.cpp sets on it afterwards (sinks, ggml_prec_set_acc, n_kv_max)."""
    params = {"scale": float(scale), "max_bias": float(max_bias), "logit_softcap": float(logit_softcap),
              "prec": prec.value, "n_kv_max": int(n_kv_max)}
    return _make(Op.FLASH_ATTN_EXT, [q, k, v, mask, sinks], f"{q.name} (flash_attn_ext)", params)


def prec_set_acc(t: Tensor, prec: Prec) -> Tensor:
    """ggml_prec_set_acc: the accumulator precision a MUL_MAT or FLASH_ATTN_EXT must use (llama.cpp: F32 for kq)."""
    if t.op not in (Op.MUL_MAT, Op.FLASH_ATTN_EXT):
        raise GraphError(f"node {t.name!r} ({t.op.value}): only MUL_MAT and FLASH_ATTN_EXT carry a precision")
    if t.op is Op.MUL_MAT and prec is Prec.UNDEFINED:
        t.op_params.pop("prec", None)  # a MUL_MAT records only a precision that was set (ggml's word 0 is 0)
    else:
        t.op_params["prec"] = prec.value
    return t


def rms_norm(a: Tensor, eps: float) -> Tensor:
    return _make(Op.RMS_NORM, [a], f"{a.name} (rms_norm)", {"eps": float(eps)})


def l2_norm(a: Tensor, eps: float) -> Tensor:
    return _make(Op.L2_NORM, [a], f"{a.name} (l2_norm)", {"eps": float(eps)})


def mul_mat(a: Tensor, b: Tensor) -> Tensor:
    return _make(Op.MUL_MAT, [a, b], f"{a.name} * {b.name}")


def ssm_conv(sx: Tensor, c: Tensor) -> Tensor:
    return _make(Op.SSM_CONV, [sx, c], f"{sx.name} (ssm_conv)")


def gated_delta_net(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, K: int = 1) -> Tensor:
    return _make(Op.GATED_DELTA_NET, [q, k, v, g, beta, state], f"{q.name} (gated_delta_net)", {"K": int(K)})


def cb(t: Tensor, name: str, il: int) -> Tensor:
    """llama.cpp's cb(): name a tensor ``name-il`` and tag it with its layer."""
    t.name = f"{name}-{il}" if il >= 0 else name
    t.layer = il
    return t


def set_output(t: Tensor) -> Tensor:
    t.flags |= Flag.OUTPUT
    return t
