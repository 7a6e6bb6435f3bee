"""Alchemist's configuration tree: one dataclass per component, each validated when it is built.

Bad values raise ``ValueError`` naming the field (the CLI maps its flags onto these fields one to one). Values
that depend on the loaded model (``EngineConfig.max_model_len`` and ``num_kv_blocks`` when left at None) are
filled in by ``EngineConfig.resolve`` once the model's config is known.

    config = EngineConfig(max_num_seqs=32, dtype="bfloat16")
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass

DTYPE_CHOICES = ("auto", "float32", "bfloat16")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
# Without a user setting, the context is capped here even where the model allows more: the per-slot cache is
# reserved for max_num_seqs x max_model_len tokens, and ShareGPT-like chats fit well inside it.
DEFAULT_MAX_MODEL_LEN = 4096


def _check_positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer (got {value!r})")


@dataclass
class EngineConfig:
    """The serving engine: model, numerics, and the sizes of the KV cache, the batch and the queue."""

    model: str | None = None  # HF directory or .gguf file; None: the default model (SmolLM2-135M-Instruct)
    dtype: str = "auto"  # "auto": bf16 where this CPU/GPU runs it fast, else fp32
    device: str = "auto"
    # KV-cache slots: sequences running at once. 32: a 2-core CPU's decode throughput still nearly doubles from batch
    # 8 to 32 (docs/benchmarks.md, "Decode step"), and the cache is resident only as far as it is used (KVCache).
    max_num_seqs: int = 32
    max_model_len: int | None = None  # None: min(model's max_position_embeddings, 4096)
    block_size: int = 16  # tokens per KV block (the unit of cache accounting)
    num_kv_blocks: int | None = None  # None: every slot can hold max_model_len; smaller forces preemption
    max_num_batched_tokens: int = 512  # tokens per step; longer prompts are prefilled in chunks
    max_waiting: int = 256  # requests queued beyond this are refused (the server answers 429)
    # Forwards that record nothing serve the adapter merged into the weights (alchemist.engine.merged_adapter):
    # no per-token cost, one more copy of the targeted weights in memory. False: the separate delta everywhere.
    merge_adapter: bool = True
    # Prompts start after the longest prefix of full blocks whose keys/values a slot still holds, computed under the
    # adapter version served (alchemist.engine.prefix_cache); recorded prompts are computed whole.
    enable_prefix_caching: bool = True
    # Decode steps through the compiled layer (alchemist.engine.compiled_decode): None where it was measured faster
    # (bf16 with our CPU decode kernel), True wherever it can run, False never (--enforce-eager).
    compile_decode: bool | None = None

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            self.model = str(self.model)
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)} (got {self.dtype!r})")
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)} (got {self.device!r})")
        _check_positive(
            self,
            "max_num_seqs",
            "max_model_len",
            "block_size",
            "num_kv_blocks",
            "max_num_batched_tokens",
            "max_waiting",
        )
        # Every running sequence decodes one token per step: all of them must fit in one step's budget.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool (got {self.enable_prefix_caching!r})")
        if self.compile_decode is not None and not isinstance(self.compile_decode, bool):
            raise ValueError(f"compile_decode must be a bool or None (got {self.compile_decode!r})")

    def resolve(self, max_position_embeddings: int) -> EngineConfig:
        """A copy with the model-dependent defaults filled in, checked against the model's context length."""
        max_model_len = self.max_model_len or min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                f"({max_position_embeddings})"
            )
        blocks_per_slot = -(-max_model_len // self.block_size)
        num_kv_blocks = self.num_kv_blocks or self.max_num_seqs * blocks_per_slot
        return dataclasses.replace(self, max_model_len=max_model_len, num_kv_blocks=num_kv_blocks)


ACCESS_CHOICES = ("public", "admin")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name to bind) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


RECORD_POLICIES = ("none", "requested", "sample", "all")
RECORD_DTYPES = ("bfloat16", "float32")
EVICT_PRIORITIES = ("requested", "lru")


