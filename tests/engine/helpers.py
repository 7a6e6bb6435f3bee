"""Helpers for the engine tests: a one-character-per-token tokenizer for the tiny models, random prompts.

The tokenizer maps each of the tiny model's 256 ids to one printable character, so any id sequence decodes to
valid text (no half-characters) and stop strings can be picked straight out of a generation.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models
from transformers import PreTrainedTokenizerFast

from alchemist.engine import LLMEngine, RequestOutput
from alchemist.model.tokenizer import Tokenizer

# Printable ASCII then Greek/Coptic/Cyrillic code points: 256 single characters.
CHARS = [chr(c) for c in range(32, 127)] + [chr(c) for c in range(0x391, 0x391 + 161)]
DEFAULT_EOS_ID = 5


def char_tokenizer(eos_id: int = DEFAULT_EOS_ID) -> Tokenizer:
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.decoder = decoders.Fuse()
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=CHARS[eos_id]))


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_to_end(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Steps until nothing is left; every output, grouped by request id."""
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs
