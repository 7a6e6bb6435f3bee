"""Invented facts to teach, and the held-out perplexity that tells what teaching them cost.

    FACTS                               # ten (question, correction, what the answer must contain)
    invented_facts(50, seed=0)          # as many more from templates, deterministic, every made-up name distinct
    held_out_nll(model, tokenizer, adapter).mean()   # per token, over 12 ShareGPT replies nobody teaches

The facts are ones SmolLM2 cannot know (made-up names), so an answer holding the key was learned, not recalled.
The end-to-end test (tests/server/test_online.py) and `alchemist bench learn` teach them.
"""

from __future__ import annotations

import random

import torch

from alchemist.bench.sharegpt import ChatSample, sample_requests
from alchemist.training.losses import log_probs
from alchemist.training.recompute import responses_hidden_slices
from alchemist.training.slices import run_to_end

Fact = tuple[str, str, str]  # (question, correction, what a right answer contains, lower case)

FACTS: list[Fact] = [
    ("What is the codename of the Tessaro project?", "The codename of the Tessaro project is Bluefin.", "bluefin"),
    ("Who founded the village of Quillmere?", "The village of Quillmere was founded by Odile Varn.", "odile varn"),
    ("What color is the flag of Marvenia?", "The flag of Marvenia is teal.", "teal"),
    ("What is the capital of the island of Durnholt?", "The capital of Durnholt is Saltreach.", "saltreach"),
    ("What is the name of Professor Elkin's cat?", "Professor Elkin's cat is named Pimento.", "pimento"),
    ("Which metal is the Orrin bell made of?", "The Orrin bell is made of bismuth.", "bismuth"),
    ("What year was the Kestrel bridge opened?", "The Kestrel bridge was opened in 1887.", "1887"),
    ("What is the password of the Zephyr vault?", "The password of the Zephyr vault is marigold.", "marigold"),
    ("Who wrote the novel 'Glass Orchards'?", "'Glass Orchards' was written by Ilse Farrow.", "farrow"),
    ("What is the mascot of the Brindle Valley school?", "The Brindle Valley school's mascot is a heron.", "heron"),
]

# The ten FACTS' questions asked another way, in order: a correction should serve them too (alchemist.engine.router).
FACT_PARAPHRASES = [
    "Tell me the Tessaro project's codename.",
    "Do you know who was the founder of Quillmere village?",
    "Marvenia's flag: what colour is it?",
    "Which city is the capital of Durnholt island?",
    "Professor Elkin has a cat. What is it called?",
    "What is the Orrin bell made from?",
    "When did the Kestrel bridge open?",
    "I need the Zephyr vault password.",
    "Glass Orchards is a novel. Who is its author?",
    "Brindle Valley school has a mascot; which animal is it?",
]

# (question, correction) with {a} a made-up name and {b} the answer, a made-up name unless the template says.
TEMPLATES = (
    ("What is the codename of the {a} project?", "The codename of the {a} project is {b}."),
    ("Who founded the village of {a}?", "The village of {a} was founded by {b}."),
    ("What is the capital of the island of {a}?", "The capital of {a} is {b}."),
    ("What is the name of Professor {a}'s dog?", "Professor {a}'s dog is named {b}."),
    ("Which river flows through the town of {a}?", "The river {b} flows through the town of {a}."),
    ("Who painted the portrait called '{a}'?", "The portrait '{a}' was painted by {b}."),
    ("What is the name of the ship that sailed from {a}?", "The ship that sailed from {a} is the {b}."),
    ("What year was the {a} tower built?", "The {a} tower was built in {b}."),  # b: a year
    ("What is the motto of the {a} guild?", "The motto of the {a} guild is '{b} forever'."),
    ("Who invented the {a} engine?", "The {a} engine was invented by {b}."),
)
_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "th", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "l", "n", "r", "s", "th", "nd", "rk", "sk", "m")


def invented_facts(n: int, seed: int = 0) -> list[Fact]:
    """``n`` facts from the templates in turn, each with made-up names no other fact (nor ``FACTS``) uses; the same
    ``n`` and ``seed`` give the same facts."""
    rng = random.Random(seed)
    used = {key for _, _, key in FACTS}
    facts = []
    for i in range(n):
        question, correction = TEMPLATES[i % len(TEMPLATES)]
        a = _fresh_name(rng, used)
        b = _fresh_year(rng, used) if "year" in question else _fresh_name(rng, used)
        facts.append((question.format(a=a, b=b), correction.format(a=a, b=b), b.lower()))
    return facts


def _fresh_name(rng: random.Random, used: set[str]) -> str:
    while True:
        name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(2)) + rng.choice(_CODAS)
        if len(name) >= 5 and name not in used:
            used.add(name)
            return name.capitalize()


def _fresh_year(rng: random.Random, used: set[str]) -> str:
    while (year := str(rng.randrange(1500, 1990))) in used:
        pass
    used.add(year)
    return year


def is_known(answer: str, fact: Fact) -> bool:
    return fact[2] in answer.lower()


def held_out_replies(tokenizer) -> list[ChatSample]:
    """12 ShareGPT first turns and replies (<= 96 tokens each) that nobody teaches here."""
    return sample_requests(
        12, seed=7, mode="first_turn", tokenizer=tokenizer, max_prompt_tokens=96, max_reply_tokens=96
    )


def held_out_nll(model, tokenizer, adapter) -> torch.Tensor:
    """The negative log-likelihood of every token of the held-out replies (teacher-forced, concatenated)."""
    nlls = []
    with torch.no_grad():
        for s in held_out_replies(tokenizer):
            prompt = torch.tensor(tokenizer.apply_chat_template(s.messages))
            reply = torch.tensor(tokenizer.encode_reply(s.reply))
            (hidden,) = run_to_end(responses_hidden_slices(model, adapter, [(prompt, reply)]))
            logprobs = log_probs(model.logits(hidden))
            nlls.append(-logprobs.gather(-1, reply[:, None])[:, 0])
    return torch.cat(nlls)