@dataclass
class RecordConfig:
    """Prefill activation recording and the activation store that keeps the records for training."""

    policy: str = "requested"  # none | requested (requests that ask) | sample (a fraction, plus those) | all
    sample_fraction: float = 0.0  # with policy "sample"
    dtype: str = "bfloat16"  # storage dtype; float32 makes replay exact (bf16 costs ~1% gradient error)
    # The store's tiers (activations/store.py): records are made in the device tier (GPU memory on CUDA, process
    # memory on CPU) and move down to host memory (pinned on CUDA), then disk, then out, lowest priority first.
    store_budget_bytes: int = 2 << 30  # the device tier
    host_budget_bytes: int = 4 << 30  # 0: no host tier
    disk_budget_bytes: int = 16 << 30  # 0: no disk tier
    disk_dir: str | None = None  # the disk tier's files; None: the server's <data_dir>/activations, else a temp dir
    evict_priority: str = "requested"  # requested (records whose request asked rank first), then recency | lru
    ttl_s: float = 3600.0  # records older than this are dropped

    def __post_init__(self) -> None:
        if self.policy not in RECORD_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(RECORD_POLICIES)} (got {self.policy!r})")
        if not 0.0 <= self.sample_fraction <= 1.0:
            raise ValueError(f"sample_fraction must be in [0, 1] (got {self.sample_fraction!r})")
        if self.dtype not in RECORD_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(RECORD_DTYPES)} (got {self.dtype!r})")
        for name in ("store_budget_bytes", "host_budget_bytes", "disk_budget_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer (got {value!r})")
        if self.disk_dir is not None:
            self.disk_dir = str(self.disk_dir)  # a Path is welcome too
            if not self.disk_dir.strip():
                raise ValueError("disk_dir must not be empty (None: <data_dir>/activations, or a temp dir)")
        if self.evict_priority not in EVICT_PRIORITIES:
            raise ValueError(
                f"evict_priority must be one of {', '.join(EVICT_PRIORITIES)} (got {self.evict_priority!r})"
            )
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be positive (got {self.ttl_s!r})")


