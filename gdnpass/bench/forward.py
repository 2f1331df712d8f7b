"""The verify forward on the GPU, fusion off vs on: kernels and kernel time per forward (each profiled kernel lined
up with its node, so the alpha/beta and FFN products and the per-GDN-layer chain table can be read off), the weight
bytes one forward reads, the GPU time of the captured CUDA graph (ABBA medians); and the pass's own CPU time."""

from __future__ import annotations

import statistics
import time

import torch

from gdnpass import pipeline
from gdnpass.bench import upstream
from gdnpass.bench.matvec import product_weights
from gdnpass.bench.timing import kernel_advances, kernel_us, node_runner
from gdnpass.fusion import PATTERNS, fuse
from gdnpass.ir import Op, op_label, runs_kernel
from gdnpass.kernels.triton_core import PDL_SUPPORTED, PREFETCH_SUPPORTED, l2_prefetch, programmatic_launch
from gdnpass.kernels.triton_matvec import PRE_PASS_NAME
from gdnpass.launches import graph_launches
from gdnpass.models import VerifyConfig, default_ids
from gdnpass.models.hparams import ModelShape
from gdnpass.models.fill import fill
from gdnpass.pipeline import PassOptions
from gdnpass.runtime import Executor, programmatic_launch_pays


def forward_executor(cfg: VerifyConfig, fused: bool, without: str | None = None, model=None, weights_of=None,
                     share_pre_passes: bool = True):
    """The forward planned, fused (every registered pattern but ``without``) or not, on the GPU, filled (``model``:
    a GgufModel whose graph it is, its weight types; the weights are seeded, not the file's). ``weights_of``: an
    executor of the same forward whose weights buffer this one shares (one copy of a 9B's 17 GiB for all variants:
    four would not fit an 80 GB card), where the two graphs lay their weights out alike (fusion leaves the weights
    where the builder put them). ``share_pre_passes``: the executor's (:mod:`gdnpass.prepasses`)."""
    res = pipeline.run(cfg if model is None else model.build(cfg), PassOptions(fusion=fused),
                       fuse_now=without is None)
    g, report = res.graph, res.report
    if without is not None:
        report = fuse(g, enabled=True, patterns=[p for p in PATTERNS if p.name != without])
    shared = {}
    if weights_of is not None and _weight_layout(g) == _weight_layout(weights_of.graph):
        shared["weights"] = weights_of.buffers["weights"]
    ex = Executor(g, device="cuda", buffers=shared, share_pre_passes=share_pre_passes)
    fill(ex, seed=2, ids=default_ids(cfg), keep=shared)
    return g, ex, report


def _weight_layout(g) -> tuple:
    """The weights buffer's size and where each of its leaves lies: two graphs alike in this share the buffer."""
    return g.buffers.get("weights"), sorted((t.name, t.offset, t.nbytes) for t in g.leafs
                                            if t.buffer == "weights" and not t.is_view)


def same_memory(a: Executor, b: Executor) -> bool:
    """Whether two executors of one graph and memory plan hold the same bytes in every tensor (outputs, caches, the
    arena's intermediates: what two runs that differ only in how their kernels launch must leave; the alignment gaps
    between tensors hold whatever the allocator left)."""
    spans = {(t.base.buffer, t.base.offset, t.base.nbytes) for t in a.graph.tensors()
             if t.base.buffer in a.buffers and t.base.offset is not None}
    return all(torch.equal(a.buffers[k][lo:lo + n], b.buffers[k][lo:lo + n]) for k, lo, n in spans)


def shared_pre_passes(ex: Executor) -> dict:
    """The products of ``ex``'s graph that skip their pre-pass (:mod:`gdnpass.prepasses`), uid -> the product whose
    pre-pass they read."""
    return ex.pre_passes.shared if ex.pre_passes is not None else {}


def product_kind(n) -> str | None:
    """'alpha/beta', 'experts' (MUL_MAT_ID) or 'ffn' (the rest of the FFN) for the products the forward table
    reports alone."""
    if n.op is Op.MUL_MAT_ID:
        return "experts"
    names = [w.name for w in product_weights(n)]
    if any("ssm_alpha" in m or "ssm_beta" in m for m in names):
        return "alpha/beta"
    if any(".ffn_" in m for m in names):
        return "ffn"
    return None


