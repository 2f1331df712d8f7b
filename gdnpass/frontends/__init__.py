"""Front ends: graphs built by other tools, imported into :mod:`gdnpass.ir`.

- :mod:`gdnpass.frontends.ggml`: a ``ggml_cgraph`` (via ggml-python) -> :class:`gdnpass.ir.Graph`, plus a facade that
  runs gdnpass's one verify builder with real ggml calls, so that ggml itself referees our IR, op semantics and
  memory plan.
  Needs the optional dependency ``ggml-python`` (imported lazily, on first use).
"""
