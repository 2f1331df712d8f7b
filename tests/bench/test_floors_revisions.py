"""The benchmark harness's CPU-checkable parts: the floor kernels of bench.py's chain table (gdnpass.bench.floors, in
the Triton interpreter, against torch) and ab_kernels.py's loading of another revision's kernels (its package, as a
package of its own: gdnpass.bench.revisions)."""

import subprocess
import sys

import pytest
import torch

from gdnpass.bench import floors, revisions


@pytest.mark.parametrize("gather,norm", [(False, False), (True, False), (True, True)])
def test_floor_kernels_do_what_their_floor_claims(gather, norm, device):
    # a floor kernel that skipped its dependent load or its sum would time less than the work it stands for
    off = 16 if gather else 0
    src = torch.randn(2 * floors.FLOOR_BLOCK + 40 + 16, device=device)
    dst = torch.full((2 * floors.FLOOR_BLOCK + 40,), float("nan"), device=device)  # two whole blocks, a masked one
    floors.floor_copy(src, dst, torch.tensor([off], device=device), gather, norm)
    want = src[off:off + dst.numel()]
    if not norm:
        assert torch.equal(dst, want)
        return
    blocks = want.split(floors.FLOOR_BLOCK)
    ref = torch.cat([b.double() / (b.double().square().sum() + 1e-6).sqrt() for b in blocks])
    torch.testing.assert_close(dst.double(), ref, rtol=1e-5, atol=0)  # (f32 sums in another order)


def _archive(rev: str, folder) -> None:
    """``git archive REV gdnpass | tar -x -C folder``: a revision's package snapshot, as the docstring says."""
    folder.mkdir(parents=True)
    data = subprocess.run(["git", "archive", "--format=tar", rev, "gdnpass"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=data, check=True)


def test_ab_kernels_loads_a_revision_or_a_snapshot_as_its_own_package(tmp_path):
    head = revisions.revision_module("HEAD", tmp_path)
    _archive("HEAD", tmp_path / "saved")
    saved = revisions.revision_module(str(tmp_path / "saved"), tmp_path)
    tree = revisions.launchers("gdnpass", None, "tree")
    for name in revisions.LAUNCHERS:
        fns = [getattr(v, name) for v in (head, saved, tree)]
        assert all(callable(f) for f in fns)
        modules = [f.__module__ for f in fns]
        assert len(set(modules)) == 3 and modules[2].startswith("gdnpass.kernels."), modules
    # the revision's chain kernel calls the revision's own helpers, not the working tree's
    chain = sys.modules[head.gdn_conv_chain.__module__]
    assert chain.__name__.startswith("ab_HEAD.kernels.")
    assert chain.silu_f32_unrolled.fn.__module__.startswith("ab_HEAD.kernels.")


def test_ab_kernels_loads_the_single_module_of_older_revisions(tmp_path):
    """Before issue 31 the kernels were one module, kernels/triton_ops.py: its launchers are found there."""
    old = tmp_path / "old" / "gdnpass"
    (old / "kernels").mkdir(parents=True)
    (old / "__init__.py").write_text("")
    (old / "kernels" / "__init__.py").write_text("")
    (old / "kernels" / "helpers.py").write_text("TAG = 'old'\n")
    (old / "kernels" / "triton_ops.py").write_text(
        "from gdnpass.kernels.helpers import TAG\n\n\n"
        "def gdn_conv_chain(*a, **k):\n    return TAG\n\n\nunary = glu = gdn_conv_chain\n")
    v = revisions.revision_module(str(tmp_path / "old"), tmp_path)
    assert v.gdn_conv_chain() == v.unary() == v.glu() == "old"
    assert v.glu.__module__.endswith(".kernels.triton_ops") and not v.glu.__module__.startswith("gdnpass")


def test_ab_kernels_names_a_base_it_cannot_read(tmp_path):
    for base, says in ((str(tmp_path / "missing"), "not a folder holding a gdnpass package"),
                       (str(tmp_path / "old_layout_file.py"), "not a folder holding a gdnpass package"),
                       ("no-such-revision", "")):
        with pytest.raises(SystemExit, match=f"ab_kernels: --base {base}: {says}") as e:
            revisions.revision_module(base, tmp_path)
        assert "\n" not in str(e.value)


def test_ab_kernels_names_a_revision_without_the_kernels(tmp_path):
    """A package without the launchers (the first revisions had no kernels): refused in one line naming what is
    missing."""
    (tmp_path / "first" / "gdnpass").mkdir(parents=True)
    (tmp_path / "first" / "gdnpass" / "__init__.py").write_text("")
    base = str(tmp_path / "first")
    with pytest.raises(SystemExit, match=f"ab_kernels: --base {base}: no gdn_conv_chain launcher in "
                                         "kernels/triton_ssm.py or kernels/triton_ops.py") as e:
        revisions.revision_module(base, tmp_path)
    assert "\n" not in str(e.value)
