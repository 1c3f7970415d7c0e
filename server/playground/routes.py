"""GET / and GET /playground/<file>: the playground page and its assets, from the package itself;
POST /playground/sign-in: the page's cookie behind --api-key (server/playground/auth.py).

Every file is read once, at import, from server/playground/static/: the page works with no network
and no build step, and a request can only name one of those files (no path reaches the disk).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.errors import APIError, clip
from server.http.access import caller_of
from server.http.openapi import page_responses, sign_in_responses
from server.playground.auth import PAGE_COOKIE, PAGE_COOKIE_MAX_AGE_S, page_token

STATIC_DIR = Path(__file__).resolve().parent / "static"
ASSET_PREFIX = "/playground/"
INDEX = "index.html"
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".svg": "image/svg+xml"}
ASSET_TYPES = tuple(_TYPES.values())
# Revalidate each time (the server may have been upgraded); the files are small.
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

router = APIRouter()


def _load_assets(directory: Path) -> dict[str, tuple[bytes, str]]:
    """file name -> (bytes, media type) for every file in the folder."""
    assets = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            media = _TYPES.get(path.suffix)
            if media is None:
                raise ValueError(f"{path}: the playground serves only {', '.join(_TYPES)} files")
            if media.startswith("text/"):
                media += "; charset=utf-8"
            assets[path.name] = (path.read_bytes(), media)
    return assets


ASSETS = _load_assets(STATIC_DIR) if STATIC_DIR.is_dir() else {}


@router.get("/", responses=page_responses("text/html"), response_class=Response)
async def page() -> Response:
    return _asset(INDEX)


@router.get(ASSET_PREFIX + "{name}", responses=page_responses(*ASSET_TYPES), response_class=Response)
async def asset(name: str) -> Response:
    return _asset(name)


@router.post(ASSET_PREFIX + "sign-in", responses=sign_in_responses())
async def sign_in(request: Request) -> JSONResponse:
    """Reached only with a right key (the middleware checks it, as on every route): sets the cookie that
    opens the page in this browser for PAGE_COOKIE_MAX_AGE_S. With no --api-key it sets nothing; the page
    is open anyway. `Secure` when the request came over https: the scope's scheme, which uvicorn takes
    from X-Forwarded-Proto only when the proxy's address is trusted (FORWARDED_ALLOW_IPS, by default
    this machine's loopback)."""
    response = JSONResponse({"signed_in": True})
    secret = caller_of(request).page_secret
    if secret is not None:
        response.set_cookie(
            PAGE_COOKIE,
            page_token(secret),
            max_age=PAGE_COOKIE_MAX_AGE_S,
            path="/",
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
    return response


def _asset(name: str) -> Response:
    found = ASSETS.get(name)
    if found is None:
        raise APIError(404, f"no playground file {clip(name)!r}", code="not_found")
    content, media_type = found
    return Response(content, media_type=media_type, headers=_HEADERS)
