"""The web app, a chat that takes feedback and a learning dashboard: static files shipped in the package
(``alchemist/server/web/``), served on the API's port. Pages are ``/`` and ``/dashboard``, their assets under
``/ui/``; all public (the API calls they make carry the key the person typed in)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB_DIR = Path(__file__).parent / "web"
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
PUBLIC_PREFIXES = ("/ui/",)  # with PAGES: what needs no API key


def mount_web(app: FastAPI) -> None:
    app.mount("/ui", StaticFiles(directory=WEB_DIR), name="ui")
    for path, name in PAGES.items():
        app.add_api_route(path, _page(WEB_DIR / name), methods=["GET"], include_in_schema=False)


def _page(file: Path):
    async def page() -> FileResponse:
        # Revalidated on every load (a 304 when unchanged), so a new version's page is never served stale.
        return FileResponse(file, media_type="text/html", headers={"Cache-Control": "no-cache"})

    return page


def is_public(path: str) -> bool:
    return path in PAGES or path.startswith(PUBLIC_PREFIXES)
