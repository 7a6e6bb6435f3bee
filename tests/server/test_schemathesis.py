"""Schemathesis over the live server's OpenAPI: generated requests, valid and invalid, to every documented route
of a real `alchemist serve` process (training on, so rollbacks are real). No 5xx, every status documented, every
error in the OpenAI envelope, every JSON response valid against its schema.

Bounded: a context of 80 tokens (a generated request decodes at most ~50 tokens), the coverage phase off, at most
MAX_EXAMPLES fuzzed cases per operation; about a minute in all on two cores.
"""

from __future__ import annotations

import itertools

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi import checks as openapi_checks

from alchemist.bench import http_calls
from tests.server.conftest import MODEL_NAME, launch_server, wait_ready, write_keys

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

MAX_EXAMPLES = 25
FLAGS = ["--max-num-seqs", "2", "--max-model-len", "80", "--max-body-bytes", "16384", "--train-max-wait-s", "1"]


def config(mode: str) -> schemathesis.Config:
    generation = {"max-examples": MAX_EXAMPLES, "mode": mode}
    return schemathesis.Config.from_dict({"phases": {"coverage": {"enabled": False}}, "generation": generation})


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("schemathesis")
    keys = write_keys(root / "keys.toml")
    server = launch_server("schemathesis", root, root / "data", [*FLAGS, "--api-keys-file", str(root / "keys.toml")])
    server.api_key = keys["ops"]  # an admin key: every route is open to it
    try:
        wait_ready(server)
        yield server
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)


@pytest.fixture(scope="module")
def valid_requests(live):
    return schemathesis.openapi.from_url(
        live.base_url + "/openapi.json", config=config("positive"), headers=live.headers
    )


@pytest.fixture(scope="module")
def invalid_requests(live):
    return schemathesis.openapi.from_url(
        live.base_url + "/openapi.json", config=config("negative"), headers=live.headers
    )


def test_rollback_to_the_base_model_before_any_checkpoint(live):
    """Runs first: the fresh server has no adapter version yet. Rolling back to 0 publishes version 1."""
    response = http_calls.post(
        live.base_url + "/v1/adapters/rollback", json={"version": 0}, headers=live.headers, timeout=30
    )
    assert response.status_code == 200, response.text
    assert response.json()["version"] == 1 and response.json()["metrics"] == {"rollback_of": 0}
    listing = http_calls.get(live.base_url + "/v1/adapters", headers=live.headers, timeout=30).json()
    assert listing["serving_version"] == 1


def test_the_schema_documents_errors_not_422_and_metrics_as_text(live):
    spec = http_calls.get(live.base_url + "/openapi.json", headers=live.headers, timeout=30).json()
    envelope = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            for status, response in responses.items():
                if int(status) >= 400:
                    assert response["content"]["application/json"]["schema"] == envelope, (method, path, status)
    assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert {"400", "404", "413", "429"} <= set(spec["paths"]["/v1/chat/completions"]["post"]["responses"])


@schemathesis.check
def openai_error_envelope(ctx, response, case) -> None:
    """Every error answers {"error": {"message", "type", "param", "code"}} and nothing else."""
    if response.status_code < 400:
        return
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


CALLS = itertools.count()
CHECKS = [
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_headers_conformance,
    openapi_checks.response_schema_conformance,
    openai_error_envelope,
]


@schemathesis.pytest.from_fixture("valid_requests").parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_valid_requests(case, live):
    check_case(case, live)


@schemathesis.pytest.from_fixture("invalid_requests").include(method="POST").parametrize()  # GETs take no input
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_invalid_requests(case, live):
    check_case(case, live)


def check_case(case, live) -> None:
    # Random model names all get a 404; every other body names the served model, so that answers get generated.
    if isinstance(case.body, dict) and "model" in case.body and next(CALLS) % 2:
        case.body["model"] = MODEL_NAME
    response = case.call(base_url=live.base_url, headers=live.headers, timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text}"
    case.validate_response(response, checks=CHECKS)
