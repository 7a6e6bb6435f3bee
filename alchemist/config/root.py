"""The root of the configuration tree: everything `alchemist serve` runs with, one section per component.

    engine   EngineConfig   the serving engine (model, numerics, KV cache, batch)
    record   RecordConfig   prefill recording and the tiered activation store
    online   OnlineConfig   the online trainer; its ``trainer`` section (TrainerConfig) is the step it runs
    server   ServerConfig   the HTTP server (address, state, keys, limits)
    scale    ScaleConfig    replicas on Ray behind one front

A config file (YAML or TOML) has the same shape, keyed by field names in the fields' units (bytes, seconds); every
field is also a flag (its annotation names it), and flags override the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from alchemist.config.engine import EngineConfig
from alchemist.config.fields import check, field_type, flag_of, sections
from alchemist.config.record import RecordConfig
from alchemist.config.scale import ScaleConfig
from alchemist.config.server import ServerConfig
from alchemist.config.training import FORMER_KEYS, RETIRED_KEYS, OnlineConfig


@dataclass
class Config:
    """`alchemist serve`: the engine, recording, the online trainer and the server."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    record: RecordConfig = field(default_factory=RecordConfig)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    scale: ScaleConfig = field(default_factory=ScaleConfig)

    def check(self) -> None:
        for section in dataclasses.fields(self):
            getattr(self, section.name).check()
        # Replicas share one feedback log, which SQLite's (one process's) cannot be.
        shared = (self.server.feedback_db or "").startswith(("postgresql://", "postgres://"))
        check(self.scale, self.scale.replicas == 1 or shared, "replicas",
              "above 1 needs a feedback log the replicas share: --feedback-db postgresql://...")  # fmt: skip


# Settings that moved (old dotted path -> new): a config file may still use the old keys (parse.py warns).
MOVED: dict[str, str] = {f"online.{old}": f"online.{new}" for old, new in FORMER_KEYS.items()}
# Settings that are gone (dotted path -> why): a config file may still set them (parse.py warns and drops them).
RETIRED: dict[str, str] = {f"online.{key}": why for key, why in RETIRED_KEYS.items()}


def leaves(cls: type = Config, path: str = "") -> Iterator[tuple[str, type, dataclasses.Field]]:
    """Every setting under ``cls``: its dotted path (``online.trainer.lr``), the section that holds it, its field."""
    nested = {f.name for f in sections(cls)}
    for f in dataclasses.fields(cls):
        if f.name in nested:
            yield from leaves(field_type(cls, f.name), f"{path}{f.name}.")
        else:
            yield f"{path}{f.name}", cls, f


def file_flags(data: dict[str, Any], cls: type = Config, path: str = "") -> list[str]:
    """A config file's mapping as the flags that set the same fields (so one parser checks both)."""
    if not isinstance(data, dict):
        raise ValueError(f"{path.rstrip('.') or 'the config file'} must be a mapping of settings (got {data!r})")
    known = {f.name: f for f in dataclasses.fields(cls)}
    nested = {f.name for f in sections(cls)}
    args: list[str] = []
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"unknown setting {path}{key} (known here: {', '.join(known)})")
        if key in nested:
            args += file_flags(value, field_type(cls, key), f"{path}{key}.")
            continue
        name, unit = flag_of(cls, key)
        if field_type(cls, key) is bool:  # a --flag / --no-flag pair
            if not isinstance(value, bool):
                raise ValueError(f"{path}{key} must be true or false (got {value!r})")
            args.append(name if value else f"--no-{name[2:]}")
        elif isinstance(value, list | tuple):
            args += [name, *map(str, value)]
        else:
            args += [name, "None" if value is None else unit.str_from_instance(value)[0] if unit else str(value)]
    return args


def file_keys(data: dict[str, Any], path: str = "") -> set[str]:
    """The dotted paths a config file sets."""
    keys: set[str] = set()
    for key, value in data.items():
        keys |= file_keys(value, f"{path}{key}.") if isinstance(value, dict) else {f"{path}{key}"}
    return keys


def as_dict(config: Config) -> dict[str, Any]:
    """The tree as a config file's mapping (tuples as lists)."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return list(value) if isinstance(value, tuple) else value

    return plain(dataclasses.asdict(config))
