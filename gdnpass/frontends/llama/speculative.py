"""llama.cpp's own speculative loop, ``llama-speculative-simple``, run as a user runs it: the peer of
``gdnpass generate``.

Why this tool: it is the pinned tree's C++ loop for one sequence with a greedy sampler (``examples/speculative-simple``
at 0c1e570): tokenize the prompt with the model file's tokenizer, prefill, then draft -> verify -> accept -> roll
back, printing the text as it is accepted and its own timing (``decoded N tokens in S seconds, speed: X t/s``, the
decode loop without the prompt, as ``gdnpass generate`` times its loop) and acceptance (``n_drafted``, ``n_accept``).
``llama-server`` with ``--spec-type ngram-simple`` runs the same drafter and the same rollback but adds HTTP and
slot scheduling to every step. The n-gram drafter is llama.cpp's ``ngram-simple`` with ``--spec-ngram-simple-size-n``
and ``-size-m`` (what :class:`gdnpass.drafters.NgramSimple` re-writes).

Two things it does differently from ``gdnpass generate`` (both from its source):

* an n-gram draft does not need rollback planes, so the tool leaves ``n_rs_seq = 0``
  (``common_params_speculative::need_n_rs_seq``: only model drafters ask for them); on a recurrent model it then
  rolls back by **checkpoints**: it saves the sequence's state before each verify and, when a draft is only
  partly accepted, restores it and decodes the accepted tokens again (``use_ckpt_tgt``). Its ``n_drafted`` /
  ``n_accept`` count those re-decodes as fully accepted drafts, so its accept rate is not gdnpass's;
* it stops once it has generated more than ``-n`` tokens (``n_predict > params.n_predict``), and a draft whose
  budget is 0 is not truncated (``common_speculative_draft`` truncates only for ``n_max > 0``), so it generates a
  few tokens more than ``-n``; tokens are compared on the common prefix.

With ``draft_mtp=K`` it drafts with the model's MTP head instead (``--spec-type draft-mtp --spec-draft-n-max K``):
a model drafter, so the target has ``n_rs_seq = K`` rollback planes and no checkpoints (``common_context_can_seq_rm``
is ``RS``), as gdnpass's loop; the MTP context's KV cache is cut back with ``llama_memory_seq_rm``. Its head always
drafts K tokens (``p_min`` 0, ``n_min`` 0), truncated to the step's budget only when that is above 0: the step at
budget 0 (gdnpass's last, a one-token decode) verifies K drafts there, and it runs one more such step once it has
exactly ``-n`` tokens. With ``verbose`` (``-v``) its log has a line per step (``accepted A/D draft tokens, the last
target token is: (ID)``): :attr:`PeerRun.steps`.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from gdnpass.errors import LlamaError
from gdnpass.frontends.llama import build

_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_COUNTS = {k: re.compile(rf"\b{k}\s*=\s*(\d+)") for k in ("n_draft", "n_predict", "n_drafted", "n_accept")}
_STEP = re.compile(r"accepted (\d+)/(\d+) draft tokens, the last target token is: \((\d+)\)")


@dataclass
class PeerRun:
    """One run of ``llama-speculative-simple``: what it printed and what it measured of itself."""

    command: list[str]
    output: bytes             # stdout: the prompt's pieces, then the generated pieces, as it printed them
    n_prompt: int             # prompt tokens (its tokenizer's count)
    n_predict: int            # tokens it generated
    n_drafted: int
    n_accept: int
    decode_seconds: float     # its decode loop (prompt excluded)
    tokens_per_second: float  # its own "speed" of the decode loop
    encode_seconds: float
    log: list[str] = field(default_factory=list)  # stderr lines that say how it ran (CUDA, checkpoints, stats)
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # (accepted, drafted, last token) (verbose)

    @property
    def accept_rate(self) -> float:
        return self.n_accept / self.n_drafted if self.n_drafted else 0.0

    def generated(self, prompt_text: str) -> bytes:
        """The generated text's bytes: what it printed after the prompt's pieces (it prints "\\n\\n" before the
        prompt, and twice after the text). Bytes, not text: a piece may be part of a UTF-8 character."""
        body, prompt = self.output.removeprefix(b"\n\n"), prompt_text.encode()
        if not body.startswith(prompt):
            raise LlamaError(f"{build.SPECULATIVE_TOOL} printed {body[:60]!r}, which does not start with the prompt")
        return body[len(prompt):].removesuffix(b"\n\n").removesuffix(b"\n\n")


def command(install: build.Install, gguf: str | Path, prompt: str, n_predict: int, size_n: int | None = None,
            size_m: int | None = None, *, draft_mtp: int | None = None, verbose: bool = False, n_ctx: int = 256,
            n_gpu_layers: int = 99, threads: int = 4) -> list[str]:
    """The command line: greedy (``--temp 0 --top-k 1``), the n-gram drafter ``ngram-simple`` with its sizes (or,
    with ``draft_mtp`` = K, the MTP head drafting K), every layer on the GPU. (Not ``-lv 4``: at that verbosity
    this build's log lost its closing statistics; ``verbose``: ``-v``, the per-step lines.)"""
    spec = (["--spec-type", "draft-mtp", "--spec-draft-n-max", str(draft_mtp)] if draft_mtp is not None else
            ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(size_n),
             "--spec-ngram-simple-size-m", str(size_m)])
    return [str(install.tool(build.SPECULATIVE_TOOL)), "-m", str(gguf), "-p", prompt, "-n", str(n_predict),
            "-c", str(n_ctx), "-ngl", str(n_gpu_layers), "-t", str(threads), "--temp", "0", "--top-k", "1",
            "--seed", "0", *spec, *(["-v"] if verbose else [])]


