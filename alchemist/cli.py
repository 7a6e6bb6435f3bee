"""The `alchemist` command line: serve, generate, and the benchmarks (`alchemist bench ...`).

Each subcommand registers its flags in a small function; heavy imports happen inside the handlers so that
`alchemist --help` stays instant.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from alchemist.config import EngineConfig, OnlineConfig, RecordConfig, ServerConfig


def _add_model_flags(p: argparse.ArgumentParser, dtype_default: str = "auto") -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=dtype_default, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")


def _generate(args: argparse.Namespace) -> int:
    from alchemist.generate import generate_text

    for delta in generate_text(args):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _register_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="answer one chat prompt (greedy unless --temperature > 0)")
    _add_model_flags(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--system", default=None, help="system message (default: the chat template's own)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=_generate)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """EngineConfig fields; unset flags keep EngineConfig's defaults."""
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences running at once (KV-cache slots)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: min(model's, 4096))")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV block pool (default: every slot can fill)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (prefill chunk size)")
    p.add_argument("--max-waiting", type=int, default=None, help="waiting requests beyond this get a 429")
    p.add_argument(
        "--enforce-eager", action="store_true", help="decode without the compiled layer (skips its warm-up compile)"
    )
    p.add_argument(
        "--no-merge-adapter", action="store_true", help="serve the adapter as a separate delta (saves a weight copy)"
    )
    p.add_argument(
        "--no-enable-prefix-caching", action="store_true", help="compute every prompt whole (no prefix cache)"
    )


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    fields = ("max_num_seqs", "max_model_len", "num_kv_blocks", "max_num_batched_tokens", "max_waiting")
    sizes = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, compile_decode=False if args.enforce_eager else None,
        merge_adapter=not args.no_merge_adapter, enable_prefix_caching=not args.no_enable_prefix_caching, **sizes,
    )  # fmt: skip


def _serve(args: argparse.Namespace) -> int:
    from alchemist.server.app import run_server

    server_config = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        data_dir=args.data_dir,
        feedback_db=args.feedback_db,
        api_key=args.api_key,
        api_keys_file=args.api_keys_file,
        allow_unauthenticated=args.allow_unauthenticated,
        metrics_access=args.metrics_access,
        docs_access=args.docs_access,
        requests_per_minute=args.rate_limit_requests,
        feedback_per_minute=args.rate_limit_feedback,
        max_streams_per_key=args.max_streams_per_key,
        record_mb_per_hour=args.record_quota_mb_per_hour,
    )
    run_server(_engine_config(args), server_config, _record_config(args), _online_config(args))
    return 0


