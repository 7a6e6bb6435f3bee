"""The repository as committed: no file carries a merge's conflict markers (a merge once committed them into
docs/architecture.md, where nothing else would have noticed)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^(<{7}|>{7}) |^={7}$", re.M)


def test_no_conflict_markers_in_tracked_files():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    texts = [p for p in tracked if p.endswith((".py", ".md", ".toml", ".txt", ".yaml", ".cfg", ".ini", ".html", ".js"))]
    assert len(texts) > 100  # the listing worked
    marked = [p for p in texts if MARKER.search((ROOT / p).read_text(errors="replace"))]
    assert marked == []
