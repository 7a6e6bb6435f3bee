"""docs/benchmarks.md's generated tables are what `python -m alchemist.bench.results_page` makes from the committed
rows (no model, no timing)."""

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


def test_a_changed_row_changes_the_page_and_check_fails(tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(DOCS / "results", results)
    page = tmp_path / "benchmarks.md"
    page.write_text((DOCS / "benchmarks.md").read_text())
    rows = results / "online-zen5-2026-12-02" / "online.jsonl"
    rows.write_text(rows.read_text().replace('"tpot_p99_ms": 46.3', '"tpot_p99_ms": 99.9'))

    assert results_page.main([str(page), "--results", str(results), "--check"]) == 1
    assert "| replay | 21.2 | 99.9 |" in capsys.readouterr().out
    assert results_page.main([str(page), "--results", str(results)]) == 0
    assert "| replay | 21.2 | 99.9 |" in page.read_text()
    assert results_page.main([str(page), "--results", str(results), "--check"]) == 0
