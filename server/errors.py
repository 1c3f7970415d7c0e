"""The one error shape every failure is answered with (OpenAI's).

Routes raise `APIError`; app.py installs the handler that renders it as
`{"error": {"message", "type", "param", "code"}}` with the given status.
"""

from __future__ import annotations


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
