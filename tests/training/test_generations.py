"""Replicas in lockstep through their group's generations (alchemist.training.generations), against one process:
replicas 0 and 1 (spawned processes, a tiny random model, fp32, each its own log and checkpoints) train a batch
of their corrections together; replica 1 then dies (``os._exit``, between rounds): replica 0's next collective
fails, and it trains on alone in the generation published without the dead one; a new replica 1 with no checkpoint
joins the next generation and catches up (the adapter and optimizer state of replica 0's version); a second batch
of corrections, logged on both, trains in lockstep again. Both then hold one process's adapter after the same two
batches, and each other's bitwise; a rollback asked of one replica is made by both."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from alchemist.training.data_parallel import DataParallel
from alchemist.training.generations import Generations
from alchemist.training.lockstep import Lockstep
from tests.training.test_lockstep import Side, corrections

FIRST = {0: [0], 1: [1, 2, 3]}  # batch one: which corrections each replica logs
SECOND = {0: [4, 5], 1: [6, 7]}  # batch two (the new replica 1's)


def _replica(index: int, phase: str, address: str, model_dir: str, out_dir: str) -> None:
    """Replica ``index``: ``first`` trains batch one and dies; ``second`` (a new replica 1) joins, catches up and
    trains batch two; ``both`` (replica 0) trains batch one, outlives replica 1 and trains batch two with the new
    one."""
    torch.set_num_threads(1)  # two replicas on a shared 2-core machine
    generations = Generations.connect(address)
    lockstep = Lockstep(DataParallel(torch.device("cpu")), 0.0, generations, index, timeout_s=60)
    side = Side(Path(out_dir) / f"{phase}{index}", Path(model_dir), lockstep)
    pairs = corrections(8)
    if phase != "second":
        side.log([(i, pairs[i]) for i in FIRST[index]])
        side.train_until_idle()
    if phase == "first":
        os._exit(0)  # no goodbye: the others find out at their next collective
    if phase == "both":
        torch.save(side.seen(), Path(out_dir) / "after-first.pt")
    # Alone in generation 2, then with the new replica, until generation 3's regroup (and catch-up) has ended: the
    # agreement on idleness below is a collective outside the loop's rounds, so both must come to it between rounds.
    while not (lockstep.joined and lockstep.generation == 3) or side.trainer.in_batch:
        if side.trainer.has_work():  # as the server's time share asks before each slice
            side.trainer.run_slice()
    side.log([(i, pairs[i]) for i in SECOND[index]])
    side.train_until_idle()
    torch.save(side.seen(), Path(out_dir) / f"{phase}{index}.pt")
    # A rollback asked of replica 0 (version 3: batch one's) is made by both, at their next round.
    asked = side.trainer.rollback(3) if index == 0 else None
    while side.trainer.version != 7 or side.trainer.in_batch or asked is not None and not asked.done():
        side.trainer.run_slice()
    assert asked is None or asked.result() == 7
    torch.save(side.seen(), Path(out_dir) / f"rolled-back{index}.pt")


def test_a_replica_that_died_is_replaced_and_the_group_trains_on_from_its_version(tmp_path, tiny_dirs):
    model_dir = tiny_dirs["llama-gqa-untied"]
    pairs = corrections(8)
    alone = Side(tmp_path / "alone", model_dir, None)
    alone.log([(i, pairs[i]) for i in range(4)])
    alone.train_until_idle()
    after_first = alone.seen()
    alone.log([(i, pairs[i]) for i in range(4, 8)])
    alone.train_until_idle()
    want = alone.seen()

    generations = Generations.host("127.0.0.1")
    generations.publish([0, 1])
    ctx = mp.get_context("spawn")
    args = (generations.address, str(model_dir), str(tmp_path))
    survivor = ctx.Process(target=_replica, args=(0, "both", *args))
    dying = ctx.Process(target=_replica, args=(1, "first", *args))
    survivor.start(), dying.start()
    dying.join(timeout=180)
    assert dying.exitcode == 0
    generations.publish([0])  # as the front does once it sees replica 1 dead
    newcomer = ctx.Process(target=_replica, args=(1, "second", *args))
    newcomer.start()
    generations.publish([0, 1])  # as the front does once the new replica serves
    deadline = time.monotonic() + 180
    for process in (survivor, newcomer):
        process.join(timeout=max(1.0, deadline - time.monotonic()))
        assert process.exitcode == 0, process
    first = torch.load(tmp_path / "after-first.pt", weights_only=False)
    seen = [torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in ("both0", "second1")]

    # Batch one in lockstep: one process's version and adapter (to rounding: tests/training/test_lockstep.py).
    assert first["version"] == after_first["version"] == 3
    for name, value in after_first["adapter"].items():
        torch.testing.assert_close(first["adapter"][name], value, rtol=0, atol=3e-5, msg=name)
    # The new replica took version 3 from replica 0 (checkpointed as its own), then batch two with it: version 6.
    assert want["version"] == 6 and all(s["version"] == s["served"] == 6 for s in seen)
    assert seen[1]["checkpoints"] == [3, 6] and seen[0]["checkpoints"] == [3, 6]
    assert seen[1]["states"] == [("trained", 6)] * len(SECOND[1])  # its own entries, once each
    for name, value in want["adapter"].items():
        assert torch.equal(seen[0]["adapter"][name], seen[1]["adapter"][name]), name
        torch.testing.assert_close(seen[0]["adapter"][name], value, rtol=0, atol=6e-5, msg=name)
    # The rollback reached both: version 7 serves version 3's weights (the new replica's from the state it took).
    for index in (0, 1):
        rolled_back = torch.load(tmp_path / f"rolled-back{index}.pt", weights_only=False)
        assert rolled_back["version"] == rolled_back["served"] == 7
        for name, value in first["adapter"].items():
            assert torch.equal(rolled_back["adapter"][name], value), (index, name)
