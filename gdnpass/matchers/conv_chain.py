"""The GDN conv chain of a speculative-verify ubatch, fused into one GDN_CONV_CHAIN node.

    GET_ROWS(conv cache, ids) -> RESHAPE -> CONCAT(dim 0, state, projectionᵀ) -> K x (VIEW -> CPY into a cache row)
    -> SSM_CONV -> SILU -> VIEW -> L2_NORM (q), VIEW -> L2_NORM (k)

The fused node runs at the CONCAT position (seed 000): it gathers the state row there (later than GET_ROWS did),
reads the projection there (as CONCAT did), and writes the snapshot rows, the SiLU output and the q/k L2 outputs
there (earlier than the CPYs, SILU and L2_NORMs did). The rules below protect exactly those moves.

Legality rules (all must hold; the bracketed name is what a refusal reports):
 1. [scope.*] one sequence [scope.n-seqs], 1 <= n_t <= 16 [scope.n-tokens], 1..16 snapshot rows [scope.n-rows],
    d_conv 3-5 [scope.d-conv], every tensor of the chain f32 [scope.type].
 2. [structure.*] CONCAT(dim 0) of RESHAPE(GET_ROWS(RESHAPE(cache), ids)) and the TRANSPOSE of a contiguous
    [C, n_t, 1] projection; SSM_CONV(CONCAT, w) with a contiguous [d_conv, C] weight; SILU of the SSM_CONV.
 3. [cpy-run.view-of-concat] every other user of the CONCAT is a VIEW [d_conv-1, C, 1] with the CONCAT's strides at
    column offset 0..n_t, read by exactly one CPY.
 4. [cpy-run.whole-row] each CPY writes exactly one whole row of the cache the GET_ROWS reads, or a window: an f32
    [d_conv-1, C, 1] view of another tensor in the cache's buffer whose (column, channel) -> address map is one-to-one.
 5. [cpy-run.row-written-twice] no two destinations overlap (a cache row written twice), except as 5b allows.
 5b. [cpy-run.dedup-gate] overlapping windows are one shared row (sglang's MambaPool, vLLM's widened state): views of
    one tensor with the same strides (nb0 = window stride, nb1 = channel stride) and the same address of concat
    column 0 (offset - column * nb0), and no address twice in the tile of all their columns. Then the step stride
    equals the window stride: element (w, ch) of the window at concat column c lies at base + (c + w)*nb0 + ch*nb1,
    a function of the concat column, so overlapping CPYs write the same value to the same address, and the kernel
    writes the row once, as one tile (op_params["tile"]). Not a refusal of its own: when it fails, overlapping
    destinations are refused by rule 5; windows that share no column keep the per-window path.
 6. [concat.user-count] the CONCAT has exactly n_cpy + 1 uses and is not OUTPUT.
 7. [get-rows.user-count] the gathered state (GET_ROWS and its RESHAPE) feeds only the CONCAT and is not OUTPUT.
 8. [ssm-conv.user-count] the SSM_CONV's only use is the SILU and it is not OUTPUT.
 9. [l2.head-geometry] L2_NORM(q) and L2_NORM(k) read views of the SiLU output with the head geometry:
    ne [S, H_k, n_t, 1], nb [4, 4S, 4C, 4C*n_t], offsets 0 and 4*S*H_k (2*S*H_k <= C).
10. [alias.output-overlaps-input] the bytes the fused kernel writes overlap none it reads, except the aliasings it
    is built for (each program reads all tokens of its channels before writing them): the SiLU output over the
    projection with the same layout and an offset that is a whole number of token rows (so every element lands on
    one of its own channel), and snapshot rows that may be the gathered row. L2 outputs on the projection are
    accepted too, but then written by a second launch of the node (``l2_separate``), once the first has read
    every projection element: within one launch that would be a race between programs.
11. Nodes in between: every node inside the chain's span (GET_ROWS .. last L2_NORM) that is not part of the chain
    (nor the projection's producer). Decided on byte ranges of the plan, not tensor identity:
    - [between.writes-cache] none may write the cache (before the fused position: the gathered row is runtime
      data; after it: the snapshot rows);
    - [between.writes-ids] none before the fused position may write the ids;
    - [between.writes-weights] none after the fused position may write the conv weight;
    - [between.writes-early-output] / [between.reads-early-output] none after the fused position may write or
      read the SiLU/L2 outputs;
    - [between.reads-cache] none after the fused position may read the snapshot rows.
    The older, broader check (``between="broad"``) replaces these with one rule, [between.touches-chain-buffer]:
    no node in between may read or write any byte of the chain's buffers (GET_ROWS, CONCAT, projection, SSM_CONV,
    SiLU and L2 outputs, the cache), nor write the ids or the weight.
"""

