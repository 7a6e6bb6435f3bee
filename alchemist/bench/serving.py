"""`alchemist bench serve`: output tokens/s, TTFT and TPOT at 1, 8 and 32 concurrent requests, three ways.

    alchemist bench serve [--json] [--concurrency 1 8 32] [--dtype auto] [--systems transformers engine http]

Prompts are ShareGPT first user turns (chat-templated, at most ``--max-prompt-tokens``); every request asks for
exactly ``--max-tokens`` greedy tokens (EOS ignored), so all systems produce the same number of tokens.

- ``engine``: our LLMEngine driven in this process (add_request / step), ``c`` requests in flight.
- ``http``: our server as a real process (``alchemist serve``), the official ``openai`` client streaming from
  this process, ``c`` requests in flight. On a small machine the client shares the CPU with the server.
- ``transformers``: ``generate`` on the same HF directory and dtype; requests in static batches of ``c``,
  left-padded (transformers has no continuous batching), one batch after the other.

A closed loop: a finished request is replaced at once, until ``--requests-per-level`` x ``c`` have run (at
least 4). TTFT counts from the request's submission; TPOT is (last token - first token) / (tokens - 1).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from alchemist.bench.report import print_rows
from alchemist.bench.sharegpt import sample_requests
from alchemist.model.loader import load_model, resolve_device, resolve_dtype

SYSTEMS = ("transformers", "engine", "http")


@dataclass
class RequestResult:
    ttft_s: float
    tpot_s: float
    num_tokens: int


def summarize(system: str, concurrency: int, results: list[RequestResult], duration_s: float) -> dict:
    ttft_ms = np.array([r.ttft_s for r in results]) * 1e3
    tpot_ms = np.array([r.tpot_s for r in results]) * 1e3
    tokens = sum(r.num_tokens for r in results)
    return {
        "system": system,
        "concurrency": concurrency,
        "requests": len(results),
        "output_tokens": tokens,
        "duration_s": round(duration_s, 2),
        "output_tok_s": round(tokens / duration_s, 1),
        "ttft_p50_ms": round(float(np.percentile(ttft_ms, 50)), 1),
        "ttft_p99_ms": round(float(np.percentile(ttft_ms, 99)), 1),
        "tpot_p50_ms": round(float(np.percentile(tpot_ms, 50)), 1),
        "tpot_p99_ms": round(float(np.percentile(tpot_ms, 99)), 1),
    }


# --- our engine, in process ---------------------------------------------------------------------------------------


def run_engine(engine, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[list, float]:
    from alchemist.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    queue = deque(enumerate(prompts))
    results: list[RequestResult] = []
    start = time.perf_counter()

    def submit() -> None:
        i, prompt = queue.popleft()
        engine.add_request(f"bench-{concurrency}-{i}", prompt, params)

    for _ in range(min(concurrency, len(queue))):
        submit()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                t = out.timings
                results.append(RequestResult(t.ttft_s, t.tpot_s, len(out.output_token_ids)))
                if queue:
                    submit()
    return results, time.perf_counter() - start


# --- our server, over HTTP --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, max_num_seqs: int, max_model_len: int) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "alchemist.cli", "serve", "--dtype", args.dtype, "--device", args.device]
    cmd += ["--port", str(port), "--served-model-name", "bench", "--max-num-seqs", str(max_num_seqs)]
    cmd += ["--max-model-len", str(max_model_len), *(["--model", args.model] if args.model else [])]
    cmd += ["--compile"] if args.compile else []
    log = tempfile.NamedTemporaryFile(prefix="alchemist-bench-serve-", suffix=".log", delete=False)
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"server did not start within 300 s; see {log.name}")


async def _http_one(client, messages: list[dict], max_tokens: int, sem: asyncio.Semaphore) -> RequestResult:
    async with sem:
        start = time.perf_counter()
        first = last = None
        num_tokens = 0
        stream = await client.chat.completions.create(
            model="bench", messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                last = time.perf_counter()
                first = first or last
            if chunk.usage is not None:
                num_tokens = chunk.usage.completion_tokens
        assert first is not None and last is not None and num_tokens == max_tokens
        return RequestResult(first - start, (last - first) / max(num_tokens - 1, 1), num_tokens)


def run_http(url: str, chats: list[list[dict]], max_tokens: int, concurrency: int) -> tuple[list, float]:
    import openai

    async def main() -> tuple[list, float]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        sem = asyncio.Semaphore(concurrency)
        start = time.perf_counter()
        results = await asyncio.gather(*(_http_one(client, m, max_tokens, sem) for m in chats))
        duration = time.perf_counter() - start
        await client.close()
        return list(results), duration

    return asyncio.run(main())


# --- transformers generate --------------------------------------------------------------------------------------


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
        tpot = (end - clock.times[0]) / max(max_tokens - 1, 1)
        results += [RequestResult(clock.times[0] - start, tpot, max_tokens) for _ in batch]
    return results, total_s


# --- driver -----------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    chats: list[list[dict]]  # what the HTTP client sends
    prompts: list[list[int]]  # the same, chat-templated: what the engine and transformers get
    warmup_chat: list[dict]
    max_tokens: int
    num_requests: dict[int, int]  # concurrency -> requests run at that level

    def levels(self) -> list[int]:
        return sorted(self.num_requests)


def bench_transformers(args: argparse.Namespace, loaded, work: Workload) -> list[dict]:
    import transformers

    dtype = loaded.model.dtype
    ref = transformers.AutoModelForCausalLM.from_pretrained(loaded.hf_dir, dtype=dtype).to(loaded.model.device).eval()
    hf_tok = loaded.tokenizer.hf
    pad_id = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else loaded.tokenizer.eos_token_ids[0]
    run_transformers(ref, work.prompts[:1], 4, 1, pad_id)  # warm-up
    rows = []
    for c in work.levels():
        results = run_transformers(ref, work.prompts[: work.num_requests[c]], work.max_tokens, c, pad_id)
        rows.append(summarize("transformers", c, *results))
        print_rows(rows[-1:], True, sys.stderr)
    return rows


def bench_engine(args: argparse.Namespace, loaded, work: Workload) -> list[dict]:
    from alchemist.config import EngineConfig
    from alchemist.engine import LLMEngine

    max_model_len = args.max_prompt_tokens + work.max_tokens
    config = EngineConfig(max_num_seqs=max(work.levels()), max_model_len=max_model_len, compile=args.compile)
    engine = LLMEngine(loaded.model, loaded.tokenizer, config)
    run_engine(engine, [loaded.tokenizer.apply_chat_template(work.warmup_chat)], 4, 1)
    rows = []
    for c in work.levels():
        results = run_engine(engine, work.prompts[: work.num_requests[c]], work.max_tokens, c)
        rows.append(summarize("engine", c, *results))
        print_rows(rows[-1:], True, sys.stderr)
    return rows


def bench_http(args: argparse.Namespace, loaded, work: Workload) -> list[dict]:
    process, url = start_server(args, max(work.levels()), args.max_prompt_tokens + work.max_tokens)
    rows = []
    try:
        run_http(url, [work.warmup_chat], 4, 1)
        for c in work.levels():
            results = run_http(url, work.chats[: work.num_requests[c]], work.max_tokens, c)
            rows.append(summarize("http", c, *results))
            print_rows(rows[-1:], True, sys.stderr)
    finally:
        stop_process(process)
    return rows


def stop_process(process: subprocess.Popen, timeout_s: float = 30) -> None:
    """Asks a server process to exit; kills it if it has not within ``timeout_s``."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


