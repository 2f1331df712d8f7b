"""Graph surgery on a small planned verify graph (tiny-dc4-h64, 1 layer, n_t=4, n_rs_seq=3, 2 cells: the pipeline's
prepare + plan, not fused): the conv chain's and the mat-vec pair's trip graphs (tests/patterns/*/trips.py) are such
a graph with one node moved, added or changed."""

from __future__ import annotations

from gdnpass import ops
from gdnpass.ir import DType, Flag, Graph, Op
from gdnpass.models import VerifyConfig
from gdnpass.patterns.pair_glu import PATTERN as PAIR_GLU
from gdnpass.pipeline import PassOptions, run

BASE = dict(model="tiny-dc4-h64", n_tokens=4, n_rs_seq=3, n_layers=1, mem_size=2)
SPLIT_FFN = PAIR_GLU.example["model"]  # a model whose FFN pair's tile splits K at 8 columns (pair_glu's scope)
IDS = [1]  # s_copy: plane 0 of cell 1 (the ubatch's cell is 0): a row none of the snapshots writes


def planned(**kw) -> Graph:
    """A verify graph built, prepared for fusion and planned by the pipeline (not fused): ``BASE`` + ``kw``."""
    return run(VerifyConfig(**{**BASE, **kw}), PassOptions(fusion=True), fuse_now=False).graph


def chain(g: Graph) -> dict:
    n = {t.name: t for t in g.nodes}
    concat = n["conv_input-0"]
    windows = [w for w in g.nodes if w.op is Op.VIEW and w.view_src is concat]
    cpys = [c for c in g.nodes if c.op is Op.CPY and c.src[0] in windows]
    # q_l2 / k_l2: what the GDN reads (the L2_NORM, or the RMS form's SCALE); k_norm: k's L2_NORM or RMS_NORM
    k_l2 = n["k_conv_predelta-0"]
    return dict(concat=concat, gr=n["conv_states-0"], conv=n["conv_output_raw-0"], silu=n["conv_output_silu-0"],
                q=n["q_conv-0"], k=n["k_conv-0"], q_l2=n["q_conv_predelta-0"], k_l2=k_l2,
                k_norm=k_l2.src[0] if k_l2.op is Op.SCALE else k_l2,
                cpys=cpys, dsts=[c.src[1] for c in cpys], windows=windows, ids=n["rs_s_copy_main"],
                proj=n["linear_attn_qkv_mixed-0"].base, weight=n["conv_output_raw-0"].src[1],
                cache=concat.src[0].src[0].src[0].base, attn_norm=n["attn_norm-0"],
                attn_residual=n["attn_residual-0"], l_out=n["l_out-0"])


def insert_after(g: Graph, anchor, node, offset=None, buffer="arena"):
    """Put ``node`` right after ``anchor``; a non-view gets bytes of ``buffer`` at ``offset`` (default: past the
    arena's end, bytes nothing else uses)."""
    if node.view_src is None:
        node.buffer = buffer
        node.offset = g.buffers["arena"] if offset is None else offset
        if buffer == "arena":
            g.buffers["arena"] = max(g.buffers["arena"], node.offset + node.nbytes)
    g.nodes.insert(g.index(anchor) + 1, node)
    node.flags |= Flag.COMPUTE
    return node


def insert_before(g: Graph, anchor, node, offset=None):
    return insert_after(g, g.nodes[g.index(anchor) - 1], node, offset)


def arena_tensor(name, nbytes):
    return ops.new_tensor(name, DType.F32, (nbytes // 4,), buffer="arena")


def read_bytes_of(g: Graph, t, after) -> None:
    """Right after ``after``, a node reads ``t``'s bytes through a tensor of its own (an arena leaf at their offset:
    no graph edge, so no user count sees it): an ADD of them to themselves, OUTPUT (run --check compares every ADD)."""
    alias = ops.new_tensor(f"{t.name} bytes", DType.F32, (t.nelements,), buffer="arena")
    alias.offset = t.offset
    g.leafs.append(alias)
    insert_after(g, after, ops.add(alias, alias)).flags |= Flag.OUTPUT


def feed_layer_output(g: Graph, c: dict, t):
    """Make ``t``'s first (up to) 64 elements flow into the layer output (l_out = ffn_out + (attn_residual + t)), so a
    stale read in ``t`` shows in the compared bytes."""
    n = min(64, t.nelements)
    assert 64 % n == 0
    v = insert_before(g, c["l_out"], ops.view_1d(t, n, 0))
    r = insert_before(g, c["l_out"], ops.add(c["attn_residual"], v))
    c["l_out"].src[1] = r


def byte_lo(t) -> int:
    return t.base.offset + t.view_offs
