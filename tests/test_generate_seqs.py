"""Issue 37 item 4: the speculative loop over several sequences at once (gdnpass.generate.generate_batch).

Each sequence drafts, is verified, accepts and rolls back on its own, in ubatches shared as llama.cpp's
split_equal shares them (equal token counts, consecutive sequence ids); on a whole tiny qwen35 model:

- every sequence's tokens are those it generates alone with the same drafter (and plain greedy decode's), its
  steps (widths, accepted counts, the plane each rollback leaves) are its steps alone, the state each rollback
  leaves is plain decode's at that position;
- fused vs unfused: identical tokens, accepted counts and logits bytes for every sequence at every step;
- per-sequence rollback indices: sequences that accepted different counts in one ubatch each read their own plane
  in the next shared ubatch (rs_s_copy = plane * n_seqs + cell), with every other plane poisoned; a wrong plane for
  one sequence changes its logits and no byte of the other's;
- a sequence that finishes early (end of generation) or drafts nothing leaves or shrinks the batch: the ubatches
  follow llama.cpp's split (a gap in the sequence ids splits the run);
- llama.cpp (the pinned build) runs the same loop over the same sequences: the same tokens, steps and rollbacks,
  and the ubatches its scheduler computed for each batch are those of gdnpass's split_equal;
- the CLI: several --prompt-ids with --check and --json; bad input as one-line errors.
"""

from __future__ import annotations

import json

import pytest
import torch

from gdnpass.drafters import NgramSimple, NoDraft, Planted, cycle_schedule, draft_budget
from gdnpass.engine import Engine, Model, Part, Settings, split_equal
from gdnpass.errors import GdnpassError
from gdnpass.generate import differences, divergence, generate, generate_batch, state_difference
from gdnpass.generate_cli import SELF_TOLERANCE
from gdnpass.models.gguf_write import write_gguf
from support.cli import cli_run, refused

PROMPTS = [[5, 17, 99, 3, 250, 7, 42, 8], [1, 2, 3], [400, 401, 402, 403, 404, 9]]
N, K = 12, 3
# per sequence: (acceptances, draft lengths) of its planted drafter; sequence 1 drafts nothing at its third step,
# sequence 2 accepts every draft (it reaches -n steps before the others)
SCHEDULES = [(cycle_schedule(K), ()), ([1, 3, 0, 2], [3, 3, 0, 3, 1]), ([K], [K])]
STATE_TOLERANCE = 1e-5  # as tests/test_generate.py


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return Model.from_gguf(write_gguf("tiny-qwen35", tmp_path_factory.mktemp("seqs") / "m.gguf", wtype="f32", seed=1))


@pytest.fixture(scope="module")
def plain(model):
    """Each prompt alone, plain greedy decode."""
    eng = Engine(model, Settings(draft_max=0, n_rs_seq=0, margins=True))  # (generate resets it for each prompt)
    return [generate(eng, p, NoDraft(), N, record_states=True) for p in PROMPTS]


def planted(plain, schedules=SCHEDULES):
    return [Planted(r.tokens, len(p), 512, a, n) for r, p, (a, n) in zip(plain, PROMPTS, schedules)]


@pytest.fixture(scope="module")
def alone(model, plain):
    """Each sequence alone with its planted drafter."""
    eng = Engine(model, Settings(draft_max=K, margins=True))
    return [generate(eng, p, d, N) for p, d in zip(PROMPTS, planted(plain))]


@pytest.fixture(scope="module")
def batch(model, plain):
    """The three sequences at once, fusion off and on, every unread plane of a ubatch's cells poisoned."""
    return {fusion: generate_batch(Engine(model, Settings(draft_max=K, n_seqs=3, fusion=fusion, poison=True,
                                                          margins=True)),
                                   PROMPTS, planted(plain), N, hash_logits=True, record_states=True)
            for fusion in (False, True)}


# ---- the split ------------------------------------------------------------------------------------------------------