BENCHES = {"transformers": bench_transformers, "engine": bench_engine, "http": bench_http}


def main(args: argparse.Namespace) -> int:
    for system in args.systems:
        if system not in BENCHES:
            raise ValueError(f"--systems: unknown system {system!r}; choose from {list(BENCHES)}")
    device = resolve_device(args.device)
    loaded = load_model(args.model, dtype=resolve_dtype(args.dtype, device), device=device)
    num_requests = {c: max(4, args.requests_per_level * c) for c in sorted(set(args.concurrency))}
    samples = sample_requests(
        max(num_requests.values()) + 1, seed=args.seed, mode="first_turn", tokenizer=loaded.tokenizer,
        max_prompt_tokens=args.max_prompt_tokens,
    )  # fmt: skip
    chats = [s.messages for s in samples[1:]]
    prompts = [loaded.tokenizer.apply_chat_template(m) for m in chats]
    work = Workload(chats, prompts, samples[0].messages, args.max_tokens, num_requests)
    note = (
        f"# {len(prompts)} ShareGPT first turns (prompt tokens mean {np.mean([len(p) for p in prompts]):.0f}, "
        f"max {max(map(len, prompts))}), {args.max_tokens} greedy output tokens each (EOS ignored), "
        f"dtype {str(loaded.model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} torch threads, "
        f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, load average at start "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(note, file=sys.stderr)
    rows = []
    for system in BENCHES:  # this order: transformers, engine, http (the server is a separate process)
        if system in args.systems:
            rows += BENCHES[system](args, loaded, work)
    add_ratios(rows)
    print_rows(rows, args.json)
    if not args.json:
        print(f"{note}, at end {os.getloadavg()[0]:.1f}")
    return 0


def add_ratios(rows: list[dict]) -> None:
    """Each row's throughput relative to transformers' and to the engine's at the same concurrency."""
    by = {(r["system"], r["concurrency"]): r["output_tok_s"] for r in rows}
    for r in rows:
        for base in ("transformers", "engine"):
            ref = by.get((base, r["concurrency"]))
            r[f"x_{base}"] = round(r["output_tok_s"] / ref, 2) if ref else None
