"""Profile (not a benchmark): recording's prefill overhead of two source trees, A/B, in alternating fresh processes.

    git worktree add /tmp/before REV
    python docs/profiles/recording_ab.py /tmp/before . 1024 2 4 [float32]   # trees, prompt tokens, threads, rounds

Each round runs ``recording_overhead.py``'s child (``bench train``'s prefill steps, the CLI's memory setting, one
warm-up, 7 interleaved timings of a plain prefill and one recording in bf16) once in each tree, in that tree's
directory (so it imports that tree's ``alchemist``), alternating which goes first. Prints each run, then per tree
the median overhead and the median share of the recording prefill's CPU time spent in copies.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recording_overhead import CHILD  # noqa: E402

trees = [Path(t).resolve() for t in sys.argv[1:3]]
num_prompt, threads, rounds = sys.argv[3], sys.argv[4], int(sys.argv[5])
dtype = sys.argv[6] if len(sys.argv) > 6 else "float32"
results: dict[Path, list[dict]] = {t: [] for t in trees}
for r in range(rounds):
    for tree in trees if r % 2 == 0 else trees[::-1]:
        done = subprocess.run([sys.executable, "-c", CHILD, "kept", num_prompt, threads, dtype], cwd=tree,
                              capture_output=True, text=True, check=True)  # fmt: skip
        row = json.loads(done.stdout.strip().splitlines()[-1])
        results[tree].append(row)
        print(tree.name, row, flush=True)
for tree, rows in results.items():
    med = statistics.median(row["overhead_pct"] for row in rows)
    share = statistics.median(row["rec_copy_cpu_share_pct"] for row in rows)
    runs = ", ".join(f"{row['overhead_pct']:+.1f}" for row in rows)
    print(
        f"{tree}: recording overhead median {med:+.2f}% over {len(rows)} runs ({runs}); "
        f"copies' CPU share median {share}%"
    )
