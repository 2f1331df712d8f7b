"""Trip graphs of the conv chain's rules (tests/patterns/test_rules.py runs them, with every registered pattern's): for
every rule, a mutation of a small planned verify graph (tests/support/surgery.py: tiny-dc4-h64, 1 layer, n_t=4,
n_rs_seq=3; of one sequence, or of two, ``SEQS2``) that breaks that rule and no other; for every hazard, a graph
where forcing the rewrite past it corrupts bytes. The runtime data is arranged so that the move matters (the ids an
in-between node writes differ from the ones read; a stale read feeds the layer output). The ids are recorded in the
graph (``meta.ids``, which the check's fill reads): one sequence reads row 1 (a row no snapshot writes); of two, the
first reads row 1, the row the second's plane 0 writes (find_slot's swap), and the second row 2, a spare cell's.

``alias.output-overlaps-input`` is a race between the programs of one Triton launch (the torch references compute
every result before writing any output): its proof runs the Triton kernels of the chain's ops, fused and unfused, in
the interpreter, the rest of the graph on torch.
"""

from __future__ import annotations

from gdnpass import ops
from gdnpass.ir import DType, Flag
from gdnpass.kernels import backends
from gdnpass.models import ModelShape
from gdnpass.patterns.conv_chain import ConvChain
from support.graphs import CHAIN_OPS, triton_for
from support.surgery import (IDS, arena_tensor, byte_lo, chain, feed_layer_output, insert_after, insert_before,
                             planned)
from support.trips import Trip

SEQS2 = dict(n_seqs=2, mem_size=3)  # two sequences (cells 0 and 1) and a spare cell
IDS2 = [1, 2]  # their gathered rows: the row sequence 1's plane 0 writes, and the spare cell's plane 0


# ---- the conv chain: structure and scope ----------------------------------------------------------------------------


def m_concat_dim(g, c):
    c["concat"].op_params["dim"] = 1


def m_state_from_mid_cache(g, c):  # GET_ROWS from a view of the cache at row 1, not at offset 0
    cache = c["cache"]
    rows = insert_before(g, c["gr"], ops.view_2d(cache, cache.ne[0], cache.ne[1] - 1, cache.nb[1], cache.nb[1]))
    c["gr"].src[0] = rows


def m_state_copied(g, c):  # CONCAT(CONT(the gathered state), ...): its first source is no RESHAPE(GET_ROWS)
    c["concat"].src[0] = insert_before(g, c["concat"], ops.cont(c["concat"].src[0]))


def m_projection_copied(g, c):  # CONCAT(state, CONT(TRANSPOSE(x))): its second source is no TRANSPOSE
    c["concat"].src[1] = insert_before(g, c["concat"], ops.cont(c["concat"].src[1]))


def m_extra_row(g, c):  # a 17th snapshot row
    w = ops.view_3d(c["concat"], *c["windows"][0].ne[:3], c["concat"].nb[1], c["concat"].nb[2], 0)
    cache = c["cache"]
    dst = ops.view_2d(cache, cache.ne[0], 1, cache.nb[1], cache.nb[1] * 1)  # row 1: cell 1, never a snapshot here
    cp = ops.cpy(w, dst)
    last = c["cpys"][-1]
    for t in (cp, dst, w):
        insert_after(g, last, t)


def m_cache_type(g, c):
    c["cache"].type = DType.F16


def m_weight_strided(g, c):  # SSM_CONV's weight: [d_conv, C] columns of a wider [2*d_conv, C] tensor
    w = c["weight"]
    wide = ops.new_tensor("conv1d_wide", DType.F32, (2 * w.ne[0], w.ne[1]), buffer="weights")
    wide.offset, g.buffers["weights"] = g.buffers["weights"], g.buffers["weights"] + wide.nbytes
    g.leafs.append(wide)
    c["conv"].src[1] = insert_before(g, c["conv"], ops.view_2d(wide, w.ne[0], w.ne[1], wide.nb[1], 0))


# ---- the CPY run, use counts, the norms -----------------------------------------------------------------------------


def m_window_column(g, c):
    c["windows"][0].view_offs = 4 * (c["concat"].ne[0] - 2)  # past column n_t


def m_window_read_twice(g, c):  # a second reader of a window
    insert_after(g, c["cpys"][0], ops.cont(c["windows"][0]))


