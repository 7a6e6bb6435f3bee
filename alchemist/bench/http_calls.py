"""``httpx.get`` / ``post`` / ``stream`` as the benchmarks and tests call the server they measure, with one TLS
context for all of them: each call makes a new client, which otherwise loads the CA bundle again, and the waits and
samplers that poll a server several times a second took that CPU from the server itself (docs/benchmarks.md, "A new
HTTP client per call").

    from alchemist.bench import http_calls
    http_calls.get(url + "/health", timeout=1)
"""

from __future__ import annotations

import ssl
from contextlib import AbstractContextManager
from typing import Any

import httpx

TLS = ssl.create_default_context()  # what httpx loads per client, loaded once


def get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, verify=TLS, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(url, verify=TLS, **kwargs)


def stream(method: str, url: str, **kwargs: Any) -> AbstractContextManager[httpx.Response]:
    return httpx.stream(method, url, verify=TLS, **kwargs)
