"""The llama.cpp build's variants and packed sources (gdnpass.frontends.llama.build), the worker's ``time`` mode
(upstream's verify decode timed on its own) and gdnpass.bench.upstream's readers of ncu output and kernel streams
(benchmarks/upstream.py's). The CUDA variant itself builds only where nvcc and CUDA's libraries are (the GPU host:
docs/performance.md)."""

import json

import pytest

from gdnpass.bench import upstream
from gdnpass.errors import LlamaError
from gdnpass.frontends.llama import build, capture


def test_packed_source_keeps_what_a_build_needs():
    keep = ["CMakeLists.txt", "ggml/src/ggml.c", "ggml/src/ggml-cpu/ops.cpp", "ggml/src/ggml-cuda/ssm-conv.cu",
            "ggml/src/ggml-alloc.c", "src/models/qwen35.cpp", "include/llama.h", "vendor/nlohmann/json.hpp",
            "common/common.cpp", "examples/speculative-simple/speculative-simple.cpp", "pocs/CMakeLists.txt"]
    drop = ["ggml/src/ggml-vulkan/ggml-vulkan.cpp", "ggml/src/ggml-metal/ggml-metal.m", "ggml/src/ggml-hip/x.txt",
            "tools/main/main.cpp", "tests/test-backend-ops.cpp"]
    assert [p for p in keep if not build.wanted(p)] == []
    assert [p for p in drop if build.wanted(p)] == []


def test_variants_are_cached_apart(tmp_path, monkeypatch):
    """Each variant has its own cache folder, and a folder holding another variant's build is not taken for it (a
    CPU build must never be timed as the GPU peer)."""
    monkeypatch.setenv("GDNPASS_CACHE", str(tmp_path))
    assert build.install_dir("cpu") != build.install_dir("cuda")
    root = build.install_dir("cuda")
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "libllama.so").write_bytes(b"")
    meta = {"commit": build.COMMIT, "layout": {}, "build_s": 1.0}
    (root / "install.json").write_text(json.dumps({**meta, "variant": "cpu"}))
    assert build.find("cuda") is None
    (root / "install.json").write_text(json.dumps({**meta, "variant": "cuda"}))
    assert build.find("cuda") is None  # a library-only build (before the speculative tool): built again
    (root / "bin").mkdir()
    (root / "bin" / build.SPECULATIVE_TOOL).write_bytes(b"")
    assert build.find("cuda") is None  # (its install.json does not list the tool among its targets)
    (root / "install.json").write_text(json.dumps({**meta, "variant": "cuda",
                                                   "targets": list(build.VARIANTS["cuda"].targets)}))
    assert build.find("cuda").variant == "cuda"
    assert build.find("cuda").tool(build.SPECULATIVE_TOOL) == root / "bin" / build.SPECULATIVE_TOOL
    with pytest.raises(LlamaError, match="unknown variant 'rocm'"):
        build.install_dir("rocm")


def test_cuda_variant_without_nvcc_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("GDNPASS_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", "/nonexistent")
    assert "nvcc" in build.toolchain_missing("cuda")
    with pytest.raises(LlamaError, match=r"^llama.cpp build \(cuda\): no cmake, cc, c\+\+, nvcc on PATH"):
        build.ensure(variant="cuda", source=tmp_path)


@pytest.mark.parametrize("what, match", [
    ("nothing", "has no COMMIT file"),
    ("other commit", "holds llama.cpp 0123456789ab, gdnpass is pinned to " + build.COMMIT[:12]),
    ("no sources", "lacks llama.cpp/CMakeLists.txt"),
])
def test_packed_source_refusals(tmp_path, what, match):
    src = tmp_path / "src"
    src.mkdir()
    if what != "nothing":
        (src / "COMMIT").write_text(("0123456789ab" * 4 if what == "other commit" else build.COMMIT) + "\n")
    with pytest.raises(LlamaError, match=match):
        build._packed(src)


def test_time_mode_on_the_cpu_build(llama, tmp_path):
    """The worker's ``time`` mode on the CPU build: every case gets its wall times, llama.cpp's resolved n_rs_seq,
    and the rollback of each step succeeds (a refusal would be an error); the DFlash taps are accepted."""
    from gdnpass.models.gguf_write import write_gguf

    path = write_gguf("tiny-qwen35", tmp_path / "tiny.gguf")
    r = capture.time_verify(path, [(3, 2), (1, 0)], n_ubatch=8, layer_inputs=[1, 2], reps=2, warmup=1,
                            install=llama)
    assert [(c["n_tokens"], c["n_rs_seq_resolved"], len(c["wall_s"])) for c in r["cases"]] == [(3, 2, 2), (1, 0, 2)]
    assert all(t > 0 for c in r["cases"] for t in c["wall_s"])
    for case in ((4, 7), (9, 0)):  # n_ubatch must exceed n_rs_seq + 1, and hold the verify (one ubatch)
        with pytest.raises(LlamaError, match=rf"case \(n_tokens {case[0]}, n_rs_seq {case[1]}\) does not fit n_ubatch"):
            capture.time_verify(path, [case], n_ubatch=8, install=llama)


