"""Compile every Triton kernel for sm_90 (the H200) ahead of time, without a GPU: the interpreter accepts programs
the compiler rejects (e.g. a variable re-typed inside an ``if``), so CI compiles them too. Run by
tests/kernels/test_compile.py in a subprocess without TRITON_INTERPRET (under it, @triton.jit builds interpreter
objects).
Every kernel of gdnpass.kernels' modules and of the registered patterns' own kernel modules (the ``_*_kernel``
functions, found there: :func:`launched_kernels`) must have a variant, below or in its pattern module's
``variants()``, or the run fails before compiling.

    PYTHONPATH=. python tests/kernels/compile_sm90.py     # one line per compiled variant, exit 1 on the first failure

(``PYTHONPATH=.``, or gdnpass installed: ``pip install -e .``.)
"""

import importlib
import itertools
import pkgutil
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import KernelInterface

from gdnpass.bench.matvec import product_shapes
from gdnpass.ir import HELD_SPLIT
from gdnpass.kernels import triton_attention as att
from gdnpass.kernels import triton_core as core
from gdnpass.kernels import triton_elementwise as elt
from gdnpass.kernels import triton_matvec as mv
from gdnpass.kernels import triton_norms as norms
from gdnpass.kernels import triton_rope as rope
from gdnpass.kernels import triton_sort as sort
from gdnpass.kernels import triton_ssm as ssm

INT_PTRS = {"ids_ptr", "table_ptr", "pos_ptr", "cnt_ptr"}
TUPLES = {"P": core.CHAIN_ARGS, "G": core.CHAIN_ARGS, "B": core.CHAIN_ARGS}  # tuple arguments: what
#                                                          triton_core.chain_args passes (an elementwise chain)
FLOATS = {"eps", "scale", "bias", "theta_scale", "freq_scale", "ext_factor", "corr0", "corr_den", "mscale",
          "softcap", "lo", "hi"}


SM90_SHARED = 232448  # bytes of shared memory one program may have on sm_90 (227 KiB): more compiles, fails at launch


def compile_sm90(kernel, constexprs: dict, num_warps: int = core.NUM_WARPS, ptrs: dict | None = None,
                 options: dict | None = None):
    """One variant: pointers f32 (i32 for indices; ``ptrs`` overrides by name), ``eps``/``scale`` f32, other scalars
    i32; ``options`` adds launch options (num_stages, maxnreg) as the launcher passes them. Refuses a variant that
    needs more shared memory than an sm_90 program may have."""
    def kind(name):
        if name in constexprs:
            return "constexpr"
        if name in TUPLES:
            return TUPLES[name]
        if name.endswith("_ptr"):
            return (ptrs or {}).get(name) or ("*i32" if name in INT_PTRS else "*fp32")
        return "fp32" if name in FLOATS else "i32"
    sig = {n: kind(n) for n in kernel.arg_names}
    # every pointer and integer 16-divisible, as a launch on aligned buffers and shapes finds them: Triton then
    # pipelines loads through shared memory, so the shared memory checked is the launch's (without the hints it
    # compiled 64 x 64 x 128-tile GEMMs in 64 KB that asked for 256 KB at launch, over sm_90's 227)
    def leaves(path, ty):  # (a tuple argument's elements by their paths)
        return [p for j, t in enumerate(ty) for p in leaves((*path, j), t)] if isinstance(ty, tuple) else [(path, ty)]
    aligned = {path: [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
               for path, ty in leaves((i,), sig[n]) if ty not in ("constexpr", "fp32")}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=aligned)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={**core.LAUNCH, "num_warps": num_warps, **(options or {})})
    if k.metadata.shared > SM90_SHARED:
        raise RuntimeError(f"{kernel.__name__} {constexprs}: {k.metadata.shared} bytes of shared memory, over sm_90's "
                           f"{SM90_SHARED}")
    return k


EPILOGUES = (("ADD",), ("SILU", "RMUL"))  # MUL_MAT_ADD's residual, MUL_MAT_CHAIN's Qwen3.5 output gate


def _epilogue(steps: tuple) -> dict:
    """A product's epilogue constexprs (triton_matvec.Epilogue.args)."""
    return dict(STEPS=steps, SIDES=core.chain_sides(list(steps)))


