"""Issue 9: soundness by search. The pass never accepts an unsafe rewrite, and refuses as little as possible.

Hypothesis perturbs valid 1-layer verify graphs of the tiny presets (see tests/support/soundness.py): it moves blocks
of nodes, flags nodes OUTPUT, reorders for fusion or not, varies n_t, n_rs_seq, d_conv and the ids, and inserts 1-3
nodes inside the conv chain's span or between a mat-vec pair that read or write random byte ranges of the arena,
the caches, the projection, the chain outputs, the ids and the weights. For every sample:

1. the narrow check's accepted rewrites run byte-identical to the unfused graph (check_fusion(...).identical);
2. each refused rewrite is forced alone (fuse(force=True) on that one candidate): it either changes bytes (a
   necessary refusal) or not (a conservative one; counted, never an error);
3. the broad check is run on the same sample: it never accepts anything unsafe, and narrow accepts everything it
   accepts.

Malformed graph files (random mutations of serialize.to_dict output) give a one-line GraphError, or load and then
fuse and run without any other exception (and, when fused, byte-identical).

What lies outside the property (plans gallocr never makes, a reported bug of the broad check) is recognised,
counted apart and reproduced by an xfail test below; docs/soundness.md explains each.

CI runs a bounded number of examples (about 30 s). GDNPASS_SOUNDNESS_EXAMPLES=N runs N perturbed graphs, 2N
malformed files and N/4 truncated texts (the long run in docs/soundness.md; add -s to see the counts),
GDNPASS_SOUNDNESS_REPORT=path also writes the counts there as JSON, and GDNPASS_SOUNDNESS_STRICT=1 makes the known
bugs fail the malformed-file search instead of being counted.
"""

from __future__ import annotations

import copy
import json
import os
import traceback
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdnpass import fusion, ops, serialize
from gdnpass.alloc import plan
from gdnpass.check import check_fusion
from gdnpass.ir import GraphError, Op
from gdnpass.models import VerifyConfig, build_verify_graph, default_ids
from support.soundness import (LAYOUTS, Bases, Insert, Sample, Stats, build, examine, mutations, n_examples,
                              plan_conflicts, planned, raw, regions, run, samples)

STRICT = os.environ.get("GDNPASS_SOUNDNESS_STRICT", "1") == "1"  # the file bugs found earlier are fixed