def m_half_row(g, c):
    c["dsts"][0].view_offs += 4


def m_row_twice(g, c):
    c["dsts"][1].view_offs = c["dsts"][0].view_offs


def m_concat_user(g, c):
    insert_after(g, c["concat"], ops.cont(c["concat"]))


def m_concat_output(g, c):
    c["concat"].flags |= Flag.OUTPUT


def m_gr_user(g, c):
    insert_after(g, c["gr"], ops.cont(c["gr"]))


def m_conv_user(g, c):
    insert_after(g, c["conv"], ops.exp(c["conv"]))


def m_cpy_user(g, c):  # a node reads a snapshot CPY's result (the rewrite removes the CPY node)
    insert_after(g, c["cpys"][-1], ops.cont(c["cpys"][0]))


def m_k_geometry(g, c):
    c["k"].view_offs += 4


def m_rms_norm_user(g, c):  # a second reader of k's RMS_NORM output, which the fused node never writes
    insert_after(g, c["k_norm"], ops.cont(c["k_norm"]))


def m_scale_bias(g, c):
    c["k_l2"].op_params["b"] = 0.5


def m_k_eps(g, c):  # k's RMS_NORM with another eps than q's
    c["k_norm"].op_params["eps"] *= 2


def m_sequence_stride(g, c):  # plane 0's second sequence starts one element into a row
    for t in (c["dsts"][-1], c["cpys"][-1]):
        t.nb = (t.nb[0], t.nb[1] + 4, *t.nb[2:])


def m_sequences_on_one_row(g, c):  # plane 0's two sequences on one row (a sequence stride of 0)
    for t in (c["dsts"][-1], c["cpys"][-1]):
        t.nb = (t.nb[0], 0, *t.nb[2:])


# ---- the conv chain: hazards ----------------------------------------------------------------------------------------


def m_silu_across_channels(g, c):  # SiLU on the projection, but one element off: other programs' channels
    c["silu"].offset = c["conv"].offset = c["proj"].offset + 4


def m_window_on_a_gathered_row(g, c):
    """Two sequences, dedup layout: the windows' shared rows moved onto cache rows 2.., so sequence 0's windows land
    on the row sequence 1 gathers (IDS2[1] = 2), channel for channel elsewhere than a row's: the program of the first
    channels writes bytes that later programs still gather."""
    w, r = c["dsts"][0].base, c["cache"]
    w.offset = r.offset + IDS2[1] * r.nb[1]
    assert w.offset + w.nbytes <= r.offset + r.nbytes  # (inside the cache: nothing else of the buffer moves)


def m_write_row_between(g, c):  # after the fused position, a node writes snapshot row 0 (before its CPY did)
    insert_after(g, c["concat"], ops.exp(c["attn_norm"]), offset=byte_lo(c["dsts"][0]), buffer="cache")


def m_write_gathered_row_between(g, c):  # before the fused position, a node writes the row the ids gather
    row = c["cache"].nb[1] * IDS[0]
    insert_after(g, c["gr"], ops.exp(c["attn_norm"]), offset=c["cache"].offset + row, buffer="cache")


def m_write_ids_between(g, c):  # between GET_ROWS and CONCAT: ids := 2 (the runtime ids are IDS = [1])
    one = insert_after(g, c["gr"], ops.view_1d(c["attn_norm"], 1, 0))
    two = insert_after(g, one, ops.scale(one, 0.0, 2.0))
    insert_after(g, two, ops.cpy(two, c["ids"]))


def m_write_weight_between(g, c):
    insert_after(g, c["concat"], ops.scale(c["weight"], 2.0, inplace=True))


def m_write_silu_between(g, c):  # scribbles on the SiLU block after the fused node wrote it there
    insert_after(g, c["concat"], ops.exp(c["attn_norm"]), offset=c["silu"].offset)


def m_read_silu_between(g, c):  # reads the SiLU block before SILU ran (the fused node has written it by then)
    t = arena_tensor("stale", 256)
    t.offset = c["silu"].offset
    feed_layer_output(g, c, insert_after(g, c["concat"], ops.exp(t)))


def m_read_row_between(g, c):  # reads snapshot row 0 before its CPY ran
    feed_layer_output(g, c, insert_after(g, c["concat"], ops.cont(c["dsts"][0])))


