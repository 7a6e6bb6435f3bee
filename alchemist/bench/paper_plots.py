"""`alchemist bench paper --out DIR`'s plots: one PNG per claim, drawn from the rows alone (matplotlib, the ``plots``
extra, on the non-interactive Agg backend), so that committed rows redraw them.

- ``throughput.png``: trained tokens per second of step, replay / recompute / transformers + PEFT, by prompt bucket;
- ``memory.png``: the steps' transient peak memory, the same three, by prompt bucket;
- ``budget.png``: training tokens per step that fit the memory budget, recompute vs replay from disk;
- ``serving.png``: TTFT, TPOT and ITL p50 / p99 against the offered rate, a line per run (recording, training),
  and the trainer's time to serve a correction and its backlog's peak.

    python -m alchemist.bench.paper_plots DIR   # redraws DIR's PNGs from DIR/rows.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODES = (("replay", "replay"), ("recompute", "recompute (separate trainer)"), ("peft", "transformers + PEFT"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, buckets: list[str], series: dict[str, list[float | None]], ylabel: str) -> None:
    shown = {label: values for label, values in series.items() if any(v is not None for v in values)}
    width = 0.8 / max(1, len(shown))
    for k, (label, values) in enumerate(shown.items()):
        xs = [i + (k - (len(shown) - 1) / 2) * width for i in range(len(buckets))]
        ax.bar(xs, [0 if v is None else v for v in values], width, label=label)
    ax.set_xticks(range(len(buckets)), buckets)
    ax.set_xlabel("prompt tokens (ShareGPT bucket)")
    ax.set_ylabel(ylabel)
    ax.legend()


def plot_throughput(rows: list[dict], path: Path) -> None:
    _plot_by_bucket(rows, path, "tok_s", "trained tokens / s of step", "(1) training throughput")


def plot_memory(rows: list[dict], path: Path) -> None:
    _plot_by_bucket(rows, path, "mib", "transient peak of a step (MiB)", "(2) peak training memory")


def _plot_by_bucket(rows: list[dict], path: Path, measure: str, ylabel: str, title: str) -> None:
    """The three modes' ``{mode}_{measure}`` side by side per prompt-length bucket."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    series = {label: [r[f"{mode}_{measure}"] for r in rows] for mode, label in MODES}
    _bars(ax, [r["bucket"] for r in rows], series, ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_budget(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar([r["mode"] for r in rows], [r["tokens"] for r in rows], color=["tab:orange", "tab:blue"][: len(rows)])
    ax.set_ylabel(f"training tokens per step (R = {rows[0]['R']})")
    ax.set_title(f"(3) tokens per step under {rows[0]['budget_mib']:g} MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_serving(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    runs = list(dict.fromkeys(r["run"] for r in rows))
    panels = [("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("itl", "ITL (ms)")]
    for ax, (metric, label) in zip(axes[0], panels, strict=True):
        for i, run in enumerate(runs):
            mine = [r for r in rows if r["run"] == run]
            name = f"{run} (rec {mine[0]['recording']}, train {mine[0]['training']})"
            rates = [r["rate"] for r in mine]
            for q, style in ((50, "-"), (99, "--")):
                ax.plot(rates, [r[f"{metric}_p{q}_ms"] for r in mine], style, marker="o", color=f"C{i}",
                        label=f"{name} p{q}")  # fmt: skip
        ax.set_xlabel("offered load (requests / s)")
        ax.set_ylabel(label)
        ax.set_title(f"{metric.upper()} p50 (solid) / p99 (dashed)")
    axes[0][0].legend(fontsize=7)
    trained = [run for run in runs if any(r["run"] == run and r["training"] == "on" for r in rows)]
    for ax, (field, label) in zip(axes[1][:2], (("served_p50_s", "median"), ("served_max_s", "slowest")), strict=True):
        for run in trained:
            mine = [r for r in rows if r["run"] == run]
            ax.plot([r["rate"] for r in mine], [r[field] for r in mine], marker="o", color=f"C{runs.index(run)}",
                    label=run)  # fmt: skip
        ax.set_xlabel("offered load (requests / s)")
        ax.set_ylabel("s from correction to a version that trained it")
        ax.set_title(f"time to serve a correction ({label})")
        if trained:
            ax.legend(fontsize=7)
    ax = axes[1][2]
    for run in trained:
        mine = [r for r in rows if r["run"] == run]
        ax.plot([r["rate"] for r in mine], [r["backlog_max"] for r in mine], marker="o",
                color=f"C{runs.index(run)}", label=run)  # fmt: skip
    ax.set_xlabel("offered load (requests / s)")
    ax.set_ylabel("feedback queued (peak)")
    ax.set_title("the trainer's backlog")
    if trained:
        ax.legend(fontsize=7)
    fig.suptitle("(4) serving latency, recording off / on, training off / on")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


PLOTS = {"throughput": plot_throughput, "memory": plot_memory, "budget": plot_budget, "serving": plot_serving}


def plot_claims(rows: list[dict], out: Path) -> list[Path]:
    """One PNG per claim that has rows, in ``out``; their paths."""
    paths = []
    for claim, plot in PLOTS.items():
        mine = [r for r in rows if r["claim"] == claim]
        if mine:
            path = out / f"{claim}.png"
            plot(mine, path)
            paths.append(path)
    return paths


if __name__ == "__main__":
    out = Path(sys.argv[1])
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    for written in plot_claims(rows, out):
        print(written)
