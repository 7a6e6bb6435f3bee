"""`alchemist bench online`: the online loop under serving load. Serving latency with training off and on, and how
fast training goes when it replays prompts from serving's records vs when it recomputes them.

    alchemist bench online [--json] [--num-requests 48] [--request-rate 0.4] [--feedback-fraction 0.5]
                           [--runs off replay recompute] [--slo-tpot-ms 0] [--drain-s 180]
                           [--backlog-interval-s 5] [any `alchemist serve` flag, or --config FILE]

The servers take every serve flag given here (their defaults: serve's, but ``--max-num-seqs 16``,
``--record-budget-mb 4096`` and ``--train-max-wait-s 5``), written to a config file each one reads. Three runs of
`alchemist serve` (a fresh process and ``--data-dir`` each, ``--record-policy requested``), the same workload and
seed each time:

- ``off``: ``--no-train``, feedback is logged and nothing trains: the serving baseline;
- ``replay``: the online trainer as it ships, replaying recorded prompts;
- ``recompute``: ``--no-train-replay``, every prompt's forward recomputed: a separate trainer's cost.

Workload: ShareGPT conversations (multi-turn by default: the history is the prompt, at most ``--max-prompt-tokens``
chat-templated), sent with Poisson arrivals at ``--request-rate`` by the official ``openai`` client (AsyncOpenAI,
streaming), each asking for as many greedy tokens as its reference reply has (at most ``--max-tokens``, EOS ignored,
so every run serves the same token counts) and for its prompt to be recorded. A seeded ``--feedback-fraction`` of the
responses get feedback as soon as they finish: the reference reply, cut to ``--max-tokens``, as a correction (or
rating 1 with ``--feedback rating``; with ``--feedback fact`` those requests ask an invented fact instead, each its
own, and are corrected with it, as people correct a wrong answer). After the last response, training drains until
it has trained every feedback entry, or for at most ``--drain-s``. The default rate suits 2 vCPUs that serve in
bf16; where the server runs in fp32 (a CPU without bf16 instructions) it saturates them: ``--request-rate 0.15``
there (docs/benchmarks.md).

Client-side TTFT (to the first streamed content), TPOT as vLLM's benchmark defines it, (e2e - TTFT) / (output
tokens - 1), and ITL, the gaps between a request's streamed content chunks, over all requests' gaps (a request's
TPOT is the mean of its gaps; a training slice shows whole in the gap it falls in). Training numbers are
differences of the server's /metrics between the start of the load, its end (``*_load``) and the end of the drain:
tokens trained (response tokens, once per epoch) per second of training slices, optimizer steps, sample passes
replayed and recomputed.

The backlog over time (``alchemist.bench.backlog``): every ``--backlog-interval-s`` from the start of the load to
the end of the drain, the feedback queued for training by class (/metrics' ``alchemist:feedback_backlog``) and the
age of the oldest, one row each (``backlog_of``: the run; ``phase``: load or drain); each run's row has its peak
(``backlog_max``) and what was left at the end (``backlog_end``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families

from alchemist.bench import http_calls
from alchemist.bench.backlog import BacklogSampler
from alchemist.bench.facts import invented_facts
from alchemist.bench.latency import StreamClock, latency_fields
from alchemist.bench.report import print_rows
from alchemist.bench.serving import _free_port, stop_process
from alchemist.bench.sharegpt import sample_requests
from alchemist.config.root import as_dict
from alchemist.model.loader import hf_dir_for
from alchemist.model.tokenizer import Tokenizer

RUNS = {"off": ["--no-train"], "replay": [], "recompute": ["--no-train-replay"]}
MODEL_NAME = "bench"
STARTUP_TIMEOUT_S = 300.0
MIN_OUTPUT_TOKENS = 2  # TPOT needs a second token


@dataclass
class Workload:
    chats: list[list[dict]]
    max_tokens: list[int]  # per request: the reference reply's length, capped
    feedback: list[dict | None]  # per request: the feedback body's fields besides response_id, or None
    arrivals_s: list[float]  # per request: when to send it, from the start of the load
    warmup_chat: list[dict]
    prompt_tokens: list[int]


@dataclass
class RequestResult:
    ttft_s: float
    e2e_s: float
    num_tokens: int
    feedback_seq: int | None  # the feedback entry's log position ("fb-<seq>"), if it got feedback
    itl_s: list[float]  # the gaps between its streamed content chunks after the first (vLLM's ITL)
    feedback_at: float | None = None  # time.perf_counter() when the server acknowledged its feedback


def _ms(seconds: float) -> str:
    """A latency objective's setting as the note shows it (0: derived by each server at start-up)."""
    return f"{seconds * 1e3:g} ms" if seconds else "derived"


