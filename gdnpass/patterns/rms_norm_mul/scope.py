"""What the RMS_NORM_MUL kernel can run, declared once: the matcher's ``scope.row-size`` rule, the record's check and
the launcher all ask it. Pure Python."""

ROW_MAX = 1 << 16  # elements of a row: one program holds whole rows in registers (models' rows are <= 16384)


def row_fits(ne0: int) -> bool:
    """Rows of 1..ROW_MAX elements."""
    return 1 <= ne0 <= ROW_MAX


def quantizes_rows(ne0: int) -> bool:
    """Rows the kernel also writes quantized for the products after it (gdnpass.prepasses): whole blocks of
    256, a row in one program's tile for its scale (RMS_NORM's tile holds a row of >= 512 elements alone)."""
    return ne0 % 256 == 0 and 512 <= ne0 <= ROW_MAX
