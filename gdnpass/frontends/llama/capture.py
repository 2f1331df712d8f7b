"""Capture llama.cpp's own verify graph and its memory plan, as gdnpass graphs.

:func:`capture` runs :mod:`.worker` in a subprocess on a GGUF file with the given context settings and returns a
:class:`Capture`:

* ``verify``: the graph llama.cpp computed for one verify ubatch of ``n_tokens`` tokens of one sequence, node for
  node in execution order, with llama.cpp's names, types, shapes, strides, views and op params, and every base
  tensor's buffer and byte offset as llama.cpp placed it. Buffers are named by role: ``weights`` (the model),
  ``compute`` (the scheduler's gallocr buffer: graph inputs and computed tensors alike), ``rs`` (recurrent states
  ``cache_r_l*`` / ``cache_s_l*``), ``kv`` (``cache_k_l*`` / ``cache_v_l*``); another buffer keeps its backend name.
* ``reserve``: the worst-case graph of ``n_ubatch`` tokens the compute buffer was planned for, unplanned (gallocr
  plans it once, at context creation, and binds that plan to every later graph of the same topology, node by node:
  :func:`gdnpass.alloc.bind`). Its leaf list also gives the verify graph its leafs, which the eval callback cannot see.
* ``verify.meta["input_bytes"]``: every graph input's bytes as llama.cpp set them (token ids, positions, the KQ mask,
  K/V row ids, ``rs_s_copy``; base64, by leaf name): the executor fills the inputs with them, so ``gdnpass run
  --graph FILE --check`` runs a captured graph on llama.cpp's own inputs;
* ``use_counts``: ggml's own use count of every verify tensor (``cgraph->use_counts`` of the reserve graph, by
  position), ``logits``, the resolved settings, llama.cpp's log;
* ``memory`` (with ``Settings(record_memory=True)``): the bytes of every non-weights buffer (``compute``, ``rs``,
  ``kv``) as the verify graph starts: its graph inputs set by llama.cpp (token ids, positions, KQ mask, row ids,
  ``rs_s_copy``...) and the caches after the prompt. Copied into an Executor's buffers, with the weights from the
  GGUF file, they make gdnpass run the very step llama.cpp ran (tests/kernels/test_attention_ops.py);
* ``node_data`` (with ``Settings(record_nodes=True)``): every computing verify node's bytes just after llama.cpp ran
  it, by node index (through the node's strides, from its first byte): a node-by-node referee of gdnpass's kernels.

A quantized weight becomes what gdnpass makes of it when it loads a model file: one of the block types gdnpass holds
(Q8_0, Q4_K, Q5_K, Q6_K) stays as llama.cpp has it; another (Q4_0, Q5_0, ...) becomes an f32 leaf (contiguous f32
strides) in a ``dequantized`` buffer of its own (role weights, gdnpass's, not llama.cpp's), so the graph is
comparable node for node with gdnpass's builder and executable; ``meta.llama.dequantized`` names each such leaf and
its ggml type.

A ggml assert (for example ``n_ubatch`` not above ``n_rs_seq + 1``) aborts the worker; it becomes one
:class:`~gdnpass.errors.LlamaError` line quoting the assert.

The same worker also runs llama.cpp's speculative loop (:func:`generate`), its verify decode timed (:func:`time_verify`)
and its tokenizer (:func:`tokenize`: ``llama_tokenize`` / ``llama_token_to_piece`` / ``llama_detokenize`` on a model
loaded with ``vocab_only``, the referee of :mod:`gdnpass.tokenizer`) and llama.cpp's quantizer (:mod:`.quantize`).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from gdnpass.errors import GraphError, LlamaError
from gdnpass.frontends.llama import build
from gdnpass.frontends.llama.worker import positions_used
from gdnpass.frontends.structs import TensorStruct, to_graph
from gdnpass.ir import BufferSpec, DType, Graph, Tensor

# one hint per ggml assert a user can cause with the context settings
_ASSERT_HINTS = {
    "n_ubatch > n_keep_tail": "n_ubatch must be greater than n_rs_seq + 1",
}


@dataclass(frozen=True)
class Settings:
    """The context settings of a capture (llama_context_params) and the batch it decodes."""

    n_tokens: int = 4          # the verify ubatch: draft tokens + 1
    n_rs_seq: int = 3          # rollback snapshot planes (llama_context_params.n_rs_seq)
    n_ubatch: int = 512        # llama.cpp's default; the reserve graph has min(n_ctx, n_ubatch) tokens
    n_batch: int = 2048
    n_ctx: int = 256           # padded to 256 by llama.cpp
    n_prompt: int = 8          # tokens decoded before the verify ubatch
    flash_attn: str = "auto"   # auto | on | off (auto resolves to FLASH_ATTN_EXT on the CPU)
    n_threads: int = 2
    seed: int = 0              # picks the token ids
    record_memory: bool = False  # keep the compute and cache buffers' bytes as the verify graph starts (Capture.memory)
    record_nodes: bool = False   # keep every verify node's bytes just after it runs (Capture.node_data)
    # the MTP head's graph instead of the target's (issue 35, docs/mtp.md): the model loaded with load_mtp, an MTP
    # context (LLAMA_CONTEXT_TYPE_MTP, ctx_other = the target, n_rs_seq 0) beside the target; the prompt and the
    # verify tokens go through the target, each batch followed by the MTP context's batch of the same tokens (each
    # paired with the target's hidden state of the token before), and the MTP batch of the verify tokens is recorded,
    # with logits for "all", the "last" or "none" of its rows (llama.cpp's draft steps ask for one, its process hook
    # for none)
    mtp: bool = False
    mtp_outputs: str = "all"
    # several sequences in one verify (issue 37): a context of n_seq_max = n_seqs (one recurrent cell each), each
    # sequence's prompt decoded on its own, then one batch of n_seqs x n_tokens verify tokens, which llama.cpp's
    # split_equal makes one ubatch (n_ubatch >= n_seqs * n_tokens); kv_unified as llama_context_params has it (False,
    # its default: one KV stream per sequence)
    n_seqs: int = 1
    kv_unified: bool = False

    def check(self, name=None) -> None:
        """GraphError, one line, for settings llama.cpp or the capture cannot take; ``name(field)`` names a field
        in the message (``gdnpass capture`` passes its flags: ``--tokens``)."""
        def need(ok: bool, field: str, msg: str) -> None:
            if not ok:
                raise GraphError(f"capture setting {name(field) if name else field}: {msg}")
        need(1 <= self.n_tokens <= 64, "n_tokens", f"must be 1..64, is {self.n_tokens}")
        need(0 <= self.n_rs_seq <= 15, "n_rs_seq", f"must be 0..15, is {self.n_rs_seq}")
        need(1 <= self.n_seqs <= 256, "n_seqs", f"must be 1..256 (llama.cpp's LLAMA_MAX_SEQ), is {self.n_seqs}")
        n_t = self.n_tokens * self.n_seqs
        need(self.n_ubatch >= n_t, "n_ubatch", f"must be at least n_tokens x n_seqs ({n_t}): one verify is one ubatch")
        need(not (self.mtp and self.n_seqs > 1), "n_seqs", "the MTP capture decodes one sequence")
        need(self.n_batch >= self.n_ubatch, "n_batch", f"must be at least n_ubatch ({self.n_ubatch})")
        need(self.n_prompt >= 1, "n_prompt", f"must be >= 1, is {self.n_prompt}")
        need(self.n_ctx >= self.n_prompt + self.n_tokens, "n_ctx",
             f"{self.n_ctx} cannot hold {self.n_prompt} prompt + {self.n_tokens} verify tokens")
        need(self.flash_attn in ("auto", "on", "off"), "flash_attn", f"must be auto, on or off, is {self.flash_attn!r}")
        need(self.n_threads >= 1, "n_threads", f"must be >= 1, is {self.n_threads}")
        need(self.mtp_outputs in ("all", "last", "none"), "mtp_outputs",
             f"must be all, last or none, is {self.mtp_outputs!r}")
        for f in ("n_ctx", "n_ubatch", "n_batch", "n_threads"):  # (llama_context_params holds them in 32 bits)
            need(getattr(self, f) < 2**31, f, f"must be below 2^31, is {getattr(self, f)}")

    def tokens(self, n_vocab_hint: int = 1 << 30) -> tuple[list[int], list[int]]:
        """Prompt and verify token ids (deterministic in ``seed``; the worker reduces them modulo the vocab)."""
        return self.seq_tokens(0)

    def seq_tokens(self, seq: int) -> tuple[list[int], list[int]]:
        """Sequence ``seq``'s prompt and verify token ids (sequence 0's are :meth:`tokens`)."""
        ids = [(1 + 7919 * (self.seed + seq + 1) * (i + 1)) % 32749 for i in range(self.n_prompt + self.n_tokens)]
        return ids[: self.n_prompt], ids[self.n_prompt:]


@dataclass
class Capture:
    verify: Graph
    reserve: Graph
    use_counts: dict[int, int]                 # verify Tensor.uid -> ggml's use count (zeros left out)
    settings: dict
    logits: bytes                              # float32, n_tokens x n_vocab
    n_vocab: int
    log: list[str] = field(default_factory=list)
    memory: dict[str, bytes] = field(default_factory=dict)  # buffer name -> bytes before the verify (record_memory)
    node_data: dict[int, bytes] = field(default_factory=dict)  # verify node index -> bytes after it ran (record_nodes)

    @property
    def reallocated(self) -> bool | None:
        """Whether gallocr re-planned for the verify graph (None: a build without debug logging cannot say)."""
        return self.verify.meta["llama"]["reallocated"]


def capture(gguf: str | os.PathLike, settings: Settings = Settings(), *, install: build.Install | None = None,
            timeout_s: float = 600.0) -> Capture:
    install = install or build.ensure()
    return _assemble(run_worker(gguf, settings, install, timeout_s), Path(gguf), settings, install)


def run_worker(gguf: str | os.PathLike, settings: Settings, install: build.Install, timeout_s: float = 600.0) -> dict:
    """The worker's raw records (see :mod:`.worker`); LlamaError when llama.cpp refuses or aborts."""
    settings.check()
    path = Path(gguf)
    if not path.is_file():
        raise LlamaError(f"capture: GGUF file {path} does not exist")
    prompt, verify = settings.tokens()
    if settings.n_seqs > 1:  # a list per sequence
        prompt, verify = (list(x) for x in zip(*(settings.seq_tokens(q) for q in range(settings.n_seqs))))
    req = {"n_seqs": settings.n_seqs, "kv_unified": settings.kv_unified, "gguf": str(path.resolve()), "lib_dir": str(install.lib_dir), "layout": install.layout,
           "n_ctx": settings.n_ctx, "n_batch": settings.n_batch, "n_ubatch": settings.n_ubatch,
           "n_rs_seq": settings.n_rs_seq, "flash_attn": settings.flash_attn, "n_threads": settings.n_threads,
           "prompt": prompt, "verify": verify, "record_memory": settings.record_memory,
           "record_nodes": settings.record_nodes, "mtp": settings.mtp, "mtp_outputs": settings.mtp_outputs}
    return _call_worker(req, path, install, timeout_s)


