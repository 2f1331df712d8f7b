"""gdnpass's errors: one base class, so a front end can catch everything a user can cause in one place.

Each message is one line naming the file, flag, tensor or field at fault. Declining a fusion is not an error (it is
a :class:`gdnpass.patterns.common.Refusal` value); an exception that is not a :class:`GdnpassError` is a bug.
"""

from __future__ import annotations


class GdnpassError(Exception):
    """Base of every error gdnpass raises on bad input or an impossible request."""


class GraphError(GdnpassError, ValueError):
    """A graph (or graph file, or config) that ggml would reject. The message names the tensor or field at fault."""


class KernelError(GdnpassError, ValueError):
    """Arguments a kernel launcher cannot run safely (shapes, strides or aliasing outside what it was built for)."""


class ResourceError(GdnpassError):
    """A request the machine cannot serve: a plan larger than the memory available, an interpreter run too long."""


class LlamaError(GdnpassError):
    """llama.cpp as a front end or referee could not do what was asked: its build failed, its layout is not the one
    gdnpass reads, or it aborted (a ggml assert) while capturing. The message is llama.cpp's own one line when it has
    one."""
