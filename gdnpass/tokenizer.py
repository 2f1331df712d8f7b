"""Text in, text out: a GGUF model file's own tokenizer, as llama.cpp reads and runs it (src/llama-vocab.cpp, 0c1e570).

:class:`Tokenizer` is made from the file's ``tokenizer.ggml.*`` fields. Byte-level BPE (``tokenizer.ggml.model =
"gpt2"``) with the ``qwen2`` or ``qwen35`` pre-tokenizer is supported; the BPE itself is HuggingFace ``tokenizers``'
(``models.BPE`` from the file's tokens and merges, a ``Split`` pre-tokenizer with the pattern of Qwen's
tokenizer.json that llama.cpp's split re-implements, then ``ByteLevel(use_regex=False)``). Around it, what llama.cpp
does itself, so that the ids are those of ``llama_tokenize``:

- special-token text is split out first, the longest token first (``tokenizer_st_partition``): control and unknown
  tokens only with ``parse_special``, user-defined tokens always; the BPE runs on the text between them;
- BOS / EOS are added with ``add_special`` only if the file says ``add_bos_token`` / ``add_eos_token``;
- token types, the special ids and their defaults, the end-of-generation set (``special_eog_ids``) and the pieces
  (``token_to_piece``: control tokens render as their text only with ``special``, unused ones as nothing) follow
  ``llama_vocab::impl::load`` and ``token_to_piece``.

:class:`StreamDecoder` turns ids into text as they come, holding back an incomplete UTF-8 sequence until it completes.
Importing this module loads neither torch nor gdnpass's graph code (:meth:`Tokenizer.from_gguf` reads the header
through :func:`gdnpass.models.gguf_read.open_reader`, which loads no torch either); see docs/gguf.md.
"""

from __future__ import annotations

import codecs
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping

from gdnpass.errors import GdnpassError


class TokenizerError(GdnpassError, ValueError):
    """A model file whose tokenizer gdnpass cannot run (no tokenizer, an unsupported model or pre-tokenizer, broken
    fields), or text / ids it cannot take. The message is one line naming the file and field."""


# the pre-tokenizer regexes: the ORIGINAL patterns of the models' tokenizer.json, which llama-vocab.cpp quotes in a
# comment next to its rewrite (LLAMA_VOCAB_PRE_TYPE_QWEN2 / _QWEN35) and unicode.cpp implements by hand
# (unicode_regex_split_custom_qwen2 / _qwen35); tokenizers' onig regex takes them as they are
PRE_PATTERNS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
    # Qwen3.5: letter runs also take combining marks (\p{M})
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# other tokenizer.ggml.pre names llama.cpp maps to the same pre-tokenizer (and clean_spaces = false)
PRE_ALIASES = {"deepseek-r1-qwen": "qwen2", "kormo": "qwen2", "f2llmv2": "qwen2"}

# llama_token_type (llama.h), as tokenizer.ggml.token_type stores it
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)
# llama_token_attr bits (what llama.cpp turns the types into)
_A_UNKNOWN, _A_UNUSED, _A_NORMAL, _A_CONTROL, _A_USER_DEFINED, _A_BYTE = 1, 2, 4, 8, 16, 32
_ATTR = {UNDEFINED: 0, NORMAL: _A_NORMAL, UNKNOWN: _A_UNKNOWN, CONTROL: _A_CONTROL, USER_DEFINED: _A_USER_DEFINED,
         UNUSED: _A_UNUSED, BYTE: _A_BYTE}

# llama_vocab::impl::load's lists of token texts (0c1e570)
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~["})
_DETECT = {  # special id -> the texts llama.cpp looks for when the file does not name it
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# the special-id keys llama.cpp reads, in its order (the deprecated FIM keys last, overriding)
_ID_KEYS = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"), ("eom", "eom_token_id"),
            ("unk", "unknown_token_id"), ("sep", "seperator_token_id"), ("pad", "padding_token_id"),
            ("mask", "mask_token_id"), ("fim_pre", "fim_pre_token_id"), ("fim_suf", "fim_suf_token_id"),
            ("fim_mid", "fim_mid_token_id"), ("fim_pad", "fim_pad_token_id"), ("fim_rep", "fim_rep_token_id"),
            ("fim_sep", "fim_sep_token_id"), ("fim_pre", "prefix_token_id"), ("fim_suf", "suffix_token_id"),
            ("fim_mid", "middle_token_id"))


@lru_cache(maxsize=1)
def byte_chars() -> tuple[str, ...]:
    """GPT-2's byte-level alphabet: the character that stands for byte b in a token's text (``bytes_to_unicode``,
    llama.cpp's ``unicode_byte_to_utf8``): printable Latin-1 bytes stand for themselves, the others for 256 + n."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return tuple(out[b] for b in range(256))


@lru_cache(maxsize=1)
def _char_bytes() -> dict[str, int]:
    return {c: b for b, c in enumerate(byte_chars())}


def _tokenizers():
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - depends on the environment
        raise TokenizerError("text needs HuggingFace's tokenizers package: pip install 'tokenizers>=0.20'") from None
    return tokenizers


def pre_tokenizer(pre: str):
    """The ``tokenizers`` pre-tokenizer for llama.cpp's ``pre`` name: Split(pattern, isolated) + ByteLevel."""
    tk = _tokenizers()
    pattern = PRE_PATTERNS[PRE_ALIASES.get(pre, pre)]
    return tk.pre_tokenizers.Sequence([tk.pre_tokenizers.Split(tk.Regex(pattern), "isolated", invert=False),
                                       tk.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                                   use_regex=False)])


