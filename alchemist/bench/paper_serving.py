"""`alchemist bench paper`'s fourth claim: serving latency with recording off / on and training off / on, under an
open-loop ShareGPT load at three rates up to saturation, with the trainer's backlog and each correction's time to
serve. The servers, the load and the measurements are `bench online`'s (``online.start_server``,
``online.measure_load``); what is new here is the runs, the rates and the time to serve (``backlog.TrainedThrough``).

Runs (one fresh server each, its rates in increasing order, a drain after each rate where it trains):
- ``off``: ``--record-policy none --no-train``: serving alone;
- ``record``: prompts recorded as training would need them, nothing trained: recording's own cost;
- ``train``: recorded and trained online, replaying the records (the system as it ships);
- ``train_recompute``: nothing recorded, trained online by recomputing every prompt: a separate trainer's work
  on the same cores.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from alchemist.bench import online
from alchemist.bench.backlog import TrainedThrough
from alchemist.bench.report import print_rows

# run -> (recording, training, --record-policy, serve flags)
RUNS = {
    "off": ("off", "off", "none", ["--no-train"]),
    "record": ("on", "off", "requested", ["--no-train"]),
    "train": ("on", "on", "requested", []),
    "train_recompute": ("off", "on", "none", ["--no-train-replay"]),
}


def workload(args: argparse.Namespace, tokenizer, rate: float, seed: int) -> online.Workload:
    """``--requests-per-rate`` ShareGPT requests at ``rate`` (Poisson), corrected as ``bench online`` corrects
    them; each rate its own ``seed``, so that no prompt is served twice from the prefix cache."""
    spec = argparse.Namespace(
        num_requests=args.requests_per_rate, seed=seed, mode=args.mode, max_prompt_tokens=args.max_prompt_tokens,
        request_rate=rate, feedback_fraction=args.feedback_fraction, max_tokens=args.max_tokens, feedback=args.feedback,
    )  # fmt: skip
    return online.build_workload(spec, tokenizer)


def capacity(url: str, args: argparse.Namespace, tokenizer) -> float:
    """Requests per second the server completes of ``--capacity-requests`` sent at once (no feedback)."""
    work = workload(args, tokenizer, 1.0, args.seed + 1000)
    n = min(args.capacity_requests, len(work.chats))
    work.arrivals_s = [0.0] * len(work.chats)
    results, duration_s = online.run_load(url, work, list(range(n)))
    failed = [r for r in results if not isinstance(r, online.RequestResult)]
    if failed:
        raise RuntimeError(f"capacity probe: {len(failed)} of {n} requests failed: {failed[0]!r}")
    return n / duration_s


def serving_rows(args: argparse.Namespace) -> list[dict]:
    from alchemist.model.loader import hf_dir_for
    from alchemist.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(hf_dir_for(args.serve.engine.model))
    rates = sorted(args.rates) if args.rates else None
    rows = []
    for run in (r for r in RUNS if r in args.runs):
        recording, training, policy, flags = RUNS[run]
        workdir = Path(tempfile.mkdtemp(prefix=f"alchemist-bench-paper-{run}-"))
        server = online.start_server(args, run, workdir, flags, policy)
        try:
            online.warm_up(server.url, workload(args, tokenizer, 1.0, args.seed))
            if rates is None:
                saturation = capacity(server.url, args, tokenizer)
                rates = [round(f * saturation, 3) for f in sorted(args.rate_fractions)]
                print(f"# capacity {saturation:.3f} req/s ({run}): rates {rates}", file=sys.stderr)
            for i, rate in enumerate(rates):
                work = workload(args, tokenizer, rate, args.seed + i)
                watch = TrainedThrough(lambda url=server.url: online.trained(url), args.served_interval_s)
                row, _, done = online.measure_load(server.url, args, run, work, train=training == "on", watch=watch)
                if training == "off":
                    row.update(dict.fromkeys(online.TRAINING_FIELDS))
                row.pop("run")
                row = {"claim": "serving", "run": run, "recording": recording, "training": training, "rate": rate,
                       **row, **served(done, watch, training == "on")}  # fmt: skip
                rows.append(row)
                print_rows(rows[-1:], True, sys.stderr)
        finally:
            online.stop_server(server)
        shutil.rmtree(workdir / "data", ignore_errors=True)  # the log stays, for a look afterwards
        print(f"# {run}: server log {server.log_path}", file=sys.stderr)
    return rows


def served(done: list[online.RequestResult], watch: TrainedThrough, training: bool) -> dict:
    """Each correction's seconds from its acknowledgement to the first adapter version seen that trained it (None:
    not by the end of the drain), and their median and maximum."""
    if not training:
        return {"served_s": None, "served_p50_s": None, "served_max_s": None, "unserved": None}
    times = [watch.served_after(r.feedback_seq, r.feedback_at) for r in done if r.feedback_seq is not None]
    ok = [t for t in times if t is not None]
    return {
        "served_s": [None if t is None else round(t, 2) for t in times],
        "served_p50_s": round(statistics.median(ok), 2) if ok else None,
        "served_max_s": round(max(ok), 2) if ok else None,
        "unserved": len(times) - len(ok),
    }
