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


def test_a_kernels_advance_is_its_end_past_the_one_before():
    """bench's per-op advances (timing.stream_advances): serial kernels advance the stream by their own time and the
    gap before them; under programmatic dependent launch a kernel that started early (waiting inside) advances it only
    by how far past its predecessor it ends. Both sum to the span."""
    from gdnpass.bench.timing import stream_advances

    assert stream_advances([(0.0, 4.0), (5.0, 9.0), (9.5, 12.0)]) == (12.0, [4.0, 5.0, 3.0])
    span, adv = stream_advances([(0.0, 4.0), (1.0, 6.0), (2.0, 8.0)])  # each launched while the one before ran
    assert span == 8.0 and adv == [4.0, 2.0, 2.0] and sum(adv) == span