def forward_kernels(g, ex: Executor) -> dict:
    """Kernels per forward and their summed duration, the same for the alpha/beta and FFN products, and the
    per-GDN-layer chain table (upstream.chain_table, the classification upstream's kernels get): the profiled
    kernels are the nodes' launches in order (gdnpass.launches), so each duration has its node."""
    total, ks = kernel_us(ex.run, reps=3)
    shared = shared_pre_passes(ex)
    nodes = launch_nodes(g, ex, len(ks))
    res = dict(kernels=len(ks), kernel_us=total)
    if len(nodes) == len(ks):
        for kind in ("alpha/beta", "ffn", "experts"):
            d = [t for n, t in zip(nodes, ks) if product_kind(n) == kind]
            res[kind] = dict(kernels=len(d), kernel_us=sum(d))
        res["chain"] = upstream.chain_table([(node_class(n), t) for n, t in zip(nodes, ks)])
        res["by_op"] = upstream.kernel_totals(list(zip(nodes, ks)), group=kernel_group)
    if any(w.type.is_quantized for n in g.nodes for w in product_weights(n)) or \
            any(n.op is Op.MUL_MAT_ID and n.src[0].type.is_quantized for n in g.nodes):
        # the quantized products' activation pre-passes that run (counted in their ops' lines too), apart: at most
        # what their producers making them could save; and how many are shared (gdnpass.prepasses)
        pre_us, pre = kernel_us(ex.run, reps=3, only=PRE_PASS_NAME)
        res["prepass"] = dict(kernels=len(pre), kernel_us=pre_us, shared=len(shared))
    return res


def forward_advances(g, ex: Executor) -> dict:
    """What each op costs the stream, launched as the options stand (programmatic dependent launch on or off): the
    span of one forward's kernels and each kernel's advance of its end (:func:`timing.kernel_advances`) summed by
    op as the by-op line groups them: two variants compare op by op where one loses time."""
    span, adv = kernel_advances(ex.run)
    nodes = launch_nodes(g, ex, len(adv))
    by_op = upstream.kernel_totals(list(zip(nodes, adv)), group=kernel_group) if len(nodes) == len(adv) else []
    return dict(span_us=span, advance_by_op=by_op)


def launch_nodes(g, ex: Executor, kernels: int) -> list:
    """The node of each of the ``kernels`` profiled kernels of one forward, in order (gdnpass.launches); where they do
    not number ``kernels`` (a node on a torch composite launches more than one kernel), as each node launches alone
    (:func:`measured_launches`)."""
    nodes = [n for n, k in graph_launches(g, shared_pre_passes(ex)) for _ in range(k)]
    return nodes if len(nodes) == kernels else measured_launches(g, ex)


def kernel_group(n) -> str:
    """A kernel's group in the by-op line: its op as reports name it, a product with its weights' names, the layer
    cut ("MUL_MAT ffn_down", "MUL_MAT_VEC_PAIR ssm_alpha+ssm_beta")."""
    ws = product_weights(n)
    if not ws:
        return op_label(n)
    # "blk.3.ffn_down.weight" -> "ffn_down", "output.weight" (the lm head) -> "output"
    return f"{n.op.value} " + "+".join(w.base.name.removesuffix(".weight").split(".")[-1] for w in ws)


def measured_launches(g, ex: Executor) -> list:
    """The nodes' launches in order as the profiler counts them: each node run alone (as a CUDA graph), once per
    distinct (op, shapes, types, parameters); for forwards where launches.node_launches is not exact."""
    counts: dict[str, int] = {}
    out = []
    for n in g.nodes:
        if not runs_kernel(n):
            continue
        key = repr((n.op, n.ne, n.type, sorted(n.op_params.items(), key=str),
                    [(s.ne, s.type, s.nb) if s is not None else None for s in n.src]))
        if key not in counts:
            counts[key] = len(kernel_us(node_runner(ex, n), reps=1)[1])
        out += [n] * counts[key]
    return out


