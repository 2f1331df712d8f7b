"""The capture worker: runs llama.cpp in its own process (``python -m gdnpass.frontends.llama.worker REQUEST OUT``).

A ggml assert aborts the whole process, so the parent (:mod:`.capture`) never loads llama.cpp itself. This module
imports neither torch nor the rest of gdnpass: only the bindings, ctypes and the struct reader.

What it does, with the request's context settings:

1. checks the library's ``ggml_tensor`` against the layout gdnpass reads (:data:`PINNED_TENSOR`): the size from the
   library itself (``ggml_tensor_overhead``) and every field offset from the probe compiled against the vendored
   headers at build time;
2. loads the GGUF and makes a context whose scheduler eval callback records every node it is asked about (returning
   "not needed", so the graph runs in one go: asking does not change the plan, which is made before the callback loop);
3. decodes the prompt (recording off), then one verify ubatch of ``n_tokens`` tokens of sequence 0 with logits for
   every token (recording on): the nodes in execution order, every tensor they reach, and each tensor's backend
   buffer (name, base, size, usage);
4. builds the reserve graph (``llama_graph_reserve``: the worst-case ``n_ubatch``-token graph the scheduler planned
   its compute buffer for) and reads its node and leaf lists and ggml's use counts, which the eval callback cannot see;
5. writes all of it as JSON to OUT. The log lines (llama.cpp's and ggml's) go along: they say how flash attention and
   the fused GDN ops resolved and whether gallocr re-allocated for the verify graph.

With ``record_memory`` in the request it also keeps the bytes the verify graph starts from: every non-weights buffer
(the compute buffer, whose graph inputs llama.cpp has just set, and the KV / recurrent caches) as it is when the
scheduler first asks about a verify node, i.e. after ``set_inputs`` and before any node runs. The cache buffers are
found from the prompt's graph (recorded for that alone), the compute buffer from that first verify node. With
``record_nodes`` it also keeps every verify node's bytes right after the node runs (the callback then asks for every
node, so the scheduler computes them one at a time; the plan and the arithmetic are the same); views and no-ops are
left out.

Always, it also keeps the bytes of every graph input (``GGML_TENSOR_FLAG_INPUT`` leafs: token ids, positions, the KQ
mask, K/V row ids, ``rs_s_copy``) as llama.cpp set them, read when the scheduler first asks about a node that reads
one (a live input's bytes are never reused before its last reader), so a captured graph can be executed as it ran.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import sys
import time

from gdnpass.frontends.structs import (GraphLayout, Names, TensorLayout, check_size, read_graph, read_reachable,
                                       read_tensor)

# struct ggml_tensor of the pinned commit (0c1e570): what gdnpass was checked against. The probe of the build must
# agree field for field; the library's ggml_tensor_overhead() must agree on the size.
PINNED_TENSOR = TensorLayout(size=336, type=0, buffer=8, ne=16, nb=48, op=80, op_params=84, n_op_params=16, flags=148,
                             src=152, n_src=10, view_src=232, view_offs=240, data=248, name=256, name_len=64)
PINNED_GRAPH = GraphLayout(n_nodes=4, n_leafs=8, nodes=16, leafs=40, use_counts=48, hash_size=56, hash_used=64,
                           hash_keys=72)
GGML_OBJECT_SIZE = 32  # sizeof(struct ggml_object) (ggml.c, private): offs, size, next, type, padding[4]

_USAGE = {0: "any", 1: "weights", 2: "compute"}  # enum ggml_backend_buffer_usage
_RESERVE_SYMBOL = "_Z19llama_graph_reserveP13llama_contextjjj"  # llama-ext.h, C++ linkage
_LAYER_INP_SYMBOL = "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"  # llama-ext.h, C++ linkage
_SET_NEXTN_SYMBOL = "_Z26llama_set_embeddings_nextnP13llama_contextbb"  # llama-ext.h: (ctx, value, masked)
_GET_NEXTN_SYMBOL = "_Z26llama_get_embeddings_nextnP13llama_context"  # llama-ext.h: the h_nextn rows
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
_NO_DATA_OPS = ("NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE")  # ggml ops that compute nothing (record_nodes)
_TYPE_SIZES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "i64": 8}  # the types gdnpass models (record_nodes)
_FLAG_INPUT = 1  # GGML_TENSOR_FLAG_INPUT


class Refused(Exception):
    """A request the worker refuses before touching llama.cpp (one line, for the parent to show)."""


def _ggml(lib_dir: str):
    """libggml-base's functions the worker needs, with their C signatures."""
    g = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"))
    sig = {
        "ggml_type_name": ([ctypes.c_int], ctypes.c_char_p),
        "ggml_op_name": ([ctypes.c_int], ctypes.c_char_p),
        "ggml_unary_op_name": ([ctypes.c_int], ctypes.c_char_p),
        "ggml_glu_op_name": ([ctypes.c_int], ctypes.c_char_p),
        "ggml_tensor_overhead": ([], ctypes.c_size_t),
        "ggml_backend_buffer_name": ([ctypes.c_void_p], ctypes.c_char_p),
        "ggml_backend_buffer_get_base": ([ctypes.c_void_p], ctypes.c_void_p),
        "ggml_backend_buffer_get_size": ([ctypes.c_void_p], ctypes.c_size_t),
        "ggml_backend_buffer_get_usage": ([ctypes.c_void_p], ctypes.c_int),
        "ggml_backend_buffer_get_alignment": ([ctypes.c_void_p], ctypes.c_size_t),
    }
    for name, (args, res) in sig.items():
        fn = getattr(g, name)
        fn.argtypes, fn.restype = args, res
    return g


def _names(g) -> Names:
    dec = lambda fn: (lambda v: (fn(v) or b"?").decode())  # noqa: E731
    return Names(type_name=dec(g.ggml_type_name), op_name=dec(g.ggml_op_name), unary_name=dec(g.ggml_unary_op_name),
                 glu_name=dec(g.ggml_glu_op_name))


