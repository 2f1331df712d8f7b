"""llama.cpp itself as a front end and as the referee (issue 15).

* :mod:`.build`: the pinned llama.cpp (llama-cpp-python 0.3.36's vendored commit), ggml + libllama + llama-speculative-simple at -O0, built
  once and cached per commit; ``gdnpass llama-build``.
* :mod:`.worker`: runs inside a subprocess (a ggml assert aborts the whole process): loads a GGUF, decodes a prompt
  and one verify ubatch while the scheduler's eval callback records every node, and reads the reserve graph.
* :mod:`.capture`: the parent side: runs the worker, turns its records into gdnpass graphs (format v2, named
  buffers, llama.cpp's offsets), and writes the graph file; ``gdnpass capture``.
* :mod:`.quantize`: llama.cpp's own quantizer (``llama_model_quantize``, in the worker) on a GGUF file: the Q8_0 and
  K-quant test and benchmark files; ``gdnpass quantize``.
"""
