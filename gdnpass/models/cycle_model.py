"""A random qwen35 GGUF whose greedy continuation follows short cycles: a model the n-gram drafter can predict.

A random model (:func:`gdnpass.models.gguf_write.write_gguf`) does not repeat itself, so llama.cpp's n-gram lookup
(:class:`gdnpass.drafters.NgramSimple`) never finds a draft in its output. This writes the same random file, then
scales the token embedding by ``scale`` (the residual stream is then dominated by the current token's embedding) and
sets the lm head's row of token ``t`` to the embedding of the token before it in its cycle: token t is followed by
``perm(t)``, the next token of its block of ``period`` tokens (0 1 2 3 4 0 ..., 5 6 7 8 9 5 ...). Every layer still
runs and still changes the logits (the GDN and attention layers are as random as before); the argmax just follows
the cycles, which the n-gram drafter then drafts.

With ``mtp=1`` the file also has an MTP block (``gguf_write --mtp 1``) whose head follows the cycles too, but not
always: its projection ``nextn.eh_proj`` (the concat [normed embedding of token x, normed hidden state h] -> E) gets
``mtp_gain`` times the identity on the embedding half and ``mtp_h`` times the identity on the hidden-state half,
over its random values. The embedding term makes the lm head pick the token after x (the trunk's choice), the
hidden-state term (the trunk's h at the position before x holds the embedding of the token before x; a chained
draft step's h, the head's own output, holds a mix) the token x itself or the one before: with the two gains close
the head agrees with the trunk part of the time, and which time depends on the hidden state it is paired with, its
own KV cache and the random layers, so the MTP drafter's accepted counts test the pairing and the head's rollback.

The file keeps write_gguf's tokenizer (byte-level BPE): ids 0..255 are bytes, the merges' tokens follow, then the
special tokens (<|endoftext|> = EOS, <|im_start|>, <|im_end|> = EOT) and unused fillers. A greedy run stays in the
block of the token it starts from, so it reaches EOS or EOT only if it starts in a block that holds one (vocab 512:
EOS 509, EOT 511, in the blocks 505..509 and 510..511); every other block never ends generation.

``python -m gdnpass.models.cycle_model PRESET PATH [--period 5] [--scale 4] [--seed 0] [--wtype f32] [--mtp 1]``
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from gdnpass.models.gguf_write import GgufError, get_model, open_reader, write_gguf


def cycle_next(t: int, period: int, vocab: int) -> int:
    """The token after ``t``: the next one of its block of ``period`` tokens (the last block may be shorter)."""
    start = t // period * period
    return start + (t - start + 1) % min(period, vocab - start)


def _read(t) -> np.ndarray:
    name = t.tensor_type.name
    if name == "F32":
        return np.array(t.data, dtype=np.float32)
    if name == "F16":
        return np.array(t.data).astype(np.float32)
    if name == "BF16":
        return (np.array(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise GgufError(f"tensor {t.name!r} has type {name}; cycle_model writes f32, f16 or bf16 files")


def _write(t, x: np.ndarray) -> None:
    name = t.tensor_type.name
    x = np.ascontiguousarray(x, dtype=np.float32)
    if name == "F32":
        t.data[...] = x.reshape(t.data.shape)
    elif name == "F16":
        t.data[...] = x.astype(np.float16).reshape(t.data.shape)
    else:  # BF16 (the reader shows its bytes): the high half of each f32, as write_gguf rounds it (toward zero)
        t.data[...] = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(t.data.shape)


# the MTP head's two gains (see the module's docstring): measured on tiny-qwen35, period 5, seed 3, K = 3, the
# head's drafts are accepted 16 of 21 times, acceptances 0, 1 and 3 (below 1.2 every draft is accepted, from
# 1.6 none)
MTP_GAIN, MTP_H = 1.0, 1.3


def write_cycle_gguf(shape, path: str | os.PathLike, *, period: int = 5, scale: float = 4.0, seed: int = 0,
                     wtype: str = "f32", mtp: int = 0, mtp_gain: float = MTP_GAIN, mtp_h: float = MTP_H) -> Path:
    shape = get_model(shape) if isinstance(shape, str) else shape
    if mtp:
        shape = dataclasses.replace(shape, nextn_predict_layers=mtp)
    if shape.tie_embeddings:
        raise GgufError(f"model {shape.name!r} ties its embeddings: a cycle model needs its own output.weight")
    if period < 2 or period > shape.vocab_size:
        raise GgufError(f"period must be 2..vocab_size ({shape.vocab_size}), is {period}")
    path = write_gguf(shape, path, wtype=wtype, seed=seed)
    reader = open_reader(path, "r+")
    by = {t.name: t for t in reader.tensors}
    emb, head = by["token_embd.weight"], by["output.weight"]
    e = _read(emb).reshape(shape.vocab_size, shape.n_embd)
    prev = np.empty(shape.vocab_size, dtype=np.int64)  # prev[perm(t)] = t
    for t in range(shape.vocab_size):
        prev[cycle_next(t, period, shape.vocab_size)] = t
    _write(head, e[prev])
    _write(emb, e * np.float32(scale))
    E, eye = shape.n_embd, np.eye(shape.n_embd, dtype=np.float32)
    for il in range(shape.n_layer, shape.block_count):  # each MTP block's projection [E, 2E] (numpy: out x in)
        proj = by[f"blk.{il}.nextn.eh_proj.weight"]
        w = _read(proj).reshape(E, 2 * E)
        w[:, :E] += np.float32(mtp_gain) * eye
        w[:, E:] += np.float32(mtp_h) * eye
        _write(proj, w)
    reader.data.flush()
    del reader
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m gdnpass.models.cycle_model", description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("path")
    p.add_argument("--period", type=int, default=5)
    p.add_argument("--scale", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wtype", default="f32", choices=["f32", "f16", "bf16"])
    p.add_argument("--mtp", type=int, default=0, help="MTP blocks (gguf_write --mtp): a head that often agrees")
    p.add_argument("--mtp-gain", type=float, default=MTP_GAIN, help="the head's embedding gain (default %(default)s)")
    p.add_argument("--mtp-h", type=float, default=MTP_H, help="the head's hidden-state gain (default %(default)s)")
    a = p.parse_args(argv)
    try:
        out = write_cycle_gguf(a.model, a.path, period=a.period, scale=a.scale, seed=a.seed, wtype=a.wtype,
                               mtp=a.mtp, mtp_gain=a.mtp_gain, mtp_h=a.mtp_h)
    except GgufError as e:
        print(f"error: {e}")
        return 2
    print(f"{out}: {out.stat().st_size / 2**20:.2f} MiB, greedy continuation in cycles of {a.period}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
