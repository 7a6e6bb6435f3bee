"""The web app in a real browser: Playwright (the PyPI package) driving Debian's chromium (/usr/bin/chromium, no
browser download) against a real `alchemist serve` process on the default model, training on with mini-batches of
one so that a correction trains within seconds. One server per module, one browser per session; every page fails
its test on a console error or an uncaught exception."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from alchemist.bench.serving import stop_process
from alchemist.model.loader import hf_dir_for, read_config
from alchemist.model.lora import LoraAdapter, LoraConfig
from alchemist.model.peft_format import save_adapter
from tests.server.conftest import ServerProcess, launch_server, wait_ready

CHROMIUM = "/usr/bin/chromium"  # `apt-get install chromium` (make install-test)
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "ui"  # screenshots, kept by CI
MAX_TOKENS = 24  # per answer: short answers keep the tests fast on a CPU
FLAGS = [
    *("--max-num-seqs", "4", "--max-model-len", "1024"),
    *("--train-batch-size", "1", "--train-max-wait-s", "1", "--train-epochs", "1"),
]
# Before the page's scripts, on every load: short answers, and whatever else the test set stays.
SETTINGS_SCRIPT = f"""
const stored = JSON.parse(localStorage.getItem("alchemist.settings") || "{{}}");
localStorage.setItem("alchemist.settings", JSON.stringify({{...stored, maxTokens: {MAX_TOKENS}}}));
"""


ADAPTER = "team-a"  # a named adapter the server also serves (--lora-modules): the chat's choice of who answers


@pytest.fixture(scope="module")
def web_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_dir = tmp_path_factory.mktemp("web-server")
    model_config = read_config(hf_dir_for(None))
    save_adapter(LoraAdapter(model_config, LoraConfig(r=4, alpha=8), seed=3), log_dir / ADAPTER)
    flags = [*FLAGS, "--lora-modules", f"{ADAPTER}={log_dir / ADAPTER}"]
    server = launch_server("web", log_dir, log_dir / "data", flags, dtype="auto")  # the default dtype: bf16 where fast
    try:
        wait_ready(server)
        yield server
    finally:
        stop_process(server.process)


# Module scope: Playwright's sync API holds an asyncio loop running on the main thread while it lives, and a test
# that a pytest-xdist worker runs after this module (asyncio.run, in tests/runtime) must not find it running.
@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


@pytest.fixture
def open_page(browser: Browser, web_server: ServerProcess) -> Iterator[Callable[..., Page]]:
    """``open_page(width, height)``: a fresh page (its own storage) of that viewport at the server's base URL."""
    contexts, errors = [], []

    def open_(width: int = 1280, height: int = 800) -> Page:
        context = browser.new_context(viewport={"width": width, "height": height}, base_url=web_server.base_url)
        context.add_init_script(SETTINGS_SCRIPT)
        contexts.append(context)
        page = context.new_page()
        page.on("console", lambda m: errors.append(f"console: {m.text} at {m.location}") if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
        page.set_default_timeout(60_000)
        return page

    yield open_
    for context in contexts:
        context.close()
    assert errors == [], errors
