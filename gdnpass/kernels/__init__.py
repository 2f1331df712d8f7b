"""Kernels: the semantic spec and the implementations.

- :mod:`~gdnpass.kernels.reference`: the torch reference of every op (the semantic spec);
- :mod:`~gdnpass.kernels.triton_core`: the exactness core of the Triton kernels, the ``@triton.jit`` helpers that fused
  and unfused kernels share and the launch conventions;
- the Triton kernels and their launchers, by family: :mod:`~gdnpass.kernels.triton_elementwise` (data movement and
  elementwise ops), :mod:`~gdnpass.kernels.triton_norms` (and SUM_ROWS), :mod:`~gdnpass.kernels.triton_sort`
  (ARGSORT), :mod:`~gdnpass.kernels.triton_matvec` (the mat-vec, its pair and its store's epilogue, MUL_MAT_ID),
  :mod:`~gdnpass.kernels.triton_ssm` (SSM_CONV, GATED_DELTA_NET, the fused conv chain),
  :mod:`~gdnpass.kernels.triton_rope`, :mod:`~gdnpass.kernels.triton_attention`;
- :mod:`~gdnpass.kernels.limits`: what the kernels can do (read by the patterns' matchers and records);
- :mod:`~gdnpass.kernels.backends`: the op -> adapter tables the executor runs.

The fused ops' records, with their adapters, live with their patterns (:mod:`gdnpass.patterns`). This package
module imports nothing: ``limits`` loads without torch or Triton, so a graph can be built, planned, fused and dumped
without either.
"""
