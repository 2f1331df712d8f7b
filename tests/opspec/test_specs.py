"""One spec per base op (gdnpass.opspec): every base op has one, no spec lacks a part, and what serialize, the
decoder, the planner and the backends use is derived from it (one parameter-type vocabulary, shared with the fused
ops' records)."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from gdnpass import alloc, opspec
from gdnpass.frontends import decode
from gdnpass.ir import FUSED_OPS, VIEW_OPS, GraphError, Op
from gdnpass.kernels import backends
from gdnpass.opspec import NONNEG, NUM, SPECS, WORDS, spec_of
from gdnpass.patterns import record

BASE_OPS = [op for op in Op if op not in FUSED_OPS and op not in (Op.NONE, Op.OPAQUE)]


def test_every_base_op_has_a_spec_with_every_part():
    assert len(BASE_OPS) >= 20 and Op.RMS_NORM in BASE_OPS and Op.ROPE in BASE_OPS  # the scan found the ops
    assert sorted(SPECS, key=lambda op: op.value) == sorted(BASE_OPS, key=lambda op: op.value)
    assert {op.value: SPECS[op].missing() for op in BASE_OPS} == {op.value: [] for op in BASE_OPS}
    for op, spec in SPECS.items():
        assert spec.op is op and spec.name == op.value
        assert len({a.key for a in spec.args}) == len(spec.args), f"{op.value}: a key twice"


def test_the_completeness_check_can_fail():
    rms = SPECS[Op.RMS_NORM]
    assert dataclasses.replace(rms, triton=None).missing() == ["triton"]
    assert dataclasses.replace(rms, torch=None, programs=None).missing() == ["torch", "programs"]
    assert dataclasses.replace(SPECS[Op.VIEW], shape=None).missing() == ["shape"]  # a view needs only its rule
    for op in (Op.NONE, Op.OPAQUE, *FUSED_OPS):
        with pytest.raises(GraphError, match="has no base-op spec"):
            spec_of(op)


def test_the_backends_and_the_planner_derive_from_the_specs():
    for op, spec in SPECS.items():
        if op in VIEW_OPS:
            assert op not in backends.TORCH_BACKEND and op not in backends.TRITON_BACKEND
            continue
        assert backends.TORCH_BACKEND[op] is spec.torch and backends.TRITON_BACKEND[op] is spec.triton
        assert backends.GGML_CPU_BACKEND[op] is (spec.ggml_cpu or spec.torch)
    assert {op for op, s in SPECS.items() if s.ggml_cpu} == {Op.MUL_MAT, Op.MUL_MAT_ID, Op.RMS_NORM,
                                                              Op.FLASH_ATTN_EXT}
    # ggml_op_can_inplace, over the ops gdnpass models (L2_NORM has an in-place variant but gallocr never reuses).
    # DIV and CLAMP joined with the expert FFN (issue 36): llama.cpp's ffn_moe_weights_sum_clamped lies over the
    # SUM_ROWS it clamps (tests/kernels/test_moe_ops.py checks that offset)
    assert alloc.INPLACE_OPS == opspec.INPLACE_OPS == {Op.SCALE, Op.ADD, Op.MUL, Op.DIV, Op.CLAMP, Op.UNARY,
                                                        Op.RMS_NORM, Op.ROPE, Op.SOFT_MAX}
    assert decode._EXACT_OPS == {op.value: op for op in BASE_OPS}


def test_one_parameter_type_vocabulary():
    assert record.Param is opspec.Param and record.NUM is NUM and record.NONNEG is NONNEG
    assert NUM.ok(-1.5) and NUM.ok(0) and not NUM.ok(float("inf")) and not NUM.ok(True)
    assert NONNEG.ok(0.0) and not NONNEG.ok(-1e-9) and not NONNEG.ok(float("nan"))
    chain = next(r for r in record_values() if r.op.value == "GDN_CONV_CHAIN")
    assert chain.params["eps"] is NONNEG  # a negative eps is meaningless: the chain's record says >= 0
    for op, spec in SPECS.items():
        for a in spec.args:
            assert isinstance(a.type, opspec.Param), f"{op.value}.{a.key}"
            assert a.word is None or a.type.ggml is not None or a.key == "kind", f"{op.value}.{a.key}: no encoding"


def record_values():
    from gdnpass.patterns import RECORDS

    return list(RECORDS.values())


def _words(op: Op, values: dict, kind: str | None = None) -> list[int]:
    """op_params words for ``values``, laid out as the spec says ggml lays them out (the decoder's inverse)."""
    words = [0] * 16
    for a in SPECS[op].words(kind):
        v, enc = values.get(a.key), a.type.ggml
        if a.key == "kind" or v is None:
            continue
        if enc == "f32":
            words[a.word] = struct.unpack("<i", struct.pack("<f", v))[0]
        elif enc == "size":
            words[a.word], words[a.word + 1] = v & 0xFFFFFFFF, v >> 32
        elif enc == "i32x4":
            words[a.word: a.word + WORDS[enc]] = list(v)
        elif enc == "prec":
            words[a.word] = {p.value: i for i, p in decode.PRECS.items()}[v]
        else:
            words[a.word] = int(v)
    return words


ROPE = {"n_dims": 64, "mode": 40, "n_ctx_orig": 262144, "freq_base": 1e7, "freq_scale": 1.0, "ext_factor": 0.0,
        "attn_factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "sections": (11, 11, 10, 0), "n_offs": 0}


@pytest.mark.parametrize("op, values, kind", [
    (Op.ROPE, ROPE, None),
    (Op.FLASH_ATTN_EXT, {"scale": 0.125, "max_bias": 0.0, "logit_softcap": 0.0, "prec": "F32", "n_kv_max": 256}, None),
    (Op.SOFT_MAX, {"scale": 0.5, "max_bias": 0.0}, None),
    (Op.VIEW, {"offset": 3 << 33}, None),
    (Op.PERMUTE, {"axes": (0, 2, 1, 3)}, None),
    (Op.RMS_NORM, {"eps": 0.5}, None),
    (Op.GATED_DELTA_NET, {"K": 4}, None),
    (Op.MUL_MAT, {"prec": "F32"}, None),
    (Op.MUL_MAT, {}, None),  # prec not set: not recorded
    (Op.GLU, {"swapped": True, "alpha": 1.5, "limit": 7.0}, "SWIGLU_OAI"),
    (Op.GLU, {"swapped": False, "limit": 7.0}, "SWIGLU_CLAMP"),
    (Op.ARGSORT, {"order": 1}, None),
    (Op.ARGSORT, {"order": 0}, None),  # ASC: a zero word, still recorded (the rule requires it)
    (Op.CLAMP, {"min": 6.103515625e-5, "max": float("inf")}, None),  # build_moe_ffn's bounds
    (Op.CLAMP, {"min": float("-inf"), "max": 7.0}, None),
    (Op.SUM_ROWS, {}, None),
    (Op.DIV, {}, None),
    (Op.MUL_MAT_ID, {}, None),
])
def test_the_decoder_reads_the_spec_layout(op, values, kind):
    got_op, params = decode.ir_op(op.value, _words(op, values, kind), glu_name=kind, inplace=False, is_node=True)
    assert got_op is op
    want = dict(values) | ({"kind": kind} if kind else {}) | ({"inplace": False} if op is Op.SCALE else {})
    assert params == want
    for k in SPECS[op].required(kind):  # the shape rule's keys: the decoder gives them all
        assert k in params


def test_the_loader_checks_every_spec_type():
    from gdnpass import serialize

    for op, spec in SPECS.items():
        assert serialize._param_types(op) == spec.types
    assert serialize._param_types(Op.OPAQUE) == {}
