"""Protected directions (alchemist.training.protected): the adapter's A is kept orthogonal to the principal
directions of ordinary chat's inputs at each seam, so that what it learns barely moves ordinary inputs' outputs.
Its learning effect on the real model is measured in docs/benchmarks.md ("Learning a correction with the
defaults"); here: the directions hold the asked energy, the projection keeps A out of them through training, and
ordinary inputs' deltas shrink with it."""

from __future__ import annotations

import fcntl
import json
import os

import pytest
import torch

from alchemist.model.loader import build_model
from alchemist.model.lora import LoraAdapter, LoraConfig
from alchemist.training.protected import ORDINARY_FILE, ProtectedSubspace, principal_directions
from alchemist.training.recompute import responses_hidden_slices
from alchemist.training.slices import run_counting, run_to_end
from tests.training.test_online import drain, online, serve_and_log


def test_principal_directions_hold_the_asked_energy():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(500, 12, generator=g) * torch.tensor([10.0, 5, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    moment = rows.t() @ rows
    vectors, k = principal_directions(moment, 0.8)
    assert torch.allclose(vectors.t() @ vectors, torch.eye(12), atol=1e-5)  # orthonormal
    values = torch.linalg.eigvalsh(moment.double()).flip(0)
    assert values[:k].sum() / values.sum() >= 0.8 > values[: k - 1].sum() / values.sum()  # the fewest that do
    assert principal_directions(moment, 0.999)[1] > k


class _Tok:
    """Plain-text prompts for a tiny model (no chat template), as ``Tokenizer.user_prompt`` makes them."""

    def user_prompt(self, text: str) -> list[int]:
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % 200 for c in text]

    def encode_reply(self, text: str) -> list[int]:
        return self.encode(text) + [2]


def _chats(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "river", "stone", "blue", "cat", "tower", "seven", "song", "glass", "north", "field", "lamp"]
    pick = lambda k: " ".join(words[i] for i in torch.randint(0, len(words), (k,), generator=g).tolist())  # noqa: E731
    return [{"user": pick(6), "assistant": pick(10)} for _ in range(n)]


def test_projection_removes_the_protected_directions_from_every_seam(tiny_dirs):
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    adapter = LoraAdapter(model.config, seed=0)
    protected = run_to_end(ProtectedSubspace.compute_slices(model, _Tok(), adapter, 0.9, _chats(12, 1)))
    assert set(protected.bases) == set(adapter.A.keys())
    bases = {key: protected.protected_basis(key) for key in protected.bases}
    kept = sum(b.shape[1] for b in bases.values())
    assert protected.describe().startswith(f"{kept} of ") and f"over {len(adapter.A)} seams" in protected.describe()
    assert all(b.shape[1] <= b.shape[0] / 2 for b in protected.bases.values())  # the smaller side is kept
    protected.project_(adapter)
    for key, basis in bases.items():
        assert 0 < basis.shape[1] < basis.shape[0]  # some directions protected, some left to learn in
        assert torch.allclose(basis.t() @ basis, torch.eye(basis.shape[1]), atol=1e-5)
        assert (adapter.A[key] @ basis).abs().max() < 1e-5, key
        assert adapter.A[key].abs().max() > 0  # what is left of A is kept
    with pytest.raises(ValueError):
        run_to_end(ProtectedSubspace.compute_slices(model, _Tok(), adapter, 1.0, _chats(2, 1)))


def test_an_adapter_made_elsewhere_keeps_its_own_directions_and_only_its_update_is_projected(tiny_dirs):
    """A named adapter loaded from PEFT (``origin``: its A as loaded): projecting it as loaded changes nothing, and
    after an update only the update loses the protected directions (taking them out of its own A would change
    its answers before it learned anything)."""
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    adapter = LoraAdapter(model.config, seed=0)
    protected = run_to_end(ProtectedSubspace.compute_slices(model, _Tok(), adapter, 0.9, _chats(12, 1)))
    origin = {key: a.detach().clone() for key, a in adapter.A.items()}
    protected.project_(adapter, origin=origin)
    assert all(torch.equal(adapter.A[key], a) for key, a in origin.items())  # as loaded: untouched
    g = torch.Generator().manual_seed(1)
    steps = {key: torch.randn(a.shape, generator=g) * 1e-2 for key, a in origin.items()}
    with torch.no_grad():
        for key, step in steps.items():
            adapter.A[key].add_(step)
    protected.project_(adapter, origin=origin)
    for key, a in origin.items():
        basis = protected.protected_basis(key)
        moved = adapter.A[key] - a
        assert (moved @ basis).abs().max() < 1e-5, key  # the update keeps out of the protected directions
        assert (a @ basis).abs().max() > 1e-3  # ... while the adapter's own A still has them
        torch.testing.assert_close(moved, step_without(steps[key], basis), rtol=0, atol=1e-6)


def step_without(step: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    return step - (step @ basis) @ basis.t()


def test_trained_adapter_stays_orthogonal_and_ordinary_deltas_shrink(engine, tmp_path):
    # The online trainer with protection on (the default) and without: after the same batches, every seam's A
    # is still out of the protected directions in its corrections' ranks (the preference ranks are free), and the
    # adapter's delta on ordinary inputs is smaller than the unprotected adapter's (what the protection is for),
    # while both trained (B moved).
    protected_run, log, _ = online(engine, tmp_path / "p", adapter={"protect_energy": 0.9})
    serve_and_log(engine, log, 4)
    drain(protected_run)
    plain_run, plain_log, _ = online(engine, tmp_path / "u")
    for entry in log.read(after_seq=0):
        fields = ("response_id", "kind", "rating", "correction", "prompt_token_ids", "response_token_ids",
                  "output_token_ids", "adapter_version", "recorded")  # fmt: skip
        plain_log.append(**{k: getattr(entry, k) for k in fields})
    drain(plain_run)
    subspace = protected_run.protected
    assert subspace is not None and plain_run.protected is None
    split = protected_run.trainer.split  # the corrections' ranks are protected; the preference ranks are free
    assert split is not None
    for key in subspace.bases:
        a = protected_run.adapter.A[key]
        shared = split.a_rows(a, preference=False).reshape(-1, a.shape[-1])
        assert (shared @ subspace.protected_basis(key)).abs().max() < 1e-4, key
    assert all(b.abs().max() > 0 for b in protected_run.adapter.B.values())

    # The deltas on ordinary chat's inputs (those the directions were taken from), at every seam.
    inputs = _seam_inputs(engine.model, engine.tokenizer)
    assert _delta_norm(protected_run.adapter, inputs) < 0.5 * _delta_norm(plain_run.adapter, inputs)


class _Inputs:
    """An adapter that adds nothing and keeps every seam's inputs."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, str], list[torch.Tensor]] = {}

    def delta(self, layer: int, name: str, x: torch.Tensor) -> None:
        self.rows.setdefault((layer, name), []).append(x.detach().clone())


def _seam_inputs(model, tokenizer) -> dict[tuple[int, str], torch.Tensor]:
    chats = json.loads(ORDINARY_FILE.read_text())[:16]
    pairs = [(torch.tensor(tokenizer.encode(c["user"])), torch.tensor(tokenizer.encode_reply(c["assistant"])))
             for c in chats]  # fmt: skip
    capture = _Inputs()
    with torch.no_grad():
        run_to_end(responses_hidden_slices(model, capture, pairs))
    return {key: torch.cat(rows) for key, rows in capture.rows.items()}


def _delta_norm(adapter: LoraAdapter, inputs: dict[tuple[int, str], torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(float(adapter.delta(layer, name, x).norm()) for (layer, name), x in inputs.items())


def test_the_subspace_is_cached_under_a_key_of_all_it_depends_on(tiny_dirs, tmp_path):
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    adapter = LoraAdapter(model.config, seed=0)
    load = lambda energy: run_counting(  # noqa: E731
        ProtectedSubspace.load_or_compute_slices(model, _Tok(), adapter, energy, tmp_path)
    )
    computed, work = load(0.9)
    (cached_file,) = tmp_path.glob("protected-*.safetensors")
    loaded, no_work = load(0.9)
    assert work > 0 and no_work == 0  # the second start loads: not a slice of work
    other_rank = LoraAdapter(model.config, LoraConfig(r=4), seed=1)  # the same seams: the same subspace
    assert run_counting(ProtectedSubspace.load_or_compute_slices(model, _Tok(), other_rank, 0.9, tmp_path))[1] == 0
    reference = run_to_end(ProtectedSubspace.compute_slices(model, _Tok(), adapter, 0.9))
    for subspace in (computed, loaded):
        assert subspace.free == reference.free and set(subspace.bases) == set(reference.bases)
        for key, basis in reference.bases.items():
            torch.testing.assert_close(subspace.bases[key], basis, rtol=0, atol=0)
    load(0.8)  # another energy, another entry
    weight, original = model.layers[0].qkv_weight, model.layers[0].qkv_weight[0, 0].item()
    with torch.no_grad():
        weight[0, 0] += 1e-3  # other weights, another entry
    load(0.9)
    assert len(list(tmp_path.glob("protected-*.safetensors"))) == 3
    with torch.no_grad():
        weight[0, 0] = original
    cached_file.write_bytes(cached_file.read_bytes()[:100])  # torn: computed again and replaced
    again, work_again = load(0.9)
    assert work_again > 0 and cached_file.stat().st_size > 100
    torch.testing.assert_close(again.bases[next(iter(again.bases))], reference.bases[next(iter(again.bases))])


def test_a_process_waits_for_the_subspace_another_computes_then_loads_it(tiny_dirs, tmp_path):
    """While another process holds the entry's lock (computing it), the loader yields without work; once that one
    has written the entry and let go, the loader reads it: computed once."""
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    adapter = LoraAdapter(model.config, seed=0)
    computed, work = run_counting(ProtectedSubspace.load_or_compute_slices(model, _Tok(), adapter, 0.9, tmp_path))
    assert work > 4
    (entry,) = tmp_path.glob("protected-*.safetensors")
    held = entry.read_bytes()
    entry.unlink()
    other = os.open(entry.with_name(f"{entry.name}.lock"), os.O_RDWR)  # another open file: another process's lock
    fcntl.flock(other, fcntl.LOCK_EX)
    loading = ProtectedSubspace.load_or_compute_slices(model, _Tok(), adapter, 0.9, tmp_path)
    for _ in range(3):
        next(loading)  # waiting (computing, it would go on for more slices than are left below)
    entry.write_bytes(held)  # the other process's result ...
    os.close(other)  # ... and its lock let go
    loaded, slices = run_counting(loading)
    assert slices == 0 and loaded.free == computed.free
    for key, basis in computed.bases.items():
        torch.testing.assert_close(loaded.bases[key], basis, rtol=0, atol=0)
