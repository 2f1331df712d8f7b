"""How many programs an SM holds is decided by registers and shared memory, which only the compiled binary knows; for
the quantized mat-vec it decides the time: a Q4_K form with 130 registers held 3 programs an SM where 128 held 4, and
its 512-program down projection ran 24% slower on the H100 (docs/performance.md, 2026-12-06, sixth session). Compiled
on the CPU exactly as the launches specialize them (launched_sm90.py), the Q4_K production variants, MUL_MAT_ADD's
residual form and MUL_MAT_ID's among them, must hold 4 (triton_matvec.Q4_K_REGS)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernels.launched_sm90 import programs_per_sm  # (tests/ is on the path: pyproject's pythonpath)

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file: tests/kernels/)
SPILL_BYTES = 0  # the register cap spills nothing (ptxas's stack; 8 bytes in the residual form before the pair's
# two products shared one code path, 2026-12-06)


def _launched() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    r = subprocess.run([sys.executable, "tests/kernels/launched_sm90.py"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def test_programs_per_sm_counts_registers_by_the_warp_and_shared_memory_by_the_block():
    assert programs_per_sm(128, 57344, 4) == 4
    assert programs_per_sm(130, 57344, 4) == 3    # 130 x 32 rounds up to 17 x 256 registers a warp
    assert programs_per_sm(128, 65536, 4) == 3    # Q5_K's shared memory: 3 blocks of 65 KB in 228 KB
    assert programs_per_sm(186, 49152, 4) == 2
    assert programs_per_sm(32, 0, 4) == 16        # 64 warps at most


@pytest.mark.slow
def test_q4_k_mat_vec_variants_hold_four_programs_an_sm():
    found = _launched()
    # the 9B's Q4_K tiles (K split 1, 2, 4, 8), the residual form of two of them, MUL_MAT_ID's (split 2)
    assert {(v["split"], v["residual"], v["ids"]) for v in found} == {
        (2, False, False), (8, False, False), (8, True, False), (4, False, False), (4, True, False),
        (1, False, False), (2, False, True)}, found
    for v in found:
        assert v["qtype"] == "q4_k" and v["cols"] == 16, v
        assert v["programs"] >= 4, f"{v}: fewer than 4 programs an SM (the cap, triton_matvec.Q4_K_REGS)"
        assert v["stack"] <= SPILL_BYTES, f"{v}: the register cap now spills ({v['stack']} bytes)"
