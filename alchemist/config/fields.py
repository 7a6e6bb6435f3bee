"""How a config field is declared once: its flag, help and unit; and the checks its section runs on it.

A field's flag lives in its annotation (``Annotated[int, flag("max-num-seqs", "...")]``), which tyro reads to make
the command line (alchemist/config/parse.py); ``flag_of`` reads it back so that a check's error can name the flag.
Checks raise ``FieldError`` (a ``ValueError``) naming the field; the command line renames it to the flag the user
typed, or the key of the config file that set it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import typing
from collections.abc import Iterator
from typing import Any

import tyro
from tyro.constructors import PrimitiveConstructorSpec

_deferred = contextvars.ContextVar("deferred_checks", default=False)


def flag(name: str, help: str) -> Any:  # noqa: A002 - argparse's word
    """The field's command-line flag ``--name`` (no section prefix: flags stay as short as vLLM's) and its help."""
    return tyro.conf.arg(name=name, help=help, prefix_name=False)


def _scaled(metavar: str, scale: float, kind: type) -> PrimitiveConstructorSpec:
    """A flag in other units than its field: ``--record-budget-mb 2`` holds 2 << 20 bytes."""

    def to_flag(value: Any) -> list[str]:
        text = repr(value / scale)
        return [text[:-2] if text.endswith(".0") else text]

    return PrimitiveConstructorSpec(
        nargs=1, metavar=metavar, instance_from_str=lambda args: kind(float(args[0]) * scale),
        is_instance=lambda value: isinstance(value, kind | int), str_from_instance=to_flag,
    )  # fmt: skip


MB = _scaled("MB", float(1 << 20), int)  # a byte count given in MiB (fractions allowed)
MS = _scaled("MS", 1e-3, float)  # seconds given in milliseconds


class FieldError(ValueError):
    """A field's value is out of bounds: ``str`` names the field; ``owner``/``field`` let the CLI name the flag."""

    def __init__(self, owner: type, field: str, value: Any, problem: str) -> None:
        self.owner, self.field, self.value, self.problem = owner, field, value, problem
        super().__init__(f"{field} {problem} (got {value!r})")


@contextlib.contextmanager
def deferred_checks() -> Iterator[None]:
    """Build configs without checking them (the CLI checks the finished tree, so its errors can name flags)."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def run_checks(config: Any) -> None:
    """``config.check()`` unless inside ``deferred_checks`` (every section's ``__post_init__`` ends with this)."""
    if not _deferred.get():
        config.check()


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def flag_of(cls: type, name: str) -> tuple[str, PrimitiveConstructorSpec | None]:
    """The flag of field ``name`` of ``cls`` (``--max-num-seqs``) and its unit spec, if it has one."""
    metadata = getattr(_hints(cls)[name], "__metadata__", ())
    arg = next(m for m in metadata if isinstance(m, type(tyro.conf.arg())))
    unit = next((m for m in metadata if isinstance(m, PrimitiveConstructorSpec)), None)
    return f"--{arg.name}", unit


def flag_help(cls: type, name: str) -> str:
    metadata = getattr(_hints(cls)[name], "__metadata__", ())
    return next(m for m in metadata if isinstance(m, type(tyro.conf.arg()))).help or ""


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check(config: Any, ok: bool, name: str, problem: str) -> None:
    """Raise ``FieldError`` for field ``name`` of ``config`` unless ``ok``."""
    if not ok:
        raise FieldError(type(config), name, getattr(config, name), problem)


def check_positive_ints(config: Any, *names: str) -> None:
    """Each field is a positive integer (or None, where None means "derived")."""
    for name in names:
        value = getattr(config, name)
        check(config, value is None or (is_int(value) and value >= 1), name, "must be a positive integer")


def check_non_negative(config: Any, *names: str, integer: bool = False) -> None:
    for name in names:
        value = getattr(config, name)
        ok = is_int(value) if integer else isinstance(value, int | float) and not isinstance(value, bool)
        check(config, ok and value >= 0, name, "must be an integer >= 0" if integer else "must be >= 0")


def check_positive(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        check(config, isinstance(value, int | float) and not isinstance(value, bool) and value > 0, name,
              "must be positive")  # fmt: skip


def check_choice(config: Any, name: str, choices: tuple[str, ...]) -> None:
    check(config, getattr(config, name) in choices, name, f"must be one of {', '.join(choices)}")


def choices_of(cls: type, name: str) -> tuple[str, ...]:
    """A ``Literal`` field's choices (the type is where they are written)."""
    return typing.get_args(field_type(cls, name))


def field_type(cls: type, name: str) -> Any:
    """Field ``name``'s type without its annotations (a section's class, ``int``, ``str | None``...)."""
    hint = _hints(cls)[name]
    return typing.get_args(hint)[0] if hasattr(hint, "__metadata__") else hint


def sections(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are config sections themselves (dataclasses)."""
    return [f for f in dataclasses.fields(cls) if dataclasses.is_dataclass(field_type(cls, f.name))]