def _add_online_flags(p: argparse.ArgumentParser) -> None:
    """OnlineConfig fields: the trainer that learns from feedback inside the server (defaults: OnlineConfig's)."""
    d = OnlineConfig()
    p.add_argument("--no-train", action="store_true", help="log feedback but train nothing")
    p.add_argument("--train-batch-size", type=int, default=d.batch_size, help="feedback samples per optimizer step")
    p.add_argument("--train-max-wait-s", type=float, default=d.max_wait_s, help="train a partial batch after this wait")
    p.add_argument("--train-key-share", type=float, default=d.key_share,
                   help="most of a batch one API key takes while others' feedback waits (1: no cap)")  # fmt: skip
    p.add_argument("--train-epochs", type=int, default=d.epochs, help="optimizer steps over each mini-batch, at most")
    p.add_argument(
        "--train-target-loss", type=float, default=d.target_loss,
        help="a mini-batch's steps end once every correction's loss is under this (0: always --train-epochs)",
    )  # fmt: skip
    p.add_argument("--train-lr", type=float, default=d.lr)
    p.add_argument("--train-max-staleness", type=int, default=d.max_staleness, help="adapter versions a record may lag")
    p.add_argument("--train-no-replay", action="store_true", help="recompute every prompt (baseline)")
    p.add_argument(
        "--train-prefetch-depth", type=int, default=d.prefetch_depth, help="record layers read ahead of the replay"
    )
    _add_group_flags(p, d)
    p.add_argument(
        "--train-share", type=float, default=d.train_share, help="time share of training while serving is busy"
    )
    p.add_argument(
        "--train-quantum-ms",
        type=float,
        default=d.train_quantum_s * 1000,
        help="training turns of up to this long while serving (ms)",
    )
    p.add_argument(
        "--train-protect-energy",
        type=float,
        default=d.protect_energy,
        help="share of ordinary chat's input directions the adapter may not read (0: off)",
    )
    p.add_argument(
        "--train-anchor-weight",
        type=float,
        default=d.anchor_weight,
        help="weight of the KL to the base model on served traffic",
    )
    p.add_argument(
        "--train-anchor-samples", type=int, default=d.anchor_samples, help="recent served completions per step"
    )
    p.add_argument(
        "--train-anchor-top-k", type=int, default=d.anchor_top_k, help="base-model tokens kept per anchor position"
    )
    p.add_argument(
        "--train-anchor-max-tokens", type=int, default=d.anchor_max_tokens, help="response tokens of an anchor"
    )
    p.add_argument(
        "--train-loss-spike-factor",
        type=float,
        default=d.loss_spike_factor,
        help="quarantine a sample whose loss exceeds this x the running level (0: NaN/inf only)",
    )
    p.add_argument(
        "--train-loss-spike-warmup", type=int, default=d.loss_spike_warmup, help="losses seen before spikes count"
    )
    _add_objective_flags(p, d)
    _add_gate_flags(p, d)
    p.add_argument("--lora-r", type=int, default=d.lora_r)
    p.add_argument("--lora-alpha", type=float, default=d.lora_alpha)
    p.add_argument(
        "--keep-adapter-versions", type=int, default=d.keep_versions, help="adapter versions kept (rollback targets)"
    )


def _add_objective_flags(p: argparse.ArgumentParser, d: OnlineConfig) -> None:
    """The objectives' weights and betas, and the backlog policy."""
    for kind, what in (("sft", "corrections"), ("kto", "ratings without a correction"), ("dpo", "preference pairs")):
        p.add_argument(f"--train-{kind}-weight", type=float, default=getattr(d, f"{kind}_weight"),
                       help=f"weight of the {kind.upper()} loss ({what}) in a step")  # fmt: skip
    p.add_argument("--train-kto-beta", type=float, default=d.kto_beta)
    p.add_argument("--train-dpo-beta", type=float, default=d.dpo_beta)
    p.add_argument("--train-kto-desirable-weight", type=float, default=d.kto_desirable_weight)
    p.add_argument("--train-kto-undesirable-weight", type=float, default=d.kto_undesirable_weight)
    p.add_argument("--train-thumbs-up", choices=("kto", "sft"), default=d.thumbs_up,
                   help="a thumbs-up without a correction: KTO-desirable, or SFT on the served answer")  # fmt: skip
    p.add_argument("--train-skip-ratings-after-s", type=float, default=d.skip_ratings_after_s,
                   help="skip ratings and preferences not trained this long after arrival (0: never)")  # fmt: skip
    p.add_argument("--train-skip-corrections-after-s", type=float, default=d.skip_corrections_after_s,
                   help="skip corrections not trained this long after arrival (0: never)")  # fmt: skip


