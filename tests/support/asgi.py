"""A raw ASGI request scope, for tests that drive the app directly to time a disconnect exactly."""

from __future__ import annotations


def post_scope(path: str, payload: bytes, spec_version: str = "2.3") -> dict:
    """The scope of a JSON POST to `path` with a body of `payload`."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
    }


def post_and_leave(app, path: str, payload: bytes, leave_when) -> list[dict]:
    """POST `payload` to `path` through the ASGI app and disconnect once `leave_when` (an asyncio.Event
    the app's fake engine sets) is set; returns every message the app sent."""
    import asyncio

    return asyncio.run(post_and_leave_async(app, path, payload, leave_when))


async def post_and_leave_async(app, path: str, payload: bytes, leave_when, timeout: float = 10) -> list[dict]:
    """post_and_leave inside a running event loop (an app whose lifespan the caller runs)."""
    import asyncio

    is_body_read = False

    async def receive() -> dict:
        nonlocal is_body_read
        if not is_body_read:
            is_body_read = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await leave_when.wait()
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(post_scope(path, payload), receive, send), timeout=timeout)
    return sent


class SilentEncoder:
    """An AsyncEncoder stand-in whose answer never comes: embed() waits until it is cancelled, and counts that."""

    is_healthy = True

    def __init__(self, model_name: str, max_model_len: int) -> None:
        import asyncio

        self.model_name = model_name
        self.max_model_len = max_model_len
        self.is_working = asyncio.Event()  # set once a request's inputs are in embed()
        self.num_cancelled = 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def embed(self, inputs, **options):
        import asyncio

        self.is_working.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise
