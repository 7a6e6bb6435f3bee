"""When a batch's steps end: after ``epochs`` steps at most; sooner once its corrections are learned, or when
corrections queued behind it have waited long enough.

    stopping = Stopping(StoppingConfig(), log, trainer, group_size=4)
    stopping.reached_target(samples, step.passes) and (yield from stopping.learned_slices(samples))
    stopping.yields(batch_seqs)

Learned: every correction's loss in the step (mean per token, before its update) under ``target_loss``, and then
each of its tokens likelier than ``target_token_p`` under the adapter as updated (a pass without gradient): under
the mean loss alone, batches stopped with a wrong name or year left (docs/benchmarks.md, "Learning a correction
with the defaults"). Yielding: under a load of corrections every batch still trains and the backlog does not grow
by ``epochs`` steps a batch (docs/benchmarks.md, "Online loop"); what such a batch did not learn yet goes on in the
next one (``learned_each_slices``; alchemist.training.online).
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator
from functools import partial

from alchemist.config.training import StoppingConfig
from alchemist.feedback.log import FeedbackLog
from alchemist.training.losses import least_token_logp
from alchemist.training.recompute import response_values_slices
from alchemist.training.trainer import Sample, Trainer


class Stopping:
    def __init__(self, config: StoppingConfig, log: FeedbackLog, trainer: Trainer, group_size: int) -> None:
        self.config, self.log, self.trainer, self.group_size = config, log, trainer, group_size

    def reached_target(self, samples: list[Sample], results: list[tuple[float, bool]]) -> bool:
        """Whether the batch's steps may end here: every correction's loss in this step (before its update) was
        under ``target_loss`` (with no target, never: all ``epochs`` steps run)."""
        target = self.config.target_loss
        return bool(target) and all(loss < target for s, (loss, _) in zip(samples, results, strict=False)
                                    if s.term is None)  # fmt: skip

    def learned_slices(self, samples: list[Sample]) -> Generator[None, None, bool]:
        """Whether the adapter as updated now says each of the batch's corrections (and thumbs-up answers) itself:
        every token likelier than ``target_token_p`` given those before it, a pass without gradient over them
        (``target_token_p`` 0: true). Asked once their mean losses are under ``target_loss``, which a correction
        with a wrong name or year left passed the same."""
        return all((yield from self._says_slices(samples)))

    def learned_each_slices(
        self, samples: list[Sample], results: list[tuple[float, bool]]
    ) -> Generator[None, None, list[bool]]:
        """For each of ``samples`` without a preference term (corrections, thumbs-up answers), in their order,
        whether it is learned by this step's test, one at a time: its loss in the step (``results``, before the
        update) under ``target_loss``, then ``learned_slices``' test (one pass over those under the loss)."""
        target = self.config.target_loss
        sft = [(s, loss) for s, (loss, _) in zip(samples, results, strict=False) if s.term is None]
        near = [i for i, (_, loss) in enumerate(sft) if target and loss < target]
        said = yield from self._says_slices([sft[i][0] for i in near])
        learned = [False] * len(sft)
        for i, ok in zip(near, said, strict=True):
            learned[i] = ok
        return learned

    def _says_slices(self, samples: list[Sample]) -> Generator[None, None, list[bool]]:
        """For each of ``samples`` without a preference term, whether the adapter as updated gives every one of its
        tokens more than ``target_token_p`` (all true where that is 0)."""
        p = self.config.target_token_p
        sft = [(s.prompt_ids, s.response_ids) for s in samples if s.term is None]
        if not p or not sft:
            return [True] * len(sft)
        model = self.trainer.model
        least = yield from response_values_slices(model, self.trainer.adapter, sft, partial(least_token_logp, model),
                                                  self.group_size)  # fmt: skip
        self.trainer.stats.learned_checks += 1
        return [value > math.log(p) for value in least]

    def yields(self, batch_seqs: list[int]) -> bool:
        """Whether the batch's further steps yield to the backlog: a correction queued behind it has waited
        ``yield_after_s`` (the batch's own entries, ``batch_seqs``, are still queued too: not counted)."""
        after_s = self.config.yield_after_s
        if not after_s:
            return False
        oldest = self.log.oldest_queued("correction", excluding=batch_seqs)
        return oldest is not None and time.time() - oldest >= after_s
