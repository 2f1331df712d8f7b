"""Compile a call's Triton launches for sm_90 (the H100 / H200) on a machine without a GPU, each specialized exactly as
its launch would be (the arguments' pointer alignment and integer divisibility, the launch's options, programmatic
dependent launch on), and read each binary's registers, stack and shared memory: what decides how many programs an
SM holds. compile_sm90.py compiles every kernel with uniform hints, so its register counts are not the launch's
(130-138 there where the H100 ran 128); these are: on 2026-12-06 they matched the H100's counts of the four
quantized variants timed there (128, 130, 138, 186).

    PYTHONPATH=. python tests/kernels/launched_sm90.py     # the block types' mat-vec production variants, a JSON line each
    PYTHONPATH=. python tests/kernels/launched_sm90.py --epilogues   # the GDN computing its gates, a store's chain
    PYTHONPATH=. python tests/kernels/launched_sm90.py --sass q8_0 12288 4096 4   # one mat-vec's SASS opcodes, counted

Run by tests/kernels/test_occupancy.py in a subprocess without TRITON_INTERPRET (under it, @triton.jit builds
interpreter objects).
"""

import collections
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

SM90 = GPUTarget("cuda", 90, 32)
SM_REGISTERS, SM_SHARED, BLOCK_RESERVED = 65536, 233472, 1024  # an sm_90 SM's register file and shared memory
TRITON = "3.6"  # the version whose launch steps compile_launch repeats (JITFunction.run's, private API)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
# qwen3.5-9b's product shapes (M, K) compiled for each K-quant: gate/up, down, 4096 x 4096, the lm head; the residual
# form (MUL_MAT_ADD) of the two it takes (down, ssm_out)
SHAPES = ((12288, 4096), (4096, 12288), (4096, 4096), (248320, 4096))
RESIDUAL = ((4096, 12288), (4096, 4096))
MOE_DOWN = (8, 2048, 512)  # MUL_MAT_ID's Q4_K experts, rows, K: the 35B-A3B experts' down shape
HAND_OFFS = ((12288, 4096), (4096, 4096))  # Q8_0's hand-offs: the FFN pair's SwiGLU, the GDN's z chain
# what --epilogues reports of a launch
EPILOGUE_KEYS = ("N_T", "G_STEPS", "B_STEPS", "GATHER", "STEPS", "SPLIT_K", "GLU")


