"""Upstream llama.cpp's own verify decode on this GPU, the peer of our whole forward (benchmarks/upstream.py, and
``benchmarks/bench.py --only whole,upstream``): the pinned tree built with ggml-cuda for sm_90 and the model file
written when missing (:func:`prepare`); per verify width, every kernel of one decode and its duration under ncu, and
the wall time per decode with ggml-cuda's CUDA graphs on (:func:`measure`); the per-GDN-layer chain table
(:func:`chain_table`) both sides' kernels are read into, and the kernels grouped by name (:func:`kernel_totals`).
Imports no torch (torch cannot share the process with ggml-cuda)."""

from __future__ import annotations

import csv
import glob
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from gdnpass.frontends.llama import build, capture
from gdnpass.models.hparams import ModelShape, dflash_target_layers, get_model

CASES = ((4, 4), (8, 8))   # (T, rows): the widths bench.py's forward sections measure
N_PROMPT = 16              # tokens before the first verify (bench.py's forward has the same n_past)
N_CTX = 256                # llama.cpp pads n_ctx to 256; bench.py's whole forward has kv_size = n_kv = 256
_UNITS_NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9}


def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def model_label(model: str | ModelShape) -> str:
    """A preset's name, with its layer count where it is the preset's first layers ("qwen3.5-35b-a3b-8l")."""
    shape = get_model(model)
    return shape.name if shape.n_layer == get_model(shape.name).n_layer else f"{shape.name}-{shape.n_layer}l"


def default_gguf(model: str | ModelShape) -> Path:
    """Where the benchmark model is written: /dev/shm when it has room (a load from memory), else the temp dir."""
    shm = Path("/dev/shm")
    need = 20 << 30 if get_model(model).n_embd >= 4096 else 1 << 30
    base = shm if shm.is_dir() and shutil.disk_usage(shm).free > need else Path(tempfile.gettempdir())
    return base / f"gdnpass-{model_label(model)}-bf16.gguf"


def prepare(model: str | ModelShape, source: str | None, gguf: str | None, say=print,
            quantize: str | None = None) -> tuple[build.Install, Path]:
    """The CUDA build and the model file (each made when missing); ``quantize`` (a mix: q4_k_m, q8_0, ...): that
    file quantized by llama.cpp's own quantizer, next to it (made when missing)."""
    from gdnpass.models.gguf_write import write_gguf

    install = build.ensure(log=lambda line: say(f"[llama-build] {line}"), variant="cuda", source=source)
    path = Path(gguf) if gguf else default_gguf(model)
    if not path.is_file():
        say(f"[gguf] writing {model_label(model)} (bf16 projections, f32 alpha/beta) to {path}")
        write_gguf(model, path, wtype="bf16", ab_wtype="f32", workers=min(16, os.cpu_count() or 1))
    if quantize:
        from gdnpass.frontends.llama.quantize import quantize as llama_quantize

        dst = path.with_name(f"{path.stem}-{quantize}.gguf")
        if not dst.is_file():
            say(f"[gguf] quantizing {path.name} to {quantize} (llama.cpp's quantizer)")
            res = llama_quantize(path, dst, quantize, install=install, threads=min(16, os.cpu_count() or 1))
            say("[gguf] " + ", ".join(res.summary_lines()))
        path = dst
    return install, path


def layer_inputs(model: str | ModelShape) -> list[int]:
    """The layers whose *inputs* llama.cpp outputs for a DFlash drafter (bench.py's taps): target layer l -> l + 1."""
    return [l + 1 for l in dflash_target_layers(get_model(model).n_layer)]


class NcuError(SystemExit):
    """ncu output this script cannot read: one line naming the log and the kernel (no traceback)."""

    def __init__(self, msg: str) -> None:
        super().__init__(f"upstream.py: {msg}")


def parse_ncu_csv(text: str, where: str = "ncu output") -> list[tuple[str, float]]:
    """(kernel name, duration in µs) per profiled kernel, in launch order, from ``ncu --csv`` output."""
    lines = [x for x in text.splitlines() if x.startswith('"')]
    out = []
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name, unit, raw = row.get("Kernel Name", "?"), row.get("Metric Unit", ""), row.get("Metric Value", "")
        if unit not in _UNITS_NS:
            raise NcuError(f"{where}: kernel {name[:60]!r} has a duration in {unit!r}, not a time unit")
        try:
            value = float(raw.replace(",", ""))
        except ValueError:
            raise NcuError(f"{where}: kernel {name[:60]!r} has no duration ({raw!r})") from None
        out.append((name, value * _UNITS_NS[unit] / 1e3))
    return out


