"""The server section: where the OpenAI-compatible server listens, its public model name, state, keys and limits."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Annotated, Literal

from alchemist.config.fields import (
    check,
    check_choice,
    check_non_negative,
    check_positive,
    check_positive_ints,
    choices_of,
    flag,
    run_checks,
)

# A named adapter's name, as clients send it in ``model``, a keys file's ``adapter`` holds it and --lora-modules and
# /v1/load_lora_adapter give it (alchemist.runtime.adapter_registry).
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_.@:/-]{1,128}")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name to bind) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def _non_empty(owner: object, name: str, none_means: str | None = None) -> None:
    value = getattr(owner, name)
    ok = (value is None and none_means is not None) or (isinstance(value, str) and bool(value.strip()))
    check(owner, ok, name, "must not be empty" + (f" (None: {none_means})" if none_means else ""))


@dataclass
class ServerConfig:
    """The OpenAI-compatible HTTP server: where it listens, the model's public name, state, API keys and limits."""

    host: Annotated[str, flag("host", "address to bind (not loopback: needs API keys or --allow-unauthenticated)")] = (
        "127.0.0.1"
    )
    port: Annotated[int, flag("port", "port to bind (0: any free one)")] = 8000
    served_model_name: Annotated[str | None, flag("served-model-name", "the model name clients send (None: the "
                                                  "model file's or directory's stem)")] = None  # fmt: skip
    max_body_bytes: Annotated[int, flag("max-body-bytes", "larger request bodies get a 413")] = 1 << 20
    max_completions_kept: Annotated[int, flag("max-completions-kept", "finished completions kept by response id, "
                                              "for feedback")] = 10_000  # fmt: skip
    completion_ttl_s: Annotated[float, flag("completion-ttl-s", "... and for how long")] = 24 * 3600.0
    data_dir: Annotated[str, flag("data-dir", "durable state: feedback log, adapters (created at start-up)")] = (
        "alchemist-data"
    )
    feedback_db: Annotated[str | None, flag("feedback-db", "the feedback log: a SQLite file, or a postgresql:// URL "
                                            "for a log shared by several servers (None: "
                                            "DATA_DIR/feedback.sqlite)")] = None  # fmt: skip
    allocator: Annotated[Literal["auto", "jemalloc", "libc"], flag("allocator", "the process's memory allocator "
                         "(auto: jemalloc where installed, which keeps resident memory flat while training under "
                         "load; else the C library's)")] = "auto"  # fmt: skip
    # API keys (alchemist.server.auth). Without any the server is open to whoever reaches it, so it binds a loopback
    # address only, unless told otherwise.
    api_key: Annotated[str | None, flag("api-key", "one admin key (default: $ALCHEMIST_API_KEY)")] = None
    api_keys_file: Annotated[str | None, flag("api-keys-file", "named user and admin keys, hashed (alchemist keys "
                                              "add); reloaded when it changes")] = None  # fmt: skip
    allow_unauthenticated: Annotated[bool, flag("allow-unauthenticated", "serve a non-loopback --host without any "
                                                "API key")] = False  # fmt: skip
    metrics_access: Annotated[Literal["public", "admin"], flag("metrics-access", "who may read /metrics (when keys "
                              "are configured)")] = "admin"  # fmt: skip
    docs_access: Annotated[Literal["public", "admin"], flag("docs-access", "who may read /docs and "
                           "/openapi.json")] = "admin"  # fmt: skip
    # Limits of every key (a key's entry in the keys file may set its own; alchemist.server.limits). Callers without
    # a key (no keys configured: loopback only) are not limited.
    requests_per_minute: Annotated[float, flag("rate-limit-requests", "completion requests per key a minute "
                                               "(0: no limit)")] = 0.0  # fmt: skip
    feedback_per_minute: Annotated[float, flag("rate-limit-feedback", "feedback per key a minute (0: no "
                                               "limit)")] = 0.0  # fmt: skip
    max_streams_per_key: Annotated[int, flag("max-streams-per-key", "streaming completions a key has open at once "
                                             "(0: no limit)")] = 0  # fmt: skip
    record_mb_per_hour: Annotated[float, flag("record-quota-mb-per-hour", "prompt records a key's "
                                              "{\"alchemist\": {\"record\": true}} may ask for")] = 2048.0  # fmt: skip
    # Named LoRA adapters (vLLM's flags; alchemist.runtime.adapter_registry): requests name one as their model. More
    # may be registered than the engine holds: the others wait on disk and are paged in on demand.
    lora_modules: Annotated[tuple[str, ...], flag("lora-modules", "LoRA adapters served by name from the start, "
                            "NAME=PATH each (PEFT adapter directories); requests name one as their model, and the "
                            "feedback on its answers trains it (into <data-dir>/adapters/NAME)")] = ()  # fmt: skip
    max_loras: Annotated[int, flag("max-loras", "named adapters held in the engine at once (the others are paged "
                         "in on demand, evicting the least recently used idle one)")] = 4  # fmt: skip
    max_cpu_loras: Annotated[int | None, flag("max-cpu-loras", "named adapters kept read in memory, so that a "
                             "page-in need not read the disk (None: max_loras)")] = None  # fmt: skip

    def __post_init__(self) -> None:
        self.data_dir = str(self.data_dir)  # a Path is welcome too
        if self.feedback_db is not None:
            self.feedback_db = str(self.feedback_db)
        run_checks(self)

    def check(self) -> None:
        check(self, isinstance(self.port, int) and 0 <= self.port <= 65535, "port", "must be an integer in 0..65535")
        if self.served_model_name is not None:
            _non_empty(self, "served_model_name")
        check_positive_ints(self, "max_body_bytes", "max_completions_kept")
        check_positive(self, "completion_ttl_s")
        _non_empty(self, "data_dir")
        _non_empty(self, "feedback_db", none_means="<data_dir>/feedback.sqlite")
        check_non_negative(self, "requests_per_minute", "feedback_per_minute", "record_mb_per_hour")
        check_non_negative(self, "max_streams_per_key", integer=True)
        check_choice(self, "allocator", choices_of(ServerConfig, "allocator"))
        check_positive_ints(self, "max_loras")
        check(self, self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
              f"must be at least max_loras ({self.max_loras}) or None")  # fmt: skip
        names = [name for name, _ in self.lora_module_paths]
        check(self, len(names) == len(set(names)), "lora_modules", "names an adapter twice")
        check_choice(self, "metrics_access", ACCESS_CHOICES)
        check_choice(self, "docs_access", ACCESS_CHOICES)
        if self.api_key is not None:
            _non_empty(self, "api_key")
        check(self, self.has_keys or self.allow_unauthenticated or is_loopback(self.host), "host",
              "is not a loopback address: refusing to serve it without API keys, anyone who reaches it could train "
              "and roll back the model. Give --api-key or --api-keys-file, or --allow-unauthenticated if that is "
              "what you want")  # fmt: skip

    @property
    def lora_module_paths(self) -> list[tuple[str, str]]:
        """--lora-modules as (name, path) pairs; a FieldError for an entry that is not NAME=PATH."""
        pairs = []
        for module in self.lora_modules:
            name, sep, path = str(module).partition("=")
            check(self, bool(sep and ADAPTER_NAME.fullmatch(name.strip()) and path.strip()), "lora_modules",
                  f"entries must be NAME=PATH, NAME of letters, digits and _ . @ : / - ({module!r} is not)")
            pairs.append((name.strip(), path.strip()))
        return pairs

    @property
    def has_keys(self) -> bool:
        return bool(self.api_key) or self.api_keys_file is not None

    @property
    def feedback_db_path(self) -> str:
        return self.feedback_db if self.feedback_db is not None else os.path.join(self.data_dir, "feedback.sqlite")


ACCESS_CHOICES = choices_of(ServerConfig, "metrics_access")
