"""Tests for alchemist.model.tokenizer on the real SmolLM2 tokenizer (byte-level BPE, loaded from its GGUF) and
on a tiny Llama-style SentencePiece tokenizer (leading-space stripping, byte fallback) built in memory."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from alchemist.model.gguf import default_gguf_path
from alchemist.model.tokenizer import IncrementalDetokenizer, Tokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "multi    space     runs\tand\ttabs",
    "Emoji: 😀👍🏽🇫🇷 👨‍👩‍👧 and more 🎉🎉",
    "中文文本：你好，世界！日本語のテキスト。한국어 텍스트",
    "Accents: café, naïve, Ångström, São Paulo, Dvořák, Ελληνικά",
    "def f(x):\n    if x:\n        return  x  *  2\n\n\n    return None  # comment\n",
    "mixed 😀中文 é\u0301 \u200b zero-width, ` code ` , a . b , c ?",
    "",
    " ",
    "\n\n",
]


def smollm2_dir() -> Path:
    # The package is part of the install (make install); its absence is an error, not a skip.
    return default_gguf_path().parent


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)  # ~6 s


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    """A Llama-2-style tokenizer: '▁' marks spaces, the decoder strips one leading space, unknown characters
    fall back to <0xXX> byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    merges = []
    for word in ["▁Hello", "▁world", "▁the", "▁caf", "▁a", "▁b", "Hello", "▁▁▁▁", "é"]:
        vocab.setdefault(word[0], len(vocab))
        for i in range(1, len(word)):
            merges.append((word[:i], word[i]))
            vocab.setdefault(word[i], len(vocab))
            vocab.setdefault(word[: i + 1], len(vocab))
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return Tokenizer(hf)


def stream(tok: Tokenizer, ids: list[int], prompt_ids: list[int] = ()) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


def assert_stream_matches(tok: Tokenizer, ids: list[int], prompt_ids: list[int] = ()) -> None:
    """The deltas add up to the text the ids add after the prompt, and split no character."""
    deltas = stream(tok, ids, prompt_ids)
    prompt_text = tok.decode(prompt_ids)
    full = tok.decode([*prompt_ids, *ids])
    assert full.startswith(prompt_text)
    full = full[len(prompt_text) :]
    if not prompt_ids:
        assert full == tok.decode(ids)
    assert "".join(deltas) == full
    for delta in deltas:
        delta.encode("utf-8")  # no lone surrogates
        assert "\ufffd" not in delta or "\ufffd" in full


# ---- Tokenizer ---------------------------------------------------------------------------------------------


def test_encode_decode_round_trip(tok: Tokenizer):
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text


def test_encode_adds_no_special_tokens_by_default(tok: Tokenizer):
    assert tok.encode("hi") == tok.hf.encode("hi", add_special_tokens=False)


def test_decode_skips_special_tokens_only_when_asked(tok: Tokenizer):
    ids = [tok.bos_token_id, *tok.encode("hi"), *tok.eos_token_ids]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_decode_keeps_spaces_before_punctuation(tok: Tokenizer):
    # clean_up_tokenization_spaces would turn this into "a. b, c?", which streaming cannot reproduce.
    assert tok.decode(tok.encode("a . b , c ?")) == "a . b , c ?"


def test_special_ids_and_vocab(tok: Tokenizer):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == tok.hf.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tok.eos_token_ids
    assert len(set(tok.eos_token_ids)) == len(tok.eos_token_ids)


def test_eos_token_ids_add_end_of_turn_when_it_differs(tok: Tokenizer):
    endoftext = tok.hf.convert_tokens_to_ids("<|endoftext|>")
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    eos_token = tok.hf.eos_token
    try:
        tok.hf.eos_token = "<|endoftext|>"  # as in Qwen2: eos differs from the ChatML end of turn
        assert tok.eos_token_ids == (endoftext, im_end)
    finally:
        tok.hf.eos_token = eos_token


def test_encode_reply_is_the_assistant_turn_the_template_renders(tok: Tokenizer):
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    user = {"role": "user", "content": "Say hi."}
    for text in ["Hello there, friend.", "Two\nlines 😀", " spaced "]:
        reply = tok.encode_reply(text)
        prompt = tok.apply_chat_template([user])
        turn = tok.apply_chat_template([user, {"role": "assistant", "content": text}], add_generation_prompt=False)
        assert reply[-1] == im_end  # as a served output ends when the model stops by itself
        assert turn[: len(prompt) + len(reply)] == prompt + reply


def test_end_of_turn_is_the_template_s_not_the_eos(tok: Tokenizer):
    eos_token = tok.hf.eos_token
    try:
        tok.hf.eos_token = "<|endoftext|>"  # as in Qwen2: eos differs from the ChatML end of turn
        assert Tokenizer(tok.hf).end_of_turn_token_id == tok.hf.convert_tokens_to_ids("<|im_end|>")
    finally:
        tok.hf.eos_token = eos_token


