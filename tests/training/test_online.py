"""The online trainer in process, on a tiny random model and a real engine, feedback log and checkpoints: batches
from the log, replay where records exist, publish + checkpoint per batch, resume exactly, abandon on failure,
rollback. (tests/server/test_online.py runs the same loop end to end on the real model over HTTP.)"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from alchemist.config import OnlineConfig, TrainerConfig
from alchemist.config.training import (
    AdapterConfig,
    AnchorsConfig,
    GateConfig,
    QueueConfig,
    RehearsalConfig,
    StoppingConfig,
)
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.feedback.log import FeedbackLog
from alchemist.feedback.sqlite_log import SQLiteFeedbackLog
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.data_parallel import DataParallel
from alchemist.training.feedback_batch import FeedbackBatch
from alchemist.training.feedback_queue import EMPTY
from alchemist.training.generations import Generations
from alchemist.training.lineage import as_trained
from alchemist.training.lockstep import Lockstep
from alchemist.training.online import OnlineTrainer
from alchemist.training.recompute import recompute_loss
from alchemist.training.slices import run_to_end as run_to_end_of
from alchemist.training.trainer import Sample, StepResult
from tests.engine.helpers import random_prompts, run_to_end


def serve_and_log(
    engine: LLMEngine, log: FeedbackLog, num: int, seed: int = 0, key_name: str | None = None, repeat: bool = False
) -> list[int]:
    """Serves ``num`` prompts (recorded) and logs a correction of each (six tokens; with ``repeat`` one token six
    times: what a tiny random model learns in a few steps); returns the entries' seqs."""
    prompts = random_prompts([20 + 3 * i for i in range(num)], seed=seed)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{seed}-{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    outputs = run_to_end(engine)
    seqs = []
    for i, prompt in enumerate(prompts):
        out = outputs[f"r{seed}-{i}"][-1]
        entry, created = log.append(
            response_id=f"r{seed}-{i}",
            kind="sft",
            correction="x",
            prompt_token_ids=prompt,
            response_token_ids=[(7 * i + (0 if repeat else j)) % 256 for j in range(6)],
            output_token_ids=out.output_token_ids,
            adapter_version=engine.adapter_version,
            recorded=True,
            key_name=key_name,
        )
        assert created
        seqs.append(entry.seq)
    return seqs


def drain(trainer: OnlineTrainer, max_slices: int = 10_000) -> int:
    slices = 0
    while trainer.has_work():
        trainer.run_slice()
        slices += 1
        assert slices < max_slices
    return slices


def tiny_loop_config(**sections: dict) -> OnlineConfig:
    """The online loop's settings for a tiny random model; ``sections``: others, by section (``stopping={"epochs":
    3}`` changes that one setting of the section).

    No evaluation gate: its canaries and held-out chats need a chat model (tests/training/test_evaluation.py).
    No protected directions: on a tiny random model they would only make its outputs harder to move, which these
    tests of the loop's mechanics need (tests/training/test_protected.py tests them). No known-fact anchors (their
    text means nothing to a tiny model: tests/training/test_anchors.py has them), served anchors all in every step
    (turn 1: test_anchors_take_turns has more) and no rehearsal (test_rehearsal_... has it): each batch trains its
    own feedback and nothing else."""
    config = OnlineConfig(
        trainer=TrainerConfig(lr=1e-2), queue=QueueConfig(batch_size=2, max_wait_s=0.0),
        stopping=StoppingConfig(epochs=2, target_loss=0.0, target_token_p=0.0), gate=GateConfig(enabled=False),
        adapter=AdapterConfig(protect_energy=0.0), anchors=AnchorsConfig(known_facts=0, turn=1),
        rehearsal=RehearsalConfig(corrections=0),
    )  # fmt: skip
    for name, settings in sections.items():
        setattr(config, name, dataclasses.replace(getattr(config, name), **settings))
    return config


def online(engine, tmp_path: Path, **sections: dict) -> tuple[OnlineTrainer, FeedbackLog, AdapterCheckpoints]:
    """A trainer beside ``engine`` with ``tiny_loop_config(**sections)``."""
    log = SQLiteFeedbackLog(tmp_path / "feedback.sqlite")
    checkpoints = AdapterCheckpoints(tmp_path / "adapters", keep=50)
    config = tiny_loop_config(**sections)
    return beside(engine, log, checkpoints, config), log, checkpoints


def beside(engine: LLMEngine, log: FeedbackLog, checkpoints: AdapterCheckpoints, config: OnlineConfig) -> OnlineTrainer:
    """The trainer as the app composes it: the engine's model, publishing to the engine, replaying from its store."""
    return OnlineTrainer.from_config(engine.model, engine.tokenizer, engine, engine.store, log, checkpoints, config)


def roll_back(trainer: OnlineTrainer, version: int) -> int:
    """A rollback asked for, then done by the slices (this thread steps)."""
    done = trainer.rollback(version)
    drain(trainer)
    return done.result(timeout=0)


def test_batches_are_trained_published_and_checkpointed(engine, tmp_path):
    trainer, log, checkpoints = online(engine, tmp_path)
    seqs = serve_and_log(engine, log, 5)
    slices = drain(trainer)
    assert slices > 3 * 2 * 2  # a replayed sample is many slices (one per layer of the walk), not one
    versions = checkpoints.versions()
    assert [v.metrics["seqs"] for v in versions] == [seqs[0:2], seqs[2:4], seqs[4:5]]  # in log order, once each
    assert [v.version for v in versions] == [2, 4, 6]  # two epochs = two optimizer steps per batch
    assert versions[-1].log_position == seqs[-1] == trainer.position
    assert engine.adapter_version == 6
    states = [(e.state, e.trained_version) for e in log.read()]
    assert states == [("trained", 2), ("trained", 2), ("trained", 4), ("trained", 4), ("trained", 6)]
    # The records were made with the base adapter (version 0); max_staleness (4) lets every pass replay while the
    # adapter is at versions 0..4: the first batch at 0 and 1, the second at 2 and 3, the last at 4, then stale.
    assert (trainer.stats.replayed, trainer.stats.recomputed) == (9, 1)
    assert trainer.stats.staleness_sum == 2 * (0 + 1) + 2 * (2 + 3) + 4  # versions behind, over replayed records
    # One set of counters, each counted once: the optimizer's steps, the sample passes (5 samples, 2 epochs).
    assert (trainer.stats.steps, trainer.stats.samples, trainer.stats.stale) == (6, 10, 1)
    assert trainer.stats is trainer.trainer.stats
    assert not trainer.has_work()


def test_steps_end_once_every_correction_is_under_the_target_loss(engine, tmp_path):
    trainer, log, checkpoints = online(engine, tmp_path, stopping={"epochs": 40, "target_loss": 5.0},
                                       queue={"batch_size": 3})  # fmt: skip
    serve_and_log(engine, log, 3)
    drain(trainer)
    metrics = checkpoints.latest().metrics
    assert metrics["first_epoch_loss"] > 5.0  # a random model: about ln(256)
    assert 1 < metrics["epochs"] < 40  # it stopped at the first step whose losses were all under the target
    assert metrics["losses"]["sft"] < 5.0
    assert trainer.version == metrics["epochs"]  # a step per epoch run


def test_steps_go_on_past_the_target_loss_until_each_correction_is_learned(engine, tmp_path):
    """With ``target_token_p``, reaching ``target_loss`` does not end the steps: each step after asks whether every
    token of each correction is that likely yet (a tiny random model never makes one likelier than 0.02: all
    epochs run); without it, the same batch ends at the target loss."""
    epochs, checks = {}, {}
    for target in (0.0, 0.5):
        trainer, log, checkpoints = online(engine, tmp_path / str(target),
                                           stopping={"epochs": 8, "target_loss": 5.0, "target_token_p": target},
                                           queue={"batch_size": 3})  # fmt: skip
        serve_and_log(engine, log, 3)
        drain(trainer)
        epochs[target], checks[target] = checkpoints.latest().metrics["epochs"], trainer.stats.learned_checks
        engine.set_adapter(None, 0)  # the next trainer starts from the base model
    assert epochs[0.0] < 8 and checks[0.0] == 0
    assert epochs[0.5] == 8 and checks[0.5] == 8 - epochs[0.0]  # from the step at the target loss, but the last


def test_a_correction_is_learned_once_every_token_is_that_likely(engine, tmp_path):
    """``Stopping.learned_slices`` against its simple twin: each token's probability recomputed as a
    one-token response to the text before it, under the trained adapter; the check holds for p just under the
    least of them and not just over it. (No cut: the twin's longer prompts would take rows out of its scope.)"""
    trainer, log, _ = online(engine, tmp_path, stopping={"epochs": 3}, queue={"batch_size": 3},
                             adapter={"route_corrections": False})  # fmt: skip
    serve_and_log(engine, log, 3)
    drain(trainer)  # an adapter that moved
    samples = [Sample(e.prompt_token_ids, e.response_token_ids) for e in log.read()]
    least = min(
        math.exp(-recompute_loss(engine.model, trainer.adapter, torch.tensor(s.prompt_ids + s.response_ids[:j]),
                                 torch.tensor(s.response_ids[j : j + 1])).item())
        for s in samples for j in range(len(s.response_ids))
    )  # fmt: skip
    for p, learned in ((least * 0.999, True), (least * 1.001, False)):
        trainer.config.stopping.target_token_p = p
        assert run_to_end_of(trainer.stopping.learned_slices(samples)) is learned


@pytest.mark.parametrize("yield_after_s", [1e-3, 0.0])
def test_a_batch_yields_its_further_steps_to_corrections_waiting_behind_it(engine, tmp_path, yield_after_s):
    """Under a backlog of corrections a batch ends after the step at which one behind it has waited
    ``yield_after_s`` (here: at once, so after its first step), unless that is 0. Its corrections not learned yet
    (no target here: ``target_loss`` 0) stay queued and go on in the next batch, oldest first, until they have had
    ``epochs`` steps; the last batch, with nothing behind it, takes all its epochs."""
    trainer, log, checkpoints = online(engine, tmp_path,
                                       stopping={"epochs": 3, "yield_after_s": yield_after_s},
                                       queue={"batch_size": 2})  # fmt: skip
    seqs = serve_and_log(engine, log, 3)
    drain(trainer)
    first, last = (v.metrics for v in checkpoints.versions())
    assert first["seqs"] == seqs[:2] and last["seqs"] == seqs[2:]
    # yielding: three batches of a step each (the third settles them: their third step), nothing carried after
    assert (first["epochs"], first["yielded"], first["carried"]) == ((1, True, []) if yield_after_s else (3, False, []))
    assert trainer.stats.carried == (4 if yield_after_s else 0)
    assert (last["epochs"], last["yielded"]) == (3, False)
    assert trainer.stats.steps == 6 and [e.state for e in log.read()] == ["trained"] * 3


def test_a_yielding_batch_settles_its_learned_corrections_and_carries_the_others(engine, tmp_path):
    """When a batch yields, a correction the adapter already says (its loss in the step under ``target_loss``,
    then every token likelier than ``target_token_p``) is settled with the batch's version; one whose loss is not
    under the target goes on, unless it has had ``epochs`` steps."""
    trainer, log, _ = online(engine, tmp_path, stopping={"epochs": 4, "target_loss": 1.0, "target_token_p": 1e-9},
                             queue={"batch_size": 3})  # fmt: skip
    seqs = serve_and_log(engine, log, 3)
    feedback = FeedbackBatch([it for _, it in trainer.queue.head()], trainer.config.objectives)
    samples = [Sample(it.prompt_ids, it.response_ids, it.record_id) for it in feedback.sft]
    trainer._steps_of = {seqs[0]: 1, seqs[1]: 1, seqs[2]: 4}
    step = StepResult(1.0, 3, 18, 0, 3, 1, 0.0, passes=[(0.5, False), (5.0, False), (5.0, False)])
    assert run_to_end_of(trainer._carried_slices(feedback, samples, step)) == {seqs[1]}  # 0: learned; 2: its epochs
    trainer.config.stopping.target_token_p = 1 - 1e-9  # no token of a random model is that likely
    assert run_to_end_of(trainer._carried_slices(feedback, samples, step)) == {seqs[0], seqs[1]}
    trainer._steps_of[seqs[1]] = 4  # had its epochs: settled, learned or not
    assert run_to_end_of(trainer._carried_slices(feedback, samples, step)) == {seqs[0]}
    # one at a time, the test of the batch's end: the loss first (no target: none), the tokens of those under it
    assert run_to_end_of(trainer.stopping.learned_each_slices(samples, step.passes)) == [False, False, False]
    trainer.config.stopping.target_token_p = 1e-9
    assert run_to_end_of(trainer.stopping.learned_each_slices(samples, step.passes)) == [True, False, False]
    trainer.config.stopping.target_loss = 0.0
    assert run_to_end_of(trainer.stopping.learned_each_slices(samples, step.passes)) == [False, False, False]


def test_rehearsal_trains_earlier_corrections_in_turn_beside_each_batch(engine, tmp_path):
    """Each batch also trains ``rehearse_corrections`` corrections trained before (SFT), the next ones of the log in
    turn, starting over after the last; the batch's own feedback and its target are unchanged."""
    trainer, log, checkpoints = online(engine, tmp_path, rehearsal={"corrections": 3}, stopping={"epochs": 1})
    seqs = []
    for batch in range(4):
        seqs += serve_and_log(engine, log, 2, seed=batch)
        drain(trainer)
        if batch == 2:  # 1-4 trained before: 3 and 4 were not rehearsed yet (1 and 2 were), then 1 again
            assert trainer.rehearsal.through == seqs[0]
    versions = checkpoints.versions()
    assert [v.metrics["rehearsed"] for v in versions] == [0, 2, 3, 3]
    assert [v.metrics["samples"] for v in versions] == [2, 2, 2, 2]  # rehearsal is not the batch's feedback
    assert versions[0].metrics["rehearsal_loss"] is None and len(versions[-1].metrics["rehearsal_loss"]) == 2
    assert trainer.rehearsal.through == seqs[3]  # the fourth batch rehearsed 2, 3, 4
    assert trainer.stats.samples == 8 + 8  # every pass counted: 8 feedback samples, 8 rehearsed


def test_rehearsal_takes_at_most_its_rows_and_passes_over_a_correction_longer_than_all_of_them(engine, tmp_path):
    """``rehearse_max_tokens`` bounds the rows (prompt + response - 1) rehearsed per step: in turn, the next ones while
    they fit; one that would not fit even alone is passed over (it never comes back), one that fits alone waits to be
    first next time."""
    trainer, log, checkpoints = online(engine, tmp_path, rehearsal={"corrections": 8, "max_tokens": 27},
                                       stopping={"epochs": 1})  # fmt: skip
    seqs = []
    for batch in range(3):  # each batch: a correction of 25 rows, then one of 28
        seqs += serve_and_log(engine, log, 2, seed=batch)
        drain(trainer)
        if batch == 1:  # 1 (25 rows) rehearsed, 2 (28) passed over
            assert trainer.rehearsal.through == seqs[1]
    # The third batch: 3 rehearsed, 4 passed over, then (the log's end: from the oldest again) 1 would not fit beside 3
    assert [v.metrics["rehearsed"] for v in checkpoints.versions()] == [0, 1, 1]
    assert trainer.rehearsal.through == seqs[3]


def test_rehearsal_leaves_out_what_a_rollback_undid_also_after_a_restart(engine, tmp_path):
    """A rollback undoes the versions after its target: the corrections they trained are not rehearsed again (nor
    after a restart, nor after a later rollback to a version from before it), the others are."""
    trainer, log, checkpoints = online(engine, tmp_path, rehearsal={"corrections": 8}, stopping={"epochs": 1})
    for batch in range(2):  # version 1 trains seqs 1-2, version 2 seqs 3-4
        serve_and_log(engine, log, 2, seed=batch)
        drain(trainer)
    roll_back(trainer, 1)  # version 3 serves version 1's weights: seqs 3-4 are undone
    assert checkpoints.latest().metrics["undone"] == [[1, 2]]
    serve_and_log(engine, log, 2, seed=2)
    drain(trainer)  # version 4 rehearses 1-2 only
    assert checkpoints.latest().metrics["rehearsed"] == 2 and checkpoints.latest().metrics["undone"] == [[1, 2]]
    restarted = beside(engine, log, checkpoints, trainer.config)
    serve_and_log(engine, log, 2, seed=3)
    drain(restarted)  # version 5 rehearses 1-2 and 5-6 (version 4's), never 3-4
    assert checkpoints.latest().metrics["rehearsed"] == 4
    roll_back(restarted, 0)  # everything undone: nothing to rehearse
    serve_and_log(engine, log, 2, seed=4)
    drain(restarted)
    assert checkpoints.latest().metrics["rehearsed"] == 0


def test_one_key_takes_at_most_half_a_batch_while_another_waits(engine, tmp_path):
    trainer, log, checkpoints = online(engine, tmp_path, queue={"batch_size": 4}, stopping={"epochs": 1})
    flood = serve_and_log(engine, log, 6, seed=1, key_name="mallory")
    alice = serve_and_log(engine, log, 1, seed=2, key_name="alice")
    drain(trainer)
    batches = [v.metrics["seqs"] for v in checkpoints.versions()]
    # Two places each while alice waits; her one left a place free, which the flood's next entry filled; the rest
    # of it waited for the next batch, none dropped.
    assert batches == [[*flood[:2], *alice, flood[2]], flood[3:6]]
    assert {e.state for e in log.read()} == {"trained"}


def test_a_small_batch_waits_for_max_wait(engine, tmp_path):
    trainer, log, _ = online(engine, tmp_path, queue={"batch_size": 4, "max_wait_s": 3600.0})
    serve_and_log(engine, log, 1)
    assert not trainer.has_work()  # one of four, and it has waited less than an hour
    trainer.config.queue.max_wait_s = 0.0
    assert trainer.has_work()


def test_restart_resumes_exactly_where_the_checkpoint_is(engine, tmp_path):
    trainer, log, checkpoints = online(engine, tmp_path)
    seqs = serve_and_log(engine, log, 4)
    while checkpoints.latest() is None:  # train the first batch only, then "crash" in the second
        trainer.run_slice()
    for _ in range(3):
        trainer.run_slice()
    first = checkpoints.latest()
    assert first.metrics["seqs"] == seqs[:2]

    resumed, _, _ = online(engine, tmp_path)  # a new process would build it the same way
    assert resumed.version == first.version == engine.adapter_version
    assert resumed.position == seqs[1]
    saved, optimizer_state, _ = checkpoints.load(first.version, engine.model.config)
    for name, p in resumed.adapter.named_parameters():
        assert torch.equal(p, saved.get_parameter(name))
    assert resumed.trainer.optimizer.state_dict()["state"].keys() == optimizer_state["state"].keys()
    drain(resumed)
    assert [v.metrics["seqs"] for v in checkpoints.versions()] == [seqs[:2], seqs[2:4]]


def test_restart_settles_what_the_checkpoints_trained_and_a_version_1_log_passed(engine, tmp_path):
    """The log is told after each checkpoint: a crash in between leaves the batch queued in the log, and restore
    settles it from the checkpoint. Entries at or before the checkpointed position that no kept checkpoint names
    (a log from before states were kept, or versions no longer kept) were trained ("sft") by a version gone."""
    trainer, log, checkpoints = online(engine, tmp_path)
    seqs = serve_and_log(engine, log, 2)
    ids = dict(prompt_token_ids=[1, 2], response_token_ids=[], output_token_ids=[])  # nothing to learn
    negative, _ = log.append(response_id="neg", kind="negative", rating=-1, adapter_version=0, recorded=False, **ids)
    seqs += serve_and_log(engine, log, 2, seed=1)
    drain(trainer)
    assert [v.metrics["seqs"] for v in checkpoints.versions()] == [seqs[:2], seqs[2:4]]
    assert (log.get(negative.seq).state, log.get(negative.seq).skip_reason) == ("skipped", EMPTY)
    # Forget the states, as a crash right after the checkpoint, or a version-1 log, would have them ...
    log._conn.execute("UPDATE feedback SET state = 'queued', trained_version = NULL, skip_reason = NULL")
    checkpoints._discard(checkpoints.versions()[0].path)  # ... and the first batch's version is no longer kept
    online(engine, tmp_path)  # restore
    settled = {e.seq: (e.state, e.trained_version, e.skip_reason) for e in log.read()}
    assert [settled[s] for s in seqs] == [("trained", None, None)] * 2 + [("trained", 4, None)] * 2
    assert settled[negative.seq] == ("queued", None, None)  # after the position: the queue settles it again
    restored, _, _ = online(engine, tmp_path)
    assert not restored.has_work()
    assert (log.get(negative.seq).state, log.get(negative.seq).skip_reason) == ("skipped", EMPTY)


def test_a_failing_batch_is_trained_again_from_the_checkpoint(engine, tmp_path):
    trainer, log, checkpoints = online(engine, tmp_path / "a")
    seqs = serve_and_log(engine, log, 2)
    original = trainer.trainer.update
    calls = []

    def fail_in_the_second_epoch() -> None:
        calls.append(1)
        if len(calls) == 2:  # the first epoch's update was applied: it must not count
            raise RuntimeError("injected")
        original()

    trainer.trainer.update = fail_in_the_second_epoch
    drain(trainer)
    assert [v.metrics["seqs"] for v in checkpoints.versions()] == [seqs]

    clean, clean_log, _ = online(engine, tmp_path / "b")  # the same entries, no failure
    for entry in log.read(after_seq=0):
        fields = {k: getattr(entry, k) for k in ("response_id", "kind", "rating", "correction", "prompt_token_ids")}
        more = ("response_token_ids", "output_token_ids", "adapter_version", "recorded")
        clean_log.append(**fields, **{k: getattr(entry, k) for k in more})
    drain(clean)
    for (name, p), q in zip(trainer.adapter.named_parameters(), clean.adapter.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert all(p.grad is None for p in trainer.adapter.parameters())


def test_rollback_serves_an_earlier_version_as_a_new_one(engine, tmp_path):
    trainer, log, checkpoints = online(engine, tmp_path)
    serve_and_log(engine, log, 4)
    drain(trainer)
    first, second = checkpoints.versions()
    prompt = log.read()[0].prompt_token_ids  # taught by the first version: served the corrections' ranks

    def greedy() -> list[int]:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        engine.add_request(f"g{time.monotonic_ns()}", prompt, params)
        return next(iter(run_to_end(engine).values()))[-1].output_token_ids

    at_second = greedy()
    new = roll_back(trainer, first.version)
    assert new == second.version + 1 == engine.adapter_version
    at_first = greedy()
    roll_back(trainer, 0)
    at_base = greedy()
    engine.set_adapter(None, 0)
    assert greedy() == at_base  # the rolled-back-to-0 adapter serves the base model's outputs exactly
    saved = checkpoints.load(first.version, engine.model.config)[0]
    engine.set_adapter(as_trained(saved, trainer.config.adapter, log, first.version, []), 99)
    assert greedy() == at_first != at_second
    with pytest.raises(KeyError):
        trainer.rollback(12345)


def test_a_rollback_runs_in_the_thread_that_runs_the_slices(engine, tmp_path):
    """Asked for from another thread (the HTTP server's pool), a rollback's torch work (loading, publishing,
    checkpointing) runs where the slices run: the stepping thread (docs/architecture.md, the engine's note on OpenMP
    threads)."""

    class Publisher:  # the engine, noting the thread each publish comes from
        def __init__(self) -> None:
            self.threads: list[threading.Thread] = []

        def set_adapter(self, adapter, version: int) -> None:
            self.threads.append(threading.current_thread())
            engine.set_adapter(adapter, version)

        def set_adapter_slices(self, adapter, version: int):
            self.threads.append(threading.current_thread())
            yield from engine.set_adapter_slices(adapter, version)

    log = SQLiteFeedbackLog(tmp_path / "feedback.sqlite")
    checkpoints = AdapterCheckpoints(tmp_path / "adapters", keep=50)
    publisher = Publisher()
    config = OnlineConfig(queue=QueueConfig(batch_size=2, max_wait_s=0.0), stopping=StoppingConfig(epochs=1),
                          trainer=TrainerConfig(lr=1e-2), gate=GateConfig(enabled=False),
                          adapter=AdapterConfig(protect_energy=0.0))  # fmt: skip
    trainer = OnlineTrainer.from_config(engine.model, engine.tokenizer, publisher, engine.store, log, checkpoints,
                                        config)  # fmt: skip
    serve_and_log(engine, log, 2)
    drain(trainer)
    assert publisher.threads == [threading.current_thread()]  # the batch's version
    asked = []
    asking = threading.Thread(target=lambda: asked.append(trainer.rollback(0)))
    asking.start()
    asking.join()
    assert trainer.has_work() and not asked[0].done()  # nothing happens in the asking thread
    trainer.run_slice()
    assert asked[0].result(timeout=0) == checkpoints.versions()[-1].version == engine.adapter_version
    assert publisher.threads == [threading.current_thread()] * 2


def test_a_rollback_waits_for_the_batch_in_training_and_keeps_it(engine, tmp_path):
    trainer, log, checkpoints = online(engine, tmp_path)
    seqs = serve_and_log(engine, log, 4)
    while trainer._job is None:  # the first batch starts
        trainer.run_slice()
    done = trainer.rollback(0)
    while trainer._job is not None:  # the step loop goes on; the batch ends, is checkpointed, then the rollback goes
        assert not done.done(), "the rollback waits for the batch in training"
        trainer.run_slice()
    assert not done.done()
    trainer.run_slice()
    first, rollback = checkpoints.versions()
    assert first.metrics["seqs"] == seqs[:2] and rollback.metrics == {"rollback_of": 0, "undone": [[0, 2]]}
    assert done.result(timeout=0) == rollback.version and rollback.version == first.version + 1
    assert trainer.position == seqs[1] == rollback.log_position  # the batch counts as trained
    drain(trainer)
    assert [v.metrics.get("seqs") for v in checkpoints.versions()][-1] == seqs[2:4]  # training goes on from there


def test_rollbacks_faster_than_a_batch_do_not_stall_training(engine, tmp_path):
    """A rollback every few slices (51 in 40 s stalled a server's training entirely when each dropped the batch in
    progress): every batch is still trained, each once."""
    trainer, log, checkpoints = online(engine, tmp_path)
    seqs = serve_and_log(engine, log, 6)
    stop = threading.Event()

    def roll_back_again_and_again() -> None:
        while not stop.is_set():
            trainer.rollback(0).result()
            time.sleep(0.005)

    hammer = threading.Thread(target=roll_back_again_and_again)
    hammer.start()
    try:
        drain(trainer)
    finally:
        stop.set()
        while hammer.is_alive():  # its last rollback is done by the slices too
            trainer.run_slice()
        hammer.join()
    trained = [v.metrics["seqs"] for v in checkpoints.versions() if "seqs" in v.metrics]
    assert trained == [seqs[0:2], seqs[2:4], seqs[4:6]]


def test_the_guard_holds_a_spiking_correction_and_its_batch_trains_without_it(engine, tmp_path):
    """The poisoning guard on the queue: a correction whose loss spikes (its level set far below any loss) is
    quarantined in the log before the update, the rest of its batch (served answers rated 1, another level) trains
    without it, the position moves past it, it stays held across a restart, and once released it trains next,
    unchecked."""
    trainer, log, checkpoints = online(engine, tmp_path, queue={"batch_size": 3}, stopping={"epochs": 1},
                                       objectives={"thumbs_up": "sft"})  # fmt: skip
    prompts = random_prompts([12, 15, 18], seed=3)
    ids = dict(output_token_ids=[5, 6], adapter_version=0, recorded=False)
    rated = [log.append(response_id=f"u{i}", kind="sft", rating=1, prompt_token_ids=p, response_token_ids=[5, 6],
                        **ids)[0].seq for i, p in enumerate(prompts[:2])]  # fmt: skip
    poison, _ = log.append(response_id="c", kind="sft", correction="?", prompt_token_ids=prompts[2],
                           response_token_ids=[9, 9, 9], **ids)  # fmt: skip
    guard = trainer.guard.levels["correction"]
    guard.level, guard.seen = 1e-6, guard.warmup  # every correction's loss is a spike now; answers rated 1 are not
    drain(trainer)
    held = log.get(poison.seq)
    assert (held.state, held.quarantine_reason.split(" >")[0]) == ("quarantined", f"loss {held.quarantine_loss:.3g}")
    [version] = checkpoints.versions()
    assert version.metrics["seqs"] == rated and version.metrics["objectives"]["sft"] == 2
    assert version.log_position == poison.seq == trainer.position  # held: settled for now
    assert trainer.stats.quarantined == 1 and all(p.grad is None for p in trainer.adapter.parameters())

    restarted, _, _ = online(engine, tmp_path, queue={"batch_size": 3}, stopping={"epochs": 1},
                             objectives={"thumbs_up": "sft"})  # fmt: skip
    guard = restarted.guard.levels["correction"]
    guard.level, guard.seen = 1e-6, guard.warmup
    assert not restarted.has_work() and restarted.quarantine.is_held(poison.seq)
    assert restarted.quarantine.release([poison.seq]) == [poison.seq]
    assert restarted.quarantine.list()[0]["released"]
    drain(restarted)
    assert [v.metrics["seqs"] for v in checkpoints.versions()][-1] == [poison.seq]  # exempt from the guard
    assert log.get(poison.seq).state == "trained" and restarted.quarantine.list() == []


def rate_served(engine: LLMEngine, log: FeedbackLog, num: int, rating: int, seed: int) -> None:
    """Serves ``num`` prompts and rates each answer (a thumb, no correction) under the adapter that served it."""
    prompts = random_prompts([12 + i for i in range(num)], seed=seed)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"t{seed}-{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    outputs = run_to_end(engine)
    for i, prompt in enumerate(prompts):
        served = outputs[f"t{seed}-{i}"][-1].output_token_ids
        log.append(response_id=f"t{seed}-{i}", kind="sft" if rating > 0 else "negative", rating=rating,
                   prompt_token_ids=prompt, response_token_ids=served, output_token_ids=served,
                   adapter_version=engine.adapter_version, recorded=True)  # fmt: skip


def test_a_version_its_users_rate_worse_is_rolled_back_between_batches(engine, tmp_path):
    trainer, log, checkpoints = online(engine, tmp_path, queue={"batch_size": 4}, stopping={"epochs": 1},
                                       rollback={"min_ratings": 4, "z": 2.0})  # fmt: skip
    rate_served(engine, log, 4, +1, seed=1)  # the base model's answers: liked
    drain(trainer)
    trained = engine.adapter_version
    assert trained > 0 and not any("rollback_of" in v.metrics for v in checkpoints.versions())
    rate_served(engine, log, 4, -1, seed=2)  # the trained version's: disliked
    drain(trainer)
    rollback = next(v for v in checkpoints.versions() if "rollback_of" in v.metrics)
    assert rollback.metrics["rollback_of"] == 0 and rollback.version == trained + 1
    assert f"users rated versions {trained}..{trained} worse than 0..0" in rollback.metrics["regression"]
    assert "thumbs down 100% of 4 ratings against 0% of 4" in rollback.metrics["regression"]
    # The disliked answers' batch trained after the rollback, on the base weights it restored; the ratings of
    # the versions before the rollback do not count again.
    assert checkpoints.latest().version == rollback.version + 1 == engine.adapter_version
    assert {e.state for e in log.read()} == {"trained"}
    rate_served(engine, log, 4, -1, seed=3)
    drain(trainer)
    assert sum("rollback_of" in v.metrics for v in checkpoints.versions()) == 1


def test_in_lockstep_the_leader_watches_and_the_round_rolls_back(engine, tmp_path):
    """The watch in lockstep: the leader (rank 0) reads the shared log's ratings at a round's start and proposes the
    rollback; the round makes it as it makes one asked for (on every replica: tests/training/test_generations.py),
    here in a real group of one (gloo, formed from a published generation as the replicas' are)."""
    generations = Generations.host("127.0.0.1")
    generations.publish([0])
    lockstep = Lockstep(DataParallel(torch.device("cpu")), 0.0, generations, 0, timeout_s=60)
    log = SQLiteFeedbackLog(tmp_path / "feedback.sqlite")
    checkpoints = AdapterCheckpoints(tmp_path / "adapters", keep=50)
    config = tiny_loop_config(queue={"batch_size": 4}, stopping={"epochs": 1}, rollback={"min_ratings": 4, "z": 2.0})
    trainer = OnlineTrainer.from_config(engine.model, engine.tokenizer, engine, engine.store, log, checkpoints,
                                        config, lockstep)  # fmt: skip

    def rounds_until(done) -> None:
        for _ in range(10_000):
            if done() and not trainer.in_batch:
                return
            trainer.run_slice()
        raise AssertionError("rounds did not get there")

    try:
        rate_served(engine, log, 4, +1, seed=1)  # the base model's answers: liked
        rounds_until(lambda: not log.queued_seqs())
        trained = engine.adapter_version
        assert trained > 0 and lockstep.joined and lockstep.generation == 1
        rate_served(engine, log, 4, -1, seed=2)  # the trained version's: disliked
        rounds_until(lambda: any("rollback_of" in v.metrics for v in checkpoints.versions()))
        rollback = next(v for v in checkpoints.versions() if "rollback_of" in v.metrics)
        assert rollback.metrics["rollback_of"] == 0 and rollback.version == trained + 1
        assert f"users rated versions {trained}..{trained} worse than 0..0" in rollback.metrics["regression"]
        rounds_until(lambda: not log.queued_seqs())  # the disliked answers' batch, in a later round
        assert checkpoints.latest().version == rollback.version + 1 == engine.adapter_version
        assert {e.state for e in log.read()} == {"trained"}
    finally:
        dist.destroy_process_group()
