"""gdnpass.tokenizer against llama.cpp's own tokenizer on the same file (one worker call per file, every text and
mode at once), the byte-level BPE vocabulary gguf_write writes, the stream decoder and the one-line errors."""

import dataclasses
import random
import subprocess
import sys

import gguf
import pytest
from hypothesis import given, settings, strategies as st

from gdnpass.frontends.llama.capture import tokenize
from gdnpass.models.gguf_write import (SPECIAL_TOKENS, GgufError, _pack_long_arrays, bpe_vocab, open_reader,
                                       read_shape, tokenizer_metadata, trained_merges, write_gguf)
from gdnpass.models.hparams import PRESETS
from gdnpass.tokenizer import CONTROL, NORMAL, UNUSED, USER_DEFINED, Tokenizer, TokenizerError

SHAPE = dataclasses.replace(PRESETS["tiny-qwen35"], name="tok", n_embd=64, n_ff=64, vocab_size=1024)
MODES = [(True, True), (True, False), (False, True), (False, False)]  # (add_special, parse_special)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.", "Hello, world!", "hello world", "HELLO WORLD",
    "don't", "I'LL", "we'Re they'VE it's O'Neil's 'quoted' 'll 's", "'s", "''", "can't won't shan't",
    "12345", "3.14159 1,000,000 -273.15 0x1F 2026-12-01 12:30:45", "٣٤٥ ½ ² ① Ⅻ", "a1b2c3",
    "今天天气很好，我们去公园散步吧。", "日本語のテキスト、ひらがなとカタカナ。", "한국어 텍스트", "中文English混合mixed",
    "👨‍👩‍👧‍👦 🏳️‍🌈 👋🏽 🇩🇪🇯🇵 ❤️", "😀😂👍", "a👍b", " 🚀",
    "def f(x):\n\tif x:\n\t\treturn  x  \n    \n\n\n", "for (int i = 0; i < n; ++i) {\r\n\ty += 2;   }\n",
    "a    b\t\t c  \n  \n d   ", "   ", "\n\n\n", "\t", " \u3000 \u00a0x\u2028y\u0085z", "line\r\nline\rline",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b<|endoftext|>",
    "<|im_start|", "<|im_end|><|im_end|>", "x <|im_start|> y", "<|im_start|><|im_start|>",
    "<think>hi</think>", "<tool_call>{}</tool_call>", "<|fim_pad|>", "a<|eot_id|>", "<unk>", "[PAD700]",
    "", " ", "  ", "x",
    "e\u0301 a\u0300\u0301 \u0301x t\u0337e\u0338x\u0335t", "\u0301", "a\u20dd", "\u0903\u093e", "\ufe0f\u200d",
    "Straße café naïve Ελληνικά русский עברית العربية हिन्दी ไทย", "\U0001fae8 \ue000 \U0003134b \U000f0000",
    "\x00\x01\x7f", "\ud7ff\ue000\uffff",
]


def random_texts(n: int, seed: int = 0) -> list[str]:
    """Short strings drawn from pools that stress the pre-tokenizer's classes (letters and marks of many scripts,
    digits, whitespace of every kind, punctuation, CJK, emoji, special-token text, contractions)."""
    pools = ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " \t\n\r\v\f",
             "'\"!?.,;:-_()[]{}<>|/\\@#$%^&*+=~`", "\u00a0\u0085\u1680\u2000\u2003\u200a\u2028\u2029\u202f\u3000"
             "\u180e\u200b\ufeff", "\u0300\u0301\u0308\u0327\u0338\u20dd\u0903\u093e\u094d\u0e31\u302a\ufe0f\u200d",
             "今天天气很好我们日本語のかなカナ한국어", "😀👍🎉🚀❤🔥👨👩🏳🌈🇩🇪👋🏽", "éñçßøæœΩαЖяשمहไ",
             "٠١٢٣०१ⅠⅡ½²①", "\u0378\u0e5c\U0001fae8\U00030000\ue000\U000f0000\U0001e030",
             "<|im_start|><|im_end|><|endoftext|><think>", "'s't're've'm'll'd'S'LL"]
    rng = random.Random(seed)
    return ["".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 24))) for _ in range(n)]


ALL_TEXTS = TEXTS + random_texts(400)


