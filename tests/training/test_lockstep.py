"""The online loop of two replicas in lockstep (alchemist.training.lockstep) against one process's: each replica a
spawned process with its own engine (a tiny random model, fp32, recording every prompt), its own feedback log holding
its share of the corrections and its own checkpoints, in one gloo group; the single process has every correction in
one log. Their batches are one batch: the same steps, versions and adapter, the same corrections routed, every
entry trained once."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from alchemist.config import EngineConfig, RecordConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.feedback.sqlite_log import SQLiteFeedbackLog
from alchemist.model.loader import build_model
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.data_parallel import DataParallel
from alchemist.training.lockstep import Lockstep
from alchemist.training.online import OnlineTrainer
from alchemist.training.slices import run_to_end as run_slices
from tests.engine.helpers import char_tokenizer, random_prompts, run_to_end
from tests.training.test_online import tiny_loop_config

CONFIG = {"queue": {"batch_size": 8}, "stopping": {"epochs": 3}}  # one batch of all four; three steps
SHARES = [1, 3]  # the corrections on each replica (its log)


def corrections(n: int = 4) -> list[tuple[list[int], list[int]]]:
    prompts = random_prompts([20 + 3 * i for i in range(n)], seed=5)
    return [(prompt, [(7 * i + j) % 256 for j in range(6)]) for i, prompt in enumerate(prompts)]


class Side:
    """One replica (``lockstep``) or the single process (None): its engine recording every prompt, its feedback
    log, its checkpoints and its online trainer (``loop``: ``tiny_loop_config``'s sections)."""

    def __init__(self, tmp: Path, model_dir: Path, lockstep: Lockstep | None, loop: dict = CONFIG) -> None:
        tmp.mkdir()
        model = build_model(model_dir, torch.float32)
        config = EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64)
        self.engine = LLMEngine(model, char_tokenizer(), config, RecordConfig(policy="all", dtype="float32"))
        self.feedback = SQLiteFeedbackLog(tmp / "feedback.sqlite")
        self.checkpoints = AdapterCheckpoints(tmp / "adapters", keep=10)
        self.lockstep = lockstep
        self.trainer = OnlineTrainer.from_config(model, self.engine.tokenizer, self.engine, self.engine.store,
                                                 self.feedback, self.checkpoints, tiny_loop_config(**loop),
                                                 lockstep)  # fmt: skip

    def log(self, pairs: list[tuple[int, tuple[list[int], list[int]]]]) -> None:
        """Serves each numbered pair's prompt (recorded) and logs a correction of it."""
        for i, (prompt, response) in pairs:
            self.engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            out = run_to_end(self.engine)[f"r{i}"][-1]
            self.feedback.append(response_id=f"r{i}", kind="sft", correction="x", prompt_token_ids=prompt,
                                 response_token_ids=response, output_token_ids=out.output_token_ids,
                                 adapter_version=0, recorded=True)  # fmt: skip

    def train_until_idle(self) -> None:
        """Rounds (or batches alone) to their ends, until no replica has anything queued."""
        for _ in range(20):
            self.trainer.run_slice()
            while self.trainer.in_batch:
                self.trainer.run_slice()
            idle = not self.feedback.queued_seqs()
            if run_slices(self.lockstep.all_slices(idle)) if self.lockstep is not None else idle:
                return
        raise AssertionError("still training after 20 rounds")

    def seen(self) -> dict:
        """What the trainer holds now."""
        trainer = self.trainer
        return {
            "adapter": {name: p.detach().clone() for name, p in trainer.adapter.named_parameters()},
            "version": trainer.version,
            "served": self.engine.adapter_version,
            "states": [(e.state, e.trained_version) for e in self.feedback.read()],
            "checkpoints": [v.version for v in self.checkpoints.versions()],
            "replayed": trainer.stats.replayed,
            "taught": sorted(map(tuple, trainer.adapter.taught)),  # the prompts its corrections' ranks serve
            "allreduce_s": trainer.stats.allreduce_s,
        }