def test_split_equal_is_llama_cpp_s():
    """llama_batch_allocr::split_equal(n_ubatch, sequential, n_keep_tail = 4), worked by hand from its source."""
    parts = lambda batch, n_ub=16, tail=4: [(p.seq0, p.n_seqs, p.n_t) for p in split_equal(batch, n_ub, tail)]  # noqa
    assert parts([(0, 4), (1, 4), (2, 4)]) == [(0, 3, 4)]               # equal drafts: one ubatch
    assert parts([(0, 2), (1, 2), (2, 4), (3, 4)]) == [(0, 2, 2), (2, 2, 4)]
    # the shortest sequence sets the count; a sequence left with 1..3 of its last 4 tokens may not be split, so
    # the first such one goes alone, whole
    assert parts([(0, 4), (1, 4), (2, 2), (3, 4)]) == [(0, 1, 4), (1, 1, 4), (2, 1, 2), (3, 1, 4)]
    assert parts([(0, 4), (2, 4)]) == [(0, 1, 4), (2, 1, 4)]            # a gap in the ids: no shared ubatch
    assert parts([(s, 4) for s in range(8)]) == [(0, 1, 4), (1, 1, 4), (2, 1, 4), (3, 1, 4), (4, 4, 4)]  # n_ubatch 16
    # a prefill: sequences of 7, 2, 5 tokens (llama.cpp's own split of this batch, tests below)
    assert split_equal([(0, 7), (1, 2), (2, 5)], 12, 4) == [Part(0, 2, (0, 0)), Part(0, 5, (2,)), Part(2, 5, (0,))]
    # a long sequence alone is cut to leave exactly n_keep_tail tokens
    # 4 each while both leave >= 4; then sequence 0 (2 would be left) alone to its end; sequence 1 alone: 8, then
    # 10 do not fit, so it is cut to leave its last 4
    assert parts([(0, 18), (1, 30)], 8) == [(0, 2, 4), (0, 2, 4), (0, 2, 4), (0, 1, 6), (1, 1, 8), (1, 1, 6),
                                            (1, 1, 4)]
    assert parts([(0, 5), (1, 5)], 16, 0) == [(0, 2, 5)] and parts([(0, 5), (1, 3)], 16, 0) == [(0, 2, 3), (0, 1, 2)]
    assert split_equal([(0, 0), (1, 0)], 16, 4) == []


# ---- the identity table ------------------------------------------------------------------------------------------


def test_each_sequence_generates_what_it_generates_alone(plain, alone, batch):
    for fusion, res in batch.items():
        for s, (r, a, p) in enumerate(zip(res, alone, plain)):
            assert r.tokens == a.tokens == p.tokens, (fusion, s)
            assert [(x.n_t, x.accepted, x.plane) for x in r.steps] == [(x.n_t, x.accepted, x.plane) for x in a.steps]
            d = divergence(r.tokens, r.margins, p.tokens, p.margins, SELF_TOLERANCE)
            assert d.index is None and torch.isfinite(torch.tensor(r.margins)).all()  # no poisoned plane was read
            # the planted schedule was realised, and each rollback left plain decode's state
            check, done = planted(plain)[s], 0
            for i, x in enumerate(r.steps):
                budget = draft_budget(K, 256, len(PROMPTS[s]) - 1 + done, N, done)
                assert (x.drafted, x.accepted) == check.planned(i, budget), (s, i)
                done += x.accepted + 1
                n_past = len(PROMPTS[s]) - 1 + done
                assert state_difference(r.states[n_past], p.states[n_past]) < STATE_TOLERANCE, (s, n_past)
    steps = [x for r in batch[False] for x in r.steps]
    assert {x.accepted for x in steps if x.drafted} == set(range(K + 1)) and any(not x.drafted for x in steps)
    assert len(batch[False][2].steps) < min(len(r.steps) for r in batch[False][:2])  # it left the batch early


def test_fusion_changes_no_byte_for_any_sequence(batch):
    off, on = batch[False], batch[True]
    for x, y in zip(off, on):
        assert differences(x, y) == []
        assert all(a.logits_sha256 == b.logits_sha256 for a, b in zip(x.steps, y.steps))


def test_sequences_share_ubatches_and_read_their_own_planes(batch):
    """The run above had ubatches of several sequences whose members read different planes (their own rollbacks)
    with every other plane poisoned: the identity tests above are the proof that each read its own."""
    res = batch[False]
    shared = []  # for each shared ubatch after the first step: the planes its sequences read
    for i in range(1, max(len(r.steps) for r in res)):
        group = [s for s, r in enumerate(res) if i < len(r.steps) and r.steps[i].ubatch_seqs > 1]
        if group:
            shared.append({res[s].steps[i - 1].plane for s in group})
    assert shared and any(len(planes) > 1 for planes in shared), shared
    # unequal drafts go alone (llama.cpp's split); all three share a ubatch where their drafts are equal
    assert {1, 3} <= {x.ubatch_seqs for r in res for x in r.steps}


