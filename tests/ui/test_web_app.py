"""The chat and the dashboard, driven in chromium against a real server (tests/ui/conftest.py): answers stream in,
feedback given in the page reaches the API and is trained, the dashboard shows the new version, the keyboard alone
gets through a chat and a correction, and both pages fit a desktop and a 375 px phone (screenshots in
artifacts/ui/)."""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Callable

import pytest
from playwright.sync_api import Page, expect

from alchemist.bench import http_calls
from tests.server.conftest import ServerProcess
from tests.ui.conftest import ADAPTER, ARTIFACTS

pytestmark = pytest.mark.slow  # scheduled first (tests/conftest.py)

TRAIN_TIMEOUT_MS = 240_000


def ask(page: Page, question: str) -> None:
    page.locator("#prompt").fill(question)
    page.locator("#prompt").press("Enter")


def wait_answers(page: Page, count: int) -> None:
    """Until ``count`` answers have finished streaming."""
    page.wait_for_function(
        "n => document.querySelectorAll('.answer[data-response-id]:not([aria-busy])').length >= n", arg=count
    )


def feedback_entry(server: ServerProcess, feedback_id: str) -> dict:
    response = http_calls.get(f"{server.base_url}/v1/feedback/{feedback_id}", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def test_reply_streams_and_a_correction_trains_into_a_new_version(open_page, web_server):
    page = open_page()
    page.goto("/")
    page.evaluate("""() => {
        window.lengths = [];  // the answer's length at each change of the page
        new MutationObserver(() => {
            const text = document.querySelector('.answer .text');
            if (text) window.lengths.push(text.textContent.length);
        }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
    }""")
    ask(page, "What is the codename of the Tessaro project?")
    wait_answers(page, 1)
    lengths = [n for n in page.evaluate("window.lengths") if n > 0]
    assert len(set(lengths)) >= 3, lengths  # painted piece by piece, not at once
    answer = page.locator(".answer").first
    expect(answer.locator(".version")).to_have_text("v0")
    expect(answer.locator(".adapter")).to_be_hidden()  # the base model's shared adapter: no name shown
    response_id = answer.get_attribute("data-response-id")

    page.get_by_role("button", name="Bad answer").click()
    page.get_by_label("Comment (optional)").fill("it made that up")
    page.get_by_label("How it should read").fill("The codename of the Tessaro project is Bluefin.")
    page.get_by_role("button", name="Send feedback").click()
    chip = page.locator(".state").first
    expect(chip).to_contain_text("correction")
    entry = feedback_entry(web_server, chip.get_attribute("data-feedback-id"))
    assert (entry["response_id"], entry["kind"], entry["rating"]) == (response_id, "sft", -1)
    assert entry["comment"] == "it made that up"

    expect(chip).to_have_text(re.compile(r"correction · trained in v\d+"), timeout=TRAIN_TIMEOUT_MS)
    version = int(re.search(r"v(\d+)", chip.inner_text()).group(1))
    assert version >= 1 and feedback_entry(web_server, entry["id"])["trained_version"] == version
    ask(page, "And who leads it?")  # the next answer comes from the new version
    wait_answers(page, 2)
    assert int(page.locator(".answer .version").nth(1).inner_text()[1:]) >= version

    dashboard = open_page()
    dashboard.goto("/dashboard")
    expect(dashboard.locator(f'#timeline li[data-version="{version}"]')).to_be_visible()
    expect(dashboard.locator("#serving")).to_contain_text(f"Serving v{version}")
    dashboard.once("dialog", lambda dialog: dialog.accept())
    dashboard.get_by_role("button", name="Roll back to v0").click()  # a rollback is published as a new version
    expect(dashboard.locator("#serving")).to_contain_text(f"Serving v{version + 1}")
    expect(dashboard.locator(f'#timeline li[data-version="{version + 1}"]')).to_contain_text("rollback to v0")


def test_the_dashboard_has_a_row_per_adapter_and_rolls_back_the_one_chosen(open_page, web_server):
    """The adapters table (GET /v1/adapters/summary): the shared adapter and team-a, each with the version it serves,
    its training and its backlog; choosing team-a shows its own versions (no base model among them), and its
    rollback button rolls team-a back, not the shared adapter."""
    question = [{"role": "user", "content": "Who makes the Tessaro?"}]
    reply = http_calls.post(web_server.base_url + "/v1/chat/completions", timeout=120,
                            json={"model": ADAPTER, "messages": question, "max_tokens": 8})  # fmt: skip
    sent = http_calls.post(web_server.base_url + "/v1/feedback", timeout=30, json={
        "response_id": reply.json()["id"], "correction": "Bluefin makes the Tessaro."})  # fmt: skip
    assert sent.status_code == 200, sent.text
    wait_for(lambda: feedback_entry(web_server, sent.json()["id"])["state"] != "queued")  # a new version of team-a
    wait_for(lambda: all(row["backlog"] == 0 for row in adapters_summary(web_server)))  # earlier tests' feedback
    shared, team = adapters_summary(web_server)
    versions = http_calls.get(web_server.base_url + "/v1/adapters", params={"adapter": ADAPTER}, timeout=10).json()
    assert (shared["adapter"], team["adapter"], team["serving_version"]) == (None, ADAPTER, versions["serving_version"])
    assert len(versions["data"]) >= 2 and versions["data"][-1]["version"] == 1  # its version 1: as loaded
    target = next(v["version"] for v in versions["data"] if not v["serving"])
    rolled = versions["data"][0]["version"] + 1  # a rollback is published as a new version

    page = open_page()
    page.goto("/dashboard")
    rows = page.locator("#adapters tbody tr")
    expect(rows).to_have_count(2)
    for i, data in enumerate((shared, team)):
        row = rows.nth(i)
        expect(row).to_have_attribute("data-adapter", data["adapter"] or "")
        expect(row.locator(".serving")).to_have_text(f"v{data['serving_version']}")
        expect(row.locator(".training")).to_have_text("on")
        expect(row.locator(".backlog")).to_have_text("0")
        expect(row.locator(".residence")).to_have_text("in the engine")  # a trained adapter is never paged out
    expect(rows.nth(0).get_by_role("button")).to_have_attribute("aria-pressed", "true")
    expect(page.locator("#versions-of")).to_have_text("the shared adapter")

    rows.nth(1).get_by_role("button", name=ADAPTER).click()
    expect(rows.nth(1).get_by_role("button")).to_have_attribute("aria-pressed", "true")
    expect(page.locator("#versions-of")).to_have_text(ADAPTER)
    expect(page.locator("#serving")).to_contain_text(f"Serving v{team['serving_version']}")
    expect(page.locator("#timeline li")).to_have_count(len(versions["data"]))  # a named adapter has no v0
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name=f"Roll back to v{target}").click()
    expect(page.locator("#serving")).to_contain_text(f"Serving v{rolled}")
    expect(page.locator(f'#timeline li[data-version="{rolled}"]')).to_contain_text(f"rollback to v{target}")
    expect(rows.nth(1).locator(".serving")).to_have_text(f"v{rolled}")
    expect(rows.nth(0).locator(".serving")).to_have_text(f"v{shared['serving_version']}")  # the shared one as was
    assert adapters_summary(web_server)[0]["serving_version"] == shared["serving_version"]


