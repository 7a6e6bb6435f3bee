"""Durable versions of the online trainer's adapter: each one complete on disk or absent, never torn.

    checkpoints = AdapterCheckpoints(Path("data/adapters"), keep=5)
    run_to_end(checkpoints.save_slices(adapter.version, adapter, optimizer.state_dict(), 1234, {"loss": 0.7}))
    info = checkpoints.latest()                                    # VersionInfo | None
    adapter, optimizer_state, log_position = checkpoints.load(info.version, model.config)

Layout of ``directory``::

    v000012/adapter/      the adapter in PEFT's format (alchemist.json holds the version): PEFT and vLLM load it
    v000012/optimizer.pt  the optimizer's state_dict (torch.save)
    v000012/checkpoint.json   {"version", "log_position", "metrics", "created_s"}
    LATEST                the committed version's directory name ("v000012")

Note: [commit protocol] ``save_slices`` writes everything into a temporary directory and fsyncs each file and the
directory, renames it to ``vNNNNNN`` and fsyncs ``directory``, then replaces ``LATEST`` (a temporary file,
fsynced, ``os.replace``d, ``directory`` fsynced again). Replacing ``LATEST`` is the commit: a crash at any earlier
point leaves the previous version as the latest. A version directory newer than ``LATEST`` (a crash between the
rename and the pointer), or any while there is no ``LATEST``, is therefore uncommitted, and start-up removes it
with any leftover temporary directory. Only the newest ``keep`` versions are kept (``LATEST``'s always among them);
a directory is renamed to a temporary name before it is deleted, so a crash while deleting leaves no torn version.

One writer (the trainer) per directory; readers in other threads or processes see only committed versions.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from alchemist.model.config import ModelConfig
from alchemist.model.lora import LoraAdapter
from alchemist.model.peft_format import VERSION_FILE, fsync_path, load_adapter, save_adapter, write_json

LATEST = "LATEST"
ADAPTER_DIR = "adapter"
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "checkpoint.json"
TMP_PREFIX = ".tmp-"
VERSION_DIR = re.compile(r"v(\d{6,})")


def version_dir_name(version: int) -> str:
    return f"v{version:06d}"


@dataclass(frozen=True)
class VersionInfo:
    version: int
    created_s: float  # wall-clock time of the save
    log_position: int  # how far into the feedback log the trainer had read
    metrics: dict[str, Any]
    path: Path  # the version's directory

    @property
    def promoted(self) -> bool:
        """Whether it served (or serves): the evaluation gate passed it, or there was none (a rollback's version, a
        version from before the gate)."""
        return bool(self.metrics.get("evaluation", {}).get("promoted", True))


class AdapterCheckpoints:
    def __init__(self, directory: Path | str, keep: int, base_model_name_or_path: str | None = None) -> None:
        """Opens (or creates) ``directory`` and removes what a crashed save left (see the module's Note).

        ``base_model_name_or_path`` goes into each adapter's PEFT config, for tools that load it with its base.
        """
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1 (got {keep!r})")
        self.directory = Path(directory)
        self.keep = keep
        self.base_model_name_or_path = base_model_name_or_path
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_uncommitted()

    # --- reading --------------------------------------------------------------------------------------------------

    def latest(self) -> VersionInfo | None:
        """The committed version, or None before the first save."""
        version = self._latest_version()
        return None if version is None else self._info(version)

    def versions(self) -> list[VersionInfo]:
        """Every committed version on disk, oldest first."""
        latest = self._latest_version()
        if latest is None:
            return []
        return [self._info(v) for v in self._version_dirs() if v <= latest]

    def serving(self) -> VersionInfo | None:
        """The newest promoted version (the one to serve; see ``VersionInfo.promoted``), or None."""
        return next((v for v in reversed(self.versions()) if v.promoted), None)

    def load(
        self, version: int, model_config: ModelConfig, device: torch.device | str = "cpu"
    ) -> tuple[LoraAdapter, dict[str, Any], int]:
        """(the adapter, its optimizer state_dict, the log position) of a committed version.

        A missing or corrupt file raises ValueError naming it.
        """
        info = self._info(version)  # checks that the version exists and its checkpoint.json
        adapter = load_adapter(info.path / ADAPTER_DIR, model_config, device)
        if adapter.version != version:
            raise ValueError(
                f"{info.path / ADAPTER_DIR / VERSION_FILE}: holds version {adapter.version}, not {version}"
            )
        optimizer_path = info.path / OPTIMIZER_FILE
        if not optimizer_path.is_file():
            raise ValueError(f"{optimizer_path}: not found (checkpoint version {version} is incomplete)")
        try:
            optimizer_state = torch.load(optimizer_path, map_location=device, weights_only=True)
        except Exception as e:  # torch raises a variety of errors for truncated or foreign files
            raise ValueError(f"{optimizer_path}: cannot be read as an optimizer state ({type(e).__name__}: {e})") from e
        if not isinstance(optimizer_state, dict):
            raise ValueError(
                f"{optimizer_path}: expected an optimizer state_dict, got {type(optimizer_state).__name__}"
            )
        return adapter, optimizer_state, info.log_position

    # --- writing --------------------------------------------------------------------------------------------------

    def save_slices(
        self,
        version: int,
        adapter: LoraAdapter,
        optimizer_state: dict[str, Any],
        log_position: int,
        metrics: dict[str, Any] | None = None,
    ) -> Generator[None, None, VersionInfo]:
        """Writes ``version`` durably and makes it the latest, then prunes old versions; returns its info. In slices:
        the adapter's files, the optimizer state's, the commit (a whole save's writes and fsyncs were a long wait for
        serving: docs/benchmarks.md, "Why the defaults", slices). The caller must not change ``adapter`` or
        ``optimizer_state`` until it ends; closed before the commit, it leaves the previous version the latest."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(f"version must be an integer >= 1 (got {version!r})")
        latest = self._latest_version()
        if latest is not None and version <= latest:
            raise ValueError(f"version {version} is not newer than the latest saved version {latest}")
        if not isinstance(log_position, int) or isinstance(log_position, bool) or log_position < 0:
            raise ValueError(f"log_position must be an integer >= 0 (got {log_position!r})")
        meta = {"version": version, "log_position": log_position, "metrics": metrics or {}, "created_s": time.time()}
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise ValueError(f"metrics must be JSON-serializable ({e})") from e

        final = self.directory / version_dir_name(version)
        if final.exists():  # an uncommitted leftover of a save of this version that failed in this process
            self._discard(final)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=self.directory))
        try:
            adapter_dir = tmp / ADAPTER_DIR
            save_adapter(adapter, adapter_dir, self.base_model_name_or_path)  # fsyncs its files and tmp
            write_json(adapter_dir / VERSION_FILE, {"version": version})  # the version saved, whatever its own
            fsync_path(adapter_dir / VERSION_FILE)
            yield
            torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
            write_json(tmp / META_FILE, meta)
            for path in (tmp / OPTIMIZER_FILE, tmp / META_FILE, adapter_dir, tmp):
                fsync_path(path)
            yield
            os.rename(tmp, final)
            fsync_path(self.directory)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; a partial version if it failed
        self._point_latest(final.name)
        self._prune()
        return self._info(version)

    # --- internals ------------------------------------------------------------------------------------------------

    def _point_latest(self, name: str) -> None:
        tmp = self.directory / f"{TMP_PREFIX}{LATEST}"
        tmp.write_text(name + "\n")
        fsync_path(tmp)
        os.replace(tmp, self.directory / LATEST)
        fsync_path(self.directory)

    def _latest_version(self) -> int | None:
        path = self.directory / LATEST
        if not path.exists():
            return None
        name = path.read_text().strip()
        match = VERSION_DIR.fullmatch(name)
        if match is None:
            raise ValueError(f"{path}: expected a version directory name like v000012 (got {name[:40]!r})")
        return int(match[1])

    def _version_dirs(self) -> list[int]:
        """Versions with a directory here, committed or not, ascending."""
        found = (VERSION_DIR.fullmatch(p.name) for p in self.directory.iterdir() if p.is_dir())
        return sorted(int(m[1]) for m in found if m is not None)

    def _info(self, version: int) -> VersionInfo:
        path = self.directory / version_dir_name(version)
        latest = self._latest_version()
        if not path.is_dir() or latest is None or version > latest:
            committed = [v for v in self._version_dirs() if latest is not None and v <= latest]
            raise ValueError(f"{self.directory}: no checkpoint version {version} (versions: {committed})")
        meta_path = path / META_FILE
        try:
            meta = json.loads(meta_path.read_text())
            info = VersionInfo(
                version=meta["version"],
                created_s=float(meta["created_s"]),
                log_position=meta["log_position"],
                metrics=meta["metrics"],
                path=path,
            )
        except FileNotFoundError as e:
            raise ValueError(f"{meta_path}: not found (checkpoint version {version} is incomplete)") from e
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{meta_path}: corrupt checkpoint metadata ({type(e).__name__}: {e})") from e
        if info.version != version or not isinstance(info.log_position, int) or not isinstance(info.metrics, dict):
            raise ValueError(f"{meta_path}: corrupt checkpoint metadata (does not describe version {version})")
        return info

    def _remove_uncommitted(self) -> None:
        latest = self._latest_version()
        for path in self.directory.iterdir():
            match = VERSION_DIR.fullmatch(path.name)
            if path.name.startswith(TMP_PREFIX) and path.is_dir():
                shutil.rmtree(path)
            elif path.name.startswith(TMP_PREFIX):
                path.unlink()
            elif match is not None and path.is_dir() and (latest is None or int(match[1]) > latest):
                self._discard(path)
        fsync_path(self.directory)

    def _prune(self) -> None:
        """Keeps the newest ``keep`` versions, and the newest promoted one (it serves, however many versions the
        evaluation gate kept from serving since)."""
        latest = self._latest_version()
        committed = [v for v in self._version_dirs() if latest is not None and v <= latest]
        serving = next((v for v in reversed(committed) if self._info(v).promoted), None)
        for version in committed[: -self.keep]:
            if version not in (latest, serving):
                self._discard(self.directory / version_dir_name(version))
        fsync_path(self.directory)

    def _discard(self, path: Path) -> None:
        """Deletes a version directory; first out of the way in one rename, so that it is never seen half-deleted."""
        doomed = self.directory / f"{TMP_PREFIX}{path.name}-discarded"
        os.rename(path, doomed)
        shutil.rmtree(doomed)
