"""The ``gdnpass`` command as a new user meets it: flag errors, the graph-file loop, the interpreter guard,
progress, a plan too large for the machine, Ctrl-C, and a fast ``--help``."""

import io
import json
import os
import subprocess
import sys

import pytest

from gdnpass import cli, progress
from gdnpass.errors import ResourceError

TINY = ["--model", "tiny-dc4-h64", "--layers", "1"]


def run_main(capsys, *argv):
    """(exit code, stdout, stderr) of ``gdnpass argv``; argparse's exits count as exit codes."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


@pytest.mark.parametrize("value", ["0", "-128", "3", "x"])
def test_bad_alignment_names_the_flag(capsys, value):
    rc, _, err = run_main(capsys, "dump", *TINY, f"--alignment={value}")
    assert rc == 2
    assert "--alignment" in err and value in err


def test_graph_file_loop(capsys, tmp_path):
    fused, unfused, report = tmp_path / "fused.json", tmp_path / "unfused.json", tmp_path / "dump.json"
    rc, out, _ = run_main(capsys, "run", *TINY, "--fuse", "--save", str(fused), "-q")
    assert rc == 0 and "(1 allocator hint) ->" in out
    rc, out, _ = run_main(capsys, "run", "--graph", str(fused), "-q")  # an already-fused graph runs
    assert rc == 0 and f"graph file {fused}" in out
    rc, out, _ = run_main(capsys, "dump", "--graph", str(fused))
    assert rc == 0 and "GDN_CONV_CHAIN" in out
    rc, out, err = run_main(capsys, "run", "--graph", str(fused), "--check")
    assert rc == 2 and "already fused" in err and "--no-fuse --save" in err and err.count("\n") == 1

    rc, _, _ = run_main(capsys, "run", *TINY, "--no-fuse", "--save", str(unfused), "-q")
    assert rc == 0
    rc, out, _ = run_main(capsys, "run", "--graph", str(unfused), "--check", "-q")
    assert rc == 0 and "0 differing" in out

    rc, out, _ = run_main(capsys, "dump", *TINY, "--fuse", "--format", "json")
    assert rc == 0
    report.write_text(out)
    rc, _, err = run_main(capsys, "run", "--graph", str(report))
    assert rc == 2 and "dump" in err and "--save" in err and err.count("\n") == 1


def test_dump_counts_allocator_hints(capsys):
    rc, out, _ = run_main(capsys, "dump", *TINY, "--fuse")
    assert rc == 0 and "(1 allocator hint) ->" in out
    rc, out, _ = run_main(capsys, "dump", *TINY, "--no-fuse")
    assert rc == 0 and "allocator hint" not in out  # prepare runs only with fusion on


def test_interpreter_guard(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc, _, err = run_main(capsys, "run", "--backend", "triton")  # qwen3.5-9b, 4 layers: an hour or more
    assert rc == 2 and "--allow-slow" in err and "about" in err and err.count("\n") == 1
    rc, _, err = run_main(capsys, "run", "--backend", "triton", "--check")
    assert rc == 2 and "--allow-slow" in err and "check (the graph twice" in err and err.count("\n") == 1


def test_interpreter_guard_suggests_a_graph_it_accepts():
    """The smaller graph the refusal names runs under the limit, checked (twice) too: the suggestion works for
    both refusals."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from gdnpass import pipeline

    a = cli.make_parser().parse_args(["run", *cli.SMALL_GRAPH])
    nodes = pipeline.run(cli._source(a), cli.pass_options(a, True), fuse_now=False).graph.nodes
    assert 2 * cli.interpreter_seconds(nodes) <= cli.SLOW_LIMIT_S


