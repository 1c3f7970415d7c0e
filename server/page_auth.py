"""How a browser opens the playground behind --api-key.

A page load cannot carry a bearer header, so signing in (POST /playground/sign-in, with the key as a
bearer token like any API call) sets an HttpOnly, SameSite=Strict cookie. The cookie holds a token
derived from the key, not the key: it opens the page and its files (GET of / and /playground/*) and
nothing else, and no script can read it. The page keeps the key itself in the browser's storage for
its origin (scheme, host and port) and sends it as `Authorization: Bearer` on every API call.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import Scope

PAGE_COOKIE = "kvserve_playground"
_PAGE_TOKEN_LABEL = b"kvserve playground page"


def page_token(api_key: bytes) -> str:
    """The cookie's value for this key: an HMAC, so the key cannot be recovered from it."""
    return hmac.new(api_key, _PAGE_TOKEN_LABEL, hashlib.sha256).hexdigest()


def is_page_request(scope: Scope) -> bool:
    """A GET of the playground page or one of its files: the only requests the cookie may authorize."""
    path = scope["path"]
    return scope["method"] == "GET" and (path == "/" or path.startswith("/playground/"))