def ncu_kernels(install: build.Install, gguf: Path, T: int, rows: int, taps: list[int], ncu: str) -> list:
    """Every kernel of one verify decode of width T with ``rows`` snapshot rows, and its duration (µs)."""
    with tempfile.TemporaryDirectory(prefix="gdnpass-ncu-") as tmp:
        log = Path(tmp, "ncu.csv")
        # clocks and caches as the program leaves them: ncu's default flushes the caches before every kernel, which
        # made upstream's kernels sum to more than its own wall time per decode (2026-12-01 evening, first run)
        prefix = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "none",
                  "--metrics", "gpu__time_duration.sum", "--csv", "--print-units", "base", "--log-file", str(log)]
        capture.time_verify(gguf, [(T, rows - 1)], n_prompt=N_PROMPT, n_ctx=N_CTX, layer_inputs=taps, reps=0,
                            warmup=2, profile=True, prefix=prefix, env={"GGML_CUDA_DISABLE_GRAPHS": "1"},
                            install=install, timeout_s=480)
        text = log.read_text() if log.exists() else ""
        kernels = parse_ncu_csv(text, f"ncu's log of the T={T} decode")
    if not kernels:
        tail = next((x for x in reversed(text.splitlines()) if x.startswith("==")), "no ncu message")
        raise NcuError(f"ncu profiled no kernel of the T={T} verify decode ({tail[:200]})")
    return kernels


def kernel_class(name: str) -> str:
    """A ggml-cuda kernel's op class, from its (demangled) name: the classes :func:`chain_table` reads."""
    n = name.lower()
    for key, cls in (("gated_delta_net", "GDN"), ("ssm_conv", "SSM_CONV"), ("concat", "CONCAT"),
                     ("get_rows", "GET_ROWS"), ("rms_norm", "RMS_NORM"), ("l2_norm", "L2_NORM"), ("cpy", "CPY"),
                     ("mul_mat", "MUL_MAT"), ("gemm", "MUL_MAT"), ("gemv", "MUL_MAT"), ("unary_gated", "GLU"),
                     ("scale_f32", "SCALE"), ("silu", "SILU")):
        if key in n:
            return cls
    return "other"


CHAIN_ROWS = ("GET_ROWS (conv state)", "CONCAT", "snapshot CPYs", "in between (ssm-state GET_ROWS)",
              "SSM_CONV (+SILU)", "q norm", "k norm", "fused chain", "alpha, beta products",
              "alpha/beta epilogue (ADD, SOFTPLUS, MUL, SIGMOID)", "GATED_DELTA_NET", "other")


def chain_table(kernels: list[tuple[str, float]]) -> dict:
    """The per-GDN-layer chain table in the seed's form from a forward's kernels [(class, µs)] in launch order
    (class: :func:`kernel_class`'s, or bench.py's from its nodes: FUSED, PAIR, SCALE too). Each GDN layer's window
    runs from its conv-state GET_ROWS (the last before its CONCAT; or its fused chain) to its GATED_DELTA_NET,
    leaving out the qkv product that llama.cpp's order puts before the CONCAT; the MUL_MATs after the CONCAT are the
    alpha and beta products (llama.cpp builds them after the q/k norms), the kernels after them their epilogue.
    Returns {row: {"us": median over GDN layers of the row's summed durations, "kernels": median count}} with
    "chain total", and "layers": how many GDN windows were found."""
    windows, start = [], 0
    for i, (cls, _) in enumerate(kernels):
        if cls == "GDN":
            windows.append(kernels[start:i + 1])
            start = i + 1
    per_layer = []
    for w in windows:
        c = next((i for i, (cls, _) in enumerate(w) if cls in ("CONCAT", "FUSED")), None)
        if c is None:
            continue
        first = c if w[c][0] == "FUSED" else max((i for i in range(c) if w[i][0] == "GET_ROWS"), default=c)
        rows: dict[str, list[float]] = {r: [] for r in CHAIN_ROWS}
        norms, after_products = 0, False
        for i, (cls, us) in enumerate(w[first:], first):
            if i < c and cls != "GET_ROWS":
                continue  # the qkv product before the CONCAT
            if cls == "GET_ROWS":
                row = "GET_ROWS (conv state)" if i < c else "in between (ssm-state GET_ROWS)"
            elif cls in ("CONCAT", "GDN"):
                row = {"CONCAT": "CONCAT", "GDN": "GATED_DELTA_NET"}[cls]
            elif cls == "CPY":
                row = "snapshot CPYs"
            elif cls in ("SSM_CONV", "SILU") and norms == 0:
                row = "SSM_CONV (+SILU)"
            elif cls == "FUSED":
                row = "fused chain"
            elif cls in ("RMS_NORM", "L2_NORM") or cls == "SCALE" and norms in (1, 2) and not after_products:
                norms += cls != "SCALE"
                row = "q norm" if norms == 1 else "k norm"
            elif cls in ("MUL_MAT", "PAIR"):
                row, after_products = "alpha, beta products", True
            else:
                row = "alpha/beta epilogue (ADD, SOFTPLUS, MUL, SIGMOID)" if after_products else "other"
            rows[row].append(us)
        per_layer.append(rows)
    if not per_layer:
        return {"layers": 0}
    table = {r: {"us": statistics.median(sum(x[r]) for x in per_layer),
                 "kernels": statistics.median(len(x[r]) for x in per_layer)} for r in CHAIN_ROWS}
    table["chain total"] = {"us": statistics.median(sum(sum(v) for v in x.values()) for x in per_layer),
                            "kernels": statistics.median(sum(len(v) for v in x.values()) for x in per_layer)}
    table["layers"] = len(per_layer)
    return table