def test_programs_follow_the_launch_blocks():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from gdnpass import pipeline
    from gdnpass.ir import Op
    from gdnpass.kernels import triton_elementwise
    from gdnpass.kernels.backends import programs
    from gdnpass.fusion import fuse
    from gdnpass.models import VerifyConfig
    from gdnpass.patterns.elementwise_chain import ElementwiseChain

    g = pipeline.run(VerifyConfig("tiny-dc4-h64", 8, 7, n_layers=1), pipeline.PassOptions(fusion=True)).graph
    seen = {}
    for n in g.nodes:
        for kernel, count, steps in programs(n):
            assert count >= 1 and steps >= 1
            seen.setdefault(n.op, []).append((kernel, count, steps))
    assert {Op.GDN_CONV_CHAIN, Op.MUL_MAT_VEC_PAIR, Op.GATED_DELTA_NET_CACHE, Op.MUL_MAT_CHAIN} <= set(seen)
    blocks = lambda n: -(-n.nelements // triton_elementwise.ELT_BLOCK)  # noqa: E731
    unfused = pipeline.run(VerifyConfig("tiny-dc4-h64", 8, 7, n_layers=1), pipeline.PassOptions(fusion=False)).graph
    sigmoid = next(n for n in unfused.nodes if n.op is Op.UNARY and n.op_params["kind"] == "SIGMOID")  # (gdn_gates
    # has the GDN compute beta's SIGMOID: only an unfused graph launches it)
    assert programs(sigmoid) == [("sigmoid", blocks(sigmoid), 1)]
    fuse(unfused, enabled=True, patterns=[ElementwiseChain()])  # (the pass gives both chains to later patterns)
    chain = next(n for n in unfused.nodes if n.op is Op.ELEMENTWISE_CHAIN)
    assert programs(chain) == [("elementwise_chain", blocks(chain), 1)]
    assert 0 < cli.interpreter_seconds(g.nodes) < cli.SLOW_LIMIT_S


def test_progress_lines_without_carriage_returns(monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    s = io.StringIO()
    p = progress.Step("execute", stream=s, tty=False)
    for i in range(1, 4):
        p(i, 3)
    for i in range(1, 3):  # a second pass (check)
        p(i, 2)
    text = s.getvalue()
    assert "\r" not in text and "execute: 3/3 nodes (100%)" in text and "execute (pass 2): 2/2" in text
    q = io.StringIO()
    quiet = progress.Step("execute", stream=q, tty=False, quiet=True)
    for i in range(1, 4):
        quiet(i, 3)
    assert q.getvalue() == ""


def test_short_steps_show_nothing():
    s = io.StringIO()
    p = progress.Step("fill", stream=s, tty=False)
    p(1, 2)
    p(2, 2)
    assert s.getvalue() == ""


def test_plan_larger_than_memory_is_refused(capsys, tmp_path):
    small = tmp_path / "g.json"
    assert run_main(capsys, "dump", *TINY, "--save", str(small))[0] == 0
    d = json.loads(small.read_text())
    leaf = dict(next(e for e in d["tensors"] if e["buffer"] == "weights" and e["view_src"] is None))
    n = 10 ** 12
    leaf.update(id=len(d["tensors"]), name="huge.weight", ne=[n, 1, 1, 1], nb=[4, 4 * n, 4 * n, 4 * n], type="f32",
                offset=d["buffers"]["weights"]["size"], layer=None)
    d["buffers"]["weights"]["size"] += 4 * n
    d["tensors"].append(leaf)
    d["leafs"].append(leaf["id"])
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps(d))
    rc, _, err = run_main(capsys, "run", "--graph", str(huge))
    assert rc == 2 and err.count("\n") == 1
    assert "huge.weight" in err and "3.64 TiB" in err and "available RAM" in err

    from gdnpass.serialize import load
    from gdnpass.runtime import Executor, check_memory
    import torch

    with pytest.raises(ResourceError, match="huge.weight"):
        Executor(load(huge))
    check_memory(load(small), torch.device("cpu"))  # the tiny graph fits
    with pytest.raises(ResourceError, match="weights"):
        check_memory(load(small), torch.device("cpu"), available=1024)


def test_ctrl_c_is_one_line(capsys, monkeypatch):
    def interrupted(a):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_run", interrupted)
    rc, _, err = run_main(capsys, "run")
    assert rc == 130 and err == "gdnpass: interrupted\n"


def test_bare_command_prints_help(capsys):
    rc, out, _ = run_main(capsys)
    assert rc == 0 and "usage: gdnpass" in out and "run" in out and "dump" in out


def test_help_imports_neither_torch_nor_triton():
    code = ("import sys\nfrom gdnpass import cli\n"
            "for argv in (['--help'], ['run', '--help'], ['dump', '--help']):\n"
            "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'triton', 'numpy', 'networkx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_the_weight_types_are_the_irs_float_and_block_types():
    from gdnpass.cli import WEIGHT_TYPES
    from gdnpass.ir import DType

    assert WEIGHT_TYPES == [t.label for t in DType if t.is_quantized or t.label in ("f32", "f16", "bf16")]
