"""Bad input gets an OpenAI-shaped error with the right status, and the server keeps serving afterwards."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from alchemist.bench import http_calls
from tests.server.conftest import MODEL_NAME

HELLO = [{"role": "user", "content": "Hello!"}]


def assert_still_serving(server) -> None:
    response = server.client().chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=2)
    assert response.choices[0].message.content is not None and response.usage.completion_tokens >= 1


def post_raw(server, body: bytes | str, path: str = "/v1/chat/completions", **kwargs) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return http_calls.post(server.base_url + path, content=body, headers=headers, timeout=30, **kwargs)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    "body, param",
    [
        ('{"model": "smollm2", "messages": [', None),  # malformed JSON
        ("[1, 2, 3]", None),  # not an object
        ('{"model": "smollm2", "messages": "hello"}', "messages"),  # wrong type
        ('{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
        ('{"model": "smollm2", "messages": [{"role": "wizard", "content": "hi"}]}', "messages.0.role"),
        ('{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}', "max_tokens"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "model"),  # missing field
    ],
)
def test_malformed_requests_are_400(server, body, param):
    error = assert_openai_error(post_raw(server, body), 400, param)
    assert error["type"] == "invalid_request_error"
    assert_still_serving(server)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(messages=[]), "messages"),
        (dict(messages=HELLO, max_tokens=0), "max_tokens"),
        (dict(messages=HELLO, max_tokens=-5), "max_tokens"),
        (dict(messages=HELLO, max_completion_tokens=0), "max_completion_tokens"),
        (dict(messages=HELLO, max_tokens=5000), "max_tokens"),  # beyond the 1024-token context
        (dict(messages=HELLO, n=2), "n"),
        (dict(messages=HELLO, temperature=-1), "temperature"),
        (dict(messages=HELLO, top_logprobs=50, logprobs=True), "top_logprobs"),
        (dict(messages=HELLO, extra_body={"min_tokens": -1}), "min_tokens"),
        (dict(messages=HELLO, max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens"),  # more than max_tokens
        (dict(messages=HELLO, max_completion_tokens=4, extra_body={"min_tokens": 5}), "min_tokens"),
    ],
)
def test_invalid_parameters_are_400(server, client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param
    assert_still_serving(server)


def test_min_tokens_over_max_tokens_is_400_on_completions_too(server, client):
    with pytest.raises(openai.BadRequestError) as info:  # max_tokens defaults to 16 on completions
        client.completions.create(model=MODEL_NAME, prompt="hi", extra_body={"min_tokens": 17})
    assert info.value.body["param"] == "min_tokens" and "min_tokens=17" in info.value.body["message"]
    assert_still_serving(server)


def test_prompt_longer_than_the_context_is_400(server, client):
    long_text = "word " * 1200  # > 1024 tokens
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": long_text}])
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL_NAME, prompt=long_text, max_tokens=1)
    assert_still_serving(server)


def test_bad_completion_prompts_are_400(server, client):
    for prompt in (["one", "two"], [10**9], ""):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    assert_still_serving(server)


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=HELLO)
    assert info.value.body["code"] == "model_not_found"
    assert "/" not in info.value.body["message"], "an error names no path on the server's disk"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="hi")
    assert_still_serving(server)


LONE_SURROGATE = '"a\\ud800b"'  # JSON for a string no UTF-8 can encode


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/chat/completions", '{"model": "smollm2", "messages": [{"role": "user", "content": %s}]}', 400),
        (
            "/v1/chat/completions",
            '{"model": "smollm2", "messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}',
            400,
        ),  # fmt: skip
        ("/v1/completions", '{"model": "smollm2", "prompt": %s}', 400),
        ("/v1/completions", '{"model": "smollm2", "prompt": [%s]}', 400),
        ("/v1/feedback", '{"response_id": "chatcmpl-x", "correction": %s}', 400),
        ("/v1/chat/completions", '{"model": %s, "messages": [{"role": "user", "content": "hi"}]}', 404),  # quoted
    ],
)
def test_lone_surrogates_are_4xx(server, path, body, status):
    assert_openai_error(post_raw(server, body % LONE_SURROGATE, path), status)
    assert_still_serving(server)


def test_unknown_route_is_openai_shaped_404(server):
    response = http_calls.get(server.base_url + "/v1/nothing-here", timeout=10)
    assert_openai_error(response, 404)


def test_body_over_the_limit_is_413(small_server):
    big = '{"model": "smollm2", "messages": [{"role": "user", "content": "' + "a" * 10_000 + '"}]}'
    assert_openai_error(post_raw(small_server, big), 413)

    def chunks():  # no Content-Length: the size is counted as the body arrives
        yield b'{"model": "smollm2", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}]}'

    assert_openai_error(post_raw(small_server, chunks()), 413)
    assert_still_serving(small_server)


def test_overload_is_429(small_server):
    """One request running and one waiting fill the small server; the next one is refused, not queued."""
    client = small_server.client()
    long_request = dict(model=MODEL_NAME, messages=HELLO, max_tokens=200, extra_body={"ignore_eos": True})
    running = client.chat.completions.create(stream=True, **long_request)
    next(iter(running))  # the first chunk: it is admitted
    small_server.wait_for_metric("alchemist:num_requests_running", 1)
    waiting_result = {}
    waiting = threading.Thread(
        target=lambda: waiting_result.update(
            r=client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=2)
        )
    )
    waiting.start()
    small_server.wait_for_metric("alchemist:num_requests_waiting", 1)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=2)
    assert info.value.status_code == 429
    running.close()  # disconnect: the running request is aborted and the waiting one gets its slot
    waiting.join(timeout=60)
    assert waiting_result["r"].choices[0].finish_reason in ("stop", "length")
    assert_still_serving(small_server)
