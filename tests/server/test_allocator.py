"""`alchemist serve` at its defaults runs on jemalloc where it is installed (CI installs it: `make install`): started
again in place, the same process, with jemalloc preloaded (alchemist/host_memory.py; why: docs/benchmarks.md,
"Soak")."""

from __future__ import annotations

from pathlib import Path

from alchemist.host_memory import jemalloc_library


def test_the_server_runs_on_jemalloc(server):
    assert jemalloc_library() is not None, "jemalloc is not installed: apt-get install libjemalloc2"
    pid = server.process.pid  # the process the test started: started again in place, it kept its id
    assert "libjemalloc" in Path(f"/proc/{pid}/maps").read_text()
    assert "alchemist: memory allocator: jemalloc" in server.log_path.read_text()
