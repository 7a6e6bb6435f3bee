"""`alchemist bench serve`: ShareGPT chat load on an OpenAI-compatible server, ours by default or any other (as
`vllm bench serve` does): output tokens/s, TTFT, TPOT and ITL per workload and concurrency.

    alchemist bench serve [--base-url http://HOST:PORT/v1] [--model NAME] [--workloads first_turn multi_turn]
                          [--concurrency 1 8 32] [--requests-per-level 2] [--max-tokens 128] [--max-prompt-tokens 512]
                          [--reuse-prompts] [--systems http engine transformers] [--adapters 1 4 16] [--json]

Systems (``--systems``, default ``http``):

- ``http``: the server at ``--base-url`` (vLLM, another Alchemist, ...; a URL without a path gets ``/v1``), or
  without it `alchemist serve` started here as a subprocess (``--model-path``, ``--dtype``, ``--device``,
  ``--enforce-eager``; ``--max-num-seqs`` the largest concurrency). The requests name ``--model``, by default the first
  id of GET /v1/models. The client is ``chat_load``: ``c`` closed-loop clients. On a small machine they share the
  CPU with a local server.
- ``engine``, ``transformers``: the first_turn workload in this process, without HTTP (``inprocess``); with them,
  every row also gets its throughput relative to theirs (``x_engine``, ``x_transformers``).

Workloads (``--workloads``, default ``first_turn``): ShareGPT conversations from a seeded shuffle (``--seed``).
``first_turn``: each request is a conversation's first user turn. ``multi_turn``: each client plays a conversation
of at least two turns, turn by turn, the history with the replies the server returned as the prompt, so prefix
reuse shows; a conversation is cut before the first turn whose prompt, counting ``--max-tokens`` per earlier reply,
would exceed ``--max-prompt-tokens``. Prompt lengths are counted with our tokenizer of ``--model-path`` (the default
model: a peer serving the same model sees the same lengths). A level runs ``--requests-per-level`` x ``c`` requests
(at least 4; multi_turn: whole conversations until their turns reach that). Every level draws its own
conversations, the next ones in the shuffle, so no prompt repeats across levels or workloads (a server's prefix
cache cannot help one level with another's prompts), unless ``--reuse-prompts``: then the levels of a workload
share theirs.

Every request asks for exactly ``--max-tokens`` greedy tokens (``max_tokens``, and ``ignore_eos`` with
``min_tokens`` where the server takes them); the tokens counted are those the streamed usage reports. TTFT is
to the first streamed content, TPOT as vLLM's benchmark defines it, (e2e - TTFT) / (output tokens - 1), ITL the
gaps between a request's streamed content chunks, over all requests' gaps; all from the request's submission.

Named adapters (``--adapters K ...``, issue 44; the http system only; ``--concurrency`` then defaults to 32): max(K)
random rank-16 PEFT adapters a0, a1, ... are written once (``serve_adapters``) into ``--adapters-dir`` (else a
temporary directory, removed at the end), and the ``--lora-modules`` arguments that serve them are printed, for a
peer. Per K and level the conversations, drawn afresh per K as per level, go round-robin to a0..a{K-1} (each names
its adapter as its ``model``; a multi_turn conversation keeps its adapter for all its turns). The server started here
gets ``--lora-modules`` for all of them and ``--max-loras`` max(K), so every adapter stays in the engine; a server
at ``--base-url`` must list them in GET /models. Before the first level one request per adapter pages each in. Each
row gains ``adapters`` (K), ``adapters_answered`` (how many of a0..a{K-1} the responses' ``model`` names) and, with
K = 1 among them, ``x_1_adapter`` (its throughput over one adapter's at that workload and concurrency).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from urllib.parse import urlparse

import numpy as np

from alchemist.bench import http_calls, serve_adapters
from alchemist.bench.chat_load import Chat, RequestResult, first_model_id, run_chats
from alchemist.bench.latency import latency_fields
from alchemist.bench.report import print_rows
from alchemist.bench.serve_adapters import adapter_name
from alchemist.bench.sharegpt import Conversation, shuffled_conversations

SYSTEMS = ("transformers", "engine", "http")  # the order they run in
WORKLOADS = ("first_turn", "multi_turn")
TURNS = {"first_turn": (1, 1), "multi_turn": (2, None)}  # user turns of a conversation: (at least, at most)
MIN_REQUESTS = 4
# Our server's context beyond --max-prompt-tokens + --max-tokens: a multi_turn prompt is estimated with
# max_tokens per earlier reply, and a reply's text re-encoded in the history may take a few tokens more.
CONTEXT_SLACK_TOKENS = 64
WARMUP_TOKENS = 4
STARTUP_TIMEOUT_S = 300.0


# --- the workload -----------------------------------------------------------------------------------------------


@dataclass
class Plan:
    warmup: Chat  # sent before each system's first level, not measured
    # (workload, adapters K or None, concurrency) -> its conversations, in run order
    cells: dict[tuple[str, int | None, int], list[Chat]]
    prompt_tokens: dict[str, list[int]]  # per workload: each turn's prompt length (estimated after the first)


def fitting_turns(
    conversation: Conversation, tokenizer, max_prompt_tokens: int, max_tokens: int, max_turns: int | None
) -> tuple[list[str], list[int]]:
    """The user turns from the first whose prompts fit ``max_prompt_tokens``, and those prompts' lengths: the
    chat-templated history, with an empty reply standing for each earlier one plus ``max_tokens`` for its text."""
    messages: list[dict] = []
    turns, lengths = [], []
    for k, (user, _) in enumerate(conversation.exchanges()[:max_turns]):
        messages.append({"role": "user", "content": user})
        n = len(tokenizer.apply_chat_template(messages)) + k * max_tokens
        if n > max_prompt_tokens:
            break
        turns.append(user)
        lengths.append(n)
        messages.append({"role": "assistant", "content": ""})
    return turns, lengths


def plan_workloads(args: argparse.Namespace, tokenizer) -> Plan:
    conversations = shuffled_conversations(args.seed)
    prompt_tokens: dict[str, list[int]] = {w: [] for w in args.workloads}

    def draw(workload: str) -> tuple[Chat, list[int]]:
        """The next conversation in the shuffle that makes a ``workload`` chat, and its prompts' lengths."""
        least, most = TURNS[workload]
        for conversation in conversations:
            turns, lengths = fitting_turns(conversation, tokenizer, args.max_prompt_tokens, args.max_tokens, most)
            if len(turns) >= least:
                return Chat(tuple(turns)), lengths
        raise ValueError(
            f"ShareGPT ran out of {workload} conversations that fit --max-prompt-tokens {args.max_prompt_tokens}; "
            "lower --requests-per-level or --concurrency, raise --max-prompt-tokens or pass --reuse-prompts"
        )

    warmup, _ = draw("first_turn")
    cells = {}
    for workload in args.workloads:
        pool: list[Chat] = []  # with --reuse-prompts, every level takes its conversations from the start of it
        for k in args.adapters or [None]:
            for c in sorted(set(args.concurrency)):
                if not args.reuse_prompts:
                    pool = []
                wanted = max(MIN_REQUESTS, args.requests_per_level * c)
                chats: list[Chat] = []
                # At least c conversations, or some of the c clients would have none to play.
                while sum(len(chat.turns) for chat in chats) < wanted or len(chats) < c:
                    if len(chats) == len(pool):
                        chat, lengths = draw(workload)
                        pool.append(chat)
                        prompt_tokens[workload] += lengths
                    chats.append(pool[len(chats)])
                if k is not None:  # round-robin over the adapters a0..a{k-1}
                    chats = [replace(chat, model=adapter_name(i % k)) for i, chat in enumerate(chats)]
                cells[(workload, k, c)] = chats
    return Plan(warmup, cells, prompt_tokens)


