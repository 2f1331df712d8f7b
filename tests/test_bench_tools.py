"""The benchmark tools' CPU-checkable parts: bench.py's floor kernels (in the Triton interpreter, against torch) and
ab_kernels.py's loading of another revision's kernels."""

import subprocess
import sys

import pytest
import torch

sys.path.insert(0, "benchmarks")
import ab_kernels  # noqa: E402
import bench  # noqa: E402


@pytest.mark.parametrize("gather,norm", [(False, False), (True, False), (True, True)])
def test_floor_kernels_do_what_their_floor_claims(gather, norm, device):
    # a floor kernel that skipped its dependent load or its sum would time less than the work it stands for
    off = 16 if gather else 0
    src = torch.randn(2 * bench.FLOOR_BLOCK + 40 + 16, device=device)
    dst = torch.full((2 * bench.FLOOR_BLOCK + 40,), float("nan"), device=device)  # two whole blocks, a masked one
    bench.floor_copy(src, dst, torch.tensor([off], device=device), gather, norm)
    want = src[off:off + dst.numel()]
    if not norm:
        assert torch.equal(dst, want)
        return
    blocks = want.split(bench.FLOOR_BLOCK)
    ref = torch.cat([b.double() / (b.double().square().sum() + 1e-6).sqrt() for b in blocks])
    torch.testing.assert_close(dst.double(), ref, rtol=1e-5, atol=0)  # (f32 sums in another order)


def test_ab_kernels_loads_a_revision_or_a_file_as_its_own_module(tmp_path):
    head = ab_kernels.revision_module("HEAD", tmp_path)
    text = subprocess.run(["git", "show", f"HEAD:{ab_kernels.SOURCE}"], check=True, capture_output=True,
                          text=True).stdout
    copy = tmp_path / "saved" / "triton_ops.py"
    copy.parent.mkdir()
    copy.write_text(text)
    saved = ab_kernels.revision_module(str(copy), tmp_path)
    assert head is not saved and head.__name__ != saved.__name__
    assert callable(head.gdn_conv_chain) and callable(saved.gdn_conv_chain)


def test_ab_kernels_names_a_base_it_cannot_read(tmp_path):
    for base in (str(tmp_path / "missing.py"), "no-such-revision"):
        with pytest.raises(SystemExit, match=f"ab_kernels: --base {base}: "):
            ab_kernels.revision_module(base, tmp_path)
