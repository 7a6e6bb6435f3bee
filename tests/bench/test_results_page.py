"""docs/benchmarks.md's generated tables are what `python -m alchemist.bench.results_page` makes from the committed
rows (no model, no timing)."""

import json
import shutil
from pathlib import Path

from alchemist.bench import results_page

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_committed_page_matches_its_rows():
    page = (DOCS / "benchmarks.md").read_text()
    assert results_page.BLOCK.search(page), "the page has no generated block"
    assert results_page.main([str(DOCS / "benchmarks.md"), "--check"]) == 0, (
        "docs/benchmarks.md is stale: run python -m alchemist.bench.results_page"
    )


def test_every_results_folder_is_on_the_page():
    names = {m.group("name") for m in results_page.BLOCK.finditer((DOCS / "benchmarks.md").read_text())}
    assert names == {p.parent.name for p in (DOCS / "results").glob("*/meta.toml")}


def test_every_table_on_the_page_is_generated():
    """A table written by hand belongs in history.md; the page's own tables are made from rows."""
    page = (DOCS / "benchmarks.md").read_text()
    outside = results_page.BLOCK.sub("", page)
    by_hand = [line for line in outside.splitlines() if line.lstrip().startswith("|")]
    assert not by_hand, f"tables outside a generated block: {by_hand[:3]}"


