"""What the ELEMENTWISE_CHAIN kernel can run, declared once: the matcher's ``scope.chain-length`` rule, the record's
check and the launcher all ask it. Pure Python."""

MAX_STEPS = 4   # nodes in one chain (Qwen3.5's longest: the GDN gate's ADD -> SOFTPLUS -> MUL)
MAX_SIDES = 2   # binary steps (each reads one operand besides the chain's value)

BINARY = {"ADD": "ADD", "MUL": "MUL", "RADD": "ADD", "RMUL": "MUL"}  # step -> op (R: the chain's value is src1)
UNARY = ("SILU", "SIGMOID", "SOFTPLUS", "EXP")                      # the UNARY kinds the Triton kernel computes


def steps_fit(steps: list[str], least: int = 2) -> bool:
    """``least`` (a chain: 2; one node's step, as GATED_DELTA_NET_CACHE computes its gates, or a product's store
    runs: 1) ..MAX_STEPS known steps, at most MAX_SIDES of them binary."""
    return (least <= len(steps) <= MAX_STEPS and all(s in BINARY or s in UNARY for s in steps)
            and sum(s in BINARY for s in steps) <= MAX_SIDES)


def sides_fit(steps: list[str], sides: int, least: int = 2) -> bool:
    """:func:`steps_fit`, with one side operand for each binary step."""
    return steps_fit(steps, least) and sides == sum(s in BINARY for s in steps)