def test_per_sequence_rollback_indices_in_one_ubatch(model):
    """Two sequences verify 4 tokens each in one ubatch; sequence 0 accepts 2 drafts (its next ubatch reads plane
    1), sequence 1 none (plane 3). Their next shared ubatch writes rs_s_copy = plane * n_seqs + cell = [2, 7] and
    gives each sequence its logits alone (a one-sequence engine through the same history), every other plane
    poisoned; reading plane 2 for sequence 1 instead changes its logits and leaves sequence 0's bytes alone."""
    p0, p1 = [5, 17, 99, 3, 250, 7], [1, 2, 3, 4, 5]
    v0, v1 = [8, 90, 91, 92], [6, 60, 61, 62]
    nxt = {0: [33, 34], 1: [44, 45]}

    def two(plane1: int | None = None):
        eng = Engine(model, Settings(draft_max=3, n_seqs=2, poison=True))
        eng.prefill({0: p0, 1: p1})
        out = eng.decode_batch({0: v0, 1: v1})
        assert out[0].slot is out[1].slot and out[0].slot.n_seqs == 2  # one ubatch of both
        assert eng.seq_rm(len(p0) + 3, seq=0) and eng.seq_rm(len(p1) + 1, seq=1)
        assert [m.rs_idx for m in eng.mem] == [1, 3]
        if plane1 is not None:
            eng.mem[1].rs_idx = plane1
        out = eng.decode_batch(nxt, keep_logits=True, check=plane1 is None)
        assert out[0].slot.n_seqs == 2 and [m.rs_idx for m in eng.mem] == [0, 0]  # single use
        return out, out[0].slot.inputs["rs_s_copy"].tolist()

    out, s_copy = two()
    assert s_copy == [1 * 2 + 0, 3 * 2 + 1]
    for seq, (p, v, accepted) in enumerate(((p0, v0, 2), (p1, v1, 0))):
        eng = Engine(model, Settings(draft_max=3))
        eng.prefill(p)
        eng.verify(v)
        assert eng.seq_rm(len(p) + 1 + accepted)
        want = eng.decode(nxt[seq])
        got = out[seq].logits()
        assert float((got - want).abs().max()) < 1e-5 * float(want.abs().max())
        assert out[seq].ids == torch.argmax(want, dim=-1).tolist()
    wrong, _ = two(plane1=2)
    assert wrong[0].logits().numpy().tobytes() == out[0].logits().numpy().tobytes()
    assert float((wrong[1].logits() - out[1].logits()).abs().max()) > 1e-2


def test_one_wait_per_step_however_many_ubatches(model, plain, monkeypatch):
    """A step's batch split into several ubatches queues them all and waits once (the last head's fetch; the others
    are read from copies queued behind their ubatches): no host round trip per sequence or per ubatch."""
    from gdnpass.engine import GreedyHead

    calls = {"fetch": 0, "read": 0}
    for name in calls:
        def counted(self, _f=getattr(GreedyHead, name), _n=name):
            calls[_n] += 1
            return _f(self)
        monkeypatch.setattr(GreedyHead, name, counted)
    eng = Engine(model, Settings(draft_max=K, n_seqs=3))
    res = generate_batch(eng, PROMPTS, planted(plain), N)
    steps = max(len(r.steps) for r in res)
    assert calls["fetch"] == steps and eng.ubatches - res[0].prefill_ubatches > steps
    assert calls["read"] == eng.ubatches - res[0].prefill_ubatches  # (fetch reads its own head too)


def test_a_batch_that_runs_one_graph_twice(model):
    """A sequence's 10 tokens with n_ubatch 4 are ubatches of 4, 4, 2 (the first two on one graph): each row's token
    is what one ubatch at a time gives (the first run's head is read before the second run reuses its buffers)."""
    toks = [5, 17, 99, 3, 250, 7, 42, 8, 1, 2]
    eng = Engine(model, Settings(draft_max=1, n_ubatch=4))
    got = eng.decode_batch({0: toks})[0]
    assert [(k[0], k[3]) for k in eng.slots] == [(4, 0), (2, 0)] and eng.ubatches == 3
    one = Engine(model, Settings(draft_max=1, n_ubatch=4))
    want = [i for a, b in ((0, 4), (4, 8), (8, 10)) for i in one.verify(toks[a:b]).ids]
    assert got.ids == want and len(set(want[:4])) > 1


