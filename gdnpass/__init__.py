"""gdnpass: a graph-rewrite fusion pass for Gated-Delta-Net layers in a ggml-like compute-graph IR."""

__version__ = "0.1.0"
