"""Profile (not a test): where one mini-batch of corrections spends its time, by phase of the online trainer.

    OMP_NUM_THREADS=2 PYTHONPATH=. python docs/profiles/batch_phases.py [batch sizes...]     # default: 4 16

The server's parts as `alchemist serve` builds them (the model in ``--dtype auto``, its engine with the default
record policy, the feedback log, ``OnlineTrainer`` with ``OnlineConfig()``), driven by hand: 16 ShareGPT questions
are served (recorded) and offered as anchors, then for each batch size K, K invented facts are asked (greedy, 24
tokens, recorded), every answer corrected, and the trainer runs slice after slice with no serving in between until
the batch is checkpointed. Each slice is put to the phase of ``OnlineTrainer._train_slices`` it ran in (what that
generator was delegating to: the anchors' references, the gate's taught facts, a step, the learned check, the
evaluation, publish, checkpoint); the table gives each phase's slices and seconds.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from alchemist.bench.facts import invented_facts
from alchemist.bench.sharegpt import sample_requests
from alchemist.config import EngineConfig, OnlineConfig, RecordConfig
from alchemist.config.training import QueueConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.feedback.sqlite_log import SQLiteFeedbackLog
from alchemist.model.loader import load_model
from alchemist.training.anchors import Anchor
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.online import OnlineTrainer

sizes = [int(a) for a in sys.argv[1:]] or [4, 16]
loaded = load_model(None, dtype="auto", device="cpu")
tok = loaded.tokenizer
engine = LLMEngine(loaded.model, tok, EngineConfig(max_num_seqs=32, compile_decode=False), RecordConfig())
work = Path(tempfile.mkdtemp())
log = SQLiteFeedbackLog(work / "feedback.sqlite")
config = OnlineConfig(queue=QueueConfig(max_wait_s=0.0, batch_size=max(sizes)))
trainer = OnlineTrainer.from_config(engine.model, tok, engine, engine.store, log,
                                    AdapterCheckpoints(work / "adapters", 8), config)  # fmt: skip
counter = iter(range(10**9))


def ask(questions: list[str]) -> list[tuple[str, list[int], list[int]]]:
    ids = [f"r{next(counter)}" for _ in questions]
    for rid, q in zip(ids, questions, strict=True):
        engine.add_request(rid, tok.user_prompt(q), SamplingParams(max_tokens=24, temperature=0.0, record=True))
    final = {}
    while len(final) < len(ids):
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    return [(rid, final[rid].prompt_token_ids, list(final[rid].output_token_ids)) for rid in ids]


others = [s.messages[0]["content"] for s in sample_requests(16, seed=11, mode="first_turn", tokenizer=tok,
                                                              max_prompt_tokens=96)]  # fmt: skip
for rid, prompt, output in ask(others):
    trainer.anchors.offer(Anchor(rid, prompt, output))

facts = iter(invented_facts(sum(sizes), seed=5))
for size in sizes:
    batch = [next(facts) for _ in range(size)]
    for (rid, prompt, output), (_, correction, _) in zip(ask([q for q, _, _ in batch]), batch, strict=True):
        log.append(response_id=rid, kind="sft", correction=correction, prompt_token_ids=prompt,
                   response_token_ids=tok.encode_reply(correction), output_token_ids=output,
                   adapter_version=engine.adapter_version, recorded=True)  # fmt: skip
    phases: dict[str, list[float]] = defaultdict(list)
    steps0, t0 = trainer.stats.steps, time.perf_counter()
    while trainer.has_work():
        job = trainer._job
        phase = "start" if job is None or job.gi_yieldfrom is None else job.gi_yieldfrom.gi_code.co_name
        took = trainer.run_slice()
        phases[phase].append(took)
    engine.step()  # the new version is applied
    total = time.perf_counter() - t0
    print(f"\nbatch of {size} corrections: {trainer.stats.steps - steps0} steps, {total:.1f} s")
    print(f"{'phase':28} {'slices':>6} {'s':>7} {'share':>6}")
    for phase, times in sorted(phases.items(), key=lambda kv: -sum(kv[1])):
        print(f"{phase:28} {len(times):6} {sum(times):7.2f} {sum(times) / total:6.0%}")
