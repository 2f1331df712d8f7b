"""The builder's facade over gdnpass's own constructors (:mod:`gdnpass.ops`): it builds a :class:`gdnpass.ir.Graph`.

Each method is the ggml call of the same name; ``expand`` is :meth:`Graph.expand` (ggml_build_forward_expand).
"""

from __future__ import annotations

from gdnpass import ops
from gdnpass.ir import DType, Flag, Graph, Prec, Tensor
from gdnpass.models.builder import build_conv_chain_only, build_verify, verify_meta
from gdnpass.models.hparams import VerifyConfig


class IrFacade:
    """:class:`gdnpass.models.builder.Facade` on gdnpass.ops; the graph is :attr:`graph`."""

    def __init__(self, graph: Graph | None = None) -> None:
        self.graph = graph if graph is not None else Graph()

    def new_tensor(self, buffer: str, name: str, type_: DType, ne, *, input: bool = False, il: int = -1) -> Tensor:
        return ops.new_tensor(name, type_, ne, buffer=buffer, flags=Flag.INPUT if input else Flag.NONE, layer=il)

    def ne(self, t: Tensor) -> tuple[int, int, int, int]:
        return t.ne

    def nb(self, t: Tensor) -> tuple[int, int, int, int]:
        return t.nb

    def view_1d(self, a, ne0, offset):
        return ops.view_1d(a, ne0, offset)

    def view_2d(self, a, ne0, ne1, nb1, offset):
        return ops.view_2d(a, ne0, ne1, nb1, offset)

    def view_3d(self, a, ne0, ne1, ne2, nb1, nb2, offset):
        return ops.view_3d(a, ne0, ne1, ne2, nb1, nb2, offset)

    def view_4d(self, a, ne0, ne1, ne2, ne3, nb1, nb2, nb3, offset):
        return ops.view_4d(a, (ne0, ne1, ne2, ne3), nb1, nb2, nb3, offset)

    def reshape_2d(self, a, ne0, ne1):
        return ops.reshape(a, ne0, ne1)

    def reshape_3d(self, a, ne0, ne1, ne2):
        return ops.reshape(a, ne0, ne1, ne2)

    def reshape_4d(self, a, ne0, ne1, ne2, ne3):
        return ops.reshape(a, ne0, ne1, ne2, ne3)

    def transpose(self, a):
        return ops.transpose(a)

    def concat(self, a, b, dim):
        return ops.concat(a, b, dim)

    def get_rows(self, a, b):
        return ops.get_rows(a, b)

    def cpy(self, a, b):
        return ops.cpy(a, b)

    def scale(self, a, s):
        return ops.scale(a, s)

    def scale_inplace(self, a, s):
        return ops.scale(a, s, inplace=True)

    def add(self, a, b):
        return ops.add(a, b)

    def mul(self, a, b):
        return ops.mul(a, b)

    def mul_mat(self, a, b):
        return ops.mul_mat(a, b)

    def rms_norm(self, a, eps):
        return ops.rms_norm(a, eps)

    def l2_norm(self, a, eps):
        return ops.l2_norm(a, eps)

    def silu(self, a):
        return ops.silu(a)

    def swiglu_split(self, a, b):
        return ops.swiglu_split(a, b)

    def permute(self, a, *axes):
        return ops.permute(a, *axes)

    def cont_2d(self, a, ne0, ne1):
        return ops.cont(a, ne0, ne1)

    def rope_multi(self, a, pos, n_dims, sections, mode, n_ctx_orig, freq_base):
        # llama.cpp's qwen35 defaults: freq_scale 1, no YaRN (ext_factor 0), attn_factor 1, beta_fast 32, beta_slow 1
        return ops.rope_multi(a, pos, None, n_dims, sections, mode, n_ctx_orig, freq_base, 1.0, 0.0, 1.0, 32.0, 1.0)

    def set_rows(self, a, b, c):
        return ops.set_rows(a, b, c)

    def mul_mat_f32(self, a, b):
        """ggml_mul_mat, then ggml_prec_set_acc(F32) (llama.cpp's KQ product)."""
        return ops.prec_set_acc(ops.mul_mat(a, b), Prec.F32)

    def soft_max_ext(self, a, mask, scale):
        return ops.soft_max_ext(a, mask, scale)

    def flash_attn_ext_f32(self, q, k, v, mask, scale):
        """ggml_flash_attn_ext, then ggml_prec_set_acc(F32), as build_attn_mha does."""
        return ops.flash_attn_ext(q, k, v, mask, scale, prec=Prec.F32)

    def sigmoid(self, a):
        return ops.sigmoid(a)

    def softplus(self, a):
        return ops.softplus(a)

    def ssm_conv(self, sx, c):
        return ops.ssm_conv(sx, c)

    def argsort_top_k(self, a, k):
        return ops.argsort_top_k(a, k)

    def src(self, t, i):
        return t.src[i]

    def sum_rows(self, a):
        return ops.sum_rows(a)

    def clamp(self, a, lo, hi):
        return ops.clamp(a, lo, hi)

    def div(self, a, b):
        return ops.div(a, b)

    def mul_mat_id(self, a, b, ids):
        return ops.mul_mat_id(a, b, ids)

    def gated_delta_net(self, q, k, v, g, beta, state, K):
        return ops.gated_delta_net(q, k, v, g, beta, state, K)

    def set_name(self, t: Tensor, name: str) -> Tensor:
        t.name = name
        return t

    def set_layer(self, t: Tensor, il: int) -> Tensor:
        t.layer = il
        return t

    def set_output(self, t: Tensor) -> Tensor:
        return ops.set_output(t)

    def expand(self, t: Tensor) -> None:
        self.graph.expand(t)
        for i, leaf in enumerate(self.graph.leafs):  # ggml_visit_parents names an unnamed leaf by its position
            if not leaf.name:
                leaf.name = f"leaf_{i}"


def build_verify_graph(cfg: VerifyConfig, weight_types: dict[str, DType] | None = None) -> Graph:
    """The verify forward of ``cfg`` (its GDN layers, or with ``cfg.whole`` the whole model), in llama.cpp's node
    order, unplanned. ``weight_types``: a model file's tensor types by name (they override ``cfg.wtype``)."""
    f = IrFacade()
    b = build_verify(f, cfg, weight_types)
    f.graph.meta = verify_meta(cfg)
    if cfg.mtp:  # the MTP graph's token ids are an unnamed leaf in llama.cpp (ggml's leaf_<i>): the fill finds it here
        f.graph.meta["token_input"] = b.tokens.name
    return f.graph


def build_conv_chain_graph(cfg: VerifyConfig) -> Graph:
    """One layer's conv chain alone, projection as input (see :func:`gdnpass.models.builder.build_conv_chain_only`)."""
    f = IrFacade()
    build_conv_chain_only(f, cfg)
    f.graph.meta = verify_meta(cfg, builder="conv-chain")
    return f.graph
