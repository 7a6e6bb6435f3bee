"""A closed-loop chat load on any OpenAI-compatible server: ``c`` clients, each playing conversations turn by turn.

    chats = [Chat(("Hi!", "And then?")), Chat(("Name three colours.",))]
    results, errors, duration_s = run_chats("http://127.0.0.1:8000/v1", "smollm2", chats, max_tokens=8, concurrency=2)

Each client takes the next conversation and sends its user turns one after the other to ``/chat/completions``
(streaming, the official ``openai`` client), every turn with the whole history before it: the earlier user turns
and the replies this server actually returned. So a server that reuses cached prefixes shows it. A one-turn chat is
a plain request. A conversation whose turn fails ends there (its later turns need the reply). A chat may name its
own model (a named adapter); each result says which model answered (the stream's ``model``).

Every request asks for exactly ``max_tokens`` greedy tokens: ``max_tokens`` plus ``ignore_eos`` and ``min_tokens``
in the body (vLLM's extras, accepted by vLLM and by Alchemist). The tokens counted are the streamed ``usage``'s
``completion_tokens`` (``stream_options.include_usage``), never assumed; a stream without usage is an error.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from alchemist.bench.latency import StreamClock


@dataclass(frozen=True)
class Chat:
    turns: tuple[str, ...]  # user messages, sent one after the other
    model: str | None = None  # the model its requests name (a named adapter), else run_chats' model


@dataclass
class RequestResult:
    """One request's client-side timings (seconds, from sending it)."""

    ttft_s: float  # to the first streamed content
    e2e_s: float  # to the end of the stream
    num_tokens: int  # output tokens, as the server's usage says
    prompt_tokens: int  # likewise
    itl_s: list[float]  # the gaps between its streamed content chunks after the first (vLLM's ITL)
    model: str | None = None  # the model that answered, as the stream says (a named adapter's name)


def openai_client(base_url: str, api_key: str):
    import openai

    # No retries: a failed request is counted as failed, not silently re-sent (which would skew its timings).
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=3600)


def first_model_id(base_url: str, api_key: str) -> str:
    """The first model of GET /models: what a server serves when the caller does not say."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2, timeout=30)
    try:
        models = client.models.list().data
    except openai.OpenAIError as e:
        raise ValueError(f"--base-url {base_url}: GET /models failed ({type(e).__name__}: {e})") from e
    if not models:
        raise ValueError(f"--base-url {base_url}: GET /models lists no model; pass --model")
    return models[0].id


async def send_turn(client, model: str, messages: list[dict], max_tokens: int) -> tuple[RequestResult, str]:
    """One streamed chat request: its timings and the reply's text."""
    clock = StreamClock()
    parts: list[str] = []
    num_tokens = prompt_tokens = answered_by = None
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "min_tokens": max_tokens},
    )  # fmt: skip
    async for chunk in stream:
        answered_by = answered_by or chunk.model
        if chunk.choices and chunk.choices[0].delta.content:
            clock.content()
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            num_tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    e2e_s = clock.elapsed_s()
    if num_tokens is None:
        raise RuntimeError("the stream carried no usage (the server must support stream_options.include_usage)")
    if clock.first is None:
        raise RuntimeError(f"no content streamed ({num_tokens} tokens)")
    result = RequestResult(clock.ttft_s, e2e_s, num_tokens, prompt_tokens, clock.gaps, answered_by)
    return result, "".join(parts)


def run_chats(
    base_url: str, model: str, chats: list[Chat], max_tokens: int, concurrency: int, api_key: str = "unused"
) -> tuple[list[RequestResult], list[BaseException], float]:
    """Plays ``chats`` with ``concurrency`` clients; (each request's result, the errors, the duration in s)."""

    async def main() -> tuple[list[RequestResult], list[BaseException], float]:
        client = openai_client(base_url, api_key)
        queue = deque(chats)
        results: list[RequestResult] = []
        errors: list[BaseException] = []

        async def one_client() -> None:
            while queue:
                chat, messages = queue.popleft(), []
                for user in chat.turns:
                    messages.append({"role": "user", "content": user})
                    try:
                        result, reply = await send_turn(client, chat.model or model, messages, max_tokens)
                    except Exception as e:  # whatever went wrong, it is this request's failure: counted
                        errors.append(e)
                        break
                    results.append(result)
                    messages.append({"role": "assistant", "content": reply})

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        duration_s = time.perf_counter() - start
        await client.close()
        return results, errors, duration_s

    return asyncio.run(main())
