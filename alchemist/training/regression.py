"""Watching what serves: a version its users rate clearly worse than what served before it is rolled back.

The evaluation gate (``alchemist.training.evaluation``) judges a version before it serves, on fixed sets; how its
users find it shows only afterwards. Every feedback entry keeps the adapter version that served its response, so
the thumbs each version earned are known. Versions follow each other quickly (one a batch), so no single version
gathers many ratings: the watch compares, for each version ``v`` served since the last rollback, the ratings of
``v`` and everything after it against those of the versions before it. Where the later ones' thumbs-down rate is
higher by at least ``margin`` and by a one-sided two-proportion z-test at ``z`` (both sides holding at least
``min_ratings``), serving goes back to the version just before ``v``; the first such ``v`` is taken, so the rollback
goes back as far as the evidence says. One named API key counts for at most ``per_key`` of a version's ratings
(``ratings_by_version``), so that one user cannot decide alone how a version is judged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from alchemist.config.training import RollbackConfig


@dataclass(frozen=True)
class Regression:
    since: int  # the first version of the worse run
    target: int  # the version to serve again (0: the base model)
    reason: str

    @property
    def metrics(self) -> dict:
        """What the version that serves ``target`` again keeps about why."""
        return {"rollback_of": self.target, "regression": self.reason}


def find_regression(
    lineage: list[int], ratings: dict[int, tuple[int, int]], bounds: RollbackConfig
) -> Regression | None:
    """The first version of ``lineage`` (versions served one after another, oldest first) from which on users
    rated clearly worse than before it, or None. ``ratings``: version -> (thumbs up, thumbs down); ``bounds``:
    ``min_ratings`` on each side of the comparison (0 disables the watch), the thumbs-down rate higher by at least
    ``margin``, by a one-sided z-test at ``z``."""
    if bounds.min_ratings <= 0:
        return None
    counts = [ratings.get(v, (0, 0)) for v in lineage]
    for i in range(1, len(lineage)):
        before_up, before_down = map(sum, zip(*counts[:i], strict=True))
        after_up, after_down = map(sum, zip(*counts[i:], strict=True))
        n0, n1 = before_up + before_down, after_up + after_down
        if min(n0, n1) < bounds.min_ratings:
            continue
        p0, p1 = before_down / n0, after_down / n1
        if p1 - p0 >= bounds.margin and _z(before_down, n0, after_down, n1) >= bounds.z:
            reason = (
                f"users rated versions {lineage[i]}..{lineage[-1]} worse than {lineage[0]}..{lineage[i - 1]}: "
                f"thumbs down {p1:.0%} of {n1} ratings against {p0:.0%} of {n0}"
            )
            return Regression(since=lineage[i], target=lineage[i - 1], reason=reason)
    return None


def ratings_by_version(
    ratings: dict[tuple[int, str | None], tuple[int, int]], per_key: int | None = None
) -> dict[int, tuple[int, int]]:
    """(thumbs up, thumbs down) the responses of each adapter version earned, from the log's ``ratings()`` (per
    version and key). One named key counts for at most ``per_key`` of a version's ratings (its own split kept);
    entries without a key (a server without keys is loopback-only) count in full."""
    totals: dict[int, tuple[int, int]] = {}
    for (version, key), (up, down) in ratings.items():
        if key is not None and per_key is not None and up + down > per_key:
            up = round(up * per_key / (up + down))
            up, down = up, per_key - up
        before = totals.get(version, (0, 0))
        totals[version] = (before[0] + up, before[1] + down)
    return totals


def _z(down0: int, n0: int, down1: int, n1: int) -> float:
    """The two-proportion z statistic of (down1 / n1) - (down0 / n0), pooled variance."""
    pooled = (down0 + down1) / (n0 + n1)
    spread = math.sqrt(pooled * (1 - pooled) * (1 / n0 + 1 / n1))
    return math.inf if spread == 0 else (down1 / n1 - down0 / n0) / spread
