"""How many programs an SM holds is decided by registers and shared memory, which only the compiled binary knows; for
the quantized mat-vec it decides the time: a Q4_K form with 130 registers held 3 programs an SM where 128 held 4, and
its 512-program down projection ran 24% slower on the H100; the Q5_K and Q6_K caps paid too (docs/performance.md,
2026-12-06 and -07). Compiled on the CPU exactly as the launches specialize them
(launched_sm90.py), the block types' production variants with a register cap (tiles.QUANT_REGS), MUL_MAT_ADD's
residual form and MUL_MAT_ID's among them, must hold as many programs an SM as the cap was chosen for, at no more
spill than it was timed with."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernels.launched_sm90 import HAND_OFFS, MOE_DOWN, RESIDUAL, SHAPES, programs_per_sm  # (tests/: pythonpath)

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file: tests/kernels/)
PROGRAMS = {"q4_k": 4, "q5_k": 4, "q6_k": 4, "q8_0": 4}  # an SM's, at each type's cap (Q8_0: uncapped, tiles.Q8_0_WAVE)
SPILL_BYTES = {"q4_k": 0, "q5_k": 8, "q6_k": 0}  # ptxas's stack a thread at the cap (Q4_K's residual form spilled 8
# bytes before the pair's two products shared one code path, 2026-12-06; Q5_K's lm head 8 since the activations'
# padding columns are not read, 2026-12-07)


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
def test_capped_k_quant_mat_vecs_hold_their_programs_an_sm():
    from gdnpass.kernels.tiles import QUANT_MIN_COLS, QUANT_REGS, mat_vec_tile

    found = _launched()
    # each block type's tiles of the 9B (K split 1-16), the residual form of two of them, MUL_MAT_ID's (Q4_K, split 2)
    _, M_id, K_id = MOE_DOWN
    assert {(v["qtype"], v["M"], v["K"], v["residual"], v["ids"]) for v in found} == {
        *((q, M, K, False, False) for q in PROGRAMS for M, K in SHAPES),
        *((q, M, K, True, False) for q in PROGRAMS for M, K in RESIDUAL), ("q4_k", M_id, K_id, False, True)}, found
    capped = [v for v in found if mat_vec_tile(v["M"], 4, v["K"], v["qtype"]).regs]
    # every Q4_K and Q5_K variant; Q6_K's launches of more programs than Q6_K_CAPPED_PAST (the lm head, 12288 rows),
    # not those of fewer (4096 rows: 256), where the cap's spill was all it added
    assert {(v["qtype"], v["M"]) for v in capped} >= {("q4_k", 4096), ("q5_k", 4096), ("q6_k", 12288),
                                                       ("q6_k", 248320)}, capped
    assert ("q6_k", 4096) not in {(v["qtype"], v["M"]) for v in capped}, capped
    # Q8_0 (its rows held split): no cap, unspilled, and every split launch holds the programs an SM its one-wave
    # split counts on (tiles.Q8_0_WAVE); the lm head, unsplit, takes 3 (its scales carried a step ahead: 8% faster
    # than at 5, H100, nineteenth session)
    assert not [v for v in capped if v["qtype"] == "q8_0"], capped
    q8_0 = [v for v in found if v["qtype"] == "q8_0"]
    assert all(v["stack"] == 0 for v in q8_0), q8_0
    assert all(v["programs"] >= PROGRAMS["q8_0"] for v in q8_0 if v["split"] > 1), q8_0
    # and so do those that hand their output on (the epilogue reads its rows of y back: quantized from the registers
    # they held, the FFN pair took 130-132 registers, 3 programs an SM)
    assert len([v for v in q8_0 if v["hand_off"]]) == len(HAND_OFFS), q8_0
    for v in capped:
        # (4 tokens; MUL_MAT_ID's program takes any column of its chunk's 16)
        assert v["cols"] == (16 if v["ids"] else QUANT_MIN_COLS[v["qtype"]]) and v["regs"] <= QUANT_REGS[v["qtype"]], v
        assert v["programs"] >= PROGRAMS[v["qtype"]], f"{v}: fewer programs an SM than its cap was chosen for"
        assert v["stack"] <= SPILL_BYTES[v["qtype"]], f"{v}: the register cap now spills more ({v['stack']} bytes)"