def _call_worker(req: dict, path: Path, install: build.Install, timeout_s: float | None, prefix: Sequence[str] = (),
                 env: dict[str, str] | None = None, what: str = "capture") -> dict:
    """Run the worker on one request (under ``prefix``, e.g. a profiler's command line, with ``env`` added to the
    bindings' environment); its JSON answer, or LlamaError (one line, opening with ``what``) when llama.cpp refuses
    or aborts. ``timeout_s`` None: no limit."""
    with tempfile.TemporaryDirectory(prefix="gdnpass-capture-") as tmp:
        req_path, out_path = Path(tmp, "request.json"), Path(tmp, "capture.json")
        req_path.write_text(json.dumps(req))
        try:
            proc = subprocess.run([*prefix, sys.executable, "-m", "gdnpass.frontends.llama.worker", str(req_path),
                                   str(out_path)], env={**install.env(), **(env or {})}, capture_output=True,
                                  text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise LlamaError(f"{what}: llama.cpp did not finish within {timeout_s:.0f} s on {path.name}") from None
        if proc.returncode != 0 or not out_path.exists():
            raise LlamaError(f"{what} of {path.name}: {_failure(proc)}")
        out = json.loads(out_path.read_text())
    if not out.get("ok"):
        raise LlamaError(f"{what} of {path.name}: {out.get('error')}")
    return out


def generate(gguf: str | os.PathLike, *, prompt: list[int] | None = None, n_predict: int, draft_max: int = 0,
             drafter: dict | None = None, n_rs_seq: int = 0, n_ubatch: int = 16, n_ctx: int = 256,
             flash_attn: str = "auto", n_threads: int = 2, rows: bool = False,
             prompts: Sequence[Sequence[int]] | None = None, drafters: Sequence[dict] | None = None,
             record_ubatches: bool = False, sampling: str = "full", runs: int = 1, n_gpu_layers: int = 0,
             install: build.Install | None = None, timeout_s: float = 600.0) -> dict:
    """llama.cpp's own greedy speculative loop on ``gguf`` (the worker's ``generate`` mode): the referee of
    ``gdnpass generate``. ``drafter``: {"kind": "none"}, {"kind": "ngram", "size_n", "size_m"} or {"kind":
    "planted", "truth", "accept", "lengths"} (:mod:`gdnpass.drafters`). Returns the worker's record: tokens, steps
    (n_t, drafted, accepted, seq_rm's result), per-token top-2 margins (and logits rows, base64 f32, with ``rows``),
    the context settings as llama.cpp resolved them.

    Several sequences at once: ``prompts`` and ``drafters`` (one each per sequence) instead of ``prompt`` and
    ``drafter``, in a context of n_seq_max = their number (a KV stream each; ``n_ctx`` is shared by the streams, as
    llama.cpp shares it); the record's ``sequences`` holds each one's tokens, steps and margins. With
    ``record_ubatches`` it also has ``prefill`` and ``batches``: each llama_decode's batch ([sequence, tokens]) and
    the ubatches llama.cpp split it into ([sequences, tokens] each). ``sampling`` ("full", "host", "backend"),
    ``runs`` and ``n_gpu_layers``: the worker's timing settings (:func:`.worker.run_generate`); the record's
    ``runs`` has each run's decode-loop seconds."""
    if (prompt is None) == (prompts is None):
        raise LlamaError("generate: give one prompt (prompt=) or several (prompts=)")
    case = generate_request([list(prompt)] if prompts is None else prompts,
                            drafters if drafters is not None else [drafter or {"kind": "none"}] *
                            (1 if prompts is None else len(prompts)),
                            n_predict, draft_max=draft_max, n_rs_seq=n_rs_seq, n_ubatch=n_ubatch, n_ctx=n_ctx,
                            flash_attn=flash_attn, n_threads=n_threads, rows=rows, record_ubatches=record_ubatches,
                            sampling=sampling, runs=runs)
    out = generate_cases(gguf, [case], n_gpu_layers=n_gpu_layers, install=install, timeout_s=timeout_s)[0]
    if "error" in out:
        raise LlamaError(f"generate of {Path(gguf).name}: {out['error']}")
    return out


def generate_request(prompts: Sequence[Sequence[int]], drafters: Sequence[dict], n_predict: int, *,
                     draft_max: int = 0, n_rs_seq: int = 0, n_ubatch: int = 16, n_ctx: int = 256,
                     flash_attn: str = "auto", n_threads: int = 2, rows: bool = False, record_ubatches: bool = False,
                     sampling: str = "full", runs: int = 1) -> dict:
    """One context of the worker's ``generate`` mode (a case of :func:`generate_cases`): its prompts (token ids) and
    drafters (one each per sequence) and settings. ``n_batch`` holds the whole prefill (every prompt) and a step of
    every sequence's K + 1 tokens, so that each is one ``llama_decode``, split by llama.cpp alone."""
    prompts = [[int(t) for t in p] for p in prompts]
    if len(drafters) != len(prompts):
        raise LlamaError(f"generate: {len(prompts)} prompts and {len(drafters)} drafters: one drafter per sequence")
    return {"n_ctx": n_ctx, "n_batch": max(n_ubatch, sum(len(p) for p in prompts), len(prompts) * (draft_max + 1)),
            "n_ubatch": n_ubatch, "n_rs_seq": n_rs_seq, "flash_attn": flash_attn, "n_threads": n_threads,
            "prompts": prompts, "n_predict": n_predict, "draft_max": draft_max, "drafters": list(drafters),
            "rows": rows, "record_ubatches": record_ubatches, "sampling": sampling, "runs": runs}


def generate_cases(gguf: str | os.PathLike, cases: Sequence[dict], *, n_gpu_layers: int = 0,
                   install: build.Install | None = None, timeout_s: float = 600.0) -> list[dict]:
    """Several contexts of the worker's ``generate`` mode (:func:`generate_request` each) in one worker process, on
    one load of ``gguf`` (``n_gpu_layers`` of its layers on the GPU: -1 or 99 for all); one record per case, or
    ``{"error": ...}`` (one line) for a case llama.cpp refused."""
    path = Path(gguf)
    if not path.is_file():
        raise LlamaError(f"generate: GGUF file {path} does not exist")
    install = install or build.ensure()
    req = {"mode": "generate", "gguf": str(path.resolve()), "lib_dir": str(install.lib_dir), "layout": install.layout,
           "n_gpu_layers": n_gpu_layers, "cases": list(cases)}
    return _call_worker(req, path, install, timeout_s)["cases"]


def tokenize(gguf: str | os.PathLike, texts: Sequence[str] = (), *,
             modes: Sequence[tuple[bool, bool]] = ((True, True),), pieces: Sequence[int] | None = (),
             detokenize: Sequence[tuple[Sequence[int], bool, bool]] = (), install: build.Install | None = None,
             timeout_s: float = 300.0) -> dict:
    """llama.cpp's own tokenizer on ``gguf``'s vocabulary, in one worker process (the worker's ``tokenize`` mode: the
    model loaded with ``vocab_only``, no weights). Returns:

    - ``tokens[i][j]``: ``llama_tokenize(vocab, texts[i], *modes[j])`` (modes: (add_special, parse_special));
    - ``pieces``: {id: (llama_token_to_piece with special true, with special false)} as bytes, for the ids of
      ``pieces`` (None: every token);
    - ``detokenized[k]``: the bytes of ``llama_detokenize(vocab, *detokenize[k])`` (ids, remove_special,
      unparse_special);
    - ``eog`` (the ids ``llama_vocab_is_eog`` accepts), ``special`` (bos / eos / eot / pad, None when unset),
      ``add_bos`` / ``add_eos``, ``n_vocab``, and llama.cpp's warning and error log lines."""
    path = Path(gguf)
    if not path.is_file():
        raise LlamaError(f"tokenize: GGUF file {path} does not exist")
    install = install or build.ensure()
    req = {"mode": "tokenize", "gguf": str(path.resolve()), "lib_dir": str(install.lib_dir), "texts": list(texts),
           "modes": [[bool(a), bool(p)] for a, p in modes], "pieces": None if pieces is None else list(pieces),
           "detokenize": [{"ids": [int(i) for i in ids], "remove_special": bool(r), "unparse_special": bool(u)}
                          for ids, r, u in detokenize]}
    out = _call_worker(req, path, install, timeout_s)
    out["pieces"] = {int(k): (base64.b64decode(a), base64.b64decode(b)) for k, (a, b) in out["pieces"].items()}
    out["detokenized"] = [base64.b64decode(x) for x in out["detokenized"]]
    return out


def time_verify(gguf: str | os.PathLike, cases: Sequence[tuple[int, int]], *, n_prompt: int = 16, n_ctx: int = 256,
                n_ubatch: int = 512, flash_attn: str = "auto", n_gpu_layers: int = -1,
                layer_inputs: Sequence[int] = (), reps: int = 20, warmup: int = 3, profile: bool = False,
                prefix: Sequence[str] = (), env: dict[str, str] | None = None, install: build.Install | None = None,
                timeout_s: float = 600.0) -> dict:
    """llama.cpp's verify decode timed on its own (the worker's ``time`` mode): per (n_tokens, n_rs_seq) case,
    ``reps`` decodes from position ``n_prompt`` on after ``warmup``, each a step that accepts no draft; with
    ``profile`` one more decode in a cuProfilerStart/Stop window (run it under ``prefix`` = an ncu command line).
    ``install``: default the CUDA build (a CPU build's timings are not the GPU peer's). Returns the worker's record:
    per case its wall times (s), the settings as llama.cpp resolved them, the load time and the CUDA log lines."""
    path = Path(gguf)
    if not path.is_file():
        raise LlamaError(f"time: GGUF file {path} does not exist")
    for n_t, n_rs in cases:
        cells = positions_used(n_prompt, n_t, warmup + reps + profile)
        if not (1 <= n_t <= n_ubatch and 0 <= n_rs and n_ubatch > n_rs + 1 and cells <= n_ctx):
            raise LlamaError(f"time: case (n_tokens {n_t}, n_rs_seq {n_rs}) does not fit n_ubatch {n_ubatch} "
                             f"(>= n_tokens, > n_rs_seq + 1: one verify is one ubatch) and n_ctx {n_ctx} "
                             f"(>= the {cells} cells the decodes fill)")
    install = install or build.ensure(variant="cuda")
    req = {"mode": "time", "gguf": str(path.resolve()), "lib_dir": str(install.lib_dir), "n_ctx": n_ctx,
           "n_batch": max(n_ubatch, n_prompt), "n_ubatch": n_ubatch, "flash_attn": flash_attn, "n_threads": 4,
           "n_gpu_layers": n_gpu_layers, "layer_inputs": list(layer_inputs), "prompt": list(range(1, n_prompt + 1)),
           "cases": [{"n_tokens": n_t, "n_rs_seq": n_rs} for n_t, n_rs in cases], "reps": reps, "warmup": warmup,
           "profile": profile}
    return _call_worker(req, path, install, timeout_s, prefix, env)


def _failure(proc: subprocess.CompletedProcess) -> str:
    """One line for a worker that died: the ggml assert if there is one, else its last error line."""
    text = (proc.stderr or "") + (proc.stdout or "")
    m = re.search(r"([\w./-]+:\d+): GGML_ASSERT\((.+?)\) failed", text)
    if m:
        hint = next((h for k, h in _ASSERT_HINTS.items() if k in m.group(2)), None)
        return (f"llama.cpp aborted: GGML_ASSERT({m.group(2)}) failed at {m.group(1).split('/vendor/')[-1]}"
                + (f" ({hint})" if hint else ""))
    m = re.search(r"([\w./-]+:\d+): (GGML_ABORT|fatal error)[^\n]*", text)
    if m:
        return f"llama.cpp aborted: {m.group(0).strip()}"
    lines = [x for x in text.splitlines() if x.strip()]
    tail = next((x for x in reversed(lines) if re.search(r"error|Error", x)), lines[-1] if lines else "")
    return f"the llama.cpp worker exited with status {proc.returncode}: {tail.strip()[:300]}"


# ---------------------------------------------------------------------------------------------------------------------
# records -> graphs
# ---------------------------------------------------------------------------------------------------------------------

_CACHES = {"rs": ("cache_r_", "cache_s_"), "kv": ("cache_k_", "cache_v_")}  # name -> the cache tensors it holds


def buffer_names(buffers: dict[str, dict], structs: list[TensorStruct]) -> dict[int, tuple[str, str]]:
    """(name, gdnpass role) per backend buffer address: ``weights`` / ``compute`` by ggml's usage, ``rs`` / ``kv``
    (role cache) by the caches they hold, ``dequantized`` (role weights) for :func:`dequantize_stand_ins`' buffer. A
    buffer that is none of these is refused: a graph placed in it could not be planned or fused correctly."""
    holds: dict[int, set[str]] = {}
    for c in structs:
        if c.buffer:
            holds.setdefault(c.buffer, set()).add(c.name)
    out: dict[int, tuple[str, str]] = {}
    for key, b in buffers.items():
        held = holds.get(int(key), set())
        if int(key) == DEQUANTIZED_BUFFER:  # gdnpass's stand-in buffer (dequantize_stand_ins)
            base, role = "dequantized", "weights"
        elif b["usage"] in ("weights", "compute"):
            base, role = b["usage"], b["usage"]
        else:
            base = next((n for n, pre in _CACHES.items() if any(t.startswith(pre) for t in held)), None)
            if base is None:
                raise LlamaError(f"capture: backend buffer {b['name']} (usage {b['usage']}) holds "
                                 f"{', '.join(sorted(held)[:3])}, which gdnpass does not know how to place")
            role = "cache"
        name, i = base, 1
        while name in {n for n, _ in out.values()}:  # a second buffer of the same kind (weights split over two)
            i += 1
            name = f"{base}{i}"
        out[int(key)] = (name, role)
    return out


DEQUANTIZED_BUFFER = 1  # the stand-in buffer's key among the recorded buffer addresses (no real pointer is 1)
# the types gdnpass holds as llama.cpp does: every DType (ggml spells the K-quants q4_K); a weight of another type
# gets an f32 stand-in, as gdnpass dequantizes it on load
_PLAIN_TYPES = tuple(t.label for t in DType)


def dequantize_stand_ins(out: dict) -> dict[str, str]:
    """Turn every weight record of ``out`` (the verify and the reserve graph's) of a type gdnpass dequantizes on load
    (Q4_0, Q5_0, ...: not a :class:`DType`) into an f32 stand-in placed in the ``dequantized`` buffer, as gdnpass
    holds such a weight after loading it; name -> ggml type."""
    weights = {int(k) for k, b in out["buffers"].items() if b["usage"] == "weights"}
    recs = [c for part in ("verify", "reserve") for c in out[part]["tensors"]
            if c["buffer"] in weights and c["op_name"] == "NONE" and c["type_name"].lower() not in _PLAIN_TYPES]
    if not recs:
        return {}
    base, size, where, kinds = 1 << 40, 0, {}, {}
    for c in recs:
        if c["addr"] not in where:
            n = c["ne"][0] * c["ne"][1] * c["ne"][2] * c["ne"][3]
            where[c["addr"]], size = size, size + (4 * n + 31) // 32 * 32
            kinds[c["name"]] = c["type_name"]
        ne = c["ne"]
        c.update(type_name="f32", nb=[4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]],
                 buffer=DEQUANTIZED_BUFFER, data=base + where[c["addr"]])
    out["buffers"][str(DEQUANTIZED_BUFFER)] = {"name": "dequantized (gdnpass: f32 copies of quantized weights)",
                                               "base": base, "size": size, "usage": "weights", "alignment": 32}
    return kinds


