"""Runs one scheduled batch through the model: the flattened inputs, the forward, the logits of sampling rows.

The batch is laid out as the model expects it (``alchemist.model.attention``): all scheduled tokens end to end,
one ``Segment`` per sequence (a decode token or a prefill chunk) pointing at the sequence's cache slot. The LM
head runs only on rows whose next token is wanted (the last token of each sequence that has now computed all its
tokens): on a 512-token prefill chunk that is one row of 49152 logits instead of 512.

The runner owns the KV cache storage: ``max_num_seqs`` slots of ``max_model_len`` tokens, contiguous per slot.
It also holds the LoRA adapters being served (``ServedAdapter``s): the shared one (None for the base model), and
others by name (``named``); each sequence names the one serving it (``alchemist.engine.sequence``). A step whose
rows all have the same adapter runs as with that adapter alone: a forward that records adds its delta after the
seam's base linear (``Llama.project``), so the records hold base outputs; every other forward (every decode) of
the shared adapter projects with it merged into the weights (``MergedLinearOps``), once the merge, one layer per
step after a swap, is complete. Only the shared adapter is merged (a merge is a copy of the targeted projections);
a named adapter adds its delta. A step whose rows have several adapters (the base model counted as one) projects
with the base weights and adds each adapter's delta on its own rows, grouped (``alchemist.engine.adapter_groups``).
"""

from __future__ import annotations

import torch

from alchemist.activations.recorder import Chunk, Recorder
from alchemist.config import EngineConfig
from alchemist.engine.adapter_groups import GroupedRows
from alchemist.engine.adapter_slots import AdapterSlots
from alchemist.engine.compiled_decode import CompiledDecode
from alchemist.engine.merged_adapter import MergedLinearOps
from alchemist.engine.packed_ops import PackedLinearOps, pack, packed_linear, packed_linear_supported
from alchemist.engine.scheduler import ScheduledBatch
from alchemist.engine.sequence import BASE, Sequence
from alchemist.engine.served_adapter import AnswerRows, RowScope, ServedAdapter
from alchemist.model.attention import AttentionMetadata, KVCache, Segment, decode_kernel_applies
from alchemist.model.llama import Adapter, Llama, rms_norm
from alchemist.model.seam import COMPUTE, Ops


