"""ROPE cases shared by the ggml referee (kernels/test_attention_ops.py) and the Triton kernel test
(kernels/test_triton_ops.py)."""

QWEN35_ROPE = dict(n_ctx_orig=262144, freq_base=1e7, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0,
                   beta_fast=32.0, beta_slow=1.0)
# (id, mode, head size, n_dims, sections, rope params): qwen35's IMROPE (sections 11, 11, 10 of 32 pairs, rotating 64
# of the row as qwen3.5 rotates 64 of 256), MROPE on the same, IMROPE with a 4th (e) section, NEOX and NORMAL with
# YaRN (ext_factor, freq_scale, attn_factor, freq_factors), a partial rotation
ROPE_CASES = [
    ("imrope-qwen35", 40, 128, 64, (11, 11, 10, 0), QWEN35_ROPE),
    ("imrope-full-row", 40, 64, 64, (11, 11, 10, 0), QWEN35_ROPE),
    ("mrope", 8, 128, 64, (11, 11, 10, 0), QWEN35_ROPE),
    ("imrope-e-section", 40, 32, 32, (4, 5, 3, 4), QWEN35_ROPE),
    ("neox", 2, 64, 64, (0, 0, 0, 0), dict(QWEN35_ROPE, freq_base=1e4, freq_scale=0.5, attn_factor=0.8)),
    ("neox-yarn", 2, 64, 48, (0, 0, 0, 0),
     dict(n_ctx_orig=4096, freq_base=5e5, freq_scale=0.25, ext_factor=1.0, attn_factor=0.9, beta_fast=32.0,
          beta_slow=1.0)),
    ("normal-yarn", 0, 48, 32, (0, 0, 0, 0),
     dict(n_ctx_orig=2048, freq_base=1e4, freq_scale=0.5, ext_factor=0.5, attn_factor=1.0, beta_fast=16.0,
          beta_slow=2.0)),
    ("normal", 0, 32, 32, (0, 0, 0, 0), dict(QWEN35_ROPE, freq_base=1e4)),
]
