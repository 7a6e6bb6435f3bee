"""Finished completions by response id: what user feedback on a response needs, kept for a while.

The feedback endpoint (``alchemist.server.feedback``) looks a response up by the ``id`` the client got
("chatcmpl-..." or "cmpl-...") and logs its prompt and output token ids for training. Entries are bounded in
number (least recently used goes first) and in age (``ttl_s``); an id that is gone is simply unknown.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CompletionRecord:
    id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    model: str
    adapter_version: int  # the LoRA adapter that produced the output; 0 = the base model
    finish_reason: str | None
    created_s: float = field(default_factory=time.time)  # wall-clock time the response finished
    recorded: bool = False  # whether activations were recorded for it (the "alchemist.record" request flag)
    owner: str | None = None  # the name of the API key that made it (alchemist.server.auth); None: no keys
    adapter_name: str | None = None  # the named adapter that served it (None: the shared one, which feedback trains)


class CompletionsRegistry:
    """Thread-safe LRU + TTL map from response id to CompletionRecord."""

    def __init__(self, max_entries: int = 10_000, ttl_s: float = 24 * 3600.0):
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, CompletionRecord] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, record: CompletionRecord) -> None:
        with self._lock:
            self._entries[record.id] = record
            self._entries.move_to_end(record.id)
            self._evict(time.time())

    def get(self, response_id: str) -> CompletionRecord | None:
        with self._lock:
            self._evict(time.time())
            record = self._entries.get(response_id)
            if record is None:
                return None
            if time.time() - record.created_s > self.ttl_s:  # stale but kept alive by recent reads
                del self._entries[response_id]
                return None
            self._entries.move_to_end(response_id)
            return record

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _evict(self, now_s: float) -> None:
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        # Expiry scans from the least recently used until a fresh record; get() checks the one it returns.
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now_s - oldest.created_s <= self.ttl_s:
                break
            self._entries.popitem(last=False)
