"""`alchemist bench memory`: a LoRA training step's memory and time, recompute vs replay from memory vs replay
from disk with prefetch, and how many training tokens a step can take under a fixed memory budget.

Per shape (P prompt tokens, R response tokens; default 1024x128, 2048x128 and ShareGPT's median and p90 lengths):
- memory: transient peak of one step (VmHWM above the RSS before it, after a warm-up step, in a fresh process with
  MALLOC_MMAP_THRESHOLD_: ``memory_probe.py``) for recompute, replay from the store's device tier and replay from
  its disk tier, and the replays' change vs recompute;
- time: medians of steps timed interleaved in this process: recompute, replay from memory, replay from disk with
  the record's file in the page cache (warm) and dropped from it before every step (cold), and disk / memory;
- page cache: a plain read of the record's file right after dropping it from the cache and again (warm), showing
  the drop works.
Then, R fixed at 128, the largest P on a grid whose step peak fits ``--budget-mib``, recompute vs replay from disk
(grid resolution: the true limit lies between a mode's ``max_P`` and ``next_P``), and the issue's goals.

Steps are the trainer's own (``memory_steps.py``): fp32 model, LoRA r=16, records in ``--record-dtype``.

    python -m alchemist.cli bench memory --shapes 1024x128 --repeats 3 [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Iterable

import torch

from alchemist.bench.memory_probe import in_fresh_process, transient_peak_mib
from alchemist.bench.memory_steps import StepSet, drop_from_page_cache, read_s
from alchemist.bench.report import interleaved_medians, print_rows
from alchemist.bench.sharegpt import token_lengths
from alchemist.model.loader import build_model, hf_dir_for, read_config

DEFAULT_SHAPES = ("1024x128", "2048x128", "sharegpt-p50", "sharegpt-p90")
# Prompt lengths probed for the budget comparison (R = BUDGET_RESPONSE_TOKENS; 8064 + 128 is SmolLM2's context).
DEFAULT_GRID = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 7168, 8064)
BUDGET_RESPONSE_TOKENS = 128
TIMED = ("recompute", "replay_memory", "replay_disk_warm", "replay_disk_cold")
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str  # as given: "1024x128", "sharegpt-p50"
    num_prompt: int
    num_response: int
    source: str = "given"


def percentile(values: Iterable[int], q: int) -> int:
    """The nearest-rank ``q``-th percentile (a value of the data)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def parse_shapes(specs: Iterable[str], max_tokens: int, sharegpt: Callable[[], list[tuple[int, int]]]) -> list[Shape]:
    """``PxR`` or ``sharegpt-pNN`` (NN-th percentile prompt and reply lengths of ``sharegpt()``, computed once)."""
    lengths: list[tuple[int, int]] | None = None
    shapes = []
    for spec in specs:
        if spec.startswith("sharegpt-p") and spec[len("sharegpt-p") :].isdigit():
            q = int(spec[len("sharegpt-p") :])
            if not 1 <= q <= 100:
                raise ValueError(f"--shapes {spec}: the percentile must be in 1..100")
            lengths = lengths if lengths is not None else sharegpt()
            num_prompt = percentile((p for p, _ in lengths), q)
            num_response = percentile((r for _, r in lengths), q)
            source = f"ShareGPT p{q} prompt and p{q} reply lengths of {len(lengths)} conversations"
        else:
            try:
                num_prompt, num_response = map(int, spec.split("x"))
            except ValueError:
                raise ValueError(f"--shapes {spec!r}: expected PxR (e.g. 1024x128) or sharegpt-pNN") from None
            source = "given"
        if num_prompt < 2 or num_response < 1 or num_prompt + num_response > max_tokens:
            raise ValueError(
                f"--shapes {spec} = {num_prompt}x{num_response}: need P >= 2, R >= 1, P + R <= "
                f"{max_tokens} (the model's context)"
            )
        shapes.append(Shape(spec, num_prompt, num_response, source))
    return shapes


def memory_probe(
    mode: str,
    num_prompt: int,
    num_response: int,
    model: str | None,
    record_dtype: str,
    prefetch_depth: int,
    lora_r: int,
    record_dir: str | None,
) -> dict:
    """In a fresh process (``in_fresh_process``): one mode's transient step peak after a warm-up step, with what
    the measured step did (layers reloaded / recomputed by the plan, MiB of record read)."""
    net = build_model(hf_dir_for(model), torch.float32)
    steps = StepSet(
        net, num_prompt, num_response, [mode], getattr(torch, record_dtype), prefetch_depth, lora_r, record_dir
    )
    try:
        step = steps[mode]
        step()  # warm-up: one-time allocations and the plan's measured costs are not transient
        s = step.trainer.stats
        before = (s.layers_reloaded, s.layers_recomputed, s.record_bytes_read)
        peak = transient_peak_mib(step)
        return {
            "peak_mib": peak,
            "layers_reloaded": s.layers_reloaded - before[0],
            "layers_recomputed": s.layers_recomputed - before[1],
            "read_mib": (s.record_bytes_read - before[2]) / MIB,
            "record_mib": steps.record_bytes / MIB,
        }
    finally:
        steps.close()