# The tool's logger is a leaked singleton whose worker thread may not have written the last lines when the process
# exits (llama.cpp issue 22142, cited in common/log.cpp at the pinned commit): its closing statistics are then missing
# (seen once in three runs on the 2-core CPU machine, never on the H200). Such a run is run again.
TRIES = 3


def run(install: build.Install, gguf: str | Path, prompt: str, n_predict: int, size_n: int | None = None,
        size_m: int | None = None, *, timeout_s: float = 300.0, **kw) -> PeerRun:
    """Run the tool (again when its log lost its closing statistics, :data:`TRIES` times at most); LlamaError (one
    line) when it fails or prints something this reader does not know."""
    for attempt in range(TRIES):
        try:
            return _run_once(command(install, gguf, prompt, n_predict, size_n, size_m, **kw), install, timeout_s)
        except _NoStatistics:
            if attempt == TRIES - 1:
                raise LlamaError(f"{build.SPECULATIVE_TOOL}: its closing statistics were missing from its log "
                                 f"{TRIES} times") from None
    raise AssertionError("unreachable")


class _NoStatistics(Exception):
    pass


def _run_once(cmd: list[str], install: build.Install, timeout_s: float) -> PeerRun:
    try:
        proc = subprocess.run(cmd, env=install.env(), capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise LlamaError(f"{build.SPECULATIVE_TOOL} did not finish within {timeout_s:.0f} s") from None
    err = proc.stderr.decode("utf-8", errors="replace")
    if proc.returncode != 0:
        last = [x for x in err.splitlines() if x.strip()][-3:]
        raise LlamaError(f"{build.SPECULATIVE_TOOL} exited with {proc.returncode}: {' | '.join(last)}")
    dec, enc = _DECODED.search(err), _ENCODED.search(err)
    counts = {k: rx.search(err) for k, rx in _COUNTS.items()}
    if dec is None or enc is None or not all(counts.values()):
        raise _NoStatistics()
    keep = [x for x in err.splitlines()
            if re.search(r"CUDA|offload|checkpoint|statistics|accept|n_draft|decoded|encoded|perf_print", x)]
    return PeerRun(cmd, proc.stdout, int(enc.group(1)), int(counts["n_predict"].group(1)), int(counts["n_drafted"].group(1)),
                   int(counts["n_accept"].group(1)), float(dec.group(2)), float(dec.group(3)), float(enc.group(2)),
                   keep[-60:], [tuple(map(int, m.groups())) for m in _STEP.finditer(err)])