class Tokenizer:
    """A GGUF file's tokenizer, giving llama.cpp's ids, pieces and end-of-generation set.

    Build it with :meth:`from_gguf` (the file's header only) or :meth:`from_metadata` (the ``tokenizer.ggml.*``
    key/values). Attributes: ``n_vocab``, ``pre``, ``bos`` / ``eos`` / ``eot`` / ``eom`` / ``pad`` / ``unk`` (ids or
    None), ``add_bos`` / ``add_eos``, ``eog`` (frozenset of ids), ``hf`` (the ``tokenizers.Tokenizer`` doing the BPE).
    """

    def __init__(self, meta: Mapping[str, Any], source: str = "metadata"):
        self.source = source

        def field(name: str, default: Any = None) -> Any:
            return meta.get(f"tokenizer.ggml.{name}", default)

        def bad(msg: str) -> TokenizerError:
            return TokenizerError(f"{source}: {msg}")

        model = field("model")
        if model is None:
            raise bad("no tokenizer.ggml.model: the file has no tokenizer (feed token ids: use --prompt-ids)")
        if model in ("none", "no_vocab"):
            raise bad(f"tokenizer.ggml.model is {model!r}: the file has no tokenizer (feed token ids: use "
                      "--prompt-ids)")
        if model != "gpt2":
            raise bad(f"tokenizer.ggml.model {model!r} is not supported (supported: gpt2, byte-level BPE)")
        pre = field("pre")
        if pre is None:  # llama.cpp falls back to its 'default' pre-tokenizer, with a warning
            raise bad(f"tokenizer.ggml.pre is missing (llama.cpp's 'default' pre-tokenizer is not supported; "
                      f"supported: {', '.join(PRE_PATTERNS)})")
        if PRE_ALIASES.get(pre, pre) not in PRE_PATTERNS:
            raise bad(f"tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(PRE_PATTERNS)})")
        self.pre = pre

        tokens = field("tokens")
        if not tokens:
            raise bad("tokenizer.ggml.tokens is missing or empty")
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp renames them
        n = self.n_vocab = len(tokens)
        types = field("token_type")
        if types is not None and len(types) < n:
            raise bad(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        attrs = [_ATTR.get(int(t), 0) for t in types[:n]] if types is not None else [_A_NORMAL] * n
        to_id = {t: i for i, t in enumerate(tokens)}
        if len(to_id) != n:
            dup = next(t for i, t in enumerate(tokens) if to_id[t] != i)
            raise bad(f"tokenizer.ggml.tokens holds {dup!r} twice")
        merges = field("merges")
        if merges is None:
            raise bad("tokenizer.ggml.merges is missing (a gpt2 tokenizer needs its merges)")

        # the special ids: gpt2's defaults (11, disabled when out of range), then the file's keys when in range
        ids: dict[str, int | None] = dict.fromkeys(("unk", "sep", "pad", "mask", "eot", "eom", "fim_pre", "fim_suf",
                                                    "fim_mid", "fim_pad", "fim_rep", "fim_sep"))
        ids["bos"] = ids["eos"] = 11 if 11 < n else None
        for name, key in _ID_KEYS:
            v = field(key)
            if v is not None and 0 <= int(v) < n:
                ids[name] = int(v)
        self.add_bos = bool(field("add_bos_token", False))
        self.add_eos = bool(field("add_eos_token", False))

        # ids llama.cpp finds by their text when the file names none (it takes the first in a hash map's order:
        # unspecified when several texts match; here the lowest id), made control tokens
        for name, texts in _DETECT.items():
            if ids[name] is None:
                found = sorted(to_id[t] for t in texts if t in to_id)
                if found:
                    ids[name] = found[0]
                    attrs[found[0]] |= _A_CONTROL
        # (llama.cpp also marks control tokens named "unused..." UNUSED; that changes neither ids nor pieces)
        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] is not None}
        for t in EOG_TEXTS:
            if t in to_id:
                eog.add(to_id[t])
                attrs[to_id[t]] |= _A_CONTROL
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always rendered
            if t in to_id:
                attrs[to_id[t]] = _A_USER_DEFINED
        eog |= {ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None}
        texts = {tokens[i]: i for i in eog}
        if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts.keys()
                                   or {"<|calls|>", "<|flush|>"} <= texts.keys()):
            eog.discard(texts["<|end|>"])
            attrs[texts["<|end|>"]] = _A_USER_DEFINED
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            attrs[texts["</s>"]] = _A_NORMAL

        self.bos, self.eos, self.eot, self.eom = ids["bos"], ids["eos"], ids["eot"], ids["eom"]
        self.pad, self.unk = ids["pad"], ids["unk"]
        self.special_ids = {k: v for k, v in ids.items() if v is not None}
        self.eog = frozenset(eog)
        self._tokens, self._attrs = tokens, attrs
        # the tokens split out of text before the BPE, longest text first (llama.cpp sorts by byte length; its
        # std::sort leaves equal lengths in no fixed order: here by id)
        special = [i for i, a in enumerate(attrs) if a & (_A_CONTROL | _A_USER_DEFINED | _A_UNKNOWN)]
        special.sort(key=lambda i: -len(tokens[i].encode()))
        self._special = [(tokens[i], i, bool(attrs[i] & (_A_CONTROL | _A_UNKNOWN))) for i in special]
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self.hf = self._build_hf(tokens, to_id, merges, special, bad)

    def _build_hf(self, tokens: list[str], to_id: dict[str, int], merges: list[str], special: list[int], bad):
        tk = _tokenizers()
        pairs = []
        for m in dict.fromkeys(merges):  # a repeated merge keeps its first rank, as in llama.cpp's bpe_ranks
            cut = m.find(" ", 1)
            if cut > 0:  # (llama.cpp keeps an unsplittable line as the pair ("", ""), which never matches)
                pairs.append((m[:cut], m[cut + 1:]))
        try:
            bpe = tk.models.BPE(vocab=to_id, merges=pairs, ignore_merges=False)
        except Exception as e:  # tokenizers' own one-line complaint (a merge whose result is not a token)
            raise bad(f"tokenizer.ggml.merges do not fit the tokens: {str(e).splitlines()[0]}") from None
        hf = tk.Tokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizer(self.pre)
        hf.decoder = tk.decoders.ByteLevel()
        hf.add_tokens([tk.AddedToken(tokens[i], special=bool(self._attrs[i] & (_A_CONTROL | _A_UNKNOWN)),
                                     normalized=False) for i in special])
        # gdnpass splits special text out itself, llama.cpp's way (longest first), before the BPE sees the text
        hf.encode_special_tokens = True
        return hf

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], source: str = "metadata") -> "Tokenizer":
        """From GGUF key/values (``tokenizer.ggml.*``, as Python values); ``source`` names them in errors."""
        return cls(meta, source)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """The tokenizer of the GGUF file at ``path``, from its header alone. On a 2-core machine: 0.02 s for a tiny
        file, 1.0 s for the writer's 248320 tokens, 3.1 s for 248k tokens and 248k merges (Qwen3.5's size)."""
        from gdnpass.models.gguf_read import GgufError, open_reader

        path = Path(path)
        try:
            fields = open_reader(path).fields
        except GgufError as e:
            raise TokenizerError(str(e)) from None
        meta = {}
        for key, f in fields.items():
            if key.startswith("tokenizer.ggml."):
                try:
                    meta[key] = f.contents()
                except UnicodeDecodeError:
                    raise TokenizerError(f"{path}: {key} is not UTF-8 text") from None
        return cls(meta, str(path))

    # ---- text -> ids ------------------------------------------------------------------------------------------------
    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """``text`` as raw-text fragments and special ids, llama.cpp's ``tokenizer_st_partition``: each special token
        in turn (longest first) is cut out of every fragment left; control and unknown ones only with
        ``parse_special``. (Searching the str is searching its UTF-8 bytes: a valid UTF-8 match starts on a
        character.)"""
        parts: list[str | int] = [text] if text else []
        for tok, tid, control in self._special:
            if control and not parse_special:
                continue
            out: list[str | int] = []
            for p in parts:
                if isinstance(p, int) or tok not in p:
                    out.append(p)
                    continue
                pieces = p.split(tok)
                for j, s in enumerate(pieces):
                    if j:
                        out.append(tid)
                    if s:
                        out.append(s)
            parts = out
        return parts

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """``llama_tokenize(vocab, text, add_special, parse_special)``: the ids of ``text``; BOS / EOS with
        ``add_special`` only if the file's ``add_bos_token`` / ``add_eos_token`` say so (Qwen: neither)."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text is not valid Unicode: {e.reason} at index {e.start}") from None
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self._need("bos"))
        # (fragment by fragment: encode_batch's thread pool would make tokenizers warn in every child process forked
        # after it, e.g. the llama.cpp worker)
        for p in self._partition(text, parse_special):
            out.extend([p] if isinstance(p, int) else self.hf.encode(p, add_special_tokens=False).ids)
        if add_special and self.add_eos:
            out.append(self._need("eos"))
        return out

    def _need(self, name: str) -> int:
        tid = self.special_ids.get(name)
        if tid is None:  # llama.cpp asserts here
            raise TokenizerError(f"{self.source}: tokenizer.ggml.add_{name}_token is set but the file has no "
                                 f"{name} token")
        return tid

    # ---- ids -> text ------------------------------------------------------------------------------------------------
    def piece(self, tid: int, special: bool = True) -> bytes:
        """``llama_token_to_piece(vocab, tid, lstrip=0, special)``: the bytes token ``tid`` stands for. Control and
        unknown tokens give their text only with ``special``; unused and undefined ones give nothing."""
        key = (tid, special)
        got = self._pieces.get(key)
        if got is None:
            got = self._pieces[key] = self._piece(tid, special)
        return got

    def _piece(self, tid: int, special: bool) -> bytes:
        if not 0 <= tid < self.n_vocab:
            raise TokenizerError(f"{self.source}: token id {tid} is out of range (vocabulary of {self.n_vocab})")
        attr, text = self._attrs[tid], self._tokens[tid]
        if attr & (_A_UNKNOWN | _A_CONTROL):
            return text.encode() if special else b""
        if attr & _A_USER_DEFINED:
            return text.encode()
        if attr & _A_NORMAL:  # llama_decode_text: each character back to its byte
            table, out = _char_bytes(), bytearray()
            for c in text:
                b = table.get(c)
                if b is None:  # (llama.cpp's marker for a character that is no byte, token text and all)
                    out += b"[UNK_BYTE_0x" + c.encode().hex().encode() + text.encode() + b"]"
                else:
                    out.append(b)
            return bytes(out)
        if attr & _A_BYTE:  # "<0xAB>"
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b"\0"
        return b""

    def decode_bytes(self, ids: Iterable[int], special: bool = True) -> bytes:
        """The pieces of ``ids`` joined: ``llama_detokenize(..., remove_special=False, unparse_special=special)``
        for the qwen pre-tokenizers (which clean no spaces)."""
        return b"".join(self.piece(int(i), special) for i in ids)

    def decode(self, ids: Iterable[int], special: bool = True) -> str:
        """:meth:`decode_bytes` as text; bytes that are not UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, special).decode("utf-8", errors="replace")

    def is_eog(self, tid: int) -> bool:
        """``llama_vocab_is_eog``: whether generation stops at ``tid`` (EOS, EOT, EOM, the FIM pad/repo/sep tokens
        and every token whose text llama.cpp lists as an end, e.g. ``<|im_end|>``, ``<|endoftext|>``)."""
        return tid in self.eog

    def stream(self, special: bool = True) -> "StreamDecoder":
        """A :class:`StreamDecoder` over this tokenizer."""
        return StreamDecoder(self, special)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.source!r}: {self.n_vocab} tokens, pre {self.pre!r}, eos {self.eos}, "
                f"eog {sorted(self.eog)})")


class StreamDecoder:
    """Ids in, text out as it completes: :meth:`feed` returns only whole characters, holding back the bytes of a
    character split across tokens until its last byte comes; :meth:`flush` ends the stream. Everything fed and
    flushed joins to ``tokenizer.decode(ids)`` exactly (bytes that are not UTF-8 become U+FFFD, as there)."""

    def __init__(self, tokenizer: Tokenizer, special: bool = True):
        self.tokenizer, self.special = tokenizer, special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: int | Iterable[int]) -> str:
        """The text that ``ids`` (one id or several) complete."""
        ids = [ids] if isinstance(ids, int) else ids
        return self._utf8.decode(self.tokenizer.decode_bytes(ids, self.special))

    def flush(self) -> str:
        """What is held back (an incomplete character: U+FFFD), and reset."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out
