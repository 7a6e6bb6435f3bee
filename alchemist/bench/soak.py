"""`alchemist bench soak`: a long closed-loop load with feedback, watching what the server process holds.

    alchemist bench soak [--json] [--clients 16] [--minutes 5] [--correct-every 4] [--runs on off]
                         [--max-tokens 64] [--sample-interval-s 5]

Each run starts `alchemist serve` at its defaults (a fresh process and ``--data-dir``; ``off`` adds ``--no-train``)
and keeps ``--clients`` streaming clients busy until ``--minutes`` after warm-up (below; at most
``--warmup-timeout-s`` is waited for it, then the load ends, unwarmed): each plays ShareGPT first turns one after the
other (the official ``openai`` client, streaming, greedy, ``--max-tokens`` asked for, its prompt recorded), then
gives feedback on the answer: every ``--correct-every``-th answer a correction (the reference reply, cut to
``--max-tokens``), the others a thumbs up or down (alternating).

Reported per run: the server's memory allocator (alchemist/host_memory.py), requests and feedback sent, errors by
status (non-2xx answers; ``429`` also counted on its own) and by exception for the rest, the server process's
resident memory (VmRSS of /proc/PID/status) sampled every ``--sample-interval-s``: after warm-up (the first sample
past ``--warmup-s`` at which the trainer's adapter version, its optimizer steps, has reached ``--warmup-version``:
one-time work such as the first batches' is then done), at the end, its peak, its growth from warm-up to the peak
(``rss_growth_mb``), its settled growth (the median of the last quarter of the samples after warm-up less the first
quarter's: ``rss_settled_growth_mb``, the soak test's measure, which a training batch's swings do not move much) and
its slope over the second half of the run, also less the activation store's memory tiers (on a CPU they are process
memory, up to ``--record-budget-mb`` + ``--record-host-budget-mb``: cap them with ``--serve-arg`` to see the rest);
the feedback backlog (``alchemist.bench.backlog``). Then the series themselves, one row per sample (``rss_of``,
``backlog_of``: the run), and the evaluation gate's cost per adapter version (GET /v1/adapters: each version's
``metrics.evaluation.seconds`` and its share of the version's ``metrics.train_s``, which includes it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from alchemist.bench import http_calls
from alchemist.bench.backlog import BacklogSampler
from alchemist.bench.online import scrape
from alchemist.bench.report import print_rows
from alchemist.bench.serving import _free_port, stop_process
from alchemist.bench.sharegpt import sample_requests
from alchemist.model.loader import hf_dir_for
from alchemist.model.tokenizer import Tokenizer

RUNS = {"on": [], "off": ["--no-train"]}
MODEL_NAME = "bench"
STARTUP_TIMEOUT_S = 300.0


def rss_mb(pid: int) -> dict[str, float]:
    """The process's resident memory in MB: all of it (VmRSS), its anonymous part (RssAnon: the heap, tensors) and
    its file-backed part (RssFile: mapped files, e.g. the store's disk tier as it is read)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) / 1024
    return fields


TIER = "alchemist:activation_store_tier_bytes"
VERSION = "alchemist:adapter_version"  # the trainer's: its optimizer steps (and rollbacks)


class RssSampler:
    """The process's VmRSS every ``interval_s`` from a thread of its own, with the activation store's bytes (from
    /metrics: on CPU the store's device and host tiers are process memory, by design up to their budgets):
    [{"t_s", "rss_mb", "anon_mb", "file_mb", "store_mb", "rss_less_store_mb"}, ...]."""

    def __init__(self, pid: int, interval_s: float, read_metrics: Callable[[], dict[str, float]]) -> None:
        self.pid, self.interval_s, self.read_metrics = pid, interval_s, read_metrics
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._t0 = time.perf_counter()

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def warm_at(self, warmup_s: float, warmup_version: int) -> float | None:
        """The time of the first sample past warm-up (``rss_summary``'s), None before it."""
        return next((s["t_s"] for s in list(self.samples) if _warm(s, warmup_s, warmup_version)), None)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.samples

    def _run(self) -> None:
        while not self._stop.is_set():
            t_s = round(time.perf_counter() - self._t0, 1)
            mem = rss_mb(self.pid)
            rss = mem["VmRSS"]
            try:
                metrics = self.read_metrics()
                store = (metrics[TIER + '{tier="device"}'] + metrics[TIER + '{tier="host"}']) / 2**20
                version = metrics.get(VERSION)
            except (httpx.HTTPError, KeyError):  # a missed store sample: the RSS one still counts
                store = version = None
            self.samples.append({"t_s": t_s, "rss_mb": round(rss, 1), "anon_mb": _round(mem.get("RssAnon")),
                                 "file_mb": _round(mem.get("RssFile")), "store_mb": _round(store),
                                 "rss_less_store_mb": _round(None if store is None else rss - store),
                                 "adapter_version": None if version is None else int(version)})  # fmt: skip
            self._stop.wait(self.interval_s)


def _round(mb: float | None) -> float | None:
    return None if mb is None else round(mb, 1)


def _warm(sample: dict, warmup_s: float, warmup_version: int) -> bool:
    return sample["t_s"] >= warmup_s and (sample.get("adapter_version") or 0) >= warmup_version


def rss_summary(samples: list[dict], warmup_s: float, warmup_version: int = 0) -> dict:
    """RSS after warm-up (the first sample past ``warmup_s`` whose adapter version is at least ``warmup_version``;
    None if the run never got there), at the end, its peak; its growth from warm-up to the peak, of RSS and of RSS
    less the store's bytes; its settled growth, the median of the last quarter of the samples after warm-up less
    that of the first quarter (None below 8 samples); the slope (MB/min) of a least-squares line over the second
    half of the run after warm-up."""
    after = [s for s in samples if _warm(s, warmup_s, warmup_version)]
    half = [s for s in after if s["t_s"] >= (after[0]["t_s"] + after[-1]["t_s"]) / 2] if after else []

    def slope(key: str) -> float | None:
        points = [(s["t_s"] / 60, s[key]) for s in half if s[key] is not None]
        if len(points) < 3:
            return None
        return round(float(np.polyfit(*zip(*points, strict=True), 1)[0]), 1)

    def growth(key: str) -> float | None:
        values = [s[key] for s in after if s[key] is not None]
        return round(max(values) - values[0], 1) if values else None

    def settled_growth() -> float | None:
        quarter = len(after) // 4
        if quarter < 2:
            return None
        first, last = (float(np.median([s["rss_mb"] for s in part])) for part in (after[:quarter], after[-quarter:]))
        return round(last - first, 1)

    return {
        "warm_s": after[0]["t_s"] if after else None,
        "rss_warm_mb": after[0]["rss_mb"] if after else None,
        "rss_end_mb": samples[-1]["rss_mb"],
        "rss_max_mb": max(s["rss_mb"] for s in samples),
        "store_end_mb": samples[-1]["store_mb"],
        "rss_growth_mb": growth("rss_mb"),  # the peak after warm-up less the warm value
        "rss_less_store_growth_mb": growth("rss_less_store_mb"),
        "rss_settled_growth_mb": settled_growth(),  # the soak test's measure: robust to a batch's swings
        "rss_slope_mb_min": slope("rss_mb"),
        "rss_less_store_slope_mb_min": slope("rss_less_store_mb"),
    }


# --- the server -------------------------------------------------------------------------------------------------


def start_server(args: argparse.Namespace, run: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    """`alchemist serve` at its defaults (but the bench's model and dtype); (the process, its URL) once healthy."""
    port = _free_port()
    cmd = [sys.executable, "-m", "alchemist.cli", "serve", "--dtype", args.dtype, "--device", args.device]
    cmd += ["--port", str(port), "--served-model-name", MODEL_NAME, "--data-dir", str(workdir / "data")]
    cmd += [*(["--model", args.model] if args.model else []), *RUNS[run], *args.serve_arg]
    with open(workdir / "server.log", "wb") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # MALLOC_ARENA_MAX and the like reach the server
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}; see {workdir / 'server.log'}")
        try:
            if http_calls.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_process(process)
    raise RuntimeError(f"server did not start within {STARTUP_TIMEOUT_S:.0f} s; see {workdir / 'server.log'}")


# --- the load ---------------------------------------------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.requests = self.feedback = self.corrections = 0
        self.errors: Counter[str] = Counter()  # by status ("429") or by exception name


async def _one_turn(client, http: httpx.AsyncClient, url: str, sample, n: int, args, tally: Tally) -> None:
    import openai

    try:
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=sample.messages, max_tokens=args.max_tokens, temperature=0.0, stream=True,
            extra_body={"alchemist": {"record": True}},
        )  # fmt: skip
        response_id = None
        async for chunk in stream:
            response_id = chunk.id
        tally.requests += 1
    except openai.APIStatusError as e:
        tally.errors[str(e.status_code)] += 1
        return
    except Exception as e:  # a broken stream or connection: this request's failure, counted
        tally.errors[type(e).__name__] += 1
        return
    if n % args.correct_every == 0:
        body = {"response_id": response_id, "correction": sample.reply}
    else:
        body = {"response_id": response_id, "rating": 1 if n % 2 else -1}
    try:
        answer = await http.post(url + "/v1/feedback", json=body)
    except httpx.HTTPError as e:
        tally.errors[type(e).__name__] += 1
        return
    if answer.is_success:
        tally.feedback += 1
        tally.corrections += "correction" in body
    else:
        tally.errors[str(answer.status_code)] += 1