def _graph(part: dict, names: dict[int, tuple[str, str]], buffers: dict[str, dict], leafs: list[int], meta: dict):
    """One recorded graph as a Graph, every base tensor with memory where llama.cpp put it (an unplanned reserve
    graph has memory only in its weights and caches)."""
    structs = {c["addr"]: TensorStruct.from_json(c) for c in part["tensors"]}

    def place(c: TensorStruct, t: Tensor) -> None:
        if c.buffer and c.data:
            t.buffer, t.offset = names[c.buffer][0], c.data - buffers[str(c.buffer)]["base"]

    asm = to_graph(structs, part["nodes"], leafs, place=place, meta=meta)
    for a, t in asm.tensors.items():  # (to_graph places leafs; computed base tensors too: llama.cpp's plan)
        if t.view_src is None and t.buffer is None:
            place(structs[a], t)
    g = asm.graph
    planned = any(t.buffer == "compute" for t in asm.tensors.values())
    for key, b in buffers.items():
        name, role = names[int(key)]
        g.buffer_specs[name] = BufferSpec(role, backend=b["name"], usage=b["usage"])
        if role != "compute" or planned:  # an unplanned (reserve) graph has no compute buffer yet
            g.buffers[name] = b["size"]
            if role == "compute":
                g.alignment = b["alignment"]
    return asm


