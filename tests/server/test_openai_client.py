"""The official `openai` client against a real server process: chat and completions, streaming and not."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai

from tests.server.conftest import MODEL_NAME

QUESTION = [{"role": "user", "content": "List three colors of the rainbow."}]
GREEDY = dict(model=MODEL_NAME, temperature=0.0)


def chat(client: openai.OpenAI, messages=QUESTION, **kwargs):
    return client.chat.completions.create(messages=messages, **{**GREEDY, "max_tokens": 24, **kwargs})


def stream_chat(client: openai.OpenAI, messages=QUESTION, **kwargs) -> tuple[str, list]:
    chunks = list(chat(client, messages, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]


def test_chat_non_streaming(client, tokenizer):
    response = chat(client)
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    assert response.model == MODEL_NAME
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens == len(tokenizer.apply_chat_template(QUESTION))
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(client):
    expected = chat(client)
    text, chunks = stream_chat(client, stream_options={"include_usage": True})
    assert text == expected.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    # The adapter version that wrote it (no training on this server: the base model, v0), in every chunk too.
    assert expected.system_fingerprint == "alchemist-v0"
    assert all(c.system_fingerprint == "alchemist-v0" for c in chunks)
    assert all(c.id == chunks[0].id and c.id.startswith("chatcmpl-") for c in chunks)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == [expected.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == expected.usage  # usage only in the final chunk
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_without_include_usage_has_no_usage(client):
    _, chunks = stream_chat(client, max_tokens=4)
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_non_streaming_and_streaming(client, tokenizer):
    prompt = "The capital of France is"
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=True))
    assert response.usage.completion_tokens == 8 and response.choices[0].finish_reason == "length"
    assert "Paris" in response.choices[0].text
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == response.choices[0].text
    assert chunks[-1].usage == response.usage
    assert all(c.id == chunks[0].id and c.id.startswith("cmpl-") for c in chunks)


def test_completion_from_token_ids(client, tokenizer):
    ids = tokenizer.encode("The capital of France is", add_special_tokens=True)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_usage_counts_the_real_tokens(client, tokenizer):
    response = chat(client, max_tokens=12, logprobs=True, top_logprobs=2)
    tokens = response.choices[0].logprobs.content
    assert response.usage.completion_tokens == len(tokens)
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens)
    assert response.usage.prompt_tokens == len(tokenizer.apply_chat_template(QUESTION))
    # The logprob tokens are the output's tokens: together they spell the text.
    assert "".join(t.token for t in tokens).startswith(response.choices[0].message.content)
    capped = chat(client, max_tokens=3)
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"


def test_stop_strings_streaming_and_not(client):
    messages = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    full = chat(client, messages, max_tokens=40).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # a string from the middle of the answer
    expected = full[: full.index(stop)]
    stopped = chat(client, messages, max_tokens=40, stop=[stop, "never-appears"])
    assert stopped.choices[0].message.content == expected
    assert stopped.choices[0].finish_reason == "stop"
    text, chunks = stream_chat(client, messages, max_tokens=40, stop=stop)
    assert text == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_makes_sampling_deterministic(client):
    kwargs = dict(temperature=1.0, top_p=0.95, max_tokens=16)
    first = chat(client, seed=1234, **kwargs).choices[0].message.content
    again = chat(client, seed=1234, **kwargs).choices[0].message.content
    streamed, _ = stream_chat(client, seed=1234, **kwargs)
    assert first == again == streamed
    others = {chat(client, seed=seed, **kwargs).choices[0].message.content for seed in (1, 2, 3)}
    assert len(others | {first}) > 1  # the seed matters


def test_a_top_p_or_temperature_under_float32s_reach_answers_greedily(client):
    """Valid values that are 0 in float32 (schemathesis found the engine dead after top_p=1.02e-79): the most likely
    token, as a greedy request gets it, and the server serving on."""
    greedy = chat(client).choices[0].message.content
    for sampling in ({"temperature": 0.26, "top_p": 1.02e-79}, {"temperature": 1e-300}):
        assert chat(client, **sampling).choices[0].message.content == greedy, sampling
    assert chat(client).choices[0].message.content == greedy


def test_extra_fields_top_k_and_alchemist_record(client, server):
    recorded_before = server.metrics().get("alchemist:recorded_prompts_total", 0.0)
    response = chat(client, max_tokens=4, extra_body={"top_k": 1, "alchemist": {"record": True}}, temperature=1.0)
    greedy = chat(client, max_tokens=4)
    assert response.choices[0].message.content == greedy.choices[0].message.content  # top_k=1 is greedy
    # Only the request that asked was recorded (the server's default policy is "requested").
    metrics = server.metrics()
    assert metrics["alchemist:recorded_prompts_total"] == recorded_before + 1
    assert metrics["alchemist:activation_store_records"] >= 1 and metrics["alchemist:activation_store_bytes"] > 0


def test_a_repeated_prompt_prefix_is_served_from_the_prefix_cache(client, server):
    system = {"role": "system", "content": "You answer in one short sentence. " * 12}  # several full blocks
    before = server.metrics()
    first = chat(client, [system, {"role": "user", "content": "Name a fruit."}], max_tokens=6)
    after_first = server.metrics()
    second = chat(client, [system, {"role": "user", "content": "Name a city."}], max_tokens=6)
    after = server.metrics()
    queries, hits = "alchemist:prefix_cache_queries_total", "alchemist:prefix_cache_hits_total"
    assert after_first[queries] - before[queries] == first.usage.prompt_tokens
    assert after[queries] - after_first[queries] == second.usage.prompt_tokens
    assert after[hits] - after_first[hits] >= 64  # the shared system message's blocks


def test_concurrent_requests_get_what_they_get_alone(client):
    prompts = [[{"role": "user", "content": f"Say something about the number {i}."}] for i in range(4)]
    alone = [chat(client, p, max_tokens=12).choices[0].message.content for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: chat(client, p, max_tokens=12).choices[0].message.content, prompts))
    assert together == alone


def test_the_model_path_is_accepted_as_the_model_name(client):
    from alchemist.model.gguf import default_gguf_path

    response = client.chat.completions.create(model=str(default_gguf_path()), messages=QUESTION, max_tokens=2)
    assert response.model == MODEL_NAME  # responses carry the served name
