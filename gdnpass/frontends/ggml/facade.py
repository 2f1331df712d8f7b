"""The builder's facade over real ggml calls (ggml-python), on a :class:`GgmlSession`: gdnpass's one verify builder
(:mod:`gdnpass.models.builder`) then builds its graph with ggml itself, so node order, auto-names and use counts come
from ``ggml_build_forward_expand``."""

from __future__ import annotations

from gdnpass.frontends.ggml.session import GgmlSession
from gdnpass.ir import DType
from gdnpass.models.builder import VerifyBuilder, build_conv_chain_only, build_verify
from gdnpass.models.builder import verify_meta as _verify_meta
from gdnpass.models.hparams import VerifyConfig


class GgmlFacade:
    """:class:`gdnpass.models.builder.Facade` as ``ggml_*(ctx, ...)`` calls in ``session.ctx``; leafs go to the
    session's per-buffer contexts. ggml has no layer tags (``il`` and :meth:`set_layer` are ignored): the importer
    reads them back from the names."""

    def __init__(self, session: GgmlSession) -> None:
        self.s, self.g, self.ctx = session, session.g, session.ctx

    def new_tensor(self, buffer: str, name: str, type_: DType, ne, *, input: bool = False, il: int = -1):
        return self.s.new_tensor(buffer, name, type_, ne, input=input)

    def ne(self, t) -> tuple[int, int, int, int]:
        return tuple(int(x) for x in t.contents.ne)

    def nb(self, t) -> tuple[int, int, int, int]:
        return tuple(int(x) for x in t.contents.nb)

    def view_1d(self, a, ne0, offset):
        return self.g.ggml_view_1d(self.ctx, a, ne0, offset)

    def view_2d(self, a, ne0, ne1, nb1, offset):
        return self.g.ggml_view_2d(self.ctx, a, ne0, ne1, nb1, offset)

    def view_3d(self, a, ne0, ne1, ne2, nb1, nb2, offset):
        return self.g.ggml_view_3d(self.ctx, a, ne0, ne1, ne2, nb1, nb2, offset)

    def view_4d(self, a, ne0, ne1, ne2, ne3, nb1, nb2, nb3, offset):
        return self.g.ggml_view_4d(self.ctx, a, ne0, ne1, ne2, ne3, nb1, nb2, nb3, offset)

    def reshape_2d(self, a, ne0, ne1):
        return self.g.ggml_reshape_2d(self.ctx, a, ne0, ne1)

    def reshape_3d(self, a, ne0, ne1, ne2):
        return self.g.ggml_reshape_3d(self.ctx, a, ne0, ne1, ne2)

    def reshape_4d(self, a, ne0, ne1, ne2, ne3):
        return self.g.ggml_reshape_4d(self.ctx, a, ne0, ne1, ne2, ne3)

    def transpose(self, a):
        return self.g.ggml_transpose(self.ctx, a)

    def concat(self, a, b, dim):
        return self.g.ggml_concat(self.ctx, a, b, dim)

    def get_rows(self, a, b):
        return self.g.ggml_get_rows(self.ctx, a, b)

    def cpy(self, a, b):
        return self.g.ggml_cpy(self.ctx, a, b)

    def scale(self, a, s):
        return self.g.ggml_scale(self.ctx, a, s)

    def scale_inplace(self, a, s):
        return self.g.ggml_scale_inplace(self.ctx, a, s)

    def add(self, a, b):
        return self.g.ggml_add(self.ctx, a, b)

    def mul(self, a, b):
        return self.g.ggml_mul(self.ctx, a, b)

    def mul_mat(self, a, b):
        return self.g.ggml_mul_mat(self.ctx, a, b)

    def rms_norm(self, a, eps):
        return self.g.ggml_rms_norm(self.ctx, a, eps)

    def l2_norm(self, a, eps):
        return self.g.ggml_l2_norm(self.ctx, a, eps)

    def silu(self, a):
        return self.g.ggml_silu(self.ctx, a)

    def swiglu_split(self, a, b):
        return self.g.ggml_swiglu_split(self.ctx, a, b)

    def sigmoid(self, a):
        return self.g.ggml_sigmoid(self.ctx, a)

    def softplus(self, a):
        return self.g.ggml_softplus(self.ctx, a)

    def ssm_conv(self, sx, c):
        return self.g.ggml_ssm_conv(self.ctx, sx, c)

    def gated_delta_net(self, q, k, v, g, beta, state, K):
        return self.g.ggml_gated_delta_net(self.ctx, q, k, v, g, beta, state, K)

    def set_name(self, t, name: str):
        self.g.ggml_set_name(t, name.encode())
        return t

    def set_layer(self, t, il: int):
        return t

    def set_output(self, t):
        self.g.ggml_set_output(t)
        return t

    def expand(self, t) -> None:
        self.s.expand(t)


def build_ggml_verify_graph(cfg: VerifyConfig, session: GgmlSession | None = None
                            ) -> tuple[GgmlSession, VerifyBuilder]:
    """:func:`gdnpass.models.build_verify_graph` with ggml: the graph is ``session.gf`` (not yet allocated)."""
    s = session or GgmlSession()
    return s, build_verify(GgmlFacade(s), cfg)


def build_ggml_conv_chain(cfg: VerifyConfig, session: GgmlSession | None = None) -> tuple[GgmlSession, VerifyBuilder]:
    """:func:`gdnpass.models.build_conv_chain_graph` with ggml: one layer's conv chain, the projection
    ``inp_qkv_mixed`` as an input; SILU and both L2 outputs flagged OUTPUT."""
    s = session or GgmlSession()
    return s, build_conv_chain_only(GgmlFacade(s), cfg)


def verify_meta(cfg: VerifyConfig) -> dict:
    """The graph.meta gdnpass.models gives the same config (so models.fill and reports work on imports)."""
    return _verify_meta(cfg, builder="ggml-verify")