# ---- the table -------------------------------------------------------------------------------------------------------


TINY_DC6 = ModelShape("tiny-dc6", n_embd=64, n_layer=2, n_k_heads=1, n_v_heads=2, head_dim=32, d_conv=6)
TINY_H80 = ModelShape("tiny-h80", n_embd=64, n_layer=2, n_k_heads=1, n_v_heads=1, head_dim=80, d_conv=4)  # llama.cpp
# accepts any head size; the fused kernel's heads are powers of two

TRIPS = [
    Trip("structure.concat", m_concat_dim),
    Trip("structure.state", m_state_from_mid_cache),
    Trip("structure.state", m_state_copied, name="copied"),
    Trip("structure.projection", m_projection_copied),
    Trip("scope.n-seqs", config=dict(n_seqs=129, mem_size=129)),
    Trip("scope.n-tokens", config=dict(n_tokens=17)),
    Trip("scope.n-rows", m_extra_row, config=dict(n_rs_seq=15)),
    Trip("scope.d-conv", config=dict(model=TINY_DC6)),
    Trip("scope.type", m_cache_type),
    Trip("structure.weight", m_weight_strided),
    Trip("cpy-run.view-of-concat", m_window_column),
    Trip("cpy-run.view-of-concat", m_window_read_twice, name="read-twice"),
    Trip("cpy-run.whole-row", m_half_row),
    Trip("cpy-run.whole-row", m_sequence_stride, config=SEQS2, name="sequence-stride"),
    Trip("cpy-run.row-written-twice", m_row_twice),
    Trip("cpy-run.row-written-twice", m_sequences_on_one_row, config=SEQS2, name="sequences"),
    Trip("concat.user-count", m_concat_user),
    Trip("concat.user-count", m_concat_output, name="output"),
    Trip("get-rows.user-count", m_gr_user),
    Trip("ssm-conv.user-count", m_conv_user),
    Trip("cpy.user-count", m_cpy_user),
    Trip("scope.head-dim", config=dict(model=TINY_H80)),
    Trip("l2.head-geometry", m_k_geometry, config=dict(qk_norm="l2")),
    Trip("rms.head-geometry", m_k_geometry),
    Trip("rms.norm-use", m_rms_norm_user),
    Trip("rms.scale-bias", m_scale_bias),
    Trip("rms.same-params", m_k_eps),
    Trip("alias.output-overlaps-input", m_silu_across_channels, kernels="triton-chain"),
    Trip("alias.output-overlaps-input", m_window_on_a_gathered_row, config=dict(SEQS2, snapshot_layout="dedup"),
         kernels="triton-chain", name="window-on-a-sequence-row"),
    Trip("between.writes-cache", m_write_row_between, name="snapshot-row"),
    Trip("between.writes-cache", m_write_gathered_row_between, name="gathered-row"),
    Trip("between.writes-ids", m_write_ids_between),
    Trip("between.writes-weights", m_write_weight_between),
    Trip("between.writes-early-output", m_write_silu_between),
    Trip("between.reads-early-output", m_read_silu_between),
    Trip("between.reads-cache", m_read_row_between),
    Trip("between.touches-chain-buffer", m_write_silu_between, between="broad"),
]


def candidate(t: Trip | None = None, mutate: bool = True):
    """(graph, pattern, anchor) of a trip case (None: the plain graph); ``mutate=False``: the same graph unmutated."""
    g = planned(**(t.config if t else {}))
    g.meta["ids"] = {1: IDS, 2: IDS2}.get((t.config if t else {}).get("n_seqs", 1), g.meta["ids"])
    pattern = ConvChain()
    if t is not None and mutate and t.mutate:
        t.mutate(g, chain(g))
    (anchor,) = pattern.candidates(g)
    return g, pattern, anchor


def kernels(t: Trip) -> dict | None:
    """The kernel table of a force proof: torch, or with the Triton kernels (in the interpreter on a CPU) of the
    chain's ops, fused and unfused alike (the fused kernel is byte-identical to the unfused Triton kernels, not to
    torch's)."""
    if t.kernels == "torch":
        return backends.TORCH_BACKEND  # (named: on a GPU the executor's default is Triton)
    if t.kernels == "triton-chain":
        return triton_for(CHAIN_OPS)
    raise KeyError(t.kernels)
