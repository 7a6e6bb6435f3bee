"""Profile (not a benchmark): the compiled step's warm-up at a server's start, for servers of other limits.

    python docs/profiles/warm_up_limits.py [inductor cache directory]     # default: a new temporary one

Starts `alchemist serve` (the defaults: bf16 where fast, compiled decode) three times, one after the other, with
other ``--max-model-len`` and ``--max-num-seqs`` each, on one inductor cache that starts empty, and prints each
start's warm-up (the compile, as the server logs it), the FX graphs inductor's cache then holds, and a greedy answer
(the same in all three). One thread each (``OMP_NUM_THREADS=1``, as the suite runs them).
"""

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from alchemist.bench.serving import _free_port

LIMITS = [("512", "4"), ("1024", "8"), ("2048", "2")]  # (--max-model-len, --max-num-seqs)


def start(limits: tuple[str, str], inductor: Path) -> tuple[str, str]:
    """(the server's warm-up line, its greedy answer to one question)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "alchemist.cli", "serve", "--port", str(port), "--served-model-name", "m",
           "--no-train", "--max-model-len", limits[0], "--max-num-seqs", limits[1]]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        while server.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        body = {"model": "m", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24,
                "temperature": 0}  # fmt: skip
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60).json()
    finally:
        server.terminate()
        log = server.communicate()[0]
    warm_up = re.search(r"warm-up [0-9.]+ s|serving eager", log)
    return warm_up.group(0) if warm_up else "?", answer["choices"][0]["message"]["content"]


def main() -> None:
    inductor = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="inductor-"))
    print("| --max-model-len | --max-num-seqs | warm-up | FX graphs cached | answer |\n|---|---|---|---|---|")
    for limits in LIMITS:
        warm_up, answer = start(limits, inductor)
        graphs = len(list((inductor / "fxgraph").glob("*/*")))
        print(f"| {limits[0]} | {limits[1]} | {warm_up} | {graphs} | {answer[:40]!r} |", flush=True)


if __name__ == "__main__":
    main()
