"""OpenAIServing: an OpenAI request -> prompt ids -> the engine -> a response, or an SSE stream of chunks.

Checks that need the tokenizer or the context length happen here, before anything is streamed, so that a bad
request gets a 400 and not a broken stream. Each finished completion is kept in the CompletionsRegistry under
its response id, for feedback to find.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from pydantic import BaseModel

from alchemist.engine import RequestOutput, SamplingParams, TokenLogprobs
from alchemist.model.tokenizer import check_text
from alchemist.runtime.async_engine import AsyncEngine, EngineDeadError, RequestStream
from alchemist.server import protocol as p
from alchemist.server.auth import ANONYMOUS, Caller
from alchemist.server.completions_registry import CompletionRecord, CompletionsRegistry
from alchemist.server.errors import InvalidRequestError, ModelNotFoundError
from alchemist.server.limits import KeyLimits, LimitConfig
from alchemist.server.named_adapters import NamedAdapters
from alchemist.training.anchors import Anchor, AnchorPool

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


@dataclass
class Accumulator:
    """What a request has produced so far, across its RequestOutputs."""

    prompt_token_ids: list[int]
    model: str  # what the response's ``model`` says: the named adapter that answers, else the base model's name
    adapter_name: str | None = None  # the named adapter serving it (None: the shared one)
    owner: str | None = None  # the API key's name (None: no keys configured)
    recorded: bool = False  # whether its prompt was asked to be recorded, and granted
    last: RequestOutput | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, when asked for

    def add(self, out: RequestOutput) -> None:
        self.last = out
        self.logprobs.extend(out.logprobs or [])

    @property
    def text(self) -> str:
        return self.last.text if self.last else ""

    @property
    def output_token_ids(self) -> list[int]:
        return self.last.output_token_ids if self.last else []

    @property
    def finish_reason(self) -> str | None:
        return self.last.finish_reason if self.last else None

    @property
    def adapter_version(self) -> int:
        """The adapter its prefill used (the engine keeps it for the whole request, across swaps)."""
        return self.last.adapter_version if self.last else 0

    def usage(self) -> p.UsageInfo:
        return p.UsageInfo.of(len(self.prompt_token_ids), len(self.output_token_ids))


class EventStream:
    """The SSE events of one request. ``aclose()`` aborts the request even when iteration never started (a
    client gone before the first event): closing an unstarted generator would not run its ``finally``."""

    def __init__(self, events: AsyncGenerator[str, None], request: RequestStream):
        self.events = events
        self.request = request

    def __aiter__(self) -> AsyncIterator[str]:
        return self.events

    async def aclose(self) -> None:
        await self.events.aclose()
        await self.request.aclose()


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Any,
        served_model_names: list[str],
        max_model_len: int,
        registry: CompletionsRegistry,
        anchors: AnchorPool | None = None,
    ):
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_model_names = served_model_names
        self.max_model_len = max_model_len
        self.registry = registry
        self.anchors = anchors  # the online trainer's: finished completions to stay close on
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self.limits = KeyLimits(LimitConfig(), 0)  # the app sets the server's (alchemist.server.limits)
        self.id_tag = ""  # after a response id's prefix: a replica's index (alchemist.scale.replica)
        self.named: NamedAdapters | None = None  # the app sets the server's (None: only the base model's names)

    @property
    def model_name(self) -> str:
        """The name responses carry (the first served name)."""
        return self.served_model_names[0]

    def models(self, caller: Caller = ANONYMOUS) -> p.ModelList:
        """The base model, and the named adapters ``caller`` may use."""
        adapters = self.named.cards(caller) if self.named is not None else []
        return p.ModelList(data=[p.ModelCard(id=self.model_name, max_model_len=self.max_model_len), *adapters])

    # --- chat -----------------------------------------------------------------------------------------------

    async def chat(
        self, req: p.ChatCompletionRequest, caller: Caller = ANONYMOUS
    ) -> p.ChatCompletionResponse | EventStream:
        """``caller``: the API key the response belongs to (only it may give feedback on it; its quota grants a
        request to be recorded)."""
        adapter = self._resolve(req.model, caller)
        prompt_ids = self.tokenizer.apply_chat_template([m.as_template_dict() for m in req.messages])
        request_id, stream, acc = await self._submit("chatcmpl", req, prompt_ids, "messages", caller, adapter)
        if req.stream:
            return EventStream(self._chat_stream(req, request_id, stream, acc), stream)
        await self._drain(stream, acc)
        self._register(request_id, acc)
        choice = p.ChatCompletionChoice(
            message=p.ChatCompletionMessage(content=acc.text),
            logprobs=self._chat_logprobs(acc.logprobs, req.top_logprobs) if req.logprobs else None,
            finish_reason=acc.finish_reason,
        )
        return p.ChatCompletionResponse(
            id=request_id,
            model=acc.model,
            system_fingerprint=p.fingerprint(acc.adapter_version),
            choices=[choice],
            usage=acc.usage(),
        )

    async def _chat_stream(
        self, req: p.ChatCompletionRequest, request_id: str, stream: RequestStream, acc: Accumulator
    ) -> AsyncGenerator[str, None]:
        created = p.now_s()
        chunk = lambda choices, usage=None: p.ChatCompletionChunk(
            id=request_id,
            created=created,
            model=acc.model,
            system_fingerprint=p.fingerprint(acc.adapter_version),
            choices=choices,
            usage=usage,
        )
        role = [p.ChatCompletionStreamChoice(delta=p.ChatDelta(role="assistant", content=""))]
        try:
            async for out in stream:
                acc.add(out)
                if role:  # sent with the first output, whose prefill names the adapter version every chunk carries
                    yield sse(chunk(role))
                    role = None
                logprobs = self._chat_logprobs(out.logprobs, req.top_logprobs) if req.logprobs else None
                if out.new_text or logprobs:
                    delta = p.ChatDelta(content=out.new_text)
                    yield sse(chunk([p.ChatCompletionStreamChoice(delta=delta, logprobs=logprobs)]))
            self._register(request_id, acc)
            if role:  # no output at all (aborted before its prefill)
                yield sse(chunk(role))
            yield sse(chunk([p.ChatCompletionStreamChoice(delta=p.ChatDelta(), finish_reason=acc.finish_reason)]))
            if req.include_usage:
                yield sse(chunk([], acc.usage()))
        except EngineDeadError as e:  # the engine failed mid-stream; the status line is already sent
            yield sse(p.ErrorResponse(error=p.ErrorInfo(message=str(e), type="internal_server_error")))
        finally:
            await stream.aclose()  # a no-op when finished; aborts on disconnect or cancellation
        yield SSE_DONE

    # --- text completions -----------------------------------------------------------------------------------

    async def completion(
        self, req: p.CompletionRequest, caller: Caller = ANONYMOUS
    ) -> p.CompletionResponse | EventStream:
        adapter = self._resolve(req.model, caller)
        # Special tokens as the model adds them to plain text (a BOS for Llama), as vLLM does.
        prompt = req.prompt
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
        request_id, stream, acc = await self._submit("cmpl", req, prompt_ids, "prompt", caller, adapter)
        if req.stream:
            return EventStream(self._completion_stream(req, request_id, stream, acc), stream)
        await self._drain(stream, acc)
        self._register(request_id, acc)
        logprobs = self._completion_logprobs(acc.logprobs, 0) if req.logprobs is not None else None
        choice = p.CompletionChoice(text=acc.text, logprobs=logprobs, finish_reason=acc.finish_reason)
        return p.CompletionResponse(
            id=request_id,
            model=acc.model,
            system_fingerprint=p.fingerprint(acc.adapter_version),
            choices=[choice],
            usage=acc.usage(),
        )

    async def _completion_stream(
        self, req: p.CompletionRequest, request_id: str, stream: RequestStream, acc: Accumulator
    ) -> AsyncGenerator[str, None]:
        created = p.now_s()
        chunk = lambda choices, usage=None: p.CompletionResponse(
            id=request_id,
            created=created,
            model=acc.model,
            system_fingerprint=p.fingerprint(acc.adapter_version),
            choices=choices,
            usage=usage,
        )
        try:
            async for out in stream:
                offset = len(acc.text)
                acc.add(out)
                logprobs = self._completion_logprobs(out.logprobs, offset) if req.logprobs is not None else None
                if out.new_text or out.finished or logprobs:
                    reason = acc.finish_reason if out.finished else None
                    yield sse(chunk([p.CompletionChoice(text=out.new_text, logprobs=logprobs, finish_reason=reason)]))
            self._register(request_id, acc)
            if req.include_usage:
                yield sse(chunk([], acc.usage()))
        except EngineDeadError as e:
            yield sse(p.ErrorResponse(error=p.ErrorInfo(message=str(e), type="internal_server_error")))
        finally:
            await stream.aclose()
        yield SSE_DONE

    # --- shared ---------------------------------------------------------------------------------------------

    def _resolve(self, model: str, caller: Caller) -> str | None:
        """The named adapter that serves ``caller``'s request for ``model`` (None: the shared one), or a 404/403
        (``alchemist.server.named_adapters``)."""
        if self.named is not None:
            return self.named.resolve(model, caller)
        if model not in self.served_model_names:
            raise ModelNotFoundError(model, self.served_model_names)
        return None

    async def _submit(
        self,
        prefix: str,
        req: p.ChatCompletionRequest | p.CompletionRequest,
        prompt_ids: list[int],
        prompt_param: str,
        caller: Caller,
        adapter: str | None = None,
    ) -> tuple[str, RequestStream, Accumulator]:
        """Admits the request, served by the named adapter ``adapter`` (None: the shared one); with one, first waits
        until the adapter is in the engine (paged in on demand: ``alchemist.runtime.adapter_registry``), holding it
        there until the request's stream ends."""
        self._check_prompt(prompt_ids, req.max_new_tokens, prompt_param)
        if req.max_new_tokens is not None and req.min_tokens > req.max_new_tokens:
            # Here rather than in SamplingParams, so that the 400 names the field (param).
            raise InvalidRequestError(
                f"min_tokens={req.min_tokens} must be <= max_tokens={req.max_new_tokens}", "min_tokens"
            )
        params = SamplingParams(
            max_tokens=req.max_new_tokens,
            min_tokens=req.min_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=max(req.top_k, 0),
            seed=req.seed,
            stop=list(req.stop or []),
            ignore_eos=req.ignore_eos,
            logprobs=req.num_logprobs,
            # A client's flag asks; its key's record quota grants (else it is served unrecorded: no error). Records
            # are for training the shared adapter: a named adapter's requests make none.
            record=adapter is None and req.alchemist.record and self.limits.grant_record(caller, len(prompt_ids)),
        )
        request_id = p.random_id(prefix + self.id_tag)
        acc = Accumulator(prompt_ids, adapter or self.model_name, adapter, owner=caller.name, recorded=params.record)
        if adapter is None:
            return request_id, self.engine.generate(request_id, prompt_ids, params), acc
        assert self.named is not None
        await self.named.acquire(adapter)
        release = lambda: self.named.release(adapter)  # noqa: E731 - called once, when the stream ends
        try:
            stream = self.engine.generate(request_id, prompt_ids, params, adapter, on_finish=release)
        except BaseException:
            release()
            raise
        return request_id, stream, acc

    def _check_prompt(self, prompt_ids: list[int], max_tokens: int | None, param: str) -> None:
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param)
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"The prompt is {n} tokens long, but the context is {self.max_model_len} tokens "
                "(max_model_len) and must leave room for at least one output token",
                param,
            )
        if max_tokens is not None and n + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"max_tokens={max_tokens} plus the {n} prompt tokens exceeds the context of {self.max_model_len} "
                f"tokens (max_model_len); ask for at most {self.max_model_len - n}",
                "max_tokens",
            )

    async def _drain(self, stream: RequestStream, acc: Accumulator) -> None:
        try:
            async for out in stream:
                acc.add(out)
        finally:
            await stream.aclose()

    def _register(self, request_id: str, acc: Accumulator) -> None:
        self.registry.add(
            CompletionRecord(
                id=request_id,
                prompt_token_ids=acc.prompt_token_ids,
                output_token_ids=acc.output_token_ids,
                text=acc.text,
                model=acc.model,
                adapter_version=acc.adapter_version,
                adapter_name=acc.adapter_name,
                finish_reason=acc.finish_reason,
                created_s=time.time(),
                recorded=acc.recorded,
                owner=acc.owner,
            )
        )
        # Anchors keep the shared adapter close to the base model on served text: a named adapter's is not its own.
        if self.anchors is not None and acc.adapter_name is None and acc.finish_reason in ("stop", "length"):
            self.anchors.offer(Anchor(request_id, acc.prompt_token_ids, acc.output_token_ids))

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _top(self, entry: Any) -> p.TopLogprob:
        token_id, logprob = entry
        text = self.token_text(token_id)
        return p.TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    def _chat_logprobs(self, logprobs: list[Any] | None, num_top: int | None) -> p.ChatLogprobs | None:
        if not logprobs:
            return None
        content = []
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            top = [self._top(entry) for entry in lp.top[: num_top or 0]]
            content.append(p.TokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top))
        return p.ChatLogprobs(content=content)

    def _completion_logprobs(self, logprobs: list[Any] | None, text_offset: int) -> p.CompletionLogprobs | None:
        if not logprobs:
            return None
        out = p.CompletionLogprobs()
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self.token_text(t): v for t, v in lp.top})
            out.text_offset.append(text_offset)
            text_offset += len(text)
        return out
