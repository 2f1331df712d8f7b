"""Issue 35 item 3: ``generate --draft mtp``, the model's MTP head drafting for the speculative loop
(gdnpass.mtp_drafter), on a cycle model whose MTP head agrees with the trunk part of the time
(``cycle_model --mtp 1``):

- fused vs unfused: identical tokens, accepted counts and logits bytes;
- rollback: poisoning every target plane but the read one and every freed KV cell, the target's and the head's, changes
  no byte; the tokens are plain greedy decode's and the state each rollback leaves equals plain decode's; the head's
  cache ends where the target's does; random K and prompts (hypothesis);
- the accepted counts depend on what the head is paired with (a head fed zeros instead of pending_h drafts
  otherwise), so equal counts are evidence;
- llama.cpp's own MTP loop (``llama-speculative-simple --spec-type draft-mtp``) on the same file: the same prompt
  tokens, the same text, step for step the same accepted / drafted counts and last tokens wherever both loops had a
  draft budget, for K = 1, 2, 3;
- the CLI: --check, and one-line refusals of a file or preset without an MTP block, or with a stripped one.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gdnpass.drafters import NoDraft, draft_budget
from gdnpass.engine import Engine, Model, Settings
from gdnpass.generate import differences, divergence, generate, state_difference
from gdnpass.generate_cli import SELF_TOLERANCE
from gdnpass.models.cycle_model import write_cycle_gguf
from gdnpass.mtp_drafter import MtpDrafter
from support.cli import cli_run, refused
from support.gguf_edit import rewrite_gguf

TEXT, N = "The quick brown fox jumps", 24


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_cycle_gguf("tiny-qwen35", tmp_path_factory.mktemp("mtp") / "cycles-mtp.gguf", period=5, wtype="f32",
                            seed=3, mtp=1)


@pytest.fixture(scope="module")
def model(path):
    return Model.from_gguf(path)


@pytest.fixture(scope="module")
def prompt(path):
    from gdnpass.tokenizer import Tokenizer

    return Tokenizer.from_gguf(path).encode(TEXT)


def run(model, prompt, k=3, n=N, **kw):
    s = Settings(draft_max=k, **kw)
    drafter = MtpDrafter(model, s)
    return generate(Engine(model, s), prompt, drafter, n, hash_logits=True, record_states=True), drafter


@pytest.fixture(scope="module")
def plain(model, prompt):
    return generate(Engine(model, Settings(draft_max=0, n_rs_seq=0, margins=True)), prompt, NoDraft(), N,
                    record_states=True)


def test_fused_and_unfused_are_identical(model, prompt):
    off, _ = run(model, prompt, fusion=False)
    on, drafter = run(model, prompt, fusion=True)
    assert differences(off, on) == []
    assert drafter.head.slots and all(s.report.enabled for s in drafter.head.slots.values())  # the head fused too
    accepted = {s.accepted for s in on.steps if s.drafted}
    assert 0 < on.accepted < on.drafted and {0, 3} <= accepted  # drafts accepted and rejected


def test_rollback_reads_only_what_it_should(model, prompt, plain):
    """Poison (NaN in every target plane but the one read, garbage in every freed KV cell of the target and of the
    head) changes no byte; the tokens and the rolled-back states are plain decode's."""
    clean, _ = run(model, prompt)
    poisoned, drafter = run(model, prompt, poison=True, margins=True)
    assert differences(clean, poisoned) == []
    d = divergence(poisoned.tokens, poisoned.margins, plain.tokens, plain.margins, SELF_TOLERANCE)
    assert d.index is None, str(d)
    for n_past, state in poisoned.states.items():
        assert state_difference(state, plain.states[n_past]) < 1e-5, n_past
    assert drafter.head.n_past == len(prompt) + len(poisoned.tokens) - 1  # the head's cache ends with the target's


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                HealthCheck.function_scoped_fixture])
@given(k=st.integers(1, 8), data=st.data())
def test_random_k_and_prompts(model, k, data):
    """Any K and prompt: no stale plane read (StalePlane), the tokens of plain greedy decode, every step drafting its
    whole budget (the head has no p_min)."""
    prompt = data.draw(st.lists(st.integers(0, 511), min_size=1, max_size=12))
    n = data.draw(st.integers(1, 16))
    res, _ = run(model, prompt, k=k, n=n, poison=True, margins=True)
    ref = generate(Engine(model, Settings(draft_max=0, n_rs_seq=0, margins=True)), prompt, NoDraft(), n)
    d = divergence(res.tokens, res.margins, ref.tokens, ref.margins, SELF_TOLERANCE)
    assert d.ok, str(d)
    done = 0
    for s in res.steps:
        assert s.drafted == draft_budget(k, 256, len(prompt) - 1 + done, n, done)
        done += s.accepted + 1