class PeakProbe:
    """Step peaks of (mode, P, R), each measured once per run in its own process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: dict[tuple[str, int, int], dict] = {}

    def __call__(self, mode: str, num_prompt: int, num_response: int) -> dict:
        key = (mode, num_prompt, num_response)
        if key not in self.results:
            a = self.args
            self.results[key] = in_fresh_process(
                "alchemist.bench.memory:memory_probe",
                *key,
                a.model,
                a.record_dtype,
                a.prefetch_depth,
                a.lora_r,
                a.record_dir,
            )
        return self.results[key]


def memory_row(shape: Shape, probe: PeakProbe) -> dict:
    peak = {m: probe(m, shape.num_prompt, shape.num_response) for m in ("recompute", "replay_memory", "replay_disk")}
    base = peak["recompute"]["peak_mib"]
    return {
        "shape": shape.name,
        "P": shape.num_prompt,
        "R": shape.num_response,
        "record_mib": peak["replay_disk"]["record_mib"],
        "recompute_mib": base,
        "replay_memory_mib": peak["replay_memory"]["peak_mib"],
        "replay_disk_mib": peak["replay_disk"]["peak_mib"],
        "replay_memory_pct": 100 * (peak["replay_memory"]["peak_mib"] / base - 1),
        "replay_disk_pct": 100 * (peak["replay_disk"]["peak_mib"] / base - 1),
        "disk_layers_recomputed": peak["replay_disk"]["layers_recomputed"],
    }


def time_rows(model, shape: Shape, args: argparse.Namespace) -> tuple[dict, dict]:
    """(the time row, the page-cache row) of one shape."""
    steps = StepSet(
        model,
        shape.num_prompt,
        shape.num_response,
        TIMED,
        getattr(torch, args.record_dtype),
        args.prefetch_depth,
        args.lora_r,
        args.record_dir,
    )
    try:
        path = steps.file
        drop_from_page_cache(path)
        cold, warm = read_s(path), read_s(path)
        file_mib = path.stat().st_size / MIB
        cache = {
            "shape": shape.name,
            "file_mib": file_mib,
            "read_cold_s": cold,
            "read_warm_s": warm,
            "cold_mib_per_s": file_mib / cold,
            "warm_mib_per_s": file_mib / warm,
        }
        if cold < 1.5 * warm:
            print(
                f"warning: {path}: a read after dropping it from the page cache took {cold:.3f} s, one from the "
                f"cache {warm:.3f} s: the drop may not work there (tmpfs?); choose --record-dir on a disk",
                file=sys.stderr,
            )
        t = interleaved_medians(
            {m: steps[m] for m in TIMED}, args.repeats, before={"replay_disk_cold": lambda: drop_from_page_cache(path)}
        )
        cold_stats = steps["replay_disk_cold"].trainer.stats
        warm_stats = steps["replay_disk_warm"].trainer.stats
        row = {
            "shape": shape.name,
            "P": shape.num_prompt,
            "R": shape.num_response,
            "recompute_s": t["recompute"],
            "replay_memory_s": t["replay_memory"],
            "disk_warm_s": t["replay_disk_warm"],
            "disk_cold_s": t["replay_disk_cold"],
            "warm_vs_memory": t["replay_disk_warm"] / t["replay_memory"],
            "cold_vs_memory": t["replay_disk_cold"] / t["replay_memory"],
            "memory_speedup": t["recompute"] / t["replay_memory"],
            "warm_layers_recomputed": warm_stats.layers_recomputed / warm_stats.replayed,
            "cold_layers_recomputed": cold_stats.layers_recomputed / cold_stats.replayed,
        }
        return row, cache
    finally:
        steps.close()


@dataclasses.dataclass
class BudgetFit:
    max_prompt: int | None  # the largest grid P that fits (None: not even the smallest)
    peak_mib: float | None  # its peak
    over_prompt: int | None  # the next grid P, the first that does not fit (None: the whole grid fits)
    over_peak_mib: float | None


def largest_fitting_prompt(peak_mib: Callable[[int], float], grid: Iterable[int], budget_mib: float) -> BudgetFit:
    """The largest P of ``grid`` whose peak fits the budget, probing in increasing order up to the first miss."""
    fit = BudgetFit(None, None, None, None)
    for num_prompt in sorted(grid):
        peak = peak_mib(num_prompt)
        if peak > budget_mib:
            return dataclasses.replace(fit, over_prompt=num_prompt, over_peak_mib=peak)
        fit = BudgetFit(num_prompt, peak, None, None)
    return fit


def budget_rows(probe: PeakProbe, args: argparse.Namespace, max_tokens: int) -> list[dict]:
    r = BUDGET_RESPONSE_TOKENS
    grid = [p for p in (args.budget_grid or DEFAULT_GRID) if p + r <= max_tokens]
    rows = []
    for mode in ("recompute", "replay_disk"):
        fit = largest_fitting_prompt(lambda p, mode=mode: probe(mode, p, r)["peak_mib"], grid, args.budget_mib)
        tokens = 0 if fit.max_prompt is None else fit.max_prompt + r
        rows.append(
            {
                "mode": mode,
                "budget_mib": args.budget_mib,
                "R": r,
                "max_P": fit.max_prompt,
                "tokens": tokens,
                "peak_mib": fit.peak_mib,
                "next_P": fit.over_prompt,
                "next_peak_mib": fit.over_peak_mib,
            }
        )
        print_rows(rows[-1:], as_json=True, out=sys.stderr)
    for row in rows:  # None: recompute fits no grid point
        row["tokens_vs_recompute"] = row["tokens"] / rows[0]["tokens"] if rows[0]["tokens"] else None
    return rows


def goal_rows(memory: list[dict], times: list[dict], budget: list[dict]) -> list[dict]:
    """The issue's goals, where this run measured them."""
    rows = []

    def goal(name: str, value: float | None, target: str, met: bool | None) -> None:
        rows.append({"goal": name, "value": value, "target": target, "met": met})

    for row in memory:
        if (row["P"], row["R"]) == (1024, 128):
            for mode in ("replay_disk", "replay_memory"):
                pct = row[f"{mode}_pct"]
                goal(f"transient step memory, {mode} vs recompute, 1024x128 (%)", pct, "<= -70", pct <= -70)
    if budget:
        ratio = budget[-1]["tokens_vs_recompute"]
        met = None if ratio is None else ratio >= 3  # None: recompute fits no grid point, the grid starts too high
        goal("tokens per step under the budget, replay from disk / recompute (grid)", ratio, ">= 3", met)
    for key, limit in (("warm_vs_memory", 1.10), ("cold_vs_memory", 1.20)):
        if times:
            worst = max(times, key=lambda row: row[key])
            goal(
                f"step time, {key.replace('_vs_', ' disk / ')}, worst shape ({worst['shape']})",
                worst[key],
                f"<= {limit:.2f}",
                worst[key] <= limit,
            )
    return rows