def check_layout(probe: dict, g) -> None:
    """Refuse a build whose ``ggml_tensor`` / ``ggml_cgraph`` is not the one the reader was checked against."""
    where = "llama.cpp layout check"
    built = TensorLayout.from_dict(probe.get("tensor", {}), where)
    bad = PINNED_TENSOR.mismatch(built)
    if bad:
        raise Refused(f"{where}: struct ggml_tensor of this build differs from the pinned one ({bad}); "
                      "rebuild with `gdnpass llama-build`")
    graph = GraphLayout.from_dict(probe.get("graph", {}), where)
    if graph != PINNED_GRAPH:
        raise Refused(f"{where}: struct ggml_cgraph of this build differs from the pinned one ({graph})")
    check_size(PINNED_TENSOR, int(g.ggml_tensor_overhead()), GGML_OBJECT_SIZE, where)


def run(req: dict) -> dict:
    import llama_cpp.llama_cpp as L  # the sdist's bindings, from PYTHONPATH; LLAMA_CPP_LIB_PATH names the libraries

    g = _ggml(req["lib_dir"])
    check_layout(req["layout"], g)
    names = _names(g)
    logs: list[str] = []
    phase = ["load"]

    on_log = log_into(L, logs, phase)  # noqa: F841 (kept referenced: llama.cpp calls it until the process ends)
    model = load_model(L, req, logs)

    recording = [False]
    order: list[int] = []
    record_memory = bool(req.get("record_memory"))
    prompt_order: list[int] = []
    cache_buffers: list[int] = []   # found from the prompt's graph
    memory: dict[int, bytes] = {}   # buffer address -> its bytes before the verify graph runs
    record_nodes = bool(req.get("record_nodes"))
    node_data: dict[int, bytes] = {}  # verify node index -> its bytes just after it ran (record_nodes)
    inputs: dict[int, bytes] = {}     # graph input address -> its bytes as llama.cpp set them
    looked: set[int] = set()

    def keep_inputs(node: int) -> None:
        """The bytes of the graph inputs ``node`` reads (directly or through a view), the first time one is read."""
        for a in read_tensor(node, PINNED_TENSOR, names).src:
            while a is not None and a not in looked:
                looked.add(a)
                c = read_tensor(a, PINNED_TENSOR, names)
                if c.view_src is None:
                    es = _TYPE_SIZES.get(c.type_name)
                    if c.flags & _FLAG_INPUT and c.op_name == "NONE" and c.data and es:
                        inputs[a] = ctypes.string_at(c.data, es * c.ne[0] * c.ne[1] * c.ne[2] * c.ne[3])
                    break
                a = c.view_src

    def snapshot(first: int) -> None:
        """The compute buffer of the first verify node and the cache buffers, before any verify node runs."""
        c = read_reachable([first], PINNED_TENSOR, names)[first]
        bufs = list(cache_buffers)
        if c.buffer and int(g.ggml_backend_buffer_get_usage(c.buffer)) == 2:  # GGML_BACKEND_BUFFER_USAGE_COMPUTE
            bufs.append(c.buffer)
        for b in bufs:
            base, size = g.ggml_backend_buffer_get_base(b), int(g.ggml_backend_buffer_get_size(b))
            memory[b] = ctypes.string_at(base, size) if base and size else b""

    @L.ggml_backend_sched_eval_callback
    def on_eval(t, ask, user_data):  # noqa: ARG001
        if recording[0] and ask:
            if record_memory and not order:
                snapshot(int(t))
            keep_inputs(int(t))
            order.append(int(t))
            return record_nodes  # "not needed" (the graph runs in one go) unless every node's bytes are kept
        if recording[0] and record_nodes:  # asked for: node t has just run
            c = read_reachable([int(t)], PINNED_TENSOR, names)[int(t)]
            es = _TYPE_SIZES.get(c.type_name)
            if es and c.data and c.op_name not in _NO_DATA_OPS and all(x > 0 for x in c.ne):
                n = es + sum((c.ne[i] - 1) * c.nb[i] for i in range(4))
                node_data[len(order) - 1] = ctypes.string_at(c.data, n)
            return True
        if record_memory and phase[0] == "prompt" and ask:
            prompt_order.append(int(t))
        return False  # "not needed": the scheduler computes the graph in one go

    phase[0] = "context"
    mtp = MtpPair(L, model, req, logs, on_eval) if req.get("mtp") else None
    ctx = mtp.ctx if mtp else make_context(L, model, req, logs, req["n_rs_seq"], on_eval)

    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    n_seqs = int(req.get("n_seqs", 1))
    # sequence s's prompt and verify tokens (one list each per sequence; a one-sequence request may give a flat list)
    per_seq = lambda ids: ids if ids and isinstance(ids[0], list) else [ids]  # noqa: E731
    prompts = [[int(x) % n_vocab for x in p] for p in per_seq(req["prompt"])]
    verifies = [[int(x) % n_vocab for x in v] for v in per_seq(req["verify"])]
    if len(prompts) != n_seqs or len(verifies) != n_seqs:
        raise Refused(f"n_seqs {n_seqs}: the request has {len(prompts)} prompts and {len(verifies)} verify batches")
    prompt, verify = prompts[0], [x for v in verifies for x in v]

    t0 = time.perf_counter()
    phase[0] = "prompt"
    if mtp:
        mtp.step(prompt, 0, "none")
    else:
        for seq, p in enumerate(prompts):  # one decode per sequence: each its own cell of the recurrent memory
            decode(L, ctx, logs, p, 0, "last", seq=seq)
    if record_memory:  # the buffers the prompt's graph reads besides the model and the compute buffer: the caches
        for c in read_reachable(prompt_order, PINNED_TENSOR, names).values():
            if c.buffer and c.buffer not in cache_buffers and int(g.ggml_backend_buffer_get_usage(c.buffer)) == 0:
                cache_buffers.append(c.buffer)
    phase[0] = "verify"
    n_out = len(verify)
    if mtp:  # the target's verify first (not recorded: the callback is the MTP context's), then the MTP ubatch
        n_out = {"all": len(verify), "last": 1, "none": 0}[req["mtp_outputs"]]
        mtp.target(verify, len(prompt))
        recording[0] = True
        mtp.head(verify, len(prompt), req["mtp_outputs"])
    else:
        recording[0] = True
        # one batch of every sequence's verify tokens, sequence-major: split_equal makes it one ubatch of n_seqs
        # sequences x n_tokens (its sequential split takes the sequence ids in increasing order)
        decode_seqs(L, ctx, logs, verifies, len(prompt), "all")
    recording[0] = False
    verify_tensors = read_reachable(order, PINNED_TENSOR, names)
    logits_p = L.llama_get_logits(ctx)
    logits = ctypes.string_at(logits_p, 4 * n_vocab * n_out) if logits_p and n_out else b""

    # the worst-case graph the compute buffer was planned for (llama_context::sched_reserve's last reserve)
    phase[0] = "reserve"
    lib = ctypes.CDLL(os.path.join(req["lib_dir"], "libllama.so"))
    reserve = getattr(lib, _RESERVE_SYMBOL)
    reserve.argtypes, reserve.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32], \
        ctypes.c_void_p
    n_ctx = L.llama_n_ctx(ctx)
    r_tokens = min(n_ctx, req["n_ubatch"])
    n_outputs_max = req["n_batch"]  # llama_context_params.n_outputs_max = 0 -> n_batch
    # (llama_context::sched_reserve's: n_seqs = n_seq_max; graph_reserve rounds n_tokens up to a multiple of it)
    gf = reserve(ctx, r_tokens, n_seqs, min(r_tokens, n_outputs_max))
    if not gf:
        raise Refused("llama_graph_reserve failed: " + _last_error(logs))
    rg = read_graph(gf, PINNED_GRAPH)
    reserve_tensors = read_reachable(rg.nodes + rg.leafs, PINNED_TENSOR, names)

    buffers: dict[int, dict] = {}
    if record_memory and not memory:
        raise Refused("record_memory: the verify graph was never asked about (no eval callback)")
    for c in list(verify_tensors.values()) + list(reserve_tensors.values()):
        if c.buffer and c.buffer not in buffers:
            buffers[c.buffer] = {"name": g.ggml_backend_buffer_name(c.buffer).decode(),
                                 "base": int(g.ggml_backend_buffer_get_base(c.buffer) or 0),
                                 "size": int(g.ggml_backend_buffer_get_size(c.buffer)),
                                 "usage": _USAGE.get(int(g.ggml_backend_buffer_get_usage(c.buffer)), "?"),
                                 "alignment": int(g.ggml_backend_buffer_get_alignment(c.buffer))}
    out = {
        "settings": {"n_ctx": int(n_ctx), "n_ctx_requested": req["n_ctx"], "n_batch": req["n_batch"],
                     "n_ubatch": req["n_ubatch"], "n_seq_max": n_seqs,
                     "kv_unified": bool(req.get("kv_unified")), "n_rs_seq": int(L.llama_n_rs_seq(ctx)),
                     "n_rs_seq_requested": req["n_rs_seq"], "flash_attn": req["flash_attn"],
                     "n_threads": req["n_threads"], "n_prompt": len(prompt), "n_tokens": len(verify),
                     "reserve": {"n_tokens": r_tokens, "n_seqs": n_seqs, "n_outputs": min(r_tokens, n_outputs_max)}},
        "system_info": (L.llama_print_system_info() or b"").decode(errors="replace"),
        "n_vocab": int(n_vocab),
        "verify": {"nodes": order, "tensors": [c.to_json() for c in verify_tensors.values()]},
        "reserve": {"nodes": rg.nodes, "leafs": rg.leafs, "use_counts": {str(k): v for k, v in rg.use_counts.items()},
                    "tensors": [c.to_json() for c in reserve_tensors.values()]},
        "buffers": {str(k): v for k, v in buffers.items()},
        "logits": base64.b64encode(logits).decode(),
        "memory": {str(k): base64.b64encode(v).decode() for k, v in memory.items()},
        "node_data": {str(k): base64.b64encode(v).decode() for k, v in node_data.items()},
        "inputs": {str(k): base64.b64encode(v).decode() for k, v in inputs.items()},
        "log": logs,
        "capture_s": round(time.perf_counter() - t0, 3),
    }
    if mtp:
        out["settings"]["mtp"] = {"n_layer_nextn": int(L.llama_model_n_layer_nextn(model)), "outputs":
                                  req["mtp_outputs"], "n_outputs": n_out, "n_ctx_target": int(L.llama_n_ctx(mtp.tgt)),
                                  "n_rs_seq_target": int(L.llama_n_rs_seq(mtp.tgt))}
        out["h_input"] = base64.b64encode(mtp.last_h).decode()
        L.llama_free(mtp.tgt)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return out


