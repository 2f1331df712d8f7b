"""Several sequences at once: gdnpass's speculative loop over S prompts in shared ubatches, tokens/s over all
sequences at each S, fusion off and on (ABBA), next to llama.cpp decoding the same batches on the same file and GPU.

    python benchmarks/seqs_bench.py --gguf c9b.gguf --write-cycle qwen3.5-9b --seqs 1,8,32 -K 3 -n 128 --peer \\
        --source .llama-src --json seqs.json
    python benchmarks/seqs_bench.py --device cpu --gguf tiny.gguf --write-cycle tiny-qwen35 --wtype f32 \\
        --period 5 --seqs 1,2,3 -n 24 --peer                               # the same steps on the CPU

Per S (the first S prompts: ``--prompts-file``, one per line, or 32 built-in ones) and per drafter (``--draft``:
n-gram and planted, each sequence drafting on its own): each sequence alone (untimed, once per prompt); the batch's
warm-up with every step's logits hashed (every graph built and captured: fusion off vs on byte for byte, and every
sequence's tokens and steps as alone); then the timed runs, off on on off (``--reps`` rounds), lean. With ``--peer``,
llama.cpp's library on the same batches (its worker: the same prompts, drafters and context), its greedy tokens read
on the host and with its backend sampling (``--peer-sampling``), a warm-up run then ``--peer-runs`` timed runs, its
tokens compared with gdnpass's. gdnpass.bench.seqs says what each step does and why this peer.

``--write-cycle PRESET`` writes ``--gguf`` first (if missing) as a cycle model (:mod:`gdnpass.models.cycle_model`:
the n-gram drafter's drafts are accepted). Each prompt is cut to its last ``--prompt-tokens`` tokens (one length:
few prefill graphs; each keeps its own last token, which a cycle model's continuation follows). ``--ubatch`` sets
n_ubatch on both sides (default: the engine's, max(16, S x (K + 1)): a step of full drafts is one ubatch). The
numbers go to ``--json FILE`` after every S (a run stopped by a time limit keeps what it measured) and to a table
at the end. Exit 1 if fusion off and on differ, a sequence differs from its run alone, a timed run's tokens differ,
or llama.cpp's tokens differ from gdnpass's (or it failed).
"""

import sys

from gdnpass.bench.seqs import main

if __name__ == "__main__":
    sys.exit(main())