def test_chat_template_matches_hf(tok: Tokenizer):
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi 😀"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "中文?"},
        ],
    ]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            expected = tok.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
            if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
                expected = expected["input_ids"]
            ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            assert ids == list(expected)
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>user\n中文?<|im_end|>\n")


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty"),
        ([{"role": "robot", "content": "hi"}], r"messages\[0\]\['role'\]"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\]\['content'\]"),
        ([{"role": "user", "content": None}], "content"),
        (["hi"], "must be a dict"),
    ],
)
def test_chat_template_rejects_bad_messages(tok: Tokenizer, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


# ---- IncrementalDetokenizer --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode(tok: Tokenizer, text: str):
    assert_stream_matches(tok, tok.encode(text))


def test_stream_with_prompt_context(tok: Tokenizer):
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi"}])
    for text in TEXTS:
        ids = tok.encode(text) + list(tok.eos_token_ids)
        assert_stream_matches(tok, ids, prompt_ids=prompt)


def test_stream_holds_back_split_characters(tok: Tokenizer):
    # One byte per token: each character is emitted whole, once its last byte arrives.
    text = "a😀b中é"
    ids = bytes_to_ids(tok, text.encode("utf-8"))
    assert len(ids) == len(text.encode("utf-8"))
    deltas = [d for d in stream(tok, ids) if d]
    assert deltas == ["a", "😀", "b", "中", "é"]


def bytes_to_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """Ids of single-byte tokens in a byte-level BPE vocabulary: GPT-2 maps each byte to a printable
    character, itself for printable Latin-1 bytes and chr(256 + k) for the k-th other byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}
    return [tok.hf.convert_tokens_to_ids(table[b]) for b in data]


def test_stream_of_random_ids(tok: Tokenizer):
    # Random ids make invalid UTF-8, lone continuation bytes and special tokens; the invariant still holds.
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert_stream_matches(tok, ids)


def test_stream_of_random_bytes(tok: Tokenizer):
    rng = random.Random(1)
    for _ in range(50):
        data = bytes(rng.choice(b"a \n\xc3\xa9\xe4\xb8\xad\xf0\x9f\x98\x80\x80\xff") for _ in range(30))
        assert_stream_matches(tok, bytes_to_ids(tok, data))


def test_stream_window_stays_bounded(tok: Tokenizer):
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode(" ".join(TEXTS) * 20)
    for i in ids:
        detok.add(i)
        assert len(detok.window) <= 8
    assert detok.text == tok.decode(ids)


def test_sentencepiece_leading_spaces(sp_tok: Tokenizer):
    ids = sp_tok.encode("Hello world the  a b")
    tokens = sp_tok.hf.convert_ids_to_tokens(ids)
    assert tokens[:3] == ["▁Hello", "▁world", "▁the"]
    # Decoding token by token loses the spaces that SentencePiece strips at the start of a decode ...
    assert "".join(sp_tok.decode([i]) for i in ids) != sp_tok.decode(ids)
    # ... the detokenizer keeps them.
    assert stream(sp_tok, ids)[:3] == ["Hello", " world", " the"]
    for text in TEXTS:
        assert_stream_matches(sp_tok, sp_tok.encode(text))
        assert_stream_matches(sp_tok, sp_tok.encode(text), prompt_ids=sp_tok.encode("Hello world"))
    # After a prompt, the first token's space is text the reply adds; alone, a decode strips it.
    prompt_ids = sp_tok.encode("Hello")
    assert stream(sp_tok, sp_tok.encode("world"), prompt_ids)[0] == " world"


def test_sentencepiece_byte_fallback(sp_tok: Tokenizer):
    ids = sp_tok.encode(" 😀中 café")
    assert "<0xF0>" in sp_tok.hf.convert_ids_to_tokens(ids)
    deltas = [d for d in stream(sp_tok, ids) if d]
    assert "".join(deltas) == sp_tok.decode(ids) == " 😀中 café"
    assert "😀" in deltas and "中" in deltas


def test_sentencepiece_random_texts(sp_tok: Tokenizer):
    # Valid text only: for invalid UTF-8, the ByteFallback decoder turns a whole run of byte tokens into U+FFFD,
    # retroactively changing text that a stream has already sent.
    rng = random.Random(2)
    pool = [*"Hello world the caf é a b", "  ", "   ", "\n", "\t", "😀", "中", "\u0301", "\x1a", "👨‍👩‍👧"]
    for _ in range(200):
        text = "".join(rng.choice(pool) for _ in range(rng.randrange(25)))
        prompt = sp_tok.encode("".join(rng.choice(pool) for _ in range(rng.randrange(6))))
        assert_stream_matches(sp_tok, sp_tok.encode(text))
        assert_stream_matches(sp_tok, sp_tok.encode(text), prompt_ids=prompt)
