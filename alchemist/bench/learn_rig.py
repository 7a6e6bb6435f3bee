"""The server's learning parts in process, driven by hand (no HTTP): what `alchemist bench learn` teaches with.

    rig = LearnRig(None, "auto", "cpu", OnlineConfig(), workdir)
    answers = rig.ask(["What is the capital of Durnholt?"], max_tokens=24)   # greedy and recorded, as served
    rig.ask(others, 24, anchor=True)          # traffic nobody gives feedback on: the trainer's anchors
    rig.offer(other_rigs_answers)             # answers another rig served, as anchors
    rig.correct(answers[0], "The capital of Durnholt is Saltreach.")         # POST /v1/feedback's log entry
    rig.rate(answer, -1); rig.prefer(chosen, rejected)                       # thumbs and pairs, the same
    report = rig.train()                      # until nothing is queued: batches, promoted, blocked, steps, time

The parts are the ones `alchemist serve` builds: the model in the serve dtype, an ``LLMEngine`` with the default
record policy (a request that asks is recorded), and what ``alchemist.runtime.build_around`` makes around it: the
``SQLiteFeedbackLog``, ``AdapterCheckpoints`` and the ``OnlineTrainer`` with the given ``OnlineConfig``. Two
differences, both for time only: decoding is eager (no compile warm-up), and a batch trains as soon as the queue has
one (``max_wait_s`` 0: nobody else's feedback is coming, and the server would wait for it in vain).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

from alchemist.activations.store import ActivationStore
from alchemist.config import Config, EngineConfig, OnlineConfig, RecordConfig, ServerConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.model.loader import LoadedModel, load_model
from alchemist.runtime import build_around
from alchemist.training.anchors import Anchor


@dataclass(frozen=True)
class Answer:
    response_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    adapter_version: int  # of the adapter that served it
    text: str


@dataclass
class TrainReport:
    """One ``train()``: its mini-batches and what the evaluation gate made of them."""

    batches: int = 0  # checkpointed versions (a batch the poisoning guard stopped makes none)
    promoted: int = 0  # of them, served
    blocked: int = 0  # of them, kept from serving by the evaluation gate (their entries held)
    steps: int = 0  # optimizer steps
    quarantined: int = 0  # entries held: by the poisoning guard, or because their version was blocked
    train_s: float = 0.0
    reasons: list[str] = field(default_factory=list)  # why each blocked version was blocked

    def row(self) -> dict:
        return {"batches": self.batches, "promoted": self.promoted, "blocked": self.blocked, "steps": self.steps,
                "quarantined": self.quarantined, "train_s": round(self.train_s, 1)}  # fmt: skip


class LearnRig:
    def __init__(self, model: str | None, dtype: str, device: str, config: OnlineConfig, workdir: Path) -> None:
        self.loaded: LoadedModel = load_model(model, dtype=dtype, device=device)
        self.tokenizer = self.loaded.tokenizer
        records = RecordConfig()
        self.store = ActivationStore.from_config(records)  # the engine records into it, the trainer replays from it
        self.engine = LLMEngine(self.loaded.model, self.tokenizer, EngineConfig(compile_decode=False), records,
                                self.store)  # fmt: skip
        workdir.mkdir(parents=True, exist_ok=True)
        # The rest as the server builds it (alchemist.runtime), its state in workdir; the rig steps by hand, so the
        # system's stepping loop is never started.
        online = dataclasses.replace(config, queue=dataclasses.replace(config.queue, max_wait_s=0.0))
        system = build_around(self.engine, Config(online=online, server=ServerConfig(data_dir=str(workdir))),
                              [self.loaded.source.stem], self.store)  # fmt: skip
        if system.trainer is None:
            raise ValueError("the rig trains: OnlineConfig.enabled must be true")
        self.system, self.config = system, online
        self.log, self.checkpoints, self.trainer = system.feedback_log, system.checkpoints, system.trainer
        self._ids = itertools.count()

    def prompt(self, question: str) -> list[int]:
        return self.tokenizer.user_prompt(question)

    def ask(
        self, questions: list[str], max_tokens: int, anchor: bool = False, temperature: float = 0.0, seed: int = 0
    ) -> list[Answer]:
        """Greedy answers, all in one engine batch, each prompt recorded (the request asks, as the e2e test's do).
        ``anchor``: offered to the trainer as served traffic, as the server offers every finished completion (the
        facts' answers are not: their feedback would exclude them at once). ``temperature`` > 0: sampled, the
        i-th question with seed ``seed + i``."""
        asked = [(f"bench-{next(self._ids)}", self.prompt(q)) for q in questions]
        for i, (rid, prompt) in enumerate(asked):
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i, record=True)
            self.engine.add_request(rid, prompt, params)
        final = {}
        while len(final) < len(asked):
            final.update((o.request_id, o) for o in self.engine.step() if o.finished)
        answers = []
        for rid, prompt in asked:
            o = final[rid]
            output = list(o.output_token_ids)
            if anchor:
                self.trainer.anchors.offer(Anchor(rid, prompt, output))
            answers.append(Answer(rid, prompt, output, o.adapter_version, self.tokenizer.decode(output)))
        return answers

    def offer(self, answers: list[Answer]) -> None:
        """``answers`` another rig of the same model served, offered to the anchors as if this one had served them
        (under its own next response ids, as ``ask`` names them)."""
        for a in answers:
            self.trainer.anchors.offer(Anchor(f"bench-{next(self._ids)}", a.prompt_ids, a.output_ids))

    def correct(self, answer: Answer, correction: str) -> None:
        """The log entry a correction through POST /v1/feedback makes."""
        self.log.append(
            response_id=answer.response_id, kind="sft", correction=correction, prompt_token_ids=answer.prompt_ids,
            response_token_ids=self.tokenizer.encode_reply(correction), output_token_ids=answer.output_ids,
            adapter_version=answer.adapter_version, recorded=True,
        )  # fmt: skip

    def rate(self, answer: Answer, rating: int) -> None:
        """The log entry a thumbs-up (1: learn the answer) or thumbs-down (-1) through POST /v1/feedback makes."""
        self.log.append(
            response_id=answer.response_id, kind="sft" if rating == 1 else "negative", rating=rating,
            prompt_token_ids=answer.prompt_ids, response_token_ids=answer.output_ids,
            output_token_ids=answer.output_ids, adapter_version=answer.adapter_version, recorded=True,
        )  # fmt: skip

    def prefer(self, chosen: Answer, rejected: Answer) -> None:
        """The log entry POST /v1/feedback makes for ``chosen`` with ``preferred_over`` ``rejected`` (two answers
        to one prompt)."""
        self.log.append(
            response_id=chosen.response_id, kind="preference", preferred_over=rejected.response_id,
            prompt_token_ids=chosen.prompt_ids, response_token_ids=chosen.output_ids,
            output_token_ids=chosen.output_ids, rejected_token_ids=rejected.output_ids,
            adapter_version=chosen.adapter_version, recorded=True,
        )  # fmt: skip

    def train(self) -> TrainReport:
        """Trains until nothing is queued (each mini-batch to its end), then serves the newest promoted version."""
        report = TrainReport()
        trainer, stats = self.trainer, self.trainer.stats
        steps0, quarantined0, t0 = stats.steps, stats.quarantined, time.perf_counter()
        latest = self.checkpoints.latest()
        last = latest.version if latest is not None else 0
        while trainer.has_work():
            trainer.run_slice()
            while trainer._job is not None:  # the batch to its end: its checkpoint tells the gate's verdict
                trainer.run_slice()
            latest = self.checkpoints.latest()
            if latest is not None and latest.version != last:
                last = latest.version
                report.batches += 1
                if latest.promoted:
                    report.promoted += 1
                else:
                    report.blocked += 1
                    report.reasons.append(latest.metrics["evaluation"]["reason"])
        self.engine.step()  # the engine takes a published adapter when it steps
        report.steps = stats.steps - steps0
        report.quarantined = stats.quarantined - quarantined0
        report.train_s = time.perf_counter() - t0
        return report
