"""The scale section: how many replicas serve and train together, and the Ray cluster they run on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from alchemist.config.fields import check, check_positive_ints, flag, run_checks


@dataclass
class ScaleConfig:
    """Replicas (``alchemist.scale``): each a complete server (engine, recorder, store, trainer) in a Ray actor,
    behind one HTTP front on the server's port. One replica (the default) runs in this process, without Ray."""

    replicas: Annotated[int, flag("replicas", "replicas that serve and train together, behind one front (more than "
                                  "one: Ray actors, and a PostgreSQL --feedback-db)")] = 1  # fmt: skip
    ray_address: Annotated[str | None, flag("ray-address", "the Ray cluster to join (None: start a local one)")] = None

    def __post_init__(self) -> None:
        run_checks(self)

    def check(self) -> None:
        check_positive_ints(self, "replicas")
        if self.ray_address is not None:
            check(self, bool(self.ray_address.strip()), "ray_address", "must not be empty (None: a local cluster)")