NCU_CSV = '''==PROF== Connected to process 123
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","123","python3","h","void k_get_rows_float<float, float>(const T1 *, ...)","1","7","(256, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","3,104"
"1","123","python3","h","void mul_mat_vec_f<float, float, 4>(...)","1","7","(128, 1, 1)","(32, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","13.6"
'''


def test_parse_ncu_csv():
    assert upstream.parse_ncu_csv(NCU_CSV) == [("void k_get_rows_float<float, float>(const T1 *, ...)", 3.104),
                                               ("void mul_mat_vec_f<float, float, 4>(...)", 13.6)]


def layer(unfused: bool, rows: int = 2) -> list[tuple[str, float]]:
    """One GDN layer's kernel classes in llama.cpp's order (the qkv product before the CONCAT, the alpha / beta
    products after the q/k norms), durations chosen to identify the rows."""
    head = [("RMS_NORM", 100.0), ("MUL_MAT", 100.0)]  # attn_norm, and a product of the layer before the chain
    if unfused:
        chain = [("GET_ROWS", 1.0), ("MUL_MAT", 50.0), ("CONCAT", 2.0), *[("CPY", 3.0)] * rows, ("GET_ROWS", 4.0),
                 ("SSM_CONV", 5.0), ("SILU", 0.5), ("RMS_NORM", 6.0), ("SCALE", 0.25), ("RMS_NORM", 7.0),
                 ("SCALE", 0.25), ("MUL_MAT", 8.0), ("ADD", 0.125), ("MUL_MAT", 9.0), ("other", 0.25)]
    else:
        chain = [("MUL_MAT", 50.0), ("FUSED", 10.0), ("GET_ROWS", 4.0), ("PAIR", 12.0), ("ADD", 0.125), ("other", 0.25)]
    return head + chain + [("GDN", 20.0)]


@pytest.mark.parametrize("unfused", [True, False])
def test_chain_table_reads_each_gdn_layer(unfused):
    t = upstream.chain_table(layer(unfused) * 3 + [("MUL_MAT", 1000.0)])
    got = {k: (v["us"], v["kernels"]) for k, v in t.items() if k != "layers" and v["kernels"]}
    if unfused:
        assert got == {"GET_ROWS (conv state)": (1.0, 1), "CONCAT": (2.0, 1), "snapshot CPYs": (6.0, 2),
                       "in between (ssm-state GET_ROWS)": (4.0, 1), "SSM_CONV (+SILU)": (5.5, 2),
                       "q norm": (6.25, 2), "k norm": (7.25, 2), "alpha, beta products": (17.0, 2),
                       "alpha/beta epilogue (ADD, SOFTPLUS, MUL, SIGMOID)": (0.375, 2), "GATED_DELTA_NET": (20.0, 1),
                       "chain total": (69.375, 16)}
    else:
        assert got == {"fused chain": (10.0, 1), "in between (ssm-state GET_ROWS)": (4.0, 1),
                       "alpha, beta products": (12.0, 1),
                       "alpha/beta epilogue (ADD, SOFTPLUS, MUL, SIGMOID)": (0.375, 2), "GATED_DELTA_NET": (20.0, 1),
                       "chain total": (46.375, 6)}
    assert t["layers"] == 3
    assert upstream.chain_table([("MUL_MAT", 1.0)]) == {"layers": 0}


def test_kernel_class_of_ggml_cuda_names():
    """The kernel names of upstream's recorded ncu run (docs/performance.md), demangled as ncu prints them."""
    names = {"void k_get_rows_float<float, float>(const float *, const int *, float *, long, long)": "GET_ROWS",
             "void k_get_rows_float_vec<float, float>(...)": "GET_ROWS", "void concat_non_cont(...)": "CONCAT",
             "void cpy_scalar<&cpy_1_scalar<float, float>>(...)": "CPY", "void ssm_conv_f32<true, 4>(...)": "SSM_CONV",
             "void rms_norm_f32<1024, true, false>(...)": "RMS_NORM", "void mul_mat_f<float, 4, 8>(...)": "MUL_MAT",
             "void gated_delta_net_cuda<128, true>(...)": "GDN", "void k_bin_bcast<&op_add, float>(...)": "other",
             "void unary_gated_op_kernel<&op_silu, float>(...)": "GLU", "void unary_op_kernel<&op_silu>(...)": "SILU"}
    assert {n: upstream.kernel_class(n) for n in names} == names