def test_a_changed_row_changes_the_page_and_check_fails(tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(DOCS / "results", results)
    page = tmp_path / "benchmarks.md"
    page.write_text((DOCS / "benchmarks.md").read_text())
    rows = results / "online-zen4-2026-12-04-token-target" / "online.jsonl"
    rows.write_text(rows.read_text().replace('"tpot_p99_ms": 79.2', '"tpot_p99_ms": 99.9'))

    assert results_page.main([str(page), "--results", str(results), "--check"]) == 1
    assert "| replay | 34.7 | 99.9 |" in capsys.readouterr().out
    assert results_page.main([str(page), "--results", str(results)]) == 0
    assert "| replay | 34.7 | 99.9 |" in page.read_text()
    assert results_page.main([str(page), "--results", str(results), "--check"]) == 0


def test_the_backlog_table_thins_a_series_but_keeps_its_peak_and_each_phase_end():
    def sample(run, t, phase, corrections, thumbs=0):
        return {"backlog_of": run, "t_s": t, "phase": phase, "correction": corrections, "thumbs_up": thumbs,
                "thumbs_down": 0, "preference": 0, "queued": corrections + thumbs, "oldest_s": t / 2}

    series = [sample("replay", t, "load", n) for t, n in [(0, 0), (5, 2), (10, 4), (15, 9), (20, 3), (25, 5)]]
    series += [sample("replay", t, "drain", n) for t, n in [(30, 4), (35, 1), (40, 0)]]
    series += [sample("off", 0, "load", 7), {"backlog_of": "replay", "t_s": 45, "phase": "drain", "error": "x"}]
    lines = results_page.backlog_table(series, every_s=20).splitlines()[2:]
    kept = [(cells[1], cells[2], cells[3]) for cells in (line.split(" | ") for line in lines)]
    # every 20 s from the first, the peak (marked), the load's last and the drain's last; off and errors left out
    assert kept == [("0.0", "load", "0"), ("15.0", "load", "**9**"), ("20.0", "load", "3"), ("25.0", "load", "5"),
                    ("40.0", "drain", "0")]


def test_the_memory_block_prints_each_part_as_the_benchmark_prints_it(tmp_path):
    rows = [{"part": "memory", "shape": "1024x128", "recompute_mib": 1577.0, "replay_memory_pct": -81.3},
            {"part": "goals", "goal": "tokens per step", "value": 6.6, "met": True}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    block = results_page.memory_block({"rows": "m.jsonl"}, tmp_path)
    assert "memory:\n\n| shape | recompute_mib | replay_memory_pct |\n" in block
    assert "| 1024x128 | 1,577 | -81.3 |" in block and "| tokens per step | 6.6 | True |" in block


def test_paper_rows_make_a_table_per_claim_with_the_papers_numbers(tmp_path):
    """`bench paper`'s rows: a table per claim they hold, each ratio against the paper's number; serving's runs
    against the off run at the same rate with issue 42's goals."""
    rows = [
        {"claim": "throughput", "bucket": "0-256", "P": 57, "R": 128, "replay_tok_s": 213.1, "recompute_tok_s": 209.4,
         "peft_tok_s": 189.1, "replay_vs_recompute": 1.0176, "replay_vs_peft": 1.127, "paper": 1.72, "met": False},
        {"claim": "memory", "bucket": "0-256", "P": 57, "R": 128, "replay_mib": 157.3, "recompute_mib": 307.3,
         "peft_mib": 312.4, "replay_vs_recompute_pct": -48.8, "replay_vs_peft_pct": -49.6, "paper": -47.0, "met": True},
        {"claim": "budget", "mode": "replay_disk", "budget_mib": 1024, "max_P": 2048, "tokens": 2176, "peak_mib": 990.0,
         "tokens_vs_recompute": 2.5, "paper": 2.0, "met": True},
    ]
    serving = {"claim": "serving", "rate": 0.5, "ttft_p50_ms": 100.0, "ttft_p99_ms": 400.0, "tpot_p50_ms": 40.0,
               "tpot_p99_ms": 60.0, "itl_p99_ms": 90.0, "slices_load": 0, "slice_s_load": 0.0, "steps": None,
               "served_s": None, "served_p50_s": None, "served_max_s": None, "unserved": None, "backlog_max": None}
    rows += [{**serving, "run": "off", "recording": "off", "training": "off"},
             {**serving, "run": "train", "recording": "on", "training": "on", "tpot_p50_ms": 42.0,
              "ttft_p99_ms": 600.0, "steps": 3, "served_s": [20.0, 70.0], "served_p50_s": 45.0, "served_max_s": 70.0,
              "unserved": 0, "backlog_max": 2}]  # fmt: skip
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    block = results_page.paper_block({"files": {"one": "rows.jsonl"}, "images": ["serving.png"]}, tmp_path)
    assert "| one | 0-256 | 57 | 128 | 213.1 | 209.4 | 189.1 | **1.02** | 1.13 | >= 1.72 | not met |" in block
    assert "| one | 0-256 | 57 | 128 | 157.3 | 307.3 | 312.4 | **-49%** | -50% | <= -47% | met |" in block
    assert "| one | replay_disk | 1024 | 2048 | 2176 | 990.0 | **2.50** | >= 2.0 | met |" in block
    assert "| one | train | 0.5 | tpot_p50_ms on / off | **1.05** | <= 1.1 | met |" in block
    assert "| one | train | 0.5 | ttft_p99_ms on / off | **1.50** | <= 1.25 | not met |" in block
    assert "| one | train | 0.5 | slowest correction served s | **70.0** | <= 60 | not met |" in block
    assert block.endswith(f"![serving.png](results/{tmp_path.name}/serving.png)\n")


def test_serve_adapters_rows_make_a_row_per_run_and_k_and_issue_44s_goals(tmp_path):
    def row(k: int, tok_s: float) -> dict:
        return {"system": "http", "workload": "first_turn", "adapters": k, "concurrency": 32, "output_tok_s": tok_s,
                "ttft_p50_ms": 500.0, "ttft_p99_ms": 900.0, "tpot_p50_ms": 60.0, "tpot_p99_ms": 80.0}  # fmt: skip

    runs = {"ours.jsonl": [row(1, 400.0), row(16, 360.0)], "vllm.jsonl": [row(1, 380.0), row(16, 380.0)]}
    for name, rows in runs.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = {"runs": {"ours": ["ours.jsonl"], "vLLM": ["vllm.jsonl"]}, "ours": "ours", "reference": "vLLM"}
    block = results_page.serve_adapters_block(meta, tmp_path)
    assert "| ours | first_turn | 16 | 32 | 360.0 | 500.0 / 900.0 | 60.0 / 80.0 |" in block
    assert "| first_turn | 16 | 32 | ours: 16 adapters / 1 | **0.90** | >= 0.85 | met |" in block
    assert "| first_turn | 1 | 32 | ours / vLLM | **1.05** | >= 1.0 | met |" in block
    assert "| first_turn | 16 | 32 | ours / vLLM | **0.95** | >= 1.0 | not met |" in block


def test_preference_rounds_without_held_out_medians_show_a_dash(tmp_path):
    """`bench learn --no-held-out-medians` rows (the suite's) have no median or fall after round 0."""
    row = {"round": 1, "entries": 4, "sampled_median": 8, "promoted": 1, "blocked": 0, "steps": 1, "quarantined": 0,
           "train_s": 1.0, "held_out_median": None, "fall": None, "held_out_pairs": 2, "held_out_margin": 0.5,
           "held_out_accuracy": 1.0}  # fmt: skip
    (tmp_path / "thumbs.jsonl").write_text(json.dumps(row) + "\n")
    block = results_page.learn_block({"preferences": {"thumbs": "thumbs.jsonl"}}, tmp_path)
    assert "| thumbs | 1 | 4 | 8 | 1 / 0 | 1 | 0 | 1.0 | - | - |  |" in block
