"""Protected directions: the adapter learns a correction through what is particular to its inputs, not through
the directions every ordinary input occupies.

A LoRA changes a seam's output on an input x by B A x. Trained on a few corrections by itself, it moves the answers
to everything else too: the inputs of ordinary chat share most of their directions with a correction's, so an A
that reads a correction reads them as well (docs/benchmarks.md, "Learning a correction with the defaults": ten
facts learned moved every one of 30 unrelated greedy answers). Gradient projection memory (Saha et al., ICLR 2021) keeps
an update orthogonal to the input subspace of what must not change: here, each seam's A is kept orthogonal to the
principal directions of the inputs that seam sees on ordinary chat, those that hold ``energy`` of their second
moment. Then A x, and with it B A x, is small for ordinary x whatever B learns, and large only for what ordinary
inputs lack: the correction's own.

- The ordinary chat: ``ordinary_sharegpt.json``, 64 ShareGPT conversations (first user turn and reply; none of
  them in the tests' or the gate's sets). Each token's input row counts once, normalised to unit length: a few
  rows (SmolLM2's first token) are hundreds of times longer than the rest and would otherwise be the subspace.
- Computed once, in slices (a layer of the forward, then a layer's eigendecompositions), before the first
  training step; then the adapter's A is projected, and again after every optimizer step (``project_``). Exact
  replay is untouched: the projection is part of the update, not of the loss.
- Kept in the cache directory a converted GGUF goes to ($ALCHEMIST_CACHE, else ~/.cache/alchemist) under a key
  of everything it depends on (the model's weights and dtype, the seams, the energy, the chats), so that a
  server's later starts, and other servers of the same model, load it instead of spending a minute of a busy CPU
  on it (docs/benchmarks.md, "Learning a correction with the defaults"); processes that need it at once compute it
  once (a lock beside the entry: the others wait for it, serving on).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Generator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from alchemist.model.digest import weights_digest
from alchemist.model.gguf import default_cache_dir
from alchemist.model.llama import Llama
from alchemist.model.lora import LoraAdapter
from alchemist.model.tokenizer import Tokenizer
from alchemist.training.rank_split import RankSplit
from alchemist.training.recompute import responses_hidden_slices

ORDINARY_FILE = Path(__file__).with_name("ordinary_sharegpt.json")
FORMAT = 2  # part of the cache key: a change to how the subspace is computed bumps it (2: fp32 eigh)
WAIT_S = 0.05  # a slice of waiting for another process's computation: about a training slice

logger = logging.getLogger(__name__)


class _Moments:
    """An adapter that adds nothing and sums each seam's unit-normalised input rows' outer products."""

    def __init__(self, seams: set[str]) -> None:
        self.seams = seams
        self.sums: dict[str, torch.Tensor] = {}

    def delta(self, layer: int, name: str, x: torch.Tensor) -> None:
        key = f"{layer}_{name}"
        if key in self.seams:
            rows = torch.nn.functional.normalize(x.detach().float(), dim=-1)
            self.sums[key] = self.sums.get(key, 0) + rows.t() @ rows
        return None


class ProtectedSubspace:
    """Per seam of the adapter (its ``A`` keys), an orthonormal basis (in, k) of the protected directions, or,
    where that is the smaller of the two, of the free ones (in, in - k): ``free`` names those seams."""

    def __init__(self, bases: dict[str, torch.Tensor], free: frozenset[str] = frozenset()) -> None:
        self.bases = bases
        self.free = free

    def protected_basis(self, key: str) -> torch.Tensor:
        """The protected directions of a seam (made from the free ones' complement where only those are kept)."""
        basis = self.bases[key]
        if key not in self.free:
            return basis
        full = torch.linalg.qr(torch.cat([basis, torch.eye(basis.shape[0])], dim=1))[0][:, basis.shape[1] :]
        return full[:, : basis.shape[0] - basis.shape[1]]

    @classmethod
    def compute_slices(
        cls, model: Llama, tokenizer: Tokenizer, adapter: LoraAdapter, energy: float, chats: list[dict] | None = None
    ) -> Generator[None, None, ProtectedSubspace]:
        """The subspace from ``chats`` (default: the ordinary ShareGPT conversations), a layer per slice."""
        if not 0.0 < energy < 1.0:
            raise ValueError(f"energy must be in (0, 1) (got {energy!r})")
        chats = chats if chats is not None else json.loads(ORDINARY_FILE.read_text())
        pairs = [(torch.tensor(tokenizer.user_prompt(c["user"]), device=model.device),
                  torch.tensor(tokenizer.encode_reply(c["assistant"]), device=model.device))
                 for c in chats]  # fmt: skip
        moments = _Moments(set(adapter.A.keys()))
        with torch.no_grad():
            for start in range(0, len(pairs), 16):
                yield from responses_hidden_slices(model, moments, pairs[start : start + 16])  # type: ignore[arg-type]
        bases, free = {}, set()
        for key, moment in moments.sums.items():
            yield
            vectors, k = principal_directions(moment, energy)
            if k <= vectors.shape[1] - k:
                bases[key] = vectors[:, :k].contiguous().to(adapter.A[key].device)
            else:  # fewer free directions than protected ones: keep those (a third less memory on SmolLM2)
                bases[key] = vectors[:, k:].contiguous().to(adapter.A[key].device)
                free.add(key)
        return cls(bases, frozenset(free))

    @classmethod
    def load_or_compute_slices(
        cls, model: Llama, tokenizer: Tokenizer, adapter: LoraAdapter, energy: float, directory: Path | None = None
    ) -> Generator[None, None, ProtectedSubspace]:
        """``compute_slices`` for the ordinary chats, or what an earlier computation left in ``directory`` (default:
        the model cache, ``default_cache_dir()``) under the same key; a new result is left there for the next start."""
        chats_bytes = ORDINARY_FILE.read_bytes()
        key = _cache_key(model, adapter, energy, chats_bytes)
        path = (directory or default_cache_dir()) / f"protected-{key}.safetensors"
        # Processes of one machine that start together (servers, a test run's two workers) compute it once: the one
        # holding the lock computes, the others wait in slices of WAIT_S (serving on between them), then load.
        with _ComputeLock(path.with_name(f"{path.name}.lock")) as lock:
            while not lock.acquire():
                yield
                time.sleep(WAIT_S)
            if path.is_file():
                try:
                    return cls._load(path)
                except Exception as e:  # a torn or foreign file: computed again and replaced
                    logger.warning("protected directions: %s unreadable (%s); computing them again", path, e)
            subspace = yield from cls.compute_slices(model, tokenizer, adapter, energy, json.loads(chats_bytes))
            try:
                subspace._save(path)
            except OSError as e:  # a read-only home: computed at every start, as before
                logger.warning("protected directions: not cached (%s)", e)
            return subspace

    def _save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        tensors = {key: basis.detach().cpu().contiguous() for key, basis in self.bases.items()}
        save_file(tensors, partial, metadata={"free": json.dumps(sorted(self.free))})
        os.replace(partial, path)  # whole or absent: a concurrent reader never sees half a file

    @classmethod
    def _load(cls, path: Path) -> ProtectedSubspace:
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            free = frozenset(json.loads((f.metadata() or {})["free"]))
        return cls(load_file(path), free)

    def describe(self) -> str:
        """How many directions are protected (of how many) and what the bases hold in memory."""
        kept = sum(b.shape[0] - b.shape[1] if k in self.free else b.shape[1] for k, b in self.bases.items())
        total = sum(b.shape[0] for b in self.bases.values())
        mib = sum(b.numel() * b.element_size() for b in self.bases.values()) / 2**20
        return f"{kept} of {total} input directions over {len(self.bases)} seams, {mib:.0f} MiB"

    @torch.no_grad()
    def project_(
        self, adapter: LoraAdapter, split: RankSplit | None = None, origin: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Each seam's A loses its components along the protected directions: A <- A - (A M) M^T, or A <- (A F) F^T
        with the free directions F. With ``split``, only the rows of its shared ranks (preferences' are free). With
        ``origin`` (per seam, the A an adapter made elsewhere was loaded with), only what moved from it: that adapter's
        own directions are its maker's, and taking them out would change its answers before it learned anything."""
        for key, basis in self.bases.items():
            a = adapter.A[key] if split is None else split.a_rows(adapter.A[key], preference=False)
            start = None if origin is None else origin[key] if split is None else split.a_rows(origin[key], False)
            moved = a if start is None else a - start
            inside = ((moved.float() @ basis) @ basis.t()).to(a.dtype)
            if key in self.free:
                a.copy_(inside if start is None else start + inside)
            else:
                a.sub_(inside)


class _ComputeLock:
    """An exclusive ``flock`` on a file beside the cache entry, taken without blocking; released on exit, and by the
    kernel if the process dies. Where the file cannot be made (a read-only cache), every process computes."""

    def __init__(self, path: Path) -> None:
        self.path, self.fd = path, None

    def __enter__(self) -> _ComputeLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            self.fd = None
        return self

    def acquire(self) -> bool:
        if self.fd is None:
            return True
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock


def _cache_key(model: Llama, adapter: LoraAdapter, energy: float, chats: bytes) -> str:
    """A digest of what the subspace depends on: the model's weights and dtype (``weights_digest``), the adapter's
    seams and their input widths (an adapter of another rank has the same subspace), the energy, the chats, and
    FORMAT."""
    digest = hashlib.sha256(f"{FORMAT}|{energy!r}|{weights_digest(model)}".encode())
    digest.update(json.dumps(sorted((k, a.shape[1]) for k, a in adapter.A.items())).encode())  # not the rank
    digest.update(chats)
    return digest.hexdigest()[:32]


def principal_directions(moment: torch.Tensor, energy: float) -> tuple[torch.Tensor, int]:
    """The eigenvectors (columns, leading first) of a symmetric second-moment matrix, and the fewest leading ones,
    k, that hold ``energy`` of its trace.

    In fp32: on the default model's seams it cuts at fp64's k, its subspaces hold fp64's energy to 8e-7, and it takes
    half the time (docs/benchmarks.md, "The suite on two workers"). Where the bases differ, the eigenvalues on either
    side of the cut are within 0.3% of each other, and either split holds the same energy."""
    values, vectors = torch.linalg.eigh(moment.float())
    values, vectors = values.double().flip(0).clamp(min=0), vectors.flip(1)
    held = values.cumsum(0) / values.sum()
    k = min(int((held < energy).sum()) + 1, len(values))
    return vectors, k