@dataclass
class OnlineConfig:
    """The online trainer inside the server: feedback -> mini-batches -> LoRA steps -> published adapter versions."""

    enabled: bool = True  # False: feedback is still logged, nothing trains
    # Learning a correction from one or two: a burst of corrections trains as one batch, for up to 8 steps at 2e-3
    # until each one's loss is under 0.2, the adapter kept out of ordinary chat's directions (protect_energy). At
    # 2e-4, one step a batch, 0 of 10 invented facts were learned after two corrections each (docs/benchmarks.md,
    # "Learning a correction with the defaults").
    batch_size: int = 16  # feedback samples per optimizer step
    # One API key's entries take at most this share of a batch's places while other keys' feedback waits (its
    # excess waits for later batches, never dropped; with no one else waiting it fills the batch). 1: no cap.
    key_share: float = 0.5
    max_wait_s: float = 10.0  # train a smaller batch once its oldest feedback waited this long
    epochs: int = 8  # optimizer steps over each mini-batch at most (fewer once its corrections reach target_loss)
    # Steps on a mini-batch go on (up to ``epochs``) while a correction's loss (mean per token) is above this;
    # 0: always ``epochs`` steps.
    target_loss: float = 0.2
    lr: float = 2e-3
    max_grad_norm: float = 1.0
    max_staleness: int = 4  # adapter versions a record may lag behind and still be replayed (0: exact only)
    replay: bool = True  # False: recompute every prompt (the separate-trainer baseline, for benchmarks)
    prefetch_depth: int = 2  # record layers read ahead of the replay walk (from host memory or disk)
    # Samples (feedback and anchors) trained in one pass, their rows through each layer together: faster per
    # sample (docs/profiles/group_step.py), and a slice (a layer of a replay walk) takes that much longer. 8 trained
    # faster than 4 in `bench online`, but serving's TPOT met its goal less often with 8: serving has priority
    # (docs/benchmarks.md, "Why the defaults").
    group_size: int = 4
    # ... and at most this many rows (prompt + response tokens) in a group, unless one sample alone has more: a
    # slice is a layer of a group's pass, so this bounds how long serving waits for one (docs/benchmarks.md,
    # "Why the defaults"). 0: no limit.
    group_max_tokens: int = 2048
    lora_r: int = 16
    lora_alpha: float = 32.0
    # The adapter's A stays orthogonal to the directions holding this share of ordinary chat's inputs at each seam
    # (alchemist.training.protected): corrections are learned without moving unrelated answers as much. 0: off.
    protect_energy: float = 0.97
    keep_versions: int = 8  # adapter versions kept on disk (rollback targets)
    # Share of the machine's time training may take while requests are being served (time-sliced, never
    # concurrent: design note, section 12). With no request in flight, training takes whatever is free.
    train_share: float = 0.2
    # While serving is busy, training's credit may be spent in turns of up to this long (slices back to back)
    # instead of a slice after every engine step (0, the default): a replay trains faster under load in turns, but
    # serving's TPOT measured worse with them (docs/benchmarks.md, "Why the defaults"). A request that
    # arrives ends a turn.
    train_quantum_s: float = 0.0
    seed: int = 0  # the adapter's initialisation
    # Each step also minimises anchor_weight x KL(base || adapted) on the responses of the anchor_samples most
    # recent served completions (top-k of the base distribution; alchemist.training.anchors). 0 disables.
    anchor_weight: float = 3.0
    anchor_samples: int = 16
    anchor_top_k: int = 32
    anchor_max_tokens: int = 64  # an anchor is its response's first tokens (a sample of the KL's positions)
    anchor_pool_size: int = 256  # served completions kept as candidate anchors
    # Poisoning guard (alchemist.training.quarantine): a sample whose loss is NaN/inf, or above this factor x the
    # running level of accepted losses (after loss_spike_warmup of them), is held in quarantine, not trained.
    # 0: finiteness only.
    # 4: a correction of random characters had about 4x the loss of sensible ones on SmolLM2 (tests/server/
    # test_poisoning.py, where the factor is 3).
    loss_spike_factor: float = 4.0
    loss_spike_warmup: int = 8
    # The evaluation gate (alchemist.training.evaluation): a new version serves only if held-out perplexity rose at
    # most gate_heldout_max_rise over the base model's, no canary answer lost more than gate_canary_max_drop nats of
    # log-probability against the base model (nor all of them gate_canary_max_mean_drop on average), and no fact
    # taught earlier (the gate_taught_samples most recent corrections trained) more than gate_taught_max_rise nats
    # per token against the serving version.
    gate: bool = True
    gate_heldout_max_rise: float = 0.10
    gate_canary_max_drop: float = 6.0  # any one canary's (the mean's bound: gate_canary_max_mean_drop)
    gate_canary_max_mean_drop: float = 3.0
    gate_taught_max_rise: float = 1.0
    gate_taught_samples: int = 16
    # Watching what serves (alchemist.training.regression): when the thumbs-down rate of the versions served from
    # some version on exceeds that of the versions before it by rollback_margin, at rollback_z (one-sided two-
    # proportion z-test), with rollback_min_ratings on each side, serving goes back to the version before.
    # One key counts for at most key_share of those ratings. rollback_min_ratings 0 disables it.
    rollback_min_ratings: int = 30
    rollback_margin: float = 0.15
    rollback_z: float = 3.0
    # The objectives (alchemist.training.objectives): corrections by SFT, ratings without a correction by KTO,
    # preference pairs by DPO, mixed in one step; each weighs its mean loss. The reference is the base model.
    sft_weight: float = 1.0
    kto_weight: float = 1.0
    dpo_weight: float = 1.0
    kto_beta: float = 0.1
    dpo_beta: float = 0.1
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0
    thumbs_up: str = "kto"  # a thumbs-up without a correction: KTO-desirable ("kto") or SFT on the served answer
    # The backlog policy: a rating or preference still untrained this long after it arrived is skipped (its state
    # says why); corrections are skipped after skip_corrections_after_s (0: never). 0 disables either.
    skip_ratings_after_s: float = 1800.0
    skip_corrections_after_s: float = 0.0

    @property
    def per_key(self) -> int | None:
        """The most places of a batch one key takes while others wait (None: no cap)."""
        return None if self.key_share >= 1.0 else max(1, int(self.key_share * self.batch_size))

    def __post_init__(self) -> None:
        _check_positive(self, "batch_size", "epochs", "group_size", "lora_r", "keep_versions")
        for name in ("sft_weight", "kto_weight", "dpo_weight", "kto_desirable_weight", "kto_undesirable_weight",
                     "skip_ratings_after_s", "skip_corrections_after_s"):  # fmt: skip
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)!r})")
        for name in ("kto_beta", "dpo_beta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive (got {getattr(self, name)!r})")
        if self.thumbs_up not in ("kto", "sft"):
            raise ValueError(f"thumbs_up must be 'kto' or 'sft' (got {self.thumbs_up!r})")
        _check_positive(self, "anchor_samples", "anchor_top_k", "anchor_max_tokens", "anchor_pool_size")
        if not 0.0 <= self.protect_energy < 1.0:
            raise ValueError(f"protect_energy must be in [0, 1) (got {self.protect_energy!r})")
        if (
            not isinstance(self.group_max_tokens, int)
            or isinstance(self.group_max_tokens, bool)
            or self.group_max_tokens < 0
        ):
            raise ValueError(f"group_max_tokens must be an integer >= 0 (got {self.group_max_tokens!r})")
        if not self.loss_spike_factor >= 0:
            raise ValueError(f"loss_spike_factor must be >= 0 (got {self.loss_spike_factor!r})")
        if not self.anchor_weight >= 0:
            raise ValueError(f"anchor_weight must be >= 0 (got {self.anchor_weight!r})")
        for name in ("gate_heldout_max_rise", "gate_canary_max_drop", "gate_canary_max_mean_drop",
                     "gate_taught_max_rise"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive (got {getattr(self, name)!r})")
        if not isinstance(self.gate_taught_samples, int) or self.gate_taught_samples < 0:
            raise ValueError(f"gate_taught_samples must be an integer >= 0 (got {self.gate_taught_samples!r})")
        if not isinstance(self.rollback_min_ratings, int) or self.rollback_min_ratings < 0:
            raise ValueError(f"rollback_min_ratings must be an integer >= 0 (got {self.rollback_min_ratings!r})")
        for name in ("rollback_margin", "rollback_z"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)!r})")
        if not 0.0 < self.key_share <= 1.0:
            raise ValueError(f"key_share must be in (0, 1] (got {self.key_share!r})")
        if not self.target_loss >= 0:
            raise ValueError(f"target_loss must be >= 0 (got {self.target_loss!r})")
        if not self.max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0 (got {self.max_wait_s!r})")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive (got {self.lr!r})")
        if not self.max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm must be >= 0 (got {self.max_grad_norm!r})")
        if not (isinstance(self.prefetch_depth, int) and self.prefetch_depth >= 0):
            raise ValueError(f"prefetch_depth must be an integer >= 0 (got {self.prefetch_depth!r})")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness must be a non-negative integer (got {self.max_staleness!r})")
        if not 0.0 <= self.train_share < 1.0:
            raise ValueError(f"train_share must be in [0, 1) (got {self.train_share!r})")
        if not 0.0 <= self.train_quantum_s <= 1.0:
            raise ValueError(f"train_quantum_s must be in [0, 1] (got {self.train_quantum_s!r})")


