"""Adapter checkpoints: bit-exact round trips, keep-N pruning, crashes mid-save (a real SIGKILL in a subprocess)
leave the previous version as the latest and are cleaned at start-up, and broken files are named in errors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alchemist.model.config import ModelConfig
from alchemist.model.lora import LoraAdapter
from alchemist.model.peft_format import load_adapter
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.slices import run_to_end

CONFIG = ModelConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)
REPO = Path(__file__).resolve().parents[2]


def trained(seed: int) -> tuple[LoraAdapter, dict]:
    """An adapter with non-zero A and B, and the state of an AdamW that took two steps on it."""
    torch.manual_seed(seed)
    adapter = LoraAdapter(CONFIG, seed=seed)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=1e-3)
    for _ in range(2):
        for p in adapter.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    return adapter, optimizer.state_dict()


def assert_same_state(got, want) -> None:
    """Nested optimizer state: equal structure, tensors bitwise equal."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            assert_same_state(got[key], want[key])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same_state(g, w)
    else:
        assert got == want


def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_round_trip_is_bit_exact(tmp_path):
    adapter, state = trained(seed=0)
    adapter.version = 3  # the saved version is the one given to save(), whatever the adapter says
    checkpoints = AdapterCheckpoints(tmp_path, keep=3, base_model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert checkpoints.latest() is None and checkpoints.versions() == []
    saved = run_to_end(
        checkpoints.save_slices(7, adapter, state, log_position=1234, metrics={"loss": 0.5, "samples": 8})
    )

    loaded, loaded_state, position = checkpoints.load(7, CONFIG)
    assert position == 1234 and loaded.version == 7
    want = adapter.module_tensors()
    for key, t in loaded.module_tensors().items():
        assert t.dtype == want[key].dtype and torch.equal(t, want[key]), key
    assert_same_state(loaded_state, state)
    torch.optim.AdamW(loaded.parameters(), lr=1e-3).load_state_dict(loaded_state)  # usable as it is

    info = checkpoints.latest()
    assert info == saved and checkpoints.versions() == [info]
    assert (info.version, info.log_position, info.metrics, info.path) == (7, 1234, saved.metrics, tmp_path / "v000007")
    assert info.metrics == {"loss": 0.5, "samples": 8} and info.created_s > 0
    assert load_adapter(info.path / "adapter", CONFIG).version == 7  # a plain PEFT adapter directory
    peft_config = json.loads((info.path / "adapter" / "adapter_config.json").read_text())
    assert peft_config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert entries(tmp_path) == ["LATEST", "v000007"]
    assert AdapterCheckpoints(tmp_path, keep=3).latest() == info  # a restart sees the same


def test_only_the_newest_keep_versions_stay(tmp_path):
    adapter, state = trained(seed=1)
    checkpoints = AdapterCheckpoints(tmp_path, keep=2)
    for version in range(1, 6):
        run_to_end(checkpoints.save_slices(version, adapter, state, log_position=10 * version, metrics={}))
        assert [v.version for v in checkpoints.versions()] == list(range(max(1, version - 1), version + 1))
    assert entries(tmp_path) == ["LATEST", "v000004", "v000005"]
    assert checkpoints.latest().log_position == 50
    reopened = AdapterCheckpoints(tmp_path, keep=1)  # a smaller keep applies from the next save
    run_to_end(reopened.save_slices(6, adapter, state, log_position=60))
    assert entries(tmp_path) == ["LATEST", "v000006"]


def test_the_serving_version_is_the_newest_promoted_and_is_never_pruned(tmp_path):
    """Versions the evaluation gate kept from serving pile up after the one that serves: it stays, whatever keep."""
    adapter, state = trained(seed=1)
    checkpoints = AdapterCheckpoints(tmp_path, keep=2)
    run_to_end(checkpoints.save_slices(1, adapter, state, log_position=1, metrics={"evaluation": {"promoted": True}}))
    run_to_end(checkpoints.save_slices(2, adapter, state, log_position=2, metrics={}))  # from before the gate: promoted
    assert checkpoints.serving().version == 2
    for version in range(3, 7):
        held = {"evaluation": {"promoted": False}}
        run_to_end(checkpoints.save_slices(version, adapter, state, log_position=version, metrics=held))
    assert [v.version for v in checkpoints.versions()] == [2, 5, 6] and checkpoints.serving().version == 2
    assert [v.promoted for v in checkpoints.versions()] == [True, False, False]
    rollback = {"rollback_of": 5}  # an admin's: promoted
    run_to_end(checkpoints.save_slices(7, adapter, state, log_position=7, metrics=rollback))
    assert [v.version for v in checkpoints.versions()] == [6, 7] and checkpoints.serving().version == 7


def test_bad_arguments_are_refused(tmp_path):
    adapter, state = trained(seed=2)
    with pytest.raises(ValueError, match="keep"):
        AdapterCheckpoints(tmp_path, keep=0)
    checkpoints = AdapterCheckpoints(tmp_path, keep=2)
    run_to_end(checkpoints.save_slices(2, adapter, state, log_position=0))
    with pytest.raises(ValueError, match="not newer than the latest saved version 2"):
        run_to_end(checkpoints.save_slices(2, adapter, state, log_position=0))
    with pytest.raises(ValueError, match="log_position"):
        run_to_end(checkpoints.save_slices(3, adapter, state, log_position=-1))
    with pytest.raises(ValueError, match="metrics must be JSON-serializable"):
        run_to_end(checkpoints.save_slices(3, adapter, state, log_position=0, metrics={"t": torch.zeros(1)}))
    with pytest.raises(ValueError, match=r"no checkpoint version 1 \(versions: \[2\]\)"):
        checkpoints.load(1, CONFIG)
    assert entries(tmp_path) == ["LATEST", "v000002"]


# The crashing save runs in a subprocess that SIGKILLs itself at one point of the protocol (no cleanup code runs).
CRASH = r"""
import os, shutil, signal, sys
import torch
import alchemist.model.peft_format as peft_format
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.slices import run_to_end
from tests.training.test_checkpoint import trained

directory, point = sys.argv[1], sys.argv[2]
die = lambda: os.kill(os.getpid(), signal.SIGKILL)

def partial_then_die(data, path, *args, **kwargs):
    with open(path, "wb") as f:
        f.write(b"\x00" * 100)
    die()

if point == "adapter":  # inside the adapter's safetensors write
    peft_format.save_file = partial_then_die
elif point == "optimizer":  # inside torch.save of the optimizer state
    torch.save = partial_then_die
elif point == "before-pointer":  # the version directory is complete and renamed, LATEST not yet replaced
    AdapterCheckpoints._point_latest = lambda self, name: die()
elif point == "pointer":  # the new LATEST is written to its temporary file, not yet renamed over LATEST
    os.replace = lambda src, dst: die()
elif point == "prune":  # LATEST points at the new version; an old one is half deleted
    real_rmtree = shutil.rmtree
    def rmtree(path, *args, **kwargs):
        if str(path).endswith("-discarded"):
            os.unlink(os.path.join(path, "optimizer.pt"))
            die()
        return real_rmtree(path, *args, **kwargs)
    shutil.rmtree = rmtree
adapter, state = trained(seed=3)
run_to_end(AdapterCheckpoints(directory, keep=2).save_slices(3, adapter, state, log_position=30))
"""


@pytest.mark.parametrize("point", ["adapter", "optimizer", "before-pointer", "pointer", "prune"])
def test_a_save_killed_midway_leaves_the_previous_version(tmp_path, point):
    adapter, state = trained(seed=4)
    checkpoints = AdapterCheckpoints(tmp_path, keep=2)
    run_to_end(checkpoints.save_slices(1, adapter, state, log_position=10))
    run_to_end(checkpoints.save_slices(2, adapter, state, log_position=20))
    crashed = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path), point], cwd=REPO, capture_output=True)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr.decode()
    assert len(entries(tmp_path)) > 3  # it left something behind

    reopened = AdapterCheckpoints(tmp_path, keep=2)
    if point == "prune":  # the save was committed; only the half-deleted old version is left to clean
        assert [v.version for v in reopened.versions()] == [2, 3]
        assert entries(tmp_path) == ["LATEST", "v000002", "v000003"]
        return
    assert reopened.latest().version == 2 and [v.version for v in reopened.versions()] == [1, 2]
    assert entries(tmp_path) == ["LATEST", "v000001", "v000002"]
    loaded, loaded_state, position = reopened.load(2, CONFIG)
    assert position == 20 and torch.equal(loaded.B["0_q_proj"], adapter.B["0_q_proj"])
    assert_same_state(loaded_state, state)
    run_to_end(reopened.save_slices(3, adapter, state, log_position=30))  # and the trainer carries on
    assert entries(tmp_path) == ["LATEST", "v000002", "v000003"]


