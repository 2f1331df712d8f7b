"""Model shapes and the one GDN verify-forward builder.

- :mod:`gdnpass.models.hparams`: :class:`ModelShape`, :data:`PRESETS`, :class:`VerifyConfig`, :func:`default_ids`;
- :mod:`gdnpass.models.builder`: the builder (llama.cpp's qwen35 ``build_layer_attn_linear``, ``build_conv_state``,
  ``build_rs``, ``build_recurrent_attn``, the FFN), written against a constructor facade;
- :mod:`gdnpass.models.ir_facade`: that facade over :mod:`gdnpass.ops`, and :func:`build_verify_graph`.

The ggml front end (:mod:`gdnpass.frontends.ggml`) runs the same builder with real ggml calls.
"""

from gdnpass.models.hparams import (PRESETS, QK_NORMS, SNAPSHOT_LAYOUTS, ModelShape, VerifyConfig, default_ids,
                                     get_model)
from gdnpass.models.ir_facade import build_conv_chain_graph, build_verify_graph

__all__ = ["ModelShape", "PRESETS", "get_model", "VerifyConfig", "SNAPSHOT_LAYOUTS", "QK_NORMS", "build_verify_graph",
           "build_conv_chain_graph", "default_ids"]
