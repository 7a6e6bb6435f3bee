"""The server on CUDA, end to end (run on a GPU machine; not part of CI, which has no GPU):

    python -m tests.cuda.check_server --tokenizer-dir DIR [--device cuda]

A real `alchemist serve --device cuda` process (bf16, records in bf16, online training on) and the official
``openai`` client: answers (plain and streamed) with their prompts recorded, corrections through /v1/feedback,
trained by the in-process trainer with replay (/metrics), the new version served; rollback serves the base model's
answer exactly; SIGKILL and restart serve the last checkpointed version. The model has SmolLM2-135M's config and
tokenizer (``DIR``: config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja, as the .gguf
conversion writes them) with random weights: the real weights are a 98 MB file that does not travel to a GPU
machine here. What is checked is the system, not what the model learns (tests/server/test_online.py, on the CPU).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import tempfile
import time
from pathlib import Path

import torch

from alchemist.bench import http_calls
from tests.server.conftest import MODEL_NAME, launch_server, wait_ready
from tests.server.test_online import FACTS, adapters, ask, feedback, stop, wait_trained_through

FLAGS = [
    *("--max-num-seqs", "8", "--max-model-len", "512", "--record-policy", "requested"),
    *("--train-batch-size", "4", "--train-max-wait-s", "1", "--train-epochs", "2", "--train-lr", "1e-3"),
]


def random_model(tokenizer_dir: Path, out: Path) -> Path:
    import transformers

    out.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    config = transformers.AutoConfig.from_pretrained(out)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def stream(server, question: str) -> tuple[str, str]:
    chunks = server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0.0,
        stream=True, extra_body={"alchemist": {"record": True}},
    )  # fmt: skip
    ids, text = set(), ""
    for chunk in chunks:
        ids.add(chunk.id)
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert len(ids) == 1
    return ids.pop(), text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    model = random_model(args.tokenizer_dir, root / "model")
    flags = ["--model", str(model), *FLAGS]
    dtype = "bfloat16"
    server = launch_server("cuda", root, root / "data", flags, device=args.device, dtype=dtype)
    try:
        wait_ready(server)
        t0 = time.perf_counter()
        answers = [ask(server, q) for q, _, _ in FACTS[:3]]
        answers.append(stream(server, FACTS[3][0]))
        print(f"ok   4 recorded answers (one streamed) in {time.perf_counter() - t0:.2f}s", flush=True)
        acks = [
            feedback(server, response_id=rid, correction=fix)
            for (rid, _), (_, fix, _) in zip(answers, FACTS, strict=False)
        ]
        again = feedback(server, response_id=answers[0][0], correction=FACTS[0][1])
        assert again["id"] == acks[0]["id"], (again, acks[0])  # idempotent
        unknown = http_calls.post(server.base_url + "/v1/feedback", json={"response_id": "chatcmpl-nope", "rating": 1})
        assert unknown.status_code == 404, unknown.text
        last = max(int(a["id"].removeprefix("fb-")) for a in acks)
        t0 = time.perf_counter()
        listing = wait_trained_through(server, last, timeout_s=300)
        metrics = server.metrics()
        replayed = metrics['alchemist:training_samples_total{path="replay"}']
        assert replayed > 0 and metrics["alchemist:training_records_unreadable_total"] == 0, metrics
        trained = listing["serving_version"]
        assert trained > 0, listing
        recomputed = metrics['alchemist:training_samples_total{path="recompute"}']
        print(f"ok   4 corrections trained in {time.perf_counter() - t0:.1f}s: serving version {trained}, "
              f"{replayed:.0f} sample passes replayed, {recomputed:.0f} recomputed", flush=True)  # fmt: skip
        after = ask(server, FACTS[0][0])[1]
        response = http_calls.post(server.base_url + "/v1/adapters/rollback", json={"version": 0}, timeout=60)
        assert response.status_code == 200, response.text
        base_again = ask(server, FACTS[0][0])[1]
        assert base_again == answers[0][1], (base_again, answers[0][1])
        print(f"ok   rollback to 0 serves the base answer exactly (trained answer differed: {after != base_again})")
        latest = adapters(server)["serving_version"]
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        server = launch_server("cuda-restart", root, root / "data", [*flags, "--no-train"], args.device, dtype)
        wait_ready(server)
        assert adapters(server)["serving_version"] == latest, (adapters(server), latest)
        assert ask(server, FACTS[0][0])[1] == base_again  # the rollback version serves the base weights
        print(f"ok   SIGKILL and restart: serving version {latest} again, same answer")
    except BaseException:
        print(server.log_path.read_text()[-6000:])
        raise
    finally:
        stop(server)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
