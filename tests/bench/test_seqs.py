"""benchmarks/seqs_bench.py's pieces (gdnpass.bench.seqs): the command line, the prompts, the drafters and the
llama.cpp peer's requests; and the whole benchmark on the CPU with a tiny cycle model (its GPU run: device_session
part 9)."""

from __future__ import annotations

import json

import pytest

from gdnpass.bench import seqs as sb
from gdnpass.engine import Settings
from gdnpass.errors import GdnpassError


def test_seq_counts_and_choices():
    assert sb.parse_seqs("1,8,32", 256) == [1, 8, 32] and sb.parse_seqs(" 4 ", 256) == [4]
    for bad, why in (("1,x", "separated by commas"), ("", "at least one"), ("0,8", "0 sequences"),
                     ("1,300", "300 sequences: expected 1..256"), ("8,1", "increasing"), ("8,8", "each count once")):
        with pytest.raises(GdnpassError, match=why):
            sb.parse_seqs(bad, 256)
    assert sb.parse_choice("planted,ngram", "--draft", sb.DRAFTERS) == ["ngram", "planted"]
    with pytest.raises(GdnpassError, match="--draft 'mtp': expected one or more of ngram, planted"):
        sb.parse_choice("mtp", "--draft", sb.DRAFTERS)
    with pytest.raises(GdnpassError, match="--peer-sampling ''"):
        sb.parse_choice("", "--peer-sampling", sb.SAMPLING)


def test_prompts():
    assert sb.choose_prompts(["a", "b", "c"], 2) == ["a", "b"]
    with pytest.raises(GdnpassError, match="32 sequences need 32 prompts; f.txt have 3"):
        sb.choose_prompts(["a", "b", "c"], 32, "f.txt")
    with pytest.raises(GdnpassError, match="prompts 0 and 2 are the same"):
        sb.choose_prompts(["a", "b", "a"], 3)
    assert sb.last_tokens([[1, 2, 3, 4], [5, 6, 7]], 3) == [[2, 3, 4], [5, 6, 7]]
    assert sb.last_tokens([[1, 2], [3]], 0) == [[1, 2], [3]]
    with pytest.raises(GdnpassError, match="--prompt-tokens 3: prompt 1 has 2 tokens"):
        sb.last_tokens([[1, 2, 3], [4, 5]], 3)


def test_built_in_prompts_diverge_on_the_9b_cycle_model():
    """The device run's tokenizer (the writer's, at the 9B's vocabulary): each built-in prompt ends in a token of its
    own (a cycle model's continuation follows the last token, so no two sequences generate the same tokens), and each
    has the default --prompt-tokens."""
    from gdnpass.models.gguf_write import tokenizer_metadata
    from gdnpass.models.hparams import get_model
    from gdnpass.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(tokenizer_metadata(get_model("qwen3.5-9b").vocab_size))
    ids = [tok.encode(t) for t in sb.PROMPTS]
    assert len(ids) == 32 and len({p[-1] for p in ids}) == 32
    assert min(len(p) for p in ids) >= sb.parser().get_default("prompt_tokens")


def test_drafters_and_context():
    assert sb.drafter_spec("ngram", 5, 3) == {"kind": "ngram", "size_n": 3, "size_m": 3}
    # sequence s starts the schedule all, none, 1, 2 at entry s: one ubatch's sequences accept different counts
    assert [sb.drafter_spec("planted", s, 3, [7, 8])["accept"] for s in range(5)] == \
        [[3, 0, 1, 2], [0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1], [3, 0, 1, 2]]
    with pytest.raises(GdnpassError, match="sequence 2 needs its truth"):
        sb.drafter_spec("planted", 2, 3)
    # one stream size for every S and alone: the longest prompt, -n tokens and a last step's K + 2 cells
    assert sb.ctx_per_seq([[1] * 25, [1] * 20], 128, 3) == 256 and sb.ctx_per_seq([[1] * 25], 227, 3) == 512
    assert sb.abba(2) == [False, True, True, False] * 2


class _Model:
    class shape:
        vocab_size = 512


def test_the_peer_runs_the_engines_context():
    """llama.cpp's request for S sequences is the context of gdnpass's engine for S: n_seq_max S, the same n_ctx,
    n_ubatch and K rollback planes, the same prompts and drafters; n_batch holds the prefill and a step of full
    drafts (one llama_decode each); a warm-up run before the timed ones."""
    prompts = [[10 + s] * 25 for s in range(8)]
    bench = sb.Bench(_Model(), prompts, 3, 16, device="cpu")
    bench.truths = {s: list(range(16)) for s in range(8)}
    cases = sb.peer_cases(bench, [1, 8], ["ngram", "planted"], ["host", "backend"], runs=2)
    assert [(c["S"], c["drafter"], c["sampling"]) for c in cases][:4] == [
        (1, "ngram", "host"), (1, "ngram", "backend"), (1, "planted", "host"), (1, "planted", "backend")]
    for c in cases:
        r, s = c["request"], bench.settings(c["S"], False)
        assert (r["n_ctx"], r["n_ubatch"], r["n_rs_seq"], r["draft_max"]) == (s.n_ctx, s.ubatch, 3, 3)
        assert r["prompts"] == prompts[:c["S"]] and len(r["drafters"]) == c["S"]
        assert r["drafters"] == bench.specs(c["drafter"], c["S"]) and r["runs"] == 3 and r["sampling"] == c["sampling"]
        assert r["n_batch"] >= max(sum(len(p) for p in r["prompts"]), c["S"] * 4)
    assert bench.settings(8, False).ubatch == 32 and bench.settings(8, False).kv_size == 256
    assert Settings(draft_max=3, n_seqs=8, n_ctx=8 * 256).kv_size == 256


