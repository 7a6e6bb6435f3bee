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
