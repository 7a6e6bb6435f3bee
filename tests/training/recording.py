"""Test helpers: record a prompt through the model's real prefill path, alone or inside batched chunked prefills."""

from __future__ import annotations

import torch

from alchemist.activations.record import Record, RecordBuilder, RecordingOps
from alchemist.bench.training import record_prefill
from alchemist.model.attention import AttentionMetadata, KVCache, Segment


def record_alone(
    model, adapter, prompt: torch.Tensor, dtype=torch.float32, record_id="r", version=0, keep_outputs=None
) -> Record:
    """``bench.training.record_prefill`` with the tests' defaults (fp32 records)."""
    return record_prefill(model, adapter, prompt, dtype, record_id, version, keep_outputs)


@torch.inference_mode()
def record_batched_chunked(
    model, adapter, prompt: torch.Tensor, others: list[torch.Tensor], chunk: int, dtype=torch.float32
) -> Record:
    """Prefills ``prompt`` in chunks of ``chunk`` tokens, each step batched with the next chunk of every other
    sequence (and decode rows of the others once their prompts are done), in a shared per-slot KV cache."""
    c = model.config
    seqs = [prompt, *others]
    device = model.device
    cache = KVCache(c.num_layers, len(seqs), max(len(s) for s in seqs) + 64, c.num_kv_heads, c.head_dim, model.dtype,
                    device)  # fmt: skip
    builder = RecordBuilder("r", prompt.tolist(), 0, c, dtype, device)
    done = [0] * len(seqs)
    while done[0] < len(prompt):
        segs, ids = [], []
        for slot, seq in enumerate(seqs):
            if done[slot] < len(seq):
                n = min(chunk, len(seq) - done[slot])
                segs.append(Segment(slot=slot, start=done[slot], length=n))
                ids.append(seq[done[slot] : done[slot] + n])
            else:  # a decode row (a random token): rows of other requests must not leak into the record
                segs.append(Segment(slot=slot, start=done[slot], length=1))
                ids.append(torch.randint(0, c.vocab_size, (1,), device=device))
        meta = AttentionMetadata(segs, cache=cache, need_lse=True)
        ops = RecordingOps(meta, {0: builder})
        positions = torch.cat([torch.arange(s.start, s.start + s.length, device=device) for s in segs])
        model(torch.cat(ids), positions, meta, ops=ops, adapter=adapter)
        ops.finish()
        for seg in segs:
            done[seg.slot] = seg.start + seg.length
    return builder.build()