def measure(install: build.Install, gguf: Path, model: str | ModelShape, say=print, kernels: bool = True) -> dict:
    """ncu kernels per verify (one process per width; ``kernels`` False: none) and wall times (one process, CUDA
    graphs on)."""
    ncu = find_ncu() if kernels else None
    taps = layer_inputs(model)
    out: dict = {"model": model_label(model), "gguf": str(gguf), "taps": taps, "cases": []}
    walls = capture.time_verify(gguf, [(T, rows - 1) for T, rows in CASES], n_prompt=N_PROMPT, n_ctx=N_CTX,
                                layer_inputs=taps, reps=30, warmup=5, install=install, timeout_s=480)
    out["load_s"], out["log"] = walls["load_s"], walls["log"]
    for (T, rows), wall in zip(CASES, walls["cases"]):
        case = {"T": T, "rows": rows, "n_rs_seq": wall["n_rs_seq_resolved"],
                "wall_us": statistics.median(wall["wall_s"]) * 1e6}
        if ncu is None:
            say("ncu not found: no kernel durations")
        else:
            ks = ncu_kernels(install, gguf, T, rows, taps, ncu)
            case.update(kernels=len(ks), kernel_us=sum(t for _, t in ks), chain=chain_table(
                [(kernel_class(n), t) for n, t in ks]), by_name=kernel_totals(ks))
        out["cases"].append(case)
        say(f"[upstream] T={T} rows={rows}: " + (f"{case['kernels']} kernels, {case['kernel_us']:.1f} us of kernels, "
                                                  if "kernels" in case else "") + f"{case['wall_us']:.1f} us wall")
    return out


def kernel_name(symbol: str) -> str:
    """A CUDA kernel's name without its signature and template arguments."""
    return symbol.split("(")[0].split("<")[0].replace("void ", "").strip()


def kernel_totals(ks: list[tuple], group=kernel_name) -> list[dict]:
    """(kernel, us) pairs grouped by ``group(kernel)`` (a kernel's symbol here; bench.py passes graph nodes): count
    and total µs of each group, largest first."""
    groups: dict[str, list[float]] = {}
    for name, t in ks:
        groups.setdefault(group(name), []).append(t)
    return sorted(({"kernel": k, "count": len(v), "us": sum(v)} for k, v in groups.items()), key=lambda r: -r["us"])


def print_tables(up: dict) -> None:
    print(f"\n## upstream llama.cpp {build.COMMIT[:12]} (ggml-cuda sm_90 Release, FA kernels off), {up['model']}, "
          f"verify decode: ncu kernel durations (CUDA graphs off), wall per decode (CUDA graphs on)")
    print("T rows | kernels per verify | kernel us | wall us per decode")
    for c in up["cases"]:
        print(f"{c['T']} {c['rows']} | {c.get('kernels', 'n/a')} | {c.get('kernel_us', float('nan')):.1f} | "
              f"{c['wall_us']:.1f}")
    for c in up["cases"]:
        if "by_name" in c:
            print(f"\nT={c['T']}: kernels by name (count, us): " +
                  "; ".join(f"{r['kernel']} {r['count']} {r['us']:.0f}" for r in c["by_name"][:12]))
