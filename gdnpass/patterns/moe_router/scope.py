"""What the MOE_ROUTER kernel can run, declared once: the matcher's ``scope.router-size`` rule, the record's check
and the launcher all ask it. Pure Python."""

from gdnpass.kernels.limits import ARGSORT_MAX_ROW


def router_fits(n_expert: int, n_used: int) -> bool:
    """Rows of 2..ARGSORT_MAX_ROW experts (a program sorts a whole row in registers, as ARGSORT's kernel), 1..n_expert
    of them used."""
    return 2 <= n_expert <= ARGSORT_MAX_ROW and 1 <= n_used <= n_expert


def serial_safe(logits: tuple[int, int], outs, logits_row: int, out_rows, block_r: int, n_t: int) -> bool:
    """Whether one program walking the tiles of ``block_r`` rows in order may store ``outs`` (byte ranges [lo, hi)
    with their row strides in bytes) over ``logits`` (its range, row stride ``logits_row``): no store of tile k
    reaches the logits of a tile after k (those of tile k are all loaded before its first store)."""
    for k in range(-(-n_t // block_r) - 1):
        later = (logits[0] + (k + 1) * block_r * logits_row, logits[1])
        for (lo, hi), row in zip(outs, out_rows):
            w = (lo + k * block_r * row, min(hi, lo + (k + 1) * block_r * row))
            if w[0] < later[1] and later[0] < w[1]:
                return False
    return True
