"""The whole-forward bench's byte count (gdnpass.bench.forward.weight_bytes_read), on the CPU."""

from gdnpass import pipeline
from gdnpass.bench.forward import weight_bytes_read
from gdnpass.ir import Op
from gdnpass.models import VerifyConfig, default_ids
from gdnpass.models.fill import fill
from gdnpass.models.hparams import get_model
from gdnpass.pipeline import PassOptions
from gdnpass.runtime import Executor


def test_an_expert_stack_counts_the_experts_its_router_chose():
    # one token: each layer's router picks n_expert_used distinct experts, so each of its gate / up / down stacks
    # is read for exactly those, not for all n_expert
    m = get_model("tiny-qwen35moe")
    cfg = VerifyConfig(m, 1, 0, whole=True, n_past=4, wtype="bf16")
    g = pipeline.run(cfg, PassOptions(fusion=True)).graph
    ex = Executor(g)
    fill(ex, seed=2, ids=default_ids(cfg))
    stacks = {n.src[0].base.uid: n.src[0].base for n in g.nodes if n.op is Op.MUL_MAT_ID}
    assert len(stacks) == 3 * m.n_layer
    unread = sum((m.n_expert - m.n_expert_used) * w.nb[2] for w in stacks.values())
    assert weight_bytes_read(g, ex) == weight_bytes_read(g) - unread


def test_same_memory_compares_every_byte():
    """What the whole-forward bench says of "on" against "unshared": two executors of one graph filled and run
    alike hold the same bytes in every buffer; one changed cache byte says otherwise."""
    from gdnpass.bench.forward import same_memory

    cfg = VerifyConfig("tiny-dc4-h64", 4, 3, n_layers=1)
    g = pipeline.run(cfg, PassOptions(fusion=True)).graph
    a, b = Executor(g), Executor(g)
    for ex in (a, b):
        fill(ex, seed=2)
        ex.run()
    assert same_memory(a, b)
    b.buffers["cache"][7] ^= 1
    assert not same_memory(a, b)
