"""The record section: which prompts' prefill activations are recorded, and the tiered store that keeps them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from alchemist.config.fields import (
    MB,
    check,
    check_choice,
    check_non_negative,
    check_positive,
    choices_of,
    flag,
    run_checks,
)


@dataclass
class RecordConfig:
    """Prefill activation recording and the activation store that keeps the records for training."""

    policy: Annotated[Literal["none", "requested", "sample", "all"], flag("record-policy",
                      "requested: the requests that ask; sample: a fraction too; all; none")] = "requested"  # fmt: skip
    sample_fraction: Annotated[float, flag("record-fraction", "with --record-policy sample")] = 0.0
    # bf16 costs ~1% gradient error; float32 makes replay exact.
    dtype: Annotated[Literal["bfloat16", "float32"], flag("record-dtype", "storage dtype of records")] = "bfloat16"
    # The store's tiers (activations/store.py): records are made in the device tier (GPU memory on CUDA, process
    # memory on CPU) and move down to host memory (pinned on CUDA), then disk, then out, lowest priority first.
    store_budget_bytes: Annotated[int, flag("record-budget-mb", "activation store: the device tier"), MB] = 2 << 30
    host_budget_bytes: Annotated[int, flag("record-host-budget-mb", "the host memory tier (0: none)"), MB] = 4 << 30
    disk_budget_bytes: Annotated[int, flag("record-disk-budget-mb", "the disk tier (0: none)"), MB] = 16 << 30
    disk_dir: Annotated[str | None, flag("record-dir", "the disk tier's files (None: DATA_DIR/activations, "
                                         "cleaned at start-up)")] = None  # fmt: skip
    evict_priority: Annotated[Literal["requested", "lru"], flag("record-evict-priority", "requested: records whose "
                              "request asked rank first, then recency; lru: recency only")] = "requested"  # fmt: skip
    ttl_s: Annotated[float, flag("record-ttl-s", "records older than this are dropped")] = 3600.0

    def __post_init__(self) -> None:
        if self.disk_dir is not None:
            self.disk_dir = str(self.disk_dir)  # a Path is welcome too
        run_checks(self)

    def check(self) -> None:
        check_choice(self, "policy", RECORD_POLICIES)
        check(self, 0.0 <= self.sample_fraction <= 1.0, "sample_fraction", "must be in [0, 1]")
        check_choice(self, "dtype", RECORD_DTYPES)
        check_budgets(self, "store_budget_bytes", "host_budget_bytes", "disk_budget_bytes")
        check(self, self.disk_dir is None or bool(self.disk_dir.strip()), "disk_dir",
              "must not be empty (None: <data_dir>/activations, or a temp dir)")  # fmt: skip
        check_choice(self, "evict_priority", EVICT_PRIORITIES)
        check_positive(self, "ttl_s")


def check_budgets(owner: object, *names: str) -> None:
    """Byte budgets: integers >= 0 (0 turns a tier off); ActivationStore checks its arguments through RecordConfig."""
    check_non_negative(owner, *names, integer=True)


RECORD_POLICIES = choices_of(RecordConfig, "policy")
RECORD_DTYPES = choices_of(RecordConfig, "dtype")
EVICT_PRIORITIES = choices_of(RecordConfig, "evict_priority")
