"""gdnpass.bench.chain's snapshot-layout measurement at batch (issue 37 item 3; benchmarks/tune_dedup.py), on the CPU:
everything it does before it times (the fused and unfused chain of S sequences from one layer, their byte checks,
the per-token baseline), in the Triton interpreter at a tiny size; the check catches a node that writes the wrong
bytes. The timing itself needs the GPU (device_session.py part 10)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gdnpass.bench import chain
from gdnpass.errors import GraphError
from gdnpass.models.hparams import get_model
from gdnpass.launches import node_launches

ROOT = Path(__file__).resolve().parents[2]


def test_the_batch_measurement_checks_every_layout_and_the_baseline():
    (r,) = chain.bench_dedup_seqs("tiny-dc4-h64", [(3, 4)])
    assert (r["S"], r["T"], r["planes"], r["C"]) == (3, 4, 4, 256)
    assert all(r[f"{k} identical"] for k in ("rows", "norm-apart", "dedup", "dedup-t", "per-token"))
    assert (r["rows tile"], r["dedup tile"], r["dedup-t tile"]) == (False, True, True)
    # the tile stores the shared row's 5 columns once, the windows' 3 x 3 columns window by window
    assert r["per-token bytes"] == r["rows bytes"] > r["dedup bytes"] == r["dedup-t bytes"]
    assert r["rows bytes"] - r["dedup bytes"] == 4 * 3 * 256 * (3 * 3 - 5)
    # GET_ROWS, CONCAT, 4 CPYs, SSM_CONV, SILU, q and k RMS_NORM + SCALE
    assert r["rows unfused kernels"] == r["dedup unfused kernels"] == 12
    if not torch.cuda.is_available():
        assert all(r[k] != r[k] for k in ("rows", "norm-apart", "dedup", "dedup-t", "per-token"))  # NaN: untimed


def test_the_byte_check_catches_a_node_that_writes_the_wrong_window():
    """The negative control: the dedup node without its tile, its first window storing another window's columns."""
    ex, node, nodes = chain.chain_layer("tiny-dc4-h64", 4, 3, "dedup", n_seqs=3)
    fused, unfused = chain.node_runner(ex, node), chain.nodes_runner(ex, nodes)
    over = chain.chain_written(node)
    assert chain.same_bytes(ex, unfused, fused, over)
    wrong = chain.without_tile(node)
    cols = node.op_params["columns"]
    wrong.op_params = {**wrong.op_params, "columns": [cols[1], *cols[1:]]}
    assert cols[0] != cols[1] and not chain.same_bytes(ex, fused, chain.node_runner(ex, wrong), over)
    assert chain.same_bytes(ex, fused, chain.node_runner(ex, chain.without_tile(node)), over)
    # the norm-apart form: the same bytes from its own norm launches (q and k: RMS_NORM and SCALE each)
    apart = chain.norm_apart(node)
    assert (node_launches(node), node_launches(apart)) == (1, 5)
    assert chain.same_bytes(ex, fused, chain.node_runner(ex, apart), over)


def test_chain_bytes_of_several_sequences():
    one, C, dc = chain.chain_bytes(8, 8), 8192, 4
    assert chain.chain_bytes(8, 8, n_s=3) == 3 * one - 2 * 4 * dc * C  # the conv taps are read once
    tile = {"windows": list(range(7)), "n_cols": 9}
    assert one - chain.chain_bytes(8, 8, tile) == 4 * C * (7 * (dc - 1) - 9)


def test_the_seed_points_run_first_and_the_bf16_shape_halves_the_channels():
    cases = chain.seqs_cases([1, 8, 64, 128], [4, 8, 16])
    assert cases[:4] == list(chain.SEED_003) and sorted(cases) == sorted((s, t) for s in (1, 8, 64, 128)
                                                                          for t in (4, 8, 16))
    half, full = chain.half_channels("qwen3.5-27b"), get_model("qwen3.5-27b")
    assert (full.conv_channels, half.conv_channels, half.head_dim) == (10240, 5120, full.head_dim)
    with pytest.raises(GraphError, match="do not halve"):
        chain.half_channels("tiny-dc4-h64")


def _script(*args):
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "benchmarks/tune_dedup.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (the GPU runs it in device_session.py part 10)")
def test_tune_dedup_runs_on_the_cpu_and_refuses_bad_input_in_one_line(tmp_path):
    out = tmp_path / "dedup.json"
    r = _script("--seqs", "2", "--tokens", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    (case,) = json.loads(out.read_text())["cases"]
    assert (case["S"], case["T"], case["dedup tile"]) == (2, 2, False)  # one window: nothing shared, no tile
    assert r.stdout.splitlines()[-1].split("|")[-2].strip() == "yes"
    for args, msg in ((["--seqs", "129"], "--seqs 129: S is 1..128"), (["--model", "nope"], "unknown model 'nope'"),
                      (["--state", "bf16-bytes"], "do not halve")):
        r = _script(*args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
