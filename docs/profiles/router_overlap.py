"""Profile (not a test): could a router keep taught corrections away from unrelated requests? Tokenizer only.

    PYTHONPATH=. python docs/profiles/router_overlap.py [--facts 50] [--unrelated 200]

The question behind it: unrelated greedy answers stay unchanged for 7 of 30 after ten facts are taught (goal 24),
because most greedy answers hold a near tie that any global change of the weights can flip
(docs/profiles/greedy_margins.py). A router would serve the taught adapter only to requests that resemble a taught
correction's prompt, as model-editing methods with a scope do (GRACE, WISE). The simplest such router looks at the
prompt's tokens alone, before any forward: a taught prompt's informative tokens (IDF over ShareGPT first turns) that
the request shares, as a share of that prompt's; route when some taught prompt's share reaches a threshold.

Prints, per threshold, the share of each set that would be routed: the taught questions themselves (must be all),
hand-written paraphrases of the ten bench facts (should be most), and what must not be: ShareGPT first turns
(`bench learn`'s unrelated prompts are of these), the gate's canaries and the known-fact anchors (well-known facts
in the same templates as the taught ones).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter

from alchemist.bench.facts import FACT_PARAPHRASES as PARAPHRASES
from alchemist.bench.facts import FACTS, invented_facts
from alchemist.bench.learn import sharegpt_questions
from alchemist.bench.sharegpt import sample_requests
from alchemist.model.loader import hf_dir_for
from alchemist.model.tokenizer import Tokenizer
from alchemist.training.anchors import KNOWN_FACTS_FILE
from alchemist.training.evaluation import CANARIES


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--facts", type=int, default=50, help="invented facts taught beside the ten bench facts")
    ap.add_argument("--unrelated", type=int, default=200, help="ShareGPT first turns that must not be routed")
    args = ap.parse_args()
    tok = Tokenizer.from_pretrained(hf_dir_for(None))
    corpus = sample_requests(3000, seed=5, mode="first_turn", tokenizer=tok, max_prompt_tokens=512)
    df = Counter(t for s in corpus for t in set(tok.encode(s.messages[0]["content"])))
    idf = lambda t: math.log((len(corpus) + 1) / (df[t] + 1))  # noqa: E731

    def tokens(text: str) -> set[int]:
        return set(tok.encode(text))

    taught = [tokens(q) for q, _, _ in FACTS + invented_facts(args.facts, seed=0)]

    def score(text: str) -> float:
        request = tokens(text)
        return max(sum(idf(t) for t in keys & request) / sum(idf(t) for t in keys) for keys in taught)

    known = [f["user"] for f in json.loads(KNOWN_FACTS_FILE.read_text())]
    sets = {
        "taught questions": [q for q, _, _ in FACTS + invented_facts(args.facts, seed=0)],
        "paraphrases of the ten": PARAPHRASES,
        "ShareGPT first turns": sharegpt_questions(tok, args.unrelated, seed=23, exclude=set()),
        "gate canaries": [q for q, _, _ in CANARIES],
        "known-fact anchors": known,
    }
    scores = {name: [score(q) for q in qs] for name, qs in sets.items()}
    print(json.dumps({"facts_taught": len(taught), **{name: len(qs) for name, qs in sets.items()}}))
    for threshold in (0.3, 0.4, 0.5, 0.6, 0.7):
        row = {name: round(sum(s >= threshold for s in ss) / len(ss), 3) for name, ss in scores.items()}
        print(json.dumps({"threshold": threshold, **row}))
    for name, ss in scores.items():
        print(json.dumps({"set": name, "max": round(max(ss), 3), "min": round(min(ss), 3)}))


if __name__ == "__main__":
    main()