def test_engines_of_a_model_share_its_weights(model, tmp_path, monkeypatch):
    """Contexts of one model share its weights, as llama.cpp's contexts share their model (benchmarks/seqs_bench.py
    keeps one copy of the 9B's 17 GB for all of its engines): a later engine's weights buffer is the first's and it
    loads no byte, and it decodes what the first decodes, byte for byte, fused or not, with any number of sequences;
    another model's engine has its own."""
    own = Engine(model, Settings(draft_max=K))
    alone = generate(own, PROMPTS[0], NoDraft(), 6, hash_logits=True)
    loaded = []
    load = model.gguf.load_weights
    monkeypatch.setattr(model.gguf, "load_weights", lambda ex, g, skip=(): loaded.append(load(ex, g, skip)))
    for fusion, n_seqs in ((False, 1), (True, 2)):
        shared = Engine(model, Settings(draft_max=K, fusion=fusion, n_seqs=n_seqs))
        again = generate(shared, PROMPTS[0], NoDraft(), 6, hash_logits=True)
        assert shared.shared["weights"] is own.shared["weights"] and differences(alone, again) == []
    assert loaded == [0, 0]  # (bytes written: each engine's first graph skipped every weight)
    other = Model.from_gguf(write_gguf("tiny-qwen35", tmp_path / "o.gguf", wtype="f32", seed=2))
    assert Engine(other, Settings(draft_max=K)).weights is not own.weights


def test_a_sequence_that_ends_leaves_the_batch(model, plain):
    """Every draft accepted, so all three verify K + 1 tokens in one ubatch each step, until sequence 1 generates
    an end-of-generation token: it stops there, and sequences 0 and 2 (no longer consecutive ids) go on in
    ubatches of their own, generating what they generate alone."""
    stop = plain[1].tokens[5]
    assert all(stop not in r.tokens for r in (plain[0], plain[2]))
    res = generate_batch(Engine(model, Settings(draft_max=K, n_seqs=3, poison=True)), PROMPTS,
                         planted(plain, [([K], ())] * 3), N, eog={stop})
    assert res[1].stop == "eog" and res[1].tokens == plain[1].tokens[:plain[1].tokens.index(stop) + 1]
    assert res[0].tokens == plain[0].tokens and res[2].tokens == plain[2].tokens
    shared = len(res[1].steps)
    assert [x.ubatch_seqs for x in res[0].steps] == [3] * shared + [1] * (len(res[0].steps) - shared)


def test_ngram_sequences_on_a_cycle_model(tmp_path):
    """The n-gram drafter on a model that repeats itself: every sequence drafts and accepts multi-token runs of its
    own, drafts of different lengths split the batch, fused and unfused give the same bytes, each sequence the
    tokens it generates alone."""
    from gdnpass.models.cycle_model import write_cycle_gguf

    m = Model.from_gguf(write_cycle_gguf("tiny-qwen35-b", tmp_path / "cycles.gguf", period=5, seed=2))
    prompts, n = [[12, 40, 7, 3, 9], [100, 101, 102], [250, 3, 77, 78, 79, 80, 81]], 16
    ng = NgramSimple(2, 3)
    runs = {f: generate_batch(Engine(m, Settings(draft_max=3, n_seqs=3, fusion=f)), prompts, [ng] * 3, n,
                              hash_logits=True) for f in (False, True)}
    one = Engine(m, Settings(draft_max=3))
    for s, p in enumerate(prompts):
        assert differences(runs[False][s], runs[True][s]) == []
        assert runs[False][s].tokens == generate(one, p, ng, n).tokens
        assert max(x.accepted for x in runs[False][s].steps) == 3
    assert {x.ubatch_seqs for r in runs[False] for x in r.steps} > {1}


# ---- llama.cpp as the referee --------------------------------------------------------------------------------------

LLAMA_REL = 1e-4  # as tests/test_generate.py: llama.cpp's CPU logits and ours within 1e-4 of the largest logit


