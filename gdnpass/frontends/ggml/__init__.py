"""ggml as the referee of our IR, op semantics and memory plan (issue 8).

All on ggml's CPU backend through ggml-python (0.0.45, which bundles ggml 0.15.3), one module per job:

* :mod:`.importer`: :func:`from_ggml` / :func:`import_ggml` import a ``ggml_cgraph`` into a
  :class:`gdnpass.ir.Graph`: every node and leaf in ggml's order, with ggml's names, types, ``ne``/``nb``, decoded op
  params, ``view_src``/``view_offs``, flags and sources. The result is validated with :func:`gdnpass.ops.validate`
  (our shape rules re-derive every node), so a node ggml builds but our rules reject is a
  :class:`~gdnpass.ir.GraphError` naming that node. Also ggml's own use counts (:func:`ggml_use_counts`) and
  :func:`lib`, the bindings.
* :mod:`.session`: :class:`GgmlSession` owns the ggml contexts, the weight/cache/input backend buffers, gallocr and
  the CPU backend; :meth:`GgmlSession.referee` runs the graph one node at a time and checks each node against the
  torch reference (:mod:`gdnpass.kernels`) fed with ggml's own inputs of that node; :func:`push_leafs` /
  :func:`pull_leafs` copy leaf bytes between a session and a gdnpass Executor.
* :mod:`.facade`: :class:`GgmlFacade`, the constructor facade of gdnpass's one verify builder
  (:mod:`gdnpass.models.builder`) as real ggml calls: :func:`build_ggml_verify_graph` and :func:`build_ggml_conv_chain`
  build the graphs of :func:`gdnpass.models.build_verify_graph` / :func:`~gdnpass.models.build_conv_chain_graph`
  with ggml, ``ggml_build_forward_expand`` for ``Graph.expand``, so node order and use counts come from ggml itself.
* :mod:`gdnpass.frontends.compare` (shared with the llama.cpp capture): :func:`signature`, :func:`leaf_signature`, :func:`diff_graphs` (structure, tensors by position).

Buffers of imported leafs (see :func:`leaf_buffer`), first match wins:

1. ``buffers[name]`` (a tensor name), then ``buffers[ctx]`` (a ggml context pointer: all tensors created in it);
2. a leaf created in the compute context ``ctx`` (if given) is ``input``: that is where llama.cpp makes its inputs;
3. the name: ``cache_*`` is ``cache``; ``inp_*`` or the INPUT flag is ``input``; anything else is ``weights``.

Computed tensors get no buffer (plan them with :func:`gdnpass.alloc.plan`). What gallocr decided is kept in
``graph.meta["ggml"]["arena_offsets"]``: per node, its data pointer minus the base of its gallocr buffer (``None``
for views and for nodes without data), so the two plans can be compared node by node.

Layers: a name ending in ``-<il>`` (llama.cpp's ``cb``) gives the layer; leafs ``blk.<il>.*`` and ``cache_?_l<il>``
too; ``inp_*`` and ``blk.*.*`` are -1; any other node inherits from its sources as :mod:`gdnpass.ops` does.

ggml ops we do not model become ``Op.OPAQUE`` nodes (kept as ggml made them, never fused). Binding bug worked around
here: ggml-python 0.0.45 declares the return type of ``ggml_backend_cpu_buffer_type``, ``ggml_backend_alloc_buffer``
and ``ggml_backend_cpu_buffer_from_ptr`` as a Python ``int`` NewType, which ctypes treats as a 32-bit C int; the
pointer is truncated and the next call segfaults whenever the heap lies above 4 GiB. :func:`lib` resets those
return types to ``c_void_p``.
"""

from gdnpass.frontends.compare import diff_graphs, leaf_signature, signature
from gdnpass.frontends.ggml.facade import GgmlFacade, build_ggml_conv_chain, build_ggml_verify_graph, verify_meta
from gdnpass.frontends.ggml.importer import (Imported, TensorStruct, from_ggml, ggml_use_counts, import_ggml,
                                             leaf_buffer, lib, read_tensor, version)
from gdnpass.frontends.ggml.session import GgmlSession, NodeCheck, compare, pull_leafs, push_leafs

__all__ = [
    "GgmlFacade", "GgmlSession", "Imported", "NodeCheck", "TensorStruct", "build_ggml_conv_chain",
    "build_ggml_verify_graph", "compare", "diff_graphs", "from_ggml", "ggml_use_counts", "import_ggml", "leaf_buffer",
    "leaf_signature", "lib", "pull_leafs", "push_leafs", "read_tensor", "signature", "verify_meta", "version",
]
