"""Rehearsal: corrections trained before, trained again (SFT) beside each batch, so later batches do not unteach them.

    rehearsal = Rehearsal(log, RehearsalConfig())
    samples = rehearsal.samples(undone)   # before a batch's steps: the next ones in turn

They are taken from the log in turn (the trained corrections after the last one rehearsed, starting over from the
oldest after the last), ``corrections`` at most and ``max_tokens`` rows at most (one longer than that alone is passed
over for good), none that a version a rollback undid trained (``undone``: alchemist.training.lineage). Taught one
after another without it, 1 of the first ten facts was still known after twenty (8 with it; docs/benchmarks.md,
"Learning with the defaults"). They replay from their records while those are fresh, else are recomputed.
"""

from __future__ import annotations

import math

from alchemist.config.training import RehearsalConfig
from alchemist.feedback.log import FeedbackLog
from alchemist.training.taught import taught_corrections
from alchemist.training.trainer import Sample


class Rehearsal:
    def __init__(self, log: FeedbackLog, config: RehearsalConfig) -> None:
        self.log, self.config = log, config
        self.through = 0  # the seq of the last correction rehearsed (or passed over): the next batch's start

    def samples(self, undone: list[list[int]]) -> list[Sample]:
        """The batch's corrections trained before: the next ones of the log, in turn (starting over after the
        last), ``corrections`` at most and ``max_tokens`` rows at most (one longer than that alone is passed over),
        none that a version in ``undone`` (a rollback's [lo, hi] ranges) trained."""
        count, budget = self.config.corrections, self.config.max_tokens or math.inf
        if not count:
            return []
        entries = taught_corrections(self.log, count, undone, self.through)
        if len(entries) < count:  # the end of the log: start over from the oldest (never one twice in a batch)
            seen = {e.seq for e in entries}
            again = taught_corrections(self.log, count - len(entries), undone)
            entries += [e for e in again if e.seq not in seen]
        taken, rows = [], 0
        for entry in entries:
            size = len(entry.prompt_token_ids) + len(entry.response_token_ids) - 1
            if size > budget:
                self.through = entry.seq  # never fits: passed over
                continue
            if rows + size > budget:
                break  # first in line next time
            taken.append(entry)
            rows += size
            self.through = entry.seq
        return [Sample(e.prompt_token_ids, e.response_token_ids, e.response_id) for e in taken]