def test_llama_cpp_runs_the_same_sequences_in_the_same_ubatches(llama, model, plain):
    """llama.cpp's own loop over the three sequences (n_seq_max 3, a KV stream each, n_ubatch 12, n_rs_seq 3, the
    same planted drafters): the same tokens (divergence rule), the same widths and accepted counts with every
    seq_rm accepted, and for the prefill and every step the ubatches its scheduler ran are split_equal's."""
    from gdnpass.frontends.llama import capture
    from gdnpass.kernels.backends import GGML_CPU_BACKEND

    U = 12
    specs = [{"kind": "planted", "truth": r.tokens, "accept": a, "lengths": list(n)}
             for r, (a, n) in zip(plain, SCHEDULES)]
    theirs = capture.generate(str(model.gguf.path), prompts=PROMPTS, drafters=specs, n_predict=N, draft_max=K,
                              n_rs_seq=K, n_ubatch=U, record_ubatches=True, install=llama)
    ours = generate_batch(Engine(model, Settings(draft_max=K, n_seqs=3, n_ubatch=U, backend=GGML_CPU_BACKEND,
                                                 margins=True)), PROMPTS, planted(plain), N, keep_logits=True)
    assert theirs["settings"]["n_seq_max"] == 3 and theirs["settings"]["n_ctx_seq"] == 256
    for o, t in zip(ours, theirs["sequences"]):
        tol = 2 * LLAMA_REL * max(float(r.abs().max()) for r in o.rows)
        d = divergence(o.tokens, o.margins, t["tokens"], t["margins"], tol)
        assert d.ok, str(d)
        assert [(x.n_t, x.accepted) for x in o.steps] == [(x["n_t"], x["accepted"]) for x in t["steps"]]
        assert all(x["seq_rm"] for x in t["steps"])
    for b in [theirs["prefill"], *theirs["batches"]]:
        parts = split_equal([tuple(x) for x in b["batch"]], U, K + 1)
        assert [[p.n_seqs, p.n_seqs * p.n_t] for p in parts] == b["ubatches"], b
    assert [[2, 4], [1, 5], [1, 5]] == theirs["prefill"]["ubatches"]  # prompts[:-1] of 7, 2, 5 tokens
    assert any(u[0] == 3 for b in theirs["batches"] for u in b["ubatches"])  # a step in one ubatch of all three


def test_llama_cpp_cases_on_one_load(llama, model, plain):
    """The worker's timing cases (the peer of benchmarks/seqs_bench.py): contexts on one model load, each loop run
    twice (the memory cleared between: the same tokens), the greedy tokens read on the host (numpy's argmax) and by
    llama.cpp's backend sampling (a greedy chain per sequence on the device) equal to the full reading's, with every
    acceptance; a case llama.cpp refuses gets its one-line error and the others run."""
    from gdnpass.frontends.llama import capture

    specs = [{"kind": "planted", "truth": r.tokens, "accept": a, "lengths": list(n)}
             for r, (a, n) in zip(plain, SCHEDULES)]
    cases = [capture.generate_request(PROMPTS, specs, N, draft_max=K, n_rs_seq=K, n_ubatch=12, n_ctx=768,
                                      sampling=m, runs=2) for m in ("full", "host", "backend", "gpu")]
    full, host, backend, bad = capture.generate_cases(model.gguf.path, cases, install=llama)
    assert bad == {"error": "sampling 'gpu': expected one of full, host, backend"}
    tokens = [q["tokens"] for q in full["sequences"]]
    assert {x["accepted"] for q in full["sequences"] for x in q["steps"]} == set(range(K + 1))
    for rec in (full, host, backend):
        assert [q["tokens"] for q in rec["sequences"]] == tokens
        assert len(rec["runs"]) == 2 and all(r["same_tokens"] and r["n_tokens"] == 3 * N for r in rec["runs"])
    assert host["sequences"][0]["margins"] == [] and backend["settings"]["sampling"] == "backend"


# ---- the CLI, bad input ------------------------------------------------------------------------------------------


