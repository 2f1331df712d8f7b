"""The benchmark harness: what the command-line scripts in ``benchmarks/`` share, importable without a GPU (the
timing itself needs one). No module here imports a script; the scripts import these.

- :mod:`~gdnpass.bench.timing`: how a kernel is timed (profiler kernel durations over CUDA-graph replays, CUDA-event
  timing of a graph of repeated calls) and one node of an executor as a callable;
- :mod:`~gdnpass.bench.ceilings`: the card's read and copy bandwidth (CUDA events, no capture, no profiler),
  cross-checked against the datasheet and the tables' own timing; every bandwidth floor is bytes over these;
- :mod:`~gdnpass.bench.floors`: the floor kernels of the fused chain's data dependencies (Triton copies of N bytes,
  after a dependent load, with a block norm);
- :mod:`~gdnpass.bench.chain`: the fused conv chain at qwen3.5-9b size (operands, bytes, the unfused chain's
  kernels next to upstream's, the one-layer fused node in a snapshot layout, the dedup layouts, and those at batch:
  S sequences x T tokens, fused vs unfused checked first, next to seed 003's per-token baseline and figures);
- :mod:`~gdnpass.bench.matvec`: the thin MUL_MAT (the models' product shapes read off the fused graph, cold-weight
  rotation, operands) against the read bandwidth, a streaming read of the same bytes and cuBLAS, and the alpha/beta
  pair;
- :mod:`~gdnpass.bench.forward`: the verify forward, fusion off vs on (kernels, kernel time, CUDA-graph GPU time),
  and the pass's own CPU time;
- :mod:`~gdnpass.bench.upstream`: upstream llama.cpp's own verify decode on the GPU (CUDA build, model file, ncu
  kernel durations, wall times) and the per-GDN-layer chain table both sides are read into;
- :mod:`~gdnpass.bench.revisions`: another revision's ``gdnpass`` package loaded as a package of its own;
- :mod:`~gdnpass.bench.session`: the device session's steps (each a script run by path) and their runner.
"""