def run_load(url: str, samples: list, args: argparse.Namespace, done: Callable[[], bool]) -> Tally:
    """``args.clients`` closed-loop clients cycling through ``samples`` until ``done()`` (asked before each turn)."""
    import openai

    tally = Tally()

    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        counter = iter(range(10**9))
        async with httpx.AsyncClient(timeout=600) as http:

            async def one_client() -> None:
                while not done():
                    n = next(counter)
                    await _one_turn(client, http, url, samples[n % len(samples)], n, args, tally)

            await asyncio.gather(*(one_client() for _ in range(args.clients)))
        await client.close()

    asyncio.run(main())
    return tally


def gate_costs(url: str, run: str) -> list[dict]:
    """Each adapter version's evaluation time and its share of the version's training time (which includes it)."""
    rows = []
    for v in http_calls.get(url + "/v1/adapters", timeout=30).json()["data"]:
        evaluation = (v.get("metrics") or {}).get("evaluation")
        train_s = (v.get("metrics") or {}).get("train_s")
        if evaluation is None or not train_s:
            continue
        rows.append({"gate_of": run, "version": v["version"], "promoted": evaluation["promoted"],
                     "train_s": round(train_s, 2), "evaluation_s": evaluation["seconds"],
                     "evaluation_share": round(evaluation["seconds"] / train_s, 3)})  # fmt: skip
    return sorted(rows, key=lambda r: r["version"])