def test_cli_several_prompt_ids(tmp_path, capsys, model):
    ids = [",".join(map(str, p)) for p in PROMPTS]
    rc, out, _ = cli_run(capsys, "generate", "--gguf", model.gguf.path, *sum((["--prompt-ids", x] for x in ids), []),
                         "--draft", "planted", "--draft-max", "3", "-n", "8", "--check", "--json", "-q")
    assert rc == 0
    js = json.loads(out)
    assert js["n_sequences"] == 3 and js["check"] == {"identical": True} and js["settings"]["n_seqs"] == 3
    assert [s["prompt"] for s in js["sequences"]] == PROMPTS
    assert all(s["vs_plain"]["identical"] and s["check"]["identical"] for s in js["sequences"])
    assert all(s["n_tokens"] == 8 or s["stop"] == "eog" for s in js["sequences"])  # (the file's tokenizer has EOG)
    assert js["n_tokens"] == sum(s["n_tokens"] for s in js["sequences"])
    assert js["n_accepted"] == sum(s["n_accepted"] for s in js["sequences"])
    # sequence s starts the planted schedule at entry s: different acceptances in one step
    assert len({s["accepted_per_step"][0] for s in js["sequences"]}) == 3
    rc, out, _ = cli_run(capsys, "generate", "--gguf", model.gguf.path, "--prompt-ids", ids[0], "--prompt-ids",
                         ids[1], "--draft", "none", "-n", "4", "-q")
    from gdnpass.tokenizer import Tokenizer

    tok, first = Tokenizer.from_gguf(model.gguf.path), js["sequences"][0]["tokens"][:4]  # (the file's own tokenizer)
    assert rc == 0 and f"[sequence 0] {tok.decode(PROMPTS[0])!r} -> {tok.decode(first)!r}" in out
    assert "[sequence 1] " in out and "tokens of 2 sequences in" in out


def test_cli_prompts_file_is_text_a_line(tmp_path, capsys):
    from gdnpass.models.cycle_model import write_cycle_gguf
    from gdnpass.tokenizer import Tokenizer

    path = write_cycle_gguf("tiny-qwen35", tmp_path / "cycles.gguf", period=5, seed=3)
    f = tmp_path / "prompts.txt"
    f.write_text("The quick brown fox\n\ndef fib(n):\n")
    rc, out, _ = cli_run(capsys, "generate", "--gguf", path, "--prompts-file", f, "--draft", "ngram", "--ngram-n", "2",
                         "--draft-max", "3", "-n", "6", "--json", "-q")
    js, tok = json.loads(out), Tokenizer.from_gguf(path)
    assert rc == 0 and [s["prompt"] for s in js["sequences"]] == [tok.encode("The quick brown fox"),
                                                                  tok.encode("def fib(n):")]
    assert all(s["text"] == tok.decode(s["tokens"]) for s in js["sequences"])


def test_bad_input_is_one_line(tmp_path, capsys, model):
    g = ["generate", "--gguf", model.gguf.path, "-n", "2", "-q"]
    refused(capsys, *g, "--prompt", "hi", "--prompt-ids", "1,2", says=("--prompt-ids", "one way"))
    refused(capsys, *g, "--prompts-file", tmp_path / "missing.txt", says=("--prompts-file", "missing.txt"))
    (tmp_path / "empty.txt").write_text("\n  \n")
    refused(capsys, *g, "--prompts-file", tmp_path / "empty.txt", says=("--prompts-file", "no prompt"))
    refused(capsys, *g, "--prompt-ids", "1,2", "--prompt-ids", "3,999", says=("--prompt-ids", "999", "vocabulary"))
    refused(capsys, *g, "--prompt-ids", "1,2", "--prompt-ids", "3", "--draft", "mtp", says=("--draft mtp",))
    refused(capsys, *g, "--prompt-ids", "1,2", "--prompt-ids", "3", "--ubatch", "600", says=("n_ubatch", "512"))
    eng = Engine(model, Settings(draft_max=1, n_seqs=2))
    for call, says in ((lambda: generate_batch(eng, [[1], [2]], [NoDraft()], 2), "2 prompts and 1 drafters"),
                       (lambda: generate_batch(eng, [[1], [2], [3]], [None] * 3, 2), "3 prompts for a context of 2"),
                       (lambda: generate_batch(eng, [[1], []], [None] * 2, 2), "prompt 1 is empty"),
                       (lambda: eng.decode_batch({2: [1]}), "sequence 2 is not among the context's 2"),
                       (lambda: Settings(n_seqs=0).check(), "n_seqs must be 1..256"),
                       (lambda: Settings(mtp=True, draft_max=0, n_seqs=2).check(), "MTP context decodes one")):
        with pytest.raises(GdnpassError, match=says) as e:
            call()
        assert "\n" not in str(e.value)
