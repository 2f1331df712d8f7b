"""IR rules: ggml's view/stride/contiguity semantics, DFS expand order, use counts, validation errors, the pass's
node replacement."""

import pytest

from gdnpass import ops
from gdnpass.ir import DType, Graph, GraphError, Op, Tensor, byte_range, is_contiguous_n


def leaf(name, ne, type_=DType.F32, buffer="weights"):
    return ops.new_tensor(name, type_, ne, buffer=buffer)


def test_contiguous_strides_and_nbytes():
    a = leaf("a", (3, 5, 2))
    assert a.nb == (4, 12, 60, 120)
    assert a.nbytes == 120 and a.is_contiguous()


def test_transpose_swaps_ne_and_nb_and_is_a_view_of_the_base():
    a = leaf("a", (8, 4, 2))
    t = ops.transpose(a)
    assert t.ne == (4, 8, 2, 1) and t.nb == (32, 4, 128, 256)
    assert t.view_src is a and t.view_offs == 0
    assert not t.is_contiguous()


def test_permute_places_source_dims_at_axes():
    a = leaf("a", (2, 3, 5, 7))
    p = ops.permute(a, 0, 2, 1, 3)  # ggml: result.ne[axis_i] = a.ne[i]
    assert p.ne == (2, 5, 3, 7)
    assert p.nb == (4, 24, 8, 120)


def test_view_offsets_accumulate_to_the_base():
    a = leaf("a", (16, 4))
    v1 = ops.view_2d(a, 8, 2, a.nb[1], 64)
    v2 = ops.view_1d(v1, 4, 8)
    assert v2.view_src is a and v2.view_offs == 72
    assert v2.op_params["offset"] == 8


def test_view_past_its_base_is_refused_naming_the_node():
    a = leaf("a", (16, 4))
    with pytest.raises(GraphError, match="'too_far'.*past its base 'a'"):
        ops.view_1d(a, 16, 4 * 60, "too_far")


def test_reshape_needs_a_contiguous_source():
    a = leaf("a", (8, 4))
    with pytest.raises(GraphError, match="not contiguous"):
        ops.reshape(ops.transpose(a), 32)


def test_is_contiguous_n_rows_only():
    a = leaf("a", (8, 4, 3))
    v = ops.view_3d(a, 4, 4, 3, a.nb[1], a.nb[2], 0)  # half of each row
    assert not v.is_contiguous()
    assert is_contiguous_n(v, 1)  # rows contiguous: what UNARY asks for


def test_cpy_is_a_view_of_its_destination():
    src = leaf("src", (3, 8), buffer="input")
    cache = leaf("cache", (24, 4), buffer="cache")
    dst = ops.view_2d(cache, 24, 1, cache.nb[1], 2 * cache.nb[1])
    c = ops.cpy(ops.transpose(ops.transpose(src)), dst)
    assert c.op is Op.CPY and c.view_src is cache and c.view_offs == 2 * 96
    with pytest.raises(GraphError, match="elements"):
        ops.cpy(leaf("x", (5,)), dst)


def test_expand_is_dfs_post_order_src0_first_each_once():
    a, b = leaf("a", (4,)), leaf("b", (4,))
    x = ops.add(a, b)
    y = ops.mul(x, a)
    z = ops.add(y, x)
    g = Graph()
    g.expand(z)
    assert [n.op for n in g.nodes] == [Op.ADD, Op.MUL, Op.ADD]
    assert g.nodes == [x, y, z] and g.leafs == [a, b]
    g.expand(z)  # idempotent
    assert len(g.nodes) == 3


def test_use_counts_count_src_slots():
    a = leaf("a", (4,))
    x = ops.add(ops.exp(a), ops.exp(a))  # two different EXP nodes
    sq = ops.mul(x, x)                   # x used twice by one node: two slots, two uses
    g = Graph()
    g.expand(sq)
    uc = g.use_counts()
    assert uc[x.uid] == 2
    assert g.users(x) == [sq]