# --- one run ----------------------------------------------------------------------------------------------------


def soak_run(args: argparse.Namespace, run: str, samples: list) -> tuple[dict, list[dict], list[dict], list[dict]]:
    """The run's row, its RSS samples, its backlog samples and its gate costs."""
    workdir = Path(tempfile.mkdtemp(prefix=f"alchemist-bench-soak-{run}-"))
    process, url = start_server(args, run, workdir)
    try:
        rss = RssSampler(process.pid, args.sample_interval_s, lambda: scrape(url)).start()
        backlog = BacklogSampler(lambda: scrape(url), args.sample_interval_s).start()
        warmup_version = args.warmup_version if run == "on" else 0  # off: version 0
        t0 = time.perf_counter()

        def done() -> bool:  # --minutes after warm-up, or warm-up never came
            warm = rss.warm_at(args.warmup_s, warmup_version)
            limit = args.warmup_timeout_s if warm is None else warm
            return time.perf_counter() - t0 >= limit + (warm is not None) * args.minutes * 60

        tally = run_load(url, samples, args, done)
        load_s = time.perf_counter() - t0
        backlog_samples = [{"backlog_of": run, **s} for s in backlog.stop()]
        rss_samples = [{"rss_of": run, **s} for s in rss.stop()]
        gates = gate_costs(url, run)
    finally:
        stop_process(process)
    shutil.rmtree(workdir / "data", ignore_errors=True)  # the log stays, for a look afterwards
    print(f"# {run}: server log {workdir / 'server.log'}", file=sys.stderr)
    allocator = re.search(r"memory allocator: (\w+)", (workdir / "server.log").read_text(errors="replace"))
    queued = [s["queued"] for s in backlog_samples if "queued" in s]
    row = {
        "run": run, "allocator": allocator and allocator.group(1), "clients": args.clients, "minutes": args.minutes,
        "requests": tally.requests,
        "load_s": round(load_s, 1), "req_s": round(tally.requests / load_s, 2), "feedback": tally.feedback,
        "corrections": tally.corrections, "errors": sum(tally.errors.values()), "errors_429": tally.errors["429"],
        "errors_by": ",".join(f"{k}:{v}" for k, v in sorted(tally.errors.items())) or None,
        **rss_summary(rss_samples, args.warmup_s, warmup_version),
        "backlog_max": max(queued, default=None), "backlog_end": queued[-1] if queued else None,
        "versions": len(gates), "evaluation_s": round(sum(g["evaluation_s"] for g in gates), 1),
        "evaluation_share": round(sum(g["evaluation_s"] for g in gates) / sum(g["train_s"] for g in gates), 3)
        if gates else None,
    }  # fmt: skip
    return row, rss_samples, backlog_samples, gates


