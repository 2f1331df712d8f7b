"""The GDN conv chain of a speculative-verify ubatch of n_s sequences, fused into one GDN_CONV_CHAIN node.

    GET_ROWS(conv cache, ids) -> RESHAPE -> CONCAT(dim 0, state, projectionᵀ) -> K x (VIEW -> CPY into a cache row)
    -> SSM_CONV -> SILU -> VIEW -> q/k normalisation, VIEW -> q/k normalisation

The q/k normalisation has two forms: upstream llama.cpp's ``build_gdn_l2_norm``, RMS_NORM(x, eps/S) then
SCALE(1/sqrt(S)) (the default builder form), and the seed fork's L2_NORM(x, eps).

The fused node runs at the CONCAT position (seed 000): it gathers the state row there (later than GET_ROWS did),
reads the projection there (as CONCAT did), and writes the snapshot rows, the SiLU output and the normalised q/k
there (earlier than the CPYs, SILU and norms did). The rules below protect exactly those moves.

Several sequences (llama.cpp's split_equal ubatch: n_s cache rows gathered, n_s rows per snapshot CPY). Which row a
sequence gathers is runtime data (``s_copy``: after find_slot's cell swaps sequence j may read the row sequence i
writes this ubatch; after a rollback it reads another plane), so no rule on the graph can say that a sequence's
snapshot rows are not another's gathered row. The kernel makes every such aliasing legal, for any ids: its programs
own channels, never sequences, and each reads the gathered state and the tokens of its channels for every sequence
before it writes any of them; rule 4 makes every destination row a whole cache row (or a window off the cache, rule
9), so channel c of any row, read or written, is the program of channel c's alone. What the rules must still say is
static: the rows of different sequences a CPY writes never alias (rules 4, 5, 5b), and nothing else crosses channels
(rule 9).

Legality rules, in the order they run (the bracketed name is what a refusal reports; structural 1-8, hazards 9-10):
 1. [structure.concat] the CONCAT is along dim 0.
    [structure.state] its first source is RESHAPE(GET_ROWS(RESHAPE or VIEW at offset 0 of a cache, ids)).
    [structure.projection] its second source is the TRANSPOSE of a contiguous [C, n_t, n_s] projection.
 2. [scope.n-seqs] 1..128 sequences; [scope.n-tokens] 1 <= n_t <= 16; [scope.n-rows] 1..16 snapshot rows;
    [scope.d-conv] d_conv 3-5; [scope.type] every tensor of the chain f32 (the limits are the kernel's:
    ``gdnpass.kernels.limits.CHAIN``).
    [structure.weight] SSM_CONV(CONCAT, w) with a contiguous [d_conv, C] weight.
 3. [cpy-run.view-of-concat] every other user of the CONCAT is a VIEW [d_conv-1, C, n_s] with the CONCAT's strides
    at column offset 0..n_t, read by exactly one CPY.
 4. [cpy-run.whole-row] each CPY writes, for each sequence, exactly one whole row of the cache the GET_ROWS reads
    (an f32 [(d_conv-1)*C, n_s] view whose sequence stride is a whole number of rows), or a window: an f32
    [d_conv-1, C, n_s] view of another tensor in the cache's buffer whose (column, channel) -> address map is
    one-to-one for each sequence.
 5. [cpy-run.row-written-twice] no two destinations overlap (a cache row written twice), except as 5b allows, and no
    two sequences of one destination do: rows of different sequences never alias (a sequence stride of 0 rows, or
    windows of two sequences that share an address, are refused).
 5b. The dedup gate (not a refusal of its own): overlapping windows are one shared row (sglang's MambaPool, vLLM's
    widened state): views of one tensor with the same strides (nb0 = window stride, nb1 = channel stride, nb2 =
    sequence stride) and the same address of concat column 0 (offset - column * nb0), and no address twice in the
    tile of all their columns of all sequences.
    Then the step stride equals the window stride: element (w, ch) of the window at concat column c lies at
    base + (c + w)*nb0 + ch*nb1, a function of the concat column, so overlapping CPYs write the same value to the
    same address, and the kernel writes the row once, as one tile (op_params["tile"]). When it fails, overlapping
    destinations are refused by rule 5; windows that share no column keep the per-window path.
 6. Use confinement, the generic rule (``patterns.common.confined``, ggml_can_fuse_subgraph): every node the rewrite
    removes and the fused node does not write is read only inside the chain and is not OUTPUT; the refusal names its
    role: [concat.user-count] the CONCAT; [get-rows.user-count] the gathered state (GET_ROWS and its RESHAPE);
    [ssm-conv.user-count] the SSM_CONV (its one user the SILU); [cpy.user-count] the snapshot CPYs. (The windows,
    the q/k views and the RMS form's RMS_NORMs are pinned by rules 3 and 7, as part of the chain's shape.)
 7. The q/k normalisation, in the form of the q heads' norm (the other form's rules hold trivially):
    [l2.head-geometry] L2 form: L2_NORM(q) and L2_NORM(k) read views of the SiLU output with the head geometry:
    ne [S, H_k, n_t, n_s], nb [4, 4S, 4C, 4C*n_t], offsets 0 and 4*S*H_k (2*S*H_k <= C), one use each, the same eps,
    contiguous outputs.
    [rms.head-geometry] RMS form: RMS_NORM(q) and RMS_NORM(k) read those views, one use each.
    [rms.norm-use] each RMS_NORM's only use is a SCALE, and it is not OUTPUT (the fused kernel never writes it).
    [rms.scale-bias] each SCALE has bias 0 and a contiguous output.
    [rms.same-params] q and k use the same eps and the same scale (they become parameters of the fused node).
 8. [scope.head-dim] the head size S is in the kernel's scope: a power of two dividing C (one program of S threads
    per head, ``tl.arange(0, S)``; ``CHAIN.heads``). llama.cpp accepts any S (head size 80, say): such a chain
    stays unfused.
 9. [alias.output-overlaps-input] the bytes the fused kernel writes overlap none it reads, except the aliasings it
    is built for (each program reads all tokens and gathered rows of its channels, of every sequence, before
    writing them): the SiLU output over the projection with the same layout and an offset that is a whole number of
    token rows (so every element lands on one of its own channel, of any sequence), and snapshot rows that may be
    any sequence's gathered row. A window (not a whole row) may not touch the cache: its channels lie elsewhere
    than a row's, so it would write channels another program still gathers, of its own sequence or another's. L2
    outputs on the projection are accepted too, but then written by a second launch of the node (``l2_separate``),
    once the first has read every projection element: within one launch that would be a race between programs.
10. Nodes in between (``patterns.common.between``): every kernel node inside the chain's span (GET_ROWS .. last q/k
    output) that the rewrite keeps (nor the projection's producer). Decided on byte ranges of the plan:
    [between.writes-cache] none may write the cache (before the fused position: the gathered row is runtime
    data; after it: the snapshot rows);
    [between.writes-ids] none before the fused position may write the ids;
    [between.writes-weights] none after the fused position may write the conv weight;
    [between.writes-early-output] none after the fused position may write the SiLU/L2 outputs;
    [between.reads-early-output] none after the fused position may read them;
    [between.reads-cache] none after the fused position may read the snapshot rows.
    The older, broader check (``between="broad"``) replaces these with one rule, [between.touches-chain-buffer]:
    no node in between may read or write any byte of the chain's buffers (GET_ROWS, CONCAT, projection, SSM_CONV,
    SiLU and L2 outputs, the cache), nor write the ids or the weight.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property

from gdnpass.ir import (DType, Flag, Graph, Op, Tensor, Unary, buffer_role, byte_range, keep_alive, one_to_one,
                        ranges_overlap)
from gdnpass.patterns.common import (HAZARD, Capture, Clause, Context, Match, Why, between, collision, confined,
                                     first_collision, rule)
from gdnpass.patterns.conv_chain.record import RECORD

NAME = "gdn_conv_chain"
SCOPE = RECORD.scope  # the kernel's limits


def _dedup_tile(dsts: list[Tensor], wins: list[int], columns: list[int], dc: int, C: int) -> dict | None:
    """Rule 5b: the shared row that the windows ``dsts[wins]`` are views of, as the fused node's tile (concat
    columns first .. first+n_cols-1 of every channel and sequence, column c of channel ch of sequence s at byte
    offset + c*nb0 + ch*nb1 + s*nb2 of ``base``), or None when they are not one."""
    if not wins:
        return None
    d0 = dsts[wins[0]]
    n_s = d0.ne[2]
    strides = d0.nb[:3] if n_s > 1 else d0.nb[:2]  # (one sequence: its stride is never used)
    offset = d0.view_offs - columns[wins[0]] * d0.nb[0]  # where concat column 0 would lie
    if any(dsts[i].base is not d0.base or dsts[i].nb[:len(strides)] != strides
           or dsts[i].view_offs - columns[i] * d0.nb[0] != offset for i in wins):
        return None
    first = min(columns[i] for i in wins)
    n_cols = max(columns[i] for i in wins) - first + dc - 1
    if n_cols >= len(wins) * (dc - 1) or not one_to_one((d0.nb[0], n_cols), (d0.nb[1], C), (d0.nb[2], n_s)):
        return None  # (windows that share no column: nothing to write once; one window alone measured slower)
    return {"windows": wins, "base": d0.base.name, "offset": offset, "first": first, "n_cols": n_cols}


@dataclass
class Norm:
    """One of the q/k normalisations: the view of the SiLU output, its L2_NORM or RMS_NORM, and (RMS form) the
    SCALE the GDN reads."""

    view: Tensor
    first: Tensor                 # L2_NORM or RMS_NORM
    scale: Tensor | None = None   # RMS form: the RMS_NORM's sole SCALE user
    uses_of_view: int = 0

    @property
    def form(self) -> str:
        return "l2" if self.first.op is Op.L2_NORM else "rms"

    @property
    def out(self) -> Tensor:
        """What the GDN reads, and the fused node writes."""
        return self.first if self.form == "l2" else self.scale

    @property
    def nodes(self) -> list[Tensor]:
        return [self.view, self.first] + ([self.scale] if self.form == "rms" else [])


@dataclass
class ChainCapture(Capture):
    """The named nodes of one candidate chain; fields a malformed candidate lacks are None (the rules say why)."""

    ROLES = (("concat", ("concat",)), ("get-rows", ("get_rows", "state_r")), ("ssm-conv", ("ssm_conv",)),
             ("cpy", ("cpys",)))
    SHAPED = (("the windows: each read by exactly one CPY", "cpy-run.view-of-concat"),
              ("the q/k views: one use each", "l2.head-geometry, rms.head-geometry"),
              ("the RMS form's RMS_NORMs: one SCALE use", "rms.norm-use"))

    concat: Tensor
    state_r: Tensor                       # CONCAT's first source
    projection_t: Tensor                  # CONCAT's second source
    ssm_conv: Tensor
    get_rows: Tensor | None = None        # RESHAPE(GET_ROWS(states, ids)) = state_r
    silu: Tensor | None = None            # the SSM_CONV's SILU user (rule 6: its only user)
    windows: list[Tensor] = field(default_factory=list)   # VIEW users of the CONCAT, in node order
    window_users: list[list[Tensor]] = field(default_factory=list)  # each window's users
    q: "Norm | None" = None                # the q heads' normalisation (at view offset 0)
    k: "Norm | None" = None                # the k heads' (right after the q heads)

    # ---- what the rewrite does (patterns.common.Capture) -----------------------------------------------------------
    @property
    def anchor(self) -> Tensor:
        return self.concat

    def removed(self) -> list[Tensor]:
        return self.chain

    def written(self) -> list[Tensor]:
        """The SiLU output (the fused node's primary output), the normalised q and k, the snapshot destinations."""
        return [self.silu, *(n.out for n in (self.q, self.k) if n is not None), *self.dsts]

    def shaped(self) -> list[Tensor]:
        norms = [n for n in (self.q, self.k) if n is not None]
        return [*self.windows, *(n.view for n in norms), *(n.first for n in norms if n.form == "rms")]

    def span(self, ctx: Context) -> tuple[int, int, int]:
        """GET_ROWS .. the last q/k output; the fused node runs at the CONCAT."""
        pos = ctx.pos
        return pos[self.get_rows.uid], pos[self.concat.uid], max(pos[self.q.out.uid], pos[self.k.out.uid])

    def between_skip(self) -> list[Tensor]:
        return [self.projection.base]  # the projection's producer

    # ---- derived ---------------------------------------------------------------------------------------------------

    @property
    def states(self) -> Tensor:
        return self.get_rows.src[0]

    @property
    def ids(self) -> Tensor:
        return self.get_rows.src[1]

    @property
    def cache(self) -> Tensor:
        return self.states.base

    @property
    def projection(self) -> Tensor:
        return self.projection_t.src[0]

    @property
    def weight(self) -> Tensor:
        return self.ssm_conv.src[1]

    @property
    def d_conv(self) -> int:
        return self.weight.ne[0]

    @property
    def C(self) -> int:
        return self.concat.ne[1]

    @property
    def n_tokens(self) -> int:
        return self.concat.ne[0] - (self.d_conv - 1)

    @property
    def n_seqs(self) -> int:
        return self.concat.ne[2]

    @cached_property
    def cpys(self) -> list[Tensor]:
        """Each window's CPY (rule 3 makes it the window's only user)."""
        return [users[0] for users in self.window_users]

    @cached_property
    def dsts(self) -> list[Tensor]:
        return [c.src[1] for c in self.cpys]

    @cached_property
    def columns(self) -> list[int]:
        return [w.view_offs // 4 for w in self.windows]

    @cached_property
    def window_dsts(self) -> list[int]:
        """Indices of the destinations that are windows of another tensor (not whole cache rows)."""
        return [i for i, d in enumerate(self.dsts) if d.base is not self.cache]

    @cached_property
    def tile(self) -> dict | None:
        return _dedup_tile(self.dsts, self.window_dsts, self.columns, self.d_conv, self.C)

    @cached_property
    def early(self) -> list[Tensor]:
        """What the fused kernel writes earlier than the unfused graph did: the SiLU and the q/k L2 outputs."""
        return [self.silu, self.q.out, self.k.out]

    @cached_property
    def chain(self) -> list[Tensor]:
        """The nodes the fused node replaces (the parts a malformed candidate lacks left out: rules 6-7 run on it)."""
        norms = [t for n in (self.q, self.k) if n is not None for t in n.nodes]
        return [t for t in (self.get_rows, self.state_r, self.concat, *self.windows, *self.cpys, *self.dsts,
                            self.ssm_conv, self.silu, *norms) if t is not None]


@dataclass(frozen=True)
class ChainPlan:
    """The kernel variant: q/k written by a second launch (their bytes sit on the projection), and the dedup tile."""

    l2_separate: bool
    tile: dict | None


# ---- 1-2. structure and scope ---------------------------------------------------------------------------------------


@rule("structure.concat")
def _concat_dim(c: ChainCapture, ctx):
    if c.concat.op_params.get("dim") != 0:
        return Why(c.concat, "CONCAT is not along dim 0")


@rule("structure.state")
def _state(c: ChainCapture, ctx):
    if c.get_rows is None:
        return Why(c.state_r, "CONCAT's first source is not RESHAPE(GET_ROWS(...))")
    if c.cache.buffer is None or buffer_role(ctx.graph, c.cache.buffer) != "cache" \
            or c.states.op not in (Op.RESHAPE, Op.VIEW) or c.states.view_offs != 0:
        return Why(c.get_rows, "GET_ROWS does not gather from a recurrent cache")


@rule("structure.projection")
def _projection(c: ChainCapture, ctx):
    if c.projection_t.op is not Op.TRANSPOSE:
        return Why(c.projection_t, "CONCAT's second source is not a TRANSPOSE")
    p = c.projection
    if not p.is_contiguous() or p.ne[:3] != (c.C, c.n_tokens, c.n_seqs):
        return Why(p, "the projection is not a contiguous [C, n_t, n_s] tensor")


@rule("scope.n-seqs")
def _n_seqs(c: ChainCapture, ctx):
    if c.concat.ne[3] != 1 or not 1 <= c.n_seqs <= SCOPE.max_seqs:
        return Why(c.concat, f"{c.n_seqs} sequences in the ubatch (ne3 {c.concat.ne[3]}): outside the kernel's "
                             f"1..{SCOPE.max_seqs}")


@rule("scope.n-tokens")
def _n_tokens(c: ChainCapture, ctx):
    if not 1 <= c.n_tokens <= SCOPE.max_tokens:
        return Why(c.concat, f"n_t = {c.n_tokens} is outside 1..{SCOPE.max_tokens}")


@rule("scope.n-rows")
def _n_rows(c: ChainCapture, ctx):
    if not 1 <= len(c.windows) <= SCOPE.max_rows:
        return Why(c.concat, f"{len(c.windows)} snapshot rows, outside 1..{SCOPE.max_rows}")


@rule("scope.d-conv")
def _d_conv(c: ChainCapture, ctx):
    if c.d_conv not in SCOPE.d_conv:
        return Why(c.ssm_conv, f"d_conv = {c.d_conv} is not one of {SCOPE.d_conv}")


@rule("scope.type")
def _types(c: ChainCapture, ctx):
    for t in (c.concat, c.cache, c.projection, c.weight, c.ssm_conv):
        if t.type is not DType.F32:
            return Why(t, f"{t.name!r} is {t.type.label}, not f32")


@rule("structure.weight")
def _weight(c: ChainCapture, ctx):
    if not c.weight.is_contiguous() or c.weight.ne[1] != c.C:
        return Why(c.weight, "the conv weight is not a contiguous [d_conv, C] tensor")


# ---- 3-5. the CPY run -----------------------------------------------------------------------------------------------


@rule("cpy-run.view-of-concat")
def _views_of_concat(c: ChainCapture, ctx):
    dc, C, n_t = c.d_conv, c.C, c.n_tokens
    for w, users in zip(c.windows, c.window_users):
        col, rem = divmod(w.view_offs, 4)
        if rem or not 0 <= col <= n_t or w.ne != (dc - 1, C, c.n_seqs, 1) or w.nb[1:3] != c.concat.nb[1:3]:
            return Why(w, f"window is not [d_conv-1, C, n_s] at column 0..{n_t} with the CONCAT's strides")
        if len(users) != 1 or users[0].op is not Op.CPY or users[0].src[0] is not w or ctx.uses(w) != 1:
            return Why(w, "window is not read by exactly one CPY")


@rule("cpy-run.whole-row")
def _whole_rows(c: ChainCapture, ctx):
    cache, dc, C, n_s = c.cache, c.d_conv, c.C, c.n_seqs
    row = cache.nb[1]
    for cpy, dst in zip(c.cpys, c.dsts):
        whole_row = (dst.base is cache and dst.ne == (cache.ne[0], n_s, 1, 1) and dst.has_contiguous_rows()
                     and not dst.view_offs % row and (n_s == 1 or not dst.nb[1] % row)
                     and cache.ne[0] == (dc - 1) * C)
        window = (dst.base is not cache and dst.base.buffer == cache.buffer and dst.ne == (dc - 1, C, n_s, 1)
                  and one_to_one((dst.nb[0], dc - 1), (dst.nb[1], C)))
        if cpy.type is not DType.F32 or not (whole_row or window):
            return Why(cpy, "CPY writes neither one whole row of the gathered cache per sequence nor a "
                            "[d_conv-1, C] window per sequence in the cache buffer")


@rule("cpy-run.row-written-twice")
def _row_twice(c: ChainCapture, ctx):
    dsts, wins, tile, row, n_s = c.dsts, c.window_dsts, c.tile, c.cache.nb[1], c.n_seqs
    for i, d in enumerate(dsts):  # the rows of one destination's sequences
        if i in wins:
            apart = one_to_one((d.nb[0], d.ne[0]), (d.nb[1], d.ne[1]), (d.nb[2], n_s))
        else:  # whole rows, a whole number of rows apart (rule 4): any number but 0
            apart = n_s == 1 or d.nb[1] != 0
        if not apart:
            return Why(c.cpys[i], f"{d.name!r} writes the rows of two of its {n_s} sequences over each other")
    spans = [byte_range(d) for d in dsts]
    for j, i in itertools.combinations(range(len(dsts)), 2):
        if ranges_overlap(spans[j], spans[i]) and not (tile and i in wins and j in wins):
            what = f"{dsts[i].name!r}" if i in wins else f"cache row {dsts[i].view_offs // row}"
            return Why(c.cpys[i], f"{what} is written twice (it overlaps {dsts[j].name!r}), and not as one shared row",
                       (spans[j], spans[i]))


# ---- 6-8. use confinement, the q/k norms, the head size ------------------------------------------------------------


_confined = confined(ChainCapture)


def _head_views(c: ChainCapture) -> Why | None:
    """The q and k views of the SiLU output have the head geometry and one use each (the norm)."""
    S, H_k = c.q.view.ne[0], c.q.view.ne[1]
    C, n_t = c.C, c.n_tokens
    want_ne, want_nb = (S, H_k, n_t, c.n_seqs), (4, 4 * S, 4 * C, 4 * C * n_t)
    for norm in (c.q, c.k):
        v = norm.view
        if v.ne != want_ne or v.nb != want_nb or 2 * S * H_k > C or norm.uses_of_view != 1:
            return Why(v, f"{v.name!r} is not [S, H_k, n_t, n_s] heads of the SiLU output")
    return None


@rule("l2.head-geometry")
def _l2_geometry(c: ChainCapture, ctx):
    if c.q is not None and c.q.form == "rms":
        return None
    if c.q is None or c.k is None or c.k.form != "l2":
        return Why(c.silu or c.ssm_conv, "no L2_NORM(q) at offset 0 and L2_NORM(k) after the q heads "
                           "(nor RMS_NORM + SCALE of them)")
    why = _head_views(c)
    if why:
        return why
    for n in (c.q.first, c.k.first):
        if n.op_params.get("eps") != c.q.first.op_params.get("eps") or not n.is_contiguous():
            return Why(n, "q and k L2_NORMs differ in eps or layout")


@rule("rms.head-geometry")
def _rms_geometry(c: ChainCapture, ctx):
    if c.q.form != "rms":
        return None
    if c.k is None or c.k.form != "rms":
        return Why(c.silu, "no RMS_NORM(k) after the q heads, in the q heads' form")
    return _head_views(c)


@rule("rms.norm-use")
def _rms_norm_use(c: ChainCapture, ctx):
    for norm in (c.q, c.k):
        if norm.form == "rms" and (norm.scale is None or ctx.uses(norm.first) != 1 or norm.first.flags & Flag.OUTPUT):
            return Why(norm.first, f"{norm.first.name!r} has uses other than one SCALE, or is OUTPUT")


@rule("rms.scale-bias")
def _rms_scale_bias(c: ChainCapture, ctx):
    for norm in (c.q, c.k):
        if norm.form == "rms" and (float(norm.scale.op_params.get("b", 0.0)) != 0.0 or not norm.scale.is_contiguous()
                                   or norm.scale.view_src is not None):
            return Why(norm.scale, f"{norm.scale.name!r} has a bias, or is in place / not contiguous")


@rule("rms.same-params")
def _rms_same_params(c: ChainCapture, ctx):
    if c.q.form != "rms":
        return None
    q, k = c.q, c.k
    if (q.first.op_params.get("eps") != k.first.op_params.get("eps")
            or q.scale.op_params.get("s") != k.scale.op_params.get("s")):
        return Why(k.first, "q and k differ in eps or scale")


@rule("scope.head-dim")
def _head_dim(c: ChainCapture, ctx):
    why = SCOPE.heads(c.q.view.ne[0], c.q.view.ne[1], c.C)
    if why:
        return Why(c.q.first, f"{why}: outside the fused kernel's scope")


STRUCTURE = (_concat_dim, _state, _projection, _n_seqs, _n_tokens, _n_rows, _d_conv, _types, _weight,
             _views_of_concat, _whole_rows, _row_twice, _confined,
             _l2_geometry, _rms_geometry, _rms_norm_use, _rms_scale_bias, _rms_same_params, _head_dim)


# ---- 9. what the kernel writes vs what it reads --------------------------------------------------------------------


def _q_k_on_projection(c: ChainCapture, ctx: Context) -> bool:
    """The q/k L2 outputs overlap the (dead) projection: a cross-program race inside one launch, so the node writes
    them in a second launch, after every program has read the projection (ChainPlan.l2_separate)."""
    return first_collision(ctx.ranges([c.q.out, c.k.out]), ctx.ranges([c.projection_t])) is not None


@rule("alias.output-overlaps-input", HAZARD)
def _alias(c: ChainCapture, ctx):
    # The SiLU output may alias the projection when every SiLU element lands on a projection element of its own
    # channel (same layout, offsets a whole token row apart): a program reads its channels before writing them.
    proj, xt, silu = c.projection, c.projection_t, c.silu
    shift = byte_range(silu)[1] - byte_range(proj)[1]
    silu_reads = [c.ids, c.weight] + ([] if silu.nb == proj.nb and shift % proj.nb[1] == 0 else [xt])
    windows = [d for d in c.dsts if d.base is not c.cache]  # unlike a row, a window may not touch the cache
    hit = (first_collision(ctx.ranges([c.q.out, c.k.out, *c.dsts]), ctx.ranges([c.ids, c.weight]))
           or first_collision(ctx.ranges(c.dsts), ctx.ranges([xt]))
           or first_collision(ctx.ranges(windows), ctx.ranges([c.cache]))
           or first_collision(ctx.ranges([silu]), ctx.ranges(silu_reads)))
    if hit:
        return collision(hit[1], f"{hit[1].name!r} overlaps {hit[3].name!r}, which the fused kernel reads", hit)
    hit = first_collision(ctx.ranges(c.early), ctx.ranges([c.cache]))
    if hit:
        return collision(hit[1], f"{hit[1].name!r} overlaps the cache", hit)


# ---- 10. nodes in between ------------------------------------------------------------------------------------------

_CHAIN = "{node} %s ({hit}) between the chain's nodes"

NARROW = (
    between("between.writes-cache", Clause("before", "w", lambda c: [c.cache], _CHAIN % "writes the cache"),
            Clause("after", "w", lambda c: c.dsts, _CHAIN % "writes a snapshot row")),
    between("between.writes-ids", Clause("before", "w", lambda c: [c.ids], _CHAIN % "writes the ids the gather reads")),
    between("between.writes-weights", Clause("after", "w", lambda c: [c.weight], _CHAIN % "writes the conv weight")),
    between("between.writes-early-output", Clause("after", "w", lambda c: c.early, _CHAIN % "writes an early output")),
    between("between.reads-early-output", Clause("after", "r", lambda c: c.early, _CHAIN % "reads an early output")),
    between("between.reads-cache", Clause("after", "r", lambda c: c.dsts, _CHAIN % "reads a snapshot row")),
)

_TOUCHES = "{node} touches {hit}, a buffer of the chain"

BROAD = (
    between("between.touches-chain-buffer",
            Clause("both", "rw", lambda c: [c.get_rows, c.concat, c.projection.base, c.ssm_conv, *c.early, c.cache,
                                            *c.dsts], _TOUCHES),
            Clause("both", "w", lambda c: [c.ids, c.weight], _TOUCHES)),  # shared read-only inputs: reads are safe
)


class ConvChain:
    name = NAME

    def rules(self, ctx: Context) -> tuple:
        return STRUCTURE + (_alias,) + (BROAD if ctx.between == "broad" else NARROW)

    def candidates(self, graph: Graph) -> list[Tensor]:
        """CONCATs that feed an SSM_CONV: the chains worth explaining, fused or not."""
        return [n.src[0] for n in graph.nodes if n.op is Op.SSM_CONV and n.src[0].op is Op.CONCAT]

    def prepare(self, graph: Graph) -> int:
        """Before planning: keep each chain's projection allocated until its last q/k norm (an allocator hint, as
        ggml-cuda's graph_optimize adds for its fusions). Otherwise gallocr may place the L2 outputs on the dead
        projection, which the fused kernel (running at the CONCAT) still reads: a race between its programs, which
        forces the node to write them in a second launch (``l2_separate``). The chains are found by
        :meth:`capture`, as the pass finds them."""
        ctx = Context(graph)
        hints = []
        for concat in self.candidates(graph):
            c = self.capture(graph, concat, ctx)
            norms = [t for n in (c.q, c.k) if n is not None for t in n.nodes[1:] if t is not None] if c else []
            if norms and c.projection_t.op is Op.TRANSPOSE:
                hints.append((norms, c))
        for norms, c in hints:
            last = max(graph.index(n) for n in norms)
            il = c.layer if c.layer is not None else -1
            graph.nodes.insert(last + 1, keep_alive(f"keep_projection-{il}", c.projection.base))
        return len(hints)

    def capture(self, graph: Graph, concat: Tensor, ctx: Context) -> ChainCapture | None:
        """The chain's named nodes, as found; the rules decide whether they are the pattern."""
        users = ctx.users(concat)
        conv = next((u for u in users if u.op is Op.SSM_CONV and u.src[0] is concat), None)
        if conv is None:
            return None
        state_r, xt = concat.src
        gr = state_r.src[0] if state_r.op is Op.RESHAPE and state_r.src[0].op is Op.GET_ROWS else None
        silu = next((u for u in ctx.users(conv) if u.op is Op.UNARY and u.src[0] is conv
                     and u.op_params.get("kind") == Unary.SILU.value), None)
        windows = [u for u in users if u.op is Op.VIEW]
        c = ChainCapture(concat, state_r, xt, conv, gr, silu, windows, [ctx.users(w) for w in windows])
        if silu is not None:
            norms = {}
            for v in ctx.users(silu):
                if v.op is Op.VIEW:
                    for n in ctx.users(v):
                        if n.op in (Op.L2_NORM, Op.RMS_NORM) and n.src[0] is v:
                            scales = [u for u in ctx.users(n) if u.op is Op.SCALE and u.src[0] is n]
                            norms[v.view_offs] = Norm(v, n, scales[0] if len(scales) == 1 else None, ctx.uses(v))
            c.q = norms.get(0)
            if c.q is not None:
                c.k = norms.get(4 * c.q.view.ne[0] * c.q.view.ne[1])
        return c

    def plan(self, c: ChainCapture, ctx: Context) -> ChainPlan:
        return ChainPlan(l2_separate=_q_k_on_projection(c, ctx), tile=c.tile)

    def rewrite(self, graph: Graph, m: Match) -> Tensor:
        """The fused node for ``m`` (the pass puts it in place of ``m.removed``)."""
        c, p = m.capture, m.plan
        primary, *outs = c.written()
        il = m.layer if m.layer is not None else -1
        q = c.q.view
        norm = {"norm": c.q.form, "eps": c.q.first.op_params["eps"]}
        if c.q.form == "rms":
            norm["scale"] = c.q.scale.op_params["s"]
        return Tensor(
            name=f"gdn_conv_chain-{il}", type=DType.F32, ne=primary.ne, nb=primary.nb, op=RECORD.op,
            op_params={"d_conv": c.d_conv, "n_tokens": c.n_tokens, "columns": c.columns, **norm,
                       "head_dim": q.ne[0], "n_k_heads": q.ne[1],
                       "l2_separate": p.l2_separate, **({"tile": p.tile} if p.tile else {}),
                       "replaced": [t.name for t in m.removed]},
            src=[c.states, c.ids, c.projection_t, c.weight], outs=outs, view_src=primary, view_offs=0, layer=m.layer)