# --- our server, as a process -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    args: argparse.Namespace, max_num_seqs: int, max_model_len: int, data_dir: str, extra: list[str] | None = None
):
    """`alchemist serve` (with the ``extra`` arguments) on a free port; (the process, its base URL with /v1) once
    /health answers."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "alchemist.cli", "serve", "--dtype", args.dtype, "--device", args.device]
    cmd += ["--port", str(port), "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len)]
    cmd += ["--data-dir", data_dir, *(["--model", args.model_path] if args.model_path else [])]
    cmd += ["--enforce-eager"] if args.enforce_eager else []
    cmd += extra or []
    log = tempfile.NamedTemporaryFile(prefix="alchemist-bench-serve-", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}; see {log.name}")
        try:
            if http_calls.get(url + "/health", timeout=1).status_code == 200:
                print(f"# server log {log.name}", file=sys.stderr)
                return process, url + "/v1"
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_process(process)
    raise RuntimeError(f"server did not start within {STARTUP_TIMEOUT_S:.0f} s; see {log.name}")


def stop_process(process: subprocess.Popen, timeout_s: float = 30) -> None:
    """Asks a server process to exit; kills it if it has not within ``timeout_s``."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# --- the systems ------------------------------------------------------------------------------------------------


def bench_http(args: argparse.Namespace, plan: Plan) -> list[dict]:
    process, data_dir, base_url = None, None, args.base_url
    names = [adapter_name(i) for i in range(max(args.adapters))] if args.adapters else []
    adapters_dir, serve_extra, rows = None, [], []
    try:
        if names:
            adapters_dir, serve_extra = serve_adapters.prepare(len(names), args.adapters_dir, args.model_path)
        if base_url is None:
            data_dir = tempfile.mkdtemp(prefix="alchemist-bench-serve-data-")
            max_model_len = args.max_prompt_tokens + args.max_tokens + CONTEXT_SLACK_TOKENS
            process, base_url = start_server(args, max(args.concurrency), max_model_len, data_dir, serve_extra)
            if names:
                print(f"# the server holds all {len(names)} adapters (--max-loras {len(names)})", file=sys.stderr)
        elif names:
            serve_adapters.check_served(base_url, args.api_key, names)
        model = args.model or first_model_id(base_url, args.api_key)
        print(f"# http: {base_url}, model {model!r}", file=sys.stderr)
        warmup = [replace(plan.warmup, model=name) for name in names] or [plan.warmup]  # pages every adapter in
        _, errors, _ = run_chats(base_url, model, warmup, WARMUP_TOKENS, len(warmup), args.api_key)
        if errors:
            raise RuntimeError(f"the warm-up request to {base_url} failed: {type(errors[0]).__name__}: {errors[0]}")
        for (workload, k, c), chats in plan.cells.items():
            results, errors, duration_s = run_chats(base_url, model, chats, args.max_tokens, c, args.api_key)
            level = f"{workload}{'' if k is None else f' K={k}'} c={c}"
            for e in errors[:3]:
                print(f"# http {level}: request failed: {type(e).__name__}: {e}", file=sys.stderr)
            rows.append(summarize("http", workload, c, results, len(errors), duration_s, k))
            if k is not None:
                answered = {r.model for r in results}
                rows[-1]["adapters_answered"] = len(answered & set(names[:k]))
                if answered - set(names[:k]):
                    print(f"# http {level}: answered by {sorted(map(str, answered - set(names[:k])))} too",
                          file=sys.stderr)  # fmt: skip
            print_rows(rows[-1:], True, sys.stderr)
    finally:
        if process is not None:
            stop_process(process)
            shutil.rmtree(data_dir, ignore_errors=True)
        if adapters_dir is not None and not args.adapters_dir:
            shutil.rmtree(adapters_dir, ignore_errors=True)
    return rows