def variants():
    # a quantized product's pre-passes: the activations as int8 groups (the workspace: bytes, then scales and sums)
    for form in ("q8_1", "q8_K"):
        yield (mv._quantize_x_kernel, dict(FORM=form), core.NUM_WARPS, dict(ws_ptr="*u8"))
    for n_t in (8, 0):  # unrolled (a verify) and looped (a prompt)
        yield ssm._ssm_conv_kernel, dict(D_CONV=4, BLOCK_C=ssm.CONV_BLOCK_C, N_T=n_t), core.NUM_WARPS
    for kind in elt.UNARY_KINDS:
        yield elt._unary_kernel, dict(KIND=kind, BLOCK=elt.ELT_BLOCK), core.NUM_WARPS
    yield elt._swiglu_kernel, dict(BLOCK=elt.ELT_BLOCK), core.NUM_WARPS
    for form in ("q8_1", "q8_K"):
        yield elt._swiglu_quantizing_kernel, dict(FORM=form), core.NUM_WARPS, dict(ws_ptr="*u8")
    for op in elt.BINARY_OPS:
        yield elt._binary_kernel, dict(OP=op, BLOCK=elt.ELT_BLOCK), core.NUM_WARPS
    # the expert FFN's router: CLAMP, SUM_ROWS, ARGSORT of the models' rows (8, 256 and 512 experts; 16 tokens)
    yield elt._clamp_kernel, dict(BLOCK=elt.ELT_BLOCK), core.NUM_WARPS
    yield norms._sum_rows_kernel, dict(BLOCK_R=norms.SUM_ROWS_BLOCK), core.NUM_WARPS
    for n_expert in (8, 256, 512, 1024):
        block_r, block_n = sort.sort_tile(n_expert, 16)
        for desc in (False, True):
            yield (sort._argsort_kernel, dict(BLOCK_R=block_r, BLOCK_N=block_n, DESC=desc), core.NUM_WARPS,
                   dict(y_ptr="*i32"))
    # the data-movement kernels move bits: int views (see triton_elementwise._bits)
    for dim in range(4):
        yield (elt._concat_kernel, dict(DIM=dim, BLOCK=elt.ELT_BLOCK), core.NUM_WARPS,
               dict(a_ptr="*i32", b_ptr="*i32", y_ptr="*i32"))
    for mode, x, y in (("bits", "*i32", "*i32"), ("bits", "*i16", "*i16"), ("f16", "*fp32", "*i16"),
                       ("bf16", "*fp32", "*i16"), ("i32", "*fp32", "*i32")):
        yield elt._cpy_kernel, dict(MODE=mode, BLOCK=elt.ELT_BLOCK), core.NUM_WARPS, dict(x_ptr=x, y_ptr=y)
    for src, a in (("f32", "*i32"), ("i32", "*i32"), ("f16", "*fp16"), ("bf16", "*i16")):
        yield (elt._get_rows_kernel, dict(SRC=src, BLOCK=elt.ELT_BLOCK), core.NUM_WARPS,
               dict(a_ptr=a, ids_ptr="*i32", y_ptr="*i32"))
    for qtype in core.QTYPES.values():  # GET_ROWS of quantized rows (token embeddings)
        yield (elt._get_rows_q_kernel, dict(NS=elt.ROWS_NS, QTYPE=qtype), core.NUM_WARPS,
               dict(a_ptr="*u8", ids_ptr="*i32", y_ptr="*fp32"))
    yield norms._row_norm_kernel, dict(zip(("BLOCK_R", "BLOCK_D"), norms.l2_tile(128)), RMS=False), core.NUM_WARPS
    for S in (32, 128):  # the q/k head sizes of the tiny and the real models
        yield norms._row_norm_kernel, dict(zip(("BLOCK_R", "BLOCK_D"), norms.l2_tile(S)), RMS=True), core.NUM_WARPS
    for has_bias in (False, True):
        yield elt._scale_kernel, dict(HAS_BIAS=has_bias, BLOCK=elt.ELT_BLOCK), core.NUM_WARPS
    for steps in (("ADD", "SOFTPLUS", "MUL"), ("SILU", "RMUL"), ("SIGMOID", "RMUL")):  # Qwen3.5's elementwise chains
        yield (elt._chain_kernel, dict(STEPS=steps, SIDES=core.chain_sides(list(steps)), BLOCK=elt.ELT_BLOCK),
               core.NUM_WARPS)
    # the mat-vec: every tile the models' products take at 1-16 columns (qwen3.5-9b's and -27b's shapes, every
    # weight type: a tile over sm_90's shared memory fails only at launch), and split-K tiles of both forms (the
    # split reads a workspace and its tickets; an unsplit launch passes None for them)
    split = [(mv.mat_vec_tile(4096, 4, 4096, "f32")._replace(split_k=4), "f32"),  # (an FMA tile, split)
             (mv.mat_vec_tile(248320, 16, 4096, "bf16"), "bf16"),  # unsplit tensor-core tiles: the lm head's,
             (mv.mat_vec_tile(12288, 16, 4096, "f32"), "f32")]      # f32's from 12288 rows
    shapes = {(M, K) for model in ("qwen3.5-9b", "qwen3.5-27b") for M, K, *_ in product_shapes(model)}
    tiles = {(mv.mat_vec_tile(M, N, K, wt), wt) for (M, K), N, wt in
             itertools.product(shapes, range(1, 17), ("bf16", "f16", "f32", "q4_k"))}
    # the other block types: each form once (their tiles differ in rows and K slices only; the decoders differ)
    tiles |= {(mv.mat_vec_tile(M, N, 4096, wt), wt) for (M, N), wt in
              itertools.product(((32, 1), (32, 8), (4096, 1), (4096, 4), (4096, 16), (4096, 32), (12288, 32),
                                 (248320, 32)), core.QTYPES.values())}
    # (MUL_MAT_ADD's residual store and MUL_MAT_CHAIN's SiLU-gate chain: on the split tiles, both forms; the FFN
    # pair's SwiGLU, pair_glu, the workspace at every split: the models' gate / up tiles, plain types)
    ffn = {(p.M, p.K) for model in ("qwen3.5-9b", "qwen3.5-27b") for p in product_shapes(model)
           if "ffn_gate" in p.names}
    glu = sorted({(mv.mat_vec_tile(M, N, K, wt, 2), wt) for (M, K), N, wt in
                  itertools.product(ffn, range(1, 17), ("bf16", "f16", "f32"))})
    # (Q8_0's products handing their output on as q8_1, the next product's activations: the FFN pair's SwiGLU at the
    # models' gate / up tiles, the GDN's z chain at their z tiles)
    z = {(p.M, p.K) for model in ("qwen3.5-9b", "qwen3.5-27b") for p in product_shapes(model) if "attn_gate" in p.names}
    hand = sorted({((t, "q8_0"), (), 1) for (M, K), N in itertools.product(ffn, range(1, 17))
                   if mv.tiles.hands_on_q8_1(t := mv.mat_vec_tile(M, N, K, "q8_0", 2))}
                  | {((t, "q8_0"), EPILOGUES[1], 0) for (M, K), N in itertools.product(z, range(1, 17))
                     if mv.tiles.hands_on_q8_1(t := mv.mat_vec_tile(M, N, K, "q8_0"))})
    # (the held-split types' rows at the models' K, on 16 bytes, take the aligned form; the 16-bit form once each:
    # mv.aligned_rows)
    held = {t.label for t in HELD_SPLIT}
    for (t, wt), steps, g, aligned, hands in ([(tw, (), 0, tw[1] in held, False) for tw in sorted(tiles) + split]
                                              + [(tw, s, 0, False, False) for tw in split for s in EPILOGUES]
                                              + [(tw, (), 1, False, False) for tw in glu]
                                              + [(tw, s, g, True, True) for tw, s, g in hand]
                                              + [((mv.mat_vec_tile(4096, 4, 4096, h), h), (), 0, False, False)
                                                 for h in sorted(held)]):
        ptr = {"bf16": "*bf16", "f16": "*fp16", "f32": "*fp32"}.get(wt, "*u8")  # (a quantized weight: bytes)
        x_ptr = "*u8" if ptr == "*u8" else "*fp32"  # (a quantized product reads the activation workspace)
        c = dict(BLOCK_M=t.block_m, COLS=t.cols, BLOCK_K=t.block_k, DOT=t.dot, SPLIT_K=t.split_k, EVICT=t.evict,
                 QTYPE=wt if ptr == "*u8" else "", IDS=False, ids_ptr=None, EARLY=t.early, ALIGNED=aligned, GLU=g,
                 HAND_OFF="q8_1" if hands else "", **({} if hands else {"hand_ptr": None}), **_epilogue(steps))
        yield (mv._mul_mat_vec_kernel, c if t.split_k > 1 or g else {**c, "ws_ptr": None, "cnt_ptr": None}, t.warps,
               dict(w_ptr=ptr, w2_ptr=ptr, x_ptr=x_ptr, **({"hand_ptr": "*u8"} if hands else {})), t.options())
    # the GEMM (MUL_MAT of over 16 columns, f16 / bf16 weights): every tile gemm_tile gives the models' products at
    # 17-1024 columns (several sequences' verify, a prompt's ubatch)
    gemm = {(mv.gemm_tile(M, N, K, wt), wt) for (M, K), N, wt in
            itertools.product(shapes, (17, 32, 33, 128, 1024), mv.GEMM_WEIGHTS)}
    for (t, wt), (steps, pair) in itertools.product(sorted(gemm), [((), False), *((s, False) for s in EPILOGUES),
                                                                   ((), True)]):
        ptr = {"bf16": "*bf16", "f16": "*fp16"}[wt]  # (steps: MUL_MAT_ADD's, MUL_MAT_CHAIN's; pair: MUL_MAT_VEC_PAIR's)
        c = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT_K=t.split_k, PAIR=pair,
                 **_epilogue(steps))  # (bf16 reads x's bf16 terms; an unsplit launch passes None for the workspace)
        yield (mv._gemm_kernel, c if t.split_k > 1 else {**c, "ws_ptr": None, "cnt_ptr": None}, t.warps,
               dict(w_ptr=ptr, w2_ptr=ptr, x_ptr="*bf16" if wt == "bf16" else "*fp32"), dict(num_stages=t.stages))
    yield mv._gemm_terms_kernel, dict(BLOCK=mv.GEMM_TERMS_BLOCK), core.NUM_WARPS, dict(t_ptr="*bf16")
    # MUL_MAT_ID (one column a slot and token, its expert's matrix from the ids): the 35B-A3B experts' shapes, plain
    # and quantized (a quantized one reads its column of the pre-pass's chunks)
    for (M, K), wt in itertools.product(((512, 2048), (2048, 512)), ("bf16", "f32", *core.QTYPES.values())):
        t = mv.mul_mat_id_tile(M, K, wt, 16)
        ptr = {"bf16": "*bf16", "f32": "*fp32"}.get(wt, "*u8")
        c = dict(BLOCK_M=t.block_m, COLS=t.cols, BLOCK_K=t.block_k, DOT=t.dot, SPLIT_K=t.split_k, EVICT=t.evict,
                 STEPS=(), SIDES=(), QTYPE=wt if ptr == "*u8" else "", IDS=True, EARLY=t.early,
                 ALIGNED=wt in held, GLU=0, HAND_OFF="", hand_ptr=None)
        yield (mv._mul_mat_vec_kernel, c if t.split_k > 1 else {**c, "ws_ptr": None, "cnt_ptr": None}, t.warps,
               dict(w_ptr=ptr, w2_ptr=ptr, ids_ptr="*i32", x_ptr="*u8" if ptr == "*u8" else "*fp32"), t.options())
    # GATED_DELTA_NET unrolled (a verify) and looped (a prompt), reading its gates; and computing Qwen3.5's (the
    # gdn_gates pattern: the decay's chain, beta's SIGMOID); a decay per key row
    plain, qwen = dict(G_STEPS=(), G_SIDES=(), G_FLAT=False, B_STEPS=(), B_SIDES=(), B_FLAT=False), dict(
        G_STEPS=("ADD", "SOFTPLUS", "MUL"), G_SIDES=(1, 0, 2), G_FLAT=True, B_STEPS=("SIGMOID",), B_SIDES=(0,),
        B_FLAT=False)
    # (and its state gathered from the cache rows: gdn_state_gather)
    for n_t, gates, row, gather in ((8, plain, 0, False), (0, plain, 0, False), (8, qwen, 0, False),
                                    (0, qwen, 0, False), (4, plain, 1, False), (8, qwen, 0, True)):
        yield (ssm._gdn_kernel, dict(S=128, BLOCK_S=128, BLOCK_V=ssm.GDN_BLOCK_V, N_T=n_t, G_ROW=row, GATHER=gather,
                                     **gates), ssm.GDN_WARPS)
    # ROPE: qwen3.5's IMROPE (64 of 256 rotated, f32), and NORMAL with YaRN and freq factors into f16
    for norm, mrope, ff, yarn, y in ((False, True, False, False, "*fp32"), (True, False, True, True, "*fp16")):
        yield (rope._rope_kernel, dict(N_DIMS=64, N_OFFS=0, NORMAL=norm, MROPE=mrope, IMROPE=mrope, S0=11, S1=11, S2=10,
                                       S3=0, HAS_FF=ff, YARN=yarn, BLOCK_H=rope.ROPE_HEADS, HALF_B=32, BLOCK_D=256),
               core.NUM_WARPS, dict(y_ptr=y))
    # SET_ROWS: f32 rows into the F16 KV cache at i64 cells (as bits), and f32 into f32 at i32 ids
    for mode, ids, y in (("f16", "*i64", "*i16"), ("bits", "*i32", "*i32")):
        yield (elt._set_rows_kernel, dict(MODE=mode, BLOCK=256), core.NUM_WARPS,
               dict(r_ptr="*fp32" if mode == "f16" else "*i32", ids_ptr=ids, y_ptr=y))
    # attention: qwen3.5's heads (256, f16 KV cache) and narrower ones with every option; SOFT_MAX's tiles
    # (split over the KV as a verify's launch is, 4 slices, or not: a prompt's many row blocks)
    for D, kv, on, split in ((256, "*fp16", False, 4), (256, "*fp16", False, 1), (128, "*bf16", True, 4),
                             (64, "*fp32", True, 1), (512, "*fp16", False, 4)):
        block_n, warps, stages = att.fa_tile(D, D, 4 if kv == "*fp32" else 2)
        c = dict(HAS_MASK=True, HAS_SINKS=on, ALIBI=on, SOFTCAP=on, BLOCK_M=att.FA_BLOCK_M, BLOCK_N=block_n,
                 BLOCK_DK=att.fa_block_d(D), BLOCK_DV=att.fa_block_d(D), SPLIT=split)
        yield (att._flash_attn_kernel, c if split > 1 else {**c, "ws_ptr": None, "cnt_ptr": None}, warps,
               dict(k_ptr=kv, v_ptr=kv, mask_ptr="*fp16"), dict(num_stages=stages))
    for ne0, mask, on in ((256, "*fp16", False), (4096, "*fp32", True), (48, "*fp16", True)):
        block_r, block_c = att.soft_max_tile(ne0)
        yield (att._soft_max_kernel, dict(HAS_MASK=True, HAS_SINKS=on, ALIBI=on, BLOCK_R=block_r, BLOCK_C=block_c),
               core.NUM_WARPS, dict(mask_ptr=mask))
    # the fused chain: llama.cpp's rows at 1, 8 and 16 tokens, windows of any strides, the dedup tile; both q/k forms;
    # one sequence, 3 (a head a program) and 128 (a head over 16 or 32 programs, their tickets)
    for n_s, n_t, rows, tile, whole, rms in ((1, 1, 1, 0, True, True), (1, 8, 8, 0, True, True),
                                             (1, 16, 16, 0, True, False), (1, 3, 2, 0, False, True),
                                             (1, 8, 1, 10, True, False), (1, 8, 8, 0, True, False),
                                             (3, 4, 4, 0, True, True), (128, 8, 8, 0, True, True),
                                             (128, 8, 8, 0, True, False), (128, 16, 16, 0, True, True),
                                             (128, 8, 1, 10, True, True)):
        columns = tuple(max(0, n_t - s) for s in range(rows - 1, -1, -1))
        shape, warps = ssm.chain_launch(n_t, 128, n_seqs=n_s)
        yield ssm._gdn_conv_chain_kernel, dict(
            D_CONV=4, S=128, N_T=n_t, COLUMNS=columns, TILE_C0=0, TILE_N=tile, WHOLE_ROWS=whole, RMS=rms, **shape,
            **({"cnt_ptr": None} if shape["BLOCK_C"] == 128 else {})), warps


