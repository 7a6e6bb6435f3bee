"""The step cost estimate (``StepCost``) on given step times: per decode row, per prefill token, and what fits."""

from __future__ import annotations

import pytest

from alchemist.engine.step_cost import DECAY, StepCost


def learned() -> StepCost:
    cost = StepCost()
    cost.observe(num_decodes=8, num_prefill_tokens=0, seconds=0.024)  # 3 ms a row
    cost.observe(num_decodes=0, num_prefill_tokens=512, seconds=0.4)  # 0.78125 ms a token
    return cost


def test_nothing_is_estimated_before_it_was_seen():
    cost = StepCost()
    assert cost.decode_row_s is None and cost.prefill_token_s is None
    assert cost.estimate(1, 0) is None and cost.estimate(0, 1) is None and cost.estimate(0, 0) == 0.0
    assert cost.prefill_tokens_within(0.05, num_decodes=2) is None  # no cap without a token rate
    cost.observe(0, 100, 0.1)
    assert cost.estimate(0, 10) == pytest.approx(0.01) and cost.estimate(2, 10) is None
    assert cost.prefill_tokens_within(0.05, num_decodes=2) == 50  # rows not yet seen count as free


def test_rates_and_estimates_from_given_steps():
    cost = learned()
    assert cost.decode_row_s == pytest.approx(0.003) and cost.prefill_token_s == pytest.approx(0.4 / 512)
    assert cost.estimate(4, 100) == pytest.approx(4 * 0.003 + 100 * 0.4 / 512)
    assert cost.prefill_tokens_within(0.03, num_decodes=4) == 23  # (30 - 12 ms) / 0.78125 ms = 23.04
    assert cost.prefill_tokens_within(0.01, num_decodes=4) == 0  # the decodes alone take longer


def test_a_mixed_step_teaches_the_token_rate_what_its_decodes_leave():
    cost = learned()
    cost.observe(num_decodes=4, num_prefill_tokens=100, seconds=4 * 0.003 + 0.1)  # 1 ms a token beside 4 decodes
    expected = (DECAY * 0.4 + 0.1) / (DECAY * 512 + 100)  # seconds and tokens averaged alike
    assert cost.prefill_token_s == pytest.approx(expected)
    assert cost.decode_row_s == pytest.approx(0.003)  # only decode-only steps teach the row rate


def test_a_small_step_hardly_moves_the_token_rate_and_recent_steps_weigh_more():
    cost = learned()
    cost.observe(0, 2, 0.01)  # 5 ms a token, over 2 tokens
    assert cost.prefill_token_s == pytest.approx(0.4 / 512, rel=0.03)
    for _ in range(60):  # the batch grew: 12 rows at 2.5 ms each
        cost.observe(12, 0, 0.030)
    assert cost.decode_row_s == pytest.approx(0.0025, rel=0.01)
