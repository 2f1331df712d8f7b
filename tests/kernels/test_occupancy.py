"""How many programs an SM holds is decided by registers and shared memory, which only the compiled binary knows; for
the quantized mat-vec it decides the time: a Q4_K form with 130 registers held 3 programs an SM where 128 held 4, and
its 512-program down projection ran 24% slower on the H100 (docs/performance.md, 2026-12-06, sixth session). Compiled
on the CPU exactly as the launches specialize them (launched_sm90.py), the Q4_K production variants, MUL_MAT_ADD's
residual form among them, must hold 4 (triton_matvec.Q4_K_REGS)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kernels.launched_sm90 import programs_per_sm  # (tests/ is on the path: pyproject's pythonpath)

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file: tests/kernels/)
SPILL_BYTES = 8  # what the register cap costs the residual form's epilogue (ptxas's stack, 2026-12-06)


def _launched() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    r = subprocess.run([sys.executable, "tests/kernels/launched_sm90.py"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    pattern = (r"_mul_mat_vec_kernel (\w+) cols (\d+) split (\d+) residual (\d): regs (\d+) stack (\d+) shared (\d+) "
               r"programs/SM (\d+)")
    keys = ("qtype", "cols", "split", "residual", "regs", "stack", "shared", "programs")
    return [dict(zip(keys, (m[1], *map(int, m.groups()[1:])))) for m in re.finditer(pattern, r.stdout)]


def test_programs_per_sm_counts_registers_by_the_warp_and_shared_memory_by_the_block():
    assert programs_per_sm(128, 57344, 4) == 4
    assert programs_per_sm(130, 57344, 4) == 3    # 130 x 32 rounds up to 17 x 256 registers a warp
    assert programs_per_sm(128, 65536, 4) == 3    # Q5_K's shared memory: 3 blocks of 65 KB in 228 KB
    assert programs_per_sm(186, 49152, 4) == 2
    assert programs_per_sm(32, 0, 4) == 16        # 64 warps at most


@pytest.mark.slow
def test_q4_k_mat_vec_variants_hold_four_programs_an_sm():
    found = _launched()
    # the 9B's Q4_K tiles (K split 1, 2, 4, 8) and the residual form of two of them
    assert {(v["split"], v["residual"]) for v in found} == {(2, 0), (8, 0), (8, 1), (4, 0), (4, 1), (1, 0)}, found
    for v in found:
        assert v["qtype"] == "q4_k" and v["cols"] == 16, v
        assert v["programs"] >= 4, f"{v}: fewer than 4 programs an SM (the cap, triton_matvec.Q4_K_REGS)"
        assert v["stack"] <= SPILL_BYTES, f"{v}: the register cap now spills more than {SPILL_BYTES} bytes"
