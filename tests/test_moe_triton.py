"""The whole qwen35moe forward on the Triton backend (issue 36 item 2): the expert FFN's every op on its kernel
(ARGSORT, SUM_ROWS, CLAMP, DIV; MUL_MAT_ID on the mat-vec, plain and quantized experts).

- In CI, on Triton's interpreter: a micro qwen35moe file (n_embd 32, 4 experts of 32 with 2 used, a shared expert
  of 64, vocab 64), f32 and Q8_0, its first layer (a GDN layer and its expert FFN) and the lm head, at 2 tokens:
  ``gdnpass run --gguf FILE --backend triton --check`` identical fused vs unfused, and the Triton logits against the
  torch backend's within LOGITS_TOL. The tiny-qwen35moe file's whole forward (4 layers, attention included) takes
  ~4 min a run on the interpreter here (its MUL_MAT_IDs: a program a weight row, slot and token), too slow for CI:
- on a GPU (marked gpu): the tiny-qwen35moe file's whole forward, f32, bf16 and Q8_0, compiled, the same checks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

gguf = pytest.importorskip("gguf")

from gdnpass import cli, pipeline  # noqa: E402
from gdnpass.models import PRESETS  # noqa: E402
from gdnpass.models.fill import fill  # noqa: E402
from gdnpass.models.gguf_model import open_model  # noqa: E402
from gdnpass.models.gguf_write import write_gguf  # noqa: E402
from gdnpass.runtime import Executor  # noqa: E402

# tiny-qwen35moe's trunk made smaller still (every row a multiple of 32, Q8_0's block), for the interpreter
MICRO = dataclasses.replace(
    PRESETS["tiny-qwen35moe"], name="micro-qwen35moe", n_embd=32, n_k_heads=1, n_v_heads=2, head_dim=16,
    head_count=2, head_count_kv=1, key_length=16, value_length=16, rope_dimension_count=8,
    rope_dimension_sections=(2, 1, 1, 0), n_ff=64, n_expert=4, n_expert_used=2, n_ff_exp=32, n_ff_shexp=64,
    vocab_size=64)

# Triton's logits against the torch backend's, max |Δ| / max |ref|: the mat-vec, GATED_DELTA_NET and flash
# attention sum in their own orders (each within 1e-5 of the reference; docs/architecture.md), and in the
# interpreter exp / log are numpy's, not torch's. A quantized file's products round their activations to 8 bits:
# a ~1e-7 difference upstream can flip one rounding (docs/quantized.md), hence its bound.
LOGITS_TOL = {"f32": 1e-4, "bf16": 1e-4, "q8_0": 1e-2}


def _logits(path, backend: str, device: str, layers: int, n_t: int, rs: int) -> torch.Tensor:
    """The fused forward of the file's first ``layers`` layers on ``backend``, from the seeded inputs and the file's
    weights: its logits."""
    model = open_model(path)
    graph = pipeline.run(model.build(model.config(layers=layers or model.shape.n_layer, n_tokens=n_t, n_rs_seq=rs)),
                         pipeline.PassOptions(fusion=True)).graph
    ex = Executor(graph, device=device, backend=backend)
    fill(ex, seed=0)
    model.load_weights(ex, graph)
    ex.run()
    return ex.read(graph.find("result_output")).double().cpu()


def _check_and_compare(path, wtype: str, device: str, layers: int, n_t: int, rs: int, capsys) -> float:
    args = ["run", "--gguf", str(path), "--tokens", str(n_t), "--rs-seq", str(rs), "--backend", "triton",
            "--device", device, "--check", "-q", *(["--layers", str(layers)] if layers else [])]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert " 0 differing" in out and "DIFFERS" not in out and "identical  result_output" in out, out
    assert "gdn_conv_chain: " in out and "identical  ffn_moe_out-0" in out, out
    tri = _logits(path, "triton", device, layers, n_t, rs)
    ref = _logits(path, "torch", device, layers, n_t, rs)
    err = float((tri - ref).abs().max() / ref.abs().max())
    print(f"{path.name} ({wtype}) on {device}: Triton logits vs torch's, max |Δ| / max |ref| = {err:.3g}")
    assert 0 < ref.abs().max() and err <= LOGITS_TOL[wtype], err
    return err


@pytest.mark.parametrize("wtype", ["f32", "q8_0"])
def test_a_moe_layer_runs_on_triton_as_on_torch(wtype, tmp_path, capsys):
    """The micro file's first layer and lm head through the interpreter (~20 s): run --check identical fused vs
    unfused on the Triton backend, logits within LOGITS_TOL of the torch backend's (measured: see docs/moe.md)."""
    path = write_gguf(MICRO, tmp_path / f"micro-{wtype}.gguf", wtype=wtype, seed=1, tokenizer="none")
    _check_and_compare(path, wtype, "cpu", 1, 2, 1, capsys)


@pytest.mark.gpu
@pytest.mark.parametrize("wtype", ["f32", "bf16", "q8_0"])
def test_gpu_whole_tiny_moe_runs_on_triton_as_on_torch(wtype, tmp_path, capsys):
    """The tiny-qwen35moe file's whole verify forward (4 layers: 3 GDN, 1 attention; 8 experts of 128, 2 used),
    compiled: run --check identical fused vs unfused on the Triton backend, logits within LOGITS_TOL of the torch
    backend's on the same GPU."""
    path = write_gguf("tiny-qwen35moe", tmp_path / f"moe-{wtype}.gguf", wtype=wtype, seed=1)
    _check_and_compare(path, wtype, "cuda", 0, 4, 3, capsys)
