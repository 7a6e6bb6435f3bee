"""`alchemist generate`: one chat prompt through the serving engine, streamed to stdout as it decodes."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from alchemist.config import EngineConfig
from alchemist.engine.engine import LLMEngine
from alchemist.engine.sequence import SamplingParams


def generate_text(args: argparse.Namespace) -> Iterator[str]:
    """Yields the answer's text deltas: greedy unless ``args.temperature`` > 0."""
    engine = LLMEngine.from_config(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=1))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    prompt_ids = engine.tokenizer.apply_chat_template(messages)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    engine.add_request("generate", prompt_ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_text:
                yield out.new_text