def programs_per_sm(regs: int, shared: int, warps: int) -> int:
    """How many programs of ``warps`` warps an sm_90 SM holds: registers (allocated 256 a warp at a time), shared
    memory (with the 1 KB the hardware reserves a block), at most 64 warps and 32 programs. Exact for programs of 4
    warps or a multiple (the mat-vec's); fewer may fit less, the register file being split in four quarters."""
    per_warp = math.ceil(regs * 32 / 256) * 256
    return min(SM_REGISTERS // (per_warp * warps), SM_SHARED // (shared + BLOCK_RESERVED), 64 // warps, 32)


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, stack bytes a thread: ptxas's spills) of a cubin, by cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return int(m[1]), int(m[2])


@contextlib.contextmanager
def compiled_as_launched(binaries: list | None = None):
    """Inside the block every Triton launch is compiled for sm_90 as it would be specialized, not run; yields the list
    that collects a (kernel name, constexprs, registers, stack bytes, shared bytes, warps) per launch (and
    ``binaries``, if given, each launch's compiled kernel: its ``asm``)."""
    backend, found, run = make_backend(SM90), [], JITFunction.run

    def compile_launch(self, *args, grid, warmup, **kwargs):  # JITFunction.run's own steps, up to the compile
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, spec, options = create_function_from_signature(self.signature, self.params, backend)(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, spec, options)
        k = triton_compile(ASTSource(self, signature, constexprs, attrs), target=SM90, options=options.__dict__)
        if binaries is not None:
            binaries.append(k)
        names = [p.name for p in self.params]
        found.append((self.__name__, {names[p[0]]: v for p, v in constexprs.items() if len(p) == 1},
                      *_resources(k.asm["cubin"]), k.metadata.shared, k.metadata.num_warps))

    JITFunction.run = compile_launch
    try:
        yield found
    finally:
        JITFunction.run = run


def epilogues() -> list[tuple[str, dict]]:
    """The kernels that run elementwise chain steps inside another kernel, compiled as launched: the GDN computing
    its gates (gdn_gates: a verify's unrolled tokens, a prompt's loop, gathering its state too), a product's store
    running the GDN's output gate (mul_mat_chain: the bf16 mat-vec, split) and the FFN pair's SwiGLU (pair_glu: the
    bf16 pair at 4 columns, unsplit, and 8, split). A launch specializes ints of 1 as constants, which
    compile_sm90.py's uniform hints do not: Triton 3.6 miscompiled the prompt loop's nested tuple of them
    (docs/performance.md, 2026-12-07, twelfth session). Returns (kernel name, constexprs) per launch."""
    _fake_sm90()
    from gdnpass.kernels import triton_matvec as mv
    from gdnpass.kernels import triton_ssm as ssm

    with compiled_as_launched() as found:
        for n_t, unrolled, gather in ((4, True, False), (20, False, False), (4, True, True)):
            S, H_v, n_s = 32, 2, 1  # (compiled, never run: zeros; q, k, v head views of one buffer, as in the graph)
            C = 2 * S + S * H_v
            qkv = torch.zeros(n_s * n_t * C)
            q, k, v = (qkv[off:].as_strided((n_s, n_t, h, S), (n_t * C, C, S, 1))
                       for off, h in ((0, 1), (S, 1), (2 * S, H_v)))
            state = torch.zeros(n_s, H_v, S, S)
            alpha, beta_x = torch.zeros(1, n_s, n_t, H_v), torch.zeros(n_s, n_t, H_v, 1)
            dt_bias, ssm_a = torch.zeros(1, 1, 1, H_v), torch.zeros(1, 1, 1, H_v)
            out = torch.empty(1, 1, n_t * n_s + 2 * S * n_s, S * H_v)
            ids = torch.zeros(n_s, dtype=torch.int32) if gather else None
            ssm.gated_delta_net(q, k, v, alpha, beta_x, state, 2, out, unrolled=unrolled, g_sides=(dt_bias, ssm_a),
                                g_steps=("ADD", "SOFTPLUS", "MUL"), beta_steps=("SIGMOID",), state_ids=ids)
        w = torch.empty(1, 1, 4096, 4096, dtype=torch.bfloat16)
        x, side, y = torch.zeros(1, 1, 4, 4096), torch.zeros(1, 1, 4, 4096), torch.empty(1, 1, 4, 4096)
        mv.mul_mat_vec_chain(w, x, ["SILU", "RMUL"], [side], y)
        w, w2 = (torch.empty(1, 1, 12288, 4096, dtype=torch.bfloat16) for _ in range(2))
        for n in (4, 8):
            mv.mul_mat_vec_pair_glu(w, w2, torch.zeros(1, 1, n, 4096), torch.empty(1, 1, n, 12288))
    return [(name, c) for name, c, *_ in found]


def sass_opcodes(qtype: str, M: int, K: int, N: int) -> collections.Counter:
    """The SASS opcodes (``LDG``, ``STS``, ``BAR``, ...; suffixes dropped) of one mat-vec launch of an M x K weight of
    ``qtype`` (a block type or bf16 / f16 / f32) at N columns, compiled for sm_90 as launched: what its loop does
    besides its loads (docs/performance.md, 2026-12-07, thirteenth session: Q8_0's quants moved through shared memory
    into the dot's operand layout)."""
    _fake_sm90()
    from gdnpass.ir import DType
    from gdnpass.kernels import triton_matvec as mv

    wt, binaries = DType.parse(qtype), []
    with compiled_as_launched(binaries):
        if wt.is_quantized:
            w = torch.empty(1, 1, M, wt.row_bytes(K), dtype=torch.uint8)  # (compiled, never read)
        else:
            w = torch.empty(1, 1, M, K, dtype={"bf16": torch.bfloat16, "f16": torch.float16}.get(qtype, torch.float32))
        mv.mul_mat_vec(w, torch.zeros(1, 1, N, K), torch.empty(1, 1, N, M), wt if wt.is_quantized else None)
    cubin = [k for k in binaries if k.name == "_mul_mat_vec_kernel"][-1].asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    opcode = r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)"  # after the address, past a predicate
    return collections.Counter(m.split(".")[0] for m in re.findall(opcode, sass))


