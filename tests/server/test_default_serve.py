"""`alchemist serve` with no engine flags, as a user starts it: bf16 where the CPU runs it fast, decode steps through
the compiled layer where it applies (alchemist.engine.compiled_decode), and it answers concurrent chats correctly."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from alchemist.bench.serving import stop_process
from alchemist.model import cpu_kernels
from alchemist.model.loader import resolve_dtype
from tests.server.conftest import MODEL_NAME, launch_server, wait_ready


def test_the_default_server_decodes_compiled_and_answers(tmp_path):
    server = launch_server("defaults", tmp_path, tmp_path / "data", [], dtype="auto")
    try:
        wait_ready(server)
        client = server.client()

        def ask(question: str) -> tuple[str, int]:
            out = client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0
            )
            return out.choices[0].message.content, out.usage.completion_tokens

        with ThreadPoolExecutor(4) as pool:  # decode steps of batch 1 to 4
            answers = list(pool.map(ask, ["What is the capital of France?"] * 3 + ["Name a primary colour."]))
        log = server.log_path.read_text()
    finally:
        stop_process(server.process)
    bf16 = resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    expect_compiled = bf16 and cpu_kernels.decode_attention_op() is not None
    assert ("decode steps run compiled" in log) == expect_compiled, log[-2000:]
    assert ("decode steps run eager" in log) != expect_compiled
    assert all("Paris" in text for text, _ in answers[:3]), answers
    assert all(tokens > 0 for _, tokens in answers)