def test_the_peer_record():
    got = {"runs": [{"tokens_per_second": 10.0, "decode_seconds": 2.0, "same_tokens": True},
                    {"tokens_per_second": 40.0, "decode_seconds": 0.5, "same_tokens": True},
                    {"tokens_per_second": 50.0, "decode_seconds": 0.4, "same_tokens": True}],
           "sequences": [{"tokens": [1, 2], "steps": [{}]}, {"tokens": [3, 5], "steps": [{}, {}]}], "settings": {}}
    rec = sb.peer_record({"S": 2, "drafter": "ngram", "sampling": "host"}, got, [[1, 2], [3, 4]], 90.0)
    assert rec["tokens_per_s"] == [40.0, 50.0] and rec["median_tokens_per_s"] == 45.0  # (the warm-up left out)
    assert rec["warmup_tokens_per_s"] == 10.0 and rec["gdnpass_on_over_llama_cpp"] == 2.0 and rec["steps"] == 2
    assert not rec["same_tokens_as_gdnpass"] and rec["differing_sequences"] == [1]


def test_the_device_sessions_command_parses():
    from gdnpass.bench import session

    (name, cmd, limit), = session.steps(9, ".llama-src", session.Path("out"))
    assert cmd[1] == "benchmarks/seqs_bench.py" and limit <= 530
    a = sb.parser().parse_args(cmd[2:])
    assert (a.seqs, a.draft, a.draft_max, a.n_predict, a.peer, a.source, a.device) == \
        ("1,8,32", "ngram,planted", 3, 128, True, ".llama-src", "cuda")


def test_bad_input_is_one_line(tmp_path):
    for argv, why in ((["--seqs", "0"], "0 sequences"), (["--draft", "mtp"], "--draft 'mtp'"),
                      (["-K", "0"], "-K must be >= 1"), (["--seqs", "33"], "33 sequences need 33 prompts"),
                      (["--gguf", str(tmp_path / "no.gguf")], "no such file")):
        with pytest.raises(SystemExit, match=f"seqs_bench: .*{why}"):
            sb.main(["--gguf", "x.gguf", "--device", "cpu", *argv])


def test_the_whole_bench_on_the_cpu(tmp_path, llama, capsys):
    """Two sequence counts, both drafters, llama.cpp's CPU build as the peer with both ways of reading its tokens:
    fusion off = on, every sequence as alone, llama.cpp's tokens gdnpass's (exit 0), the numbers in the JSON."""
    path, out = tmp_path / "c.gguf", tmp_path / "o.json"
    rc = sb.main(["--device", "cpu", "--gguf", str(path), "--write-cycle", "tiny-qwen35", "--wtype", "f32",
                  "--period", "5", "--seqs", "1,3", "-K", "2", "-n", "10", "--prompt-tokens", "8", "--peer",
                  "--peer-runs", "1", "--json", str(out)])
    assert rc == 0, capsys.readouterr().out[-2000:]
    res = json.loads(out.read_text())
    assert [(c["S"], c["drafter"]) for c in res["cases"]] == [(1, "ngram"), (1, "planted"), (3, "ngram"),
                                                               (3, "planted")]
    for c in res["cases"]:
        assert c["identical_off_on"] and c["same_as_alone"] and c["lean_runs_same_tokens"]
        assert c["fusion_on"]["tokens"] == 10 * c["S"] and len(c["fusion_on"]["tokens_per_s"]) == 2
    planted = res["cases"][3]
    assert planted["distinct_sequences"] == 3 and 0 < planted["fusion_on"]["accept_rate"] < 1
    assert planted["fusion_on"]["ubatches_per_step"] < 3  # (sequences shared ubatches)
    assert {(p["S"], p["drafter"], p["sampling"]) for p in res["llama_cpp"]} == {
        (s, d, m) for s in (1, 3) for d in sb.DRAFTERS for m in sb.SAMPLING}
    assert all(p["same_tokens_as_gdnpass"] and p["runs_same_tokens"] for p in res["llama_cpp"])
    assert "llama.cpp backend" in capsys.readouterr().out