def _assemble(out: dict, path: Path, settings: Settings, install: build.Install) -> Capture:
    dequantized = dequantize_stand_ins(out)
    buffers = out["buffers"]
    structs = [TensorStruct.from_json(c) for c in out["verify"]["tensors"] + out["reserve"]["tensors"]]
    names = buffer_names(buffers, structs)
    log = out["log"]
    verify_log = [x for x in log if x.startswith("verify:")]
    realloc = any("reallocating buffers automatically" in x for x in verify_log)
    llama = {"commit": build.COMMIT, "package": f"{build.PACKAGE}=={build.VERSION}", "build": "Debug -O0",
             "gguf": path.name, "gguf_bytes": path.stat().st_size, "settings": out["settings"],
             "reallocated": realloc, "flash_attn": _flash_attn(log, settings.flash_attn), "resolved": _resolved(log),
             "capture_s": out["capture_s"], "dequantized": dequantized}
    bufmeta = {names[int(k)][0]: {"size": b["size"], "backend": b["name"], "usage": b["usage"],
                               "alignment": b["alignment"]} for k, b in buffers.items()}

    reserve = _graph(out["reserve"], names, buffers, out["reserve"]["leafs"],
                     {"builder": "llama.cpp", "graph": "reserve", "llama": llama, "buffers": bufmeta})
    # the verify graph's leafs: the reserve graph's, through the (node, src slot) correspondence of two graphs of one
    # topology; a verify graph of another topology keeps its leafs in first-use order
    vnodes = out["verify"]["nodes"]
    vstructs = {c["addr"]: c for c in out["verify"]["tensors"]}
    rstructs = {c["addr"]: c for c in out["reserve"]["tensors"]}
    same = len(vnodes) == len(out["reserve"]["nodes"]) and all(
        vstructs[v]["op_name"] == rstructs[r]["op_name"] for v, r in zip(vnodes, out["reserve"]["nodes"]))
    corr: dict[int, int] = {}  # reserve address -> verify address
    if same:
        for v, r in zip(vnodes, out["reserve"]["nodes"]):
            corr[r] = v
            for vs, rs in zip(vstructs[v]["src"], rstructs[r]["src"]):
                if vs is not None and rs is not None:
                    corr.setdefault(rs, vs)
    # A reserve leaf no node reads (llama.cpp makes inp_embd next to inp_tokens and uses one) is in the verify
    # graph's leaf list too, and gallocr allocates it, but the eval callback never sees it: it stands in with the
    # reserve graph's record (same name, type, shape; its bytes are never read), placed where the reserve plan puts it.
    unseen = [a for a in out["reserve"]["leafs"] if a not in corr] if same else []
    for i, a in enumerate(unseen):  # (a made-up address: the reserve graph may reuse the verify graph's memory)
        out["verify"]["tensors"].append(dict(rstructs[a], addr=-1 - i, data=0, buffer=0))
        corr[a] = -1 - i
    leafs = [corr[a] for a in out["reserve"]["leafs"]] if same else []
    llama["same_topology_as_reserve"] = same
    llama["unseen_leafs"] = [rstructs[a]["name"] for a in unseen]
    by_addr = {c["addr"]: c["name"] for c in out["verify"]["tensors"]}
    verify = _graph(out["verify"], names, buffers, leafs,
                    {"builder": "llama.cpp", "graph": "verify", "llama": llama, "buffers": bufmeta,
                     "input_bytes": {by_addr[int(a)]: v for a, v in out.get("inputs", {}).items()}})
    if unseen:  # where gallocr put them: gdnpass's replica of the reserve plan (exact on every tensor it can check)
        from gdnpass.alloc import plan  # (here: alloc imports the IR, the worker must not)

        shadow = copy.deepcopy(reserve.graph)
        plan(shadow, verify.graph.alignment, "compute")
        where = {i: t for i, t in enumerate(shadow.leafs)}
        for i, t in enumerate(verify.graph.leafs):
            if t.buffer is None and t.view_src is None:
                t.buffer, t.offset = "compute", where[i].offset
    counts = {}
    if same:
        rcounts = {int(k): v for k, v in out["reserve"]["use_counts"].items()}
        for r, v in corr.items():
            if rcounts.get(r):
                counts[verify.tensors[v].uid] = rcounts[r]
    memory = {names[int(k)][0]: base64.b64decode(v) for k, v in out.get("memory", {}).items()}
    node_data = {int(k): base64.b64decode(v) for k, v in out.get("node_data", {}).items()}
    return Capture(verify.graph, reserve.graph, counts, out["settings"], base64.b64decode(out["logits"]),
                   out["n_vocab"], log, memory, node_data)