class MtpPair:
    """A target context and its MTP context (``LLAMA_CONTEXT_TYPE_MTP``, ``ctx_other`` = the target, no rollback
    planes, the eval callback ``cb_eval``), driven as llama.cpp's MTP drafter drives them
    (common/speculative.cpp ``common_speculative_impl_draft_mtp``): the target emits its ``h_nextn`` rows for every
    token (``llama_set_embeddings_nextn(tgt, true, masked false)``), the MTP context its own for the output rows
    (masked true); every target batch is followed by an MTP batch of the same tokens at the same positions, token k
    paired with the target's hidden state of token k - 1 (the first with the last row of the batch before: zeros at
    the start), its ``process`` hook."""

    def __init__(self, L, model, req: dict, logs: list[str], cb_eval) -> None:
        self.L, self.logs = L, logs
        lib = ctypes.CDLL(os.path.join(req["lib_dir"], "libllama.so"))
        self.set_nextn = getattr(lib, _SET_NEXTN_SYMBOL)
        self.set_nextn.argtypes, self.set_nextn.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
        self.get_nextn = getattr(lib, _GET_NEXTN_SYMBOL)
        self.get_nextn.argtypes, self.get_nextn.restype = [ctypes.c_void_p], ctypes.POINTER(ctypes.c_float)
        if int(L.llama_model_n_layer_nextn(model)) < 1:
            raise Refused(f"{req['gguf']} has no MTP block (llama_model_n_layer_nextn is 0)")
        self.tgt = make_context(L, model, req, logs, req["n_rs_seq"])
        self.set_nextn(self.tgt, True, False)
        # the MTP context: the target's n_ctx, no snapshot planes (common_speculative_init_result sets both)
        self.ctx = make_context(L, model, {**req, "n_ctx": int(L.llama_n_ctx(self.tgt))}, logs, 0, cb_eval,
                                ctx_type=L.LLAMA_CONTEXT_TYPE_MTP, ctx_other=self.tgt)
        self.set_nextn(self.ctx, True, True)
        self.n_embd = int(L.llama_model_n_embd(model))
        self.pending = bytes(4 * self.n_embd)  # the hidden state paired with the next batch's first token
        self.last_h = b""                      # the h rows of the last MTP batch (what mtp_h_input held)

    def target(self, tokens: list[int], pos0: int) -> bytes:
        """The target's decode of ``tokens`` (logits for every row) and its h_nextn rows."""
        decode(self.L, self.tgt, self.logs, tokens, pos0, "all")
        p = self.get_nextn(self.tgt)
        if not p:
            raise Refused("llama_get_embeddings_nextn returned no rows for the target's batch")
        self.h_tgt = ctypes.string_at(p, 4 * self.n_embd * len(tokens))
        return self.h_tgt

    def head(self, tokens: list[int], pos0: int, outputs: str, h: bytes | None = None) -> None:
        """The MTP context's batch of ``tokens`` at pos0.., each with its paired hidden state, logits for "all",
        the "last" or "none" of its rows. ``h``: the rows to pair; default the process hook's pairing of the target's
        last batch (of these tokens): the pending row, then that batch's rows but its last, which becomes the pending
        row."""
        L, row = self.L, 4 * self.n_embd
        if h is None:
            n = len(tokens)
            rows = self.pending + self.h_tgt[: (n - 1) * row]
            self.pending = self.h_tgt[(n - 1) * row: n * row]
        else:
            rows = h
        self.last_h = rows
        buf = ctypes.create_string_buffer(rows, len(rows))
        b = L.llama_batch_ext_init(self.ctx)
        try:
            for i, tok in enumerate(tokens):
                idx = L.llama_batch_ext_add_token(b, 0, tok)
                if idx < 0:
                    raise Refused(f"llama_batch_ext_add_token returned {idx} for token {i} of the MTP batch")
                L.llama_batch_ext_set_pos(b, idx, (L.llama_pos * 4)(pos0 + i, 0, 0, 0))
                data = ctypes.cast(ctypes.byref(buf, i * row), ctypes.POINTER(ctypes.c_float))
                if not L.llama_batch_ext_set_embd_token(b, idx, L.llama_embd(data, 1, self.n_embd)):
                    raise Refused(f"llama_batch_ext_set_embd_token refused row {i} of the MTP batch")
                if outputs == "all" or outputs == "last" and i == len(tokens) - 1:
                    L.llama_batch_ext_set_output_logits(b, idx, True)
            rc = L.llama_process(self.ctx, L.LLAMA_PROCESS_TYPE_DECODE, b)
            if rc != 0:
                raise Refused(f"llama_process of the MTP context returned {rc} for {len(tokens)} tokens at position "
                              f"{pos0}: " + _last_error(self.logs))
        finally:
            L.llama_batch_ext_free(b)

    def step(self, tokens: list[int], pos0: int, outputs: str) -> None:
        """A target batch and the MTP process hook's batch after it."""
        self.target(tokens, pos0)
        self.head(tokens, pos0, outputs)


