"""The front takes a key's limits over all replicas together (issue 43: "the same API, keys, limits"): one key's
request rate is its rate however many replicas serve it, not that many times it. The front's own app, before any
replica: with none ready, a request it admits gets the 503 of no replica, one it refuses the 429 (or 401/403) in
the OpenAI envelope, as one server answers them."""

from __future__ import annotations

from fastapi.testclient import TestClient

from alchemist.config import ServerConfig
from alchemist.scale.front import create_front
from alchemist.scale.replica_set import ReplicaSet
from tests.server.conftest import write_keys

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_keys_limits_hold_at_the_front(tmp_path):
    keys_file = tmp_path / "keys.toml"
    keys = write_keys(keys_file, users=("alice", "bob"))
    config = ServerConfig(api_keys_file=str(keys_file), requests_per_minute=2, feedback_per_minute=1,
                          max_streams_per_key=1)  # fmt: skip
    with TestClient(create_front(ReplicaSet([]), config)) as front:

        def post(path: str, key: str | None, body: dict) -> tuple[int, dict]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = front.post(path, json=body, headers=headers)
            return response.status_code, response.json()

        status, body = post("/v1/chat/completions", None, CHAT)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert post("/v1/chat/completions", "sk-wrong", CHAT)[0] == 401
        # alice's two requests a minute pass the front (no replica is ready: 503), the third is refused there
        assert [post("/v1/chat/completions", keys["alice"], CHAT)[0] for _ in range(2)] == [503, 503]
        status, body = post("/v1/completions", keys["alice"], {"model": "m", "prompt": "hi"})
        assert status == 429 and body["error"]["type"] == "rate_limit_error", body
        assert "'alice'" in body["error"]["message"] and "requests_per_minute" in body["error"]["message"]
        assert front.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {keys['alice']}"}
                          ).headers["retry-after"]  # fmt: skip
        # bob's are his own; a stream he opened and that ended (here: no replica) is closed again
        stream = {**CHAT, "stream": True}
        assert [post("/v1/chat/completions", keys["bob"], stream)[0] for _ in range(2)] == [503, 503]
        # feedback: its own rate
        assert post("/v1/feedback", keys["bob"], {"response_id": "chatcmpl-0", "rating": 1})[0] == 503
        status, body = post("/v1/feedback", keys["bob"], {"response_id": "chatcmpl-0", "rating": 1})
        assert status == 429 and "feedback_per_minute" in body["error"]["message"]
        # the front's own endpoint: admin only, in the envelope
        response = front.get("/v1/replicas", headers={"Authorization": f"Bearer {keys['bob']}"})
        assert response.status_code == 403 and response.json()["error"]["code"] == "permission_denied"
        assert front.get("/v1/replicas", headers={"Authorization": f"Bearer {keys['ops']}"}).json()["data"] == []
