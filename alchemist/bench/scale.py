"""`alchemist bench scale`: one replica against several on this machine's cores, serving and training together.

    alchemist bench scale [--json] [--replica-counts 1 2] [--num-requests 48] [--request-rate 1]
                          [any `alchemist serve` flag, or --config FILE]

For each count N of ``--replica-counts``: `alchemist serve --replicas N` (N = 1: one server process on the cores a
replica of the largest count gets; N > 1: a front, a local Ray cluster (or --ray-address's) and N replicas of
``cpu_count // N`` cores each), its feedback log a fresh database of a throwaway PostgreSQL server (or of
--feedback-db's) for every N alike. The same workload each time, `bench online`'s (ShareGPT conversations with
Poisson arrivals, every prompt recorded, a seeded fraction of the responses corrected as they finish: ``--feedback
fact``'s invented facts by default), then the drain until the feedback is trained. A row per N:

- serving: output tokens/s, TTFT / TPOT / ITL percentiles (client-side, as `bench online` measures them);
- training, per replica (the replicas' /metrics summed, divided by N): sample passes per second of training slices,
  the gradients' all-reduce's share of the training time (``alchemist:training_allreduce_seconds`` against
  ``alchemist:training_seconds``: the replicas having met, what moving the gradients costs), the share spent at the
  steps' meeting points (``alchemist:training_sync_seconds``: waiting for the slower replica, mostly), steps;
- record affinity: the share of feedback the front passed to the replica that served the response (its hit and
  miss counters), and the share of sample passes replayed from a record (the rest recomputed: a replica's queue
  claims any entry of the shared log);
- the adapter versions the replicas serve at the end (one, if they trained in lockstep).

Two replicas of one core each cannot beat one replica on two cores; against one replica on one core they show what
scaling out costs and keeps (docs/design scale-out's "Measuring on a 2-core machine").
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np

from alchemist.bench import http_calls
from alchemist.bench.online import (
    RequestResult,
    build_workload,
    run_load,
    scrape,
    start_server,
    stop_server,
    summarize,
    warm_up,
)
from alchemist.bench.postgres import fresh_database, postgres_server
from alchemist.bench.report import print_rows
from alchemist.model.loader import hf_dir_for
from alchemist.model.tokenizer import Tokenizer
from alchemist.scale.replica_set import WATCH_S

P = "alchemist:training_"


def replica_urls(url: str, replicas: int) -> list[str]:
    """Where each replica serves (the front's /v1/replicas), or the server itself (one replica, no front)."""
    if replicas == 1:
        return [url]
    return [r["url"] for r in http_calls.get(url + "/v1/replicas", timeout=30).json()["data"]]


def summed(urls: list[str]) -> dict[str, float]:
    """The replicas' /metrics samples, summed by name (counters add up)."""
    total: dict[str, float] = {}
    for url in urls:
        for name, value in scrape(url).items():
            total[name] = total.get(name, 0.0) + value
    return total


def wait_ready(url: str, replicas: int, timeout_s: float = 600.0) -> None:
    """Until every replica serves and, where they train, trains in the replicas' group (not "waiting")."""
    deadline = time.monotonic() + timeout_s
    while replicas > 1 and time.monotonic() < deadline:
        states = http_calls.get(url + "/v1/replicas", timeout=30).json()["data"]
        if all(r["state"] == "ready" and r["training"] != "waiting" for r in states):
            return
        time.sleep(0.5)
    if replicas > 1:
        raise RuntimeError(f"replicas not ready within {timeout_s} s")


def queued(url: str) -> int:
    backlog = http_calls.get(url + "/v1/feedback", params={"limit": 1}, timeout=30).json()["backlog"]
    return sum(kind["count"] for kind in backlog.values())


def settled_versions(url: str, timeout_s: float = 60.0) -> list[int]:
    """The versions the replicas serve once they agree and the front has seen it: one version, unchanged for a
    second and a half of polls (the front asks each replica every ``WATCH_S``; the log marks a batch trained right
    after its version swapped in on one replica, and the others swap it in at their next step)."""
    deadline, seen, since = time.monotonic() + timeout_s, None, time.monotonic()
    while True:
        replicas = http_calls.get(url + "/v1/replicas", timeout=30).json()["data"]
        versions = sorted({r["adapter_version"] for r in replicas})
        if versions != seen:
            seen, since = versions, time.monotonic()
        if (len(versions) == 1 and time.monotonic() - since >= 3 * WATCH_S) or time.monotonic() > deadline:
            return versions
        time.sleep(WATCH_S / 2)


def bench_level(args: argparse.Namespace, replicas: int, work, database: str) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"alchemist-bench-scale-{replicas}-"))
    cores = max(1, (os.cpu_count() or 1) // max(args.replicas))  # per replica, alike at every count
    flags = ["--replicas", str(replicas), "--feedback-db", database]
    threads = os.environ.get("OMP_NUM_THREADS")
    if replicas == 1:
        os.environ["OMP_NUM_THREADS"] = str(cores)  # the server's torch threads (a replica's, set by Ray, above 1)
    try:
        server = start_server(args, f"replicas-{replicas}", workdir, flags, record_policy="requested")
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    try:
        wait_ready(server.url, replicas)
        warm_up(server.url, work)
        urls = replica_urls(server.url, replicas)
        before = summed(urls)
        results, duration_s = run_load(server.url, work, list(range(len(work.chats))))
        done = [r for r in results if isinstance(r, RequestResult)]
        for e in [r for r in results if not isinstance(r, RequestResult)][:3]:
            print(f"# {replicas} replicas: request failed: {type(e).__name__}: {e}", file=sys.stderr)
        serving = summarize(f"replicas-{replicas}", done, len(results) - len(done), duration_s)
        row = {"replicas": replicas, "cores_each": cores, **serving}
        drain_start = time.perf_counter()
        while (left := queued(server.url)) and time.perf_counter() - drain_start < args.drain_s:
            time.sleep(1.0)
        end = summed(urls)
        delta = lambda name: end.get(P + name, 0.0) - before.get(P + name, 0.0)  # noqa: E731
        passes = delta('samples_total{path="replay"}') + delta('samples_total{path="recompute"}')
        train_s, allreduce_s, sync_s = (delta(f"{name}seconds_total") for name in ("", "allreduce_", "sync_"))
        row.update(
            drain_s=round(time.perf_counter() - drain_start, 1),
            unsettled=left,
            steps=int(delta("steps_total") / replicas),  # each replica takes every step
            samples_per_replica=round(passes / replicas, 1),
            samples_s_per_replica=round(passes / train_s, 2) if train_s else None,  # summed over summed seconds
            train_s_per_replica=round(train_s / replicas, 1),
            allreduce_share=round(allreduce_s / train_s, 3) if train_s else None,
            sync_share=round(sync_s / train_s, 3) if train_s else None,
            replayed_share=round(delta('samples_total{path="replay"}') / passes, 3) if passes else None,
        )
        if replicas > 1:
            front = scrape(server.url)
            hits = front.get('alchemist:front_feedback_total{affinity="hit"}', 0.0)
            misses = front.get('alchemist:front_feedback_total{affinity="miss"}', 0.0)
            row["feedback_affinity"] = round(hits / (hits + misses), 3) if hits + misses else None
            row["versions"] = settled_versions(server.url)
        else:
            row["feedback_affinity"] = 1.0 if row["feedback"] else None  # one replica holds every record
            row["versions"] = [http_calls.get(server.url + "/v1/adapters", timeout=30).json()["serving_version"]]
    finally:
        stop_server(server)
    shutil.rmtree(workdir / "data", ignore_errors=True)
    print(f"# {replicas} replicas: log {server.log_path}", file=sys.stderr)
    return row


@contextmanager
def postgres_databases(feedback_db: str | None) -> Iterator[Callable[[], str]]:
    """Fresh databases for the runs' feedback logs: on the server of ``--feedback-db`` where it names one
    (postgresql://), else on a throwaway server, deleted after the runs."""
    if feedback_db is not None and feedback_db.startswith(("postgresql://", "postgres://")):
        yield partial(fresh_database, feedback_db)
    else:
        with postgres_server() as pg:
            yield pg.fresh_database


def main(args: argparse.Namespace) -> int:
    if any(n < 1 for n in args.replicas):
        raise ValueError("--replicas: counts of replicas, each at least 1")
    tokenizer = Tokenizer.from_pretrained(hf_dir_for(args.serve.engine.model))
    work = build_workload(args, tokenizer)
    note = (
        f"# {len(work.chats)} ShareGPT {args.mode} requests at {args.request_rate} req/s (Poisson, seed {args.seed}), "
        f"prompt tokens mean {np.mean(work.prompt_tokens):.0f}, output tokens mean {np.mean(work.max_tokens):.0f}, "
        f"{args.feedback} feedback on {sum(f is not None for f in work.feedback)}; replicas {args.replicas}; "
        f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, load average at start "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(note, file=sys.stderr)
    rows = []
    with postgres_databases(args.serve.server.feedback_db) as fresh_database:
        for replicas in args.replicas:
            rows.append(bench_level(args, replicas, work, fresh_database()))
            print_rows(rows[-1:], True, sys.stderr)
    print_rows(rows, args.json)
    if not args.json:
        print(f"{note}, at end {os.getloadavg()[0]:.1f}")
    return 0