def train(tmp: Path, model_dir: Path, pairs, first: int, lockstep: Lockstep | None, config: dict = CONFIG) -> dict:
    """Serves ``pairs``' prompts (recorded), logs a correction of each, and trains until none is queued: in rounds
    with the other replicas (``lockstep``) or alone. Returns what the trainer ended with."""
    side = Side(tmp, model_dir, lockstep, config)
    side.log(list(enumerate(pairs, start=first)))
    side.train_until_idle()
    return side.seen()


def _replica(rank: int, world_size: int, rendezvous: str, model_dir: Path, out_dir: str, shares: list[int],
             config: dict) -> None:  # fmt: skip
    torch.set_num_threads(1)  # two replicas on a shared 2-core machine
    data_parallel = DataParallel.join(rendezvous, rank, world_size, torch.device("cpu"), timeout_s=60)
    first = sum(shares[:rank])
    pairs = corrections()[first : first + shares[rank]]
    tmp = Path(out_dir) / f"replica{rank}"
    seen = train(tmp, model_dir, pairs, first, Lockstep(data_parallel, round_s=0.0), config)
    torch.save(seen, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def run_replicas(tmp_path: Path, model_dir: Path, shares: list[int], config: dict) -> list[dict]:
    """Two replica processes in one gloo group, each with its ``shares`` of ``corrections()``: what each ended with."""
    args = (len(shares), f"file://{tmp_path / 'rendezvous'}", Path(model_dir), str(tmp_path), shares, config)
    context = mp.start_processes(_replica, args, nprocs=len(shares), join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    while not context.join(timeout=1.0):
        assert time.monotonic() < deadline, "replicas still running"
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(len(shares))]


def test_replicas_in_lockstep_train_what_one_process_trains(tmp_path, tiny_dirs):
    model_dir = tiny_dirs["llama-gqa-untied"]
    alone = train(tmp_path / "alone", model_dir, corrections(), 0, None)
    replicas = run_replicas(tmp_path, model_dir, SHARES, CONFIG)
    # One batch of three steps, published as one version, on every replica and in the single process alike.
    assert alone["version"] == alone["served"] == 3 and alone["checkpoints"] == [3]
    assert alone["states"] == [("trained", 3)] * 4
    for rank, seen in enumerate(replicas):
        assert (seen["version"], seen["served"], seen["checkpoints"]) == (3, 3, [3]), rank
        assert seen["states"] == [("trained", 3)] * SHARES[rank]  # its own entries, once each
        assert seen["replayed"] > 0 and seen["allreduce_s"] > 0
    # The same adapter: the replicas' bitwise (one all-reduced update), one process's to float rounding.
    for name, want in alone["adapter"].items():
        assert torch.equal(replicas[0]["adapter"][name], replicas[1]["adapter"][name]), name
        # AdamW's first steps move each value by about lr whatever its gradient's size, so a gradient summed in
        # another order (1e-7 relative: tests/training/test_data_parallel.py) moves a near-zero one's value by up
        # to a few 1e-6: within a thousandth of the 3 x lr (3e-2) the values moved.
        torch.testing.assert_close(replicas[0]["adapter"][name], want, rtol=0, atol=3e-5, msg=name)
    assert alone["replayed"] == replicas[0]["replayed"] + replicas[1]["replayed"]
    # Each replica serves every correction of the batch to the requests like its prompt, the others' too.
    assert len(alone["taught"]) == 4 and all(seen["taught"] == alone["taught"] for seen in replicas)


def test_a_replica_whose_entries_are_not_ready_yet_joins_the_batch_another_made_ready(tmp_path, tiny_dirs):
    """Replica 0 holds a full batch (ready), replica 1 one correction that would wait an hour for more: the round
    replica 0 starts trains both replicas' entries in one batch, as one trainer's batch takes every entry queued.
    Before, replica 1 joined with none, and its correction waited (here: "still training after 20 rounds")."""
    config = {"queue": {"batch_size": 2, "max_wait_s": 3600.0}, "stopping": {"epochs": 1}}
    replicas = run_replicas(tmp_path, tiny_dirs["llama-gqa-untied"], [2, 1], config)
    for rank, seen in enumerate(replicas):
        assert (seen["version"], seen["served"]) == (1, 1), rank  # one batch of one step, on both
        assert seen["states"] == [("trained", 1)] * [2, 1][rank]