def bench_in_process(args: argparse.Namespace, plan: Plan, systems: list[str]) -> list[dict]:
    """The engine and transformers rows (first_turn only: a multi_turn history needs a server's replies)."""
    from alchemist.bench import inprocess
    from alchemist.model.loader import load_model, resolve_device, resolve_dtype

    device = resolve_device(args.device)
    loaded = load_model(args.model_path, dtype=resolve_dtype(args.dtype, device), device=device)
    template = lambda chat: loaded.tokenizer.user_prompt(chat.turns[0])
    prompts = {c: [template(chat) for chat in chats] for (w, _, c), chats in plan.cells.items() if w == "first_turn"}
    warmup = template(plan.warmup)
    max_model_len = args.max_prompt_tokens + args.max_tokens
    levels = {
        "transformers": lambda: inprocess.bench_transformers(loaded, warmup, prompts, args.max_tokens),
        "engine": lambda: inprocess.bench_engine(
            loaded, warmup, prompts, args.max_tokens, max_model_len, args.enforce_eager
        ),
    }
    if "multi_turn" in args.workloads:
        print("# engine, transformers: first_turn rows only", file=sys.stderr)
    rows = []
    for system in SYSTEMS:
        if system in systems and system in levels:
            for c, results, duration_s in levels[system]():
                rows.append(summarize(system, "first_turn", c, results, 0, duration_s))
                print_rows(rows[-1:], True, sys.stderr)
    return rows


# --- the report -------------------------------------------------------------------------------------------------


def summarize(
    system: str, workload: str, concurrency: int, results: list[RequestResult], failed: int, duration_s: float,
    adapters: int | None = None,
) -> dict:
    tokens = sum(r.num_tokens for r in results)
    return {
        "system": system,
        "workload": workload,
        **({} if adapters is None else {"adapters": adapters}),  # --adapters' rows only: the others keep their shape
        "concurrency": concurrency,
        "requests": len(results),
        "failed": failed,
        "output_tokens": tokens,
        "prompt_tokens_mean": round(float(np.mean([r.prompt_tokens for r in results])), 1) if results else None,
        "duration_s": round(duration_s, 2),
        "output_tok_s": round(tokens / duration_s, 1),
        **latency_fields(results),
    }


