"""ggml-style op constructors, and the validator of a node.

Each base op has one *rule* (its spec's, :mod:`gdnpass.opspec`): given a node's sources, op_params and (for views)
its requested shape, it checks what ggml asserts and returns the result's type, ne, nb and view placement.
Constructors use the rule to fill a new tensor; :func:`validate_node` re-runs it on an existing node (a loaded file,
a rewritten graph) and compares. One source of truth, so a constructor can never build what the validator rejects.
"""

from __future__ import annotations

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
    keep_alive,  # noqa: F401 (an allocator hint, constructed with the others: ops.keep_alive)
)
from gdnpass.opspec import SPECS, Shape
from gdnpass.opspec.shapes import pad4 as _pad4
from gdnpass.opspec.shapes import req as _req
from gdnpass.patterns import record_of


def _rule_kept(n: Tensor) -> Shape:
    """Fused and opaque nodes keep the layout they were given; a fused node's record checks what it carries."""
    if n.op.is_fused:
        record_of(n.op).validate(n)
    return Shape(n.type, n.ne, n.nb, n.view_src, n.view_offs)


def _rule(op: Op):
    """The rule of ``op``: its spec's, or for OPAQUE and the fused ops :func:`_rule_kept`; None if unmodelled."""
    if op is Op.OPAQUE or op.is_fused:
        return _rule_kept
    spec = SPECS.get(op)
    return None if spec is None else lambda n: spec.shape(n, spec)


def validate_node(n: Tensor) -> None:
    """Re-derive the node's type, shape, strides and view placement from its sources; GraphError on any mismatch."""
    if n.op is Op.NONE:
        _req(bool(n.op_params.get("hint")) and n.is_empty and n.view_src is not None and len(n.src) >= 1, n,
             "op NONE in the node list must be an empty allocator hint viewing its first source")
        return
    rule = _rule(n.op)
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
    want = _rule(op)(t)
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


def mul_mat_id(w: Tensor, b: Tensor, ids: Tensor) -> Tensor:
    """ggml_mul_mat_id(as, b, ids): each token's selected experts' matrices times its rows of b."""
    return _make(Op.MUL_MAT_ID, [w, b, ids], f"{w.name} * {b.name}")


def div(a: Tensor, b: Tensor, inplace: bool = False) -> Tensor:
    return _make(Op.DIV, [a, b], f"{a.name} (div)", {"inplace": inplace} if inplace else {})


def sum_rows(a: Tensor) -> Tensor:
    return _make(Op.SUM_ROWS, [a], f"{a.name} (sum_rows)")


def clamp(a: Tensor, lo: float, hi: float, inplace: bool = False) -> Tensor:
    """ggml_clamp (``inplace``: ggml_clamp_inplace); ``hi`` may be inf (llama.cpp's MoE weight sum)."""
    return _make(Op.CLAMP, [a], f"{a.name} (clamp)",
                 {"min": float(lo), "max": float(hi), **({"inplace": True} if inplace else {})})


SORT_ASC, SORT_DESC = 0, 1  # enum ggml_sort_order


def argsort(a: Tensor, order: int) -> Tensor:
    return _make(Op.ARGSORT, [a], f"{a.name} (argsort)", {"order": int(order)})


def argsort_top_k(a: Tensor, k: int) -> Tensor:
    """ggml_argsort_top_k: a descending ARGSORT and a view of each row's first ``k`` indices."""
    if not 0 < k <= a.ne[0]:
        raise GraphError(f"argsort_top_k of {a.name!r}: k {k} must be 1..{a.ne[0]} (its row)")
    s = argsort(a, SORT_DESC)
    return view_4d(s, (k, *s.ne[1:]), s.nb[1], s.nb[2], s.nb[3], 0, f"{s.name} (view)")


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