def main(args: argparse.Namespace) -> int:
    for name in ("repeats", "sharegpt_samples", "lora_r"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.budget_mib <= 0 or args.prefetch_depth < 0:
        raise ValueError("--budget-mib must be > 0 and --prefetch-depth >= 0")
    hf_dir = hf_dir_for(args.model)
    max_tokens = read_config(hf_dir).max_position_embeddings

    def sharegpt() -> list[tuple[int, int]]:
        from alchemist.model.tokenizer import Tokenizer  # transformers: only imported when needed

        tokenizer = Tokenizer.from_pretrained(hf_dir)
        return token_lengths(args.sharegpt_samples, args.seed, tokenizer, args.sharegpt_mode)

    shapes = parse_shapes(args.shapes or DEFAULT_SHAPES, max_tokens, sharegpt)
    model = build_model(hf_dir, torch.float32)
    parts: dict[str, list[dict]] = {"shapes": [], "memory": [], "time": [], "page_cache": [], "budget": []}
    for shape in shapes:
        source = shape.source if shape.source == "given" else f"{shape.source} ({args.sharegpt_mode}, seed {args.seed})"
        parts["shapes"].append({"shape": shape.name, "P": shape.num_prompt, "R": shape.num_response, "source": source})
    probe = PeakProbe(args)
    for shape in shapes:
        parts["memory"].append(memory_row(shape, probe))
        time_row, cache_row = time_rows(model, shape, args)
        parts["time"].append(time_row)
        parts["page_cache"].append(cache_row)
        for name in ("memory", "time"):  # progress: a full run takes a while
            print_rows([{"part": name, **parts[name][-1]}], as_json=True, out=sys.stderr)
    if not args.no_budget:
        parts["budget"] = budget_rows(probe, args, max_tokens)
    parts["goals"] = goal_rows(parts["memory"], parts["time"], parts["budget"])
    for name, rows in parts.items():
        if args.json:
            print_rows([{"part": name, **row} for row in rows], as_json=True)
        elif rows:
            print(f"\n## {name}")
            print_rows(rows, as_json=False)
    return 0