def kernel_modules() -> list:
    """The modules that define kernels: every module of gdnpass.kernels, and the module of each registered
    pattern's launcher that lives in its folder (gdnpass/patterns/<name>/kernel.py)."""
    import gdnpass.kernels as package
    from gdnpass.patterns import REGISTRY

    names = [f"{package.__name__}.{info.name}" for info in pkgutil.iter_modules(package.__path__)]
    names += [m for m in (p.kernel.rsplit(".", 1)[0] for p in REGISTRY) if m not in names]
    return [importlib.import_module(m) for m in names]


def pattern_variants():
    """The variants a pattern's own kernel module lists (its ``variants()``)."""
    for module in kernel_modules():
        if not module.__name__.startswith("gdnpass.kernels.") and hasattr(module, "variants"):
            yield from module.variants()


def launched_kernels() -> dict[str, KernelInterface]:
    """Every kernel the launchers launch, by ``module.name``: the ``@triton.jit`` functions named ``_*_kernel``
    defined in :func:`kernel_modules` (the helpers they call compile inside them), found by import."""
    found = {}
    for module in kernel_modules():
        short = module.__name__.removeprefix("gdnpass.kernels.").removeprefix("gdnpass.patterns.")
        for name, value in vars(module).items():
            if (isinstance(value, KernelInterface) and name.startswith("_") and name.endswith("_kernel")
                    and value.fn.__module__ == module.__name__):
                found[f"{short}.{name}"] = value
    return found


