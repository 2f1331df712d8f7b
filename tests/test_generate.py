"""Issue 19: the speculative loop end to end (gdnpass.generate): draft, verify, accept, roll back.

The seed's identity table, on whole tiny qwen35 models:

- fused vs unfused: identical tokens and accepted counts and byte-identical logits at every step;
- speculative vs plain one-token greedy decode: identical tokens up to the first divergence, where both top-2 logit
  margins must be below the tolerance (SELF_TOLERANCE); the recurrent state the next ubatch reads after each
  accepted prefix equals plain decode's within 1e-5 relative;
- rollback: the loop reads exactly the plane it should (poisoning every other plane and the freed KV cells changes
  no byte of the logits), and reading a stale plane changes the output;
- the CLI: a planted run on a qwen35 file of a shape no other test uses has every acceptance 0..K, identical with
  fusion off and on; the n-gram drafter accepts multi-token runs on a repetitive model;
- llama.cpp (the pinned build) decodes the same file to the same tokens: plain greedy and its own rollback path
  (n_rs_seq > 0, llama_memory_seq_rm), under the divergence rule.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from gdnpass.drafters import (NgramSimple, NoDraft, Planted, accept_greedy, cycle_schedule, draft_budget, first_argmax,
                              ngram_defaults, ngram_simple_draft)
from gdnpass.engine import Engine, GreedyHead, Model, Planes, Settings, StalePlane, n_kv_for, split_ubatches
from gdnpass.errors import GdnpassError
from gdnpass.generate import differences, divergence, generate, greedy_accept, state_difference
from gdnpass.generate_cli import SELF_TOLERANCE
from gdnpass.models.gguf_write import write_gguf
from gdnpass.models.hparams import PRESETS

PROMPT = [5, 17, 99, 3, 250, 7, 42, 8]
N = 20
K = 4
STATE_TOLERANCE = 1e-5  # max |spec - plain| / max |plain| of the recurrent states (measured: ~1e-7)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return Model.from_gguf(write_gguf("tiny-qwen35", tmp_path_factory.mktemp("gen") / "m.gguf", wtype="f32", seed=1))


@pytest.fixture(scope="module")
def plain(model):
    return generate(Engine(model, Settings(draft_max=0, n_rs_seq=0, margins=True)), PROMPT, NoDraft(), N,
                    keep_logits=True, record_states=True)


@pytest.fixture(scope="module")
def spec(model, plain):
    """The planted run, fusion off and on, with every plane but the read one poisoned at every ubatch."""
    out = {}
    for fusion in (False, True):
        eng = Engine(model, Settings(draft_max=K, fusion=fusion, poison=True, margins=True))
        out[fusion] = generate(eng, PROMPT, Planted(plain.tokens, len(PROMPT), 512, cycle_schedule(K)), N,
                               keep_logits=True, record_states=True)
    return out


# ---- the pieces ------------------------------------------------------------------------------------------------------


def test_ubatch_split_is_llama_cpp_s():
    assert split_ubatches(20, 8) == [(0, 8), (8, 16), (16, 20)]
    # n_keep_tail 4: never leave 1..3 tokens for a later ubatch; take them when they fit, else leave exactly 4
    assert split_ubatches(10, 8, 4) == [(0, 6), (6, 10)]
    assert split_ubatches(18, 8, 4) == [(0, 8), (8, 14), (14, 18)]
    assert split_ubatches(7, 8, 4) == [(0, 7)]
    assert split_ubatches(0, 8, 4) == []
    with pytest.raises(Exception, match="n_ubatch 4 must be greater than"):
        split_ubatches(9, 4, 4)
    assert n_kv_for(3, 1024) == 256 and n_kv_for(257, 1024) == 512 and n_kv_for(900, 768) == 768


def test_ngram_simple_draft_is_llama_cpp_s():
    cyc = [1, 2, 3, 4, 5] * 4  # period 5: the newest match of the last 2 tokens is 5 back, 4 tokens follow it
    assert ngram_simple_draft(2, 3, cyc[:-1], cyc[-1]) == [1, 2, 3]
    assert ngram_simple_draft(2, 8, cyc[:-1], cyc[-1]) == [1, 2, 3, 4]  # what follows the match, up to m
    assert ngram_simple_draft(2, 17, cyc[:-1], cyc[-1]) == []         # needs more than n + m + 1 tokens
    assert ngram_simple_draft(4, 4, cyc[:-1], cyc[-1]) == [1, 2, 3, 4]
    assert ngram_simple_draft(5, 5, cyc[:-1], cyc[-1]) == []          # copy = period - 1 < n
    # a constant run: the newest match is 1 back, too close to copy n tokens; llama.cpp does not try older ones
    assert ngram_simple_draft(2, 2, [7] * 12, 7) == []
    assert ngram_simple_draft(3, 3, [9, 1, 2, 3, 4, 5, 6, 1, 2], 3) == [4, 5, 6]
    assert ngram_simple_draft(3, 3, [1, 2, 3, 4, 5, 6, 1], 2) == []  # 7 tokens: not more than n + m + 1
    assert ngram_simple_draft(2, 3, [9, 1, 2, 3, 4, 5, 6, 8, 0, 1], 2) == [3, 4, 5]
    assert NgramSimple(2, 3).draft([9, 1, 2, 3, 4, 5, 6, 8, 0, 1], 2, 2) == [3, 4]  # capped by the loop's n_max
    # position 0 is never a match (it means "none" in the C++)
    assert ngram_simple_draft(2, 3, [1, 2, 7, 7, 7, 7, 7, 1], 2) == []


def test_draft_budget_hand_worked():
    # K = 4, n_ctx 256, 20 tokens wanted
    assert draft_budget(4, 256, 10, 20, 0) == 4     # far from both ends: K
    assert draft_budget(4, 256, 10, 20, 17) == 2    # 3 tokens left: 2 drafts + the bonus token
    assert draft_budget(4, 256, 10, 20, 19) == 0    # the last token: a one-token decode
    # near the end of the context: id_last + 3 drafts in cells 251..254, the bonus token's cell 255
    assert draft_budget(4, 256, 251, 100, 0) == 3
    assert draft_budget(4, 256, 254, 100, 0) == 0   # one cell for id_last, one for the bonus: no draft
    assert draft_budget(4, 256, 255, 100, 0) == 0   # never negative
    assert draft_budget(0, 256, 10, 20, 0) == 0     # K = 0: plain decode


def test_greedy_accept_hand_worked():
    draft = [5, 6, 7]
    assert accept_greedy(draft, [5, 6, 7, 9].__getitem__) == [5, 6, 7, 9]  # all 3 accepted, the bonus from row 3
    assert accept_greedy(draft, [5, 0, 7, 9].__getitem__) == [5, 0]        # row 1 disagrees: 1 accepted, then 0
    assert accept_greedy(draft, [1, 6, 7, 9].__getitem__) == [1]           # none accepted
    assert accept_greedy([], [4].__getitem__) == [4]                       # no draft: a one-token decode
    rows_read = []
    accept_greedy(draft, lambda i: rows_read.append(i) or [5, 6, 0, 0][i])
    assert rows_read == [0, 1, 2]  # rows 0 .. accepted, in order, once each: the rows after a mismatch are not read
    # ties: the first of equal maxima, in plain Python as torch.argmax picks it
    row = [1.0, 3.0, 3.0, 2.0]
    assert first_argmax(row) == int(torch.argmax(torch.tensor(row))) == 1
    logits = torch.tensor([[0.0, 2.0, 2.0], [1.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    assert greedy_accept(logits, [1, 0]) == accept_greedy([1, 0], lambda i: first_argmax(logits[i].tolist())) \
        == [1, 0, 2]


def test_greedy_head_picks_the_first_maximum_and_its_margin(device):
    inf = float("inf")
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0], [5.0, 1.0, 1.0, 1.0], [-inf, 3.5, -inf, 3.25]], device=device)
    head = GreedyHead(logits, margins=True)
    head.compute()
    assert head.fetch() == ([1, 0, 1], [0.0, 4.0, 0.25], [])
    head = GreedyHead(logits, margins=False)
    head.compute()
    assert head.fetch() == ([1, 0, 1], None, [])
    logits[1, 2], logits[2, 0] = float("nan"), inf
    head.compute()
    assert head.fetch()[2] == [1, 2]  # NaN or +inf in a row: reported, never a token


def test_nonfinite_logits_are_an_error_naming_the_step(model):
    eng = Engine(model, Settings(draft_max=0, n_rs_seq=0))
    slot = eng.slot(1, n_kv_for(1, eng.kv_size))
    norm = slot.executor.view(next(t for t in slot.graph.leafs if t.name == "output_norm.weight"))
    keep = norm.clone()
    norm.fill_(float("nan"))
    try:
        with pytest.raises(GdnpassError, match=r"^step 0 \(n_past 0\): the logits of row 0 are not finite"):
            generate(eng, PROMPT[:1], NoDraft(), 2)
    finally:
        norm.copy_(keep)  # (the model's weights: every context of the model shares them)


def test_ngram_defaults_keep_size_n_at_most_size_m():
    assert ngram_defaults(4) == (4, 4)
    assert ngram_defaults(15) == (12, 15)  # llama.cpp's default n of 12
    assert ngram_defaults(0) == (1, 1)     # sizes must be >= 1
    NgramSimple(*ngram_defaults(0))


def test_planes_track_what_each_plane_holds():
    p = Planes(4)
    p.require(0, 0)
    p.advance(0, 5)  # a 5-token ubatch: every plane written
    assert p.conv == [5, 4, 3, 2, 1] and p.ssm == [5, 4, 3, 2, 1]
    p.advance(4, 2)  # 2 tokens from state 4: conv planes >= 2 hold the clamped pre-state, ssm planes >= 2 stale
    assert p.conv == [6, 5, 4, 4, 4] and p.ssm == [6, 5, None, None, None]
    p.require(1, 5)
    with pytest.raises(StalePlane, match="plane 2, which holds conv state after 4 tokens and ssm state stale"):
        p.require(2, 4)
    p.advance(6, 1)  # a one-token decode: ssm planes >= 1 stale
    assert p.ssm == [7, None, None, None, None]


# ---- the identity table ------------------------------------------------------------------------------------------


def test_planted_run_has_every_acceptance_and_fusion_changes_no_byte(spec):
    off, on = spec[False], spec[True]
    assert len(off.tokens) == N
    assert set(s.accepted for s in off.steps if s.drafted) == set(range(K + 1))
    assert differences(off, on) == []
    assert [s.accepted for s in off.steps] == [s.accepted for s in on.steps]
    assert all(x.numpy().tobytes() == y.numpy().tobytes() for x, y in zip(off.logits, on.logits))
    assert all(torch.isfinite(x).all() for x in off.logits)  # the poisoned planes were never read


def test_speculative_equals_plain_greedy_decode(plain, spec):
    for r in spec.values():
        d = divergence(r.tokens, r.margins, plain.tokens, plain.margins, SELF_TOLERANCE)
        assert d.ok, str(d)
        assert d.index is None  # (this model has no near tie in these 20 tokens: min margin 1.3e-3)
        # the planted schedule was realised: the loop accepted what the drafter planned
        planted = Planted(plain.tokens, len(PROMPT), 512, cycle_schedule(K))
        generated = [sum(s.accepted + 1 for s in r.steps[:i]) for i in range(len(r.steps))]
        budgets = [draft_budget(K, Settings().kv_size, len(PROMPT) - 1 + n, N, n) for n in generated]
        assert [s.accepted for s in r.steps] == [planted.planned(i, b)[1] for i, b in enumerate(budgets)]
        # the state each rollback leaves for the next ubatch is plain decode's at that position
        assert set(r.states) <= set(plain.states) and len(r.states) == len(r.steps) + 1
        for n_past, st in r.states.items():
            assert state_difference(st, plain.states[n_past]) < STATE_TOLERANCE, n_past
        rows = max(float((a - b).abs().max()) for a, b in zip(r.rows, plain.rows))
        assert rows < SELF_TOLERANCE / 2


def test_the_device_side_head_reads_what_the_logits_say(plain, spec):
    """Each generated token is its row's first argmax and its margin the float64 top-1 minus top-2 of that row,
    as computed on the host from the kept logits bytes: the greedy head changes no decision and no margin."""
    for r in (plain, *spec.values()):
        assert len(r.rows) == len(r.tokens) == len(r.margins) == N
        for tok, m, row in zip(r.tokens, r.margins, r.rows):
            top = torch.topk(row.double(), 2).values
            assert (tok, m) == (first_argmax(row.tolist()), float(top[0] - top[1]))


def test_prefill_asks_for_no_logits_and_leaves_the_same_state(model):
    """The prefill's ubatches run graphs without lm-head columns (llama.cpp's prefill asks for no logits); the
    recurrent state and KV cache they leave are byte for byte those of ubatches with every row's logits."""
    prompt = [(7 * i + 3) % 512 for i in range(11)]
    eng = Engine(model, Settings(draft_max=K, n_ubatch=6))
    assert eng.prefill(prompt) == 2 and {(s.n_t, s.n_out) for s in eng.slots.values()} == {(6, 0), (5, 0)}
    without = {k: v.clone() for k, v in eng.caches().items()}
    eng.reset()
    for a, b in ((0, 6), (6, 11)):
        assert eng.verify(prompt[a:b]) is not None
    for name, v in eng.caches().items():
        assert without[name].numpy().tobytes() == v.numpy().tobytes(), name