def vocab_file(path, meta: dict):
    """A GGUF holding qwen35 hparams and the tokenizer ``meta``, no tensors: enough for llama.cpp's vocab_only load."""
    w = gguf.GGUFWriter(path, "qwen35")
    from gdnpass.models.gguf_write import add_kv, gguf_metadata

    for k, v in {**gguf_metadata(SHAPE), **meta}.items():
        add_kv(w, k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def variant_meta() -> dict:
    """The writer's vocabulary changed where llama.cpp has rules of its own: the qwen2 pre-tokenizer; BOS and EOS
    added; user-defined tokens (split out of text even without parse_special), two of which overlap ("<tool" and
    "tool_call>": llama.cpp cuts the longer one first); "<|fim_pad|>" and "<|eot_id|>" typed NORMAL (llama.cpp
    knows them by their text and makes them control tokens ending generation); an UNKNOWN-typed token; an EOM id
    ("</think>": llama.cpp adds it to the end-of-generation set)."""
    meta = tokenizer_metadata(SHAPE.vocab_size)
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    extra = {"<think>": USER_DEFINED, "</think>": USER_DEFINED, "<tool": USER_DEFINED, "tool_call>": USER_DEFINED,
             "<|fim_pad|>": NORMAL, "<|eot_id|>": NORMAL, "<unk>": 2}
    for i, (t, ty) in enumerate(extra.items(), start=900):
        tokens[i], types[i] = t, ty
    meta.update({"tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                 "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True,
                 "tokenizer.ggml.eom_token_id": tokens.index("</think>")})
    return meta


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """A real model file as the writer writes it (its default tokenizer: byte-level BPE, qwen35)."""
    return write_gguf(SHAPE, tmp_path_factory.mktemp("tok") / "tok.gguf", wtype="bf16", seed=1)


@pytest.fixture(scope="module")
def tok(model_file):
    return Tokenizer.from_gguf(model_file)


@pytest.fixture(scope="module", params=["qwen35", "qwen2-variant"])
def ref(request, model_file, llama, tmp_path_factory):
    """(our tokenizer, llama.cpp's answers) for one file: every text in every mode, every piece, the detokenized
    bytes of our ids, in one worker call."""
    if request.param == "qwen35":
        path = model_file
    else:
        path = vocab_file(tmp_path_factory.mktemp("variant") / "variant.gguf", variant_meta())
    ours = Tokenizer.from_gguf(path)
    ids = [ours.encode(t) for t in ALL_TEXTS]
    out = tokenize(path, ALL_TEXTS, modes=MODES, pieces=None,
                   detokenize=[(x, False, special) for x in ids for special in (True, False)], install=llama)
    out["our_ids"] = ids
    return ours, out


# ---- against llama.cpp ------------------------------------------------------------------------------------------
def test_encode_matches_llama(ref):
    ours, out = ref
    bad = [(text, mode, ours.encode(text, *mode), got) for text, per_mode in zip(ALL_TEXTS, out["tokens"])
           for mode, got in zip(MODES, per_mode) if ours.encode(text, *mode) != got]
    assert bad == [], f"{len(bad)} differ, first: {bad[:3]}"


def test_pieces_match_llama(ref):
    ours, out = ref
    assert len(out["pieces"]) == ours.n_vocab == out["n_vocab"]
    bad = [i for i, (special, plain) in out["pieces"].items()
           if (ours.piece(i, special=True), ours.piece(i, special=False)) != (special, plain)]
    assert bad == []


def test_decode_matches_llama_detokenize(ref):
    ours, out = ref
    got = iter(out["detokenized"])
    for ids in out["our_ids"]:
        for special in (True, False):
            assert ours.decode_bytes(ids, special) == next(got)


def test_special_ids_and_eog_match_llama(ref):
    ours, out = ref
    assert ours.eog == set(out["eog"])
    assert {k: getattr(ours, k) for k in ("bos", "eos", "eot", "pad")} == out["special"]
    assert (ours.add_bos, ours.add_eos) == (out["add_bos"], out["add_eos"])


@pytest.mark.parametrize("ref", ["qwen2-variant"], indirect=True)
def test_variant_exercises_llama_rules(ref):
    """The variant file does what its rules say (so the comparison above covered them)."""
    ours, out = ref
    i = ALL_TEXTS.index("<tool_call>{}</tool_call>")
    tool, call, bos, eos = (ours.hf.token_to_id(t) for t in ("<tool", "tool_call>", "<|endoftext|>", "<|endoftext|>"))
    got = out["tokens"][i][MODES.index((True, False))]  # user-defined tokens split out without parse_special
    assert got[0] == bos and got[-1] == eos and call in got and tool not in got
    assert {ours.hf.token_to_id(t) for t in ("<|fim_pad|>", "<|eot_id|>", "</think>")} <= ours.eog


# ---- the writer's vocabulary ------------------------------------------------------------------------------------
def test_writer_vocabulary_layout(tok, model_file):
    """Bytes 0..255 in byte order, the merges' tokens, Qwen's three specials (control), [PAD<id>] fillers (unused);
    vocab_size and the token count agree; EOS / PAD / BOS <|endoftext|>, EOT <|im_end|>, no BOS added."""
    v = bpe_vocab(SHAPE.vocab_size)
    n_merges = len(trained_merges())
    assert 200 < n_merges <= 512 and v.merges == [f"{a} {b}" for a, b in trained_merges()]
    assert [tok.piece(b) for b in range(256)] == [bytes([b]) for b in range(256)]
    assert v.tokens[v.eos:v.eot + 1] == list(SPECIAL_TOKENS) and v.n_bpe == 256 + n_merges
    assert v.types == [NORMAL] * v.n_bpe + [CONTROL] * 3 + [UNUSED] * (1024 - v.n_bpe - 3)
    assert v.tokens[-1] == "[PAD1023]" and len(v.tokens) == tok.n_vocab == read_shape(model_file).vocab_size == 1024
    assert (tok.eos, tok.pad, tok.bos, tok.eot, tok.add_bos) == (v.eos, v.eos, v.eos, v.eot, False)
    assert tok.eog == {v.eos, v.eot} and tok.is_eog(v.eot) and not tok.is_eog(v.im_start)
    assert tok.piece(v.im_start) == b"<|im_start|>" and tok.piece(v.im_start, special=False) == b""
    assert tok.piece(1000) == b"" and tok.encode("<|im_start|>") == [v.im_start]
    # it is a real BPE: English and indented code take few tokens
    assert len(tok.encode("The model reads the tokens of the text.")) <= 10
    assert len(tok.encode("        return accepted\n")) <= 4


def test_writer_shrinks_merges_to_fit_a_small_vocabulary():
    small = bpe_vocab(512)  # tiny-qwen35
    assert len(small.tokens) == 512 and small.n_bpe == 509 and len(small.merges) == 253
    assert small.merges == bpe_vocab(1024).merges[:253]
    bare = bpe_vocab(259)
    assert bare.merges == [] and bare.tokens[256:] == list(SPECIAL_TOKENS)
    with pytest.raises(GgufError, match="vocab_size 258 is too small") as e:
        bpe_vocab(258)
    assert "tokenizer='none'" in str(e.value) and "\n" not in str(e.value)


def test_training_is_deterministic_across_processes():
    """The merges (hence the file's bytes) do not depend on the process: Rust's and Python's hash seeds differ."""
    code = "from gdnpass.models.gguf_write import trained_merges; print(repr(trained_merges()))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == repr(trained_merges())


def test_fast_array_packing_writes_gguf_writers_bytes(tmp_path):
    """The writer's one-go packing of the vocabulary arrays gives GGUFWriter's own bytes."""
    meta = tokenizer_metadata(1024)
    paths = []
    for fast in (True, False):
        w = gguf.GGUFWriter(tmp_path / f"{fast}.gguf", "qwen35")
        if fast:
            _pack_long_arrays(w)
        for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
            w.add_array(k, meta[k])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        paths.append((tmp_path / f"{fast}.gguf").read_bytes())
    assert paths[0] == paths[1]


def test_fast_header_reader_equals_gguf_reader(model_file):
    """open_reader's bulk array reading gives GGUFReader's own fields, part for part."""
    fast, slow = open_reader(model_file), gguf.GGUFReader(model_file)
    assert list(fast.fields) == list(slow.fields)
    for key, f in fast.fields.items():
        g = slow.fields[key]
        assert (f.offset, f.data, f.types, len(f.parts)) == (g.offset, g.data, g.types, len(g.parts)), key
        assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(f.parts, g.parts)), key
    assert [t.name for t in fast.tensors] == [t.name for t in slow.tensors]


