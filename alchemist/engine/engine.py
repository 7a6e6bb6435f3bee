"""The serving engine: requests in, tokens out, one batched step at a time.

    engine = LLMEngine.from_config(EngineConfig())               # or LLMEngine(model, tokenizer, config)
    engine.add_request("r1", tokenizer.encode("Hello"), SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.new_text, out.finished)

``step()`` is schedule -> run -> sample -> postprocess. Nothing here knows about HTTP.

Threads: ``step()`` runs in one thread (see below: the main one); ``add_request`` and ``abort`` may be called from
any other thread at the same time. They only validate and put the operation on a pending queue (under a small
lock), which ``step()`` drains before it schedules; ``abort`` additionally applies it at once when no step is in
progress, so a caller that is not stepping sees the slot and blocks freed on return.

Adapters: ``set_adapter(adapter, version)`` (any thread) serves a LoRA adapter as the shared one from the start of
the next step, ``set_adapter(None, 0)`` the base model again. It serves a frozen copy taken in the caller's thread,
so the trainer may go on updating its own adapter in place; its merge into the weights is then made over the next
steps, a layer per step (``alchemist.engine.merged_adapter``). The thread that steps the engine may instead make the
merge itself, between its steps, before the swap: ``set_adapter_slices`` (the online trainer publishes so, on
training's time). A request in flight at a swap continues with the new adapter from the next step, but its prompt
record and its outputs' ``adapter_version`` keep the version its prefill started with (the oldest it saw; a
preemption restarts the prefill, and the version). Prefix-cache blocks are keyed by the adapter's name and that
version (``alchemist.engine.prefix_cache``), so none computed under one adapter serves another.

Named adapters (an adapter per user or team): ``set_adapter(adapter, version, name="team-a")`` serves another
adapter beside the shared one, under a name, from the next step (again: a new version; requests in flight continue
with it), and ``remove_adapter(name)`` takes it away: requests that name it are refused from then on, and those
already added finish with it. A request names its adapter (``add_request``'s ``adapter_name``): None, the shared
one; ``BASE`` ("base"), the base model alone; else a name set, or ValueError. Named adapters are served as deltas,
never merged; a step may hold rows of several adapters (``alchemist.engine.adapter_rows``), and one whose rows all
have the same adapter runs as it did when the engine served one.

Latency: each step's time teaches ``step_cost`` (``alchemist.engine.step_cost``); with a TPOT objective
(``set_tpot_objective``, or ``EngineConfig.slo_tpot_s``) a step's prefill beside decodes is capped to what fits in it
(``alchemist.engine.scheduler``), or, where the decodes alone outlast it, to what lasts ``OVER_OBJECTIVE_STRETCH``
times their time. ``probe`` measures unloaded steps, leaving no other trace (the runtime derives the
objective from them at start-up).

Run ``step()`` in the thread that ran torch's first parallel op (normally the main thread, which loaded the
model), and run no torch work in other threads: each thread that runs OpenMP regions gets its own team, and
with more OpenMP threads than cores libgomp stops spin-waiting, so every parallel region of a step pays a wake-up
(docs/benchmarks.md, "OpenMP and the stepping thread").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field

from alchemist.activations.recorder import Recorder
from alchemist.activations.store import ActivationStore
from alchemist.config import EngineConfig, RecordConfig
from alchemist.engine.block_manager import BlockManager
from alchemist.engine.merged_adapter import MergedLinearOps
from alchemist.engine.output import EngineStats, RequestOutput, RequestTimings
from alchemist.engine.router import Router
from alchemist.engine.runner import ModelRunner
from alchemist.engine.sampler import Sampler
from alchemist.engine.scheduler import ScheduledBatch, Scheduler
from alchemist.engine.sequence import BASE, SamplingParams, Sequence
from alchemist.engine.served_adapter import ServedAdapter
from alchemist.engine.step_cost import StepCost
from alchemist.engine.stop import StopChecker
from alchemist.model.llama import Llama
from alchemist.model.loader import load_model
from alchemist.model.lora import LoraAdapter, part_shapes
from alchemist.model.tokenizer import IncrementalDetokenizer, Tokenizer

# A step beside decodes that alone outlast the TPOT objective may still prefill for half their time: held to the
# scheduler's minimum instead, 32 decodes on an AMX Xeon left prompts waiting seconds and throughput fell a fifth
# (docs/benchmarks.md, "Serving against vLLM").
OVER_OBJECTIVE_STRETCH = 1.5


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests already (the server answers 429)."""


