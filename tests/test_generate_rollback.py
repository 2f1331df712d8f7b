"""Rollback properties of the speculative loop (issue 19), with hypothesis.

Random schedules drive the real loop (:func:`gdnpass.generate.generate`) on a small whole model with generated
weights: K up to 15 rollback planes, a planted drafter whose drafts have random lengths (shorter than K, so
n_t < 1 + n_rs_seq and planes >= n_t hold the clamped pre-state / stale ssm states; length 0: a one-token decode,
after which ssm planes >= 1 are stale) and random acceptances (every r = n_t - 1 - accepted is read at some step).
Every ubatch poisons all planes but the one it reads (NaN) and the freed KV cells, and checks with
:class:`~gdnpass.engine.Planes` that the plane it reads holds the current history's state. Properties:

- the loop never reads a stale plane (no StalePlane, no NaN anywhere);
- the tokens are plain greedy decode's (under the divergence rule) and the schedule was realised step for step;
- the state each rollback leaves for the next ubatch equals plain decode's at that position within 1e-5.

(tests/test_generate.py shows that reading a stale plane does change the output.)
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from gdnpass.drafters import NoDraft, Planted, draft_budget
from gdnpass.engine import Engine, Model, Settings
from gdnpass.generate import divergence, generate, state_difference
from gdnpass.generate_cli import SELF_TOLERANCE
from gdnpass.models.hparams import PRESETS

# a small whole model (3 GDN layers, 1 attention layer), f32 generated weights: a step costs a few ms
MINI = dataclasses.replace(PRESETS["tiny-qwen35"], name="rollback-mini", n_embd=64, n_k_heads=1, n_v_heads=2,
                           head_dim=16, n_ff=96, head_count=2, head_count_kv=1, key_length=16, value_length=16,
                           rope_dimension_count=8, rope_dimension_sections=(2, 1, 1, 0), vocab_size=97)
MODEL = Model.preset(MINI, wtype="f32", seed=3)
PROMPT = [11, 29, 3, 71, 50, 8]
N = 14
_ENGINES: dict[int, Engine] = {}
_PLAIN = {}


def engine(k: int) -> Engine:
    if k not in _ENGINES:
        _ENGINES[k] = Engine(MODEL, Settings(draft_max=k, n_ubatch=k + 2, poison=True, margins=True))
    return _ENGINES[k]


def plain():
    if not _PLAIN:
        _PLAIN["r"] = generate(Engine(MODEL, Settings(draft_max=0, n_rs_seq=0, margins=True)), PROMPT, NoDraft(), N,
                               record_states=True)
    return _PLAIN["r"]


@settings(max_examples=14, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 15), data=st.data())
def test_random_rollbacks_never_read_a_stale_plane(k, data):
    steps = data.draw(st.integers(3, 8))
    lengths = data.draw(st.lists(st.integers(0, k), min_size=steps, max_size=steps))
    accept = data.draw(st.lists(st.integers(0, k), min_size=steps, max_size=steps))
    ref = plain()
    drafter = Planted(ref.tokens, len(PROMPT), MINI.vocab_size, accept, lengths)
    res = generate(engine(k), PROMPT, drafter, N, record_states=True)  # StalePlane would raise here
    d = divergence(res.tokens, res.margins, ref.tokens, ref.margins, SELF_TOLERANCE)
    assert d.ok, str(d)
    assert len(res.tokens) == N
    check = Planted(ref.tokens, len(PROMPT), MINI.vocab_size, accept, lengths)
    done = 0
    for i, s in enumerate(res.steps):
        if d.index is not None and done + s.accepted + 1 > d.index:
            break  # (a near tie parted the runs: the schedule only holds before it)
        budget = draft_budget(k, engine(k).kv_size, len(PROMPT) - 1 + done, N, done)
        assert (s.drafted, s.accepted) == check.planned(i, budget), (i, s)
        done += s.accepted + 1
        assert state_difference(res.states[len(PROMPT) - 1 + done], ref.states[len(PROMPT) - 1 + done]) < 1e-5
    assert all(torch.isfinite(torch.tensor(res.margins)))  # a poisoned (NaN) plane read would show here
