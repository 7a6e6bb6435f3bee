"""The regression watch's decision (alchemist.training.regression) and the ratings it reads from a real SQLite log;
tests/training/test_online.py has the trainer rolling back on it."""

from __future__ import annotations

import math

import pytest

from alchemist.config.training import RollbackConfig
from alchemist.feedback.sqlite_log import SQLiteFeedbackLog
from alchemist.training.regression import find_regression, ratings_by_version

BOUNDS = RollbackConfig(min_ratings=30, margin=0.15, z=3.0)


def test_worse_ratings_from_a_version_on_roll_back_to_the_one_before():
    # 10 of 50 down before version 3, 25 of 50 from it on: +30 points, z = 0.3 / sqrt(.35 * .65 * (2 / 50)) = 3.14.
    ratings = {0: (20, 5), 2: (20, 5), 3: (10, 10), 5: (15, 15)}
    found = find_regression([0, 2, 3, 5], ratings, BOUNDS)
    assert (found.since, found.target) == (3, 2)
    assert "thumbs down 50% of 50 ratings against 20% of 50" in found.reason
    z = 0.3 / math.sqrt(0.35 * 0.65 * (1 / 50 + 1 / 50))
    assert 3.0 < z < 3.2  # just past the bound: with three fewer "down" after (22 of 47: z = 2.8) it must not fire
    assert find_regression([0, 2, 3, 5], ratings | {5: (15, 12)}, BOUNDS) is None


@pytest.mark.parametrize(
    ("ratings", "why"),
    [
        ({0: (20, 5), 2: (20, 5), 3: (10, 10), 5: (15, 12)}, "z below its bound"),
        ({0: (20, 5), 2: (20, 5), 3: (10, 10), 5: (5, 4)}, "too few ratings after"),
        ({0: (240, 60), 3: (2340, 660)}, "significant but under the margin"),
        ({0: (20, 20), 3: (20, 20)}, "no worse"),
    ],
)
def test_no_rollback_without_clear_evidence(ratings, why):
    assert find_regression(sorted(ratings), ratings, BOUNDS) is None, why


def test_the_first_worse_version_is_the_one_rolled_back_past_and_zero_disables():
    ratings = {0: (60, 0), 1: (30, 30), 2: (0, 60)}  # worse from 1 on, and worse again from 2 on
    assert find_regression([0, 1, 2], ratings, BOUNDS).target == 0
    assert find_regression([0, 1, 2], ratings, RollbackConfig(min_ratings=0)) is None
    assert find_regression([7], ratings, BOUNDS) is None  # nothing before the first version to compare with


def test_ratings_by_version_cap_one_keys_share(tmp_path):
    log = SQLiteFeedbackLog(tmp_path / "feedback.sqlite")

    def rate(n: int, rating: int, version: int, key: str | None) -> None:
        for _ in range(n):
            log.append(response_id=f"r{len(log.read(limit=10**6))}", kind="sft" if rating > 0 else "negative",
                       rating=rating, prompt_token_ids=[1], response_token_ids=[2], output_token_ids=[2],
                       adapter_version=version, recorded=False, key_name=key)  # fmt: skip

    rate(3, 1, 0, "alice")
    rate(40, -1, 1, "mallory")  # one key floods version 1 with thumbs down
    rate(2, -1, 1, "alice")
    rate(1, 1, 1, "alice")
    rate(5, -1, 1, None)  # no key (a server without keys): counted in full
    log.append(response_id="c", kind="sft", correction="fixed", prompt_token_ids=[1], response_token_ids=[2],
               output_token_ids=[2], adapter_version=1, recorded=False)  # fmt: skip  # no rating: not counted
    ratings = log.ratings()  # per version and key: the cap is the watch's, over what the log counts
    assert ratings == {(0, "alice"): (3, 0), (1, "mallory"): (0, 40), (1, "alice"): (1, 2), (1, None): (0, 5)}
    assert ratings_by_version(ratings) == {0: (3, 0), 1: (1, 47)}
    assert ratings_by_version(ratings, per_key=15) == {0: (3, 0), 1: (1, 15 + 2 + 5)}
    mixed = ratings_by_version(ratings, per_key=2)
    assert mixed == {0: (2, 0), 1: (0 + 1, 2 + 1 + 5)}  # alice's 1 up / 2 down scaled to 2: her split kept