# ---- ids -> text ------------------------------------------------------------------------------------------------
def test_stream_decoder_yields_whole_characters(tok):
    """Fed one id at a time, the stream gives decode(ids) exactly, never part of a character: "€" as its three byte
    tokens comes out whole with the third."""
    euro = list("€".encode())  # ids 0..255 are the bytes
    s = tok.stream()
    assert [s.feed(i) for i in euro] == ["", "", "€"] and s.flush() == ""
    for text in TEXTS:
        ids = tok.encode(text)
        s, got = tok.stream(), ""
        for k, i in enumerate(ids):
            got += s.feed(i)
            assert tok.decode(ids).startswith(got)
            assert "\ufffd" not in got  # (these texts are valid UTF-8 at every token boundary or held back)
            assert tok.decode(ids[:k + 1]).startswith(got)
        assert got + s.flush() == tok.decode(ids) == text


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.binary(max_size=40), cuts=st.lists(st.integers(0, 40), max_size=8))
def test_stream_decoder_equals_decode_on_any_bytes(tok, data, cuts):
    """Any bytes (broken UTF-8 too) in any chunks: the stream joins to decode(ids), U+FFFD where decode has them."""
    ids = list(data)  # byte tokens
    s = tok.stream()
    bounds = sorted({0, len(ids), *[c for c in cuts if c <= len(ids)]})
    got = "".join(s.feed(ids[a:b]) for a, b in zip(bounds, bounds[1:])) + s.flush()
    assert got == tok.decode(ids) == data.decode("utf-8", errors="replace")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.text(max_size=60))