def _resolved(log: list[str]) -> list[str]:
    """How llama.cpp resolved its automatic settings at context creation (``resolve_fused_ops`` log lines)."""
    lines = [x.split("resolve_fused_ops: ", 1)[1] for x in log if "resolve_fused_ops: " in x]
    return list(dict.fromkeys(x for x in lines if not x.startswith("resolving")))


def _flash_attn(log: list[str], requested: str) -> str | None:
    """'on' or 'off' as the context resolved flash attention: an 'auto' request is resolved (and logged) at context
    creation; an explicit one stands."""
    for x in _resolved(log):
        if x.startswith("Flash Attention"):
            return "on" if x.endswith("enabled") else "off"
    return requested if requested != "auto" else None


def summary(cap: Capture) -> dict:
    """What a capture holds, for ``gdnpass capture`` (text or --json)."""
    from gdnpass.ir import Op

    g = cap.verify
    llama = g.meta["llama"]
    ops = [n.op.value if n.op is not Op.OPAQUE else n.op_params.get("ggml_op", "?") for n in g.nodes]
    gdn = sorted({n.layer for n in g.nodes if n.op.value == "GATED_DELTA_NET" and n.layer is not None})
    attn = sorted({n.layer for n in g.nodes if n.op.value in ("FLASH_ATTN_EXT", "SOFT_MAX") and n.layer is not None})
    return {"gguf": llama["gguf"], "llama_cpp": llama["commit"][:12], "settings": llama["settings"],
            "nodes": len(g.nodes), "leafs": len(g.leafs), "reserve_nodes": len(cap.reserve.nodes),
            "gdn_layers": gdn, "attention_layers": attn, "zero_size_nodes": sum(n.is_empty for n in g.nodes),
            "opaque": sorted({o for n, o in zip(g.nodes, ops) if n.op is Op.OPAQUE}),
            "buffers": g.meta["buffers"], "reallocated": llama["reallocated"],
            "flash_attn": llama["flash_attn"], "capture_s": llama["capture_s"]}


