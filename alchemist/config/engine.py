"""The serving engine's section: model, numerics, and the sizes of the KV cache, the batch and the queue."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Literal

from alchemist.config.fields import (
    MS,
    check,
    check_choice,
    check_non_negative,
    check_positive_ints,
    choices_of,
    flag,
    run_checks,
)

# Without a user setting, the context is capped here even where the model allows more: the per-slot cache is
# reserved for max_num_seqs x max_model_len tokens, and ShareGPT-like chats fit well inside it.
DEFAULT_MAX_MODEL_LEN = 4096


@dataclass
class EngineConfig:
    """The serving engine: model, numerics, KV cache and batch sizes."""

    model: Annotated[str | None, flag("model", "HF model directory or .gguf file (None: SmolLM2-135M-Instruct)")] = None
    dtype: Annotated[Literal["auto", "float32", "bfloat16"],
                     flag("dtype", "auto: bf16 where this CPU/GPU runs it fast, else fp32")] = "auto"  # fmt: skip
    device: Annotated[Literal["auto", "cpu", "cuda"], flag("device", "auto: cuda when visible")] = "auto"
    # KV-cache slots: sequences running at once. 32: a 2-core CPU's decode throughput still nearly doubles from batch
    # 8 to 32 (docs/benchmarks.md, "Decode step"), and the cache is resident only as far as it is used (KVCache).
    max_num_seqs: Annotated[int, flag("max-num-seqs", "sequences running at once (KV-cache slots)")] = 32
    max_model_len: Annotated[int | None, flag("max-model-len", "context length (None: min(model's, 4096))")] = None
    block_size: Annotated[int, flag("block-size", "tokens per KV block (the unit of cache accounting)")] = 16
    num_kv_blocks: Annotated[int | None,
                             flag("num-kv-blocks", "KV block pool (None: every slot can fill; less preempts)")] = None
    max_num_batched_tokens: Annotated[int,
                                      flag("max-num-batched-tokens", "tokens per step (prefill chunk size)")] = 512
    max_waiting: Annotated[int, flag("max-waiting", "requests queued beyond this get a 429")] = 256
    # The latency objective: serving's promise, which training yields to (alchemist.runtime.time_share) and which
    # sizes the prefill chunks run beside decodes (alchemist.engine.scheduler). 0: derived at start-up from the
    # unloaded steps this machine measures (alchemist.runtime.objective says how).
    slo_tpot_s: Annotated[float, flag("slo-tpot-ms", "time per output token serving keeps to: training waits "
                                      "and prefill chunks shrink to hold it (0: derived at start-up)"),
                          MS] = 0.0  # fmt: skip
    slo_ttft_s: Annotated[float, flag("slo-ttft-ms", "time to first token: no training slice while a waiting "
                                      "request would miss it (0: derived at start-up)"), MS] = 0.0  # fmt: skip
    # Forwards that record nothing serve the adapter merged into the weights (alchemist.engine.merged_adapter):
    # no per-token cost, one more copy of the targeted weights in memory.
    merge_adapter: Annotated[bool, flag("merge-adapter", "serve the adapter merged into the weights (else a "
                                        "separate delta: saves a weight copy)")] = True  # fmt: skip
    # Prompts start after the longest prefix of full blocks whose keys/values a slot still holds, computed under the
    # adapter version served (alchemist.engine.prefix_cache); recorded prompts are computed whole.
    enable_prefix_caching: Annotated[bool, flag("enable-prefix-caching", "reuse cached prompt prefixes")] = True
    # A taught correction serves the requests that hold at least this share of a taught prompt's rare words
    # (alchemist.engine.router; docs/benchmarks.md, "Learning a correction with the defaults").
    route_threshold: Annotated[float, flag("route-threshold", "serve the corrections' ranks to prompts holding this "
                               "share of a taught prompt's rare words (0: to every prompt)")] = 0.5  # fmt: skip
    # Decode steps through the compiled layer (alchemist.engine.compiled_decode): None where it was measured faster
    # (bf16 with our CPU decode kernel), True wherever it can run, False never (--enforce-eager).
    compile_decode: Annotated[bool | None, flag("compile-decode", "decode through the compiled layer: None where "
                              "measured faster, True wherever it runs, False never (--enforce-eager)")] = (
        None  # fmt: skip
    )

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            self.model = str(self.model)  # a Path is welcome too
        run_checks(self)

    def check(self) -> None:
        check_choice(self, "dtype", choices_of(EngineConfig, "dtype"))
        check_choice(self, "device", choices_of(EngineConfig, "device"))
        check_positive_ints(self, "max_num_seqs", "max_model_len", "block_size", "num_kv_blocks",
                            "max_num_batched_tokens", "max_waiting")  # fmt: skip
        # Every running sequence decodes one token per step: all of them must fit in one step's budget.
        check(self, self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
              f"must be at least max_num_seqs ({self.max_num_seqs})")  # fmt: skip
        check(self, 0.0 <= self.route_threshold <= 1.0, "route_threshold", "must be in [0, 1]")
        check_non_negative(self, "slo_tpot_s", "slo_ttft_s")
        for name in ("merge_adapter", "enable_prefix_caching"):
            check(self, isinstance(getattr(self, name), bool), name, "must be a bool")
        check(self, self.compile_decode is None or isinstance(self.compile_decode, bool), "compile_decode",
              "must be a bool or None")  # fmt: skip

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


DTYPE_CHOICES = choices_of(EngineConfig, "dtype")
DEVICE_CHOICES = choices_of(EngineConfig, "device")