def test_the_head_shares_the_model_s_weights(model, prompt):
    """llama.cpp's MTP context reads the model's own tensors: the head's context binds the model's one weights
    buffer, which the target's contexts (fusion off and on) bind too, so token_embd and output are held once; it
    allocates no weights of its own. The model's buffer holds the head's block besides the trunk's weights."""
    from gdnpass.pipeline import PassOptions, run as plan_alone

    off, on = Settings(draft_max=3), Settings(draft_max=3, fusion=True)
    drafter = MtpDrafter(model, off)
    generate(Engine(model, on), prompt, MtpDrafter(model, on), 4)
    target = Engine(model, off)
    generate(target, prompt, drafter, 4)
    slots = [*target.slots.values(), *drafter.head.slots.values()]
    buffer = slots[0].executor.buffers["weights"]
    assert all(s.executor.buffers["weights"] is buffer for s in slots) and target.weights is drafter.head.weights

    def storage(slot):
        return {t.name: (slot.executor.view(t).data_ptr(), t.nbytes) for t in slot.graph.leafs
                if t.buffer == "weights"}

    trunk, head = storage(slots[0]), storage(slots[-1])
    shared = trunk.keys() & head.keys()
    assert {"token_embd.weight", "output.weight"} <= shared
    assert {n: trunk[n] for n in shared} == {n: head[n] for n in shared}  # the same bytes, not equal copies
    # the memory: the head's graph planned alone packs its own weights; now the buffer grows by its block only
    alone = {mtp: plan_alone(model.build(model.config(mtp=mtp, n_tokens=1)), PassOptions(fusion=False)).graph
             for mtp in (False, True)}
    before, block = alone[True].buffers["weights"], buffer.numel() - alone[False].buffers["weights"]
    assert buffer.numel() == target.weights.size and 0 < block < before
    assert before - block == sum(-(-trunk[n][1] // 128) * 128 for n in shared)


def test_a_step_has_one_host_round_trip(model, prompt, monkeypatch):
    """The n-gram step's one wait per step: the head's draft steps and process ubatches are queued, each draft step's
    token the step before's argmax and every hidden-state row (the target's, pending_h, the head's own) copied where
    they are; the verify's greedy head is the only thing fetched (the draft's ids come over with it), and neither
    h_nextn rows nor logits are read back."""
    from collections import Counter

    from gdnpass.engine import GreedyHead
    from gdnpass.runtime import Executor

    calls: Counter = Counter()
    for cls, name in ((GreedyHead, "fetch"), (Executor, "read"), (Engine, "_wait")):
        def counted(*a, _f=getattr(cls, name), _n=f"{cls.__name__}.{name}", **kw):
            calls[_n] += 1
            return _f(*a, **kw)
        monkeypatch.setattr(cls, name, counted)
    s = Settings(draft_max=3)
    drafter = MtpDrafter(model, s)
    res = generate(Engine(model, s), prompt, drafter, N)
    assert calls == Counter({"GreedyHead.fetch": len(res.steps)})
    assert res.drafted > res.accepted > 0 and drafter.head.ubatches > res.drafted  # (draft steps and process)


def test_nothing_is_kept_in_a_context_s_arena_across_its_ubatches(model, prompt, monkeypatch):
    """What a draft step hands the next (its token, its h_nextn row) and the target's rows the head pairs with are
    copied out before the context runs another ubatch: NaN in every arena before every ubatch of the target and of
    the head (as a CUDA graph's capture warm-up run overwrites it) changes no byte."""
    clean, _ = run(model, prompt)
    ubatch = Engine._ubatch

    def clobbered(self, *a, **kw):
        if "arena" in self.shared:
            self.shared["arena"].fill_(0xFF)
        return ubatch(self, *a, **kw)

    monkeypatch.setattr(Engine, "_ubatch", clobbered)
    poisoned, _ = run(model, prompt)
    assert differences(clean, poisoned) == [] and clean.accepted > 0


def test_the_accepted_counts_depend_on_the_pairing(model, prompt):
    """A head paired with zeros instead of pending_h drafts differently: equal counts are evidence of the pairing."""

    class ZeroPending(MtpDrafter):
        def draft(self, history, id_last, n_max):
            self.pending.zero_()
            return super().draft(history, id_last, n_max)

    s = Settings(draft_max=3)
    wrong = generate(Engine(model, s), prompt, ZeroPending(model, s), N)
    right, _ = run(model, prompt)
    assert [(x.drafted, x.accepted) for x in wrong.steps] != [(x.drafted, x.accepted) for x in right.steps]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_llama_cpp_mtp_loop_drafts_and_accepts_the_same(llama, path, model, prompt, k):
    """llama-speculative-simple --spec-type draft-mtp on the same file. Where gdnpass's step had a draft budget
    (all but a last one-token decode), the tool's step is the same: accepted and drafted counts and its last token.
    After, the tool runs its budget-0 steps (a budget of 0 does not truncate its K drafts; it stops only past -n):
    K drafts each. The text is the same on gdnpass's N tokens."""
    from gdnpass.frontends.llama import speculative
    from gdnpass.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(path)
    peer = speculative.run(llama, path, TEXT, N, draft_mtp=k, verbose=True, n_gpu_layers=0, threads=2)
    ours, _ = run(model, prompt, k=k)
    assert peer.n_prompt == len(prompt) and len(ours.tokens) == N
    assert peer.generated(TEXT).startswith(tok.decode_bytes(ours.tokens))
    budgeted = [s for s in ours.steps if s.drafted]  # (the MTP drafter drafts its whole budget)
    assert len(budgeted) >= len(ours.steps) - 1
    last, done = [], 0
    for s in ours.steps:
        done += s.accepted + 1
        last.append(ours.tokens[done - 1])
    assert peer.steps[:len(budgeted)] == [(s.accepted, s.drafted, t) for s, t in zip(budgeted, last)]
    assert all(d == k for _, d, _ in peer.steps[len(budgeted):])
    assert (peer.n_drafted, peer.n_accept) == (sum(d for _, d, _ in peer.steps), sum(a for a, _, _ in peer.steps))
    assert 0 < ours.accepted < ours.drafted


def test_cli_check_and_refusals(capsys, path, tmp_path):
    import json

    from gdnpass.models.gguf_write import write_gguf

    rc, out, _ = cli_run(capsys, "generate", "--gguf", path, "--prompt", TEXT, "--draft", "mtp", "--draft-max", "3",
                         "-n", "12", "--check", "--json", "-q")
    summary = json.loads(out)
    assert rc == 0 and summary["check"]["identical"] and summary["mtp_graphs"] and summary["n_accepted"] > 0
    plain = write_gguf("tiny-qwen35", tmp_path / "plain.gguf", tokenizer="none")
    refused(capsys, "generate", "--gguf", plain, "--draft", "mtp", says=(str(plain), "no MTP block",
                                                                         "nextn_predict_layers"))
    refused(capsys, "generate", "--draft", "mtp", says=("preset 'tiny-qwen35'", "no MTP block"))
    stripped = rewrite_gguf(path, tmp_path / "stripped.gguf", keep=lambda n: not n.startswith("blk.4."))
    refused(capsys, "generate", "--gguf", stripped, "--draft", "mtp", "-n", "2",
            says=(str(stripped), "blk.4.", "absent from the file"))