def test_a_save_in_slices_commits_only_at_its_end_and_a_closed_one_leaves_nothing(tmp_path):
    """The online trainer saves in slices (serving steps in between): until the last slice the previous version
    is the latest; one abandoned midway (a rollback, the trainer's batch dropped) leaves no files behind."""
    adapter, state = trained(seed=6)
    checkpoints = AdapterCheckpoints(tmp_path, keep=3)
    run_to_end(checkpoints.save_slices(1, adapter, state, log_position=10))
    slices = checkpoints.save_slices(2, adapter, state, log_position=20)
    for _ in range(2):
        next(slices)
        assert checkpoints.latest().version == 1 and checkpoints.versions()[-1].version == 1
    with pytest.raises(StopIteration) as done:
        next(slices)
    assert done.value.value == checkpoints.latest() and checkpoints.latest().log_position == 20
    assert entries(tmp_path) == ["LATEST", "v000001", "v000002"]

    abandoned = checkpoints.save_slices(3, adapter, state, log_position=30)
    next(abandoned)
    next(abandoned)
    abandoned.close()
    assert checkpoints.latest().version == 2 and entries(tmp_path) == ["LATEST", "v000001", "v000002"]


def test_leftovers_of_a_crash_are_removed_at_start_up(tmp_path):
    adapter, state = trained(seed=5)
    run_to_end(AdapterCheckpoints(tmp_path, keep=3).save_slices(1, adapter, state, log_position=10))
    (tmp_path / ".tmp-v000002-abc").mkdir()  # a save that died while writing
    (tmp_path / ".tmp-v000002-abc" / "optimizer.pt").write_bytes(b"partial")
    (tmp_path / "v000003").mkdir()  # a version renamed into place whose LATEST update never happened
    (tmp_path / "v000003" / "checkpoint.json").write_text("{}")
    (tmp_path / ".tmp-LATEST").write_text("v000003\n")
    checkpoints = AdapterCheckpoints(tmp_path, keep=3)
    assert checkpoints.latest().version == 1 and [v.version for v in checkpoints.versions()] == [1]
    assert entries(tmp_path) == ["LATEST", "v000001"]


