"""A request's hold on the models it uses, from the moment its route picks a model to the last byte of its
answer (a stream's too), so no model is unloaded under a request that is still rendering its prompt or
streaming. The middleware opens one scope per request; a route's `hold` adds to it; the scope's end
releases them all, however the request ended (answered, failed, client gone). The scope also adds up how long
the request waited for models to load (Ollama's answers report it as `load_duration`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_held: ContextVar[list[Callable[[], None]] | None] = ContextVar("kvserve_model_leases", default=None)
_load_waits: ContextVar[list[int] | None] = ContextVar("kvserve_model_load_waits", default=None)


@contextmanager
def lease_scope() -> Iterator[None]:
    """One request's scope: what is held inside is released when it ends."""
    releases: list[Callable[[], None]] = []
    token = _held.set(releases)
    waits = _load_waits.set([])
    try:
        yield
    finally:
        _held.reset(token)
        _load_waits.reset(waits)
        for release in reversed(releases):
            release()


def hold(release: Callable[[], None]) -> bool:
    """Release with the current request's end; False outside a request scope (the caller releases)."""
    releases = _held.get()
    if releases is None:
        return False
    releases.append(release)
    return True


def note_load_wait(nanoseconds: int) -> None:
    """The current request waited this long for a model to load (nothing outside a request scope)."""
    waits = _load_waits.get()
    if waits is not None:
        waits.append(nanoseconds)


def load_wait_ns() -> int:
    """How long the current request has waited for models to load, in nanoseconds (0: none was loading)."""
    return sum(_load_waits.get() or ())
