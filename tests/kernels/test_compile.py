"""The Triton kernels compile for the H200 (sm_90) on a machine without a GPU (see compile_sm90.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def sm90_script(script: str, *args):
    """Run tests/kernels/``script`` (compile_sm90.py, launched_sm90.py) without the interpreter."""
    root = Path(__file__).resolve().parents[2]  # the repository (this file: tests/kernels/)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the repository's gdnpass, installed or not (a script's own folder, tests/kernels/, is what python puts on
    # sys.path)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, f"tests/kernels/{script}", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)


def test_every_kernel_compiles_for_sm90():
    r = sm90_script("compile_sm90.py")
    assert r.returncode == 0, r.stderr[-3000:]
    n = int(r.stdout.rsplit("compiled ", 1)[1].split()[0])
    assert n >= 14 and r.stdout.count("sm_90 ok") == n, r.stdout
    kernels = int(r.stdout.split(" kernels found in gdnpass.kernels and the patterns")[0].rsplit("\n", 1)[-1])
    assert kernels >= 17, r.stdout  # (the Triton modules' and the patterns' kernels, by import: none left out)


def test_the_compile_check_refuses_what_only_the_interpreter_accepts():
    """A kernel the compiler refuses, a tile that compiles but needs more shared memory than sm_90 gives, and a
    kernel of the package without a variant."""
    r = sm90_script("compile_sm90.py", "--negative-control")
    assert r.returncode == 0 and r.stdout.count("refused as expected") == 3, r.stdout + r.stderr[-2000:]


def test_kernels_running_chain_steps_compile_as_launched():
    """The GDN computing its gates (a verify's unrolled tokens, a prompt's loop, gathering its state), a product's
    store running the GDN's output gate and the FFN pair's SwiGLU (unsplit and split), each compiled for sm_90
    specialized as its launch is (launched_sm90.py --epilogues): ints of 1 become constants there, not in
    compile_sm90.py's uniform hints, and the prompt loop's gates failed on the GPU that way until chain_args was
    flattened (docs/performance.md, 2026-12-07, twelfth)."""
    import json

    r = sm90_script("launched_sm90.py", "--epilogues")
    assert r.returncode == 0, r.stderr[-3000:]
    found = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    gdn = [(v["N_T"], v["GATHER"]) for v in found if v["kernel"] == "_gdn_kernel" and v["G_STEPS"] and v["B_STEPS"]]
    assert gdn == [(4, False), (0, False), (4, True)], found  # (N_T 0: the loop)
    products = [(v["STEPS"], v["GLU"], v["SPLIT_K"]) for v in found if v["kernel"] == "_mul_mat_vec_kernel"]
    assert products == [(["SILU", "RMUL"], 0, 4), ([], 1, 1), ([], 1, 2)], found


def _sass(qtype: str) -> dict[str, int]:
    r = sm90_script("launched_sm90.py", "--sass", qtype, "12288", "4096", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    return {op: int(n) for n, op in (line.split() for line in r.stdout.splitlines())}


@pytest.mark.parametrize("qtype, barriers", [("q4_k", 16), ("q8_0", 24), ("q6_k", 16)])
def test_quantized_weights_copy_ahead_as_launched(qtype, barriers):
    """launched_sm90.py --sass: a mat-vec's SASS opcodes as launched. Q4_K's 144-byte blocks lie on 16-byte words,
    and so do Q8_0's and Q6_K's quants in the rows gdnpass holds (quants.held_rows: in planes, quants first), so
    Triton's pipeline copies them ahead (LDGSTS) and the dot reads them from shared memory with few barriers. (Q8_0's
    blocks as the file has them, every other group's quants 2 bytes off a word, went through shared memory group by
    group: 141 STS and 39 BAR at 12288 x 4096; Q6_K's 210-byte blocks, loaded 16 bits at a time to avoid that, were
    waited on in their own step, uncopied ahead.)"""
    ops = _sass(qtype)
    assert ops.get("LDGSTS", 0) >= 32 and ops.get("BAR", 0) <= barriers and ops.get("STS", 0) <= 16, ops
