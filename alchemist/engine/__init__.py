"""The serving engine: continuous batching over a per-slot KV cache with block accounting (docs/architecture.md)."""

from alchemist.engine.engine import LLMEngine, QueueFullError
from alchemist.engine.output import EngineStats, RequestOutput, RequestTimings
from alchemist.engine.sequence import SamplingParams, TokenLogprobs

__all__ = [
    "EngineStats",
    "LLMEngine",
    "QueueFullError",
    "RequestOutput",
    "RequestTimings",
    "SamplingParams",
    "TokenLogprobs",
]