def test_round_trip(tok, text):
    """Byte-level BPE loses nothing: decode(encode(text)) == text, special text parsed or not."""
    assert tok.decode(tok.encode(text, parse_special=False)) == text
    assert tok.decode(tok.encode(text)) == text


# ---- errors -----------------------------------------------------------------------------------------------------
def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg and msg
    return msg


def test_file_without_tokenizer_is_refused(tmp_path):
    path = write_gguf(dataclasses.replace(SHAPE, vocab_size=97), tmp_path / "ids.gguf", tokenizer="none")
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_gguf(path)
    msg = _one_line(e)
    assert msg.startswith(str(path)) and "tokenizer.ggml.model is 'none'" in msg and "--prompt-ids" in msg
    with pytest.raises(GgufError, match="too small") as e:  # the default tokenizer needs 259 tokens
        write_gguf(dataclasses.replace(SHAPE, vocab_size=97), tmp_path / "small.gguf")
    _one_line(e)
    with pytest.raises(GgufError, match="tokenizer 'sentencepiece' is not supported") as e:
        write_gguf(SHAPE, tmp_path / "x.gguf", tokenizer="sentencepiece")


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.pre": "foo"}, "tokenizer.ggml.pre 'foo' is not supported (supported: qwen2, qwen35)"),
    ({"tokenizer.ggml.pre": None}, "tokenizer.ggml.pre is missing"),
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model 'llama' is not supported"),
    ({"tokenizer.ggml.model": None}, "no tokenizer.ggml.model"),
    ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges is missing"),
    ({"tokenizer.ggml.merges": ["a b", "ab cd"]}, "tokenizer.ggml.merges do not fit the tokens"),
    ({"tokenizer.ggml.tokens": ["a", "b", "a"], "tokenizer.ggml.token_type": None}, "holds 'a' twice"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "token_type has 2 entries for 1024 tokens"),
])
def test_bad_metadata_is_one_line(change, message):
    meta = {k: v for k, v in {**tokenizer_metadata(1024), **change}.items() if v is not None}
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_metadata(meta, "model.gguf")
    msg = _one_line(e)
    assert msg.startswith("model.gguf: ") and message in msg


def test_bad_files_and_ids_are_one_line(tmp_path, tok):
    with pytest.raises(TokenizerError, match="no such file") as e:
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    _one_line(e)
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(TokenizerError, match="not a readable GGUF file") as e:
        Tokenizer.from_gguf(tmp_path / "text.gguf")
    _one_line(e)
    with pytest.raises(TokenizerError, match="token id 1024 is out of range") as e:
        tok.decode([1, 1024])
    _one_line(e)
    with pytest.raises(TokenizerError, match="not valid Unicode") as e:
        tok.encode("a\ud800b")
    _one_line(e)