def run_generate(req: dict) -> dict:
    """``mode: generate``: llama.cpp's own speculative-simple loop with a greedy sampler, on one sequence or several
    at once (``prompts`` and ``drafters``: one each per sequence; a context of n_seq_max = their number, a KV stream
    each).

    Prefill every prompt but its last token (one batch, no logits); then per step: each running sequence drafts with
    its drafter (``gdnpass.drafters``, pure Python: the same drafter code as gdnpass's loop), one ``llama_decode`` of
    every running sequence's [id_last, drafts...] at its own positions with logits for every token (llama.cpp splits
    the batch into ubatches itself), each accepts its greedy prefix (row i's argmax equals draft i) and rolls back
    with ``llama_memory_seq_rm(mem, seq, n_past, -1)`` (with ``n_rs_seq > 0`` the recurrent memory restores the
    snapshot plane ``cell.pos - (n_past - 1)`` for the sequence's next ubatch); a sequence with ``n_predict`` tokens
    leaves the batch. Returns per sequence the tokens, per step the width, the accepted drafts and seq_rm's result,
    per token its top-2 margin (and, with ``rows``, its logits row); with one prompt these are the record's own
    keys. With ``record_ubatches`` also every batch's (sequence, tokens) and the ubatches llama.cpp ran for it,
    (sequences, tokens) each, read from the graphs its scheduler computed.

    For timing (the peer of ``benchmarks/seqs_bench.py``): ``sampling`` "host" reads each row's greedy token as the
    argmax of its logits, which llama.cpp copies to the host (numpy, no margins), "backend" lets llama.cpp's greedy
    sampler run on the device (``llama_context_params.samplers``: a greedy chain per sequence, the token read with
    ``llama_get_sampled_token_ith``; the logits stay there); the default ("full") keeps margins as above. ``runs``:
    the loop run that many times in the one context (``llama_memory_clear`` between), each run's decode loop timed
    (prefill excluded, after ``llama_synchronize``): ``runs`` in the record. ``cases``: several such requests (each a
    dict of keys overriding the request's) on one model load: ``cases`` in the record, one record each (or
    ``{"error": ...}`` for a case llama.cpp refused)."""
    import llama_cpp.llama_cpp as L

    logs: list[str] = []
    on_log = log_into(L, logs)  # noqa: F841 (kept referenced: llama.cpp calls it until the process ends)
    model = load_model(L, req, logs)
    if req.get("cases"):  # (a case llama.cpp refuses gets its error; the others still run)
        out = {"cases": [_generate_or_error(L, model, {**req, **case}, logs) for case in req["cases"]]}
    else:
        out = _generate(L, model, req, logs)
    L.llama_model_free(model)
    return out


