"""`alchemist serve`'s command line, made by tyro from the config tree: a flag per field, grouped by section.

tyro (rather than jsonargparse or pydantic-settings) because it reads plain dataclasses as they are and lets each
field name its own flag, so the flags stay flat and vLLM-like (``--max-num-seqs``, not ``--engine.max-num-seqs``)
while ``--help`` still groups them by section. A config file (``--config FILE``, YAML or TOML) is turned into the
flags that set the same fields and parsed first, so the user's flags override it and one parser checks both.
"""

from __future__ import annotations

import os
import tomllib
import warnings
from pathlib import Path
from typing import Any

import tyro
import yaml

from alchemist.config.fields import FieldError, deferred_checks, flag_of
from alchemist.config.root import MOVED, RETIRED, Config, file_flags, file_keys
from alchemist.config.training import WHY_RETIRED

# Spellings from before the flags were generated, still accepted: tyro makes --X / --no-X pairs.
LEGACY_FLAGS = {
    "--enforce-eager": ["--compile-decode", "False"],
    "--train-no-replay": ["--no-train-replay"],
    "--train-no-gate": ["--no-train-gate"],
}
# Flags of settings that are gone, each with its value: still accepted, with a FutureWarning, and ignored.
RETIRED_FLAGS = {"--train-share": WHY_RETIRED, "--train-quantum-ms": WHY_RETIRED}
DESCRIPTION = (
    "OpenAI-compatible HTTP server that learns from feedback. Settings come from the flags below, each a field of "
    "the config tree (alchemist/config/); --config FILE (YAML or TOML, the same tree keyed by field names: see "
    "examples/serve.yaml) is read first and flags override it. Also accepted: --enforce-eager (= --compile-decode "
    "False), --train-no-replay, --train-no-gate."
)


def load_file(path: str) -> dict[str, Any]:
    """A config file's mapping (TOML by its suffix, else YAML); empty if the file is."""
    text = Path(path).read_text()
    data = tomllib.loads(text) if path.endswith(".toml") else yaml.safe_load(text)
    return data or {}


def moved_keys(data: dict[str, Any], path: str = "the config file") -> dict[str, Any]:
    """``data`` with the keys of settings that moved (``root.MOVED``) put where they are now, a ``FutureWarning``
    naming the new key for each, and those of settings that are gone (``root.RETIRED``) dropped, with one saying so.
    An old key that is now a section's name (``online.gate``) counts as old only when its value is not a mapping."""
    data = _copy(data)
    for old, why in RETIRED.items():
        *parents, leaf = old.split(".")
        holder = _section(data, parents)
        if holder is not None and leaf in holder:
            holder.pop(leaf)
            warnings.warn(f"{path}: {old} is ignored: {why}", FutureWarning, stacklevel=3)
    found: list[tuple[str, Any]] = []
    for old, new in MOVED.items():
        *parents, leaf = old.split(".")
        holder = _section(data, parents)
        if holder is None or leaf not in holder or isinstance(holder[leaf], dict):
            continue
        found.append((new, holder.pop(leaf)))
        warnings.warn(f"{path}: {old} is now {new} (the old key is still read, for now)", FutureWarning, stacklevel=3)
    for new, value in found:  # after every old key is out: an old key may be a new section's name
        *parents, leaf = new.split(".")
        holder = data
        for part in parents:
            holder = holder.setdefault(part, {})
        if leaf in holder:
            raise ValueError(f"{new} is set twice (once by its old key)")
        holder[leaf] = value
    return data


def _copy(data: Any) -> Any:
    return {k: _copy(v) for k, v in data.items()} if isinstance(data, dict) else data


def _section(data: dict[str, Any], parts: list[str]) -> dict[str, Any] | None:
    for part in parts:
        data = data.get(part) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else None


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """``--config FILE`` (or ``--config=FILE``) out of ``argv``, legacy spellings rewritten, retired flags dropped."""
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a file")
            path, i = argv[i + 1], i + 2
            continue
        name = arg.split("=", 1)[0]
        if name in RETIRED_FLAGS:
            warnings.warn(f"{name} is ignored: {RETIRED_FLAGS[name]}", FutureWarning, stacklevel=3)
            i += 1 if "=" in arg else 2  # the flag and its value
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest += LEGACY_FLAGS.get(arg, [arg])
        i += 1
    return path, rest


def parse_config(argv: list[str], base: Config | None = None, prog: str = "alchemist serve",
                 description: str = DESCRIPTION) -> Config:  # fmt: skip
    """The config ``argv`` gives on top of ``base`` (default: ``Config()``); a bad value raises ``ValueError`` naming
    the flag the user typed or the file's key. ``--help`` and malformed flags exit, as argparse does."""
    path, argv = _split_config(argv)
    with deferred_checks():
        config = base if base is not None else Config()
        keys: set[str] = set()
        if path is not None:
            try:
                data = moved_keys(load_file(path), path)
                keys = file_keys(data)
                from_file = file_flags(data)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
            config = tyro.cli(Config, args=from_file, default=config, prog=f"{prog} --config {path}")
        config = tyro.cli(Config, args=argv, default=config, prog=prog, description=description)
    if config.server.api_key is None and "server.api_key" not in keys:
        config.server.api_key = os.environ.get("ALCHEMIST_API_KEY")  # read here, never shown by --help
    try:
        config.check()
    except FieldError as e:
        raise ValueError(_named(e, argv, keys, path)) from None
    return config


def _named(error: FieldError, argv: list[str], keys: set[str], path: str | None) -> str:
    """The error in the user's words: the flag they typed, else the file's key, else the flag."""
    name, unit = flag_of(error.owner, error.field)
    typed = {a.split("=", 1)[0] for a in argv}
    key = next((k for k in keys if k.endswith(f".{error.field}") and _owner_matches(k, error.owner)), None)
    if key is not None and name not in typed and f"--no-{name[2:]}" not in typed:
        return f"{key} in {path} {error.problem} (got {error.value!r})"
    shown = error.value
    if unit is not None:
        try:
            shown = unit.str_from_instance(error.value)[0]
        except (TypeError, ValueError):
            pass
    return f"{name} {error.problem} (got {shown})"


def _owner_matches(key: str, owner: type) -> bool:
    from alchemist.config.root import leaves

    return any(path == key and cls is owner for path, cls, _ in leaves())


def add_field_flags(parser: Any, cls: type, *names: str, **defaults: Any) -> None:
    """Argparse flags for a few fields of ``cls`` (a bench that runs part of the tree): the fields' own flag names,
    types, choices and help; ``defaults`` where a bench wants other defaults than the fields'."""
    import dataclasses
    import typing

    from alchemist.config.fields import field_type, flag_help

    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        flag, _ = flag_of(cls, name)
        kind = field_type(cls, name)
        choices = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None
        scalar = next((t for t in (int, float) if kind is t), str)
        default = defaults.get(name, fields[name].default)
        parser.add_argument(flag, type=None if choices else scalar, choices=choices, default=default,
                            help=f"{flag_help(cls, name)} (default: {default})")  # fmt: skip


def serve_flag_names() -> set[str]:
    """Every flag the serve parser takes: each field's (and ``--no-`` of a bool's), ``--config``, legacy spellings."""
    from alchemist.config.fields import field_type
    from alchemist.config.root import leaves

    names = {"--config", *LEGACY_FLAGS}
    for _, cls, f in leaves():
        name, _ = flag_of(cls, f.name)
        names |= {name, f"--no-{name[2:]}"} if field_type(cls, f.name) is bool else {name}
    return names