from __future__ import annotations

import itertools

from gdnpass import ops
from gdnpass.ir import DType, Flag, Graph, Op, Tensor, Unary, byte_range, ranges_overlap, runs_kernel
from gdnpass.matchers.common import Context, Match, Refusal, first_collision

NAME = "gdn_conv_chain"
MAX_TOKENS = 16
MAX_ROWS = 16
D_CONV = (3, 4, 5)


def _one_to_one(nb0: int, n0: int, nb1: int, n1: int) -> bool:
    """Whether an f32 [n0, n1] view with byte strides nb0, nb1 hits no address twice: the inner stride times its
    extent does not reach the outer stride."""
    (a, na), (b, _) = sorted([(nb0, n0), (nb1, n1)])
    return a >= 4 and not a % 4 and not b % 4 and a * na <= b


def _dedup_tile(dsts: list[Tensor], wins: list[int], columns: list[int], dc: int, C: int) -> dict | None:
    """Rule 5b: the shared row that the windows ``dsts[wins]`` are views of, as the fused node's tile (concat
    columns first .. first+n_cols-1 of every channel, column c of channel ch at byte offset + c*nb0 + ch*nb1 of
    ``base``), or None when they are not one."""
    if not wins:
        return None
    d0 = dsts[wins[0]]
    offset = d0.view_offs - columns[wins[0]] * d0.nb[0]  # where concat column 0 would lie
    if any(dsts[i].base is not d0.base or dsts[i].nb[:2] != d0.nb[:2]
           or dsts[i].view_offs - columns[i] * d0.nb[0] != offset for i in wins):
        return None
    first = min(columns[i] for i in wins)
    n_cols = max(columns[i] for i in wins) - first + dc - 1
    if n_cols >= len(wins) * (dc - 1) or not _one_to_one(d0.nb[0], n_cols, d0.nb[1], C):
        return None  # (windows that share no column: nothing to write once; one window alone measured slower)
    return {"windows": wins, "base": d0.base.name, "offset": offset, "first": first, "n_cols": n_cols}