def _add_gate_flags(p: argparse.ArgumentParser, d: OnlineConfig) -> None:
    """The evaluation gate's bounds (alchemist.training.evaluation)."""
    p.add_argument("--train-no-gate", action="store_true", help="serve new adapter versions unevaluated")
    p.add_argument("--train-gate-heldout-max-rise", type=float, default=d.gate_heldout_max_rise,
                   help="held-out perplexity rise over the base model a version may have (0.1: 10%%)")  # fmt: skip
    p.add_argument("--train-gate-canary-max-drop", type=float, default=d.gate_canary_max_drop,
                   help="nats any canary answer's log-probability may lose against the base model")  # fmt: skip
    p.add_argument("--train-gate-canary-max-mean-drop", type=float, default=d.gate_canary_max_mean_drop,
                   help="... and all of them on average")  # fmt: skip
    p.add_argument("--train-gate-taught-max-rise", type=float, default=d.gate_taught_max_rise,
                   help="nats per token a fact taught earlier may lose against the serving version")  # fmt: skip
    p.add_argument("--train-gate-taught-samples", type=int, default=d.gate_taught_samples,
                   help="facts taught earlier (the most recent trained corrections) that are checked")  # fmt: skip
    p.add_argument("--train-rollback-min-ratings", type=int, default=d.rollback_min_ratings,
                   help="roll back versions users rate worse, given this many ratings a side (0: never)")  # fmt: skip
    p.add_argument("--train-rollback-margin", type=float, default=d.rollback_margin,
                   help="... when their thumbs-down rate is higher by this much (0.15: 15 points)")  # fmt: skip
    p.add_argument("--train-rollback-z", type=float, default=d.rollback_z,
                   help="... and by a one-sided two-proportion z-test at this z")  # fmt: skip


def _add_group_flags(p: argparse.ArgumentParser, d: OnlineConfig) -> None:
    """How many samples train together (serve and bench online)."""
    p.add_argument("--train-group-size", type=int, default=d.group_size, help="samples trained together in one pass")
    p.add_argument(
        "--train-group-max-tokens",
        type=int,
        default=d.group_max_tokens,
        help="rows of a pass at most (bounds a slice); 0: no limit",
    )


def _online_config(args: argparse.Namespace) -> OnlineConfig:
    return OnlineConfig(
        enabled=not args.no_train,
        batch_size=args.train_batch_size,
        max_wait_s=args.train_max_wait_s,
        key_share=args.train_key_share,
        epochs=args.train_epochs,
        target_loss=args.train_target_loss,
        lr=args.train_lr,
        max_staleness=args.train_max_staleness,
        replay=not args.train_no_replay,
        prefetch_depth=args.train_prefetch_depth,
        group_size=args.train_group_size,
        group_max_tokens=args.train_group_max_tokens,
        train_share=args.train_share,
        train_quantum_s=args.train_quantum_ms / 1000,
        anchor_weight=args.train_anchor_weight,
        protect_energy=args.train_protect_energy,
        anchor_samples=args.train_anchor_samples,
        anchor_top_k=args.train_anchor_top_k,
        anchor_max_tokens=args.train_anchor_max_tokens,
        sft_weight=args.train_sft_weight,
        kto_weight=args.train_kto_weight,
        dpo_weight=args.train_dpo_weight,
        kto_beta=args.train_kto_beta,
        dpo_beta=args.train_dpo_beta,
        kto_desirable_weight=args.train_kto_desirable_weight,
        kto_undesirable_weight=args.train_kto_undesirable_weight,
        thumbs_up=args.train_thumbs_up,
        skip_ratings_after_s=args.train_skip_ratings_after_s,
        skip_corrections_after_s=args.train_skip_corrections_after_s,
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        keep_versions=args.keep_adapter_versions,
        loss_spike_factor=args.train_loss_spike_factor,
        loss_spike_warmup=args.train_loss_spike_warmup,
        gate=not args.train_no_gate,
        gate_heldout_max_rise=args.train_gate_heldout_max_rise,
        gate_canary_max_drop=args.train_gate_canary_max_drop,
        gate_canary_max_mean_drop=args.train_gate_canary_max_mean_drop,
        gate_taught_max_rise=args.train_gate_taught_max_rise,
        gate_taught_samples=args.train_gate_taught_samples,
        rollback_min_ratings=args.train_rollback_min_ratings,
        rollback_margin=args.train_rollback_margin,
        rollback_z=args.train_rollback_z,
    )


def _add_record_flags(p: argparse.ArgumentParser) -> None:
    """RecordConfig fields: which prompts' prefill activations are kept for training."""
    p.add_argument("--record-policy", default="requested", choices=["none", "requested", "sample", "all"])
    p.add_argument("--record-fraction", type=float, default=0.0, help="with --record-policy sample")
    p.add_argument("--record-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--record-budget-mb", type=int, default=2048, help="activation store: device tier budget")
    p.add_argument("--record-host-budget-mb", type=int, default=4096, help="activation store: host memory tier")
    p.add_argument("--record-disk-budget-mb", type=int, default=16384, help="activation store: disk tier")
    p.add_argument("--record-dir", default=None, help="the disk tier's files (default: DATA_DIR/activations)")


