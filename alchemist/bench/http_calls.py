"""``httpx.get`` / ``post`` / ``stream`` as the benchmarks and tests call the server they measure, with one TLS
context for all of them: each call makes a new client, which otherwise loads the CA bundle again (25 ms of CPU on a
Zen 4), and the waits and samplers that poll a server several times a second took that from the server itself (a
profile of tests/server/test_online.py: 21 s of its client's 243 s).

    from alchemist.bench import http_calls
    http_calls.get(url + "/health", timeout=1)
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

TLS = ssl.create_default_context()  # what httpx loads per client, loaded once


def get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, verify=TLS, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(url, verify=TLS, **kwargs)


@contextmanager
def stream(method: str, url: str, **kwargs: Any) -> Iterator[httpx.Response]:
    with httpx.stream(method, url, verify=TLS, **kwargs) as response:
        yield response
