"""The shape of the code itself: no import circles, one error base class, one record per fused op (and the loader
checks fused nodes against it), launchers that raise instead of assert, Triton kernel families that share their
``@triton.jit`` helpers only through the exactness core, a pipeline that builds no torch; benchmark scripts that are
command lines over the harness (gdnpass.bench), imported by nothing, with no sys.path changes; tests in folders that
mirror the package."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import subprocess
import sys

import networkx as nx
import pytest
import torch

from gdnpass import errors, ir, serialize
from gdnpass.ir import FUSED_OPS, GraphError, Op
from gdnpass.kernels import backends
from gdnpass.patterns import RECORDS, REGISTRY
from gdnpass.patterns.conv_chain.record import RECORD as CONV_CHAIN
from gdnpass.models import VerifyConfig
from gdnpass.pipeline import PassOptions, run
from support.surgery import SPLIT_FFN

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "gdnpass"
ROOT = PACKAGE.parent


# ---- imports --------------------------------------------------------------------------------------------------------


def _module(path: pathlib.Path, root: pathlib.Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = PACKAGE) -> nx.DiGraph:
    """module -> gdnpass module it imports, anywhere in the file (function-level imports count: a lazy import that
    closes a circle is still a circle)."""
    g = nx.DiGraph()
    modules = {_module(p, root): p for p in root.rglob("*.py")}
    for name, path in modules.items():
        g.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    g.add_edge(name, t)
    return g


def test_no_module_imports_one_that_imports_it_back():
    g = import_graph()
    assert len(g) > 20 and "gdnpass.bench.timing" in g  # the scan found the package, the benchmark harness too
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"import circles: {cycles}"


def test_the_product_does_not_import_the_benchmark_harness():
    g = import_graph()
    assert [(a, b) for a, b in g.edges if b.startswith("gdnpass.bench") and not a.startswith("gdnpass.bench")] == []


def test_the_cycle_check_can_fail(tmp_path):
    pkg = tmp_path / "gdnpass"
    pkg.mkdir()
    for name in ("__init__", "a", "b", *(f"m{i}" for i in range(20))):
        (pkg / f"{name}.py").write_text("")
    (pkg / "a.py").write_text("from gdnpass import b\n")
    (pkg / "b.py").write_text("def f():\n    import gdnpass.a\n")  # hidden in a function: still a circle
    assert list(nx.simple_cycles(import_graph(pkg))) != []


def test_building_planning_fusing_and_dumping_need_no_torch():
    code = ("import sys\n"
            "from gdnpass import pipeline, dump, serialize\n"
            "from gdnpass.models import VerifyConfig\n"
            "r = pipeline.run(VerifyConfig('tiny-dc4-h64', 4, 3, n_layers=1), pipeline.PassOptions(fusion=True))\n"
            "assert r.report.applied\n"
            "serialize.dumps(r.graph)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- the benchmark scripts ----------------------------------------------------------------------------------------


def script_problems(files: dict[str, str]) -> list[str]:
    """What breaks the benchmarks' layering in ``files`` (a repository path -> its source; the scripts are
    ``benchmarks/*.py``): a file that imports a benchmark script (by its name, which the script's folder on sys.path
    makes importable, or as ``benchmarks.NAME``; what scripts share lives in gdnpass.bench), a file that reads or
    changes ``sys.path`` (the scripts and tests run with gdnpass importable: ``PYTHONPATH=.`` or installed)."""
    scripts = {pathlib.PurePosixPath(f).stem for f in files if f.startswith("benchmarks/") and f.endswith(".py")}
    problems = []
    for where, src in sorted(files.items()):
        for node in ast.walk(ast.parse(src)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                top, _, rest = name.partition(".")
                if top in scripts or top == "benchmarks":
                    problems.append(f"{where} imports the benchmark script {rest if top == 'benchmarks' else top}")
            if isinstance(node, ast.Attribute) and node.attr == "path" and ast.unparse(node.value) == "sys":
                problems.append(f"{where}:{node.lineno} touches sys.path")
    return sorted(problems)


def _sources(*folders: str) -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for f in folders for p in sorted((ROOT / f).rglob("*.py"))}


def test_benchmark_scripts_are_imported_by_nothing_and_leave_sys_path_alone():
    files = _sources("gdnpass", "benchmarks", "tests", "examples")
    assert {"benchmarks/bench.py", "benchmarks/tune_dedup.py", "benchmarks/upstream.py",
            "tests/kernels/compile_sm90.py", "gdnpass/bench/chain.py"} <= set(files)
    assert script_problems(files) == []


def test_the_script_rules_can_fail():
    assert script_problems({
        "benchmarks/bench.py": "import sys\nsys.path.insert(0, 'benchmarks')\ndef f():\n    from tune_dedup import g\n",
        "benchmarks/tune_dedup.py": "from bench import node_runner\n",  # the old circle, bench <-> tune_dedup
        "benchmarks/upstream.py": "from gdnpass.bench.upstream import measure\n",  # a script as it should be
        "gdnpass/bench/chain.py": "from gdnpass.bench.timing import kernel_us\nimport upstream\n",
        "tests/test_x.py": "import benchmarks.tune_dedup\nimport sys\nprint(sys.path)\n",
    }) == ["benchmarks/bench.py imports the benchmark script tune_dedup",
           "benchmarks/bench.py:2 touches sys.path",
           "benchmarks/tune_dedup.py imports the benchmark script bench",
           "gdnpass/bench/chain.py imports the benchmark script upstream",
           "tests/test_x.py imports the benchmark script tune_dedup",
           "tests/test_x.py:3 touches sys.path"]


def test_every_name_a_benchmark_script_imports_from_gdnpass_exists():
    """The scripts need a GPU to run, so a name moved or renamed in gdnpass would go unnoticed here: each script's
    ``from gdnpass... import NAME`` must find NAME (an attribute, or a submodule)."""
    missing, checked = [], 0
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                pairs = [(a.name, None) for a in node.names if a.name.split(".")[0] == "gdnpass"]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gdnpass":
                pairs = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, name in pairs:
                checked += 1
                found = importlib.import_module(module)
                if name is not None and not hasattr(found, name) and \
                        importlib.util.find_spec(f"{module}.{name}") is None:
                    missing.append(f"{path.name}: {module}.{name}")
    assert checked > 30 and missing == []


def test_the_harness_reads_ncu_and_runs_steps_without_torch():
    """gdnpass.bench.upstream shares no process with torch (ggml-cuda runs there), and the device session's runner
    starts its steps without loading it."""
    code = ("import sys\n"
            "from gdnpass.bench import session, upstream\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- the tests' layout -----------------------------------------------------------------------------------------------

TEST_HELPERS = ("support", "data")  # tests/support/: helpers the test files share; tests/data/: their files


def layout_problems(tests: pathlib.Path, package: pathlib.Path) -> list[str]:
    """Where the tests' layout breaks its rule, that it mirrors the package: every .py file of tests/ lives in tests/
    itself (a test of a top-level module or of the whole; conftest.py) or in tests/PATH/ where gdnpass/PATH/ is a
    package (tests/kernels/, tests/models/, tests/bench/, tests/frontends/ggml/, tests/patterns/conv_chain/, ...),
    except in the helper folders (TEST_HELPERS), which hold no test file (``test_*.py``); and no file imports a test
    file (what tests share lives in tests/support/)."""
    problems = []
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        where, folder = f"tests/{rel.as_posix()}", rel.parent
        if folder.parts and folder.parts[0] in TEST_HELPERS:
            if path.name.startswith("test_"):
                problems.append(f"{where}: a test file among the helpers")
            continue
        if folder.parts and not (package / folder / "__init__.py").is_file():
            problems.append(f"{where}: gdnpass/{folder.as_posix()}/ is no package of gdnpass")
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            problems += [f"{where} imports the test file {n}" for n in names if n.split(".")[-1].startswith("test_")]
    return problems


def test_the_tests_mirror_the_package():
    tests = ROOT / "tests"
    found = {p.relative_to(tests).parent.as_posix() for p in tests.rglob("test_*.py")}
    assert {".", "kernels", "models", "bench", "frontends/ggml", "frontends/llama", "patterns", "patterns/conv_chain",
            "patterns/mat_vec_pair"} <= found  # the scan found the folders
    assert layout_problems(tests, PACKAGE) == []


def test_the_layout_check_can_fail(tmp_path):
    package, tests = tmp_path / "gdnpass", tmp_path / "tests"
    for folder in ("", "kernels", "patterns", "patterns/conv_chain"):
        (package / folder).mkdir(parents=True, exist_ok=True)
        (package / folder / "__init__.py").write_text("")
    files = {
        "conftest.py": "", "test_ir.py": "", "kernels/test_kernels.py": "", "kernels/compile_sm90.py": "",
        "patterns/conv_chain/test_fusion.py": "from support.graphs import CHAIN\n",  # all as they should be
        "test_fusion_old_issue.py": "from test_ir import leaf\n",  # a test file importing another
        "fusion/test_chain.py": "",  # gdnpass/fusion.py is a module, not a package
        "patterns/mat_vec_pair/test_pair.py": "",  # no such pattern
        "models/helpers.py": "",  # a helper in a folder that mirrors nothing
        "support/test_arena.py": "",  # a test file among the helpers
    }
    for name, text in files.items():
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        (tests / name).write_text(text)
    assert sorted(layout_problems(tests, package)) == [
        "tests/fusion/test_chain.py: gdnpass/fusion/ is no package of gdnpass",
        "tests/models/helpers.py: gdnpass/models/ is no package of gdnpass",
        "tests/patterns/mat_vec_pair/test_pair.py: gdnpass/patterns/mat_vec_pair/ is no package of gdnpass",
        "tests/support/test_arena.py: a test file among the helpers",
        "tests/test_fusion_old_issue.py imports the test file test_ir"]


# ---- errors ---------------------------------------------------------------------------------------------------------


def test_one_error_base_class():
    kinds = [errors.GraphError, errors.KernelError, errors.ResourceError]
    assert all(issubclass(k, errors.GdnpassError) for k in kinds)
    assert ir.GraphError is errors.GraphError


TRITON_MODULES = sorted((PACKAGE / "kernels").glob("triton_*.py"))


def test_launcher_checks_raise_kernel_errors_not_asserts():
    from gdnpass.kernels import triton_norms

    x = torch.zeros(1, 1, 4, 8)[..., ::2]  # rows not contiguous
    with pytest.raises(errors.KernelError, match="contiguous rows"):
        triton_norms.l2_norm(x, 1e-6, torch.zeros(1, 1, 4, 4))
    assert len(TRITON_MODULES) >= 7  # the core, the families, attention
    for path in TRITON_MODULES:
        assert not [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Assert)], path.name


# ---- the Triton kernel families ------------------------------------------------------------------------------------


def _jit_functions(tree: ast.Module) -> set[str]:
    """The ``@triton.jit`` functions a module defines (at top level, or in an ``if`` choosing a variant)."""
    defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    return {d.name for d in defs if any(ast.unparse(x).startswith("triton.jit") for x in d.decorator_list)}


def kernel_family_problems(modules: dict[str, str]) -> list[str]:
    """What breaks the kernels' layering in ``modules`` (name -> source of gdnpass/kernels/triton_*.py): a family
    module's ``@triton.jit`` helper imported by another (what two kernels must compute alike lives in triton_core,
    the exactness core), a jit function defined twice, triton_core importing a family."""
    trees = {name: ast.parse(src) for name, src in modules.items()}
    jit = {name: _jit_functions(tree) for name, tree in trees.items()}
    problems = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gdnpass.kernels.triton_")):
                continue
            source = node.module.rpartition(".")[2]
            if name == "triton_core":
                problems.append(f"triton_core imports {source}: the core imports no kernel family")
            shared = sorted({a.name for a in node.names} & jit.get(source, set()))
            if source != "triton_core" and shared:
                problems.append(f"{name} imports the jit helpers {shared} from {source}, not from triton_core")
    defined: dict[str, str] = {}
    for name, names in jit.items():
        for fn in sorted(names):
            if fn in defined:
                problems.append(f"{fn} is defined in {defined[fn]} and in {name}")
            defined.setdefault(fn, name)
    return problems


def test_kernel_families_share_jit_helpers_only_through_the_core():
    modules = {p.stem: p.read_text() for p in TRITON_MODULES}
    assert {"triton_core", "triton_elementwise", "triton_ssm", "triton_attention"} <= set(modules)
    assert kernel_family_problems(modules) == []


def test_the_family_check_can_fail():
    core = "import triton\n@triton.jit\ndef silu_f32(x):\n    return x\n"
    family = "import triton\n@triton.jit\ndef conv_dot(w):\n    return w\n"
    assert kernel_family_problems({
        "triton_core": core + "from gdnpass.kernels.triton_a import launcher\n",
        "triton_a": family,
        "triton_b": family + "from gdnpass.kernels.triton_a import conv_dot\n",
    }) == ["triton_core imports triton_a: the core imports no kernel family",
           "triton_b imports the jit helpers ['conv_dot'] from triton_a, not from triton_core",
           "conv_dot is defined in triton_a and in triton_b"]


# ---- the fused-op records ------------------------------------------------------------------------------------------


def test_every_fused_op_has_a_record_and_backends_run_it():
    assert set(RECORDS) == FUSED_OPS
    for op, r in RECORDS.items():
        assert backends.TORCH_BACKEND[op] is r.torch and backends.TRITON_BACKEND[op] is r.triton
        assert r.scope is not None and r.src


@pytest.fixture(scope="module")
def fused_files() -> dict[str, dict]:
    """Fused graph files of a dense and a MoE layer: between them a node of every fused op (MOE_ROUTER needs the
    experts; the dense layer's MUL_MAT_ADD is the one the MoE plan refuses; the dense layer at 8 tokens of an FFN
    whose pair's tile splits K, where the pair's SwiGLU fuses: pair-glu.tile)."""
    runs = {m: run(VerifyConfig(m, n_t, 3, n_layers=1), PassOptions(fusion=True))
            for m, n_t in ((SPLIT_FFN, 8), ("tiny-qwen35moe", 4))}
    assert {a.pattern for r in runs.values() for a in r.report.applied} == {p.name for p in REGISTRY}
    return {m: serialize.to_dict(r.graph) for m, r in runs.items()}


@pytest.fixture(scope="module")
def fused_file(fused_files) -> dict:
    return fused_files[SPLIT_FFN]


def _entry(d: dict, op: Op) -> dict:
    return next(t for t in d["tensors"] if t["op"] == op.value)


def test_a_fused_graph_file_round_trips(fused_files):
    for d in fused_files.values():
        g = serialize.from_dict(d)
        assert serialize.to_dict(g) == d
    chain = next(n for n in serialize.from_dict(fused_files[SPLIT_FFN]).nodes if n.op is Op.GDN_CONV_CHAIN)
    assert len(chain.src) == 4 and len(chain.outs) == 2 + len(chain.op_params["columns"])
    assert "n_inputs" not in chain.op_params  # a file detail, not a parameter


@pytest.mark.parametrize("key, value, says", [
    ("n_tokens", 9, "projection"),  # (the file: 8 tokens)
    ("n_tokens", 17, "n_tokens 17 is outside"),
    ("d_conv", 3, "weight"),
    ("d_conv", 9, "d_conv 9 is not one of"),
    ("head_dim", 48, "head_dim 48"),
    ("head_dim", 32, "is not \\[head_dim, n_k_heads, n_tokens, n_s\\]"),
    ("n_k_heads", 2, "is not \\[head_dim, n_k_heads, n_tokens, n_s\\]"),
    ("n_k_heads", 0, "n_k_heads 0"),
    ("eps", -1.0, "'eps' must be a finite number"),
    ("eps", "x", "'eps' must be a finite number"),
    ("columns", [0, 9], "columns"),
    ("columns", [0, 1], "outs must be q, k and one destination per column"),
    ("l2_separate", 1, "'l2_separate' must be a bool"),
])
def test_inconsistent_chain_parameters_are_refused_on_load(fused_file, key, value, says):
    d = __import__("copy").deepcopy(fused_file)
    _entry(d, Op.GDN_CONV_CHAIN)["op_params"][key] = value
    with pytest.raises(GraphError, match=says) as e:
        serialize.from_dict(d, "g.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("g.json: tensor ")


@pytest.mark.parametrize("mutate, says", [
    (lambda e: e["op_params"].pop("n_inputs"), "lacks 'n_inputs'"),
    (lambda e: e["op_params"].update(n_inputs=2), "needs 3 sources"),
    (lambda e: e["op_params"].update(n_inputs=99), "'n_inputs' must be an int in 0..4"),
    (lambda e: e["src"].pop(), "outs must hold the second product"),
])
def test_damaged_pair_nodes_are_refused_on_load(fused_file, mutate, says):
    d = __import__("copy").deepcopy(fused_file)
    mutate(_entry(d, Op.MUL_MAT_VEC_PAIR))
    with pytest.raises(GraphError, match=says):
        serialize.from_dict(d, "g.json")


def test_launches_come_from_the_record():
    from gdnpass.launches import launches

    res = run(VerifyConfig("tiny-dc4-h64", 4, 3, n_layers=1), PassOptions(fusion=True, hints=False))
    chain = next(n for n in res.graph.nodes if n.op is Op.GDN_CONV_CHAIN)
    # l2_separate: the fused launch, then the unfused norm kernels for q and k (RMS form: RMS_NORM and SCALE each)
    want = 1 + (4 if chain.op_params["norm"] == "rms" else 2) * chain.op_params["l2_separate"]
    assert CONV_CHAIN.launches(chain) == want and launches(res.graph)["GDN_CONV_CHAIN"] == want
