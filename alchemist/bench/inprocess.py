"""`alchemist bench serve --systems engine transformers`: the first_turn load without HTTP, in this process.

    results, duration_s = run_engine(engine, prompts, max_tokens=128, concurrency=8)
    results, duration_s = run_transformers(hf_model, prompts, max_tokens=128, concurrency=8, pad_id=0)

- ``engine``: our LLMEngine driven here (add_request / step), ``c`` requests in flight, a finished one replaced at
  once (the same closed loop as the HTTP clients). What the server adds on top of it shows as the difference.
- ``transformers``: ``generate`` on the same HF directory and dtype; requests in static batches of ``c``,
  left-padded (transformers has no continuous batching), one batch after the other.

Both take chat-templated prompt ids and produce exactly ``max_tokens`` greedy tokens (EOS ignored); their results
are ``chat_load.RequestResult``s timed the way the HTTP client times its requests (from submission; ITL: the gaps
between a request's steps).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

import torch

from alchemist.bench.chat_load import RequestResult


def run_engine(engine, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[list, float]:
    from alchemist.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    queue = deque(enumerate(prompts))
    submitted: dict[str, tuple[float, int]] = {}  # per request: when it was added, its prompt's length
    token_times: dict[str, list[float]] = {}  # per request: when each step handed out its tokens
    results: list[RequestResult] = []
    start = time.perf_counter()

    def submit() -> None:
        i, prompt = queue.popleft()
        request_id = f"bench-{concurrency}-{i}"
        submitted[request_id] = time.perf_counter(), len(prompt)
        token_times[request_id] = []
        engine.add_request(request_id, prompt, params)

    for _ in range(min(concurrency, len(queue))):
        submit()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.new_token_ids:
                token_times[out.request_id].append(now)
            if out.finished:
                times, (sent, num_prompt) = token_times.pop(out.request_id), submitted.pop(out.request_id)
                gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
                results.append(RequestResult(times[0] - sent, now - sent, len(out.output_token_ids), num_prompt, gaps))
                if queue:
                    submit()
    return results, time.perf_counter() - start


def run_transformers(model, prompts: list[list[int]], max_tokens: int, concurrency: int, pad_id: int):
    from transformers import LogitsProcessor

    class StepClock(LogitsProcessor):
        """Called once per generated position, right after that position's forward: its token time."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    results: list[RequestResult] = []
    total_s = 0.0
    for i in range(0, len(prompts), concurrency):
        batch = prompts[i : i + concurrency]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        clock = StepClock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, logits_processor=[clock], pad_token_id=pad_id,
            )  # fmt: skip
        end = time.perf_counter()
        total_s += end - start
        assert out.shape[1] - width == max_tokens
        gaps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]  # the whole batch's steps
        results += [RequestResult(clock.times[0] - start, end - start, max_tokens, len(p), gaps) for p in batch]
    return results, total_s


Levels = Iterator[tuple[int, list[RequestResult], float]]  # (concurrency, results, duration_s) per level


def bench_transformers(
    loaded, warmup: list[int], prompts_by_level: dict[int, list[list[int]]], max_tokens: int
) -> Levels:
    """Each level in turn, after a warm-up on ``warmup`` (first-call costs are not measured)."""
    import transformers

    dtype = loaded.model.dtype
    ref = transformers.AutoModelForCausalLM.from_pretrained(loaded.hf_dir, dtype=dtype).to(loaded.model.device).eval()
    hf_tok = loaded.tokenizer.hf
    pad_id = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else loaded.tokenizer.eos_token_ids[0]
    run_transformers(ref, [warmup], 4, 1, pad_id)
    for c, prompts in prompts_by_level.items():
        yield c, *run_transformers(ref, prompts, max_tokens, c, pad_id)


def bench_engine(
    loaded, warmup: list[int], prompts_by_level: dict[int, list[list[int]]], max_tokens: int, max_model_len: int,
    enforce_eager: bool,
) -> Levels:  # fmt: skip
    """Each level in turn on one engine, after a warm-up on ``warmup``."""
    from alchemist.config import EngineConfig
    from alchemist.engine import LLMEngine

    config = EngineConfig(max_num_seqs=max(prompts_by_level), max_model_len=max_model_len,
                          compile_decode=False if enforce_eager else None)
    engine = LLMEngine(loaded.model, loaded.tokenizer, config)
    run_engine(engine, [warmup], 4, 1)
    for c, prompts in prompts_by_level.items():
        yield c, *run_engine(engine, prompts, max_tokens, c)