def adapters_summary(server: ServerProcess) -> list[dict]:
    response = http_calls.get(server.base_url + "/v1/adapters/summary", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["data"]


def wait_for(done: Callable[[], bool], timeout_s: float = TRAIN_TIMEOUT_MS / 1000) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_the_bar_chooses_who_answers_and_the_answer_names_its_adapter(open_page, web_server):
    """The bar lists what the key may ask (GET /v1/models: the base model, then the adapters); an answer asked of
    an adapter is written by it (the response's ``model``) and says so."""
    page = open_page()
    page.goto("/")
    choice = page.get_by_label("Model")
    expect(choice.locator("option")).to_have_text([web_server_model(web_server), ADAPTER])
    choice.select_option(ADAPTER)
    ask(page, "Say hello.")
    wait_answers(page, 1)
    answer = page.locator(".answer").first
    expect(answer.locator(".adapter")).to_have_text(ADAPTER)
    expect(answer.locator(".adapter")).to_have_attribute("title", f"Written by the adapter {ADAPTER}")


def web_server_model(server: ServerProcess) -> str:
    return http_calls.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_regenerate_and_choose_makes_a_preference(open_page, web_server):
    page = open_page()
    page.goto("/")
    ask(page, "Name a fruit.")
    wait_answers(page, 1)
    first = page.locator(".answer").first.get_attribute("data-response-id")
    page.get_by_role("button", name="Regenerate").click()
    wait_answers(page, 2)
    second = page.locator(".answer").nth(1).get_attribute("data-response-id")
    page.get_by_role("button", name="B is better").click()
    chip = page.locator(".state", has_text="preference")
    expect(chip).to_be_visible()
    expect(page.locator(".answer")).to_have_count(1)  # the chosen one stays
    entry = feedback_entry(web_server, chip.get_attribute("data-feedback-id"))
    assert (entry["kind"], entry["response_id"]) == ("preference", second)
    with sqlite3.connect(f"file:{web_server.data_dir / 'feedback.sqlite'}?mode=ro", uri=True) as log:
        (worse,) = log.execute("SELECT preferred_over FROM feedback WHERE seq = ?", (int(entry["id"][3:]),)).fetchone()
    assert worse == first


def test_keyboard_alone_chats_and_corrects(open_page, web_server):
    page = open_page()
    page.goto("/")
    expect(page.locator("#prompt")).to_be_focused()
    page.keyboard.type("Name a color.")
    page.keyboard.press("Enter")
    wait_answers(page, 1)
    expect(page.locator("#prompt")).to_be_focused()  # back in the box, ready for the next question
    for _ in range(6):  # back from the box: the answer's buttons, last first
        page.keyboard.press("Shift+Tab")
        if page.evaluate("document.activeElement.textContent") == "Edit":
            break
    assert page.evaluate("document.activeElement.textContent") == "Edit"
    assert page.evaluate("getComputedStyle(document.activeElement).outlineStyle") != "none"  # focus is visible
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.name") == "correction"
    page.keyboard.press("Control+A")
    page.keyboard.type("My favourite color is ultramarine blue.")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Send feedback"
    page.keyboard.press("Enter")
    chip = page.locator(".state", has_text="correction")
    expect(chip).to_be_visible()
    entry = feedback_entry(web_server, chip.get_attribute("data-feedback-id"))
    assert entry["kind"] == "sft" and entry["rating"] is None
    assert page.evaluate("document.activeElement.textContent") == "Edit"  # focus returns to where it was


def test_both_pages_fit_desktop_and_phone_widths(open_page):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for width, height in ((1280, 800), (375, 740)):
        check_pages_at(open_page(width, height), width)


def check_pages_at(page: Page, width: int) -> None:
    sent = []
    page.on("request", lambda r: sent.append(r.headers.get("authorization")) if "/chat/" in r.url else None)
    page.goto("/")
    page.get_by_text("Settings").click()  # the key is asked for, and kept in this browser
    page.locator("#api-key").fill("sk-ui-test")
    page.locator("#api-key").press("Tab")
    page.get_by_text("Settings").click()
    ask(page, "Say hello.")
    wait_answers(page, 1)
    assert sent == ["Bearer sk-ui-test"]
    for locator in (
        page.get_by_role("link", name="Chat"), page.get_by_role("link", name="Dashboard"),
        page.get_by_text("Settings"), page.locator("#prompt"), page.locator("#send"), page.locator(".answer"),
        page.get_by_role("button", name="Bad answer"), page.get_by_role("button", name="Regenerate"),
    ):  # fmt: skip
        expect(locator).to_be_in_viewport()
    assert page.evaluate("document.scrollingElement.scrollWidth") <= width  # no sideways scrolling
    page.screenshot(path=ARTIFACTS / f"chat-{width}.png")

    page.goto("/dashboard")
    expect(page.locator(".chart polyline").first).to_be_attached()  # a series has points
    for locator in (page.locator("#timeline li").first, page.locator("figure.chart").first):
        expect(locator).to_be_in_viewport()
    assert page.evaluate("document.scrollingElement.scrollWidth") <= width
    page.screenshot(path=ARTIFACTS / f"dashboard-{width}.png")
    assert page.evaluate("JSON.parse(localStorage.getItem('alchemist.settings')).apiKey") == "sk-ui-test"


def test_bench_ui_measures_page_weight_and_painted_ttft(browser, web_server):
    from alchemist.bench.ui import latency, page_weight

    weight = page_weight(browser, web_server.base_url, "/", settle_s=0.5)
    assert 5_000 < weight["bytes"] < 300_000 and weight["requests"] >= 4  # the page, css, 2 scripts, the models
    timing = latency(browser, web_server.base_url, rounds=1, max_tokens=4)
    assert timing["server_ttft_ms_p50"] > 0 and timing["page_ttft_ms_p50"] > 0
    assert timing["paint_overhead_ms"] > 0 and timing["api_overhead_ms"] > 0
