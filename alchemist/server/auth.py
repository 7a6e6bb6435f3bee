"""API keys, OpenAI-style (``Authorization: Bearer <key>``): who may call what.

    keys = KeyStore.load(api_key="sk-...", keys_file="keys.toml")   # either, both, or neither (no keys: open,
                                                                     # and the server binds loopback only)
    @router.post("/v1/feedback")
    def feedback(body, caller: Caller = Depends(user)): ...          # or admin, metrics_reader, docs_reader

The keys file holds named keys, hashed (sha256 hex of the key; the key itself is shown once, by
``alchemist keys add``), user or admin, each with optional limits (``alchemist.server.limits``)::

    [[keys]]
    name = "alice"
    sha256 = "9f86d08..."
    admin = false                 # admin: rollback and adapter management, /metrics and /docs when not public
    adapter = "team-a"            # optional: the key's own named adapter (its model; see Caller.adapter)
    requests_per_minute = 60      # optional, over the server's --rate-limit-* defaults
    feedback_per_minute = 20
    max_streams = 4
    record_mb_per_hour = 256

The file is read again when its modification time changes (checked at most once a second) or on SIGHUP; a file
that fails to parse keeps the previous keys (logged). ``--api-key`` adds one admin key named "admin".
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from alchemist.config.server import ADAPTER_NAME
from alchemist.server.errors import AuthenticationError, PermissionDeniedError

logger = logging.getLogger(__name__)

SHA256_HEX = re.compile(r"[0-9a-f]{64}")
LIMIT_FIELDS = ("requests_per_minute", "feedback_per_minute", "max_streams", "record_mb_per_hour")
RELOAD_CHECK_S = 1.0  # how often a request may stat the keys file


@dataclass(frozen=True)
class Caller:
    """Who made a request: a key's name (None: no keys are configured, everyone is the same anonymous caller)."""

    name: str | None
    admin: bool
    limits: dict[str, float] = field(default_factory=dict)  # this key's own limits (LIMIT_FIELDS), if any
    # The key's own named adapter (alchemist.runtime.adapter_registry): a request for the base model's name is
    # served by it, and it is the one adapter a user key may name. None: the shared adapter, as for any key.
    adapter: str | None = None

    def may_use(self, adapter: str) -> bool:
        """Whether this caller may name the adapter ``adapter`` as its model: its own; any for an admin (and for
        everyone where no keys are configured)."""
        return self.admin or self.adapter == adapter


ANONYMOUS = Caller(None, admin=True)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "sk-alc-" + secrets.token_urlsafe(32)


def parse_keys(text: str, source: str) -> dict[str, Caller]:
    """sha256 hex -> Caller, from the TOML of a keys file; ValueError naming the entry at fault."""
    entries = tomllib.loads(text).get("keys", [])
    by_hash: dict[str, Caller] = {}
    names: set[str] = set()
    for i, entry in enumerate(entries):
        name, digest = entry.get("name"), str(entry.get("sha256", "")).lower()
        if not isinstance(name, str) or not name or name in names:
            raise ValueError(f"{source}: keys[{i}] needs a unique non-empty name (got {name!r})")
        if not SHA256_HEX.fullmatch(digest):
            raise ValueError(f"{source}: keys[{i}] ({name}): sha256 must be 64 hex digits")
        unknown = set(entry) - {"name", "sha256", "admin", "adapter", *LIMIT_FIELDS}
        if unknown:
            raise ValueError(f"{source}: keys[{i}] ({name}): unknown fields {sorted(unknown)}")
        limits = {k: float(entry[k]) for k in LIMIT_FIELDS if k in entry}
        if any(v < 0 for v in limits.values()):
            raise ValueError(f"{source}: keys[{i}] ({name}): limits must be >= 0")
        adapter = entry.get("adapter")
        if adapter is not None and not (isinstance(adapter, str) and ADAPTER_NAME.fullmatch(adapter)):
            raise ValueError(f"{source}: keys[{i}] ({name}): adapter must be an adapter name (got {adapter!r})")
        names.add(name)
        by_hash[digest] = Caller(name, admin=bool(entry.get("admin", False)), limits=limits, adapter=adapter)
    return by_hash


