"""A request's hold on the models it uses, from the moment its route picks a model to the last byte of its
answer (a stream's too), so no model is unloaded under a request that is still rendering its prompt or
streaming. The middleware opens one scope per request; a route's `hold` adds to it; the scope's end
releases them all, however the request ended (answered, failed, client gone)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_held: ContextVar[list[Callable[[], None]] | None] = ContextVar("kvserve_model_leases", default=None)


@contextmanager
def lease_scope() -> Iterator[None]:
    """One request's scope: what is held inside is released when it ends."""
    releases: list[Callable[[], None]] = []
    token = _held.set(releases)
    try:
        yield
    finally:
        _held.reset(token)
        for release in reversed(releases):
            release()


def hold(release: Callable[[], None]) -> bool:
    """Release with the current request's end; False outside a request scope (the caller releases)."""
    releases = _held.get()
    if releases is None:
        return False
    releases.append(release)
    return True
