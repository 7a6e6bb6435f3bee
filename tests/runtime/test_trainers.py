"""The trainers of a replica (``alchemist.runtime.trainers``) on a tiny random model, with a real engine, feedback
log and checkpoints: a named adapter's trainer starts from the adapter as loaded (its version 1), trains only the
feedback on its own responses, publishes under its name and resumes after a restart; the trainers with work take
batches in turn; a name whose checkpoints would land among the shared adapter's is refused.

    pytest tests/runtime/test_trainers.py
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from alchemist.config import EngineConfig, RecordConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.feedback.log import FeedbackLog
from alchemist.feedback.sqlite_log import SQLiteFeedbackLog
from alchemist.model.loader import build_model
from alchemist.model.peft_format import load_adapter
from alchemist.runtime.trainers import Trainers, checkpoint_dir, named_trainer, served_path
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.online import OnlineTrainer
from tests.engine.helpers import char_tokenizer, random_adapter, random_prompts, run_to_end
from tests.training.test_online import serve_and_log, tiny_loop_config

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(tiny_dirs) -> LLMEngine:
    model = build_model(tiny_dirs["llama-gqa-untied"], torch.float32)
    config = EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64)
    return LLMEngine(model, char_tokenizer(), config, RecordConfig(policy="all", dtype="float32"))


def log_named(engine: LLMEngine, log: FeedbackLog, name: str, num: int, seed: int) -> list[int]:
    """Serves ``num`` prompts with the named adapter ``name`` and logs a correction of each (one token repeated:
    what a tiny model learns in a few steps); returns their seqs."""
    prompts = random_prompts([18 + 2 * i for i in range(num)], seed=seed)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{name}-{seed}-{i}", prompt, GREEDY, adapter_name=name)
    outputs = run_to_end(engine)
    seqs = []
    for i, prompt in enumerate(prompts):
        out = outputs[f"{name}-{seed}-{i}"][-1]
        entry, _ = log.append(response_id=f"{name}-{seed}-{i}", kind="sft", correction="x", prompt_token_ids=prompt,
                              response_token_ids=[11] * 6, output_token_ids=out.output_token_ids,
                              adapter_version=out.adapter_version, recorded=False, adapter=name)  # fmt: skip
        seqs.append(entry.seq)
    return seqs


def greedy(engine: LLMEngine, prompt: list[int], name: str | None) -> list[int]:
    engine.add_request("probe", prompt, GREEDY, adapter_name=name)
    return run_to_end(engine)["probe"][-1].output_token_ids


def test_each_adapter_trains_its_own_feedback_taking_batches_in_turn(engine, tmp_path: Path):
    config = tiny_loop_config()
    log = SQLiteFeedbackLog(tmp_path / "feedback.sqlite")
    shared = OnlineTrainer.from_config(engine.model, engine.tokenizer, engine, engine.store, log,
                                       AdapterCheckpoints(tmp_path / "adapters", keep=50), config)  # fmt: skip
    loaded = random_adapter(engine.model, seed=5, std=0.2)
    before = {k: t.clone() for k, t in loaded.state_dict().items()}
    team_a = named_trainer(engine, engine.store, log, config, tmp_path, "team-a", loaded)
    assert engine.named_adapters == {"team-a": 1} and team_a.version == 1  # as loaded: version 1, served
    probe = random_prompts([15], seed=99)[0]
    reference = LLMEngine(engine.model, engine.tokenizer, engine.config)  # the loaded adapter served alone
    reference.set_adapter(loaded, 1, name="team-a")
    assert greedy(engine, probe, "team-a") == greedy(reference, probe, "team-a")
    trainers = Trainers(shared)
    trainers.add("team-a", team_a)
    assert "team-a" in trainers and "team-b" not in trainers

    shared_seqs = serve_and_log(engine, log, 4, repeat=True)  # two batches of the shared adapter's
    named_seqs = log_named(engine, log, "team-a", 2, seed=3)  # one of team-a's, logged after them
    while trainers.has_work():
        trainers.run_slice()

    shared_versions = shared.checkpoints.versions()
    named_versions = team_a.checkpoints.versions()
    assert [v.metrics["seqs"] for v in shared_versions] == [shared_seqs[:2], shared_seqs[2:]]  # never team-a's
    assert [v.metrics.get("seqs") for v in named_versions] == [None, named_seqs]  # as loaded, then its batch
    # In turn: team-a's batch came between the shared adapter's two, though both of those were queued first.
    assert shared_versions[0].created_s < named_versions[1].created_s < shared_versions[1].created_s
    assert engine.adapter_version == shared.version == 4 and engine.named_adapters == {"team-a": team_a.version} == {
        "team-a": 3}  # fmt: skip
    assert {e.seq: (e.state, e.trained_version) for e in log.read()} == {
        **{seq: ("trained", v) for seq, v in zip(shared_seqs, (2, 2, 4, 4), strict=True)},
        **{seq: ("trained", 3) for seq in named_seqs}}  # fmt: skip
    assert any(not torch.equal(t, before[k]) for k, t in team_a.adapter.state_dict().items())
    assert all(torch.equal(t, before[k]) for k, t in loaded.state_dict().items())  # the loaded copy untouched
    assert (tmp_path / "adapters" / "team-a" / "v000003" / "adapter" / "adapter_config.json").is_file()

    # Served without training (--no-train), team-a is what its training left serving; an untrained name as given.
    served = served_path(tmp_path, "team-a", tmp_path / "given")
    assert served == tmp_path / "adapters" / "team-a" / "v000003" / "adapter"
    assert all(torch.equal(t, team_a.adapter.state_dict()[k])
               for k, t in load_adapter(served, engine.model.config).state_dict().items())  # fmt: skip
    assert served_path(tmp_path, "team-z", tmp_path / "given") == tmp_path / "given"
    assert served_path(tmp_path, "v000001", tmp_path / "given") == tmp_path / "given"

    # A restart resumes team-a from its latest checkpoint, served under its name at that version.
    again = LLMEngine(engine.model, engine.tokenizer, engine.config)
    resumed = named_trainer(again, None, log, config, tmp_path, "team-a", loaded)
    assert resumed.version == 3 and again.named_adapters == {"team-a": 3} and not resumed.has_work()
    assert all(torch.equal(t, team_a.adapter.state_dict()[k]) for k, t in resumed.adapter.state_dict().items())
    log.close()


def test_a_trainer_started_at_run_time_is_made_in_a_slice(engine, tmp_path: Path):
    """A run-time load's trainer is made by the stepping thread (the caller of run_slice), not the loader's."""
    config = tiny_loop_config()
    log = SQLiteFeedbackLog(tmp_path / "feedback.sqlite")
    shared = OnlineTrainer.from_config(engine.model, engine.tokenizer, engine, engine.store, log,
                                       AdapterCheckpoints(tmp_path / "adapters", keep=50), config)  # fmt: skip
    trainers = Trainers(shared, partial(named_trainer, engine, engine.store, log, config, tmp_path))
    done = trainers.start("team-b", random_adapter(engine.model, seed=6, std=0.2))
    assert not done.done() and "team-b" not in trainers and trainers.has_work()
    trainers.run_slice()
    assert done.result(timeout=0) is None and "team-b" in trainers and engine.named_adapters == {"team-b": 1}
    again = trainers.start("team-b", random_adapter(engine.model, seed=7, std=0.2))
    trainers.run_slice()
    with pytest.raises(ValueError, match="has a trainer already"):
        again.result(timeout=0)
    assert not trainers.has_work()
    with pytest.raises(ValueError, match="no named adapter at run time"):
        Trainers(shared).start("team-c", random_adapter(engine.model, seed=8))
    log.close()


def test_names_whose_checkpoints_would_land_elsewhere_are_refused(tmp_path: Path):
    assert checkpoint_dir(tmp_path, "team/a") == tmp_path / "adapters" / "team" / "a"
    for name in ("v000001", "v1234567/x", ".tmp-x", "../x", "a/../../x", "a//b"):
        with pytest.raises(ValueError, match="cannot be trained"):
            checkpoint_dir(tmp_path, name)
