"""`alchemist bench soak` end to end, briefly: a real server process with training on, two streaming clients for
12 s with feedback; every row's fields present and sane, RSS, the adapter version and the backlog sampled over time.
Memory growth is not asserted here (docs/benchmarks.md, "Soak"); `--runs off` is the same run with --no-train."""

from __future__ import annotations

import json
import subprocess
import sys

CMD = [sys.executable, "-m", "alchemist.cli", "bench", "soak", "--json", "--runs", "on", "--clients", "2"]
CMD += ["--minutes", "0.2"]
CMD += ["--correct-every", "2", "--max-tokens", "8", "--max-prompt-tokens", "96", "--num-prompts", "8"]
CMD += ["--sample-interval-s", "1", "--warmup-s", "2", "--serve-arg=--record-budget-mb=256"]
CMD += ["--serve-arg=--record-host-budget-mb=0"]


def test_bench_soak_brief():
    done = subprocess.run(CMD, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    runs = {r["run"]: r for r in rows if "run" in r}
    assert list(runs) == ["on"]
    for r in runs.values():
        assert r["requests"] >= 2 and r["errors"] == 0 and r["errors_429"] == 0 and r["errors_by"] is None
        assert r["feedback"] == r["requests"] and 1 <= r["corrections"] < r["requests"]
        assert 200 < r["rss_warm_mb"] <= r["rss_max_mb"] and r["rss_end_mb"] <= r["rss_max_mb"]
        assert r["warm_s"] >= 2 and 0 <= r["rss_growth_mb"] <= r["rss_max_mb"] - r["rss_warm_mb"] + 0.1  # rounding
        assert r["backlog_max"] >= 1
    for run in runs:
        rss = [r for r in rows if r.get("rss_of") == run]
        assert len(rss) >= 8 and all(s["rss_mb"] > 200 and s["anon_mb"] > 0 for s in rss)
        assert any(s["store_mb"] for s in rss)  # the prompts asked to be recorded: the store holds some
        assert all(s["adapter_version"] is not None for s in rss if s["store_mb"] is not None)
        assert len([r for r in rows if r.get("backlog_of") == run]) >= 8
    for gate in (r for r in rows if "gate_of" in r):  # training on may have committed a version in 12 s
        assert gate["gate_of"] == "on" and 0 < gate["evaluation_s"] <= gate["train_s"]