def test_poisoning_unread_planes_and_freed_cells_changes_no_byte(model, plain, spec):
    """Without poison, the same run gives the same logits bytes: every ubatch read exactly its plane, and the freed
    KV cells (garbage under poison) were masked out."""
    eng = Engine(model, Settings(draft_max=K, poison=False))
    clean = generate(eng, PROMPT, Planted(plain.tokens, len(PROMPT), 512, cycle_schedule(K)), N, keep_logits=True)
    assert differences(clean, spec[False]) == []


def test_reading_a_stale_plane_changes_the_output(model):
    """A 2-token verify with K = 4 planes leaves ssm planes 2..4 stale. After accepting 0 drafts the next ubatch must
    read plane 1; the loop's check refuses plane 3, and reading it anyway changes the logits (and the recurrent
    state), as reading a valid but wrong plane (0) does."""
    eng = Engine(model, Settings(draft_max=K))

    def run(plane: int | None, check: bool = True):
        eng.reset()
        eng.prefill(PROMPT[:-1])
        eng.decode([PROMPT[-1], 300])  # id_last and one draft
        assert eng.seq_rm(len(PROMPT))  # accept 0 drafts: roll back one token
        assert eng.rs_idx == 1
        if plane is not None:
            eng.mem[0].rs_idx = plane
        return eng.decode([123], check=check)

    good = run(None)
    with pytest.raises(StalePlane, match="plane 3"):
        run(3)
    stale = run(3, check=False)
    wrong = run(0, check=False)
    assert float((stale - good).abs().max()) > 1e-2 and float((wrong - good).abs().max()) > 1e-2
    again = run(None)
    assert again.numpy().tobytes() == good.numpy().tobytes()