SAMPLING = ("full", "host", "backend")


def _generate_or_error(L, model, req: dict, logs: list[str]) -> dict:
    try:
        return _generate(L, model, req, logs)
    except Refused as e:
        return {"error": str(e)}


def _generate(L, model, req: dict, logs: list[str]) -> dict:
    """One context of :func:`run_generate`: the loop over its prompts, ``runs`` times."""
    from gdnpass.drafters import accept_greedy, draft_budget, first_argmax, from_spec  # (no torch)
    from gdnpass.errors import GdnpassError

    prompts = [[int(x) for x in p] for p in req.get("prompts") or [req["prompt"]]]
    specs = req.get("drafters") or [req.get("drafter") or {"kind": "none"}] * len(prompts)
    if len(specs) != len(prompts):
        raise Refused(f"{len(prompts)} prompts and {len(specs)} drafters: one drafter per sequence")
    try:
        for d, p in zip(specs, prompts):  # (a kind it does not know: one line, before llama.cpp runs)
            from_spec(d, len(p), 1)
    except GdnpassError as e:
        raise Refused(str(e)) from None
    sampling = req.get("sampling", "full")
    if sampling not in SAMPLING:
        raise Refused(f"sampling {sampling!r}: expected one of {', '.join(SAMPLING)}")
    runs = int(req.get("runs", 1))
    if runs < 1:
        raise Refused(f"runs must be >= 1, is {runs}")
    ran: list[list[int]] = []  # the ubatches of the current llama_decode: [sequences, tokens] each
    on_eval = _ubatch_recorder(req, ran) if req.get("record_ubatches") else None
    K, N = req["draft_max"], req["n_predict"]
    chains = _greedy_chains(L, len(prompts)) if sampling == "backend" else None
    ctx = make_context(L, model, {**req, "n_seqs": len(prompts)}, logs, req["n_rs_seq"], on_eval,
                       samplers=chains, n_outputs_max_per_seq=K + 1 if chains else 0)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    mem = L.llama_get_memory(ctx)
    n_ctx = int(L.llama_n_ctx_seq(ctx))  # (each sequence's stream: n_ctx / n_seq_max)

    def greedy(row: int, q: dict) -> int:
        """Row ``row`` (of the batch) 's greedy token, as ``sampling`` reads it."""
        if sampling == "backend":
            tok = int(L.llama_get_sampled_token_ith(ctx, row))
            if tok == L.LLAMA_TOKEN_NULL:
                raise Refused(f"backend sampling gave no token for row {row} of the batch")
            return tok
        p = L.llama_get_logits_ith(ctx, row)
        if sampling == "host":
            import numpy as np

            return int(np.argmax(np.ctypeslib.as_array(p, shape=(n_vocab,))))  # (the first of equal maxima)
        values = [p[j] for j in range(n_vocab)]
        top = sorted(values, reverse=True)[:2]
        q["margins"].append(top[0] - top[1])
        if req.get("rows"):
            q["rows"].append(base64.b64encode(ctypes.string_at(p, 4 * n_vocab)).decode())
        return first_argmax(values)

    def loop() -> tuple[list[dict], dict, list[dict], float, float]:
        """One run: the sequences' records, the prefill's and each step's batches, the whole and the decode loop's
        seconds."""
        seqs = [{"drafter": from_spec(d, len(p), n_vocab), "history": p[:-1], "id_last": p[-1], "tokens": [],
                 "steps": [], "margins": [], "rows": []} for p, d in zip(prompts, specs)]
        t0 = time.perf_counter()
        ran.clear()
        if any(q["history"] for q in seqs):
            decode_seqs(L, ctx, logs, {s: q["history"] for s, q in enumerate(seqs) if q["history"]}, 0, "none")
        L.llama_synchronize(ctx)
        prefill = {"batch": [[s, len(q["history"])] for s, q in enumerate(seqs) if q["history"]],
                   "ubatches": list(ran)}
        batches = []
        t_loop = time.perf_counter()
        while True:
            running = [s for s, q in enumerate(seqs) if len(q["tokens"]) < N]
            if not running:
                break
            drafts = {}
            for s in running:
                q = seqs[s]
                budget = draft_budget(K, n_ctx, len(q["history"]), N, len(q["tokens"]))
                drafts[s] = [int(t) for t in q["drafter"].draft(q["history"], q["id_last"], budget)][:budget]
            ran.clear()
            batch = {s: [seqs[s]["id_last"], *drafts[s]] for s in running}
            decode_seqs(L, ctx, logs, batch, {s: len(seqs[s]["history"]) for s in running}, "all")
            batches.append({"batch": [[s, len(b)] for s, b in batch.items()], "ubatches": list(ran)})
            row0 = 0  # the batch index of the sequence's first row
            for s in running:
                q, draft = seqs[s], drafts[s]
                ids = accept_greedy(draft, lambda i, q=q, row0=row0: greedy(row0 + i, q))
                row0 += len(draft) + 1
                for tok in ids:
                    q["history"].append(q["id_last"])
                    q["id_last"] = tok
                ok = bool(L.llama_memory_seq_rm(mem, s, len(q["history"]), -1))
                q["steps"].append({"n_t": len(draft) + 1, "drafted": len(draft), "accepted": len(ids) - 1,
                                   "seq_rm": ok, "pos_max": int(L.llama_memory_seq_pos_max(mem, s))})
                q["tokens"] += ids
        t1 = time.perf_counter()
        return seqs, prefill, batches, t1 - t0, t1 - t_loop

    timed = []
    for r in range(runs):
        if r:
            L.llama_memory_clear(mem, True)
        seqs, prefill, batches, seconds, decode_s = loop()
        tokens = [q["tokens"] for q in seqs]
        if not r:
            first = (seqs, prefill, batches, seconds, tokens)
        n_tokens = sum(len(t) for t in tokens)
        timed.append({"decode_seconds": round(decode_s, 6), "n_tokens": n_tokens,
                      "tokens_per_second": round(n_tokens / decode_s, 3) if decode_s else 0.0,
                      "same_tokens": tokens == first[4]})
    seqs, prefill, batches, seconds, _ = first
    sequences = [{k: q[k] for k in ("tokens", "steps", "margins", "rows")} for q in seqs]
    out = {**(sequences[0] if len(seqs) == 1 else {}), "sequences": sequences, "n_vocab": int(n_vocab),
           "settings": {"n_ctx": int(L.llama_n_ctx(ctx)), "n_ctx_seq": n_ctx, "n_seq_max": len(seqs),
                        "n_rs_seq": int(L.llama_n_rs_seq(ctx)), "n_ubatch": req["n_ubatch"], "sampling": sampling,
                        "n_gpu_layers": int(req.get("n_gpu_layers", 0))},
           "seconds": round(seconds, 3), "runs": timed}
    if req.get("record_ubatches"):
        out.update({"prefill": prefill, "batches": batches})
    L.llama_free(ctx)
    for chain in chains or ():
        L.llama_sampler_free(chain)
    return out


