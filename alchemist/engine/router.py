"""Which requests the corrections' ranks serve: those whose prompt holds most of a taught prompt's rare words.

A correction taught to the adapter (the ranks ``AdapterConfig.lora_r``, cut: ``alchemist.training.rank_split``)
is served only to requests that resemble a prompt it was taught on; every other request is served the base model
plus the preference ranks, exactly as before anything was taught. Model-editing methods with a scope do the same
(GRACE, WISE); this is the simplest scope, on the prompt's words before any forward:

    score(request) = max over taught prompts t of  sum(idf(w) for w in words(t) & words(request)) / sum(idf(w) for w
    in words(t))

routed when it reaches ``threshold``. Words are lower-cased runs of letters and digits of the decoded prompt, less
the words of the chat template and its system prompt (those of an empty user turn); idf(w) = log((N + 1) /
(df(w) + 1)) over ``WORD_DF_FILE``, the document frequencies of N ShareGPT first turns
(``docs/profiles/router_words.py`` writes it): made-up names and rare words weigh most, "what" and "the" nothing.
Why words and this threshold: docs/benchmarks.md, "Learning a correction with the defaults" (taught questions and
hand-written paraphrases routed, ShareGPT first turns and the gate's canaries not).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path

WORD_DF_FILE = Path(__file__).with_name("word_df.json")
_WORD = re.compile(r"[^\W_]+")


def words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


@cache
def _table() -> tuple[int, dict[str, int]]:
    data = json.loads(WORD_DF_FILE.read_text())
    return data["documents"], data["df"]


def idf(word: str) -> float:
    n, df = _table()
    return math.log((n + 1) / (df.get(word, 0) + 1))


class Router:
    """The taught prompts' words, and the routing decision for a request's prompt."""

    def __init__(self, decode: Callable[[list[int]], str], template: str, threshold: float) -> None:
        """``decode``: token ids -> text; ``template``: the decoded prompt of an empty user turn (its words never
        count)."""
        self.decode, self.threshold = decode, threshold
        self._template = words(template)
        self._keys: list[tuple[dict[str, float], float]] = []  # per taught prompt: its words' idf, their sum

    def teach(self, prompts: Iterable[list[int]]) -> None:
        """Adds taught prompts (token ids)."""
        for prompt in prompts:
            weights = {w: idf(w) for w in words(self.decode(prompt)) - self._template}
            total = sum(weights.values())
            if total > 0:
                self._keys.append((weights, total))

    def __len__(self) -> int:
        return len(self._keys)

    def score(self, prompt: list[int]) -> float:
        """The largest share of a taught prompt's rare words the prompt holds (0 when nothing is taught)."""
        if not self._keys:
            return 0.0
        have = words(self.decode(prompt))
        return max(sum(w for word, w in weights.items() if word in have) / total for weights, total in self._keys)

    def routes(self, prompt: list[int]) -> bool:
        return bool(self._keys) and self.score(prompt) >= self.threshold