_NODE_CLASSES = {Op.GDN_CONV_CHAIN: "FUSED", Op.MUL_MAT_VEC_PAIR: "PAIR", Op.GATED_DELTA_NET: "GDN"}


def node_class(n) -> str:
    """A node's class for upstream.chain_table (its op, with the fused ops and SILU named as there)."""
    if n.op is Op.UNARY and n.op_params.get("kind") == "SILU":
        return "SILU"
    return _NODE_CLASSES.get(n.op, n.op.name)


def chosen_experts(g, ex: Executor) -> dict[int, set[int]]:
    """The experts each expert stack's MUL_MAT_IDs read in an eager run of ``ex`` (their ids probed as they are
    read): stack uid -> expert indices."""
    id_nodes = [n for n in g.nodes if n.op is Op.MUL_MAT_ID]
    chosen: dict[int, set[int]] = {}
    for n, ids in zip(id_nodes, ex.run_probed([n.src[2] for n in id_nodes]) if id_nodes else []):
        chosen.setdefault(n.src[0].base.uid, set()).update(ids.flatten().tolist())
    return chosen


def expert_bytes_read(g, chosen: dict[int, set[int]]) -> int:
    """Bytes of the experts the MUL_MAT_IDs read (:func:`chosen_experts`)."""
    stacks = {n.src[0].base.uid: n.src[0].base for n in g.nodes if n.op is Op.MUL_MAT_ID}
    return sum(len(chosen[uid]) * w.nb[2] for uid, w in stacks.items())


def weight_bytes_read(g, ex: Executor | None = None) -> int:
    """Bytes of the weights one forward reads: every weights-buffer leaf whole, but the rows GET_ROWS gathers of a
    leaf only GET_ROWS reads (the token embedding), and of an expert stack only MUL_MAT_ID reads, the experts its ids
    chose (``ex``: an eager run's, :func:`chosen_experts`; without ``ex``, every expert)."""
    chosen = chosen_experts(g, ex) if ex is not None else {}
    readers: dict[int, list] = {}
    for n in g.nodes:
        for s in n.src:
            if s is not None and s.base.buffer == "weights":
                readers.setdefault(s.base.uid, []).append((n, s.base))
    total = 0
    for uses in readers.values():
        base = uses[0][1]
        if all(n.op is Op.GET_ROWS for n, _ in uses):
            total += sum(n.ne[1] * n.ne[2] * n.ne[3] for n, _ in uses) * base.nb[1]
        elif base.uid in chosen and all(n.op is Op.MUL_MAT_ID for n, _ in uses):
            total += len(chosen[base.uid]) * base.nb[2]
        else:
            total += base.nbytes
    return total