class KeyStore:
    """The configured keys, looked up by the hash of what a client sends; the keys file is reloaded when it
    changes."""

    def __init__(self, api_key: str | None = None, keys_file: str | None = None):
        self.fixed = {hash_key(api_key): Caller("admin", admin=True)} if api_key else {}
        self.keys_file = Path(keys_file) if keys_file else None
        self._from_file: dict[str, Caller] = {}
        self._mtime_ns: int | None = None
        self._checked_s = 0.0
        self._lock = threading.Lock()
        if self.keys_file is not None:
            if not self.keys_file.is_file():
                raise ValueError(f"--api-keys-file {self.keys_file} does not exist (`alchemist keys add` makes it)")
            self._from_file = parse_keys(self.keys_file.read_text(), str(self.keys_file))  # errors stop start-up
            self._mtime_ns = self.keys_file.stat().st_mtime_ns

    @property
    def enabled(self) -> bool:
        return bool(self.fixed) or self.keys_file is not None

    def lookup(self, key: str) -> Caller | None:
        self._maybe_reload()
        digest = hash_key(key)
        return self.fixed.get(digest) or self._from_file.get(digest)

    def reload(self) -> None:
        """Read the keys file again (SIGHUP); a broken file keeps the keys in force."""
        if self.keys_file is None:
            return
        with self._lock:
            try:
                mtime_ns = self.keys_file.stat().st_mtime_ns
                self._from_file = parse_keys(self.keys_file.read_text(), str(self.keys_file))
                self._mtime_ns = mtime_ns
                logger.info("API keys reloaded from %s: %d keys", self.keys_file, len(self._from_file))
            except (OSError, ValueError, tomllib.TOMLDecodeError) as e:
                logger.error("API keys file not reloaded, the previous keys stay in force: %s", e)

    def _maybe_reload(self) -> None:
        if self.keys_file is None or time.monotonic() - self._checked_s < RELOAD_CHECK_S:
            return
        self._checked_s = time.monotonic()
        try:
            changed = self.keys_file.stat().st_mtime_ns != self._mtime_ns
        except OSError:
            changed = False  # a file being replaced; the next check sees the new one
        if changed:
            self.reload()


def add_key(keys_file: str | os.PathLike, name: str, admin: bool, adapter: str | None = None) -> str:
    """Append a new key to ``keys_file`` (created if missing), with its own named adapter if ``adapter``; returns
    the key, which is stored only hashed."""
    path = Path(keys_file)
    text = path.read_text() if path.exists() else ""
    existing = parse_keys(text, str(path))
    if any(c.name == name for c in existing.values()):
        raise ValueError(f"{path} already has a key named {name!r}")
    if not re.fullmatch(r"[A-Za-z0-9_.@-]+", name):
        raise ValueError(f"key name {name!r}: use letters, digits and _ . @ - only")
    if adapter is not None and not ADAPTER_NAME.fullmatch(adapter):
        raise ValueError(f"adapter name {adapter!r}: use 1 to 128 letters, digits and _ . @ : / - only")
    key = new_key()
    block = f'[[keys]]\nname = "{name}"\nsha256 = "{hash_key(key)}"\nadmin = {"true" if admin else "false"}\n'
    if adapter is not None:  # only then: a key without one reads as it always has
        block += f'adapter = "{adapter}"\n'
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(("\n" if text and not text.endswith("\n\n") else "") + block)
    os.chmod(path, 0o600)
    return key


# --- the FastAPI dependencies ----------------------------------------------------------------------------------

Credentials = HTTPAuthorizationCredentials | None
bearer = HTTPBearer(auto_error=False, description="An API key: --api-key, or one of --api-keys-file")


def _caller(request: Request, credentials: Credentials, admin: bool) -> Caller:
    keys: KeyStore = request.app.state.keys
    if not keys.enabled:
        return ANONYMOUS
    if credentials is None:
        raise AuthenticationError("Missing API key: send it as 'Authorization: Bearer <key>'")
    caller = keys.lookup(credentials.credentials)
    if caller is None:
        raise AuthenticationError("Incorrect API key provided")
    if admin and not caller.admin:
        raise PermissionDeniedError(f"This needs an admin key; key {caller.name!r} is a user key")
    return caller


async def user(request: Request, credentials: Credentials = Depends(bearer)) -> Caller:
    """Any valid key."""
    return _caller(request, credentials, admin=False)


async def admin(request: Request, credentials: Credentials = Depends(bearer)) -> Caller:
    """An admin key."""
    return _caller(request, credentials, admin=True)


async def metrics_reader(request: Request, credentials: Credentials = Depends(bearer)) -> Caller:
    """/metrics: anyone with --metrics-access public, else an admin key."""
    if request.app.state.server_config.metrics_access == "public":
        return ANONYMOUS
    return _caller(request, credentials, admin=True)


async def docs_reader(request: Request, credentials: Credentials = Depends(bearer)) -> Caller:
    """/docs and /openapi.json: anyone with --docs-access public, else an admin key."""
    if request.app.state.server_config.docs_access == "public":
        return ANONYMOUS
    return _caller(request, credentials, admin=True)
