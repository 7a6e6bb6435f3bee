"""The web app's pages and assets are served by the real server process, on the API's port."""

from __future__ import annotations

from alchemist.bench import http_calls
from alchemist.server.web import WEB_DIR, is_public


def test_pages_and_assets_are_served(server):
    for path in ("/", "/dashboard"):
        page = http_calls.get(server.base_url + path, timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.headers["cache-control"] == "no-cache" and "/ui/app.css" in page.text
    for asset in sorted(WEB_DIR.glob("*.js")) + sorted(WEB_DIR.glob("*.css")):
        got = http_calls.get(f"{server.base_url}/ui/{asset.name}", timeout=10)
        assert got.status_code == 200 and got.content == asset.read_bytes()
    missing = http_calls.get(server.base_url + "/ui/missing.js", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


def test_only_the_app_is_public():
    assert all(is_public(p) for p in ("/", "/dashboard", "/ui/chat.js"))
    assert not any(is_public(p) for p in ("/v1/models", "/v1/feedback", "/metrics", "/uix"))