def _greedy_chains(L, n: int) -> list:
    """One sampler chain holding llama.cpp's greedy sampler per sequence (backend sampling takes chains only)."""
    chains = []
    for _ in range(n):
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        chains.append(chain)
    return chains


def _ubatch_recorder(req: dict, ran: list[list[int]]):
    """An eval callback that appends [sequences, tokens] to ``ran`` for every ubatch graph the scheduler computes:
    its tokens from the token embedding's rows (``model.input_embed``), its sequences from the first GDN layer's
    gathered conv states (``conv_states-<il>``, one row per sequence). It asks for nothing (the graph runs in one
    go)."""
    import llama_cpp.llama_cpp as L

    g = _ggml(req["lib_dir"])
    check_layout(req["layout"], g)
    names = _names(g)

    @L.ggml_backend_sched_eval_callback
    def on_eval(t, ask, user_data):  # noqa: ARG001
        if ask:
            c = read_tensor(int(t), PINNED_TENSOR, names)
            if c.name == "model.input_embed":
                ran.append([0, int(c.ne[1])])
            elif c.name.startswith("conv_states-") and ran and ran[-1][0] == 0:
                ran[-1][0] = int(c.ne[1])
        return False
    return on_eval


def run_time(req: dict) -> dict:
    """``mode: time``: upstream's verify decode alone, for the benchmarks (``benchmarks/upstream.py``).

    One model load (``n_gpu_layers``: -1 offloads every layer), then per case {"n_tokens", "n_rs_seq"} a context
    with the request's settings and the DFlash taps (``layer_inputs``: ``llama_set_embeddings_layer_inp``), the
    prompt, then ``warmup`` + ``reps`` verify decodes of ``n_tokens`` tokens with logits for every token. Each is a
    step of the speculative loop that accepts no draft: its first token stays, ``llama_memory_seq_rm`` rolls the
    rest back (restoring a snapshot plane), and the next verify starts one position later (:func:`positions_used`).
    Every decode has the same shapes, so ggml-cuda replays its CUDA graph. Each decode is timed wall-clock around
    ``llama_decode`` + ``llama_synchronize``. With ``profile``, one more verify decode between cuProfilerStart and
    cuProfilerStop, the window ``ncu --profile-from-start off`` measures."""
    import llama_cpp.llama_cpp as L

    logs: list[str] = []

    on_log = log_into(L, logs)  # noqa: F841 (kept referenced: llama.cpp calls it until the process ends)
    t0 = time.perf_counter()
    model = load_model(L, req, logs)
    load_s = time.perf_counter() - t0
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    prompt = [int(x) % n_vocab for x in req["prompt"]]
    cuda = ctypes.CDLL("libcuda.so.1") if req.get("profile") else None
    lib = ctypes.CDLL(os.path.join(req["lib_dir"], "libllama.so"))
    set_layer_inp = getattr(lib, _LAYER_INP_SYMBOL)
    set_layer_inp.argtypes, set_layer_inp.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None
    cases = []
    for case in req["cases"]:
        ctx = make_context(L, model, req, logs, case["n_rs_seq"])
        for lid in req.get("layer_inputs", ()):
            set_layer_inp(ctx, lid, True)
        mem = L.llama_get_memory(ctx)
        if prompt:
            decode(L, ctx, logs, prompt, 0, "none")
        verify = [(7 * i + 3) % n_vocab for i in range(case["n_tokens"])]
        pos = [len(prompt)]

        def step() -> float:  # one verify that accepts no draft: its first token stays, the rest is rolled back
            a = time.perf_counter()
            decode(L, ctx, logs, verify, pos[0], "all")
            L.llama_synchronize(ctx)
            b = time.perf_counter()
            pos[0] += 1
            if not L.llama_memory_seq_rm(mem, 0, pos[0], -1):
                raise Refused(f"llama_memory_seq_rm refused the rollback to position {pos[0]}")
            return b - a

        for _ in range(req.get("warmup", 3)):
            step()
        wall = [step() for _ in range(req.get("reps", 20))]
        if cuda is not None:
            cuda.cuProfilerStart()
            step()
            cuda.cuProfilerStop()
        cases.append({**case, "n_rs_seq_resolved": int(L.llama_n_rs_seq(ctx)), "wall_s": wall})
        L.llama_free(ctx)
    out = {"cases": cases, "n_vocab": int(n_vocab), "load_s": round(load_s, 2),
           "system_info": (L.llama_print_system_info() or b"").decode(errors="replace"),
           "log": [x for x in logs if "CUDA" in x or "offload" in x or "graph" in x.lower()][-40:]}
    L.llama_model_free(model)
    return out