# ---- the CLI -------------------------------------------------------------------------------------------------------


def _cli(capsys, *args) -> tuple[int, dict]:
    from gdnpass.cli import main

    rc = main(["generate", *args, "--json", "-q"])
    return rc, json.loads(capsys.readouterr().out)


def test_cli_planted_on_an_unseen_shape(tmp_path, capsys):
    """A qwen35 file of a shape no other test uses (6 layers, attention every third, GDN heads of 48, bf16): every
    acceptance 0..K present in --json, fusion off and on identical (--check), the same tokens as plain decode."""
    shape = dataclasses.replace(PRESETS["tiny-qwen35"], name="gen-unseen", n_embd=192, n_layer=6, n_k_heads=2,
                                n_v_heads=6, head_dim=48, n_ff=320, full_attention_interval=3, head_count=6,
                                head_count_kv=2, key_length=32, value_length=32, rope_dimension_count=8,
                                rope_dimension_sections=(2, 1, 1, 0), vocab_size=384)
    path = write_gguf(shape, tmp_path / "unseen.gguf", wtype="bf16", seed=7)
    rc, out = _cli(capsys, "--gguf", str(path), "--draft", "planted", "--draft-max", "3", "-n", "16", "--check",
                   "--prompt-ids", "3,1,4,1,5,9,2,6")
    assert rc == 0
    assert out["n_tokens"] == 16 and out["check"] == {"identical": True, "differences": []}
    assert all(out["acceptance_histogram"][str(a)] > 0 for a in range(4))
    assert out["vs_plain"]["identical"] and all(g["bound_to_reserve"] for g in out["graphs"])


