"""The latency objective: the TPOT and TTFT serving keeps to, set by the user or derived from this machine at start-up.

    objective = resolve_objective(engine)       # the runtime's build, before the stepping loop starts
    objective.tpot_s, objective.ttft_s          # training yields to them (alchemist.runtime.time_share); the engine
                                                # caps prefill beside decodes by the TPOT (alchemist.engine.scheduler)

``--slo-tpot-ms`` and ``--slo-ttft-ms`` (``EngineConfig.slo_tpot_s`` / ``slo_ttft_s``) set them; 0 derives them
from unloaded engine steps measured here (``LLMEngine.probe``), so that the defaults fit the machine and the model:

- TPOT = ``TPOT_MARGIN`` (1.10) x the median decode step of ``PROBE_BATCH`` (8) requests decoding together: serving
  at a modest load, 10% slower at most with training beside it (issue 42's goal for TPOT p50, training on vs off);
  under a load whose steps outgrow it, training may still add 10% of each step (``step_share``);
- TTFT = ``TTFT_MARGIN`` (1.10) x the prefill of one full chunk (``max_num_batched_tokens`` tokens, after the decode
  steps) + the TPOT: a prompt of one chunk arriving during a step waits for that step, then runs alone.

The probe takes about a second on the default model on a 2-core CPU; its steps also seed the engine's step cost
estimate (``alchemist.engine.step_cost``).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

import torch

from alchemist.engine import LLMEngine

logger = logging.getLogger(__name__)

TPOT_MARGIN = 1.10
TTFT_MARGIN = 1.10
PROBE_BATCH = 8  # requests decoding together in the probe (at most max_num_seqs)
PROBE_PROMPT_TOKENS = 8
PROBE_DECODE_STEPS = 8  # decode steps of the probe's batch; the first is left out of the median (warm-up)


@dataclass(frozen=True)
class LatencyObjective:
    tpot_s: float  # time per output token: an engine step plus the training that may run before the next
    ttft_s: float  # time to first token: no training slice while a request waiting for its first would miss it
    # ... and, where the TPOT was derived, training may add this fraction of any step, even one over it: the probe's
    # unloaded steps are shorter than steps under load (ShareGPT at 1 request a second on an AMX Xeon: 44 ms against
    # a 35 ms objective), where training otherwise got 1% of the time (docs/benchmarks.md, "Training beside a light
    # load"). A TPOT set by hand is kept as it is.
    step_share: float = 0.0


def resolve_objective(engine: LLMEngine) -> LatencyObjective:
    """The objective of the engine's config, its zeros derived from probe steps; the engine's prefill cap is set to
    its TPOT. Run it in the thread that steps the engine (build does, before the loop starts)."""
    config = engine.config
    tpot_s, ttft_s = config.slo_tpot_s, config.slo_ttft_s
    how, step_share = "set", 0.0 if tpot_s else TPOT_MARGIN - 1
    if not (tpot_s and ttft_s):
        decode_s, prefill_s = measure_unloaded(engine)
        tpot_s = tpot_s or TPOT_MARGIN * decode_s
        ttft_s = ttft_s or TTFT_MARGIN * prefill_s + tpot_s
        how = f"derived: unloaded decode step {decode_s * 1e3:.1f} ms, prefill of a chunk {prefill_s * 1e3:.1f} ms"
    objective = LatencyObjective(tpot_s, ttft_s, step_share)
    engine.set_tpot_objective(objective.tpot_s)
    logger.info("latency objective: TPOT %.1f ms, TTFT %.1f ms (%s)", tpot_s * 1e3, ttft_s * 1e3, how)
    return objective


def measure_unloaded(engine: LLMEngine) -> tuple[float, float]:
    """(a decode step of the probe batch, the prefill of a full chunk) in seconds, on the engine as it is now."""
    c = engine.config
    assert c.max_model_len is not None and c.num_kv_blocks is not None
    generator = torch.Generator().manual_seed(0)  # distinct prompts: none is served from the prefix cache
    vocab = engine.model.config.vocab_size

    def prompts(count: int, length: int) -> list[list[int]]:
        return torch.randint(0, vocab, (count, length), generator=generator).tolist()

    batch = min(PROBE_BATCH, c.max_num_seqs)
    steps = engine.probe(prompts(batch, PROBE_PROMPT_TOKENS), max_tokens=PROBE_DECODE_STEPS + 1)
    decodes = [s for d, p, s in steps if p == 0 and d > 0]
    full = [s for d, p, s in steps if p == 0 and d == batch][1:]  # a preemption (a small KV pool) shrinks a batch
    decode_s = statistics.median(full or decodes)
    chunk = min(c.max_num_batched_tokens, c.max_model_len - 1, c.num_kv_blocks * c.block_size)
    # One prefill: after the decode steps above it takes what a second one would (docs/benchmarks.md, "The start-up
    # probe"), and the faster of two cost a chunk's prefill at every start.
    prefill_s = _prefill_s(engine.probe(prompts(1, chunk), max_tokens=1))
    return decode_s, prefill_s


def _prefill_s(steps: list[tuple[int, int, float]]) -> float:
    return sum(s for _, p, s in steps if p > 0)