def test_a_first_save_that_never_committed_leaves_nothing(tmp_path):
    (tmp_path / "v000001" / "adapter").mkdir(parents=True)
    checkpoints = AdapterCheckpoints(tmp_path, keep=3)
    assert checkpoints.latest() is None and entries(tmp_path) == []


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:50])


@pytest.mark.parametrize(
    ("relative", "damage", "message"),
    [
        ("adapter/adapter_model.safetensors", truncate, "corrupt or truncated safetensors"),
        ("adapter/adapter_model.safetensors", Path.unlink, "not found"),
        ("adapter/adapter_config.json", Path.unlink, "not found"),
        ("optimizer.pt", truncate, "cannot be read as an optimizer state"),
        ("optimizer.pt", Path.unlink, "not found"),
        ("checkpoint.json", truncate, "corrupt checkpoint metadata"),
        ("checkpoint.json", Path.unlink, "not found"),
    ],
)
def test_a_broken_file_is_named(tmp_path, relative, damage, message):
    adapter, state = trained(seed=6)
    checkpoints = AdapterCheckpoints(tmp_path, keep=3)
    run_to_end(checkpoints.save_slices(1, adapter, state, log_position=10))
    path = tmp_path / "v000001" / relative
    damage(path)
    with pytest.raises(ValueError, match=message) as error:
        checkpoints.load(1, CONFIG)
    assert str(path) in str(error.value)


def test_a_garbled_latest_pointer_is_named_and_nothing_is_deleted(tmp_path):
    adapter, state = trained(seed=7)
    run_to_end(AdapterCheckpoints(tmp_path, keep=3).save_slices(1, adapter, state, log_position=10))
    (tmp_path / "LATEST").write_text("garbage")
    with pytest.raises(ValueError, match="LATEST: expected a version directory name"):
        AdapterCheckpoints(tmp_path, keep=3)
    assert entries(tmp_path) == ["LATEST", "v000001"]