def uncovered(todo) -> list[str]:
    """The launched kernels no variant of ``todo`` compiles."""
    compiled = [kernel for kernel, *_ in todo]
    return sorted(name for name, k in launched_kernels().items() if not any(k is c for c in compiled))


@triton.jit
def _retyped_in_if(x_ptr, n):
    """Runs under the interpreter, is refused by the compiler: ``t`` is a constexpr before the ``if``, a tensor in it."""
    t = 0
    if n > 0:
        t = tl.arange(0, 4)
    tl.store(x_ptr + t, 1.0)


def main() -> int:
    if sys.argv[1:] == ["--negative-control"]:  # the check must be able to fail: a kernel the compiler refuses, and
        # flash attention's f32-K/V tile with 3 pipeline stages (the launcher gives it 1), over the shared memory
        block_n, warps, _ = att.fa_tile(128, 128, 4)
        bad = [(_retyped_in_if, {}, core.NUM_WARPS),
               (att._flash_attn_kernel, dict(HAS_MASK=True, HAS_SINKS=False, ALIBI=False, SOFTCAP=False,
                                             BLOCK_M=att.FA_BLOCK_M, BLOCK_N=block_n, BLOCK_DK=128, BLOCK_DV=128,
                                             SPLIT=1, ws_ptr=None, cnt_ptr=None),
                warps, dict(k_ptr="*fp32", v_ptr="*fp32", mask_ptr="*fp16"), dict(num_stages=3))]
        for kernel, *args in bad:
            try:
                compile_sm90(kernel, *args)
            except Exception as e:  # noqa: BLE001 (triton raises CompilationError subclasses of several kinds)
                print(f"refused as expected: {kernel.__name__}: {type(e).__name__}")
                continue
            return 1
        # and a kernel left out of the variants is named
        missing = uncovered([v for v in (*variants(), *pattern_variants()) if v[0] is not ssm._ssm_conv_kernel])
        if missing != ["triton_ssm._ssm_conv_kernel"]:
            return 1
        print(f"refused as expected: {missing[0]}: no variant")
        return 0
    todo = [*variants(), *pattern_variants()]
    missing = uncovered(todo)
    if missing:
        raise SystemExit(f"kernels without a variant to compile: {', '.join(missing)}")
    print(f"{len(launched_kernels())} kernels found in gdnpass.kernels and the patterns, each with a variant",
          flush=True)
    for kernel, constexprs, num_warps, *ptrs in todo:
        missing = [kernel.arg_names[i] for i in kernel.constexprs if kernel.arg_names[i] not in constexprs]
        if missing:  # a constexpr left out compiles as a plain argument: the check would test another kernel
            raise SystemExit(f"{kernel.__name__}: constexprs {missing} not given")
        compile_sm90(kernel, constexprs, num_warps, *ptrs)
        print(f"sm_90 ok: {kernel.__name__} {constexprs}", flush=True)
    print(f"compiled {len(todo)} variants")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
