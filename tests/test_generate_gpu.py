"""The lean step on the GPU (skipped without one): inputs staged in one asynchronous copy, the greedy head inside the
CUDA graph, logits to the host only when asked. Each check compares bytes, never timings."""

from __future__ import annotations

import pytest
import torch

from gdnpass.drafters import Planted, cycle_schedule, first_argmax
from gdnpass.engine import Engine, Model, Settings, split_ubatches
from gdnpass.generate import differences, generate, generate_batch
from gdnpass.models.gguf_write import write_gguf

pytestmark = pytest.mark.gpu

PROMPT = [5, 17, 99, 3, 250, 7, 42, 8, 11, 300, 2, 64, 77, 9, 123, 45, 6, 200, 31]  # a prefill of 2 ubatches
N, K = 20, 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return Model.from_gguf(write_gguf("tiny-qwen35", tmp_path_factory.mktemp("gpu") / "m.gguf", wtype="bf16",
                                      seed=2, ab_wtype="f32"))


@pytest.fixture(scope="module")
def truth(model):
    eng = Engine(model, Settings(draft_max=0, n_rs_seq=0, device="cuda", cuda_graphs=True))
    return generate(eng, PROMPT, n_predict=N).tokens


def run(model, truth, **kw):
    s = dict(draft_max=K, device="cuda", margins=True)
    gen_kw = {k: kw.pop(k) for k in ("hash_logits", "keep_logits") if k in kw}
    eng = Engine(model, Settings(**s, **kw))
    return generate(eng, PROMPT, Planted(truth, len(PROMPT), model.shape.vocab_size, cycle_schedule(K)), N,
                    **gen_kw), eng


def test_cuda_graph_replay_equals_eager_run_and_fusion_changes_no_byte(model, truth):
    eager, _ = run(model, truth, cuda_graphs=False, hash_logits=True)
    off, eng = run(model, truth, cuda_graphs=True, hash_logits=True)
    on, _ = run(model, truth, cuda_graphs=True, fusion=True, hash_logits=True)
    assert differences(eager, off) == [] and differences(off, on) == []
    assert {s.accepted for s in off.steps if s.drafted} == set(range(K + 1))
    # the prefill asked for no logits: its graphs have no lm-head columns
    ubatches = split_ubatches(len(PROMPT) - 1, eng.s.ubatch, K + 1)
    assert len(ubatches) == 2 and {(k[0], k[2]) for k in eng.slots if k[2] == 0} == {(b - a, 0) for a, b in ubatches}


def test_lean_steps_decide_what_the_logits_say(model, truth):
    kept, _ = run(model, truth, cuda_graphs=True, keep_logits=True)
    lean, _ = run(model, truth, cuda_graphs=True)
    assert lean.tokens == kept.tokens and lean.margins == kept.margins and not lean.logits
    assert [s.logits_sha256 for s in lean.steps] == [None] * len(lean.steps)  # no hash unless asked
    for tok, m, row in zip(kept.tokens, kept.margins, kept.rows):
        top = torch.topk(row.double(), 2).values
        assert (tok, m) == (first_argmax(row.tolist()), float(top[0] - top[1]))


PROMPTS = [PROMPT[:8], PROMPT[8:11], PROMPT[11:]]


def test_several_sequences_on_the_gpu(model):
    """Three sequences in shared ubatches on the GPU (CUDA graphs, Triton): each generates what it generates alone,
    an eager run and fused replays give the same bytes for every sequence at every step (a step of several
    ubatches queues them all and waits once)."""
    truths = [generate(Engine(model, Settings(draft_max=0, n_rs_seq=0, device="cuda", cuda_graphs=True)), p,
                       n_predict=N).tokens for p in PROMPTS]
    schedule = cycle_schedule(K)

    def run(cuda_graphs: bool, fusion: bool):
        drafters = [Planted(t, len(p), model.shape.vocab_size, schedule[s:] + schedule[:s])  # (different acceptances)
                    for s, (t, p) in enumerate(zip(truths, PROMPTS))]
        eng = Engine(model, Settings(draft_max=K, n_seqs=3, device="cuda", cuda_graphs=cuda_graphs, fusion=fusion))
        return generate_batch(eng, PROMPTS, drafters, N, hash_logits=True)

    eager, off, on = run(False, False), run(True, False), run(True, True)
    for s in range(3):
        assert off[s].tokens == truths[s]
        assert differences(eager[s], off[s]) == [] and differences(off[s], on[s]) == []
    assert any(x.ubatch_seqs > 1 for r in on for x in r.steps)


def test_graphs_wider_than_the_mat_vec_share_one_pool(model):
    """Four sequences drafting K = 4 each: a step is one ubatch of 20 tokens, whose products run torch's matmul (over
    the mat-vec's 16 columns) on temporaries that the capture allocates. All of an engine's graphs are captured into
    one memory pool (a pool per graph would hold such temporaries once per graph: 4 GB for the 9B's lm head over 16
    columns); replays of graphs that share it give the eager run's bytes at every step of every sequence."""
    prompts = [PROMPT[:8], PROMPT[8:12], PROMPT[12:16], PROMPT[16:]]
    plain = generate_batch(Engine(model, Settings(draft_max=0, n_rs_seq=0, n_seqs=4, device="cuda")), prompts,
                           [None] * 4, N)
    schedule = [K]  # every draft accepted: the four sequences verify K + 1 tokens each in one ubatch, every step

    def run(cuda_graphs: bool):
        drafters = [Planted(r.tokens, len(p), model.shape.vocab_size, schedule) for r, p in zip(plain, prompts)]
        eng = Engine(model, Settings(draft_max=K, n_seqs=4, device="cuda", cuda_graphs=cuda_graphs))
        return generate_batch(eng, prompts, drafters, N, hash_logits=True), eng

    (eager, _), (replayed, eng) = run(False), run(True)
    for s in range(4):
        assert replayed[s].tokens == plain[s].tokens and differences(eager[s], replayed[s]) == []
    wide = [k for k, slot in eng.slots.items() if k[0] * k[4] > 16 and k[2] and slot.cuda_graph is not None]
    assert wide and {slot.cuda_graph.pool() for slot in eng.slots.values()} == {eng._pool}


