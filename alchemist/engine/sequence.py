"""One request inside the engine: its tokens, sampling parameters, cache placement, progress and timings.

A ``Sequence`` holds prompt and output ids in one list (``token_ids``). Its progress is a single number,
``num_computed_tokens``: how many of ``token_ids`` have their keys/values in the cache. Each step computes the
next chunk ``token_ids[num_computed_tokens:]`` (a prefill chunk, or the one token sampled last step) and, when
that reaches the end of the list, samples a token. A sequence admitted on a prefix-cache hit starts past the
cached tokens. A preempted sequence restarts at 0 (or at a hit) and so recomputes its prompt and the outputs so
far, then continues where it stopped.

A sequence names the adapter that serves it (``adapter_name``): None, the shared adapter (whichever is set, the base
model if none); ``BASE``, the base model whatever is set; any other name, an adapter the engine holds by that name
(``LLMEngine.set_adapter``). Its ``adapter_version`` is that adapter's version when its prefill started.

State changes go through the named methods below (``admit``, ``advance``, ``append_token``, ``preempt``,
``finish``); the scheduler and block manager call them, nothing else writes the fields.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from alchemist.model.tokenizer import IncrementalDetokenizer

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
SAMPLING_EPS = 1e-5  # a temperature under this samples greedily (vLLM's _SAMPLING_EPS)
SEED_MODULUS = 1 << 64  # torch.Generator seeds are 64-bit; any int seed maps onto one
# The adapter name a request gives to be served by the base model alone (no adapter may be set under it).
BASE = "base"


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Bad values raise ValueError naming the field."""

    max_tokens: int | None = None  # None: up to the context length (max_model_len)
    min_tokens: int = 0  # no stop token or stop string ends the request before this many output tokens
    temperature: float = 1.0  # 0: greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None  # same seed, same tokens, whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # finish before the first occurrence (not included)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the chosen token's logprob and the k most likely
    record: bool = False  # ask for this prompt's prefill activations to be recorded for training

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None (got {self.max_tokens!r})")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0 (got {self.min_tokens!r})")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (got {self.temperature!r})")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, 0 meaning no limit (got {self.top_k!r})")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None (got {self.seed!r})")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings (got {self.stop!r})")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0 (got {self.stop_token_ids!r})")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool (got {self.ignore_eos!r})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in 0..{MAX_LOGPROBS} (got {self.logprobs!r})")
        if not isinstance(self.record, bool):
            raise ValueError(f"record must be a bool (got {self.record!r})")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or under ``SAMPLING_EPS`` as in vLLM: so sharp a distribution is argmax's, and a temperature
        under float32's range (1e-300 is 0 there) would divide the logits by zero."""
        return self.temperature < SAMPLING_EPS


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (of the model's distribution, before temperature/top-k/top-p) for one sampled token."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely (token id, logprob), best first


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        detokenizer: IncrementalDetokenizer,
        arrival_s: float,
        device: torch.device,
        adapter_name: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self._prompt_ids = list(prompt_ids)  # kept apart so outputs can share it without a copy per step
        self.params = params
        self.max_tokens = max_tokens  # params.max_tokens, or what the context leaves
        self.status = SequenceStatus.WAITING
        self.slot: int | None = None
        self.block_ids: list[int] = []  # owned by the BlockManager
        self.num_computed_tokens = 0
        self.record = False  # record the prompt's prefill activations (the engine's recording policy decides)
        self.routed = False  # served the corrections' ranks (alchemist.engine.router decides, at arrival)
        self.adapter_name = adapter_name  # the adapter serving it: None the shared one, BASE none, else by name
        self.adapter_version = 0  # of that adapter when its prefill (the latest, after a preemption) started
        self.finish_reason: str | None = None
        # Sampling state: one generator per request so its draws do not depend on its batch neighbours.
        self.generator: torch.Generator | None = None
        if not params.is_greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed % SEED_MODULUS)
        # Output state: text so far (untruncated) and how much of it has been handed out.
        self.detokenizer = detokenizer
        self.text = ""
        self.num_text_sent = 0
        self.pending_token_ids: list[int] = []  # sampled since the last RequestOutput
        self.pending_logprobs: list[TokenLogprobs] = []
        # Timings (time.monotonic seconds).
        self.arrival_s = arrival_s
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.finished_s: float | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, slot={self.slot}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )

    # --- views ------------------------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed through the model before the next sample (1 while decoding)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def chunk(self, num_tokens: int) -> list[int]:
        """The next ``num_tokens`` ids to compute."""
        return self.token_ids[self.num_computed_tokens : self.num_computed_tokens + num_tokens]

    # --- transitions --------------------------------------------------------------------------------------------

    def admit(self, slot: int, now_s: float, num_cached_tokens: int = 0, adapter_version: int = 0) -> None:
        """WAITING -> RUNNING in ``slot`` (the block manager has reserved it), whose first ``num_cached_tokens``
        keys/values are already cached (a prefix-cache hit, computed under ``adapter_version``: its prefill so
        starts with that version)."""
        assert self.status is SequenceStatus.WAITING and self.num_computed_tokens == 0
        self.status = SequenceStatus.RUNNING
        self.slot = slot
        if num_cached_tokens:
            assert num_cached_tokens < self.num_tokens
            self.num_computed_tokens = num_cached_tokens
            self.adapter_version = adapter_version
        if self.first_scheduled_s is None:
            self.first_scheduled_s = now_s

    def advance(self, num_tokens: int, adapter_version: int = 0) -> None:
        """``num_tokens`` more tokens now have their keys/values in the cache, computed with that adapter.

        A chunk from position 0 starts the prompt's prefill (or its recomputation after a preemption): its
        adapter version becomes the sequence's, as it does the prompt record's.
        """
        if self.num_computed_tokens == 0:
            self.adapter_version = adapter_version
        self.num_computed_tokens += num_tokens
        assert self.num_computed_tokens <= len(self.token_ids)

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None, now_s: float) -> None:
        self.token_ids.append(token_id)
        self.pending_token_ids.append(token_id)
        if logprobs is not None:
            self.pending_logprobs.append(logprobs)
        if self.first_token_s is None:
            self.first_token_s = now_s

    def preempt(self) -> None:
        """RUNNING -> WAITING; its cache is gone, so everything computed so far will be recomputed."""
        assert self.status is SequenceStatus.RUNNING
        self.status = SequenceStatus.WAITING
        self.slot = None
        self.num_computed_tokens = 0

    def add_text(self, delta: str) -> None:
        self.text += delta

    def truncate_text(self, length: int) -> None:
        """Cuts the text at a stop string (text already handed out is never taken back)."""
        assert length >= self.num_text_sent
        self.text = self.text[:length]

    def take_new_text(self, hold_back: int) -> str:
        """Text not yet handed out, except the last ``hold_back`` characters (a stop string may be starting
        there) while the sequence runs; everything once it is finished."""
        end = len(self.text) if self.is_finished else max(self.num_text_sent, len(self.text) - hold_back)
        new_text = self.text[self.num_text_sent : end]
        self.num_text_sent = end
        return new_text

    def take_new_tokens(self) -> tuple[list[int], list[TokenLogprobs]]:
        """Ids (and logprobs) sampled since the last call."""
        tokens, logprobs = self.pending_token_ids, self.pending_logprobs
        self.pending_token_ids, self.pending_logprobs = [], []
        return tokens, logprobs

    def finish(self, reason: str, now_s: float) -> None:
        assert reason in ("stop", "length", "abort")
        self.status = SequenceStatus.FINISHED
        self.slot = None
        self.finish_reason = reason
        self.finished_s = now_s
