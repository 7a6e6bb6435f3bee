"""Helpers for the engine tests: a one-character-per-token tokenizer for the tiny models, random prompts and
adapters, and a plain greedy loop over ``Llama.forward`` as the reference for the engine's outputs.

The tokenizer maps each of the tiny model's 256 ids to one printable character, so any id sequence decodes to
valid text (no half-characters) and stop strings can be picked straight out of a generation.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models
from transformers import PreTrainedTokenizerFast

from alchemist.config import EngineConfig, RecordConfig
from alchemist.engine import LLMEngine, RequestOutput
from alchemist.model.attention import AttentionMetadata, KVCache, Segment
from alchemist.model.llama import Adapter, Llama
from alchemist.model.lora import LoraAdapter
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


def recording_engine(model: Llama, max_num_batched_tokens: int, policy: str = "all", **engine_config) -> LLMEngine:
    """An engine over ``model`` that records by ``policy``, in fp32: 4 slots of 128 tokens unless ``engine_config``
    (EngineConfig fields) says otherwise."""
    sizes = {"max_num_seqs": 4, "max_model_len": 128, **engine_config}
    config = EngineConfig(max_num_batched_tokens=max_num_batched_tokens, **sizes)
    return LLMEngine(model, char_tokenizer(), config, RecordConfig(policy=policy, dtype="float32"))


def random_adapter(model: Llama, seed: int, std: float = 0.05) -> LoraAdapter:
    """A LoRA adapter with random (seeded) non-zero B, so that its delta changes the outputs."""
    adapter = LoraAdapter(model.config, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in adapter.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * std)
    return adapter


@torch.inference_mode()
def greedy_reference(model: Llama, prompt: list[int], num_tokens: int, adapters: list[Adapter | None]) -> list[int]:
    """Greedy tokens from ``Llama.forward`` with a one-slot KV cache: forward i (the prompt, then each token
    sampled) runs with ``adapters[i]`` (the last one repeats), as the engine does when the adapter changes."""
    c = model.config
    cache = KVCache(c.num_layers, 1, len(prompt) + num_tokens, c.num_kv_heads, c.head_dim, model.dtype, model.device)
    ids, start, out = list(prompt), 0, []
    for i in range(num_tokens):
        meta = AttentionMetadata([Segment(slot=0, start=start, length=len(ids))], cache=cache)
        positions = torch.arange(start, start + len(ids), device=model.device)
        hidden = model(
            torch.tensor(ids, device=model.device), positions, meta, adapter=adapters[min(i, len(adapters) - 1)]
        )
        out.append(int(model.logits(hidden[-1:]).argmax(-1)))
        start, ids = start + len(ids), [out[-1]]
    return out
