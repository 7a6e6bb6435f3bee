"""Tokenizer: a thin wrapper over a Hugging Face tokenizer, plus incremental detokenization for streaming.

``Tokenizer`` does no tokenization of its own; it pins the few choices the engine relies on (no automatic
special tokens in ``encode``, no whitespace "clean-up" in ``decode``, chat templates returned as ids, the set of
stop ids). ``IncrementalDetokenizer`` turns a stream of generated ids into text deltas whose concatenation equals
``Tokenizer.decode`` of all the ids.

    tok = Tokenizer.from_pretrained(model_dir)                      # or gguf_file="model.gguf"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerFast

CHAT_ROLES = ("system", "user", "assistant", "tool")
# tokenizer_config.json classes that name no model-specific tokenizer: a tokenizer.json loaded as it is (transformers
# 5 calls that class TokenizersBackend; PreTrainedTokenizerFast is its name there too).
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# End-of-turn markers of common chat formats (ChatML, Llama 3, Phi-3, Gemma). A model may stop on one of these
# while its configured eos is a different token (e.g. Qwen2: eos <|endoftext|>, turns end with <|im_end|>).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
# How many already-emitted tokens are re-decoded with each new one: enough context for a leading-space or
# multi-token character to decode the same way it does in the full sequence (vLLM uses the same value).
DETOKENIZE_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Wraps a Hugging Face tokenizer (kept as ``.hf``)."""

    def __init__(self, hf: Any):
        self.hf = hf

    @classmethod
    def from_pretrained(cls, path: str | Path, gguf_file: str | None = None) -> Tokenizer:
        """Load from a Hugging Face model directory, or from ``gguf_file`` inside ``path``.

        A directory whose tokenizer is the generic one (ours from a .gguf, ``alchemist.model.gguf``) loads it
        directly: the class AutoTokenizer would pick, without its model-config lookup (about four times faster in a
        fresh process: docs/benchmarks.md, "Start-up")."""
        if gguf_file is not None:
            return cls(AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file))
        if _generic_tokenizer(Path(path)):
            return cls(PreTrainedTokenizerFast.from_pretrained(str(path)))
        return cls(AutoTokenizer.from_pretrained(str(path)))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the eos token, plus the chat format's end-of-turn token when it differs."""
        ids = [self.hf.eos_token_id] if self.hf.eos_token_id is not None else []
        template = self.hf.chat_template if isinstance(self.hf.chat_template, str) else ""
        vocab = self.hf.get_vocab()
        for token in END_OF_TURN_TOKENS:
            if token in template and token in vocab and vocab[token] not in ids:
                ids.append(vocab[token])
        return tuple(ids)

    @cached_property
    def end_of_turn_token_id(self) -> int | None:
        """The stop id that closes an assistant turn in the chat template (``<|im_end|>`` for ChatML, ``<|eot_id|>``
        for Llama 3): the first of ``eos_token_ids`` after a reply the template renders. Without a template, the
        eos token."""
        fallback = self.eos_token_ids[0] if self.eos_token_ids else None
        if not self.hf.chat_template:
            return fallback
        user = {"role": "user", "content": "Hi"}
        prompt = self.apply_chat_template([user])
        turn = self.apply_chat_template([user, {"role": "assistant", "content": "Hello"}], add_generation_prompt=False)
        if turn[: len(prompt)] != prompt:  # a template that renders history differently: no reply to look after
            return fallback
        return next((t for t in turn[len(prompt) :] if t in self.eos_token_ids), fallback)

    def encode_reply(self, text: str) -> list[int]:
        """The ids of an assistant reply saying ``text`` that ends by itself: text's tokens, then the end-of-turn
        id, as served output ids end when the engine stops on a stop token (finish_reason "stop")."""
        end = self.end_of_turn_token_id
        return self.encode(text) + ([end] if end is not None else [])

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        check_text(text, "text")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # No clean-up: it deletes spaces before punctuation, which streaming cannot reproduce token by token.
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def user_prompt(self, text: str) -> list[int]:
        """A user turn asking ``text`` as the server prompts it; the plain text for a tokenizer without a chat
        template (tiny test models)."""
        if not self.hf.chat_template:
            return self.encode(text)
        return self.apply_chat_template([{"role": "user", "content": text}])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` (OpenAI-style ``{"role", "content"}`` dicts) in the model's chat format."""
        validate_messages(messages)
        if not self.hf.chat_template:
            raise ValueError("this tokenizer has no chat template; use a chat (instruct) model")
        ids = self.hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
        return list(ids)


def validate_messages(messages: list[dict]) -> None:
    """Raise ValueError naming the first malformed message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if message.get("role") not in CHAT_ROLES:
            raise ValueError(f"messages[{i}]['role'] is {message.get('role')!r}; expected one of {CHAT_ROLES}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}]['content'] must be a string")
        check_text(message["content"], f"messages[{i}]['content']")


def check_text(text: str, name: str) -> None:
    """Raise ValueError if ``text`` is not valid Unicode: JSON can carry a lone surrogate ("\\ud800"), which no
    tokenizer can encode (HF's raises a TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode: a lone surrogate at position {e.start}") from None


class IncrementalDetokenizer:
    """Turns generated ids, one at a time, into text deltas for streaming.

    Each step decodes a short window twice, ``window[:num_sent]`` (ids whose text is already sent, kept as
    context) and the whole window, and emits the difference. The context makes leading spaces come out as in the
    full decode (SentencePiece strips a space only at the start of a decode); a delta is held back while it ends
    in U+FFFD, i.e. while a multi-byte character is still split across tokens. After each emission the window
    restarts at the ids just emitted, so it stays a few tokens long and each step is O(1) in the sequence length.

    Invariant: the deltas (then ``flush()``) add up to ``decode(ids)`` without a prompt, and to the text the ids
    add after the prompt with one (so a SentencePiece reply can start with a space that ``decode(ids)`` strips).
    One exception, shared with vLLM: for invalid UTF-8 made of byte-fallback tokens, HF's ByteFallback decoder
    replaces the whole run of byte tokens, including bytes already sent, with U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.window: list[int] = list(prompt_ids[-DETOKENIZE_CONTEXT_TOKENS:])
        self.num_sent = len(self.window)  # window[:num_sent] is context whose text was already sent
        self._deltas: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._deltas)

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes (often "", never a partial character)."""
        self.window.append(token_id)
        sent_text, window_text = self._decode_window()
        if len(window_text) <= len(sent_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(window_text[len(sent_text) :])

    def flush(self) -> str:
        """At end of stream, emit what is held back (an unfinished character decodes to U+FFFD, as in decode)."""
        sent_text, window_text = self._decode_window()
        if len(window_text) <= len(sent_text):
            return ""
        return self._emit(window_text[len(sent_text) :])

    def _decode_window(self) -> tuple[str, str]:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return decode(self.window[: self.num_sent]), decode(self.window)

    def _emit(self, delta: str) -> str:
        del self.window[: self.num_sent]
        self.num_sent = len(self.window)
        self._deltas.append(delta)
        return delta


def _generic_tokenizer(path: Path) -> bool:
    """Whether ``path`` holds a tokenizer.json whose tokenizer_config.json names a generic class."""
    config = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not config.is_file():
        return False
    return json.loads(config.read_text()).get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