@dataclass
class _Pending:
    """Operations from other threads, applied at the start of the next step."""

    adds: list[Sequence] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    # the latest set_adapter or remove_adapter per adapter name (None: the shared adapter): (frozen copy, version,
    # its merge if already made: set_adapter_slices), or None for a removal
    adapters: dict[str | None, tuple[ServedAdapter | None, int, MergedLinearOps | None] | None] = field(
        default_factory=dict
    )


class LLMEngine:
    def __init__(
        self,
        model: Llama,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        record_config: RecordConfig | None = None,
        store: ActivationStore | None = None,
    ) -> None:
        """An engine over an already loaded model (``config.model``, ``dtype`` and ``device`` are then unused).

        Prompts are recorded per ``record_config`` (None: ``RecordConfig()``'s defaults, the same as `alchemist
        serve`'s; policy "none" records nothing) into ``store``: the runtime builds it and hands it to the trainer
        too. Without one the engine makes its own (offline use, tests).
        """
        self.config = (config or EngineConfig()).resolve(model.config.max_position_embeddings)
        c = self.config
        assert c.max_model_len is not None and c.num_kv_blocks is not None
        self.model = model
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(c.max_num_seqs, c.num_kv_blocks, c.block_size, c.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, c.max_num_seqs, c.max_num_batched_tokens)
        rc = record_config or RecordConfig()  # one default per setting: the config tree's
        self.store = store if store is not None else ActivationStore.from_config(rc)
        self.recorder = None
        if rc.policy != "none":
            self.recorder = Recorder(rc, self.store, model.config, model.device, compute_dtype=model.dtype)
        self.runner = ModelRunner(model, c, self.recorder)
        self.sampler = Sampler()
        self.stop_checker = StopChecker(tokenizer.eos_token_ids, c.max_model_len)
        self._seqs: dict[str, Sequence] = {}  # every request not yet finished, by id (pending ones included)
        self._pending = _Pending()
        self._lock = threading.Lock()  # guards _seqs and _pending: held briefly, never across a forward
        self._step_lock = threading.Lock()  # held while a step (or an abort applied at once) changes the queues
        self._aborted: list[RequestOutput] = []  # final outputs of aborted requests, for the next step
        self._names: dict[str, int] = {}  # named adapters a request may name now, with their versions (under _lock)
        self._retiring: set[str] = set()  # named adapters removed that sequences still name
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_finished = 0
        # The latency objective's TPOT (None: not set yet; the runtime derives it at start-up), which caps a step's
        # prefill beside decodes by what the step cost estimate fits in it (alchemist.engine.scheduler).
        self.tpot_objective_s: float | None = c.slo_tpot_s or None
        self.step_cost = StepCost()  # learned from every step
        self.last_step: tuple[int, int, float] | None = None  # (decode rows, prefill tokens, seconds)

    @classmethod
    def from_config(cls, config: EngineConfig, record_config: RecordConfig | None = None) -> LLMEngine:
        loaded = load_model(config.model, dtype=config.dtype, device=config.device)
        return cls(loaded.model, loaded.tokenizer, config, record_config)

    # --- requests (any thread) ------------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, adapter_name: str | None = None
    ) -> None:
        """Queues a request, served by the adapter ``adapter_name`` names (None: the shared one; ``BASE``: none).
        ValueError (naming the field) if it can never run; QueueFullError when full."""
        max_tokens = self._check_request(request_id, prompt_ids, params)
        seq = Sequence(
            request_id,
            prompt_ids,
            params,
            max_tokens,
            IncrementalDetokenizer(self.tokenizer, prompt_ids),
            arrival_s=time.monotonic(),
            device=self.model.device,
            adapter_name=adapter_name,
        )
        seq.record = self.recorder is not None and self.recorder.wants(params.record)
        with self._lock:
            if adapter_name not in (None, BASE) and adapter_name not in self._names:
                raise ValueError(
                    f"adapter_name {adapter_name!r} names no adapter (set: {sorted(self._names)}; None for the shared "
                    f"one, {BASE!r} for the base model)"
                )
            if request_id in self._seqs:
                raise ValueError(f"request_id {request_id!r} is already in use")
            if len(self._pending.adds) + len(self.scheduler.waiting) >= self.config.max_waiting:
                raise QueueFullError(f"{self.config.max_waiting} requests are waiting already (max_waiting)")
            self._seqs[request_id] = seq
            self._pending.adds.append(seq)

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its slot and blocks; unknown or finished ids are ignored.

        Its final RequestOutput (finish_reason "abort") comes with the next ``step()``.
        """
        with self._lock:
            self._pending.aborts.append(request_id)
        self._apply_pending_if_idle()

    def set_adapter(self, adapter: LoraAdapter | None, version: int, name: str | None = None) -> None:
        """Serves ``adapter`` (None: the base model) as ``version`` (0 for None, else >= 1) from the next step: as
        the shared adapter (``name`` None), or under ``name`` (an adapter, not None: ``remove_adapter`` takes a
        name away), which requests may name from now on.

        The copy is taken here, in the caller's thread: changes to ``adapter`` after this returns are not served.
        A version names one adapter's weights: keys/values cached under it (prefix caching) serve it again.
        """
        if name is None:
            self._queue_adapter(self._served(adapter, version), version, None)
            return
        if not isinstance(name, str) or not name or name == BASE:
            raise ValueError(f"name must be a non-empty string other than {BASE!r}, or None (got {name!r})")
        if adapter is None:
            raise ValueError(f"adapter must be a LoraAdapter for a name (to take {name!r} away: remove_adapter)")
        served = self._served(adapter, version)
        with self._lock:
            self._names[name] = version
            self._pending.adapters[name] = (served, version, None)
        self._apply_pending_if_idle()

    def remove_adapter(self, name: str) -> None:
        """Takes the adapter set under ``name`` away: requests that name it are refused from now on; those added
        already finish with it (it is dropped when none is left). ValueError if no adapter has that name."""
        with self._lock:
            if not isinstance(name, str) or name not in self._names:
                raise ValueError(f"name {name!r} names no adapter (set: {sorted(self._names)})")
            del self._names[name]
            self._pending.adapters[name] = None
        self._apply_pending_if_idle()

    @property
    def named_adapters(self) -> dict[str, int]:
        """The adapters requests may name now (``set_adapter``'s names, pending ones included), with their
        versions."""
        with self._lock:
            return dict(self._names)

    def set_adapter_slices(self, adapter: LoraAdapter, version: int) -> Generator[None, None, None]:
        """``set_adapter`` for the thread that steps the engine, in slices: the merge into the weights is made here,
        a layer per slice (a generator: the caller runs other work, engine steps, between them), and served whole
        from the first step after the last. Every forward meanwhile serves the previous adapter, so a swap costs
        serving no merge steps and no forwards with the separate delta; the previous merge and the new one are both
        held until then. The copy is taken before the first slice."""
        served = self._served(adapter, version)
        assert served is not None
        merged = self.runner.new_merge(served)
        while merged is not None and not merged.complete:
            merged.merge_next()
            yield
        self._queue_adapter(served, version, merged)

    def _served(self, adapter: LoraAdapter | None, version: int) -> ServedAdapter | None:
        """The frozen copy to serve (None for the base model), after checking the arguments."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be an integer >= 0 (got {version!r})")
        if adapter is None:
            if version != 0:
                raise ValueError(f"version must be 0 for the base model (adapter None; got {version})")
            return None
        if not isinstance(adapter, LoraAdapter):
            raise ValueError(f"adapter must be a LoraAdapter or None (got {type(adapter).__name__})")
        if version == 0:
            raise ValueError("version 0 means the base model; give an adapter a version >= 1")
        mine, theirs = self.model.config, adapter.model_config
        if mine.num_layers != theirs.num_layers or part_shapes(mine) != part_shapes(theirs):
            raise ValueError("adapter was made for a model of another shape (its model_config differs)")
        served = ServedAdapter(adapter, self.model.dtype, self.model.device)
        served.router = self._router(served)  # in the caller's thread: decoding every taught prompt takes a while
        return served

    def _queue_adapter(self, served: ServedAdapter | None, version: int, merged: MergedLinearOps | None) -> None:
        with self._lock:
            self._pending.adapters[None] = (served, version, merged)
        self._apply_pending_if_idle()

    @property
    def adapter_version(self) -> int:
        """The version of the shared adapter the next step serves (0: the base model)."""
        with self._lock:
            pending = self._pending.adapters.get(None)
        return pending[1] if pending is not None else self.runner.adapter_version

    def close(self) -> None:
        """The engine is done (its stepping thread, the store's last user, calls this): the activation store it
        records into drops every record and file and stops its disk writer."""
        self.store.close()

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._seqs or self._pending.aborts or self._aborted)

    def waiting_since(self) -> float | None:
        """When (``time.monotonic``) the longest-waiting request without its first token arrived: still waiting for
        admission, or admitted with its prompt's prefill not done (chunked over steps; a preempted request had its
        first token); None if there is none."""
        with self._lock:
            arrivals = [seq.arrival_s for seq in self._pending.adds]
        with self._step_lock:  # an abort applied at once changes the queues
            for queue in (self.scheduler.waiting, self.scheduler.running):
                arrivals += [seq.arrival_s for seq in queue if seq.first_token_s is None]
        return min(arrivals, default=None)

    def set_tpot_objective(self, seconds: float | None) -> None:
        """Cap prefill beside decodes so that a step's estimated time stays within ``seconds`` (None: no cap)."""
        self.tpot_objective_s = seconds

    def probe(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[int, int, float]]:
        """Serves ``prompts`` together, greedily, ``max_tokens`` each, and returns every step's (decode rows, prefill
        tokens, seconds): how long this machine's steps take unloaded (call it with nothing in flight: the runtime
        does at start-up). The requests leave no trace but their steps in ``step_cost``: nothing is recorded, and
        the counters ``stats()`` reports are as before."""
        counters = self._counters()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            request_id = f"probe-{i}-{time.monotonic_ns()}"
            self.add_request(request_id, prompt, params)
            with self._lock:
                self._seqs[request_id].record = False
        steps = []
        while self.has_unfinished():
            self.step()
            if self.last_step is not None:
                steps.append(self.last_step)
        self._restore_counters(counters)
        return steps

    def _counters(self) -> tuple[int, ...]:
        cache = self.block_manager.prefix_cache
        queries, hits = (cache.num_queries, cache.num_hits) if cache is not None else (0, 0)
        return (self._num_prompt_tokens, self._num_generation_tokens, self._num_finished,
                self.scheduler.num_preemptions, queries, hits)  # fmt: skip

    def _restore_counters(self, counters: tuple[int, ...]) -> None:
        cache = self.block_manager.prefix_cache
        (self._num_prompt_tokens, self._num_generation_tokens, self._num_finished, self.scheduler.num_preemptions,
         queries, hits) = counters  # fmt: skip
        if cache is not None:
            cache.num_queries, cache.num_hits = queries, hits

    def stats(self) -> EngineStats:
        cache = self.block_manager.prefix_cache
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._pending.adds),
            kv_cache_usage=self.block_manager.usage,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_finished=self._num_finished,
            activation_bytes=self.store.stats.bytes_held,
            activation_tier_bytes=dict(self.store.stats.tier_bytes),
            activation_records=self.store.stats.records,
            num_recorded=self.recorder.num_recorded if self.recorder is not None else 0,
            num_prefix_cache_queries=cache.num_queries if cache is not None else 0,
            num_prefix_cache_hits=cache.num_hits if cache is not None else 0,
        )

    # --- the loop (one thread) ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one batch; returns an output for each request that sampled a token, finished or was aborted."""
        with self._step_lock:
            self._apply_pending()
            cap = self._prefill_cap if self.tpot_objective_s is not None else None
            batch = self.scheduler.schedule(time.monotonic(), self.runner.version_of, cap)
            self.last_step = None
            if batch.is_empty:
                return self._take_aborted()
            t0 = time.perf_counter()
            self.runner.copy_prefixes(batch)
            logits, sampling = self.runner.run(batch)
            samples = self.sampler(logits, [s.params for s in sampling], [s.generator for s in sampling])
            outputs = self._postprocess(batch, sampling, samples.token_ids, samples.logprobs)
            num_decodes = batch.num_tokens.count(1)
            self.last_step = (num_decodes, batch.total_tokens - num_decodes, time.perf_counter() - t0)
            self.step_cost.observe(*self.last_step)
            return outputs

    def _prefill_cap(self, num_decodes: int) -> int | None:
        """Prefill tokens a step beside ``num_decodes`` decodes may take within the TPOT objective, or where those
        decodes alone outlast it (a batch larger than the objective was derived on), within
        ``OVER_OBJECTIVE_STRETCH`` times their time (None: no estimate yet)."""
        assert self.tpot_objective_s is not None
        decodes_s = self.step_cost.estimate(num_decodes, 0) or 0.0
        budget_s = self.tpot_objective_s if decodes_s < self.tpot_objective_s else OVER_OBJECTIVE_STRETCH * decodes_s
        return self.step_cost.prefill_tokens_within(budget_s, num_decodes)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        adapter_name: str | None = None,
    ) -> list[RequestOutput]:
        """Runs prompts to completion (offline use, tests, benchmarks), each served by the adapter ``adapter_name``
        names (``add_request``); final outputs in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{id(prompts)}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(request_id, prompt, p, adapter_name)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            final.update((out.request_id, out) for out in self.step() if out.finished)
        return [final[i] for i in ids]

    # --- internals --------------------------------------------------------------------------------------------------

    def _check_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> int:
        """Validates a request against this engine; returns its effective max_tokens."""
        c = self.config
        assert c.max_model_len is not None and c.num_kv_blocks is not None
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string (got {request_id!r})")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams (got {type(params).__name__})")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        vocab = self.model.config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt_ids must be token ids in 0..{vocab - 1}")
        if len(prompt_ids) >= c.max_model_len:
            raise ValueError(
                f"prompt_ids has {len(prompt_ids)} tokens; max_model_len {c.max_model_len} leaves no room to generate"
            )
        max_tokens = params.max_tokens or c.max_model_len - len(prompt_ids)
        if len(prompt_ids) + max_tokens > c.max_model_len:
            raise ValueError(
                f"max_tokens {max_tokens} + {len(prompt_ids)} prompt tokens exceed max_model_len {c.max_model_len}"
            )
        # The last sampled token is never fed back, so the cache holds at most prompt + max_tokens - 1 tokens.
        needed = self.block_manager.blocks_for(len(prompt_ids) + max_tokens - 1)
        if needed > c.num_kv_blocks:
            raise ValueError(
                f"prompt + max_tokens need {needed} KV blocks but num_kv_blocks is {c.num_kv_blocks}; "
                "lower max_tokens or raise num_kv_blocks"
            )
        return max_tokens

    def _apply_pending_if_idle(self) -> None:
        if self._step_lock.acquire(blocking=False):  # no step running: apply the queue now
            try:
                self._apply_pending()
            finally:
                self._step_lock.release()

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, _Pending()
            for name, change in pending.adapters.items():  # under the lock, so that adapter_version never goes back
                if name is None:
                    assert change is not None
                    self.runner.set_adapter(*change)
                elif change is not None:
                    self.runner.set_named(name, change[0], change[1])
                    self._retiring.discard(name)
                elif name in self.runner.named:
                    self._retiring.add(name)
        for seq in pending.adds:
            # decided once, under the adapter its prefill starts with: its prompt rows are the same either way
            router = self._router_of(seq)
            seq.routed = router is not None and router.routes(seq.prompt_token_ids)
            self.scheduler.add(seq)
        if self._retiring:  # a removed adapter goes once no sequence names it
            named = {seq.adapter_name for queue in (self.scheduler.waiting, self.scheduler.running) for seq in queue}
            for name in self._retiring - named:
                self.runner.set_named(name, None)
            self._retiring &= named
        now = time.monotonic()
        for request_id in pending.aborts:
            with self._lock:
                seq = self._seqs.pop(request_id, None)
            if seq is None:
                continue
            self.scheduler.remove(seq)
            if self.recorder is not None:
                self.recorder.drop(request_id)
            seq.finish("abort", now)
            self._aborted.append(self._output(seq))
            self._num_finished += 1

    @property
    def router(self) -> Router | None:
        """Which requests the corrections' ranks of the shared adapter serving now serve (None: every request
        alike)."""
        return None if self.runner.adapter is None else self.runner.adapter.router

    def _router_of(self, seq: Sequence) -> Router | None:
        """The router of the adapter serving ``seq`` now: which requests its corrections' ranks serve (None: every
        request alike)."""
        served = self.runner.served(seq.adapter_name)
        return None if served is None else served.router

    def _router(self, served: ServedAdapter) -> Router | None:
        """The router of an adapter whose corrections' ranks are cut (None: every request served alike)."""
        if not served.cut:
            return None
        router = Router(self.tokenizer.decode, self.tokenizer.decode(self.tokenizer.user_prompt("")),
                        self.config.route_threshold)  # fmt: skip
        router.teach(served.taught)
        return router

    def _take_aborted(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        return outputs

    def _postprocess(
        self, batch: ScheduledBatch, sampling: list[Sequence], token_ids: list[int], logprobs: list
    ) -> list[RequestOutput]:
        now = time.monotonic()
        cache = self.block_manager.prefix_cache
        for seq, num in zip(batch.seqs, batch.num_tokens, strict=True):
            serving = self.runner.version_of(seq.adapter_name)
            seq.advance(num, serving)
            if cache is not None:  # the full blocks just completed serve later prompts that start with them
                assert seq.slot is not None
                # a routed request's keys/values from its last prompt token on hold the corrections' ranks: never
                # a later prompt's (whose rows there are prompt rows, without them)
                computed = seq.num_computed_tokens
                if seq.routed:
                    computed = min(computed, seq.num_prompt_tokens - 1)
                cache.register(seq.slot, seq.token_ids, computed, seq.adapter_version, serving, seq.adapter_name)
        outputs = self._take_aborted()
        for seq, token_id, lp in zip(sampling, token_ids, logprobs, strict=True):
            if seq.first_token_s is None:
                self._num_prompt_tokens += seq.num_prompt_tokens
            seq.append_token(token_id, lp, now)
            self._num_generation_tokens += 1
            reason = self.stop_checker.check(seq, token_id)
            if reason is not None:
                self.scheduler.remove(seq)
                seq.finish(reason, now)
                self._num_finished += 1
                with self._lock:
                    self._seqs.pop(seq.request_id, None)
            outputs.append(self._output(seq))
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        new_tokens, new_logprobs = seq.take_new_tokens()
        new_text = seq.take_new_text(self.stop_checker.hold_back(seq))
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            new_text=new_text,
            text=seq.text[: seq.num_text_sent],
            output_token_ids=seq.output_token_ids,
            prompt_token_ids=seq.prompt_token_ids,
            adapter_version=seq.adapter_version,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            logprobs=new_logprobs if seq.params.logprobs is not None else None,
            timings=RequestTimings.of(seq) if seq.is_finished else None,
            adapter_name=seq.adapter_name,
        )
