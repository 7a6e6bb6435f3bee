"""Profile (not a benchmark): what recording a prompt in bf16 adds to its prefill, with glibc's default memory
thresholds, with the CLI's (``alchemist.host_memory``) and with jemalloc where installed (the server's allocator),
and the page faults each takes.

    python docs/profiles/recording_overhead.py 1024 2 [bfloat16 [ALLOCATOR ...]]   # prompt tokens, threads, dtype

Each setting runs in a fresh process (the thresholds are process-wide): ``bench train``'s prefill step functions
(SmolLM2, fp32 model unless a dtype is given, LoRA on, records in bf16), one warm-up each, then 7 interleaved
timings; prints medians, the overhead, minor page faults per call, and the share of the recording prefill's CPU
time spent in copies (torch.profiler, one call).
"""

import ctypes.util
import json
import os
import subprocess
import sys

CHILD = r"""
import json, resource, statistics, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from alchemist.bench.training import make_steps
from alchemist.host_memory import keep_freed_memory
from alchemist.model.loader import build_model, hf_dir_for

setting, num_prompt, threads, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), getattr(torch, sys.argv[4])
if setting == "kept":
    assert keep_freed_memory()
torch.set_num_threads(threads)
steps = make_steps(build_model(hf_dir_for(None), dtype), num_prompt, 8, dtype)
names = ("prefill", "prefill_rec_bf16")
times, faults = {n: [] for n in names}, {n: 0 for n in names}
for n in names:
    steps[n]()
for _ in range(7):
    for n in names:
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        steps[n]()
        times[n].append(time.perf_counter() - t0)
        faults[n] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
with profile(activities=[ProfilerActivity.CPU]) as p:
    steps["prefill_rec_bf16"]()
events = p.key_averages()
copy_share = sum(e.self_cpu_time_total for e in events if e.key == "aten::copy_") / sum(
    e.self_cpu_time_total for e in events)
med = {n: statistics.median(v) for n, v in times.items()}
print(json.dumps({"setting": setting, **{n + "_s": round(v, 4) for n, v in med.items()},
                  "overhead_pct": round(100 * (med["prefill_rec_bf16"] / med["prefill"] - 1), 2),
                  **{n + "_faults": faults[n] // 7 for n in names},
                  "rec_copy_cpu_share_pct": round(100 * copy_share, 1)}))
"""

if __name__ == "__main__":
    num_prompt, threads = int(sys.argv[1]), int(sys.argv[2])
    dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
    libs = {"jemalloc": ctypes.util.find_library("jemalloc"), "tcmalloc": ctypes.util.find_library("tcmalloc_minimal")}
    preload = {name: {"LD_PRELOAD": lib, "MALLOC_CONF": ""} for name, lib in libs.items() if lib}
    preload = {name: env for name, env in preload.items() if name in sys.argv[4:] or not sys.argv[4:]}
    for setting in ("default", "kept", *preload):
        env = os.environ | preload.get(setting, {})
        done = subprocess.run(
            [sys.executable, "-c", CHILD, setting, str(num_prompt), str(threads), dtype],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        print(json.loads(done.stdout.strip().splitlines()[-1]))