def bench_forward(T: int, rows: int, rounds: int, whole: bool = False, without: str | None = None,
                  wtype: str = "bf16", gguf=None, shape: str | ModelShape = "qwen3.5-9b") -> dict:
    """The 24 GDN layers of ``shape`` with their FFNs (one shared set of weights), or ``whole``: its whole forward
    with its own weights (token embedding, every layer, lm head; the projections and the embedding ``wtype``: bf16,
    or a block type's random blocks), after upstream's prompt (n_past upstream.N_PROMPT); ``gguf``: the whole
    forward of that model file, with its weight types (seeded values). The weights read count an expert stack's
    experts the run's router chose (:func:`weight_bytes_read`). ``without``: a third variant, fused with every
    pattern but that one (what it saves). Where products share pre-passes (:mod:`gdnpass.prepasses`), "unshared" is
    fusion on with every product running its own (what sharing saves). Where
    programmatic dependent launch is supported (triton_core.PDL_SUPPORTED), every variant's CUDA graph is captured
    with it or not as the executor captures it (runtime.programmatic_launch_pays) and "other launch" is fusion on
    the other way; kernel durations are always those of serial launches, and each variant's advances
    (:func:`forward_advances`) those of its own launches. Where the weights' L2 prefetch is
    supported (triton_core.PREFETCH_SUPPORTED), "no prefetch" is fusion on without it."""
    model = None
    if gguf is not None:
        from gdnpass.models.gguf_model import open_model

        model = open_model(gguf)
        cfg = model.config(n_tokens=T, n_rs_seq=rows - 1, dflash=True, n_past=upstream.N_PROMPT)
        wtype = model.weights_summary()
    else:
        cfg = VerifyConfig(shape, T, rows - 1, share_weights=not whole, dflash=True, whole=whole,
                           n_past=upstream.N_PROMPT if whole else 0, wtype=wtype)
    res = {}
    runs = {}
    # (name, fused, the pattern left out, flip: launched the other way than the executor captures by default, shared
    # pre-passes, L2 prefetch); "other launch": fusion on, with programmatic dependent launch where the default is
    # serial launches, or the reverse (what the default, runtime.programmatic_launch_pays, wins)
    variants = [("off", False, None, False, True, True), ("on", True, None, False, True, True)]
    variants += ([("without", True, without, False, True, True)] if without else [])
    variants += ([("other launch", True, None, True, True, True)] if PDL_SUPPORTED else [])
    variants += [("unshared", True, None, False, False, True)]
    variants += ([("no prefetch", True, None, False, True, False)] if PREFETCH_SUPPORTED else [])
    for name, fused, left_out, flip, share, prefetch in variants:
        if not share and not shared_pre_passes(runs["on"]):
            continue  # (nothing shared: "on" is this variant)
        g, ex, report = forward_executor(cfg, fused, left_out, model, weights_of=runs.get("off"),
                                         share_pre_passes=share)
        pdl = PDL_SUPPORTED and programmatic_launch_pays(g) != flip
        with l2_prefetch(prefetch):
            kernels = forward_kernels(g, ex)  # (serial launches' durations: timing.kernel_us)
            with programmatic_launch(pdl):
                kernels.update(forward_advances(g, ex))
            ex.capture(pdl=pdl)
        res[name] = dict(nodes=len(g.nodes), launches=sum(k for _, k in graph_launches(g, shared_pre_passes(ex))),
                         **kernels, fusion=report.summary() if fused else "off",
                         weight_bytes=weight_bytes_read(g, ex), pdl=pdl, prefetch=prefetch)
        if "experts" in res[name]:
            res[name]["experts"]["bytes"] = expert_bytes_read(g, chosen_experts(g, ex))
        runs[name] = ex
    for name in ("unshared", "no prefetch"):  # (each ran the same runs as "on" from the same fill: the same bytes)
        if name in runs:
            res[name]["outputs_identical"] = same_memory(runs["on"], runs[name])
    times = {name: [] for name in runs}

    def replay_ms(ex):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        ex.run()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    for r in range(rounds):
        order = list(runs)
        for name in order + order[::-1]:  # ABBA (ABCCBA)
            times[name].append(statistics.median(replay_ms(runs[name]) for _ in range(10)))
    for name in times:
        res[name]["us_per_forward"] = statistics.median(times[name]) * 1e3
    res["T"], res["rows"], res["gdn_layers"], res["left_out"] = T, rows, len(cfg.shape.gdn_layers), without
    res["pdl"], res["wtype"] = PDL_SUPPORTED, wtype
    return res


def bench_pass(n=10, patterns: int | None = None) -> dict:
    """The pass on the CPU: fuse() on the 24-layer graph (T=8, 7 rows, DFlash taps), each run on a freshly built and
    planned graph, ``n`` times, with the registry's first ``patterns`` patterns (None: all); median and min ms."""
    chosen = PATTERNS[:patterns]
    times = []
    for _ in range(n):
        cfg = VerifyConfig("qwen3.5-9b", 8, 7, dflash=True)
        g = pipeline.run(cfg, PassOptions(fusion=True), fuse_now=False).graph
        t0 = time.perf_counter()
        report = fuse(g, enabled=True, patterns=chosen)
        times.append((time.perf_counter() - t0) * 1e3)
    return dict(patterns=[p.name for p in chosen], median_ms=statistics.median(times), min_ms=min(times),
                nodes=len(g.nodes), summary=report.summary())

