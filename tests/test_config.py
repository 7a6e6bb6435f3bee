"""RecordConfig's store tiers: validation naming the field, and the CLI flags that map onto them."""

from __future__ import annotations

import argparse

import pytest

from alchemist.cli import _add_record_flags, _record_config
from alchemist.config import RecordConfig


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("host_budget_bytes", -1, "host_budget_bytes"),
        ("disk_budget_bytes", 1.5, "disk_budget_bytes"),
        ("store_budget_bytes", True, "store_budget_bytes"),
        ("disk_dir", " ", "disk_dir"),
        ("evict_priority", "fifo", "evict_priority"),
    ],
)
def test_record_config_rejects_bad_tier_settings(field, value, message):
    with pytest.raises(ValueError, match=message):
        RecordConfig(**{field: value})


def test_record_flags_map_to_the_tiers(tmp_path):
    parser = argparse.ArgumentParser()
    _add_record_flags(parser)
    defaults = _record_config(parser.parse_args([]))
    assert (defaults.store_budget_bytes, defaults.host_budget_bytes, defaults.disk_budget_bytes) == (
        2 << 30,
        4 << 30,
        16 << 30,
    )
    assert defaults.disk_dir is None
    args = ["--record-budget-mb", "1", "--record-host-budget-mb", "0", "--record-disk-budget-mb", "3"]
    config = _record_config(parser.parse_args([*args, "--record-dir", str(tmp_path)]))
    assert (config.store_budget_bytes, config.host_budget_bytes, config.disk_budget_bytes) == (1 << 20, 0, 3 << 20)
    assert config.disk_dir == str(tmp_path)