# ---- the MTP drafter on the device (issue 35): a cycle model whose MTP head agrees with the trunk part of the time

MTP_PROMPT = [491, 32, 113, 117, 369, 107, 274, 114, 111, 119, 110, 287, 111, 120, 32, 106, 315, 112, 115]
MTP_N = 24  # (the prompt: "The quick brown fox jumps" in the file's tokenizer, as tests/test_generate_mtp.py has it)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    from gdnpass.models.cycle_model import write_cycle_gguf

    return Model.from_gguf(write_cycle_gguf("tiny-qwen35", tmp_path_factory.mktemp("gpu-mtp") / "cm.gguf", period=5,
                                            wtype="f32", seed=3, mtp=1))


def mtp_run(model, **kw):
    from gdnpass.mtp_drafter import MtpDrafter

    gen_kw = {k: kw.pop(k) for k in ("hash_logits",) if k in kw}
    s = Settings(draft_max=3, device="cuda", margins=True, **kw)
    drafter = MtpDrafter(model, s)
    eng = Engine(model, s)
    return generate(eng, MTP_PROMPT, drafter, MTP_N, **gen_kw), eng, drafter


def test_mtp_loop_eager_cuda_graphs_and_fused_are_identical(mtp_model):
    """The MTP loop on the GPU (hidden-state rows and drafts staying on the device): an eager run, CUDA-graph
    replays and fused replays give the same tokens, accepted counts and logits bytes, and the tokens of plain greedy
    decode on the GPU."""
    from gdnpass.generate import divergence
    from gdnpass.generate_cli import SELF_TOLERANCE

    eager, _, _ = mtp_run(mtp_model, cuda_graphs=False, hash_logits=True)
    off, _, _ = mtp_run(mtp_model, cuda_graphs=True, hash_logits=True)
    on, _, drafter = mtp_run(mtp_model, cuda_graphs=True, fusion=True, hash_logits=True)
    assert differences(eager, off) == [] and differences(off, on) == []
    assert 0 < on.accepted < on.drafted and all(s.report.enabled for s in drafter.head.slots.values())
    plain = generate(Engine(mtp_model, Settings(draft_max=0, n_rs_seq=0, device="cuda", cuda_graphs=True,
                                                margins=True)), MTP_PROMPT, n_predict=MTP_N)
    d = divergence(on.tokens, on.margins, plain.tokens, plain.margins, SELF_TOLERANCE)
    assert d.ok, str(d)


def test_mtp_head_binds_the_target_s_weights_on_the_gpu(mtp_model):
    _, eng, drafter = mtp_run(mtp_model, cuda_graphs=True)
    slots = [*eng.slots.values(), *drafter.head.slots.values()]
    buffer = slots[0].executor.buffers["weights"]
    assert buffer.is_cuda and all(s.executor.buffers["weights"] is buffer for s in slots)
    for name in ("token_embd.weight", "output.weight"):
        ptrs = {s.executor.view(t).data_ptr() for s in slots for t in s.graph.leafs if t.name == name}
        assert len(ptrs) == 1, name


def test_mtp_step_synchronizes_only_in_the_verify_fetch(mtp_model, monkeypatch):
    """torch's sync debug mode set to error during a warm run (every graph captured): no operation of the loop
    synchronizes with the device but the verify's greedy-head fetch (once a step), the draft's host copies read
    after it, and the wait after the prefill; the head is never fetched."""
    from gdnpass.engine import GreedyHead
    from gdnpass.mtp_drafter import DeviceDraft, MtpDrafter

    s = Settings(draft_max=3, device="cuda", cuda_graphs=True)
    eng, drafter = Engine(mtp_model, s), MtpDrafter(mtp_model, s)
    warm = generate(eng, MTP_PROMPT, drafter, MTP_N)  # (every graph built and captured)
    calls = {"fetch": 0, "tolist": 0, "synchronize": 0}

    def allowed(f, name):
        def call(*a, **kw):
            calls[name] += 1
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                return f(*a, **kw)
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        return call

    monkeypatch.setattr(GreedyHead, "fetch", allowed(GreedyHead.fetch, "fetch"))
    monkeypatch.setattr(DeviceDraft, "tolist", allowed(DeviceDraft.tolist, "tolist"))
    monkeypatch.setattr(torch.cuda, "synchronize", allowed(torch.cuda.synchronize, "synchronize"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = generate(eng, MTP_PROMPT, drafter, MTP_N)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert res.tokens == warm.tokens and res.drafted > 0
    assert calls == {"fetch": len(res.steps), "tolist": sum(1 for x in res.steps if x.drafted), "synchronize": 1}