def _fake_sm90() -> None:
    """The GPU the launches are compiled for, as gdnpass sees it when imported (programmatic dependent launch on)."""
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)


def main() -> int:
    if not triton.__version__.startswith(TRITON):
        raise SystemExit(f"launched_sm90.py: written against Triton {TRITON}'s launch steps, found {triton.__version__}")
    if sys.argv[1:2] == ["--sass"]:
        if len(sys.argv) != 6 or not all(v.isdigit() for v in sys.argv[3:]):
            raise SystemExit("usage: launched_sm90.py --sass WTYPE M K N (rows, K, columns; e.g. q8_0 12288 4096 4)")
        qtype, *mkn = sys.argv[2:]
        for op, n in sass_opcodes(qtype, *map(int, mkn)).most_common():
            print(f"{n:6d} {op}")
        return 0
    if sys.argv[1:] == ["--epilogues"]:
        for name, c in epilogues():
            print(json.dumps(dict(kernel=name, **{k: v for k, v in c.items() if k in EPILOGUE_KEYS})), flush=True)
        return 0
    _fake_sm90()
    from gdnpass.ir import DType
    from gdnpass.kernels import triton_matvec as mv

    shapes = []  # (M, K) of each mat-vec launch, in order
    with compiled_as_launched() as found:
        for qtype in ("q4_k", "q5_k", "q6_k", "q8_0"):
            wt = DType.parse(qtype)
            for M, K in SHAPES:
                w = torch.empty(1, 1, M, wt.row_bytes(K), dtype=torch.uint8)  # (compiled, never read)
                x, y = torch.zeros(1, 1, 4, K), torch.empty(1, 1, 4, M)
                mv.mul_mat_vec(w, x, y, wt)
                shapes.append((M, K))
                if (M, K) in RESIDUAL:
                    mv.mul_mat_vec_add(w, x, torch.zeros_like(y), y, wt)
                    shapes.append((M, K))
        q8_0 = DType.parse("q8_0")  # the Q8_0 products that hand their output on (gdnpass.prepasses' hand-off): the
        for M, K in HAND_OFFS:      # FFN pair's SwiGLU, the z chain's gated output
            w = torch.empty(1, 1, M, q8_0.row_bytes(K), dtype=torch.uint8)
            x, y = torch.zeros(1, 1, 4, K), torch.empty(1, 1, 4, M)
            if (M, K) == SHAPES[0]:
                mv.mul_mat_vec_pair_glu(w, w, x, y, dtype=q8_0, quantize="q8_1")
            else:
                mv.mul_mat_vec_chain(w, x, ["SILU", "RMUL"], [torch.zeros_like(y)], y, q8_0, quantize="q8_1")
            shapes.append((M, K))
        q4_k, (experts, M, K) = DType.parse("q4_k"), MOE_DOWN
        mv.mul_mat_id(torch.empty(1, experts, M, q4_k.row_bytes(K), dtype=torch.uint8), torch.zeros(1, 4, 2, K),
                      torch.zeros(1, 1, 4, 2, dtype=torch.int32), torch.empty(1, 4, 2, M), q4_k)
        shapes.append((M, K))
    launches = [f for f in found if f[0] == "_mul_mat_vec_kernel"]
    assert len(launches) == len(shapes), (len(launches), len(shapes))
    for (M, K), (name, c, regs, stack, shared, warps) in zip(shapes, launches):
        print(json.dumps(dict(qtype=c["QTYPE"], M=M, K=K, cols=c["COLS"], split=c["SPLIT_K"],
                              residual=c["STEPS"] == ("ADD",), hand_off=c.get("HAND_OFF", "") != "",
                              ids=c["IDS"], regs=regs, stack=stack, shared=shared,
                              programs=programs_per_sm(regs, shared, warps))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