def build_workload(args: argparse.Namespace, tokenizer: Tokenizer) -> Workload:
    samples = sample_requests(
        args.num_requests + 1, seed=args.seed, mode=args.mode, tokenizer=tokenizer,
        max_prompt_tokens=args.max_prompt_tokens,
    )  # fmt: skip
    warmup, samples = samples[0], samples[1:]
    rng = np.random.default_rng(args.seed)
    gaps = rng.exponential(1.0 / args.request_rate, size=len(samples))
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])  # the first request at once
    with_feedback = set(rng.choice(len(samples), round(args.feedback_fraction * len(samples)), replace=False))
    facts = iter(invented_facts(len(with_feedback), seed=args.seed))
    chats, max_tokens, feedback = [s.messages for s in samples], [], []
    for i, sample in enumerate(samples):
        reply_ids = tokenizer.encode(sample.reply)[: args.max_tokens]
        max_tokens.append(max(MIN_OUTPUT_TOKENS, len(reply_ids)))
        if i not in with_feedback:
            feedback.append(None)
        elif args.feedback == "correction":
            feedback.append({"correction": tokenizer.decode(reply_ids)})
        elif args.feedback == "fact":  # the request asks an invented fact instead; its answer is corrected
            question, correction, _ = next(facts)
            chats[i] = [{"role": "user", "content": question}]
            feedback.append({"correction": correction})
        else:
            feedback.append({"rating": 1})
    prompt_tokens = [len(tokenizer.apply_chat_template(chat)) for chat in chats]
    return Workload(chats, max_tokens, feedback, arrivals.tolist(), warmup.messages, prompt_tokens)


# --- the server -------------------------------------------------------------------------------------------------


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log_path: Path


def start_server(
    args: argparse.Namespace, run: str, workdir: Path, flags: list[str] | None = None, record_policy: str = "requested"
) -> Server:
    """`alchemist serve` with the bench's serve flags, ``--record-policy record_policy`` and ``flags`` (default: the
    run's, ``RUNS[run]``)."""
    port = _free_port()
    serve = args.serve  # every serve flag given to the bench (bench/cli.py's online_servers: its defaults)
    serve.engine.max_model_len = args.max_prompt_tokens + args.max_tokens + 8  # + a correction's end, re-encoding
    serve.record.policy = record_policy
    config_path = workdir / "serve.yaml"
    config_path.write_text(yaml.safe_dump(as_dict(serve), sort_keys=False))
    cmd = [sys.executable, "-m", "alchemist.cli", "serve", "--config", str(config_path), "--port", str(port)]
    flags = RUNS[run] if flags is None else flags
    cmd += ["--served-model-name", MODEL_NAME, "--data-dir", str(workdir / "data"), *flags]
    log_path = workdir / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    server = Server(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}; see {log_path}")
        try:
            if http_calls.get(server.url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"server did not start within {STARTUP_TIMEOUT_S:.0f} s; see {log_path}")


def stop_server(server: Server) -> None:
    stop_process(server.process)


