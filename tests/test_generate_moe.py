"""The speculative loop on a qwen35moe file (issue 36 step 3): fused vs unfused identical tokens, accepted counts and
logits bytes with rollback; llama.cpp (the pinned build) decodes the same file to the same tokens, plain and through
its own rollback path, under the divergence rule of tests/test_generate.py."""

from __future__ import annotations

import pytest

from gdnpass.drafters import NoDraft, Planted, cycle_schedule
from gdnpass.engine import Engine, Model, Settings
from gdnpass.generate import differences, divergence, generate
from gdnpass.models.gguf_write import write_gguf

PROMPT = [5, 17, 99, 3, 250, 7, 42, 8]
N = 12
LLAMA_REL = 1e-4  # the f32 file's logits bound (docs/moe.md): a divergence needs both top-2 margins below twice it
LENGTHS = [3, 3, 1, 0, 2]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return Model.from_gguf(write_gguf("tiny-qwen35moe", tmp_path_factory.mktemp("gen-moe") / "m.gguf", wtype="f32",
                                      seed=1))


def test_fused_and_unfused_generate_the_same_bytes(model):
    """A planted run (every acceptance 0..3, rollback each step) fused and unfused: identical tokens, accepted
    counts and logits bytes at every step; the MoE layers' ops run on the torch backend."""
    plain = generate(Engine(model, Settings(draft_max=0, n_rs_seq=0)), PROMPT, NoDraft(), N)
    runs = [generate(Engine(model, Settings(draft_max=3, fusion=fusion)), PROMPT,
                     Planted(plain.tokens, len(PROMPT), 512, cycle_schedule(3), LENGTHS), N, keep_logits=True)
            for fusion in (False, True)]
    assert differences(runs[0], runs[1]) == []
    assert runs[0].tokens == plain.tokens
    assert {s.accepted for s in runs[0].steps if s.drafted} == {0, 1, 2, 3}


def test_llama_cpp_generates_the_same_tokens(llama, model):
    from gdnpass.frontends.llama import capture
    from gdnpass.kernels.backends import GGML_CPU_BACKEND

    path = str(model.gguf.path)
    kw = dict(prompt=PROMPT, n_predict=N, n_ubatch=8, install=llama)
    lp = capture.generate(path, **kw)
    ls = capture.generate(path, n_rs_seq=3, draft_max=3, **kw,
                          drafter={"kind": "planted", "truth": lp["tokens"], "accept": cycle_schedule(3),
                                   "lengths": LENGTHS})
    assert ls["settings"]["n_rs_seq"] == 3 and all(s["seq_rm"] for s in ls["steps"])
    ours_p = generate(Engine(model, Settings(draft_max=0, n_rs_seq=0, n_ubatch=8, backend=GGML_CPU_BACKEND,
                                             margins=True)), PROMPT, NoDraft(), N, keep_logits=True)
    planted = Planted(ours_p.tokens, len(PROMPT), 512, cycle_schedule(3), LENGTHS)
    ours_s = generate(Engine(model, Settings(draft_max=3, n_ubatch=8, backend=GGML_CPU_BACKEND, margins=True)),
                      PROMPT, planted, N)
    tol = 2 * LLAMA_REL * max(float(r.abs().max()) for r in ours_p.rows)
    for ours, theirs in ((ours_p, lp), (ours_s, ls)):
        d = divergence(ours.tokens, ours.margins, theirs["tokens"], theirs["margins"], tol)
        assert d.ok, str(d)
    assert ls["tokens"] == lp["tokens"]
    assert [(s["n_t"], s["accepted"]) for s in ls["steps"]] == [(s.n_t, s.accepted) for s in ours_s.steps]
