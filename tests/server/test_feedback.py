"""POST /v1/feedback against a real server: responses served to the official openai client, feedback posted with
httpx, and the feedback log read straight from its SQLite file (read-only) while the server runs."""

from __future__ import annotations

import sqlite3
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from alchemist.bench import http_calls
from alchemist.config import Config, EngineConfig, ServerConfig
from alchemist.engine import LLMEngine
from alchemist.feedback.log import decode_ids
from alchemist.runtime import build_around
from alchemist.server.app import create_app
from tests.server.conftest import MODEL_NAME
from tests.server.test_errors import assert_openai_error, assert_still_serving, post_raw

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
FEEDBACK = "/v1/feedback"


def chat(server, messages=CAPITAL, **kwargs):
    kwargs = {"max_tokens": 8, "temperature": 0.0} | kwargs
    return server.client().chat.completions.create(model=MODEL_NAME, messages=messages, **kwargs)


def post_feedback(server, body: dict) -> httpx.Response:
    return http_calls.post(server.base_url + FEEDBACK, json=body, timeout=30)


def log_rows(server) -> list[dict]:
    """Every entry of the server's feedback log, token ids decoded, as another process sees it."""
    uri = f"file:{server.data_dir / 'feedback.sqlite'}?mode=ro"
    with sqlite3.connect(uri, uri=True) as db:
        db.row_factory = sqlite3.Row
        rows = [dict(r) for r in db.execute("SELECT * FROM feedback ORDER BY seq")]
    for row in rows:
        for name in ("prompt_token_ids", "response_token_ids", "output_token_ids", "rejected_token_ids"):
            row[name] = None if row[name] is None else decode_ids(row[name])
    return rows


def feedback_metric(server, kind: str) -> float:
    return server.metrics()[f'alchemist:feedback_total{{kind="{kind}"}}']


def test_a_rating_is_logged_once_however_often_it_is_sent(server, tokenizer):
    served = chat(server)
    before, sft_before = len(log_rows(server)), feedback_metric(server, "sft")
    response = post_feedback(server, {"response_id": served.id, "rating": 1})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "feedback" and body["id"].startswith("fb-")
    assert (body["response_id"], body["kind"], body["created"]) == (served.id, "sft", True)
    rows = log_rows(server)  # committed before the 200
    assert len(rows) == before + 1
    row = rows[-1]
    assert f"fb-{row['seq']}" == body["id"]
    assert row["prompt_token_ids"] == tokenizer.apply_chat_template(CAPITAL)
    assert row["response_token_ids"] == row["output_token_ids"]
    assert len(row["output_token_ids"]) == served.usage.completion_tokens
    assert tokenizer.decode(row["output_token_ids"]) == served.choices[0].message.content
    assert (row["rating"], row["correction"], row["preferred_over"], row["rejected_token_ids"]) == (1, None, None, None)
    assert (row["adapter_version"], row["recorded"]) == (0, 0)

    again = post_feedback(server, {"response_id": served.id, "rating": 1})
    assert again.status_code == 200 and again.json() == body | {"created": False}
    assert len(log_rows(server)) == before + 1
    assert feedback_metric(server, "sft") == sft_before + 1


def test_a_correction_is_learned_as_a_reply_that_stops(server, tokenizer):
    served = chat(server, [{"role": "user", "content": "Say hello."}], max_tokens=64)
    assert served.choices[0].finish_reason == "stop"
    correction = "Hello! How can I help you today?"
    response = post_feedback(server, {"response_id": served.id, "correction": correction, "rating": -1})
    assert response.status_code == 200, response.text
    assert response.json()["kind"] == "sft"  # a correction is what to learn, whatever the rating
    row = log_rows(server)[-1]
    assert row["correction"] == correction and row["rating"] == -1
    assert row["response_token_ids"] == tokenizer.encode(correction) + [row["output_token_ids"][-1]]
    # It ends as the served output ends on a natural stop: with the end-of-turn token, <|im_end|> here.
    assert row["output_token_ids"][-1] == tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.decode(row["response_token_ids"]) == correction


def test_a_bad_rating_is_a_negative_entry(server):
    served = chat(server, extra_body={"alchemist": {"record": True}})
    negative_before = feedback_metric(server, "negative")
    response = post_feedback(server, {"response_id": served.id, "rating": -1})
    assert response.status_code == 200 and response.json()["kind"] == "negative"
    row = log_rows(server)[-1]
    assert row["response_token_ids"] == row["output_token_ids"] and row["recorded"] == 1
    assert feedback_metric(server, "negative") == negative_before + 1


