"""benchmarks/device_session.py's steps and their runner, gdnpass.bench.session (the steps need the GPU host; the
runner does not)."""

import sys

from gdnpass.bench import session


def test_a_step_reports_its_status_time_and_last_line(tmp_path):
    name, rc, secs, said = session.run_step("ok", [sys.executable, "-c", "print('a'); print('done: 3')"], 30,
                                              tmp_path)
    assert (name, rc, said) == ("ok", 0, "done: 3") and secs < 30
    assert (tmp_path / "ok.log").read_text() == "a\ndone: 3\n"
    assert session.run_step("bad", [sys.executable, "-c", "raise SystemExit(4)"], 30, tmp_path)[1] == 4
    assert session.run_step("gone", ["/nonexistent/tool"], 30, tmp_path)[1] == 127


def test_a_silent_step_past_its_limit_is_stopped(tmp_path):
    name, rc, secs, _ = session.run_step("hang", [sys.executable, "-c", "import time; time.sleep(30)"], 1.0,
                                           tmp_path)
    assert rc is None and 1.0 <= secs < 10


def test_each_part_fits_one_device_call(tmp_path):
    for part in (p for p in session.PARTS if p != 4):  # (part 4: 580 s, a call of its own)
        assert sum(limit for _, _, limit in session.steps(part, ".llama-src", tmp_path)) < 540


def test_step_names_are_unique_across_parts(tmp_path):
    # (--steps finds a step by its name among every part's: a second step of the same name would hide the first)
    names = [name for part in session.PARTS for name, _, _ in session.steps(part, ".llama-src", tmp_path)]
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)


def test_a_step_past_its_limit_is_stopped_with_its_children(tmp_path):
    # compute-sanitizer and multiprocessing pools run the work in children, which keep the output pipe open
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); " \
            "time.sleep(30)"
    name, rc, secs, _ = session.run_step("tree", [sys.executable, "-c", child], 1.0, tmp_path)
    assert rc is None and 1.0 <= secs < 10