def _record_config(args: argparse.Namespace) -> RecordConfig:
    return RecordConfig(
        policy=args.record_policy,
        sample_fraction=args.record_fraction,
        dtype=args.record_dtype,
        store_budget_bytes=args.record_budget_mb << 20,
        host_budget_bytes=args.record_host_budget_mb << 20,
        disk_budget_bytes=args.record_disk_budget_mb << 20,
        disk_dir=args.record_dir,
    )


def _register_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    _add_model_flags(p)
    _add_engine_flags(p)
    _add_record_flags(p)
    _add_online_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: the file's stem)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get a 413")
    p.add_argument("--data-dir", default="alchemist-data", help="durable state: feedback log, adapters")
    p.add_argument("--feedback-db", default=None, help="feedback log SQLite file (default: DATA_DIR/feedback.sqlite)")
    _add_key_flags(p)
    p.set_defaults(func=_serve)


def _add_key_flags(p: argparse.ArgumentParser) -> None:
    """Who may call the server (alchemist.server.auth)."""
    p.add_argument(
        "--api-key", default=os.environ.get("ALCHEMIST_API_KEY"), help="one admin key (default: $ALCHEMIST_API_KEY)"
    )
    p.add_argument("--api-keys-file", default=None, help="named user and admin keys, hashed (alchemist keys add)")
    p.add_argument(
        "--allow-unauthenticated", action="store_true", help="serve a non-loopback --host without any API key"
    )
    p.add_argument("--metrics-access", default="admin", choices=["public", "admin"], help="who may read /metrics")
    p.add_argument("--docs-access", default="admin", choices=["public", "admin"], help="/docs and /openapi.json")
    d = ServerConfig()
    p.add_argument("--rate-limit-requests", type=float, default=d.requests_per_minute, help="per key a minute; 0: off")
    p.add_argument("--rate-limit-feedback", type=float, default=d.feedback_per_minute, help="per key a minute; 0: off")
    p.add_argument("--max-streams-per-key", type=int, default=d.max_streams_per_key, help="open streams; 0: off")
    p.add_argument(
        "--record-quota-mb-per-hour", type=float, default=d.record_mb_per_hour, help="records a key may ask for"
    )


def _keys_add(args: argparse.Namespace) -> int:
    from alchemist.server.auth import add_key

    key = add_key(args.file, args.name, args.admin)
    print(f"{'admin' if args.admin else 'user'} key {args.name!r} added to {args.file} (stored hashed; shown once):")
    print(key)
    return 0


def _register_keys(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="API keys of `serve --api-keys-file`")
    ksub = keys.add_subparsers(dest="keys", required=True)
    p = ksub.add_parser("add", help="make a new key, print it once, store its hash (SIGHUP or wait: serve reloads)")
    p.add_argument("name")
    p.add_argument("--admin", action="store_true", help="rollback, adapter management, /metrics and /docs")
    p.add_argument("--file", default="alchemist-data/api-keys.toml", help="the keys file")
    p.set_defaults(func=_keys_add)


def _bench_forward(args: argparse.Namespace) -> int:
    from alchemist.bench.forward import main

    return main(args)