def test_a_preference_keeps_both_outputs(server):
    better, worse = (chat(server, temperature=1.0, seed=seed, max_tokens=6) for seed in (1, 2))
    response = post_feedback(server, {"response_id": better.id, "preferred_over": worse.id})
    assert response.status_code == 200 and response.json()["kind"] == "preference"
    row = log_rows(server)[-1]
    assert row["preferred_over"] == worse.id and row["rating"] is None
    assert len(row["response_token_ids"]) == better.usage.completion_tokens
    assert len(row["rejected_token_ids"]) == worse.usage.completion_tokens
    assert feedback_metric(server, "preference") >= 1


@pytest.fixture(scope="module")
def served_ids(server) -> dict[str, str]:
    other = chat(server, [{"role": "user", "content": "Name a colour."}], max_tokens=2)
    return {"response": chat(server, max_tokens=2).id, "other_prompt": other.id}


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"response_id": "chatcmpl-never-served", "rating": 1}, 404, "response_id"),
        ({"response_id": "{response}", "preferred_over": "chatcmpl-never-served"}, 404, "preferred_over"),
        ({"response_id": "{response}", "preferred_over": "{response}"}, 400, "preferred_over"),
        ({"response_id": "{response}", "preferred_over": "{other_prompt}"}, 400, "preferred_over"),
        ({"response_id": "{response}", "preferred_over": "{other_prompt}", "rating": 1}, 400, None),
        ({"response_id": "{response}", "correction": ""}, 400, "correction"),
        ({"response_id": "{response}", "correction": "  \n\t "}, 400, "correction"),
        ({"response_id": "{response}", "correction": "word " * 1100}, 400, "correction"),  # > the 1024 context
        ({"response_id": "{response}", "rating": 0}, 400, "rating"),
        ({"response_id": "{response}", "rating": 5}, 400, "rating"),
        ({"response_id": "{response}", "rating": "1"}, 400, "rating"),
        ({"response_id": "{response}", "rating": True}, 400, "rating"),
        ({"response_id": "{response}", "rating": 1.0}, 400, "rating"),
        ({"response_id": "{response}"}, 400, None),  # says nothing
        ({"response_id": "{response}", "rating": 1, "score": 0.9}, 400, "score"),  # unknown field
        ({"response_id": "{response}", "rating": 1, "comment": "x" * 10_001}, 400, "comment"),
        ({"response_id": "{response}", "rating": 1, "comment": 3}, 400, "comment"),
        ({"response_id": "{response}", "rating": 1, "metadata": ["a"]}, 400, "metadata"),
        ({"response_id": "{response}", "rating": 1, "metadata": {"k": "v" * 16_400}}, 400, "metadata"),
        ({"response_id": "{response}", "rating": 1, "feedback_id": "fb-12"}, 400, "feedback_id"),
        ({"response_id": "{response}", "rating": 1, "feedback_id": ""}, 400, "feedback_id"),
        ({"rating": 1}, 400, "response_id"),
        ({"response_id": "", "rating": 1}, 400, "response_id"),
        ({"response_id": 7, "rating": 1}, 400, "response_id"),
    ],
)
def test_bad_feedback_is_refused_and_nothing_is_written(server, served_ids, body, status, param):
    body = {k: v.format(**served_ids) if isinstance(v, str) else v for k, v in body.items()}
    before = log_rows(server)
    error = assert_openai_error(post_feedback(server, body), status, param)
    assert error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "response_not_found"
    assert log_rows(server) == before
    assert http_calls.get(server.base_url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("raw", ['{"response_id": "x", "rating": ', "[1, 2]", "null", "rating=1"])
def test_malformed_bodies_are_400(server, raw):
    before = log_rows(server)
    assert_openai_error(post_raw(server, raw, path=FEEDBACK), 400)
    assert log_rows(server) == before


def test_serving_and_feedback_go_on_after_refusals(server):
    assert_still_serving(server)
    response = post_feedback(server, {"response_id": chat(server, max_tokens=2).id, "rating": -1})
    assert response.status_code == 200 and response.json()["created"]


def test_expired_responses_are_404_but_a_logged_submission_still_answers(smollm2, tmp_path):
    engine = LLMEngine(smollm2.model, smollm2.tokenizer, EngineConfig(max_num_seqs=1, max_model_len=128))
    config = Config(server=ServerConfig(data_dir=str(tmp_path), completion_ttl_s=1.0))
    app = create_app(build_around(engine, config, ["m"]))
    request = {"model": "m", "messages": CAPITAL, "max_tokens": 2, "temperature": 0}
    with TestClient(app) as http:
        served = http.post("/v1/chat/completions", json=request).json()
        logged = http.post(FEEDBACK, json={"response_id": served["id"], "rating": 1})
        assert logged.status_code == 200
        time.sleep(1.2)
        expired = http.post(FEEDBACK, json={"response_id": served["id"], "rating": -1})
        assert expired.status_code == 404 and expired.json()["error"]["code"] == "response_not_found"
        retried = http.post(FEEDBACK, json={"response_id": served["id"], "rating": 1})  # a retry of a logged one
        assert retried.status_code == 200 and retried.json() == logged.json() | {"created": False}
    assert app.state.feedback_log.last_seq() == 1
    assert (tmp_path / "feedback.sqlite").exists()


def get_feedback(server, feedback_id: str) -> httpx.Response:
    return http_calls.get(f"{server.base_url}{FEEDBACK}/{feedback_id}", timeout=30)


def test_comment_metadata_and_client_id_are_kept_and_shown(server):
    served = chat(server, max_tokens=4)
    meta = {"source": "open-webui", "chat_id": "c-42", "tags": ["geo"], "nested": {"ok": True}}
    body = {"response_id": served.id, "rating": -1, "comment": "Wrong city.", "metadata": meta,
            "feedback_id": f"ui-{served.id}"}  # fmt: skip
    posted = post_feedback(server, body)
    assert posted.status_code == 200, posted.text
    answer = posted.json()
    seq = int(answer["id"].removeprefix("fb-"))
    shown = {"id": f"fb-{seq}", "object": "feedback", "response_id": served.id, "kind": "negative", "rating": -1,
             "comment": "Wrong city.", "metadata": meta, "feedback_id": body["feedback_id"], "state": "queued",
             "trained_version": None, "skip_reason": None, "quarantine_reason": None}  # fmt: skip
    assert answer == shown | {"created": True, "created_at": answer["created_at"]}
    assert abs(answer["created_at"] - time.time()) < 60
    # GET by the server's id and by the client's: the same entry (this server does not train: it stays queued).
    for key in (answer["id"], body["feedback_id"]):
        got = get_feedback(server, key)
        assert got.status_code == 200 and got.json() == shown | {"created_at": answer["created_at"]}
    row = log_rows(server)[-1]
    assert (row["seq"], row["comment"], row["feedback_id"], row["state"]) == (seq, "Wrong city.", body["feedback_id"],
                                                                               "queued")  # fmt: skip
    # A retry under the client's id is that entry; other content under it is a conflict; nothing more is written.
    before = len(log_rows(server))
    again = post_feedback(server, body)
    assert again.status_code == 200 and again.json() == answer | {"created": False}
    conflict = post_feedback(server, body | {"comment": "Wrong country."})
    error = assert_openai_error(conflict, 409, "feedback_id")
    assert error["code"] == "feedback_id_conflict" and answer["id"] in error["message"]
    assert len(log_rows(server)) == before


def test_feedback_without_the_new_fields_shows_them_empty(server):
    served = chat(server, max_tokens=3)
    answer = post_feedback(server, {"response_id": served.id, "rating": 1}).json()
    got = get_feedback(server, answer["id"]).json()
    assert (got["comment"], got["metadata"], got["feedback_id"], got["state"]) == (None, None, None, "queued")
    assert got == {k: v for k, v in answer.items() if k != "created"}


@pytest.mark.parametrize("key", ["fb-999999", "never-sent", "fb-x"])
def test_unknown_feedback_is_404(server, key):
    error = assert_openai_error(get_feedback(server, key), 404, "id")
    assert error["code"] == "feedback_not_found"


def test_the_list_pages_through_entries_and_shows_the_backlog(server):
    """This server does not train: everything stays queued, and the backlog counts it by class."""
    served = [chat(server, [{"role": "user", "content": f"Count to {i}."}], max_tokens=2) for i in range(3)]
    ids = [post_feedback(server, {"response_id": s.id, "rating": 1}).json()["id"] for s in served]
    everything = http_calls.get(server.base_url + FEEDBACK, params={"limit": 1000}, timeout=30).json()
    assert everything["object"] == "list" and not everything["has_more"]
    assert [e["id"] for e in everything["data"]][-3:] == ids
    assert everything["backlog"]["thumbs_up"]["count"] == sum(
        e["state"] == "queued" and e["kind"] == "sft" and e["rating"] == 1 for e in everything["data"]
    )  # fmt: skip
    assert set(everything["backlog"]) == {"correction", "thumbs_up", "thumbs_down", "preference"}
    after = int(ids[0].removeprefix("fb-")) - 1
    page = http_calls.get(server.base_url + FEEDBACK, params={"after": f"fb-{after}", "limit": 2, "state": "queued"},
                          timeout=30).json()  # fmt: skip
    assert [e["id"] for e in page["data"]] == ids[:2] and page["has_more"]
    assert http_calls.get(server.base_url + FEEDBACK, params={"state": "trained"}, timeout=30).json()["data"] == []


@pytest.mark.parametrize("params, param", [({"state": "done"}, "state"), ({"after": "x"}, "after"),
                                           ({"limit": 0}, "limit"), ({"limit": 1001}, "limit")])  # fmt: skip
def test_bad_list_queries_are_400(server, params, param):
    assert_openai_error(http_calls.get(server.base_url + FEEDBACK, params=params, timeout=30), 400, param)
