"""Limits per API key: request and feedback rates, concurrent streams, and how many bytes of prompt records the
key's ``{"alchemist": {"record": true}}`` may ask for.

    limits = KeyLimits(LimitConfig(requests_per_minute=60), record_bytes_per_token=346_000)
    limits.admit_request(caller)          # RateLimitError (a 429 with Retry-After) when the key's rate is spent
    release = limits.open_stream(caller)  # ... when it has max_streams open; release() when the stream ends
    limits.grant_record(caller, 900)      # False: serve it unrecorded (not an error)

Rates are token buckets holding a minute's worth (a burst of ``requests_per_minute`` at once, then that many a
minute); the record quota is a bucket of ``record_mb_per_hour`` refilled over an hour. A key's own limits (its
entry in the keys file) replace the server's defaults; 0 is no limit. Callers without a key (a server without
keys, which serves loopback only) are not limited.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Depends, Request

from alchemist.server.auth import Caller, user
from alchemist.server.errors import RateLimitError

if TYPE_CHECKING:
    from alchemist.config import ServerConfig


@dataclass(frozen=True)
class LimitConfig:
    """The defaults of every key (ServerConfig's fields of the same names); 0: no limit."""

    requests_per_minute: float = 0.0
    feedback_per_minute: float = 0.0
    max_streams: float = 0.0
    record_mb_per_hour: float = 2048.0

    @classmethod
    def of(cls, config: ServerConfig) -> LimitConfig:
        """The server's defaults for every key."""
        return cls(config.requests_per_minute, config.feedback_per_minute, config.max_streams_per_key,
                   config.record_mb_per_hour)  # fmt: skip

    def for_caller(self, caller: Caller) -> LimitConfig:
        return LimitConfig(**{**self.__dict__, **caller.limits})


class TokenBucket:
    def __init__(self, capacity: float, refill_per_s: float):
        self.capacity = capacity
        self.refill_per_s = refill_per_s
        self.level = capacity
        self.at_s = time.monotonic()

    def take(self, cost: float = 1.0) -> float:
        """Takes ``cost`` and returns 0.0, or takes nothing and returns the seconds until it could."""
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.at_s) * self.refill_per_s)
        self.at_s = now
        if self.level >= cost:
            self.level -= cost
            return 0.0
        return (cost - self.level) / self.refill_per_s if cost <= self.capacity else float("inf")


@dataclass
class _KeyState:
    requests: TokenBucket | None
    feedback: TokenBucket | None
    records: TokenBucket | None
    streams: int = 0
    config: LimitConfig = field(default_factory=LimitConfig)


class KeyLimits:
    def __init__(self, config: LimitConfig, record_bytes_per_token: int):
        self.config = config
        self.record_bytes_per_token = record_bytes_per_token
        self.refused = {"requests": 0, "feedback": 0, "streams": 0, "records": 0}  # for /metrics and the soak
        self._keys: dict[str, _KeyState] = {}
        self._lock = threading.Lock()

    def admit_request(self, caller: Caller) -> None:
        self._take(caller, "requests", 1.0, "requests_per_minute")

    def admit_feedback(self, caller: Caller) -> None:
        self._take(caller, "feedback", 1.0, "feedback_per_minute")

    def open_stream(self, caller: Caller) -> Callable[[], None]:
        """Counts a stream of the key open; returns the function that closes it (call it once)."""
        if caller.name is None:
            return lambda: None
        with self._lock:
            state = self._state(caller)
            limit = state.config.max_streams
            if limit and state.streams >= limit:
                self.refused["streams"] += 1
                raise RateLimitError(f"Key {caller.name!r} has {int(limit)} streams open already (max_streams)", 1.0)
            state.streams += 1

        def release() -> None:
            with self._lock:
                self._keys[caller.name].streams -= 1  # the key's state now (a keys file reload may renew it)

        return release

    def grant_record(self, caller: Caller, prompt_tokens: int) -> bool:
        """Whether the key's quota covers recording a prompt of ``prompt_tokens`` (charged if so)."""
        if caller.name is None:
            return True
        with self._lock:
            state = self._state(caller)
            if state.records is None or state.records.take(prompt_tokens * self.record_bytes_per_token) == 0.0:
                return True
            self.refused["records"] += 1
            return False

    def _take(self, caller: Caller, kind: str, cost: float, setting: str) -> None:
        if caller.name is None:
            return
        with self._lock:
            bucket = getattr(self._state(caller), kind)
            wait_s = bucket.take(cost) if bucket is not None else 0.0
            if wait_s:
                self.refused[kind] += 1
        if wait_s:
            limit = getattr(self._state(caller).config, setting)
            raise RateLimitError(f"Rate limit of key {caller.name!r} reached: {limit:g} {kind} a minute ({setting})",
                                 wait_s)  # fmt: skip

    def _state(self, caller: Caller) -> _KeyState:
        """The key's buckets; made again when its limits changed (a reloaded keys file)."""
        config = self.config.for_caller(caller)
        state = self._keys.get(caller.name)
        if state is None or state.config != config:
            per_minute = lambda n: TokenBucket(max(n, 1.0), n / 60.0) if n else None  # holds one at least
            record_bytes = config.record_mb_per_hour * (1 << 20)
            records = TokenBucket(record_bytes, record_bytes / 3600.0) if record_bytes else None
            streams = state.streams if state is not None else 0
            state = _KeyState(per_minute(config.requests_per_minute), per_minute(config.feedback_per_minute),
                              records, streams, config)  # fmt: skip
            self._keys[caller.name] = state
        return state


# --- the FastAPI dependencies: the key, then its rate ---------------------------------------------------------


async def requester(request: Request, caller: Caller = Depends(user)) -> Caller:
    """A completion request: any valid key, within its request rate."""
    request.app.state.limits.admit_request(caller)
    return caller


async def feedback_giver(request: Request, caller: Caller = Depends(user)) -> Caller:
    """Feedback: any valid key, within its feedback rate."""
    request.app.state.limits.admit_feedback(caller)
    return caller
