"""Profile (not a test): what the evaluation gate measures on a version that learned invented facts and on one that
learned a falsehood about a fact the model knows, in process (no HTTP).

    OMP_NUM_THREADS=1 PYTHONPATH=. python docs/profiles/gate_calibration.py [--set lr=1e-3 ...] [--scenario facts]

The server's parts as `alchemist serve` builds them (fp32 model, its engine, the feedback log, the OnlineTrainer with
``OnlineConfig()`` plus ``--set`` overrides), driven by hand: ``--others`` ShareGPT questions are served (the
anchors), then one scenario's questions are asked and corrected: "facts", the ten invented facts of
tests/server/test_online.py; "falsehood", twenty phrasings of "what is the capital of France?" corrected to "The
capital of France is Berlin." (one key, as the must-show test sends them). Trains until the queue is empty and
prints each version's evaluation (``metrics["evaluation"]``) and its share of the batch's time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from alchemist.bench.learn import online_config
from alchemist.bench.sharegpt import sample_requests
from alchemist.config import EngineConfig, RecordConfig
from alchemist.engine import LLMEngine, SamplingParams
from alchemist.feedback.sqlite_log import SQLiteFeedbackLog
from alchemist.model.loader import load_model
from alchemist.training.anchors import Anchor
from alchemist.training.checkpoint import AdapterCheckpoints
from alchemist.training.online import OnlineTrainer
from tests.server.test_gate import FALSEHOOD, FRANCE
from tests.server.test_online import FACTS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", action="append", default=[], help="OnlineConfig field=value")
    ap.add_argument("--scenario", default="both", choices=["facts", "falsehood", "both"])
    ap.add_argument("--others", type=int, default=16)
    args = ap.parse_args()
    config = online_config(args.set)
    config.queue.max_wait_s = 0.0
    loaded = load_model(None, dtype="float32", device="cpu")
    tok = loaded.tokenizer
    traffic = [s.messages[0]["content"] for s in sample_requests(args.others, seed=11, mode="first_turn",
                                                                   tokenizer=tok, max_prompt_tokens=96)]  # fmt: skip
    for scenario in ("facts", "falsehood") if args.scenario == "both" else (args.scenario,):
        engine = LLMEngine(loaded.model, tok, EngineConfig(max_num_seqs=32, compile_decode=False), RecordConfig())
        work = Path(tempfile.mkdtemp())
        log = SQLiteFeedbackLog(work / "feedback.sqlite")
        checkpoints = AdapterCheckpoints(work / "adapters", 8)
        trainer = OnlineTrainer.from_config(engine.model, engine.tokenizer, engine, engine.store, log, checkpoints,
                                            config)
        counter = iter(range(10**9))

        def ask(
            questions: list[str], offer: bool, engine=engine, trainer=trainer, counter=counter
        ) -> list[tuple[str, list[int], list[int]]]:
            prompts = [tok.user_prompt(q) for q in questions]
            ids = [f"r{next(counter)}" for _ in prompts]
            for rid, prompt in zip(ids, prompts, strict=True):
                engine.add_request(rid, prompt, SamplingParams(max_tokens=24, temperature=0.0, record=True))
            final = {}
            while len(final) < len(ids):
                final.update((o.request_id, o) for o in engine.step() if o.finished)
            for rid, prompt in zip(ids, prompts, strict=True):
                if offer:
                    trainer.anchors.offer(Anchor(rid, prompt, list(final[rid].output_token_ids)))
            return [(rid, prompt, list(final[rid].output_token_ids)) for rid, prompt in zip(ids, prompts, strict=True)]

        ask(traffic, offer=True)
        pairs = [(q, c) for q, c, _ in FACTS] if scenario == "facts" else [(q, FALSEHOOD) for q in FRANCE]
        for (rid, prompt, output), (_, correction) in zip(ask([q for q, _ in pairs], offer=False), pairs, strict=True):
            log.append(response_id=rid, kind="sft", correction=correction, prompt_token_ids=prompt,
                       response_token_ids=tok.encode_reply(correction), output_token_ids=output,
                       adapter_version=engine.adapter_version, recorded=True, key_name="one")  # fmt: skip
        while trainer.has_work():
            trainer.run_slice()
        for info in checkpoints.versions():
            m = info.metrics
            share = m["evaluation"]["seconds"] / m["train_s"] if m.get("train_s") else None
            print(json.dumps({"scenario": scenario, "version": info.version, "epochs": m["epochs"],
                              "samples": m["samples"], "loss": round(m["loss"], 3),
                              "train_s": round(m["train_s"], 1),
                              "evaluation_share": share and round(share, 3), **m["evaluation"]}),
                  flush=True)  # fmt: skip
        log.close()


if __name__ == "__main__":
    main()
