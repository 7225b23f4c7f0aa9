"""The playground: a static page served by the gateway at ``/`` (HTML, vanilla JS and CSS in ``static/``; no
external URL, it works offline).

The page sends the gateway's own ``POST /v1/chat/completions`` with ``stream: true`` and
``"glance": {"stream_rounds": true}``, so every content chunk says which verification round committed it and
how many of its tokens were accepted drafts and which was the bonus token (``app.RoundChunks``); the answer is
shaded round by round as it streams, with live tau and rounds. "Measure" repeats the request with
``"glance": {"measure_speedup": true}`` (embedded backend only) and shows the measured speedup and
``lossless_match``.

The page and its assets are open paths (no API key: they hold no secret); the page asks for the key when the
gateway has one and sends it as ``Authorization: Bearer`` with its requests only.
"""

from __future__ import annotations

import io
from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response

from .errors import APIError

STATIC = Path(__file__).parent / "static"
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
PLAYGROUND_PATHS = {"/", "/playground/info.json", "/playground/demo.png"} | {f"/playground/{name}" for name in ASSETS}
NO_CACHE = {"Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


@router.get("/")
async def page():
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8", headers=NO_CACHE)


@lru_cache(maxsize=1)
def demo_png() -> bytes:
    from .example import example

    buf = io.BytesIO()
    example().image.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


@router.get("/playground/demo.png")
async def demo_image():
    """The demo scene that ``make serve``'s curl example sends (``glance_server.example``)."""
    return Response(demo_png(), media_type="image/png")


@router.get("/playground/info.json")
async def info(request: Request):
    """What the page needs before its first request: the backend (SGLang cannot measure the speedup per
    request), whether an API key is needed, the request limits and the demo question."""
    from .example import example

    gw = request.app.state.gateway
    config = gw.config
    return {"backend": gw.backend.name, "api_key_required": bool(config.keys),
            "measure_speedup": gw.backend.name == "embedded", "max_tokens_limit": config.max_tokens_limit,
            "max_image_bytes": config.max_image_bytes, "demo_prompt": example().prompt}


@router.get("/playground/{name}")  # last: the routes above take their names first
async def asset(name: str):
    if name not in ASSETS:  # only the listed files: no path is ever joined from the request
        raise APIError(404, f"no playground asset {name!r}", "not_found")
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers=NO_CACHE)
