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
