"""The preference objectives' passes without gradient, replayed where a record gives their values, else recomputed:
sequence log-probabilities of (prompt, response) pairs under the base model (KTO's and DPO's reference) or under
the adapter as it is (KTO's reference point z0, before every step).

    ref = yield from sequence_logps_slices(trainer, passes, "reference")  # the base model's
    kl = yield from sequence_logps_slices(trainer, kl_pairs, "kl")        # the adapter's

A pass replays as a gradient pass's live forward does (``replay.replay_logps_slices``): its response rows run on
top of the prompt rebuilt from the prompt's record, without autograd and without a walk, so a pass costs its R
response rows through the layers instead of P + R. Whether a record may serve a pass is the trainer's rule
(``Trainer.pinned_record``): under the adapter, a record made at most ``max_staleness`` versions ago, as for a
gradient pass; under the base model, only a record the base model made (version 0), since a record's layer inputs
are those of the adapter that served it. KTO's mismatched pair (prompt j, the completion of another item) replays
from prompt j's record, the other completion as its live rows. Records are pinned while used; a record that goes
bad mid-read (``RecordUnavailable``) has its group recomputed, counted ``unreadable``. Every pass is counted by kind
and path in the trainer's ``TrainingStats`` (``reference_replayed``, ``kl_recomputed``, ...).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from alchemist.activations.record import Record
from alchemist.activations.store import RecordUnavailable
from alchemist.model.lora import LoraAdapter
from alchemist.training.recompute import sequence_logps_slices as recomputed_logps_slices
from alchemist.training.record_reader import RecordReader
from alchemist.training.replay import ReplaySample, replay_logps_slices
from alchemist.training.trainer import Trainer

Kind = Literal["reference", "kl"]  # the base model's log-probabilities; the adapter's, of KTO's mismatched pairs


@dataclass(frozen=True)
class LogpPass:
    """log p(response | prompt) wanted; ``record_id`` names the prompt's record, if one was made."""

    prompt_ids: list[int]
    response_ids: list[int]
    record_id: str | None = None


def sequence_logps_slices(
    trainer: Trainer, passes: Sequence[LogpPass], kind: Kind, group_size: int = 4
) -> Generator[None, None, list[float]]:
    """log p(response | prompt) of each pass under the base model ("reference") or the trainer's adapter ("kl"),
    no gradient: those with a usable record replayed, ``group_size`` per live forward, the others recomputed as
    many per forward; in slices of one layer. Both are a preference objective's (KTO's reference point), out of
    the corrections' ranks' scope where those are cut (``RankSplit``)."""
    base = kind == "reference"
    adapter = None if base else trainer.adapter
    pinned = {i: found for i, p in enumerate(passes)
              if isinstance(found := trainer.pinned_record(p.record_id, p.prompt_ids, base), Record)}  # fmt: skip
    logps: dict[int, float] = {}
    try:
        replayable = list(pinned)
        for start in range(0, len(replayable), group_size):
            group = {i: (passes[i], pinned[i]) for i in replayable[start : start + group_size]}
            logps |= yield from _replayed_slices(trainer, adapter, group)
            for i in group:
                trainer.store.release(pinned.pop(i).record_id)  # type: ignore[union-attr]
    finally:  # also when the batch is abandoned mid-pass (the generator closed)
        for record in pinned.values():
            trainer.store.release(record.record_id)  # type: ignore[union-attr]
    rest = [i for i in range(len(passes)) if i not in logps]
    if rest:
        pairs = [(passes[i].prompt_ids, passes[i].response_ids) for i in rest]
        values = yield from recomputed_logps_slices(trainer.model, adapter, pairs, group_size, in_scope=False)
        logps |= dict(zip(rest, values, strict=True))
    for i in range(len(passes)):
        trainer.stats.count_logp_pass(kind, i not in rest)
    return [logps[i] for i in range(len(passes))]


def _replayed_slices(
    trainer: Trainer, adapter: LoraAdapter | None, group: dict[int, tuple[LogpPass, Record]]
) -> Generator[None, None, dict[int, float]]:
    """The group's log-probabilities by index, replayed together; none if a record went bad mid-read."""
    store, device, readers = trainer.store, trainer.model.device, []
    assert store is not None  # the records are pinned in it
    try:
        samples = []
        for p, record in group.values():
            reader = RecordReader(store, record, trainer.model, trainer.adapter, len(p.prompt_ids) - 1, trainer.costs,
                                  trainer.stats, trainer.config.prefetch_depth, walk=False)  # fmt: skip
            readers.append(reader)
            ids = torch.tensor(p.prompt_ids, device=device), torch.tensor(p.response_ids, device=device)
            samples.append(ReplaySample(*ids, reader.forward_layer))
        values = yield from replay_logps_slices(trainer.model, adapter, samples, in_scope=False)
    except RecordUnavailable:  # a damaged file: its group is recomputed
        trainer.stats.unreadable += 1
        return {}
    finally:
        for reader in readers:
            reader.close()
    return dict(zip(group, values, strict=True))