def _register_bench(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    bench = sub.add_parser("bench", help="benchmarks (each takes --json: one JSON object per table row)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    p = bsub.add_parser("forward", help="prefill speed, ours vs transformers on the same weights")
    _add_model_flags(p, dtype_default="float32")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_bench_forward)
    _register_bench_serve(bsub)
    _register_bench_train(bsub)
    _register_bench_memory(bsub)
    _register_bench_online(bsub)
    _register_bench_learn(bsub)
    _register_bench_ui(bsub)
    _register_bench_soak(bsub)
    return bsub


def _bench_train(args: argparse.Namespace) -> int:
    from alchemist.bench.training import main

    return main(args)


def _register_bench_train(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("train", help="one LoRA step: recompute vs replay vs transformers+PEFT; memory; recording")
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--shapes", nargs="+", default=None, help="PxR pairs, e.g. 512x128 (default: 128..2048 x 32..512)")
    p.add_argument("--record-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--prefill-repeats", type=int, default=11, help="prefills with and without recording, timed in pairs"
    )
    p.add_argument("--no-peft", action="store_true", help="skip the transformers + PEFT baseline")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_bench_train)


def _bench_memory(args: argparse.Namespace) -> int:
    from alchemist.bench.memory import main

    return main(args)


def _register_bench_memory(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser(
        "memory", help="training step memory and time: recompute vs replay from memory vs replay from disk; budget"
    )
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
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
    p.add_argument("--record-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="what serving records")
    p.add_argument("--prefetch-depth", type=int, default=2, help="record layers read ahead of the replay walk")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--record-dir", default=None, help="where record files go (default: a temporary directory)")
    p.add_argument("--sharegpt-samples", type=int, default=2000, help="conversations for the sharegpt-pNN lengths")
    p.add_argument("--sharegpt-mode", default="multi_turn", choices=["multi_turn", "first_turn"])
    p.add_argument("--seed", type=int, default=0, help="ShareGPT sampling seed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_bench_memory)


def _bench_serve(args: argparse.Namespace) -> int:
    from alchemist.bench.serving import main

    return main(args)


def _register_bench_serve(bsub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="of what runs here")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (of what runs here)")
    p.add_argument(
        "--workloads", "--workload", nargs="+", default=["first_turn"], help="first_turn (ShareGPT first user turns) "
        "and/or multi_turn (conversations continued turn by turn with the server's replies)"
    )  # fmt: skip
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument(
        "--requests-per-level", type=int, default=2, help="requests = this x concurrency (at least 4; multi_turn: "
        "whole conversations until their turns reach it)"
    )  # fmt: skip
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="prompts longer are skipped (multi_turn: cut)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens of every request (EOS ignored)")
    p.add_argument("--reuse-prompts", action="store_true", help="every level of a workload sends the same prompts")
    p.add_argument("--systems", nargs="+", default=["http"], help="http, and in process: engine, transformers")
    p.add_argument("--enforce-eager", action="store_true", help="our engine and server decode eager (no compile)")
    p.add_argument("--seed", type=int, default=0, help="ShareGPT shuffle")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_bench_serve)


def _bench_online(args: argparse.Namespace) -> int:
    from alchemist.bench.online import main

    return main(args)


def _register_bench_online(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("online", help="the online loop under load: latency with training off/on, replay vs recompute")
    _add_model_flags(p)
    p.add_argument("--runs", nargs="+", default=["off", "replay", "recompute"])
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--request-rate", type=float, default=0.4, help="requests per second (Poisson arrivals)")
    p.add_argument("--mode", default="multi_turn", choices=["multi_turn", "first_turn"], help="ShareGPT prompts")
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    p.add_argument("--max-tokens", type=int, default=128, help="cap on output tokens and on corrections")
    p.add_argument("--feedback-fraction", type=float, default=0.5, help="responses that get feedback")
    p.add_argument("--feedback", default="correction", choices=["correction", "rating"])
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--record-budget-mb", type=int, default=4096, help="the server's activation store")
    d = OnlineConfig()  # the server's defaults, but a shorter wait for a partial batch
    p.add_argument("--train-batch-size", type=int, default=d.batch_size)
    p.add_argument("--train-epochs", type=int, default=d.epochs)
    p.add_argument("--train-protect-energy", type=float, default=d.protect_energy)
    _add_group_flags(p, d)
    p.add_argument("--train-max-wait-s", type=float, default=5.0)
    p.add_argument("--train-share", type=float, default=d.train_share)
    p.add_argument("--train-quantum-ms", type=float, default=d.train_quantum_s * 1000)
    p.add_argument("--drain-s", type=float, default=180.0, help="after the load, training may finish for this long")
    p.add_argument("--backlog-interval-s", type=float, default=5.0, help="how often the feedback backlog is sampled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_bench_online)


def _bench_learn(args: argparse.Namespace) -> int:
    from alchemist.bench.learn import main

    return main(args)


def _register_bench_learn(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser(
        "learn", help="corrections learned with the default settings: facts per correction, forgetting, samples/s"
    )
    _add_model_flags(p)
    p.add_argument("--parts", nargs="+", default=["teach", "forgetting", "throughput"],
                   help="teach, forgetting and/or throughput")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="an OnlineConfig field other than its default (repeatable), e.g. lr=1e-3")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="teach: rounds of asking and correcting")
    p.add_argument("--teach-facts", type=int, default=10, help="teach: how many of the ten facts")
    p.add_argument(
        "--others", type=int, default=16, help="ShareGPT questions served beside each teach round (forgetting: first)"
    )
    p.add_argument("--unrelated", type=int, default=30, help="teach: ShareGPT questions whose answers should stay")
    p.add_argument("--facts", type=int, default=50, help="forgetting: facts taught one after another")
    p.add_argument("--others-per-fact", type=int, default=2, help="forgetting: ShareGPT questions served per fact")
    d = OnlineConfig()
    p.add_argument("--throughput-items", type=int, default=d.batch_size, help="throughput: feedback per mini-batch")
    p.add_argument("--max-prompt-tokens", type=int, default=768, help="throughput: ShareGPT multi-turn prompts")
    p.add_argument("--max-response-tokens", type=int, default=128, help="throughput: replies cut to this")
    p.add_argument("--repeats", type=int, default=3, help="throughput: timed mini-batches per way (medians)")
    p.add_argument("--seed", type=int, default=0, help="throughput: ShareGPT sampling seed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_bench_learn)


def _bench_ui(args: argparse.Namespace) -> int:
    from alchemist.bench.ui import main

    return main(args)


def _register_bench_ui(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("ui", help="the web app in chromium: page weight, time to first token painted vs the API's")
    p.add_argument("--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (default: start one)")
    p.add_argument("--model-path", default=None, help="of the server started here (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="of a server started here")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (of the server started here)")
    p.add_argument("--rounds", type=int, default=8, help="questions asked both through the API and in the page")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--settle-s", type=float, default=1.0, help="requests after the load event still counted")
    p.add_argument("--chromium", default="/usr/bin/chromium", help="the browser Playwright drives")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_bench_ui, compile=False)


def _bench_soak(args: argparse.Namespace) -> int:
    from alchemist.bench.soak import main

    return main(args)


def _register_bench_soak(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("soak", help="streaming clients with feedback for minutes: errors, resident memory, backlog")
    _add_model_flags(p)
    p.add_argument("--runs", nargs="+", default=["on", "off"], help="on: training on; off: --no-train")
    p.add_argument("--clients", type=int, default=16, help="streaming clients, each one request at a time")
    p.add_argument("--minutes", type=float, default=5.0, help="how long each run's load lasts")
    p.add_argument("--correct-every", type=int, default=4, help="a correction on every k-th answer, thumbs on others")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens asked for per request; cap on corrections")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=256, help="ShareGPT first turns, cycled through")
    p.add_argument("--sample-interval-s", type=float, default=5.0, help="how often RSS and the backlog are sampled")
    p.add_argument("--warmup-s", type=float, default=60.0, help="RSS after warm-up: the first sample past this")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="an extra `alchemist serve` argument (repeatable): --serve-arg=--train-lr=1e-3")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_bench_soak)


# Subcommands register here; each adds its own parser.
REGISTRARS: list[Callable[[argparse._SubParsersAction], object]] = [_register_generate, _register_serve, _register_keys]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alchemist", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for register in REGISTRARS:
        register(sub)
    _register_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Imported after parsing: the engine package brings torch and transformers (~4 s), which --help and argument
    # errors never need.
    from alchemist.host_memory import keep_freed_memory

    keep_freed_memory()  # this process owns the allocator: reuse freed buffers (host_memory.py)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"alchemist: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