def add_ratios(rows: list[dict], bases: list[str]) -> None:
    """Each row's throughput relative to each base system's at the same workload and concurrency; an adapter row's
    also relative to one adapter's (K = 1), where that was measured."""
    by = {(r["system"], r["workload"], r.get("adapters"), r["concurrency"]): r["output_tok_s"] for r in rows}
    for r in rows:
        for base in bases:
            ref = by.get((base, r["workload"], None, r["concurrency"]))
            r[f"x_{base}"] = round(r["output_tok_s"] / ref, 2) if ref else None
        if "adapters" in r:
            ref = by.get((r["system"], r["workload"], 1, r["concurrency"]))
            r["x_1_adapter"] = round(r["output_tok_s"] / ref, 2) if ref else None


def describe(args: argparse.Namespace, plan: Plan) -> str:
    """The note line: what was sent, and the machine it was measured on."""
    parts = []
    for workload in args.workloads:
        chats = {chat.turns: chat for (w, _, _), cell in plan.cells.items() if w == workload for chat in cell}
        lengths = plan.prompt_tokens[workload]
        parts.append(
            f"{workload}: {len(chats)} conversations, {sum(len(c.turns) for c in chats.values())} distinct turns, "
            f"prompt tokens mean {np.mean(lengths):.0f} max {max(lengths)}"
            + (" (estimated after the first turn)" if workload == "multi_turn" else "")
        )
    target = f"target {args.base_url or 'alchemist serve started here'}; " if "http" in args.systems else ""
    machine = ""
    if args.base_url is None or set(args.systems) != {"http"}:  # something runs here: in which dtype
        from alchemist.model.loader import resolve_device, resolve_dtype

        dtype = resolve_dtype(args.dtype, resolve_device(args.device))
        machine = f"dtype {str(dtype).removeprefix('torch.')}, "
    return (
        f"# ShareGPT (seed {args.seed}{', prompts reused across levels' if args.reuse_prompts else ''}): "
        f"{'; '.join(parts)}; {args.max_tokens} greedy output tokens each (EOS ignored); {target}"
        f"{machine}{os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}, load average at start {os.getloadavg()[0]:.1f}"
    )


def check_args(args: argparse.Namespace) -> None:
    args.concurrency = args.concurrency or ([32] if args.adapters else [1, 8, 32])
    for flag in ("concurrency", "requests_per_level", "max_tokens", "max_prompt_tokens", "adapters"):
        values = getattr(args, flag)
        if any(v < 1 for v in (values if isinstance(values, list) else [] if values is None else [values])):
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {values}")
    for flag, values, known in (("systems", args.systems, SYSTEMS), ("workloads", args.workloads, WORKLOADS)):
        for value in values:
            if value not in known:
                raise ValueError(f"--{flag}: unknown {value!r}; choose from {list(known)}")
    if args.adapters and set(args.systems) != {"http"}:
        raise ValueError("--adapters measures the http system only; leave out --systems engine and transformers")
    if args.adapters_dir and not args.adapters:
        raise ValueError("--adapters-dir is where --adapters K ... writes its adapters; give --adapters too")
    if set(args.systems) - {"http"} and "first_turn" not in args.workloads:
        raise ValueError("--systems engine and transformers run the first_turn workload only; add it to --workloads")
    if args.base_url is not None and urlparse(args.base_url).path in ("", "/"):
        args.base_url = args.base_url.rstrip("/") + "/v1"  # the OpenAI API's root, as a client's base_url has it
    args.workloads = list(dict.fromkeys(args.workloads))  # the order given, once each
    args.adapters = list(dict.fromkeys(args.adapters)) if args.adapters else None
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY", "unused")


def main(args: argparse.Namespace) -> int:
    from alchemist.model.loader import hf_dir_for
    from alchemist.model.tokenizer import Tokenizer

    check_args(args)
    plan = plan_workloads(args, Tokenizer.from_pretrained(hf_dir_for(args.model_path)))
    note = describe(args, plan)
    print(note, file=sys.stderr)
    rows = bench_in_process(args, plan, args.systems) if set(args.systems) - {"http"} else []
    if "http" in args.systems:
        rows += bench_http(args, plan)
    add_ratios(rows, [s for s in ("transformers", "engine") if s in args.systems])
    print_rows(rows, args.json)
    if not args.json:
        print(f"{note}, at end {os.getloadavg()[0]:.1f}")
    return 0
