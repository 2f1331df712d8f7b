"""The MOE_ROUTER kernel against the six unfused Triton kernels (byte for byte) and its torch reference (byte for
byte: in the interpreter the reference's exp is the kernels', conftest's kernel_exp; SOFT_MAX's f64 sum order is
far below the f32 rounding of 1/Σ), at the routers' shapes on small grids; and what the launcher refuses. Logits of
std 0.1 + a per-expert ramp: no ties (docs/moe.md: the reference leaves their order to a stable sort). On a GPU,
every test here runs compiled, and one more at the 35B-A3B router (256 experts, 8 used)."""

import pytest
import torch

from gdnpass.errors import KernelError
from gdnpass.kernels import triton_attention as att
from gdnpass.kernels import triton_elementwise as elt
from gdnpass.kernels import triton_norms as norms
from gdnpass.kernels import triton_sort as sort
from gdnpass.kernels.limits import ARGSORT_MAX_ROW
from gdnpass.patterns.moe_router import kernel
from support.arena import DEVICE, Arena
from support.compare import assert_bits, assert_same_bytes

LO, HI = 6.103515625e-5, float("inf")  # build_moe_ffn's clamp of the weights' sum


def logits(n_exp: int, n_t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ramp = torch.randperm(n_exp, generator=g).float() * 1e-3  # distinct per expert: no ties
    return (0.1 * torch.randn(n_t, n_exp, generator=g) + ramp).view(1, 1, n_t, n_exp).to(DEVICE)


def unfused(a: Arena, x, n_used, lo=LO, hi=HI):
    """SOFT_MAX, ARGSORT (DESC), GET_ROWS of its top-k view, SUM_ROWS, CLAMP, DIV: six launches, as the graph's."""
    n_t, n_exp = x.shape[2], x.shape[3]
    probs = a.view(tuple(x.shape))
    att.soft_max(x, None, None, 1.0, 0.0, probs)
    order = a.view(tuple(x.shape), torch.int32)
    sort.argsort(probs, 1, order)
    w = a.view((1, n_t, n_used, 1))
    elt.get_rows(probs.reshape(1, n_t, n_exp, 1), order[..., :n_used], w)
    w = w.view(1, 1, n_t, n_used)
    total = a.view((1, 1, n_t, 1))
    norms.sum_rows(w, total)
    elt.clamp(total, lo, hi, total)  # (in place, as gallocr plans it)
    y = a.view((1, 1, n_t, n_used))
    elt.div(w, total, y)
    return order, y


def fused(a: Arena, x, n_used, lo=LO, hi=HI, order_stride=None):
    order = a.view(tuple(x.shape), torch.int32, row_stride=order_stride)
    y = a.view((1, 1, x.shape[2], n_used))
    a.run(lambda: kernel.moe_router(x, n_used, lo, hi, order, y), order, y)
    return order, y


# (experts, used, tokens, the logits' row stride)
CASES = [(8, 2, 4, None), (8, 8, 1, None), (16, 4, 3, 20), (64, 8, 2, None), (100, 3, 2, None), (256, 8, 4, None),
         (256, 2, 1, 260)]


@pytest.mark.parametrize("n_exp,n_used,n_t,stride", CASES)
def test_fused_equals_unfused_and_reference(n_exp, n_used, n_t, stride, kernel_exp):
    a = Arena()
    x = a.put(logits(n_exp, n_t, n_exp + n_t), row_stride=stride)
    order, y = fused(a, x, n_used, order_stride=stride and stride + 4)
    u_order, u_y = unfused(a, x, n_used)
    assert_same_bytes(order, u_order, "argsort vs unfused")
    assert_same_bytes(y, u_y, "weights vs unfused")
    r_order, r_y = kernel.reference(x, n_used, LO, HI)
    assert_same_bytes(order, r_order, "argsort vs reference")
    assert_same_bytes(y, r_y, "weights vs reference")
    assert torch.allclose(y.sum(-1).double().cpu(), torch.ones(n_t, dtype=torch.float64), atol=1e-6)  # (normalised)


def test_the_clamp_and_edge_values_pass_through_as_unfused(kernel_exp):
    """A clamp that bites (hi below the sum), a NaN logit in one row (the row NaN throughout, its order by torch's
    NaN placement), -inf logits (zero probabilities) and signed zeros."""
    a = Arena()
    x = logits(16, 4, 3)
    x[0, 0, 1, 5] = float("nan")
    x[0, 0, 2, :3] = float("-inf")
    x[0, 0, 3, 7] = -0.0
    x = a.put(x)
    for lo, hi in ((LO, HI), (0.0, 0.5), (0.9, 2.0)):
        order, y = fused(a, x, 4, lo, hi)
        u_order, u_y = unfused(a, x, 4, lo, hi)
        assert_same_bytes(order, u_order, f"argsort, clamp [{lo}, {hi}]")
        assert_bits(y, u_y, f"weights, clamp [{lo}, {hi}]")  # (row 1's NaNs: a.run saw no stray byte)
    assert y[0, 0, 1].isnan().all() and not y[0, 0, 0].isnan().any()


def test_the_launcher_refuses_what_the_kernel_cannot_run():
    a = Arena()
    x = a.put(logits(8, 2, 0))
    order, y = a.view((1, 1, 2, 8), torch.int32), a.view((1, 1, 2, 2))
    with pytest.raises(KernelError, match="9 of 8 experts"):
        kernel.moe_router(x, 9, LO, HI, order, a.view((1, 1, 2, 9)))
    wide = a.put(logits(ARGSORT_MAX_ROW + 1, 1, 0))
    with pytest.raises(KernelError, match=f"2..{ARGSORT_MAX_ROW} experts"):
        kernel.moe_router(wide, 2, LO, HI, a.view(tuple(wide.shape), torch.int32), a.view((1, 1, 1, 2)))
    with pytest.raises(KernelError, match="overlaps"):
        kernel.moe_router(x, 2, LO, HI, order, x[..., :2])
    with pytest.raises(KernelError, match="NaN bound"):
        kernel.moe_router(x, 2, float("nan"), HI, order, y)
    with pytest.raises(KernelError, match="into"):
        kernel.moe_router(x, 2, LO, HI, order.float(), y)


@pytest.mark.parametrize("n_exp,n_t,div_at", [(256, 8, 128), (16, 130, 640)])
def test_serial_stores_over_the_logits_as_gallocr_plans_them(n_exp, n_t, div_at, kernel_exp):
    """The DIV inside the logits (gallocr's plan from 8 tokens: the probabilities are dead by then), ``div_at`` bytes
    on: one program walking the tiles in order writes the unfused bytes (the unfused kernels run on a copy of the
    logits); the serial guard accepts it, and refuses the DIV on the second tile's logits."""
    a = Arena()
    x0 = logits(n_exp, n_t, 7)
    want_order, want_y = unfused(a, a.put(x0), 4)
    block_r, _ = kernel.soft_max_tile(n_exp)
    assert n_t > block_r  # (several tiles)
    x = a.put(x0)
    y = x.reshape(-1)[div_at // 4: div_at // 4 + 4 * n_t].view(1, 1, n_t, 4)
    order = a.view(tuple(x.shape), torch.int32)
    kernel.moe_router(x, 4, LO, HI, order, y, serial=True)
    assert_same_bytes(order, want_order, "argsort")
    assert_same_bytes(y, want_y, "weights")
    later = x.reshape(-1)[block_r * n_exp:][: 4 * n_t].view(1, 1, n_t, 4)  # on tile 1's logits
    with pytest.raises(KernelError, match="overlaps"):
        kernel.moe_router(x, 4, LO, HI, order, later, serial=True)
    with pytest.raises(KernelError, match="overlaps"):
        kernel.moe_router(x, 4, LO, HI, order, y)  # (a program a tile: no overlap at all)


def test_programs_and_variants():
    from types import SimpleNamespace

    for serial, want in ((False, [("moe_router", 2, 1)]), (True, [("moe_router", 1, 2)])):
        node = SimpleNamespace(src=[SimpleNamespace(ne=(256, 8, 1, 1))], op_params={"serial": serial})
        assert kernel.programs(node) == want  # SOFT_MAX's tile: 4 rows of 256; serial: one program, 2 tiles
    assert {c["BLOCK_C"] for _, c, _ in kernel.variants()} == {8, 128, 256, 512, 1024}


@pytest.mark.gpu
@pytest.mark.parametrize("n_t", [4, 8])
@pytest.mark.parametrize("serial", [False, True])
def test_gpu_35b_router_compiled_matches_unfused(n_t, serial):
    """The 35B-A3B router (256 experts, 8 used), compiled: the fused kernel's bytes are the six unfused kernels',
    one program a tile and serial (with the DIV inside the logits, as gallocr plans it from 8 tokens)."""
    a = Arena()
    for seed in range(20):
        x0 = logits(256, n_t, seed)
        want_order, want_y = unfused(a, a.put(x0), 8)
        x = a.put(x0)
        order = a.view(tuple(x.shape), torch.int32)
        y = x.reshape(-1)[64: 64 + 8 * n_t].view(1, 1, n_t, 8) if serial else a.view((1, 1, n_t, 8))
        kernel.moe_router(x, 8, LO, HI, order, y, serial=serial)
        torch.cuda.synchronize()
        assert_same_bytes(order, want_order, f"argsort, seed {seed}")
        assert_same_bytes(y, want_y, f"weights, seed {seed}")