def test_validate_catches_a_tampered_shape_naming_the_node():
    a = leaf("a", (8, 4))
    s = ops.silu(ops.cont(a))
    g = Graph()
    g.expand(s)
    ops.validate(g)
    s.ne = (8, 5, 1, 1)
    with pytest.raises(GraphError, match=r"node '.*silu.*' \(UNARY\): ne"):
        ops.validate(g)


def test_op_rules_follow_ggml_asserts():
    x = leaf("x", (7, 16, 1), buffer="input")
    w = leaf("w", (4, 16))
    assert ops.ssm_conv(x, w).ne == (16, 4, 1, 1)
    with pytest.raises(GraphError, match="channels"):
        ops.ssm_conv(x, leaf("w2", (4, 8)))
    ids = leaf("ids", (2,), DType.I32, "input")
    assert ops.get_rows(leaf("c", (6, 5)), ids).ne == (6, 2, 1, 1)
    with pytest.raises(GraphError, match="must be i32"):
        ops.get_rows(leaf("c2", (6, 5)), leaf("f", (2,)))
    with pytest.raises(GraphError, match=r"ne\[1\] differs"):
        ops.concat(leaf("p", (3, 4)), leaf("q", (2, 5)), 0)
    mm = ops.mul_mat(leaf("W", (16, 32), DType.BF16), leaf("v", (16, 3), buffer="input"))
    assert mm.ne == (32, 3, 1, 1) and mm.type is DType.F32


def test_byte_range_needs_a_plan_and_resolves_views():
    a = leaf("a", (16, 4))
    v = ops.view_1d(a, 4, 16)
    with pytest.raises(GraphError, match="no memory"):
        byte_range(v)
    a.offset = 256
    assert byte_range(v) == ("weights", 272, 288)


def _router_like(reader_between: bool):
    """p = EXP(a); k = VIEW(p); kk = VIEW(k); [q = SCALE(k)]; y = SILU(p); z = SCALE(kk), and a new node at y that
    writes y's memory and p (as MOE_ROUTER writes its DIV's and its ARGSORT's, the top-k view kept between)."""
    a = leaf("a", (8, 2), buffer="input")
    p = ops.exp(a)
    k = ops.view_2d(p, 4, 2, p.nb[1], 0, "k")
    kk = ops.view_1d(k, 4, 0, "kk")
    y = ops.silu(p)
    z = ops.scale(kk, 2.0)
    p.name, y.name, z.name = "p", "y", "z"
    g = Graph()
    g.expand(kk)
    if reader_between:
        g.expand(ops.scale(k, 3.0))
    g.expand(y)
    g.expand(z)
    new = Tensor(name="fused", type=DType.F32, ne=y.ne, nb=y.nb, op=Op.UNARY, op_params={"kind": "EXP"}, src=[a],
                 outs=[p])
    return g, new, (p, y)


def test_replace_moves_views_of_what_the_new_node_writes_after_it():
    """The finding of the moe_router branch: the top-k VIEW of the ARGSORT stood before the fused node that now
    writes the ARGSORT, so the saved graph did not load. The views (and a view of a view) follow the new node, in
    their order, and the order is valid."""
    g, new, (p, y) = _router_like(reader_between=False)
    assert [n.name for n in g.nodes] == ["p", "k", "kk", "y", "z"]
    g.replace([([p, y], new, y)])
    assert [n.name for n in g.nodes] == ["fused", "k", "kk", "z"]
    g.check_order()


def test_replace_refuses_a_kernel_that_reads_what_the_new_node_writes_before_it():
    """A kernel node there would read the bytes before the new node writes them: a matcher's bug, named."""
    g, new, (p, y) = _router_like(reader_between=True)
    with pytest.raises(GraphError, match=r"node 'k \(scaled\)' reads 'k' before 'fused', which now writes it"):
        g.replace([([p, y], new, y)])
