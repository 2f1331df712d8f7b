"""What the llama.cpp referee tests (tests/frontends/llama/test_referee*.py, test_moe_referee.py) check of a capture,
written once: a builder's graph against llama.cpp's captured one, llama.cpp's plan against gdnpass's planner, and
the builder's logits from llama.cpp's own state at the verify's start."""

from __future__ import annotations

from pathlib import Path

from gdnpass import alloc
from gdnpass.frontends.compare import signature
from gdnpass.frontends.llama import capture as cap_mod


def assert_graph_equals_capture(mine, c: cap_mod.Capture) -> None:
    """``mine`` equals llama.cpp's verify graph node for node (op, type, ne, nb, op params, views, sources, flags),
    leaf for leaf (without buffers: ours keeps inputs in an input buffer; a leaf no node reads, which the capture
    never sees, by name and flags only), and in ggml's use counts."""
    g = c.verify
    assert signature(mine) == signature(g)
    unseen = set(g.meta["llama"]["unseen_leafs"])
    leaf = lambda t: (t.name, int(t.flags)) if t.name in unseen else (t.name, t.type, t.ne, t.nb, int(t.flags))  # noqa
    assert [leaf(t) for t in mine.leafs] == [leaf(t) for t in g.leafs]
    pos = lambda gr, counts: [counts.get(t.uid, 0) for t in [*gr.leafs, *gr.nodes]]  # noqa: E731
    assert pos(mine, mine.use_counts()) == pos(g, c.use_counts)


def assert_plan_equals_capture(c: cap_mod.Capture) -> tuple[list, dict]:
    """gdnpass's gallocr replica plans llama.cpp's reserve graph to its compute buffer's size and, bound to the
    verify graph, puts every compute tensor on llama.cpp's offset (leafs no node reads are never seen by
    llama.cpp's callback: their offsets are the replica's, so not compared). Returns (those compute tensors,
    llama.cpp's (buffer, offset) by uid) for the caller's own checks."""
    g = c.verify
    theirs = {t.uid: (t.buffer, t.offset) for t in g.tensors() if t.view_src is None}
    planned = alloc.plan(c.reserve, g.meta["buffers"]["compute"]["alignment"], "compute")
    assert planned.buffers["compute"] == g.meta["buffers"]["compute"]["size"]  # gallocr's compute buffer size
    b = alloc.bind(c.reserve, g, "compute")
    assert not b.reallocated, b.why
    unseen = set(g.meta["llama"]["unseen_leafs"])
    compute = [t for t in g.tensors() if t.view_src is None and theirs[t.uid][0] == "compute" and t.name not in unseen]
    assert [(t.name, t.offset, theirs[t.uid][1]) for t in compute if (t.buffer, t.offset) != theirs[t.uid]] == []
    return compute, theirs


def logits_from_llama_state(llama, path: Path, n_tokens: int, n_rs_seq: int, n_ubatch: int, flash: str):
    """The builder's whole forward of model file ``path``, run unfused by gdnpass's executor with GGML_CPU_BACKEND
    from the state llama.cpp's memory held when its verify began (the prompt's KV cache and recurrent states,
    recorded by the capture, copied leaf by leaf), with the capture's token ids and the file's weights; then fused,
    from the same state, against the unfused run. Returns (max |Δ| / max |ref| of its logits against llama.cpp's
    CPU logits, the ``check_fusion`` result)."""
    import numpy as np
    import torch

    from gdnpass import pipeline
    from gdnpass.check import check_fusion
    from gdnpass.kernels.backends import GGML_CPU_BACKEND
    from gdnpass.models.fill import fill
    from gdnpass.models.gguf_model import open_model
    from gdnpass.runtime import Executor

    s = cap_mod.Settings(n_tokens=n_tokens, n_rs_seq=n_rs_seq, n_ubatch=n_ubatch, n_batch=n_ubatch,
                         record_memory=True, flash_attn=flash)
    c = cap_mod.capture(path, s, install=llama)
    want = torch.from_numpy(np.frombuffer(c.logits, dtype=np.float32).copy()).reshape(n_tokens, c.n_vocab)
    model = open_model(path)
    cfg = model.config(n_tokens=n_tokens, n_rs_seq=n_rs_seq, n_past=s.n_prompt, flash_attn=flash == "on")
    cached = {t.name: t for t in c.verify.leafs if t.buffer in ("rs", "kv")}
    tokens = [x % c.n_vocab for x in s.tokens()[1]]

    def start(ex: Executor, graph) -> None:  # after the seeded fill: llama.cpp's state, weights and tokens
        model.load_weights(ex, graph)
        for t in graph.leafs:
            if t.name in cached:
                theirs = cached[t.name]
                raw = c.memory[theirs.buffer][theirs.offset: theirs.offset + theirs.nbytes]
                ex.view(t).view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        ex.view(graph.find("inp_tokens")).copy_(torch.tensor(tokens, dtype=torch.int32))

    res = pipeline.run(model.build(cfg), pipeline.PassOptions(fusion=False))
    assert {t.name for t in res.graph.leafs if t.name.startswith("cache_")} == set(cached)
    ex = Executor(res.graph, backend=GGML_CPU_BACKEND)
    fill(ex, seed=0)
    start(ex, res.graph)
    ex.run()
    got = ex.read(res.graph.find("result_output")).reshape(want.shape)
    err = float((got - want).abs().max() / want.abs().max())
    res = pipeline.run(model.build(cfg), pipeline.PassOptions(fusion=True), fuse_now=False)
    return err, check_fusion(res.graph, weights=lambda ex: start(ex, res.graph))
