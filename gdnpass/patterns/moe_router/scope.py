"""What the MOE_ROUTER kernel can run, declared once: the matcher's ``scope.router-size`` rule, the record's check
and the launcher all ask it. Pure Python."""

from gdnpass.kernels.limits import ARGSORT_MAX_ROW


def router_fits(n_expert: int, n_used: int) -> bool:
    """Rows of 2..ARGSORT_MAX_ROW experts (a program sorts a whole row in registers, as ARGSORT's kernel), 1..n_expert
    of them used."""
    return 2 <= n_expert <= ARGSORT_MAX_ROW and 1 <= n_used <= n_expert