def scrape(url: str) -> dict[str, float]:
    """/metrics samples by name and labels, e.g. ``alchemist:training_samples_total{path="replay"}``."""
    samples = {}
    for family in text_string_to_metric_families(http_calls.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def trained_through(url: str) -> int:
    """The feedback log position that the newest checkpointed adapter version has trained up to (0: none)."""
    return trained(url)[0]


def trained(url: str) -> tuple[int, set[int]]:
    """``trained_through``, and the feedback entries (seqs) the promoted versions still listed trained: one
    settled past an entry carried over to a later batch is trained before the position reaches it."""
    listing = http_calls.get(url + "/v1/adapters", timeout=30).json()
    seqs = {seq for v in listing["data"] if v["promoted"] for seq in v["metrics"].get("seqs", [])}
    return max((v["log_position"] for v in listing["data"]), default=0), seqs


# --- the load ---------------------------------------------------------------------------------------------------


async def _request(client, http: httpx.AsyncClient, url: str, work: Workload, i: int) -> RequestResult:
    clock = StreamClock()
    num_tokens = 0
    response_id = None
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=work.chats[i], max_tokens=work.max_tokens[i], temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "alchemist": {"record": True}},
    )  # fmt: skip
    async for chunk in stream:
        response_id = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            clock.content()
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    e2e_s = clock.elapsed_s()
    if clock.first is None or num_tokens != work.max_tokens[i]:
        raise RuntimeError(f"request {i}: {num_tokens} tokens streamed, {work.max_tokens[i]} asked for")
    seq = at = None
    if work.feedback[i] is not None:
        answer = await http.post(url + "/v1/feedback", json={"response_id": response_id, **work.feedback[i]})
        answer.raise_for_status()
        seq, at = int(answer.json()["id"].removeprefix("fb-")), time.perf_counter()
    return RequestResult(clock.ttft_s, e2e_s, num_tokens, seq, clock.gaps, at)


def run_load(url: str, work: Workload, indices: list[int]) -> tuple[list[RequestResult | BaseException], float]:
    """Sends requests ``indices`` at their arrival times; returns each one's result (or error) and the duration."""
    import openai

    async def main() -> tuple[list, float]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        async with httpx.AsyncClient(timeout=600) as http:
            start = time.perf_counter()
            tasks = []
            for i in indices:
                await asyncio.sleep(max(0.0, start + work.arrivals_s[i] - time.perf_counter()))
                tasks.append(asyncio.create_task(_request(client, http, url, work, i)))
            results = await asyncio.gather(*tasks, return_exceptions=True)
            duration = time.perf_counter() - start
        await client.close()
        return list(results), duration

    return asyncio.run(main())


# --- one run ----------------------------------------------------------------------------------------------------


