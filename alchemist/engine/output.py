"""What the engine hands back each step: per-request progress, and engine-wide stats for metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from alchemist.engine.sequence import Sequence, TokenLogprobs


@dataclass(frozen=True)
class RequestTimings:
    """Seconds, measured with ``time.monotonic`` from the request's arrival (``add_request``)."""

    queue_s: float  # arrival -> first scheduled
    ttft_s: float  # arrival -> first output token
    tpot_s: float  # mean time per output token after the first (0 with a single token)
    e2e_s: float  # arrival -> finished

    @classmethod
    def of(cls, seq: Sequence) -> RequestTimings:
        assert seq.finished_s is not None
        arrival = seq.arrival_s
        scheduled = seq.first_scheduled_s if seq.first_scheduled_s is not None else seq.finished_s
        first = seq.first_token_s if seq.first_token_s is not None else seq.finished_s
        n = seq.num_output_tokens
        return cls(
            queue_s=scheduled - arrival,
            ttft_s=first - arrival,
            tpot_s=(seq.finished_s - first) / (n - 1) if n > 1 else 0.0,
            e2e_s=seq.finished_s - arrival,
        )


@dataclass(frozen=True)
class RequestOutput:
    """One request's progress in one step (only requests that progressed, finished or were aborted get one)."""

    request_id: str
    new_token_ids: list[int]  # sampled this step
    new_text: str  # the text those tokens add (a stop string and what follows it are never included)
    text: str  # all text handed out so far (the concatenation of every new_text)
    output_token_ids: list[int]  # all sampled so far (a copy)
    prompt_token_ids: list[int]
    adapter_version: int  # of the adapter its prefill started with (0: the base model, or not prefilled yet)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    logprobs: list[TokenLogprobs] | None  # one per new token, when the request asked for logprobs
    timings: RequestTimings | None  # when finished
    adapter_name: str | None = None  # the adapter it named (None: the shared one; ``sequence.BASE``: none)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics. Counters are totals since the engine started."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held, 0..1
    num_prompt_tokens: int  # prompt tokens prefilled (each request counted once, recomputation not)
    num_generation_tokens: int  # tokens sampled
    num_preemptions: int
    num_finished: int  # requests finished (any reason, aborts included)
    activation_bytes: int = 0  # bytes of recorded activations held by the store
    activation_tier_bytes: dict[str, int] = field(default_factory=dict)  # per tier ("device", "host", "disk")
    activation_records: int = 0  # records held by the store
    num_recorded: int = 0  # prompt records completed and stored
    num_prefix_cache_queries: int = 0  # tokens of admitted sequences looked up in the prefix cache (vLLM's count)
    num_prefix_cache_hits: int = 0  # of those, tokens whose keys/values came from the cache