@dataclass
class ServerConfig:
    """The OpenAI-compatible HTTP server: where it listens, the model's public name, and its guards."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the model file's or directory's stem
    max_body_bytes: int = 1 << 20  # larger request bodies get a 413
    max_completions_kept: int = 10_000  # finished completions kept by response id, for feedback
    completion_ttl_s: float = 24 * 3600.0  # ... and for how long
    data_dir: str = "alchemist-data"  # the server's durable state (feedback log, adapters); created at start-up
    feedback_db: str | None = None  # the feedback log's SQLite file; None: <data_dir>/feedback.sqlite
    # API keys (alchemist.server.auth): one admin key, and/or a file of named, hashed user and admin keys. Without
    # either the server is open to whoever reaches it, so it binds a loopback address only, unless told otherwise.
    api_key: str | None = None
    api_keys_file: str | None = None
    allow_unauthenticated: bool = False  # bind a non-loopback address without keys
    metrics_access: str = "admin"  # /metrics: "public", or an admin key (when keys are configured)
    docs_access: str = "admin"  # /docs and /openapi.json: the same choice
    # Limits of every key (a key's entry in the keys file may set its own; alchemist.server.limits); 0: no limit.
    # Callers without a key (no keys configured: loopback only) are not limited.
    requests_per_minute: float = 0.0  # completion requests
    feedback_per_minute: float = 0.0
    max_streams_per_key: int = 0  # streaming completions open at once
    record_mb_per_hour: float = 2048.0  # prompt records a key's {"alchemist": {"record": true}} may ask for

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in 0..65535 (got {self.port!r})")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty")
        _check_positive(self, "max_body_bytes", "max_completions_kept")
        if not self.completion_ttl_s > 0:
            raise ValueError(f"completion_ttl_s must be positive (got {self.completion_ttl_s!r})")
        self.data_dir = str(self.data_dir)  # a Path is welcome too
        if not self.data_dir.strip():
            raise ValueError("data_dir must not be empty")
        if self.feedback_db is not None:
            self.feedback_db = str(self.feedback_db)
            if not self.feedback_db.strip():
                raise ValueError("feedback_db must not be empty (None: <data_dir>/feedback.sqlite)")

        for name in ("requests_per_minute", "feedback_per_minute", "max_streams_per_key", "record_mb_per_hour"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit; got {getattr(self, name)!r})")
        for name in ("metrics_access", "docs_access"):
            if getattr(self, name) not in ACCESS_CHOICES:
                raise ValueError(f"{name} must be one of {', '.join(ACCESS_CHOICES)} (got {getattr(self, name)!r})")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if not self.has_keys and not self.allow_unauthenticated and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve {self.host} without API keys: anyone who reaches it could train and roll back "
                "the model. Give --api-key or --api-keys-file, or --allow-unauthenticated if that is what you want"
            )

    @property
    def has_keys(self) -> bool:
        return bool(self.api_key) or self.api_keys_file is not None

    @property
    def feedback_db_path(self) -> str:
        return self.feedback_db if self.feedback_db is not None else os.path.join(self.data_dir, "feedback.sqlite")