def main(args: argparse.Namespace) -> int:
    for run in args.runs:
        if run not in RUNS:
            raise ValueError(f"--runs: unknown run {run!r}; choose from {list(RUNS)}")
    if args.clients < 1 or args.minutes <= 0 or args.correct_every < 1 or args.sample_interval_s <= 0:
        raise ValueError("--clients and --correct-every must be >= 1, --minutes and --sample-interval-s > 0")
    if args.warmup_timeout_s < args.warmup_s:
        raise ValueError("--warmup-timeout-s must be at least --warmup-s")
    tokenizer = Tokenizer.from_pretrained(hf_dir_for(args.model))
    samples = sample_requests(args.num_prompts, seed=args.seed, mode="first_turn", tokenizer=tokenizer,
                              max_prompt_tokens=args.max_prompt_tokens, max_reply_tokens=args.max_tokens)  # fmt: skip
    note = (
        f"# {args.clients} streaming clients for {args.minutes} min after warm-up, {len(samples)} ShareGPT first turns "
        f"(<= {args.max_prompt_tokens} prompt tokens), {args.max_tokens} tokens asked for, a correction every "
        f"{args.correct_every}th answer, thumbs on the others; dtype {args.dtype}; {os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}, load average at start {os.getloadavg()[0]:.1f}"
    )
    print(note, file=sys.stderr)
    rows, rss, backlog, gates = [], [], [], []
    for run in RUNS:  # this order: on, off
        if run in args.runs:
            row, r, b, g = soak_run(args, run, samples)
            rows.append(row)
            rss, backlog, gates = rss + r, backlog + b, gates + g
            print_rows(rows[-1:], True, sys.stderr)
    for table in (rows, rss, backlog, gates):
        print_rows(table, args.json)
        if not args.json and table:
            print()
    if not args.json:
        print(f"{note}, at end {os.getloadavg()[0]:.1f}")
    return 0
