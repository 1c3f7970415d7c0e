"""Who sent a request: which of the server's API keys it carries, whether that key is an admin's, and
the prefix-cache namespace its requests get (docs/serving/reliability.md, "Isolation between clients").

The middleware (server/http/middleware.py) checks the bearer token against every key in constant time and
puts the request's `Caller` in its scope state; routes read it with `caller_of(request)`.

- Admin: on a server with no key (open, a single user) everyone; else the --admin-api-key keys, or,
  with none of those, the one --api-key when there is just one (a single-user server, as before).
  With several keys and no admin key, no one. Only an admin reads the prefix-cache counters of
  /metrics and the per-block and per-sequence detail of /kv_cache: both tell whether a prompt someone
  else sent is cached.
- Prefix-cache namespace (--prefix-cache-scope api-key, the default): a cached prefix answers many
  times faster, so a client that can guess another's prompt could learn by timing whether it was
  sent. Each key's requests therefore hash their prefix blocks under a salt derived from the key (an
  HMAC), folded with the request's own cache_salt: equal prompts under different keys never share a
  block. With one key (or none) this changes nothing. `shared`: the request's cache_salt alone.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request

PREFIX_CACHE_SCOPES = ("shared", "api-key")
_NAMESPACE_LABEL = b"kvserve prefix-cache namespace"
_PAGE_LABEL = b"kvserve playground page"


@dataclass(frozen=True)
class Caller:
    """The sender of one request, as far as the server tells senders apart.

    cache_namespace: the secret its prefix-cache salts derive from (None: the request's cache_salt as sent).
    page_secret: what signs its playground cookie (server/playground/auth.py); None on an open server.
    """

    is_admin: bool
    cache_namespace: bytes | None = None
    page_secret: bytes | None = None

    def cache_salt(self, requested: str | None) -> str | None:
        """The salt the engine folds into this request's prefix-block hashes."""
        if self.cache_namespace is None:
            return requested
        # A leading 0 or 1 tells "no salt" from a salt: no request salt can stand for another's absence.
        message = b"\x00" if requested is None else b"\x01" + requested.encode()
        return hmac.new(self.cache_namespace, message, hashlib.sha256).hexdigest()


# Anyone, on a server with no API key.
OPEN_CALLER = Caller(is_admin=True)


def _digest(text: str) -> bytes:
    # Compared as digests: every comparison then has one length, whatever the key's.
    return hashlib.sha256(text.encode()).digest()


class ApiKeys:
    """The server's keys, ready to check bearer tokens against; no keys: an open server."""

    def __init__(
        self, keys: Sequence[str], admin_keys: Sequence[str] = (), prefix_cache_scope: str = "api-key"
    ) -> None:
        """keys: every key the server accepts (admin keys included); admin_keys: those with admin rights."""
        if prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"prefix_cache_scope must be one of {PREFIX_CACHE_SCOPES}, got {prefix_cache_scope!r}")
        admins = set(admin_keys)
        sole_key_is_admin = not admins and len(keys) == 1
        self._keys: list[tuple[bytes, Caller]] = []  # (the key's digest, its caller)
        for key in keys:
            secret = key.encode()
            caller = Caller(
                is_admin=key in admins or sole_key_is_admin,
                cache_namespace=(
                    hmac.new(secret, _NAMESPACE_LABEL, hashlib.sha256).digest()
                    if prefix_cache_scope == "api-key"
                    else None
                ),
                page_secret=hmac.new(secret, _PAGE_LABEL, hashlib.sha256).digest(),
            )
            self._keys.append((_digest(key), caller))

    @property
    def is_open(self) -> bool:
        """No key configured: every request is let in, as an admin."""
        return not self._keys

    @property
    def page_secrets(self) -> tuple[bytes, ...]:
        """Each key's playground-cookie secret (server/playground/auth.py)."""
        return tuple(caller.page_secret for _, caller in self._keys if caller.page_secret is not None)

    def caller_for(self, token: str) -> Caller | None:
        """The caller a bearer token stands for; None: no key matches. Takes the same time whichever key
        matches, or none: every key is compared, in constant time."""
        digest = _digest(token)
        found = None
        for key_digest, caller in self._keys:
            if hmac.compare_digest(digest, key_digest):
                found = caller
        return found


def caller_of(request: Request) -> Caller:
    """The request's caller, as the middleware found it (an app without it is open)."""
    return request.scope.get("state", {}).get("caller", OPEN_CALLER)


def request_cache_salt(request: Request, requested: str | None) -> str | None:
    """The cache_salt a generation route passes to SamplingParams for this request."""
    return caller_of(request).cache_salt(requested)


def parse_keys(text: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c'): one --api-key value or KVSERVE_API_KEY, a comma-separated list."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def read_key_file(path: str | Path) -> tuple[str, ...]:
    """One key per line; blank lines and lines starting with '#' are skipped. A file with no key is an
    error: a server meant to be behind keys must not start open."""
    keys = tuple(_key_lines(Path(path).read_text().splitlines()))
    if not keys:
        raise ValueError(f"{path}: no API key in the file (one key per line; '#' starts a comment line)")
    return keys


def _key_lines(lines: Iterable[str]) -> Iterable[str]:
    for line in lines:
        key = line.strip()
        if key and not key.startswith("#"):
            yield key
