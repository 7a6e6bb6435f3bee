"""Profile (not a test): the e2e teaching loop of tests/server/test_online.py, round by round.

    PYTHONPATH=. python docs/profiles/e2e_curve.py [rounds] [others] [other tokens] [server flags ...]

The numbers default to the test's; server flags are added to the test's (``TEACH_FLAGS``).

A real server with the test's flags; each round corrects the ten facts' answers, waits for the step, asks again
(beside ``others`` ShareGPT questions answered with ``other tokens`` greedy tokens: the next step's anchors).
Prints, per round, the facts the served answers hold and the seconds spent training and asking; then each trained
version's held-out perplexity rise (the test's 12 ShareGPT replies, fp32, vs the base model).
"""

import math
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tests.server.test_online as e2e
from alchemist.model.loader import load_model
from alchemist.training.checkpoint import AdapterCheckpoints
from tests.server.conftest import launch_server, wait_ready

first_flag = next((i for i, a in enumerate(sys.argv[1:]) if a.startswith("--")), len(sys.argv) - 1)
numbers, extra_flags = [int(a) for a in sys.argv[1 : 1 + first_flag]], sys.argv[1 + first_flag :]
rounds, num_others, other_tokens = numbers + [e2e.ROUNDS, e2e.NUM_OTHERS, e2e.OTHER_TOKENS][len(numbers) :]
e2e.ROUNDS, e2e.NUM_OTHERS = rounds, num_others  # other_questions reads them
loaded = load_model(None, dtype="float32", device="cpu")
others = e2e.other_questions(loaded.tokenizer)
work = Path(tempfile.mkdtemp())
server = launch_server("teach", work, work / "data", [*e2e.TEACH_FLAGS, *extra_flags])


def ask_all(questions: list[str]) -> list[tuple[str, str]]:
    with ThreadPoolExecutor(len(e2e.FACTS) + len(questions)) as pool:
        facts = [pool.submit(e2e.ask, server, q) for q, _, _ in e2e.FACTS]
        for q in questions:
            pool.submit(e2e.ask, server, q, other_tokens)
        return [f.result() for f in facts]


start = time.perf_counter()
try:
    wait_ready(server)
    answers = ask_all(others[0])
    print(f"ready and asked: {time.perf_counter() - start:.0f} s", flush=True)
    for round_ in range(rounds):
        t0 = time.perf_counter()
        acks = [e2e.feedback(server, response_id=rid, correction=fix)
                for (rid, _), (_, fix, _) in zip(answers, e2e.FACTS, strict=True)]  # fmt: skip
        e2e.wait_trained_through(server, max(int(a["id"].removeprefix("fb-")) for a in acks))
        t1 = time.perf_counter()
        answers = ask_all(others[round_ + 1] if round_ + 1 < rounds else [])
        held = sum(key in text.lower() for (_, text), (_, _, key) in zip(answers, e2e.FACTS, strict=True))
        print(f"round {round_ + 1}: {held}/10 facts, train {t1 - t0:.1f} s, ask {time.perf_counter() - t1:.1f} s",
              flush=True)  # fmt: skip
finally:
    e2e.stop(server)
print(f"total {time.perf_counter() - start:.0f} s", flush=True)

checkpoints = AdapterCheckpoints(work / "data" / "adapters", keep=16)
base = e2e.held_out_nll(loaded.model, loaded.tokenizer, None).mean()
for v in checkpoints.versions():
    adapter, _, _ = checkpoints.load(v.version, loaded.model.config)
    rise = math.exp(e2e.held_out_nll(loaded.model, loaded.tokenizer, adapter).mean() - base) - 1
    print(f"version {v.version}: held-out perplexity {rise:+.1%}, loss {v.metrics['loss']:.3f}", flush=True)
