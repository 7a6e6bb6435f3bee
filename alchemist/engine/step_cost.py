"""StepCost: how long an engine step takes, learned online from the steps measured.

    cost = StepCost()
    cost.observe(num_decodes=8, num_prefill_tokens=0, seconds=0.024)      # after each step (LLMEngine.step)
    cost.observe(num_decodes=0, num_prefill_tokens=512, seconds=0.40)
    cost.estimate(4, 100)                                                # 4 x 3 ms + 100 x 0.78 ms
    cost.prefill_tokens_within(0.030, num_decodes=4)                     # what a step beside 4 decodes may prefill

A step is modelled as ``num_decodes x decode_row_s + num_prefill_tokens x prefill_token_s``. Each rate is a ratio of
two exponential averages, of seconds and of rows (or tokens), so a step weighs by its size: a step of a few prefill
tokens hardly moves the per-token rate. Decode-only steps teach the row rate; a step with prefill tokens teaches the
token rate from what is left of its time once its decodes' estimate is taken off. A row's rate is that of the batch
sizes seen lately (a decode step's fixed cost, reading the weights, is shared by its rows): serving's batch changes
slowly, and decode-only steps come often enough under load to follow it.
"""

from __future__ import annotations

DECAY = 0.9  # each step's weight in the averages fades by this per step of its kind (about ten steps' memory)


class _Rate:
    """Seconds per unit: the ratio of exponentially decayed sums of seconds and units."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.units = 0.0

    def add(self, seconds: float, units: int) -> None:
        self.seconds = DECAY * self.seconds + seconds
        self.units = DECAY * self.units + units

    @property
    def value(self) -> float | None:
        return max(self.seconds, 0.0) / self.units if self.units > 0 else None


class StepCost:
    def __init__(self) -> None:
        self._row = _Rate()  # seconds per decode row
        self._token = _Rate()  # seconds per prefill token

    @property
    def decode_row_s(self) -> float | None:
        """Seconds a step spends per decode row (None before a decode-only step was seen)."""
        return self._row.value

    @property
    def prefill_token_s(self) -> float | None:
        """Seconds a step spends per prefill token (None before a step with prefill tokens was seen)."""
        return self._token.value

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """A step of ``num_decodes`` decode rows and ``num_prefill_tokens`` prompt tokens took ``seconds``."""
        if num_prefill_tokens == 0:
            if num_decodes > 0:
                self._row.add(seconds, num_decodes)
            return
        self._token.add(seconds - num_decodes * (self.decode_row_s or 0.0), num_prefill_tokens)

    def estimate(self, num_decodes: int, num_prefill_tokens: int) -> float | None:
        """The seconds such a step should take (None while a rate it needs is unknown)."""
        row_s, token_s = self.decode_row_s, self.prefill_token_s
        if (num_decodes and row_s is None) or (num_prefill_tokens and token_s is None):
            return None
        return num_decodes * (row_s or 0.0) + num_prefill_tokens * (token_s or 0.0)

    def prefill_tokens_within(self, seconds: float, num_decodes: int) -> int | None:
        """The most prefill tokens a step beside ``num_decodes`` decodes may take and still last at most ``seconds``
        (0 if the decodes alone take that long; None while the token rate is unknown)."""
        token_s = self.prefill_token_s
        if token_s is None:
            return None
        left_s = seconds - num_decodes * (self.decode_row_s or 0.0)
        if left_s <= 0:
            return 0
        return int(left_s / token_s) if token_s > 0 else None
