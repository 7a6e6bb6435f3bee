"""`alchemist bench ...`: each benchmark's flags, registered under the main command line (alchemist/cli.py).

Flags a benchmark shares with `alchemist serve` come from the config tree's fields (``add_field_flags``; `bench
online` takes every serve flag, parsed by the serve parser). The benchmarks themselves are imported when run, so that
``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib

from alchemist.config import Config, EngineConfig, OnlineConfig, RecordConfig, TrainerConfig
from alchemist.config.parse import add_field_flags
from alchemist.config.training import AdapterConfig


def _runs(module: str):
    """The handler that imports ``alchemist.bench.<module>`` and runs its ``main(args)``."""
    return lambda args: importlib.import_module(f"alchemist.bench.{module}").main(args)


def _model_flags(p: argparse.ArgumentParser, **defaults: object) -> None:
    add_field_flags(p, EngineConfig, "model", "dtype", "device", **defaults)


def register(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    bench = sub.add_parser("bench", help="benchmarks (each takes --json: one JSON object per table row)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for register_one in (_forward, _serve, _train, _memory, _online, _learn, _ui, _soak, _paper, _scale):
        register_one(bsub)
    return bsub


def _forward(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("forward", help="prefill speed, ours vs transformers on the same weights")
    _model_flags(p, dtype="float32")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_runs("forward"))


def _train(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("train", help="one LoRA step: recompute vs replay vs transformers+PEFT; memory; recording")
    add_field_flags(p, EngineConfig, "model")
    p.add_argument("--shapes", nargs="+", default=None, help="PxR pairs, e.g. 512x128 (default: 128..2048 x 32..512)")
    add_field_flags(p, RecordConfig, "dtype", dtype="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--prefill-repeats", type=int, default=11, help="prefills with and without recording, timed in pairs"
    )
    p.add_argument("--no-peft", action="store_true", help="skip the transformers + PEFT baseline")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_runs("training"))


def _memory(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser(
        "memory", help="training step memory and time: recompute vs replay from memory vs replay from disk; budget"
    )
    add_field_flags(p, EngineConfig, "model")
    p.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        help="PxR pairs (e.g. 1024x128) or sharegpt-pNN (the NN-th percentile ShareGPT prompt and reply lengths; "
        "default: 1024x128 2048x128 sharegpt-p50 sharegpt-p90)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed steps per mode (medians, interleaved)")
    p.add_argument(
        "--budget-mib",
        type=float,
        default=1024,
        help="transient step memory budget for the tokens-per-step comparison (default 1024: recompute then fits "
        "P=512 while replay's limit stays inside SmolLM2's 8k context)",
    )
    p.add_argument("--budget-grid", type=int, nargs="+", default=None, help="prompt lengths probed (R = 128)")
    p.add_argument("--no-budget", action="store_true", help="skip the tokens-per-step comparison")
    add_field_flags(p, RecordConfig, "dtype")
    p.add_argument("--prefetch-depth", type=int, default=TrainerConfig.prefetch_depth,
                   help="record layers read ahead of the replay walk")  # fmt: skip
    add_field_flags(p, AdapterConfig, "lora_r")
    p.add_argument("--record-dir", default=None, help="where record files go (default: a temporary directory)")
    p.add_argument("--sharegpt-samples", type=int, default=2000, help="conversations for the sharegpt-pNN lengths")
    p.add_argument("--sharegpt-mode", default="multi_turn", choices=["multi_turn", "first_turn"])
    p.add_argument("--seed", type=int, default=0, help="ShareGPT sampling seed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_runs("memory"))


def _serve(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser(
        "serve", help="ShareGPT chat load on an OpenAI-compatible server (ours by default): tokens/s, TTFT, TPOT, ITL"
    )
    p.add_argument(
        "--base-url", default=None, help="the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1 (default: "
        "start `alchemist serve` here)"
    )  # fmt: skip
    p.add_argument("--model", default=None, help="the model name requests carry (default: the first of GET /models)")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY, else 'unused'")
    p.add_argument(
        "--model-path", default=None, help="HF model directory or .gguf: of the server started here, of the engine "
        "and transformers systems, and the tokenizer that counts prompt tokens (default: SmolLM2-135M-Instruct)"
    )  # fmt: skip
    add_field_flags(p, EngineConfig, "dtype", "device")  # of what runs here
    p.add_argument(
        "--workloads", "--workload", nargs="+", default=["first_turn"], help="first_turn (ShareGPT first user turns) "
        "and/or multi_turn (conversations continued turn by turn with the server's replies)"
    )  # fmt: skip
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="default: 1 8 32 (with --adapters: 32)")
    p.add_argument(
        "--requests-per-level", type=int, default=2, help="requests = this x concurrency (at least 4; multi_turn: "
        "whole conversations until their turns reach it)"
    )  # fmt: skip
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="prompts longer are skipped (multi_turn: cut)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens of every request (EOS ignored)")
    p.add_argument("--reuse-prompts", action="store_true", help="every level of a workload sends the same prompts")
    p.add_argument("--systems", nargs="+", default=["http"], help="http, and in process: engine, transformers")
    p.add_argument("--enforce-eager", action="store_true", help="our engine and server decode eager (no compile)")
    p.add_argument(
        "--adapters", type=int, nargs="+", default=None, metavar="K", help="per K, the requests spread round-robin "
        "over K named LoRA adapters (of max(K) made here: rank 16, every projection); the server started here holds "
        "them all, one at --base-url must serve them (the --lora-modules printed)"
    )  # fmt: skip
    p.add_argument("--adapters-dir", default=None, help="where --adapters' adapters are written and kept (default: "
                   "a temporary directory, removed at the end)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="ShareGPT shuffle")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_runs("serving"))


def online_servers() -> Config:
    """`bench online`'s servers before its flags: serve's defaults, but 16 sequences, a 4 GiB device store and a
    shorter wait for a partial batch."""
    config = Config()
    config.engine.max_num_seqs = 16
    config.record.store_budget_bytes = 4 << 30
    config.online.queue.max_wait_s = 5.0
    return config


def _online(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser(
        "online", help="the online loop under load: latency with training off/on, replay vs recompute",
        epilog="Every `alchemist serve` flag (and --config FILE) sets the servers it starts (see alchemist serve "
        "--help); here their defaults are serve's but --max-num-seqs 16 --record-budget-mb 4096 --train-max-wait-s 5.",
    )  # fmt: skip
    p.add_argument("--runs", nargs="+", default=["off", "replay", "recompute"])
    _workload_flags(p, rate=0.4, max_tokens=128, feedback_fraction=0.5, feedback="correction", drain_s=180.0)
    p.add_argument("--backlog-interval-s", type=float, default=5.0, help="how often the feedback backlog is sampled")
    p.set_defaults(func=_runs("online"), serve_base=online_servers)


def _workload_flags(
    p: argparse.ArgumentParser, rate: float, max_tokens: int, feedback_fraction: float, feedback: str, drain_s: float
) -> None:
    """`bench online`'s workload (and `bench scale`'s, with its own defaults): ShareGPT requests with feedback."""
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--request-rate", type=float, default=rate, help="requests per second (Poisson arrivals)")
    p.add_argument("--mode", default="multi_turn", choices=["multi_turn", "first_turn"], help="ShareGPT prompts")
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="cap on output tokens and on corrections")
    p.add_argument("--feedback-fraction", type=float, default=feedback_fraction, help="responses that get feedback")
    p.add_argument("--feedback", default=feedback, choices=["correction", "rating", "fact"],
                   help="correction: the reference reply; rating: a thumbs-up; fact: the request asks an invented "
                   "fact instead, corrected with it")  # fmt: skip
    p.add_argument("--drain-s", type=float, default=drain_s, help="after the load, training may finish for this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def _learn(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser(
        "learn", help="feedback learned at the defaults: facts per correction, forgetting, samples/s, thumbs, pairs"
    )
    _model_flags(p)
    p.add_argument("--parts", nargs="+", default=["teach", "forgetting", "throughput", "thumbs", "pairs"],
                   help="teach, forgetting, throughput, thumbs and/or pairs")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="an OnlineConfig setting other than its default (repeatable), by its dotted path (e.g. "
                   "stopping.epochs=4), a TrainerConfig field's name (lr=1e-3) or a former flat name "
                   "(epochs=4)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="teach: rounds of asking and correcting")
    p.add_argument("--teach-facts", type=int, default=10, help="teach: how many of the ten facts")
    p.add_argument(
        "--others", type=int, default=16, help="ShareGPT questions served beside each teach round (forgetting: first)"
    )
    p.add_argument("--unrelated", type=int, default=30, help="teach: ShareGPT questions whose answers should stay")
    p.add_argument("--facts", type=int, default=50, help="forgetting: facts taught one after another")
    p.add_argument("--others-per-fact", type=int, default=2, help="forgetting: ShareGPT questions served per fact")
    d = OnlineConfig()
    p.add_argument("--throughput-items", type=int, default=d.queue.batch_size,
                   help="throughput: feedback per mini-batch")  # fmt: skip
    p.add_argument("--max-prompt-tokens", type=int, default=768, help="throughput: ShareGPT multi-turn prompts")
    p.add_argument("--max-response-tokens", type=int, default=128, help="throughput: replies cut to this")
    p.add_argument("--repeats", type=int, default=3, help="throughput: timed mini-batches per way (medians)")
    p.add_argument("--seed", type=int, default=0, help="throughput, thumbs, pairs: ShareGPT sampling seed")
    p.add_argument("--preference-prompts", type=int, default=64, help="thumbs, pairs: ShareGPT questions per round")
    p.add_argument("--preference-rounds", type=int, default=2, help="thumbs, pairs: rounds of sampling and feedback")
    p.add_argument("--preference-tokens", type=int, default=128, help="thumbs, pairs: answers' max tokens")
    p.add_argument("--held-out", type=int, default=16, help="thumbs, pairs: questions whose greedy length is measured")
    p.add_argument("--held-out-medians", action=argparse.BooleanOptionalAction, default=True,
                   help="thumbs, pairs: their greedy answers asked again after each round, for the median (without: "
                        "the held-out margin alone after round 0)")  # fmt: skip
    p.add_argument("--prefer", choices=("shorter", "longer"), default="shorter",
                   help="thumbs, pairs: the preference the feedback shows (longer: the control)")  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_runs("learn"))


def _ui(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("ui", help="the web app in chromium: page weight, time to first token painted vs the API's")
    p.add_argument("--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (default: start one)")
    p.add_argument("--model-path", default=None, help="of the server started here (default: SmolLM2-135M-Instruct)")
    add_field_flags(p, EngineConfig, "dtype", "device")  # of the server started here
    p.add_argument("--rounds", type=int, default=8, help="questions asked both through the API and in the page")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--settle-s", type=float, default=1.0, help="requests after the load event still counted")
    p.add_argument("--chromium", default="/usr/bin/chromium", help="the browser Playwright drives")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_runs("ui"))


def _soak(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("soak", help="streaming clients with feedback for minutes: errors, resident memory, backlog")
    _model_flags(p)
    p.add_argument("--runs", nargs="+", default=["on", "off"], help="on: training on; off: --no-train")
    p.add_argument("--clients", type=int, default=16, help="streaming clients, each one request at a time")
    p.add_argument("--minutes", type=float, default=5.0, help="how long each run's load lasts after warm-up")
    p.add_argument("--correct-every", type=int, default=4, help="a correction on every k-th answer, thumbs on others")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens asked for per request; cap on corrections")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=256, help="ShareGPT first turns, cycled through")
    p.add_argument("--sample-interval-s", type=float, default=5.0, help="how often RSS and the backlog are sampled")
    p.add_argument("--warmup-s", type=float, default=60.0, help="RSS after warm-up: the first sample past this...")
    p.add_argument("--warmup-version", type=int, default=0,
                   help="... at which the trainer's adapter version (optimizer steps) has reached this")  # fmt: skip
    p.add_argument("--warmup-timeout-s", type=float, default=600.0,
                   help="the load ends if warm-up has not come by then (the row's warm_s is then null)")  # fmt: skip
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="an extra `alchemist serve` argument (repeatable): --serve-arg=--train-lr=1e-3")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_runs("soak"))


def _paper(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser(
        "paper", help="the paper's evaluation on ShareGPT in one run: training throughput, memory, tokens per step "
        "under a budget, serving latency (--out DIR: rows and PNG plots)",
        epilog="Every `alchemist serve` flag (and --config FILE) sets the model (--model), the record dtype and the "
        "adapter's rank of every claim, and the servers of the serving claim (defaults as `bench online`'s).",
    )  # fmt: skip
    p.add_argument("--claims", nargs="+", default=["throughput", "memory", "budget", "serving"],
                   help="throughput, memory, budget and/or serving")  # fmt: skip
    p.add_argument("--mode", default="multi_turn", choices=["multi_turn", "first_turn"], help="ShareGPT prompts")
    p.add_argument("--seed", type=int, default=0, help="ShareGPT sampling and arrivals")
    # throughput and memory
    p.add_argument("--buckets", type=int, nargs="+", default=[0, 256, 512, 1024, 2048, 4096],
                   help="throughput, memory: prompt-length bucket edges, each bucket (lo, hi]")  # fmt: skip
    p.add_argument("--sharegpt-samples", type=int, default=1000, help="conversations the buckets' samples come from")
    p.add_argument("--response-tokens", type=int, default=128, help="a sample's reply cut to this")
    p.add_argument("--repeats", type=int, default=3, help="throughput: timed steps per way (medians, interleaved)")
    p.add_argument("--no-peft", action="store_true", help="skip the transformers + PEFT baseline")
    # budget
    p.add_argument("--budget-mib", type=float, default=1024, help="budget: transient step memory (`bench memory`'s)")
    p.add_argument("--budget-grid", type=int, nargs="+", default=None, help="budget: prompt lengths probed (R = 128)")
    # serving
    p.add_argument("--runs", nargs="+", default=["off", "record", "train", "train_recompute"],
                   help="serving: off, record (recording on), train (recording and training on), train_recompute "
                   "(training on, recording off)")  # fmt: skip
    p.add_argument("--rates", type=float, nargs="+", default=None, help="serving: requests per second (Poisson; "
                   "default: --rate-fractions of the measured capacity)")  # fmt: skip
    p.add_argument("--rate-fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0],
                   help="serving: of the requests per second one server completes of --capacity-requests sent at "
                   "once")  # fmt: skip
    p.add_argument("--capacity-requests", type=int, default=32, help="serving: the capacity probe's requests")
    p.add_argument("--requests-per-rate", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=768, help="serving: ShareGPT prompts longer are skipped")
    p.add_argument("--max-tokens", type=int, default=128, help="serving: cap on output tokens and on corrections")
    p.add_argument("--feedback-fraction", type=float, default=0.125, help="serving: responses corrected")
    p.add_argument("--feedback", default="correction", choices=["correction", "fact"],
                   help="serving: what is corrected: ShareGPT answers by their reference reply, or invented facts "
                   "asked instead (as bench online's)")  # fmt: skip
    p.add_argument("--drain-s", type=float, default=180.0, help="serving: after each rate's load, training may "
                   "finish for this long")  # fmt: skip
    p.add_argument("--backlog-interval-s", type=float, default=5.0, help="serving: how often the backlog is sampled")
    p.add_argument("--served-interval-s", type=float, default=0.5,
                   help="serving: how often the trained adapter's log position is read (time to serve's "
                   "resolution)")  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="a directory: rows.jsonl, note.txt and one PNG per claim")
    p.set_defaults(func=_runs("paper"), serve_base=online_servers)


def _scale(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser(
        "scale", help="one replica against several on this machine: serving, training per replica, the collectives' "
        "share, record affinity",
        epilog="Every `alchemist serve` flag (and --config FILE) sets the servers it starts; here their defaults are "
        "`bench online`'s. Each count's feedback log is a fresh database of a throwaway PostgreSQL server, or of "
        "--feedback-db's where it is a postgresql:// URL; --ray-address: the replicas' Ray cluster.",
    )  # fmt: skip
    p.add_argument("--replica-counts", dest="replicas", type=int, nargs="+", default=[1, 2],
                   help="replicas of each run (one run per count, the machine's cores split between them)")  # fmt: skip
    _workload_flags(p, rate=1.0, max_tokens=96, feedback_fraction=0.25, feedback="fact", drain_s=300.0)
    p.set_defaults(func=_runs("scale"), serve_base=online_servers)
