"""The results page's tables, made from the benchmarks' committed ``--json`` rows.

    python -m alchemist.bench.results_page                  # rewrite the tables in docs/benchmarks.md
    python -m alchemist.bench.results_page --check          # exit 1 (and print a diff) if they are stale

docs/benchmarks.md marks each generated block with ``<!-- results: NAME -->`` ... ``<!-- /results -->``; NAME is a
folder of docs/results/ holding the rows of one invocation or more (``*.jsonl``, as ``--json`` printed them) and a
``meta.toml`` that says which benchmark made them, on what machine, at which commit, with which commands, and which
file is which run. Only the marked blocks change; the explanations around them are written by hand, and every table
on the page is a marked block (a benchmark without committed rows has a section that names its command and links to
its last run by hand in docs/history.md).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alchemist.bench.report import _fmt

PAGE = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- results: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def f1(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def both_ways(row: dict, part: str) -> str:
    """A throughput row's time of a pass without gradient, replayed / recomputed (rows before both were timed:
    the one time, recomputed both ways)."""
    if not row[f"{part}_s"]:
        return "-"
    if f"{part}_recompute_s" not in row:
        return f"{f1(row[f'{part}_s'])} (both ways)"
    return f"{f1(row[f'{part}_s'])} / {f1(row[f'{part}_recompute_s'])}"


def ratio(num: float, den: float) -> str:
    return f"**{num / den:.2f}**"


def provenance(meta: dict, folder: Path) -> str:
    """Machine, commit and commands: the head of every generated block."""
    commands = "\n".join(meta["commands"])
    run = f"{meta['date']}, commit {meta['commit']}. {meta.get('conditions', '')}".rstrip()
    return (
        f"- Machine: {meta['machine']}\n- Run: {run}\n- Rows: `docs/results/{folder.name}/`\n\n"
        f"```\n{commands}\n```\n\n"
    )


def serve_block(meta: dict, folder: Path) -> str:
    """Per workload and concurrency, each run's value side by side, and ours / the reference's ratio of medians."""
    groups = {label: [read_rows(folder / f) for f in files] for label, files in meta["runs"].items()}
    ours, ref = meta["ours"], meta["reference"]
    keys = [(r["workload"], r["concurrency"]) for r in groups[ours][0]]

    def values(label: str, key: tuple, field: str) -> list[float]:
        return [r[field] for run in groups[label] for r in run if (r["workload"], r["concurrency"]) == key]

    def cell(label: str, key: tuple, field: str) -> str:
        return ", ".join(f1(v) for v in values(label, key, field))

    header = ["workload", "conc."] + [f"output tok/s: {label}" for label in groups] + [f"{ours} / {ref}"]
    for field in ("TTFT p50 ms", "TPOT p99 ms", "ITL p99 ms"):
        header += [f"{field}: {ours}", ref]
    rows = []
    for key in keys:
        row = [*key, *(cell(label, key, "output_tok_s") for label in groups)]
        row.append(ratio(statistics.median(values(ours, key, "output_tok_s")),
                         statistics.median(values(ref, key, "output_tok_s"))))
        for field in ("ttft_p50_ms", "tpot_p99_ms", "itl_p99_ms"):
            row += [cell(ours, key, field), cell(ref, key, field)]
        rows.append(row)
    return table(header, rows)


# Issue 44's goals for output tok/s: the most adapters' over one adapter's, and ours over the reference's at each K.
MANY_ADAPTERS_VS_ONE = 0.85
OURS_VS_REFERENCE = 1.0


def serve_adapters_block(meta: dict, folder: Path) -> str:
    """`bench serve --adapters`' rows: per run (``meta["runs"]``: label -> files, as serve's), workload, K and
    concurrency, output tok/s (medians of the files) and TTFT / TPOT; then issue 44's goals where ``meta`` names
    ``ours``: the most adapters against one, and ours against the ``reference`` at each K where it names one."""
    groups = {label: [r for f in files for r in read_rows(folder / f)] for label, files in meta["runs"].items()}
    keys = list(dict.fromkeys((r["workload"], r["adapters"], r["concurrency"]) for rs in groups.values() for r in rs))

    def median(label: str, key: tuple, field: str) -> float | None:
        values = [r[field] for r in groups[label] if (r["workload"], r["adapters"], r["concurrency"]) == key]
        return statistics.median(values) if values else None

    header = ["run", "workload", "adapters", "conc.", "output tok/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms"]
    body = [[label, *key, f1(median(label, key, "output_tok_s")),
             f"{f1(median(label, key, 'ttft_p50_ms'))} / {f1(median(label, key, 'ttft_p99_ms'))}",
             f"{f1(median(label, key, 'tpot_p50_ms'))} / {f1(median(label, key, 'tpot_p99_ms'))}"]
            for label in groups for key in keys if median(label, key, "output_tok_s") is not None]  # fmt: skip
    if "ours" not in meta:
        return table(header, body)
    ours, ref, goals = meta["ours"], meta.get("reference"), []
    for workload, k, c in keys:
        value = median(ours, (workload, k, c), "output_tok_s")
        one = median(ours, (workload, 1, c), "output_tok_s")
        theirs = median(ref, (workload, k, c), "output_tok_s") if ref in groups else None
        if k == max(key[1] for key in keys) and k > 1 and value and one:
            goals.append([workload, k, c, f"{ours}: {k} adapters / 1", value / one, MANY_ADAPTERS_VS_ONE])
        if value and theirs:
            goals.append([workload, k, c, f"{ours} / {ref}", value / theirs, OURS_VS_REFERENCE])
    goals = [[*g[:4], f"**{g[4]:.2f}**", f">= {g[5]}", "met" if g[4] >= g[5] else "not met"] for g in goals]
    return table(header, body) + "\n" + table(["workload", "adapters", "conc.", "ratio", "value", "goal", ""], goals)


def online_block(meta: dict, folder: Path) -> str:
    """The three runs' serving latency and training speed, then the goals' ratios as bench online computes them."""
    rows = read_rows(folder / meta["rows"])
    runs = [r for r in rows if "run" in r and "backlog_of" not in r]
    header = ["run", "TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms", "TTFT p50 ms", "train tok/s: all; under load",
              "replayed / recomputed", "drained"]
    body = [
        [r["run"], f1(r["tpot_p50_ms"]), f1(r["tpot_p99_ms"]), f1(r["itl_p99_ms"]), f1(r["ttft_p50_ms"]),
         "-" if r["train_tok_s"] is None else f"{f1(r['train_tok_s'])}; {f1(r['train_tok_s_load'])}",
         "-" if r["replayed"] is None else f"{r['replayed']} / {r['recomputed']}",
         "-" if r["drained"] is None else ("yes" if r["drained"] else "no")]
        for r in runs
    ]
    goals = [[r["ratio"], f"**{r['value']:.2f}**", r["goal"], "met" if r["met"] else "not met"]
             for r in rows if "ratio" in r]
    blocks = [table(header, body), table(["ratio", "value", "goal", ""], goals)]
    backlog = [r for r in rows if "backlog_of" in r]
    if backlog:
        blocks.append(backlog_table(backlog, meta.get("backlog_every_s", 30.0)))
    return "\n".join(blocks)


def backlog_table(samples: list[dict], every_s: float) -> str:
    """The runs' backlog over time (training on): the samples on an ``every_s`` grid, each phase's last and each
    run's peak (marked)."""
    body = []
    for run in dict.fromkeys(s["backlog_of"] for s in samples):  # in the runs' order
        if run == "off":
            continue  # training off: its backlog is all its feedback, by design
        series = [s for s in samples if s["backlog_of"] == run and "queued" in s]  # not a failed scrape's
        peak = max(series, key=lambda s: s["queued"])
        kept, next_t = [], 0.0
        for i, s in enumerate(series):
            last_of_phase = i + 1 == len(series) or series[i + 1]["phase"] != s["phase"]
            on_grid = s["t_s"] >= next_t
            if on_grid:
                next_t += every_s * (1 + (s["t_s"] - next_t) // every_s)
            if on_grid or last_of_phase or s is peak:
                kept.append(s)
        body += [[run, f1(s["t_s"]), s["phase"], f"**{s['queued']}**" if s is peak else s["queued"],
                  s["correction"], s["thumbs_up"] + s["thumbs_down"], s["preference"], f1(s["oldest_s"])]
                 for s in kept]  # fmt: skip
    return table(["backlog of", "t s", "phase", "queued", "corrections", "thumbs", "pairs", "oldest s"], body)


def learn_block(meta: dict, folder: Path) -> str:
    """`bench learn`'s parts that ``meta`` names rows of: the teach rounds and the end-of-teach measures, the
    forgetting curves (``meta["forgetting"]``: label -> rows), the throughput of each objective, the rounds of
    the thumbs and pairs parts (``meta["preferences"]``: label -> rows)."""
    blocks, yes = [], {True: "met", False: "not met"}
    if "teach" in meta:
        teach = read_rows(folder / meta["teach"])
        rounds = [r for r in teach if r["part"] == "teach"]
        end = next(r for r in teach if r["part"] == "teach_end")
        by_2 = next(r for r in rounds if r["round"] == min(2, rounds[-1]["round"]))
        blocks.append(table(
            ["round", "facts known", "corrected", "batches", "promoted / blocked", "steps", "quarantined", "train s"],
            [[r["round"], f"{r['known']} of {r['of']}", r["corrected"], r["batches"],
              f"{r['promoted']} / {r['blocked']}", r["steps"], r["quarantined"], f1(r["train_s"])] for r in rounds],
        ))  # fmt: skip
        blocks.append(table(["at the end of teach", "value", "goal"], [
            ["held-out perplexity rise", f"{end['perplexity_rise']:+.1%}", f"< 5%: {yes[end['goal_rise']]}"],
            ["unrelated greedy answers unchanged (32 tokens)", f"{end['unchanged_32']} of {end['unrelated']}",
             f">= 80%: {yes[end['goal_unchanged']]}"],
            ["the same, first 16 tokens", f"{end['unchanged_16']} of {end['unrelated']}", ""],
            ["facts known after 2 corrections each", f"{by_2['known']} of {by_2['of']}",
             f">= 90%: {yes[end['goal_known_by_2']]}"],
        ]))  # fmt: skip
    if "forgetting" in meta:  # label -> rows: one curve per configuration
        curves = [(label, r) for label, file in meta["forgetting"].items()
                  for r in read_rows(folder / file) if r["part"] == "forgetting"]  # fmt: skip
        blocks.append(table(
            ["forgetting", "facts taught", "first ten known", "all taught known", "learned when taught",
             "corrections", "versions promoted / blocked", "steps", "train s"],
            [[label, r["taught"], f"{r['first_ten_known']} of {r['of']}", f"{r['taught_known']} of {r['taught']}",
              r["learned_when_taught"], r["corrections"], f"{r['promoted']} / {r['blocked']}", r["steps"],
              f1(r["train_s"])] for label, r in curves],
        ))  # fmt: skip
    if "throughput" in meta:
        through = read_rows(folder / meta["throughput"])
        blocks.append(table(
            ["objective", "replay s", "recompute s", "base-model pass s (replay / recompute)",
             "KTO reference point s (replay / recompute)", "items/s replay", "replay / recompute", "goal"],
            [[r["objective"].upper(), f"{r['replay_s']:.1f}", f"{r['recompute_s']:.1f}", both_ways(r, "reference"),
              both_ways(r, "kl"), f"{r['replay_items_s']:.2f}", f"{r['ratio']:.2f}x",
              "-" if r["goal"] is None else f"{r['goal']}: {yes[r['met']]}"] for r in through],
        ))  # fmt: skip
    if "preferences" in meta:  # label -> rows: the thumbs and pairs parts' rounds
        rounds = [(label, r) for label, file in meta["preferences"].items() for r in read_rows(folder / file)]
        blocks.append(table(
            ["feedback", "round", "entries", "sampled median", "versions promoted / blocked", "steps", "quarantined",
             "train s", "held-out median", "fall", "goal", "held-out margin, nats (pairs it favours)"],
            [[label, r["round"], r["entries"], "-" if r["sampled_median"] is None else r["sampled_median"],
              f"{r['promoted']} / {r['blocked']}", r["steps"], r["quarantined"], f1(r["train_s"]),
              "-" if r["held_out_median"] is None else r["held_out_median"],
              "-" if r["fall"] is None else f"{r['fall']:.0%}",
              f">= 30%: {yes[r['goal_fall']]}" if "goal_fall" in r else "", margin(r)] for label, r in rounds],
        ))  # fmt: skip
    return "\n".join(blocks)


def margin(row: dict) -> str:
    """A preference round's held-out margin (``alchemist.bench.learn_preferences.HeldOutMargins``): the mean, and
    how many of the pairs it favours; "-" for rows measured before it existed or without pairs."""
    if row.get("held_out_margin") is None:
        return "-"
    ahead = round(row["held_out_accuracy"] * row["held_out_pairs"])
    return f"{row['held_out_margin']:+.2f} ({ahead} of {row['held_out_pairs']})"


def soak_block(meta: dict, folder: Path) -> str:
    """Per invocation (``meta["files"]``: label -> rows) and run: the load, the errors, resident memory after
    warm-up, the backlog; then the evaluation gate's cost per version (of those GET /v1/adapters still lists)."""
    header = ["invocation", "run", "allocator", "requests", "errors / 429", "trainer's versions", "RSS MB: warm (at s)",
              "end", "peak", "settled growth", "slope MB/min", "backlog max / end"]  # fmt: skip
    body, gates = [], []
    for label, file in meta["files"].items():
        rows = read_rows(folder / file)
        for r in (r for r in rows if "run" in r):
            warm = "-" if r["warm_s"] is None else f"{f1(r['rss_warm_mb'])} ({r['warm_s']:.0f})"
            # the adapter version the trainer reached (GET /v1/adapters lists only the latest few: the gate rows)
            versions = max((s["adapter_version"] or 0 for s in rows if s.get("rss_of") == r["run"]), default=0)
            body.append([label, r["run"], r["allocator"], r["requests"], f"{r['errors']} / {r['errors_429']}",
                         versions, warm, f1(r["rss_end_mb"]), f1(r["rss_max_mb"]),
                         f1(r["rss_settled_growth_mb"]), f1(r["rss_slope_mb_min"]),
                         f"{r['backlog_max']} / {r['backlog_end']}"])  # fmt: skip
        gates += [[label, g["version"], "yes" if g["promoted"] else "no", f1(g["evaluation_s"]), f1(g["train_s"]),
                   f"{g['evaluation_share']:.0%}"] for g in rows if "gate_of" in g]  # fmt: skip
    gate_header = ["invocation", "version", "promoted", "gate s", "version's training s", "gate's share"]
    return table(header, body) + "\n" + table(gate_header, gates)


def memory_block(meta: dict, folder: Path) -> str:
    """`bench memory`'s parts as it prints them: per part a table whose columns are its rows' keys, each value as
    the benchmark's own table formats it."""
    parts: dict[str, list[dict]] = {}
    for row in read_rows(folder / meta["rows"]):
        parts.setdefault(row["part"], []).append({k: v for k, v in row.items() if k != "part"})
    return "\n".join(f"{name}:\n\n" + table(list(rows[0]), [[_fmt(v) for v in r.values()] for r in rows])
                     for name, rows in parts.items())


# Issue 42's goals for training on against off under the same open-loop load: (row field, most on / off).
SERVING_GOALS = (("tpot_p50_ms", 1.10), ("tpot_p99_ms", 1.25), ("ttft_p99_ms", 1.25))
SERVED_WITHIN_S = 60.0  # ... and every correction served within a minute of its acknowledgement


def paper_block(meta: dict, folder: Path) -> str:
    """`bench paper`'s rows, per invocation (``meta["files"]``: label -> rows), a table per claim they hold (training
    throughput, memory, tokens under a budget: each with the paper's number and whether it was met; serving: each
    run's latency at each rate, the training it did under the load and each correction's time to serve, then
    training on against the off run at the same rate with issue 42's goals); then ``meta["images"]``."""
    runs = [(label, r) for label, file in meta["files"].items() for r in read_rows(folder / file)]
    blocks = []
    for claim, render in (("throughput", _throughput), ("memory", _memory), ("budget", _budget),
                          ("serving", _serving)):  # fmt: skip
        rows = [(label, r) for label, r in runs if r["claim"] == claim]
        if rows:
            blocks.append(render(rows))
    blocks += [f"![{image}](results/{folder.name}/{image})\n" for image in meta.get("images", [])]
    return "\n".join(blocks)


def _met(row: dict) -> str:
    return "-" if row.get("met") is None else ("met" if row["met"] else "not met")


def _throughput(rows: list[tuple[str, dict]]) -> str:
    header = ["invocation", "prompt bucket", "P", "R", "trained tok/s: replay", "recompute", "transformers + PEFT",
              "replay / recompute", "replay / PEFT", "paper", ""]  # fmt: skip
    return table(header, [[label, r["bucket"], r["P"], r["R"], f1(r["replay_tok_s"]), f1(r["recompute_tok_s"]),
                           f1(r["peft_tok_s"]), f"**{r['replay_vs_recompute']:.2f}**",
                           "-" if r["replay_vs_peft"] is None else f"{r['replay_vs_peft']:.2f}",
                           f">= {r['paper']}", _met(r)] for label, r in rows])  # fmt: skip


def _memory(rows: list[tuple[str, dict]]) -> str:
    header = ["invocation", "prompt bucket", "P", "R", "transient peak MiB: replay", "recompute", "transformers + PEFT",
              "replay vs recompute", "replay vs PEFT", "paper", ""]  # fmt: skip
    pct = lambda v: "-" if v is None else f"{v:+.0f}%"  # noqa: E731
    return table(header, [[label, r["bucket"], r["P"], r["R"], f1(r["replay_mib"]), f1(r["recompute_mib"]),
                           f1(r["peft_mib"]), f"**{pct(r['replay_vs_recompute_pct'])}**",
                           pct(r["replay_vs_peft_pct"]), f"<= {r['paper']:+.0f}%", _met(r)]
                          for label, r in rows])  # fmt: skip


def _budget(rows: list[tuple[str, dict]]) -> str:
    header = ["invocation", "mode", "budget MiB", "longest prompt that fits", "tokens a step", "peak MiB",
              "tokens vs recompute", "paper", ""]  # fmt: skip
    return table(header, [[label, r["mode"], r["budget_mib"], r["max_P"], r["tokens"], f1(r["peak_mib"]),
                           "-" if r["tokens_vs_recompute"] is None else f"**{r['tokens_vs_recompute']:.2f}**",
                           "-" if r["paper"] is None else f">= {r['paper']}", _met(r)]
                          for label, r in rows])  # fmt: skip


def _serving(runs: list[tuple[str, dict]]) -> str:
    header = ["invocation", "run", "req/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "ITL p99 ms",
              "slices under load: n, s", "steps", "served s: p50 / max", "unserved", "backlog max"]  # fmt: skip
    body = [[label, r["run"], r["rate"], f"{f1(r['ttft_p50_ms'])} / {f1(r['ttft_p99_ms'])}",
             f"{f1(r['tpot_p50_ms'])} / {f1(r['tpot_p99_ms'])}", f1(r["itl_p99_ms"]),
             f"{r['slices_load']}, {f1(r['slice_s_load'])}", "-" if r["steps"] is None else r["steps"],
             "-" if r["served_s"] is None else f"{f1(r['served_p50_s'])} / {f1(r['served_max_s'])}",
             "-" if r["unserved"] is None else r["unserved"], "-" if r["backlog_max"] is None else r["backlog_max"]]
            for label, r in runs]  # fmt: skip
    off = {}
    for _, r in runs:
        if r["training"] == "off" and r["recording"] == "off":
            off.setdefault(r["rate"], r)
    goals = []
    for label, r in runs:
        if r["training"] != "on" or r["rate"] not in off:
            continue
        for field, most in SERVING_GOALS:
            value = r[field] / off[r["rate"]][field]
            goals.append([label, r["run"], r["rate"], f"{field} on / off", f"**{value:.2f}**", f"<= {most}",
                          "met" if value <= most else "not met"])  # fmt: skip
        served = r["served_max_s"] if not r["unserved"] else None
        goals.append([label, r["run"], r["rate"], "slowest correction served s",
                      f"**{f1(served)}**" if served is not None else f"**{r['unserved']} unserved**",
                      f"<= {SERVED_WITHIN_S:.0f}", "met" if served is not None and served <= SERVED_WITHIN_S
                      else "not met"])  # fmt: skip
    return table(header, body) + "\n" + table(["invocation", "run", "req/s", "ratio", "value", "goal", ""], goals)


SCALE_GOALS = (("allreduce_share", "<=", 0.05), ("feedback_affinity", ">=", 0.95))  # issue 43's


def scale_block(meta: dict, folder: Path) -> str:
    """`bench scale`'s rows, per invocation (``meta["files"]``: label -> rows): each count of replicas' serving,
    training per replica, the gradients' all-reduce's and the meeting points' shares of training time (rows from
    before the two were told apart have the collectives' whole share as the first, and "-" as the second) and record
    affinity; then issue 43's goals."""
    header = ["invocation", "replicas x cores", "output tok/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms",
              "samples/s per replica", "steps", "all-reduce share", "waits' share", "feedback to its replica",
              "replayed", "versions at the end", "unsettled"]  # fmt: skip
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    body, goals = [], []
    for label, file in meta["files"].items():
        for r in read_rows(folder / file):
            body.append([label, f"{r['replicas']} x {r['cores_each']}", f1(r["output_tok_s"]),
                         f"{f1(r['ttft_p50_ms'])} / {f1(r['ttft_p99_ms'])}",
                         f"{f1(r['tpot_p50_ms'])} / {f1(r['tpot_p99_ms'])}", _fmt(r["samples_s_per_replica"]),
                         r["steps"], pct(r["allreduce_share"]), pct(r.get("sync_share")), pct(r["feedback_affinity"]),
                         pct(r["replayed_share"]), ", ".join(map(str, r["versions"])), r["unsettled"]])  # fmt: skip
            if r["replicas"] > 1:
                for field, op, bound in SCALE_GOALS:
                    value = r[field]
                    met = value is not None and (value <= bound if op == "<=" else value >= bound)
                    goals.append([label, r["replicas"], field, pct(value), f"{op} {bound:.0%}",
                                  "met" if met else "not met"])  # fmt: skip
    return table(header, body) + "\n" + table(["invocation", "replicas", "measure", "value", "goal", ""], goals)


RENDERERS: dict[str, Callable[[dict, Path], str]] = {
    "serve": serve_block, "serve_adapters": serve_adapters_block, "online": online_block, "learn": learn_block,
    "soak": soak_block, "memory": memory_block, "paper": paper_block, "scale": scale_block,
}


def render(folder: Path) -> str:
    meta = tomllib.loads((folder / "meta.toml").read_text())
    return provenance(meta, folder) + RENDERERS[meta["benchmark"]](meta, folder)


def update(page: str, results: Path) -> str:
    """The page with every marked block made again from its folder's rows."""
    def fill(m: re.Match) -> str:
        return m.group(1) + render(results / m.group("name")) + m.group(4)
    return BLOCK.sub(fill, page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", nargs="?", type=Path, default=PAGE)
    parser.add_argument("--results", type=Path, default=None, help="default: results/ beside the page")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the tables are stale")
    args = parser.parse_args(argv)
    old = args.page.read_text()
    new = update(old, args.results or args.page.parent / "results")
    if not args.check:
        args.page.write_text(new)
        return 0
    if new != old:
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "committed", "made"))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
