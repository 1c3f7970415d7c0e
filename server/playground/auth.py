"""How a browser opens the playground behind --api-key.

A page load cannot carry a bearer header, so signing in (POST /playground/sign-in, with a key as a
bearer token like any API call) sets an HttpOnly, SameSite=Strict cookie, `Secure` when the sign-in
came over https. The cookie holds a token derived from the key, not the key: it opens the page and
its files (GET of / and /playground/*) and nothing else, and no script can read it. The token carries
its expiry, signed with it, so an old cookie value stops working on the server too, not only in the
browser. The page keeps the key itself in the browser's storage for its origin (scheme, host and
port) and sends it as `Authorization: Bearer` on every API call.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Sequence

from starlette.types import Scope

PAGE_COOKIE = "kvserve_playground"
PAGE_COOKIE_MAX_AGE_S = 12 * 3600
_EXPIRY = re.compile(r"[0-9]{1,12}")


def _mac(page_secret: bytes, expiry: str) -> str:
    return hmac.new(page_secret, expiry.encode(), hashlib.sha256).hexdigest()


def page_token(page_secret: bytes, now: float | None = None) -> str:
    """The cookie's value for one key (its page secret, server/http/access.py): `<expiry>.<HMAC>`, the expiry
    in Unix seconds, PAGE_COOKIE_MAX_AGE_S from now. An HMAC, so the key cannot be recovered from it."""
    expiry = str(int(time.time() if now is None else now) + PAGE_COOKIE_MAX_AGE_S)
    return f"{expiry}.{_mac(page_secret, expiry)}"


def is_valid_page_token(token: str, page_secrets: Sequence[bytes], now: float | None = None) -> bool:
    """Did one of these keys sign the token, and has it not expired? Every key is tried, in constant time."""
    expiry, dot, mac = token.partition(".")
    if not dot or not _EXPIRY.fullmatch(expiry) or int(expiry) < (time.time() if now is None else now):
        return False
    valid = False
    for secret in page_secrets:
        valid |= hmac.compare_digest(mac.encode(), _mac(secret, expiry).encode())
    return valid


def is_page_request(scope: Scope) -> bool:
    """A GET of the playground page or one of its files: the only requests the cookie may authorize."""
    path = scope["path"]
    return scope["method"] == "GET" and (path == "/" or path.startswith("/playground/"))