class ConvChain:
    name = NAME

    def candidates(self, graph: Graph) -> list[Tensor]:
        """CONCATs that feed an SSM_CONV: the chains worth explaining, fused or not."""
        return [n.src[0] for n in graph.nodes if n.op is Op.SSM_CONV and n.src[0].op is Op.CONCAT]

    def prepare(self, graph: Graph) -> int:
        """Before planning: keep each chain's projection allocated until its last L2_NORM (an allocator hint, as
        ggml-cuda's graph_optimize adds for its fusions). Otherwise gallocr may place the L2 outputs on the dead
        projection, which the fused kernel (running at the CONCAT) still reads: a race between its programs, which
        forces the node to write them in a second launch (``l2_separate``)."""
        added = 0
        for concat in self.candidates(graph):
            xt = concat.src[1]
            conv = next(n for n in graph.nodes if n.op is Op.SSM_CONV and n.src[0] is concat)
            silus = [n for n in graph.nodes if n.op is Op.UNARY and n.src[0] is conv]
            l2s = [n for n in graph.nodes if n.op is Op.L2_NORM and silus and n.src[0].view_src is silus[0]]
            if xt.op is not Op.TRANSPOSE or not l2s:
                continue
            last = max(graph.index(n) for n in l2s)
            il = concat.layer if concat.layer is not None else -1
            graph.nodes.insert(last + 1, ops.keep_alive(f"keep_projection-{il}", xt.src[0].base))
            added += 1
        return added

    def match(self, graph: Graph, concat: Tensor, ctx: Context) -> Match | Refusal:
        def refuse(rule: str, node: Tensor, reason: str, rng=None) -> Refusal:
            return Refusal(NAME, rule, node, reason, concat.layer, rng)

        # ---- structure --------------------------------------------------------------------------------------
        if concat.op_params.get("dim") != 0:
            return refuse("structure.concat", concat, "CONCAT is not along dim 0")
        state_r, xt = concat.src
        gr = state_r.src[0] if state_r.op is Op.RESHAPE else None
        if gr is None or gr.op is not Op.GET_ROWS:
            return refuse("structure.state", state_r, "CONCAT's first source is not RESHAPE(GET_ROWS(...))")
        states, ids = gr.src
        cache = states.base
        if cache.buffer != "cache" or states.op not in (Op.RESHAPE, Op.VIEW) or states.view_offs != 0:
            return refuse("structure.state", gr, "GET_ROWS does not gather from a recurrent cache")
        if xt.op is not Op.TRANSPOSE:
            return refuse("structure.projection", xt, "CONCAT's second source is not a TRANSPOSE")
        proj = xt.src[0]
        users = ctx.users(concat)
        convs = [u for u in users if u.op is Op.SSM_CONV and u.src[0] is concat]
        conv = convs[0]
        weight = conv.src[1]
        silus = ctx.users(conv)
        silu = silus[0] if len(silus) == 1 else None
        dc = weight.ne[0]
        C = concat.ne[1]
        n_t, n_s = concat.ne[0] - (dc - 1), concat.ne[2]
        windows = [u for u in users if u.op is Op.VIEW]  # other users surface in rule 6 (concat.user-count)

        # ---- 1. scope ---------------------------------------------------------------------------------------
        if n_s != 1 or concat.ne[3] != 1:
            return refuse("scope.n-seqs", concat, f"{n_s} sequences in the ubatch; only single-sequence verify fuses")
        if not 1 <= n_t <= MAX_TOKENS:
            return refuse("scope.n-tokens", concat, f"n_t = {n_t} is outside 1..{MAX_TOKENS}")
        if not 1 <= len(windows) <= MAX_ROWS:
            return refuse("scope.n-rows", concat, f"{len(windows)} snapshot rows, outside 1..{MAX_ROWS}")
        if dc not in D_CONV:
            return refuse("scope.d-conv", conv, f"d_conv = {dc} is not one of {D_CONV}")
        for t in (concat, cache, proj, weight, conv):
            if t.type is not DType.F32:
                return refuse("scope.type", t, f"{t.name!r} is {t.type.label}, not f32")

        # ---- 2. structure, continued -----------------------------------------------------------------------
        if not proj.is_contiguous() or proj.ne[:3] != (C, n_t, 1):
            return refuse("structure.projection", proj, "the projection is not a contiguous [C, n_t, 1] tensor")
        if not weight.is_contiguous() or weight.ne[1] != C:
            return refuse("structure.weight", weight, "the conv weight is not a contiguous [d_conv, C] tensor")
        if silu is None or silu.op is not Op.UNARY or silu.op_params.get("kind") != Unary.SILU.value:
            return refuse("ssm-conv.user-count", conv, "SSM_CONV's only user is not a SILU")

        # ---- 3-5b. the CPY run ------------------------------------------------------------------------------
        row = cache.nb[1]
        cpys, columns, wins = [], [], []  # wins: indices of the window destinations
        for w in windows:
            col, rem = divmod(w.view_offs, 4)
            if (rem or not 0 <= col <= n_t or w.ne != (dc - 1, C, 1, 1) or w.nb[1:3] != concat.nb[1:3]):
                return refuse("cpy-run.view-of-concat", w,
                              f"window is not [d_conv-1, C, 1] at column 0..{n_t} with the CONCAT's strides")
            wu = ctx.users(w)
            if len(wu) != 1 or wu[0].op is not Op.CPY or wu[0].src[0] is not w or ctx.uses(w) != 1:
                return refuse("cpy-run.view-of-concat", w, "window is not read by exactly one CPY")
            cpy = wu[0]
            dst = cpy.src[1]
            whole_row = (dst.base is cache and dst.ne == (cache.ne[0], 1, 1, 1) and dst.is_contiguous()
                         and not dst.view_offs % row and cache.ne[0] == (dc - 1) * C)
            window = (dst.base is not cache and dst.base.buffer == cache.buffer and dst.ne == (dc - 1, C, 1, 1)
                      and _one_to_one(dst.nb[0], dc - 1, dst.nb[1], C))
            if cpy.type is not DType.F32 or not (whole_row or window):
                return refuse("cpy-run.whole-row", cpy, "CPY writes neither exactly one whole row of the gathered "
                              "cache nor a [d_conv-1, C] window in the cache buffer")
            if window:
                wins.append(len(cpys))
            cpys.append(cpy)
            columns.append(col)
        dsts = [c.src[1] for c in cpys]
        tile = _dedup_tile(dsts, wins, columns, dc, C)
        spans = [byte_range(d) for d in dsts]
        for j, i in itertools.combinations(range(len(dsts)), 2):
            if ranges_overlap(spans[j], spans[i]) and not (tile and i in wins and j in wins):
                what = f"{dsts[i].name!r}" if i in wins else f"cache row {dsts[i].view_offs // row}"
                return refuse("cpy-run.row-written-twice", cpys[i],
                              f"{what} is written twice (it overlaps {dsts[j].name!r}), and not as one shared row",
                              (spans[j], spans[i]))

        # ---- 6-8. use confinement ---------------------------------------------------------------------------
        if ctx.uses(concat) != len(cpys) + 1 or concat.flags & Flag.OUTPUT:
            return refuse("concat.user-count", concat,
                          f"CONCAT has {ctx.uses(concat)} uses, expected {len(cpys) + 1} (the CPYs + SSM_CONV), or is OUTPUT")
        for t in (gr, state_r):
            if ctx.uses(t) != 1 or t.flags & Flag.OUTPUT:
                return refuse("get-rows.user-count", t, "the gathered state has users outside the chain or is OUTPUT")
        if ctx.uses(conv) != 1 or conv.flags & Flag.OUTPUT:
            return refuse("ssm-conv.user-count", conv, "SSM_CONV has other users or is OUTPUT")

        # ---- 9. the q/k L2_NORMs ----------------------------------------------------------------------------
        l2 = {}
        for v in ctx.users(silu):
            if v.op is not Op.VIEW:
                continue
            for n in ctx.users(v):
                if n.op is Op.L2_NORM and n.src[0] is v:
                    l2[v.view_offs] = (v, n)
        q = l2.get(0)
        geometry = None
        if q is not None:
            S, H_k = q[0].ne[0], q[0].ne[1]
            k = l2.get(4 * S * H_k)
            geometry = (S, H_k)
        if q is None or k is None:
            return refuse("l2.head-geometry", silu, "no L2_NORM(q) at offset 0 and L2_NORM(k) after the q heads")
        S, H_k = geometry
        want_ne, want_nb = (S, H_k, n_t, 1), (4, 4 * S, 4 * C, 4 * C * n_t)
        for v, n in (q, k):
            if v.ne != want_ne or v.nb != want_nb or 2 * S * H_k > C or ctx.uses(v) != 1:
                return refuse("l2.head-geometry", v, f"{v.name!r} is not [S, H_k, n_t, 1] heads of the SiLU output")
            if n.op_params.get("eps") != q[1].op_params.get("eps") or not n.is_contiguous():
                return refuse("l2.head-geometry", n, "q and k L2_NORMs differ in eps or layout")

        chain = [gr, state_r, concat, *windows, *cpys, *dsts, conv, silu, q[0], q[1], k[0], k[1]]
        pos = ctx.pos
        c = dict(states=states, ids=ids, cache=cache, get_rows=gr, concat=concat, projection=proj, projection_t=xt,
                 weight=weight, cpys=cpys, dsts=dsts, columns=columns, tile=tile, ssm_conv=conv, silu=silu,
                 q_view=q[0], q_l2=q[1], k_view=k[0], k_l2=k[1], chain=chain,
                 d_conv=dc, n_tokens=n_t, head_dim=S, n_k_heads=H_k, eps=q[1].op_params["eps"])
        if ctx.check_hazards:
            hazard = self._hazards(graph, ctx, c)
            if hazard is not None:
                return hazard
        span = (pos[gr.uid], max(pos[q[1].uid], pos[k[1].uid]))
        return Match(NAME, concat, concat.layer, c, [t for t in chain if t.uid in pos], span)

    def _hazards(self, graph: Graph, ctx: Context, c: dict) -> Refusal | None:
        """Rules 10 and 11: the byte-range hazards of running the chain at the CONCAT position."""
        concat, silu, q_l2, k_l2, cache = c["concat"], c["silu"], c["q_l2"], c["k_l2"], c["cache"]

        def refuse(rule: str, node: Tensor, reason: str, hit) -> Refusal:
            return Refusal(NAME, rule, node, reason, concat.layer, (hit[0], hit[2]))

        early = [silu, q_l2, k_l2]
        # ---- 10. what the kernel writes vs what it reads ----------------------------------------------------
        # The SiLU output may alias the projection when every SiLU element lands on a projection element of its own
        # channel (same layout, offsets a whole token row apart): a program reads its channels before writing them.
        proj, xt = c["projection"], c["projection_t"]
        shift = byte_range(silu)[1] - byte_range(proj)[1]
        silu_reads = [c["ids"], c["weight"]] + ([] if silu.nb == proj.nb and shift % proj.nb[1] == 0 else [xt])
        # L2 outputs on the (dead) projection are a cross-program race inside one launch: the node then writes
        # them in a second launch, after every program has read the projection (see c["l2_separate"]).
        c["l2_separate"] = first_collision(ctx.ranges([q_l2, k_l2]), ctx.ranges([xt])) is not None
        windows = [d for d in c["dsts"] if d.base is not cache]  # unlike a row, a window may not touch the cache
        hit = (first_collision(ctx.ranges([q_l2, k_l2, *c["dsts"]]), ctx.ranges([c["ids"], c["weight"]]))
               or first_collision(ctx.ranges(c["dsts"]), ctx.ranges([xt]))
               or first_collision(ctx.ranges(windows), ctx.ranges([cache]))
               or first_collision(ctx.ranges([silu]), ctx.ranges(silu_reads)))
        if hit:
            return refuse("alias.output-overlaps-input", hit[1],
                          f"{hit[1].name!r} overlaps {hit[3].name!r}, which the fused kernel reads", hit)
        hit = first_collision(ctx.ranges(early), ctx.ranges([cache]))
        if hit:
            return refuse("alias.output-overlaps-input", hit[1], f"{hit[1].name!r} overlaps the cache", hit)

        # ---- 11. nodes in between ---------------------------------------------------------------------------
        pos = ctx.pos
        start, at, end = pos[c["get_rows"].uid], pos[concat.uid], max(pos[q_l2.uid], pos[k_l2.uid])
        skip = {t.uid for t in c["chain"]} | {c["projection"].base.uid}
        between = [n for n in graph.nodes[start:end + 1] if n.uid not in skip and runs_kernel(n)]
        if ctx.between == "broad":
            owned = ctx.ranges([c["get_rows"], concat, c["projection"].base, c["ssm_conv"], *early, cache, *c["dsts"]])
            inputs_ = ctx.ranges([c["ids"], c["weight"]])  # shared read-only inputs: reading them is no hazard
            for n in between:
                hit = first_collision(ctx.node_writes(n) + ctx.node_reads(n), owned) or first_collision(ctx.node_writes(n), inputs_)
                if hit:
                    return refuse("between.touches-chain-buffer", n,
                                  f"{n.name!r} touches {hit[3].name!r}, a buffer of the chain", hit)
            return None
        before_rules = [("between.writes-cache", "w", ctx.ranges([cache]), "writes the cache"),
                        ("between.writes-ids", "w", ctx.ranges([c["ids"]]), "writes the ids the gather reads")]
        after_rules = [("between.writes-cache", "w", ctx.ranges(c["dsts"]), "writes a snapshot row"),
                       ("between.writes-weights", "w", ctx.ranges([c["weight"]]), "writes the conv weight"),
                       ("between.writes-early-output", "w", ctx.ranges(early), "writes an early output"),
                       ("between.reads-early-output", "r", ctx.ranges(early), "reads an early output"),
                       ("between.reads-cache", "r", ctx.ranges(c["dsts"]), "reads a snapshot row")]
        for n in between:
            mine = {"w": ctx.node_writes(n), "r": ctx.node_reads(n)}
            for rule, kind, theirs, what in (after_rules if pos[n.uid] > at else before_rules):
                hit = first_collision(mine[kind], theirs)
                if hit:
                    return refuse(rule, n, f"{n.name!r} {what} ({hit[3].name!r}) between the chain's nodes", hit)
        return None

    def rewrite(self, graph: Graph, m: Match) -> Tensor:
        """The fused node for ``m`` (the pass puts it in place of ``m.removed``)."""
        c = m.captures
        silu = c["silu"]
        il = m.layer if m.layer is not None else -1
        fused = Tensor(
            name=f"gdn_conv_chain-{il}", type=DType.F32, ne=silu.ne, nb=silu.nb, op=Op.GDN_CONV_CHAIN,
            op_params={"n_inputs": 4, "d_conv": c["d_conv"], "n_tokens": c["n_tokens"], "columns": c["columns"],
                       "eps": c["eps"], "head_dim": c["head_dim"], "n_k_heads": c["n_k_heads"],
                       "l2_separate": c.get("l2_separate", True),
                       **({"tile": c["tile"]} if c["tile"] else {}),
                       "replaced": [t.name for t in m.removed]},
            src=[c["states"], c["ids"], c["projection_t"], c["weight"], c["q_l2"], c["k_l2"], *c["dsts"]],
            view_src=silu, view_offs=0, layer=m.layer)
        return fused