class ModelRunner:
    def __init__(self, model: Llama, config: EngineConfig, recorder: Recorder | None = None) -> None:
        assert config.max_model_len is not None, "pass a resolved EngineConfig"
        self.model = model
        self.config = config
        self.recorder = recorder
        self.adapter: ServedAdapter | None = None  # the adapter served (None: the base model), as a delta
        self.merged: MergedLinearOps | None = None  # the same adapter merged into the weights, layer by layer
        self.adapter_version = 0  # of the adapter serving now (0: none); records and outputs carry it
        self.named: dict[str, tuple[ServedAdapter, int]] = {}  # the adapters served by name, with their versions
        self.num_merged_steps = 0  # forwards that projected with the merged weights (tests, profiles)
        self.num_mixed_steps = 0  # forwards whose rows had several adapters (tests, profiles)
        # the adapters of such steps, stacked for their grouped deltas (copied in at their first such step)
        self.slots = AdapterSlots(model.config, model.dtype, model.device)
        c = model.config
        self.cache = KVCache(
            c.num_layers,
            config.max_num_seqs,
            config.max_model_len,
            c.num_kv_heads,
            c.head_dim,
            model.dtype,
            model.device,
        )
        # Our CPU decode-attention kernel is built (first start) or loaded here, before serving starts, in the thread
        # that steps (alchemist.model.cpu_kernels).
        decode_kernel_applies(self.cache.k[0])
        # The base ops: oneDNN-packed bf16 linears where they apply (same outputs, faster), else plain compute.
        self.ops: Ops = COMPUTE
        self._packed_lm_head: torch.Tensor | None = None
        self._packed = packed_linear_supported(model)
        if self._packed:
            self.ops = PackedLinearOps(model)
            self._packed_lm_head = pack(model.lm_head)
        # All-decode batches that record nothing run the compiled layer where it applies; it compiles here, before
        # serving starts, in the thread that steps.
        self.compiled = CompiledDecode.create_warm(model, self.cache, config.compile_decode, self._packed, self.ops)

    def describe_decode(self) -> str:
        """How decode steps run, for the server's start-up line."""
        if self.compiled is None:
            return "decode steps run eager"
        return f"decode steps run compiled (torch.compile; warm-up {self.compiled.warm_up_s:.1f} s)"

    def set_adapter(self, adapter: ServedAdapter | None, version: int, merged: MergedLinearOps | None = None) -> None:
        """Serves ``adapter`` from the next forward on (the engine calls it between steps only), with ``merged``,
        its merge made beforehand (``new_merge``), or else a merge that starts over, a layer per step."""
        self.adapter = adapter
        self.adapter_version = version
        self.merged = merged if merged is not None or adapter is None else self.new_merge(adapter)

    def set_named(self, name: str, adapter: ServedAdapter | None, version: int = 0) -> None:
        """Serves ``adapter`` as ``version`` under ``name`` from the next forward on (None: takes ``name`` away, once
        no sequence names it); the engine calls it between steps only."""
        if adapter is None:
            del self.named[name]
        else:
            self.named[name] = (adapter, version)

    def served(self, name: str | None) -> ServedAdapter | None:
        """The adapter serving the sequences that name ``name`` (None: the base model)."""
        if name is None:
            return self.adapter
        return None if name == BASE else self.named[name][0]

    def version_of(self, name: str | None) -> int:
        """The version of the adapter serving the sequences that name ``name`` (0: the base model)."""
        if name is None:
            return self.adapter_version
        return 0 if name == BASE else self.named[name][1]

    def new_merge(self, adapter: ServedAdapter) -> MergedLinearOps | None:
        """A merge of ``adapter`` into this runner's base weights, none of its layers merged yet (None if the
        config turns merging off)."""
        if not self.config.merge_adapter:
            return None
        return MergedLinearOps(self.model, adapter, self.ops, self._packed)

    def ops_for(self, batch: ScheduledBatch, meta: AttentionMetadata) -> Ops:
        """The ops object for this batch's forward: recording ops when a prompt chunk of a recorded request is in
        the batch (they see every projection and attention output, per layer, and slice each recorded request's
        rows out of the batch by its segment), else plain compute. Decode rows are never recorded."""
        if self.recorder is None:
            return self.ops
        chunks = [
            Chunk(seq.request_id, seq.prompt_token_ids, seq.record, seq.params.record, seq.adapter_name,
                  self.version_of(seq.adapter_name))
            for seq in batch.seqs
        ]  # fmt: skip
        return self.recorder.ops_for(meta, chunks, self.ops)

    @torch.inference_mode()
    def copy_prefixes(self, batch: ScheduledBatch) -> None:
        """The batch's prefix-cache copies, in order, before its forward (the stepping thread calls it): each a
        cached prefix held in another sequence's slot, which only appends, so the prefix is stable."""
        for src, dst, num_tokens in batch.prefix_copies:
            self.cache.copy_prefix(src, dst, num_tokens)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Computes the batch, writing its keys/values into the cache.

        Returns the logits ``(S, vocab)`` of the S sequences that sample this step, and those sequences in row
        order. A prefill chunk that does not finish its prompt samples nothing.
        """
        ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        sample_rows: list[int] = []
        sampling: list[Sequence] = []
        for seq, num in zip(batch.seqs, batch.num_tokens, strict=True):
            start = seq.num_computed_tokens
            assert seq.slot is not None
            ids.extend(seq.chunk(num))
            positions.extend(range(start, start + num))
            segments.append(Segment(slot=seq.slot, start=start, length=num))
            if start + num == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sampling.append(seq)
        device = self.model.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)  # (T,)
        pos = torch.tensor(positions, dtype=torch.long, device=device)  # (T,)
        meta = AttentionMetadata(segments, cache=self.cache)
        ops = self.ops_for(batch, meta)
        served = [self.served(seq.adapter_name) for seq in batch.seqs]
        # Rows of several adapters: the base weights and each adapter's delta on its rows, grouped where that pays.
        if any(a is not served[0] for a in served):
            live = {a for a in (self.adapter, *(a for a, _ in self.named.values())) if a is not None}
            answer = self.answer_rows(batch)
            adapter: Adapter | None = GroupedRows.of(self.slots, served, batch.num_tokens, answer, live, device)
            self.num_mixed_steps += 1
        else:
            ops, adapter = self.one_adapter(batch, served[0], ops, len(ids))
        # Decodes of several adapters, all grouped, run compiled too, the grouped deltas in the layer's graph.
        grouped = adapter if isinstance(adapter, GroupedRows) and adapter.compilable and meta.all_decode else None
        compiled = self.compiled is not None and ops in (self.ops, self.merged)  # records nothing
        if compiled and (adapter is None or grouped is not None):
            if meta.all_decode:
                slots = torch.tensor([seg.slot for seg in segments], dtype=torch.long, device=device)  # (T,)
                hidden = self.compiled.forward(input_ids, pos, slots, meta.max_position, ops, grouped)
            else:
                hidden = self.compiled.forward_step(input_ids, pos, meta, ops)
        else:
            hidden = self.model(input_ids, pos, meta, ops, adapter)  # (T, d)
        if self.recorder is not None:
            self.recorder.after_forward(ops)
        if self.merged is not None:
            self.merged.merge_next()  # a layer per step after a swap, until complete
        if len(sample_rows) != len(ids):
            hidden = hidden[torch.tensor(sample_rows, dtype=torch.long, device=device)]  # (S, d)
        return self.logits(hidden), sampling

    def one_adapter(
        self, batch: ScheduledBatch, served: ServedAdapter | None, ops: Ops, num_rows: int
    ) -> tuple[Ops, Adapter | None]:
        """The ops and adapter of a forward whose every row ``served`` serves (None: the base model), ``ops`` being
        the base or recording ones: the shared adapter's merge where it is complete and nothing records, else its
        delta."""
        merged = self.merged if served is self.adapter else None
        # the corrections' ranks act on the answer rows of routed requests only (found in Python: no device sync)
        answer = self.answer_rows(batch) if served is not None and served.cut else None
        if ops is self.ops and merged is not None and merged.complete:  # nothing records: merged weights
            self.num_merged_steps += 1
            if answer:  # the merge leaves the corrections' ranks out: their delta on these rows alone
                rows = torch.tensor(answer, dtype=torch.long, device=self.model.device)
                return merged, AnswerRows(served, rows)  # type: ignore[arg-type]
            return merged, None
        if answer is not None:
            return ops, RowScope(served, answer, num_rows)  # type: ignore[arg-type]
        return ops, served

    @staticmethod
    def answer_rows(batch: ScheduledBatch) -> list[int]:
        """The batch's rows the cut ranks act on: a routed request's from its last prompt token on
        (``alchemist.training.rank_split``: every other row is the same routed or not)."""
        rows: list[int] = []
        row = 0
        for seq, num in zip(batch.seqs, batch.num_tokens, strict=True):
            if seq.routed:
                first = max(seq.num_prompt_tokens - 1 - seq.num_computed_tokens, 0)  # within this step's rows
                rows.extend(range(row + first, row + num))
            row += num
        return rows

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``model.logits`` (final norm, LM head), with the packed LM head where the fast path applies."""
        if self._packed_lm_head is None:
            return self.model.logits(hidden)
        normed = rms_norm(hidden, self.model.norm, self.model.config.rms_norm_eps)
        return packed_linear(normed, self._packed_lm_head, None)
