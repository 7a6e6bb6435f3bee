"""API keys on a real server process (a keys file with users alice and bob and admin ops, plus --api-key), through
the official openai client where it fits: no key or a wrong one is a 401, a response belongs to its key (feedback
by another user key is a 403), rollback needs an admin key, /health stays open, the keys file is reloaded when it
changes; without keys the server refuses a non-loopback address."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from alchemist.bench import http_calls
from alchemist.server.auth import add_key, hash_key
from tests.server.conftest import MODEL_NAME, ServerProcess, launch_server, wait_ready, write_keys

HELLO = [{"role": "user", "content": "Hello!"}]
ADMIN_KEY = "sk-the-single-admin-key"
FLAGS = ["--max-num-seqs", "4", "--max-model-len", "128", "--train-max-wait-s", "600"]
LIMITED = {
    "hasty": {"requests_per_minute": 2, "feedback_per_minute": 1},
    "streamer": {"max_streams": 1},
    "frugal": {"record_mb_per_hour": 1},  # SmolLM2's records take ~0.35 MB a prompt token: not one prompt fits
}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("auth")
    keys = write_keys(root / "keys.toml")
    for name, limits in LIMITED.items():  # keys with limits of their own, as an operator writes them
        keys[name] = f"sk-{name}-key"
        fields = "".join(f"{field} = {value}\n" for field, value in limits.items())
        with open(root / "keys.toml", "a") as f:
            f.write(f'\n[[keys]]\nname = "{name}"\nsha256 = "{hash_key(keys[name])}"\n{fields}')
    flags = [*FLAGS, "--api-keys-file", str(root / "keys.toml"), "--api-key", ADMIN_KEY]
    server = launch_server("auth", root, root / "data", flags)
    server.keys_file = root / "keys.toml"
    try:
        wait_ready(server)
        yield server, keys
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)


def ask(server: ServerProcess, key: str) -> str:
    return server.client(api_key=key).chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=4).id


def post(server: ServerProcess, path: str, key: str | None, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return http_calls.post(server.base_url + path, json=body, headers=headers, timeout=60)


def get(server: ServerProcess, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return http_calls.get(server.base_url + path, headers=headers, timeout=60)


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


def test_no_key_or_a_wrong_key_is_401(keyed):
    server, _ = keyed
    for key in ("unused", "sk-alc-not-a-key"):
        with pytest.raises(openai.AuthenticationError) as info:
            server.client(api_key=key).chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=2)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    response = post(server, "/v1/completions", None, {"model": MODEL_NAME, "prompt": "hi"})
    assert_error(response, 401, "invalid_api_key")
    assert response.headers["www-authenticate"] == "Bearer"
    for path in ("/v1/models", "/v1/adapters", "/metrics", "/openapi.json", "/docs"):
        assert_error(get(server, path, None), 401, "invalid_api_key")
    assert get(server, "/health", None).status_code == 200  # load balancers' probe stays open


def test_feedback_on_another_keys_response_is_403(keyed):
    server, keys = keyed
    alices = ask(server, keys["alice"])
    response = post(server, "/v1/feedback", keys["bob"], {"response_id": alices, "correction": "Hi there."})
    assert_error(response, 403, "permission_denied")
    preferred = post(
        server, "/v1/feedback", keys["bob"], {"response_id": ask(server, keys["bob"]), "preferred_over": alices}
    )
    assert_error(preferred, 403, "permission_denied")  # nor may bob name alice's response as the worse one
    assert post(server, "/v1/feedback", keys["alice"], {"response_id": alices, "rating": 1}).status_code == 200
    assert post(server, "/v1/feedback", keys["ops"], {"response_id": alices, "rating": -1}).status_code == 200


def test_a_user_cannot_roll_back_an_admin_can(keyed):
    server, keys = keyed
    assert_error(post(server, "/v1/adapters/rollback", keys["alice"], {"version": 0}), 403, "permission_denied")
    for admin in (keys["ops"], ADMIN_KEY):  # a keys-file admin, and --api-key
        response = post(server, "/v1/adapters/rollback", admin, {"version": 0})
        assert response.status_code == 200, response.text
    assert get(server, "/v1/adapters", keys["alice"]).json()["serving_version"] == response.json()["version"]


def test_metrics_and_docs_need_an_admin_key_by_default(keyed):
    server, keys = keyed
    for path in ("/metrics", "/openapi.json", "/docs"):
        assert_error(get(server, path, keys["alice"]), 403, "permission_denied")
        assert get(server, path, keys["ops"]).status_code == 200
    assert get(server, "/metrics", keys["ops"]).headers["content-type"].startswith("text/plain")


def test_keys_file_is_reloaded_on_change_and_on_sighup(keyed):
    server, keys = keyed
    carol = add_key(server.keys_file, "carol", admin=False)
    deadline = time.monotonic() + 10
    while (status := get(server, "/v1/models", carol).status_code) == 401 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status == 200
    # Revoke carol in a rewrite that keeps the file's mtime (a restored copy, say): only SIGHUP notices it.
    stat = os.stat(server.keys_file)
    server.keys_file.write_text(server.keys_file.read_text().replace(hash_key(carol), hash_key("revoked")))
    os.utime(server.keys_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    time.sleep(1.5)  # the mtime check ran and saw nothing new
    assert get(server, "/v1/models", carol).status_code == 200
    server.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while (status := get(server, "/v1/models", carol).status_code) == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status == 401
    assert get(server, "/v1/models", keys["alice"]).status_code == 200


def test_without_keys_a_non_loopback_address_is_refused(tmp_path: Path):
    cmd = [sys.executable, "-m", "alchemist.cli", "serve", "--host", "0.0.0.0", "--data-dir", str(tmp_path)]
    repo_root = Path(__file__).resolve().parents[2]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=repo_root)
    assert done.returncode == 2 and "--allow-unauthenticated" in done.stderr, done.stderr


def test_without_keys_the_server_says_it_is_loopback_only(server):
    assert "loopback only" in server.log_path.read_text()


def assert_rate_limited(response: httpx.Response) -> None:
    assert_error(response, 429, "rate_limit_exceeded")
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert int(response.headers["retry-after"]) >= 1


def test_request_and_feedback_rates_give_429_with_retry_after(keyed):
    server, keys = keyed
    client = server.client(api_key=keys["hasty"])
    ids = [client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).id for _ in range(2)]
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
    assert info.value.body["type"] == "rate_limit_error" and int(info.value.response.headers["retry-after"]) >= 1
    assert post(server, "/v1/feedback", keys["hasty"], {"response_id": ids[0], "rating": 1}).status_code == 200
    assert_rate_limited(post(server, "/v1/feedback", keys["hasty"], {"response_id": ids[1], "rating": 1}))
    assert ask(server, keys["alice"])  # other keys are not held up


def test_concurrent_streams_per_key_give_429(keyed):
    server, keys = keyed
    client = server.client(api_key=keys["streamer"])
    long = dict(model=MODEL_NAME, messages=HELLO, max_tokens=90, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(stream=True, **long)
    next(iter(first))
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(stream=True, **long)
    assert client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=2).id  # not a stream
    first.close()
    deadline = time.monotonic() + 10
    while True:  # the first stream's slot is free once the server sees the disconnect
        try:
            second = client.chat.completions.create(stream=True, **{**long, "max_tokens": 2})
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert [chunk for chunk in second]


def test_a_record_request_beyond_the_keys_quota_is_served_unrecorded(keyed):
    server, keys = keyed
    server.api_key = keys["ops"]  # metrics() reads /metrics with it

    def recorded_after(key: str) -> float:
        response = server.client(api_key=key).chat.completions.create(
            model=MODEL_NAME, messages=HELLO, max_tokens=2, extra_body={"alchemist": {"record": True}}
        )
        assert response.choices[0].message.content is not None  # served either way
        time.sleep(0.5)
        return next(v for k, v in server.metrics().items() if "recorded_prompts" in k)

    before = recorded_after(keys["frugal"])
    assert recorded_after(keys["frugal"]) == before, "frugal's quota holds no prompt"
    assert recorded_after(keys["alice"]) == before + 1, "alice's (the default quota) does"
