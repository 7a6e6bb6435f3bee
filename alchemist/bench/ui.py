"""`alchemist bench ui`: the web app's page weight and what painting adds to the time to first token, measured in
chromium (Playwright, driving Debian's /usr/bin/chromium) against `alchemist serve` (started here unless
``--base-url``).

    alchemist bench ui [--base-url http://HOST:PORT] [--rounds 8] [--max-tokens 16] [--json]

- page weight: bytes transferred (response headers and bodies, as the browser's network events count them) when a
  fresh browser context first loads ``/`` and ``/dashboard``, every request they make until ``--settle-s`` after
  the load event included (the model list; the dashboard's first series and adapters);
- time to first token: in each round the same question is asked once through the API (a streamed request, the
  time to its first content chunk, as `bench serve` measures it) and once in the chat page (from the page's
  ``alchemist:send`` mark, set before it sends, to ``alchemist:painted``, set in a task after the frame that first
  showed the answer's words), in alternating order. ``paint_overhead_ms`` is the median of the rounds' differences.
  The prompts are recorded (as the page asks), so that no round gets a prefix-cache hit the other did not.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time

import httpx

from alchemist.bench import http_calls
from alchemist.bench.report import print_rows
from alchemist.bench.serving import start_server, stop_process

PAGES = ("/", "/dashboard")
TTFT_METRIC = "alchemist:time_to_first_token_seconds"
QUESTIONS = (
    "Name a city in France.", "What is two plus two?", "Say hello in Spanish.", "Name a planet.",
    "What color is the sky?", "Name a fruit.", "What is the opposite of hot?", "Name a musical instrument.",
)  # fmt: skip


def page_weight(browser, base_url: str, path: str, settle_s: float) -> dict:
    context = browser.new_context(base_url=base_url)  # empty cache: a first load
    finished = []
    page = context.new_page()
    page.on("requestfinished", lambda request: finished.append(request))
    page.goto(path, wait_until="load")
    page.wait_for_timeout(settle_s * 1000)
    sizes = [r.sizes() for r in finished]
    context.close()
    total = sum(s["responseBodySize"] + s["responseHeadersSize"] for s in sizes)
    return {"page": path, "bytes": total, "kib": round(total / 1024, 1), "requests": len(sizes)}


def api_ttft_ms(client: httpx.Client, body: dict) -> float:
    """The time to the first content chunk of a streamed request, as the client sees it."""
    t0, ttft = time.perf_counter(), None
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():  # all of it, so that the next round starts on an idle server
            if ttft is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    ttft = (time.perf_counter() - t0) * 1000
    if ttft is None:
        raise RuntimeError(f"no content streamed for {body['messages']}")
    return ttft


def page_ttft_ms(page, question: str) -> float:
    page.get_by_role("button", name="New chat").click()
    page.evaluate("performance.clearMarks()")
    page.locator("#prompt").fill(question)
    page.locator("#prompt").press("Enter")
    page.wait_for_function("performance.getEntriesByName('alchemist:painted').length > 0", timeout=120_000)
    page.wait_for_function("document.querySelector('.answer:not([aria-busy])') !== null", timeout=120_000)
    return page.evaluate(
        "performance.getEntriesByName('alchemist:painted')[0].startTime"
        " - performance.getEntriesByName('alchemist:send')[0].startTime"
    )


def server_ttft_ms(client: httpx.Client, run) -> tuple[float, float]:
    """(what ``run()`` returns, the server's own TTFT of the one request it made): the change of /metrics' TTFT
    histogram sum, once its count has grown by one (the server observes a request as it finishes)."""

    def read() -> tuple[float, float]:
        text = client.get("/metrics").text
        value = lambda name: float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))
        return value(TTFT_METRIC + "_sum"), value(TTFT_METRIC + "_count")

    total, count = read()
    result = run()
    deadline = time.monotonic() + 10
    while (now := read())[1] == count:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not count the request's TTFT")
        time.sleep(0.01)
    assert now[1] == count + 1, "one request at a time"
    return result, (now[0] - total) * 1000


def one_round(client: httpx.Client, page, body: dict, api_first: bool) -> tuple[float, float, float, float]:
    """(API TTFT, its server TTFT, the page's painted TTFT, its server TTFT) of one question asked both ways."""
    question = body["messages"][0]["content"]
    via_api = lambda: server_ttft_ms(client, lambda: api_ttft_ms(client, body))
    via_page = lambda: server_ttft_ms(client, lambda: page_ttft_ms(page, question))
    if api_first:
        api = via_api()
        return (*api, *via_page())
    painted = via_page()
    return (*via_api(), *painted)


def latency(browser, base_url: str, rounds: int, max_tokens: int) -> dict:
    model = http_calls.get(base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    context = browser.new_context(base_url=base_url)
    settings = {"maxTokens": max_tokens, "temperature": 0}
    context.add_init_script(f"localStorage.setItem('alchemist.settings', '{json.dumps(settings)}')")
    page = context.new_page()
    page.goto("/")
    client = httpx.Client(base_url=base_url, timeout=120)  # kept alive, as the browser keeps its connection
    rows = []  # (client-side API TTFT, its server TTFT, page's painted TTFT, its server TTFT)
    for i in range(rounds + 1):  # the first round warms both paths up and is not counted
        question = QUESTIONS[i % len(QUESTIONS)]
        body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "alchemist": {"record": True}}  # fmt: skip
        measured = one_round(client, page, body, api_first=i % 2 == 1)
        if i:
            rows.append(measured)
    context.close()
    client.close()
    median = lambda values: round(statistics.median(values), 1)
    return {
        "rounds": rounds,
        "server_ttft_ms_p50": median([r[1] for r in rows] + [r[3] for r in rows]),
        "api_ttft_ms_p50": median([r[0] for r in rows]),
        "page_ttft_ms_p50": median([r[2] for r in rows]),
        "api_overhead_ms": median([r[0] - r[1] for r in rows]),  # client-side TTFT minus the server's own
        "paint_overhead_ms": median([r[2] - r[3] for r in rows]),  # painted in the page minus the server's own
    }


def main(args: argparse.Namespace) -> int:
    from playwright.sync_api import sync_playwright

    process, base_url = None, args.base_url
    if base_url is None:
        data_dir = tempfile.mkdtemp(prefix="alchemist-bench-ui-data-")
        process, api_url = start_server(args, 4, 1024, data_dir)
        base_url = api_url.removesuffix("/v1")
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium)
            weights = [page_weight(browser, base_url, path, args.settle_s) for path in PAGES]
            timing = latency(browser, base_url, args.rounds, args.max_tokens)
            browser.close()
    finally:
        if process is not None:
            stop_process(process)
    print(f"# {base_url}, chromium {args.chromium}", file=sys.stderr)
    print_rows(weights, args.json)
    print_rows([timing], args.json)
    return 0