def search(n: int):
    """Hypothesis settings for one search: reproducible (derandomize), no deadline, no example database."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def report(name: str, text: str, counts: dict) -> None:
    print(f"\n{name}\n{text}")
    path = os.environ.get("GDNPASS_SOUNDNESS_REPORT")
    if path:
        old = {}
        if os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
        with open(path, "w") as f:
            json.dump({**old, name: counts}, f, indent=1, default=str)


# ---------------------------------------------------------------------------------------------------------------------
# perturbed verify graphs
# ---------------------------------------------------------------------------------------------------------------------


def test_perturbed_graphs_fuse_soundly():
    stats = Stats()

    @search(n_examples(200))  # CI; the long run (docs/soundness.md): GDNPASS_SOUNDNESS_EXAMPLES=4000
    @given(samples())
    def check(s):
        problems = examine(s, stats)
        assert not problems, "\n".join(problems)

    check()
    report("perturbed verify graphs", stats.table(), stats.to_json())
    assert stats.unsafe["narrow"] == 0 and stats.unsafe["broad"] == 0
    # the search is not vacuous: it fuses, it makes refusals matter, and it finds what only narrow accepts
    chain, pair = "gdn_conv_chain", "mul_mat_vec_pair"
    assert stats.accepted[chain] > 0 and stats.accepted[pair] > 0
    assert sum(stats.necessary.values()) > 0 and stats.narrow_only[chain] > 0


def test_a_copy_is_probed_after_it_copies():
    """Found by the search (2026-12-03): a write into the state cache after the state was read, before the GDN.
    Fused and unfused leave the same cache bytes, but the check probed the CPY of the snapshot into the cache just
    before its "last reader", which was the CPY itself (it lists its destination among its sources): the bytes from
    before the copy, which the inserted write had changed in one run and not yet in the other. A probe is read
    after its writer (runtime.probe_points)."""
    from gdnpass.runtime import probe_points

    s = Sample("tiny-dc3-h32", 1, 0, ffn=False, reorder=False, ids=(0,),
               inserts=(Insert(after=35, kind="exp", region="cache_s_l0[0]", rel=0, nbytes=4),))
    g = build(s)
    cpy = next(n for n in g.nodes if n.op is Op.CPY and n.name.startswith("ssm_state_update"))
    (at,) = [i for i, ts in probe_points(g, [cpy]).items() if cpy in ts]
    assert at > g.nodes.index(cpy)
    assert check_fusion(g, ids=list(s.ids), seed=s.seed).identical


def tiny() -> Sample:
    s = Sample("tiny-dc4-h64", 4, 3)
    return replace(s, ids=tuple(default_ids(s.cfg)))


def insert_after(s: Sample, node: str, kind: str, region: str, nbytes: int | None = None, rel: int = 0) -> Sample:
    """``s`` with one more inserted node, right after the node named ``node`` (rel/nbytes: inside ``region``)."""
    g = build(s)
    reg = regions(g)[region]
    after = next(i for i, n in enumerate(g.nodes) if n.name == node)
    ins = Insert(after, kind, region, rel, nbytes or reg.hi - reg.lo)
    return replace(s, inserts=s.inserts + (ins,))


def test_harness_sees_a_refused_hazard():
    """The negative control in the search's terms: an EXP scribbling on the SiLU block after the CONCAT is refused,
    and forcing it changes bytes (so the search can tell a necessary refusal from a conservative one)."""
    s = insert_after(tiny(), "conv_input-0", "exp", "silu")
    stats = Stats()
    assert examine(s, stats) == []
    assert stats.necessary["gdn_conv_chain", "between.writes-early-output"] == 1


def test_harness_sees_narrow_accept_what_broad_refuses():
    """Scaling the dead projection after the CONCAT: broad refuses, narrow accepts, and the bytes are identical."""
    s = tiny()
    g = build(s)
    proj, silu = (regions(g)[k] for k in ("projection", "silu"))
    free = [o for o in range(proj.lo, proj.hi - 64, 64) if o + 64 <= silu.lo or o >= silu.hi]  # not the SiLU block
    s = insert_after(s, "conv_input-0", "scale", "projection", 64, free[0] - proj.lo)
    stats = Stats()
    assert examine(s, stats) == []
    assert stats.narrow_only["gdn_conv_chain"] == 1
    assert stats.broad_refused["gdn_conv_chain", "between.touches-chain-buffer"] == 1


# ---------------------------------------------------------------------------------------------------------------------
# known gap: in-between writes onto the chain's live intermediates
# ---------------------------------------------------------------------------------------------------------------------


def scribble_on_live_concat():
    """A node right after the CONCAT whose output bytes are the CONCAT's (which the SSM_CONV and CPYs still read),
    reached without a graph edge. gallocr never plans this, but a graph file can say it."""
    cfg = VerifyConfig("tiny-dc4-h64", 4, 3, n_layers=1, mem_size=2)
    g = build_verify_graph(cfg)
    fusion.prepare(g, enabled=True)
    plan(g)
    concat = next(n for n in g.nodes if n.name == "conv_input-0")
    scribble = ops.exp(raw("weights", 0, 16))
    scribble.buffer, scribble.offset = "arena", concat.offset
    g.nodes.insert(g.index(concat) + 1, scribble)
    return cfg, g


@pytest.mark.xfail(strict=True, reason="known gap: the narrow between-rules ignore the chain's intermediates "
                                       "(GET_ROWS, CONCAT, SSM_CONV outputs); only a plan gallocr never makes puts "
                                       "a node on them: alloc.check_plan rejects it (on load), fuse() does not "
                                       "run it (8 ms); see docs/soundness.md")
def test_known_gap_write_onto_live_concat_is_fused():
    cfg, g = scribble_on_live_concat()
    res = check_fusion(g, ids=default_ids(cfg))
    assert res.identical, (res.report.summary(), [c.to_json() for c in res.compared if not c.identical][:2])


def test_broad_check_refuses_the_known_gap():
    cfg, g = scribble_on_live_concat()
    r = fusion.fuse(g, enabled=True, between="broad")
    assert "between.touches-chain-buffer" in {x.rule for x in r.refused}


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x != "rows"])
def test_broad_check_covers_window_rows(layout):
    """(was a bug found by this search: the broad check left out snapshot destinations outside the gathered cache)"""
    s = replace(tiny(), snapshot_layout=layout)
    s = insert_after(s, "conv_input-0", "exp", "cache_w_l0[0]")  # the whole row of cell 0, before its CPYs ran
    assert "between.writes-cache" in {r.rule for r in run(s).refused.values()}  # narrow refuses it
    res = run(s, between="broad")
    assert res.result.identical or "gdn_conv_chain:conv_input-0" not in res.accepted


# ---------------------------------------------------------------------------------------------------------------------
# malformed graph files
# ---------------------------------------------------------------------------------------------------------------------

_BASES = Bases()


def bases() -> Bases:
    """to_dict of small planned graphs: unprepared, prepared (with a keep-alive hint), and fused."""
    if not _BASES:
        for reorder, fused in [(False, False), (True, False), (True, True)]:
            g = planned(Sample("tiny-dc3-h32", 2, 1, ffn=False, reorder=reorder))
            if fused:
                fusion.fuse(g, enabled=True)
            _BASES.append(serialize.to_dict(g))
    return _BASES


FUSED_OPS = (Op.GDN_CONV_CHAIN, Op.MUL_MAT_VEC_PAIR)


def known_bug(g, err: Exception | None) -> str | None:
    """Which reported bug (see the xfail tests below) explains a crash (``err``) or a byte difference (None) on a
    loaded graph; None if none does."""
    frames = {f.name for f in traceback.extract_tb(err.__traceback__)} if err else set()
    fused = any(n.op in FUSED_OPS for n in g.nodes)
    if fused and (err is None or frames & {"_ref_conv_chain", "_ref_mat_vec_pair"}):
        return "fused nodes from a file are not validated"
    if plan_conflicts(g) and (err is None or ("get_rows" in frames and isinstance(err, IndexError))):
        return "a plan with overlapping live tensors loads (and is fused)"
    return None


def check_one_line(err: GraphError, source: str) -> None:
    msg = str(err)
    assert "\n" not in msg and msg.startswith(source + ": "), msg


def test_malformed_graph_files_fail_cleanly():
    outcome: Counter = Counter()

    def known(g, err=None) -> bool:
        bug = known_bug(g, err)
        if bug is None or STRICT:
            return False
        outcome[f"loaded, known bug: {bug}"] += 1
        return True

    @search(n_examples(1000, per=2))
    @given(mutations(bases()))
    def check(mutated):
        d, steps = mutated
        try:
            g = serialize.from_dict(d, "mutated.json")
        except GraphError as err:
            check_one_line(err, "mutated.json")
            outcome["GraphError on load"] += 1
            return
        outcome["loaded"] += 1
        try:
            res = check_fusion(g)  # fuses and runs it (ids from the file's meta)
        except GraphError:
            outcome["loaded, GraphError on fuse/run"] += 1
            return
        except Exception as err:
            if known(g, err):
                return
            raise
        outcome["loaded, ran" + (", fused" if res.report.applied else "")] += 1
        # a file that loads is fused only where that is safe
        assert res.identical or known(g), (steps, [c.to_json() for c in res.compared if not c.identical][:2])

    check()
    report("malformed graph files", "\n".join(f"{k}: {v}" for k, v in sorted(outcome.items())), dict(outcome))
    assert outcome["GraphError on load"] > 0 and outcome["loaded, ran, fused"] > 0


@search(n_examples(200, per=0.25))
@given(st.data())
def test_truncated_json_text_is_a_one_line_error(data):
    text = serialize.dumps(serialize.from_dict(bases()[data.draw(st.integers(0, 2))]))
    cut = data.draw(st.integers(0, len(text) - 2))
    with pytest.raises(GraphError) as err:
        serialize.loads(text[:cut], "cut.json")
    check_one_line(err.value, "cut.json")


# ---------------------------------------------------------------------------------------------------------------------
# known bugs found by the malformed-file search (minimal reproductions)
# ---------------------------------------------------------------------------------------------------------------------


def tiny_dict(fused: bool = False) -> dict:
    return copy.deepcopy(bases()[2 if fused else 0])


def tensor(d: dict, pred) -> dict:
    return next(e for e in d["tensors"] if pred(e))


def test_relabelled_fused_node_is_refused_on_load():
    """(was a bug found by this search: from_dict did not validate fused nodes)"""
    d = tiny_dict()
    tensor(d, lambda e: e["op"] == "SSM_CONV")["op"] = "GDN_CONV_CHAIN"
    with pytest.raises(GraphError):
        check_fusion(serialize.from_dict(d, "m.json"))


def test_fused_node_with_a_null_src_is_refused_on_load():
    d = tiny_dict(fused=True)
    tensor(d, lambda e: e["op"] == "GDN_CONV_CHAIN")["src"][-1] = None
    with pytest.raises(GraphError):
        check_fusion(serialize.from_dict(d, "m.json"))


def test_ids_leaf_under_a_live_node_is_refused_on_load():
    """(was a bug found by this search: from_dict accepted plans with overlapping live tensors)"""
    d = tiny_dict()
    e = tensor(d, lambda e: e["name"] == "rs_s_copy")
    e["buffer"], e["offset"] = "arena", 0  # on top of attn_norm, written by the second node
    with pytest.raises(GraphError):
        check_fusion(serialize.from_dict(d, "m.json"))


def test_invalid_plan_is_refused_on_load():
    d = tiny_dict()
    concat = tensor(d, lambda e: e["name"] == "conv_input-0")
    state = tensor(d, lambda e: e["name"] == "cache_s_l0 (reshaped) (get_rows)")  # written while the CONCAT is live
    concat["offset"] = state["offset"]
    with pytest.raises(GraphError, match="share bytes .* while both are live"):
        serialize.from_dict(d, "m.json")