def summary_text(s: dict, path: str) -> str:
    st = s["settings"]
    bufs = ", ".join(f"{k} {v['size'] / 2**20:.2f} MiB" for k, v in s["buffers"].items())
    mtp = st.get("mtp")
    what = (f"MTP ubatch of {st['n_tokens']} tokens ({mtp['n_outputs']} with logits) in the MTP context (n_rs_seq "
            f"{st['n_rs_seq']}; the target's {mtp['n_rs_seq_target']})" if mtp else
            f"verify ubatch of {st['n_tokens']} tokens, n_rs_seq {st['n_rs_seq']}" if st.get("n_seq_max", 1) == 1 else
            f"verify ubatch of {st['n_seq_max']} sequences x {st['n_tokens'] // st['n_seq_max']} tokens "
            f"({'one unified KV stream' if st['kv_unified'] else 'a KV stream each'}), n_rs_seq {st['n_rs_seq']}")
    lines = [
        f"gdnpass capture: {s['gguf']} on llama.cpp {s['llama_cpp']}: {what}, n_ubatch {st['n_ubatch']} (reserve graph "
        f"{st['reserve']['n_tokens']} tokens), n_ctx {st['n_ctx']}, after a {st['n_prompt']}-token prompt",
        f"  nodes {s['nodes']} ({s['zero_size_nodes']} zero-size), leafs {s['leafs']}; GDN layers {s['gdn_layers']}, "
        f"attention layers {s['attention_layers']} (flash attention: {s['flash_attn']})",
        f"  buffers: {bufs}",
        "  plan: the reserve plan, bound node by node" if s["reallocated"] is False else
        "  plan: gallocr re-planned for this graph" if s["reallocated"] else "  plan: unknown (no allocator log)",
    ]
    if s["opaque"]:
        lines.append(f"  kept as ggml made them (not modelled): {', '.join(s['opaque'])}")
    lines.append(f"  wrote {path} in {s['capture_s']:.2f} s of llama.cpp; next: gdnpass dump --graph {path} --fuse "
                 "--explain")
    return "\n".join(lines)
