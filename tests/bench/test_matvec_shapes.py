"""The product table's CPU parts (gdnpass.bench.matvec): the shapes it times are read off the fused graph (so a
product the builder adds or fusion pairs is timed as the forward runs it), and issue 32's targets by weight size."""

import pytest

from gdnpass.bench import matvec
from gdnpass.models.hparams import get_model


def test_product_shapes_are_the_fused_forwards_products():
    m = get_model("qwen3.5-9b")
    got = {(p.M, p.K, p.pair): p.names for p in matvec.product_shapes("qwen3.5-9b")}
    assert got[(m.n_ff, m.n_embd, True)] == "ffn_gate+ffn_up"            # paired by fusion
    assert got[(m.head_count_kv * m.key_length, m.n_embd, True)] == "attn_v+attn_k"
    assert got[(m.n_v_heads, m.n_embd, True)] == "ssm_alpha+ssm_beta"
    assert got[(m.n_embd, m.n_ff, False)] == "ffn_down"
    assert got[(m.vocab_size, m.n_embd, False)] == "output"
    assert set(got[(4096, 4096, False)].split(", ")) == {"attn_gate", "ssm_out", "attn_output"}
    assert not any(M == m.n_ff and not pair for M, _, pair in got)  # gate and up never run alone with fusion on


def test_27b_shapes_differ_where_its_config_does():
    got = {(p.M, p.K) for p in matvec.product_shapes("qwen3.5-27b")}
    assert {(10240, 5120), (6144, 5120), (5120, 6144), (17408, 5120), (5120, 17408), (12288, 5120)} <= got


@pytest.mark.parametrize("nbytes,share", [(32 << 20, 0.85), ((32 << 20) - 1, 0.70), (8 << 20, 0.70),
                                          ((8 << 20) - 1, None), (2 << 30, 0.85)])
def test_target_share_by_weight_bytes(nbytes, share):
    assert matvec.target_share(nbytes) == share