def run_tokenize(req: dict) -> dict:
    """``mode: tokenize``: llama.cpp's own tokenizer on the file's vocabulary (the model loaded with ``vocab_only``:
    no weights). Per text (``texts``, UTF-8) and per [add_special, parse_special] of ``modes``: ``llama_tokenize``'s
    ids. Per id of ``pieces`` (null: every token): ``llama_token_to_piece(lstrip 0)`` with special true and false
    (base64). Per {"ids", "remove_special", "unparse_special"} of ``detokenize``: ``llama_detokenize``'s bytes
    (base64). Also the ids ``llama_vocab_is_eog`` accepts, the special ids and add_bos / add_eos."""
    import llama_cpp.llama_cpp as L

    logs: list[str] = []

    on_log = log_into(L, logs)  # noqa: F841 (kept referenced: llama.cpp calls it until the process ends)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(req["gguf"].encode(), mp)
    if not model:
        raise Refused(f"llama.cpp could not load {req['gguf']}: " + _last_error(logs, 2))
    vocab = L.llama_model_get_vocab(model)
    n_vocab = int(L.llama_vocab_n_tokens(vocab))

    def tokenize(text: bytes, add_special: bool, parse_special: bool) -> list[int]:
        cap = len(text) + 8
        while True:
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(vocab, text, len(text), buf, cap, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def piece(tid: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(vocab, tid, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(vocab, tid, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
        arr = (L.llama_token * max(1, len(ids)))(*ids)
        cap = 16 * len(ids) + 16
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = L.llama_detokenize(vocab, arr, len(ids), buf, cap, remove_special, unparse_special)
            if n >= 0:
                return buf.raw[:n]
            cap = -n

    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    texts = [t.encode() for t in req.get("texts", [])]
    modes = [(bool(a), bool(p)) for a, p in req.get("modes", [[True, True]])]
    tokens = [[tokenize(t, a, p) for a, p in modes] for t in texts]
    ids = range(n_vocab) if req.get("pieces") is None else [int(i) for i in req["pieces"]]
    pieces = {str(i): [b64(piece(i, True)), b64(piece(i, False))] for i in ids}
    detok = [b64(detokenize([int(i) for i in d["ids"]], bool(d["remove_special"]), bool(d["unparse_special"])))
             for d in req.get("detokenize", [])]
    null = L.LLAMA_TOKEN_NULL

    def special(tid: int) -> int | None:
        return None if tid == null else int(tid)

    out = {"n_vocab": n_vocab, "tokens": tokens, "modes": modes, "pieces": pieces, "detokenized": detok,
           "eog": [i for i in range(n_vocab) if L.llama_vocab_is_eog(vocab, i)],
           "special": {"bos": special(L.llama_vocab_bos(vocab)), "eos": special(L.llama_vocab_eos(vocab)),
                       "eot": special(L.llama_vocab_eot(vocab)), "pad": special(L.llama_vocab_pad(vocab))},
           "add_bos": bool(L.llama_vocab_get_add_bos(vocab)), "add_eos": bool(L.llama_vocab_get_add_eos(vocab)),
           "log": [x for x in logs if "error" in x.lower() or "warn" in x.lower()][-20:]}
    L.llama_model_free(model)
    return out


def run_quantize(req: dict) -> dict:
    """``mode: quantize``: ``llama_model_quantize`` of ``src`` into ``dst`` with
    ``llama_model_quantize_default_params()`` but ``ftype`` (the name of a ``LLAMA_FTYPE_*`` constant of the
    bindings, read from them here) and ``n_threads``. Returns the ftype's value, the seconds and llama.cpp's log
    lines (its fragments joined into lines: a fallback warning comes in three calls)."""
    import llama_cpp.llama_cpp as L

    text: list[str] = []

    @L.llama_log_callback
    def on_log(level, chunk, user_data):  # noqa: ARG001 - ctypes signature
        text.append((chunk or b"").decode(errors="replace"))

    L.llama_log_set(on_log, None)
    ftype = getattr(L, req["ftype"], None)
    if not isinstance(ftype, int):
        raise Refused(f"the bindings of this llama.cpp build have no {req['ftype']}")
    L.llama_backend_init()
    params = L.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = int(req["n_threads"])
    t0 = time.perf_counter()
    rc = L.llama_model_quantize(req["src"].encode(), req["dst"].encode(), ctypes.byref(params))
    seconds = time.perf_counter() - t0
    logs = [x.rstrip() for x in "".join(text).splitlines() if x.strip()]
    if rc != 0:  # llama_model_quantize caught an exception: "llama_model_quantize: failed to quantize: <what>"
        at = [i for i, x in enumerate(logs) if "failed to quantize: " in x]
        if not at:
            raise Refused(_last_error(logs))
        msg = logs[at[-1]].split("failed to quantize: ", 1)[1]
        if "failed to load model" in msg and at[-1] > 0:  # the loader's cause is the line before
            msg += f" ({logs[at[-1] - 1].split(': ', 1)[-1]})"
        raise Refused(f"llama_model_quantize failed: {msg}")
    return {"ftype_value": int(ftype), "seconds": round(seconds, 3), "log": logs}


def positions_used(n_prompt: int, n_tokens: int, steps: int) -> int:
    """KV cells :func:`run_time` fills: the prompt, then ``steps`` verifies of ``n_tokens`` tokens, each starting one
    position after the one before."""
    return n_prompt + steps - 1 + n_tokens


def log_into(L, logs: list[str], phase: list[str] | None = None):
    """Route llama.cpp's and ggml's log lines into ``logs`` (prefixed with ``phase[0]``, the step the worker is in,
    when given); returns the ctypes callback, which the caller must keep referenced."""
    @L.llama_log_callback
    def on_log(level, text, user_data):  # noqa: ARG001 - ctypes signature
        line = (text or b"").decode(errors="replace").rstrip()
        logs.append(f"{phase[0]}: {line}" if phase else line)

    L.llama_log_set(on_log, None)
    return on_log


def load_model(L, req: dict, logs: list[str]):
    """The request's GGUF, with ``n_gpu_layers`` of its layers on the GPU (default 0; -1: all); Refused when
    llama.cpp cannot load it."""
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = int(req.get("n_gpu_layers", 0))
    mp.load_mtp = bool(req.get("mtp"))  # the MTP blocks' tensors (skipped by default: TENSOR_SKIP)
    model = L.llama_model_load_from_file(req["gguf"].encode(), mp)
    if not model:
        raise Refused(f"llama.cpp could not load {req['gguf']}: " + _last_error(logs, 2))
    return model


def make_context(L, model, req: dict, logs: list[str], n_rs_seq: int, cb_eval=None, ctx_type: int = 0,
                 ctx_other=None, samplers=None, n_outputs_max_per_seq: int = 0):
    """A context of the request's ``n_seqs`` sequences (default one) with its n_ctx / n_batch / n_ubatch / threads /
    flash attention and ``n_rs_seq`` rollback planes; ``cb_eval``: the scheduler's eval callback (None: none);
    ``ctx_type`` (an ``LLAMA_CONTEXT_TYPE_*``) and ``ctx_other`` (another context) as llama_context_params takes
    them; ``samplers``: a sampler chain per sequence, run on the device (backend sampling), with at most
    ``n_outputs_max_per_seq`` output rows per sequence and batch."""
    cp = L.llama_context_default_params()
    if samplers:
        configs = (L.llama_sampler_seq_config * len(samplers))()
        for s, chain in enumerate(samplers):
            configs[s].seq_id, configs[s].sampler = s, ctypes.cast(chain, ctypes.c_void_p)
        cp.samplers, cp.n_samplers = configs, len(samplers)
        cp.n_outputs_max_per_seq = n_outputs_max_per_seq
    cp.ctx_type = ctx_type
    if ctx_other is not None:
        cp.ctx_other = ctx_other
    cp.n_ctx, cp.n_batch, cp.n_ubatch = req["n_ctx"], req["n_batch"], req["n_ubatch"]
    cp.n_seq_max, cp.n_rs_seq = int(req.get("n_seqs", 1)), n_rs_seq  # one recurrent cell per sequence
    cp.kv_unified = bool(req.get("kv_unified"))  # False (llama.cpp's default): one KV stream per sequence
    cp.n_threads = cp.n_threads_batch = req["n_threads"]
    cp.flash_attn_type = FLASH_ATTN[req["flash_attn"]]
    if cb_eval is not None:
        cp.cb_eval = cb_eval
        cp.cb_eval_user_data = None
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise Refused("llama.cpp could not create the context: " + _last_error(logs))
    return ctx


def decode(L, ctx, logs: list[str], tokens: list[int], pos0: int, logits: str, seq: int = 0) -> None:
    """One llama_decode of ``tokens`` at positions pos0.. of sequence ``seq``, with logits for "all", the "last" or
    "none" of its rows; a failure is a Refused naming llama.cpp's last error."""
    decode_seqs(L, ctx, logs, {seq: tokens}, pos0, logits)


def decode_seqs(L, ctx, logs: list[str], tokens, pos0, logits: str) -> None:
    """One llama_decode of one batch holding each sequence's tokens (``tokens``: a list per sequence id, or a dict
    seq id -> list) at positions pos0.. (one for all, or a dict seq id -> its first position), sequence after
    sequence, with logits for "all" or the "last" of each sequence's rows or "none"; a failure is a Refused naming
    llama.cpp's last error."""
    seqs = tokens.items() if isinstance(tokens, dict) else enumerate(tokens)
    rows = [(seq, i, tok, i == len(toks) - 1) for seq, toks in seqs for i, tok in enumerate(toks)]
    first = pos0 if isinstance(pos0, dict) else {seq: pos0 for seq, _, _, _ in rows}
    b = L.llama_batch_init(len(rows), 0, 1)
    try:
        b.n_tokens = len(rows)
        for j, (seq, i, tok, last) in enumerate(rows):
            b.token[j], b.pos[j], b.n_seq_id[j] = tok, first[seq] + i, 1
            b.seq_id[j][0] = seq
            b.logits[j] = 1 if logits == "all" or logits == "last" and last else 0
        rc = L.llama_decode(ctx, b)
        if rc != 0:
            raise Refused(f"llama_decode returned {rc} for {len(rows)} tokens at position "
                          f"{pos0 if not isinstance(pos0, dict) else min(first.values(), default=0)}: "
                          + _last_error(logs))
    finally:
        L.llama_batch_free(b)


def _last_error(logs: list[str], n: int = 1) -> str:
    """The last ``n`` error lines of llama.cpp's log, joined (the cause usually comes one line before the summary)."""
    errs = [x.split(": ", 1)[-1] for x in logs if "error" in x.lower() or "failed" in x.lower()]
    return "; ".join(errs[-n:]) if errs else (logs[-1].split(": ", 1)[-1] if logs else "no message")


def main(argv: list[str]) -> int:
    req_path, out_path = argv
    with open(req_path) as fh:
        req = json.load(fh)
    try:
        mode = {"generate": run_generate, "time": run_time, "tokenize": run_tokenize,
                "quantize": run_quantize}.get(req.get("mode"), run)
        out = {"ok": True, **mode(req)}
    except Refused as err:
        out = {"ok": False, "error": str(err)}
    with open(out_path, "w") as fh:
        json.dump(out, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
