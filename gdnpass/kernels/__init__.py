"""Kernels: the semantic spec and the implementations.

- :mod:`~gdnpass.kernels.reference`: the torch reference of every op (the semantic spec);
- :mod:`~gdnpass.kernels.triton_ops`: the Triton kernels and their launchers;
- :mod:`~gdnpass.kernels.fused`: one record per fused op (inputs, parameters, launches, adapters, scope);
- :mod:`~gdnpass.kernels.limits`: what the kernels can do (read by the matchers);
- :mod:`~gdnpass.kernels.backends`: the op -> adapter tables the executor runs.

This package module imports nothing: ``limits`` and ``fused`` load without torch or Triton, so a graph can be built,
planned, fused and dumped without either.
"""
