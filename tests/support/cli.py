"""Running the ``gdnpass`` command inside a test: its exit code and output, and the one-line refusal every bad input
must get (tests/test_cli_bad_input.py, tests/frontends/llama/test_quantize.py)."""

from gdnpass import cli


def cli_run(capsys, *argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``gdnpass argv``; never a traceback."""
    try:
        rc = cli.main([str(x) for x in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return rc, out, err


def refused(capsys, *argv, says: tuple[str, ...] = ()) -> str:
    """``gdnpass argv`` is a one-line error, exit 2, whose line holds every string of ``says``."""
    rc, _, err = cli_run(capsys, *argv)
    assert rc == 2 and err.count("\n") == 1, (rc, err)
    for s in says:
        assert s in err, (s, err)
    return err