def test_cli_ngram_accepts_multi_token_runs(tmp_path, capsys):
    from gdnpass.models.cycle_model import write_cycle_gguf

    path = write_cycle_gguf("tiny-qwen35-b", tmp_path / "cycles.gguf", period=5, seed=2)
    rc, out = _cli(capsys, "--gguf", str(path), "--draft", "ngram", "--ngram-n", "2", "--draft-max", "3", "-n", "20",
                   "--check", "--prompt-ids", "12,40,7,3,9")
    assert rc == 0 and out["check"]["identical"]
    assert out["tokens"][:6] == [5, 6, 7, 8, 9, 5]
    assert max(out["accepted_per_step"]) == 3 and out["n_accepted"] >= 9


def test_cli_text_in_text_out(tmp_path, capsys):
    """--prompt TEXT: tokenized with the file's own tokenizer, the continuation streamed as text, a closing stats
    line as llama.cpp's; a file or preset without a tokenizer refuses text in one line."""
    from gdnpass.cli import main
    from gdnpass.models.cycle_model import write_cycle_gguf
    from gdnpass.tokenizer import Tokenizer

    path = write_cycle_gguf("tiny-qwen35", tmp_path / "cycles.gguf", period=5, seed=3)
    text = "The quick brown fox jumps"
    assert main(["generate", "--gguf", str(path), "--prompt", text, "--draft", "ngram", "--ngram-n", "2",
                 "--draft-max", "3", "-n", "16"]) == 0
    out = capsys.readouterr().out
    tok = Tokenizer.from_gguf(path)
    rc, js = _cli(capsys, "--gguf", str(path), "--prompt", text, "--draft", "ngram", "--ngram-n", "2",
                  "--draft-max", "3", "-n", "16")
    assert rc == 0 and js["prompt"] == tok.encode(text) and js["text"] == tok.decode(js["tokens"])
    assert out.startswith(text + js["text"] + "\n\n")
    assert "decoded 16 tokens in" in out and f"n_accept {js['n_accepted']}" in out
    for args in (["--model", "tiny-qwen35", "--prompt", "hi"],
                 ["--gguf", str(write_gguf("tiny-qwen35", tmp_path / "ids.gguf", tokenizer="none")), "--prompt", "hi"]):
        assert main(["generate", *args, "-n", "2", "-q"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("--prompt" in err or "tokenizer" in err), err
    # a preset's flags beside a model file do nothing: refused, naming the flag
    assert main(["generate", "--gguf", str(path), "--wtype", "f32", "-n", "2", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--wtype does nothing with --gguf" in err


def test_one_token_prompt_records_states(model):
    """A one-token prompt prefills nothing: the states before the first verify come from the caches themselves."""
    res = generate(Engine(model, Settings(draft_max=0, n_rs_seq=0)), PROMPT[:1], NoDraft(), 2, record_states=True)
    assert len(res.tokens) == 2 and len(res.states) >= 1


def test_cli_errors_are_one_line(capsys):
    from gdnpass.cli import main

    assert main(["generate", "--prompt-ids", "1,2,999999", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "outside the vocabulary" in err
    assert main(["generate", "--draft-max", "15", "--ubatch", "16", "-q"]) == 2
    assert "must be greater than n_rs_seq + 1" in capsys.readouterr().err
    assert main(["generate", "--draft", "ngram", "--ngram-n", "0", "-n", "2", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ngram sizes must be >= 1" in err


@pytest.mark.parametrize("value", ["3", "x", "0"])
def test_cli_bad_alignment_is_gdnpass_run_s_one_line_error(capsys, value):
    """argparse's usage, then one error line, no traceback: the same line as ``gdnpass run`` gives."""
    from gdnpass.cli import main

    errors = {}
    for command in ("run", "generate"):
        with pytest.raises(SystemExit) as e:
            main([command, f"--alignment={value}", "-q"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        lines = [line for line in err.splitlines() if "error:" in line]
        assert len(lines) == 1 and lines[0] == err.splitlines()[-1]
        errors[command] = lines[0].replace(f"gdnpass {command}: ", "")
    assert errors["generate"] == errors["run"] and "--alignment" in errors["run"] and value in errors["run"]


# ---- llama.cpp as the referee --------------------------------------------------------------------------------------

# llama.cpp's CPU logits and ours (GGML_CPU_BACKEND, f32 file) differ by at most 1e-4 of the largest logit
# (docs/whole-model.md); a divergence then needs both top-2 margins below twice that
LLAMA_REL = 1e-4


def test_llama_cpp_generates_the_same_tokens(llama, model, capsys):
    from gdnpass.frontends.llama import capture
    from gdnpass.kernels.backends import GGML_CPU_BACKEND

    path = str(model.gguf.path)
    kw = dict(prompt=PROMPT, n_predict=N, n_ubatch=8, install=llama)
    lp = capture.generate(path, **kw)
    ls = capture.generate(path, n_rs_seq=3, draft_max=3, **kw,
                          drafter={"kind": "planted", "truth": lp["tokens"], "accept": cycle_schedule(3),
                                   "lengths": [3, 3, 1, 0, 2]})
    assert ls["settings"]["n_rs_seq"] == 3 and all(s["seq_rm"] for s in ls["steps"])
    ours_p = generate(Engine(model, Settings(draft_max=0, n_rs_seq=0, n_ubatch=8, backend=GGML_CPU_BACKEND,
                                                  margins=True)),
                      PROMPT, NoDraft(), N, keep_logits=True)
    planted = Planted(ours_p.tokens, len(PROMPT), 512, cycle_schedule(3), [3, 3, 1, 0, 2])
    ours_s = generate(Engine(model, Settings(draft_max=3, n_ubatch=8, backend=GGML_CPU_BACKEND, margins=True)), PROMPT, planted, N)
    tol = 2 * LLAMA_REL * max(float(r.abs().max()) for r in ours_p.rows)
    for ours, theirs in ((ours_p, lp), (ours_s, ls)):
        d = divergence(ours.tokens, ours.margins, theirs["tokens"], theirs["margins"], tol)
        assert d.ok, str(d)
    assert ls["tokens"] == lp["tokens"]  # llama.cpp's rollback path = its plain decode
    # the same steps: widths and accepted counts, llama.cpp's rollback and ours
    assert [(s["n_t"], s["accepted"]) for s in ls["steps"]] == [(s.n_t, s.accepted) for s in ours_s.steps]
    assert {s["accepted"] for s in ls["steps"] if s["drafted"]} == {0, 1, 2, 3}


def test_llama_cpp_speculative_simple_writes_the_same_text(llama, tmp_path):
    """llama.cpp's own loop as a user runs it (llama-speculative-simple: it tokenizes the text with the file's
    tokenizer, drafts with its ngram-simple drafter and, with no rollback planes for an n-gram draft, rolls back by
    checkpoints) and gdnpass's loop on one cycle model: the same prompt tokens, the same text."""
    from gdnpass.frontends.llama import speculative
    from gdnpass.models.cycle_model import write_cycle_gguf
    from gdnpass.tokenizer import Tokenizer

    path = write_cycle_gguf("tiny-qwen35", tmp_path / "cycles.gguf", period=5, wtype="f32", seed=3)
    text, n = "The quick brown fox jumps", 24
    tok = Tokenizer.from_gguf(path)
    prompt = tok.encode(text)
    peer = speculative.run(llama, path, text, n, size_n=2, size_m=3, n_gpu_layers=0, threads=2)
    ours = generate(Engine(Model.from_gguf(path), Settings(draft_max=3)), prompt, NgramSimple(2, 3), n, eog=tok.eog)
    assert peer.n_prompt == len(prompt)
    assert len(ours.tokens) == n and peer.n_predict >= n  # (it stops only once past -n)
    assert peer.generated(text).startswith(tok.decode_bytes(ours.tokens))
    assert max(s.accepted for s in ours.steps) == 3 and peer.n_accept > 0  # the drafts were accepted on both sides