def bench_run(args: argparse.Namespace, run: str, work: Workload) -> tuple[dict, list[dict]]:
    """The run's row, and its backlog samples (``backlog_of``: the run)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"alchemist-bench-online-{run}-"))
    server = start_server(args, run, workdir)
    try:
        warm_up(server.url, work)
        row, samples, _ = measure_load(server.url, args, run, work, train=run != "off")
    finally:
        stop_server(server)
    shutil.rmtree(workdir / "data", ignore_errors=True)  # the log stays, for a look afterwards
    print(f"# {run}: server log {server.log_path}", file=sys.stderr)
    return row, samples


def warm_up(url: str, work: Workload) -> None:
    """One short request: first-call costs (allocations, the client's connection) are not measured."""
    run_load(url, Workload([work.warmup_chat], [8], [None], [0.0], work.warmup_chat, []), [0])


def measure_load(
    url: str, args: argparse.Namespace, run: str, work: Workload, train: bool, watch=None
) -> tuple[dict, list[dict], list[RequestResult]]:
    """The load of ``work`` on a running server, then (``train``) the drain: the row, the backlog samples
    (``backlog_of``: ``run``) and the requests' results. ``watch``, if given, is started before the load and stopped
    after the drain (e.g. ``backlog.TrainedThrough``)."""
    before = scrape(url)
    backlog = BacklogSampler(lambda: scrape(url), args.backlog_interval_s).start()
    if watch is not None:
        watch.start()
    results, duration_s = run_load(url, work, list(range(len(work.chats))))
    after_load = scrape(url)
    backlog.phase = "drain"
    done = [r for r in results if isinstance(r, RequestResult)]
    for e in [r for r in results if not isinstance(r, RequestResult)][:3]:
        print(f"# {run}: request failed: {type(e).__name__}: {e}", file=sys.stderr)
    row = summarize(run, done, len(results) - len(done), duration_s)
    row.update(waits(before, after_load))
    if train:
        last_seq = max((r.feedback_seq for r in done if r.feedback_seq is not None), default=0)
        drain_start = time.perf_counter()
        while not (drained := trained_through(url) >= last_seq):
            if time.perf_counter() - drain_start > args.drain_s:
                break
            time.sleep(1.0)
        row.update(training_numbers(before, after_load, scrape(url)))
        row.update(drain_s=round(time.perf_counter() - drain_start, 1), drained=drained)
    if watch is not None:
        watch.stop()
    samples = [{"backlog_of": run, **s} for s in backlog.stop()]
    queued = [s["queued"] for s in samples if "queued" in s]
    row.update(backlog_max=max(queued, default=None), backlog_end=queued[-1] if queued else None)
    return row, samples, done


def summarize(run: str, results: list[RequestResult], failed: int, duration_s: float) -> dict:
    tokens = sum(r.num_tokens for r in results)
    return {
        "run": run,
        "requests": len(results),
        "failed": failed,
        "feedback": sum(r.feedback_seq is not None for r in results),
        "load_s": round(duration_s, 1),
        "req_s": round(len(results) / duration_s, 3),
        "output_tok_s": round(tokens / duration_s, 1),
        **latency_fields(results),
    }


def waits(before: dict, after_load: dict) -> dict:
    """What serving's steps took and waited for during the load, from /metrics' histograms: engine steps (and those
    over 100 ms), training slices run while requests were in flight (their seconds, those over 100 ms: a due step
    waited for each)."""
    step, piece = "alchemist:engine_step_seconds", "alchemist:training_slice_seconds"
    delta = lambda name: after_load.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731  (no slices: absent)
    slices, slices_fast = piece + '_count{serving="yes"}', piece + '_bucket{le="0.1",serving="yes"}'
    return {
        "steps_load": int(delta(step + "_count")),
        "steps_over_100ms_load": int(delta(step + "_count") - delta(step + '_bucket{le="0.1"}')),
        "slices_load": int(delta(slices)),
        "slice_s_load": round(delta(piece + '_sum{serving="yes"}'), 1),
        "slices_over_100ms_load": int(delta(slices) - delta(slices_fast)),
    }


TRAINING_FIELDS = (
    "train_tokens_load", "train_s_load", "train_tok_s_load", "train_tokens", "anchor_tokens", "train_s", "train_tok_s",
    "steps", "replayed", "recomputed", "replay_hit_rate", "drain_s", "drained",
)  # fmt: skip


def training_numbers(before: dict, after_load: dict, end: dict) -> dict:
    """Training during the load (``*_load``) and overall (load + drain), from /metrics differences. Trained
    tokens are the feedback's and the anchors' (the KL to the base model on served traffic): both are trained."""
    p = "alchemist:training_"
    names = ("tokens_total", "anchor_tokens_total", "seconds_total", "steps_total", "replay_hit_rate")
    missing = [n for n in names if p + n not in end]
    if missing:
        raise RuntimeError(f"/metrics lacks {', '.join(p + n for n in missing)}")
    delta = lambda a, name: a[p + name] - before[p + name]
    trained = lambda a: delta(a, "tokens_total") + delta(a, "anchor_tokens_total")  # noqa: E731
    tokens_load, s_load = trained(after_load), delta(after_load, "seconds_total")
    tokens, s = trained(end), delta(end, "seconds_total")
    return {
        "train_tokens_load": int(tokens_load),
        "train_s_load": round(s_load, 1),
        "train_tok_s_load": round(tokens_load / s_load, 1) if s_load > 0 else None,  # None: no training yet
        "train_tokens": int(tokens),
        "train_s": round(s, 1),
        "train_tok_s": round(tokens / s, 1) if s > 0 else None,
        "anchor_tokens": int(delta(end, "anchor_tokens_total")),
        "steps": int(delta(end, "steps_total")),
        "replayed": int(delta(end, 'samples_total{path="replay"}')),
        "recomputed": int(delta(end, 'samples_total{path="recompute"}')),
        "replay_hit_rate": round(end[p + "replay_hit_rate"], 3),
    }


# --- driver -----------------------------------------------------------------------------------------------------


def ratios(rows: list[dict]) -> list[dict]:
    """The goals: TPOT p99 with training on <= 1.5x off; training tokens/s replay >= 1.4x recompute."""
    by = {r["run"]: r for r in rows}
    out = []

    def add(num: str, den: str, field: str, goal: str, ok: Callable[[float], bool]) -> None:
        if num in by and den in by:
            a, b = by[num][field], by[den][field]
            value = round(a / b, 2) if a is not None and b else None  # None: nothing to compare
            met = ok(value) if value is not None else None
            out.append({"ratio": f"{field} {num}/{den}", "value": value, "goal": goal, "met": met})

    for run in ("replay", "recompute"):
        add(run, "off", "tpot_p99_ms", "<= 1.5", lambda v: v <= 1.5)
    for field in ("train_tok_s", "train_tok_s_load"):
        add("replay", "recompute", field, ">= 1.4", lambda v: v >= 1.4)
    return out


def main(args: argparse.Namespace) -> int:
    for run in args.runs:
        if run not in RUNS:
            raise ValueError(f"--runs: unknown run {run!r}; choose from {list(RUNS)}")
    if args.request_rate <= 0 or not 0.0 <= args.feedback_fraction <= 1.0 or args.max_tokens < MIN_OUTPUT_TOKENS:
        raise ValueError("--request-rate must be > 0, --feedback-fraction in [0, 1], --max-tokens >= 2")
    tokenizer = Tokenizer.from_pretrained(hf_dir_for(args.serve.engine.model))
    online, trainer = args.serve.online, args.serve.online.trainer
    work = build_workload(args, tokenizer)
    note = (
        f"# {len(work.chats)} ShareGPT {args.mode} requests at {args.request_rate} req/s (Poisson, seed {args.seed}), "
        f"prompt tokens mean {np.mean(work.prompt_tokens):.0f} max {max(work.prompt_tokens)}, output tokens mean "
        f"{np.mean(work.max_tokens):.0f} (cap {args.max_tokens}, EOS ignored), {args.feedback} feedback on "
        f"{sum(f is not None for f in work.feedback)}; train batch {online.queue.batch_size}, epochs "
        f"{online.stopping.epochs}, group {trainer.group_size} ({trainer.group_max_tokens} tokens), "
        f"objective TPOT {_ms(args.serve.engine.slo_tpot_s)}, TTFT {_ms(args.serve.engine.slo_ttft_s)}, max wait "
        f"{online.queue.max_wait_s} s; dtype "
        f"{args.serve.engine.dtype}; {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, load "
        f"average at start {os.getloadavg()[0]:.1f}"
    )
    print(note, file=sys.stderr)
    rows, backlog = [], []
    for run in RUNS:  # this order: off, replay, recompute
        if run in args.runs:
            row, samples = bench_run(args, run, work)
            rows.append(row)
            backlog += samples
            if run == "off":
                rows[-1].update(dict.fromkeys(TRAINING_FIELDS))
            print_rows(rows[-1:], True, sys.stderr)
    print_rows(rows, args.json)
    if not args.json:
        print()
    print_rows(ratios(rows), args.json)
    if not args.json:
        print()
    print_rows(backlog, args.json)
    if not args.json:
        print(f"{note}, at end {os.getloadavg()[0]:.1f}")
    return 0
