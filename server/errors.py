"""The one error shape every failure is answered with (OpenAI's), and the one mapping to it.

Routes raise `APIError`; the engine raises its own errors (engine/errors.py); a body that is not
strict JSON raises `RequestBodyError` while it is read (server/http/json_body.py). `api_error_for`
maps any exception to an `APIError`, and `install_error_handlers` makes the app answer each
with `{"error": {"message", "type", "param", "code"}}` and its status (and headers, e.g.
Retry-After on 429). Streamed answers send the same body as an SSE error event.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import (
    EngineDeadError,
    EngineStepError,
    InvalidRequestError,
    KVServeError,
    QueueFullError,
    RequestTimeoutError,
)

logger = logging.getLogger(__name__)


# Every `error.code` the server answers with: snake_case, stable, one meaning each. The error table of
# docs/api/errors.md lists the same codes (a test keeps the two and the code that raises them in step).
ERROR_CODES: dict[str, str] = {
    "invalid_request": "400: a field is missing, mistyped, out of range or contradicts another",
    "context_length_exceeded": "400: the prompt plus max_tokens does not fit the model's context",
    "unsupported_field": "400: an OpenAI field kvserve does not implement was set",
    "batch_too_large": "413: more inputs in one request than --max-client-batch-size",
    "wrong_model_task": "400: the model exists but serves another task (e.g. chat with the embedding model)",
    "invalid_token_ids": "400: token-id input that the model's tokenizer did not make",
    "invalid_api_key": "401: --api-key is set and the request's bearer token is missing or wrong",
    "admin_required": "403: the route takes an admin API key (loading and unloading models)",
    "model_too_large": "400: the model alone needs more memory than --memory-budget",
    "not_found": "404: no such route, or no such stored object",
    "model_not_found": "404: no served model has that name",
    "method_not_allowed": "405: the route exists for another HTTP method",
    "request_too_large": "413: the body is over --max-request-bytes; 400: the request could hold more than "
    "--max-request-cost tokens, or has more prompts than --max-queued-requests",
    "queue_full": "429: --max-queued-requests are already waiting; retry after Retry-After",
    "attention_busy": "429: POST /attention is already computing another prompt's weights; retry after Retry-After",
    "internal_error": "500: a bug; the server goes on serving",
    "model_load_failed": "500: the model named could not be loaded (the message says why); other models serve on",
    "engine_step_failed": "500: the model raised while this request was in its step; the others went on",
    "model_loading": "503: the models are still loading; retry after Retry-After",
    "model_not_running": "503: the model's engine is not running",
    "models_busy": "503: the model is not loaded and every loaded model is in use, with no room for another; "
    "retry after Retry-After",
    "engine_dead": "503: the engine stopped after repeated failures",
    "shutting_down": "503: the server is stopping; retry (on another replica)",
    "request_timeout": "504: the request outlived --request-timeout",
}
# The code an error gets when its raiser names none.
_DEFAULT_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    429: "queue_full",
    503: "model_not_running",
    504: "request_timeout",
}


# How much of a client's own text (a model name, a key, a tool name) an error message echoes.
MAX_ECHOED_CHARS = 64


def clip(text: str, limit: int = MAX_ECHOED_CHARS) -> str:
    """`text` as an error message may echo it: at most `limit` characters, then "..."."""
    return text if len(text) <= limit else f"{text[:limit]}..."


class RequestBodyError(StarletteHTTPException):
    """A body that is not JSON a route takes (server/http/json_body.py): raised while FastAPI reads the body,
    which passes HTTP errors through as they are, and answered as a 400 `invalid_request`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message)
        self.param = param


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
        fallback = "internal_error" if status_code >= 500 else "invalid_request"
        self.code = code or _DEFAULT_CODES.get(status_code, fallback)
        if self.code not in ERROR_CODES:
            raise ValueError(f"error code {self.code!r} is not in ERROR_CODES")
        self.headers = headers or {}

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_type(self) -> str:
        """Anthropic's name for this error's kind."""
        if self.status_code == 503:
            return "overloaded_error"
        if self.status_code == 504:
            return "timeout_error"
        if self.status_code >= 500:
            return "api_error"
        kinds = {
            401: "authentication_error",
            403: "permission_error",
            404: "not_found_error",
            413: "request_too_large",
            429: "rate_limit_error",
        }
        return kinds.get(self.status_code, "invalid_request_error")

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": self.anthropic_type(), "message": self.message}}

    def body_for(self, path: str) -> dict:
        """The error body the route at `path` answers with: Anthropic's shape on the Messages routes,
        Ollama's (`{"error": message}`) under /api/, OpenAI's everywhere else."""
        if is_anthropic_path(path):
            return self.anthropic_body()
        if is_ollama_path(path):
            return {"error": self.message}
        return self.to_body()


ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def is_anthropic_path(path: str) -> bool:
    return path in ANTHROPIC_PATHS


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def api_error_for(exc: BaseException) -> APIError:
    """The one mapping from exceptions to the OpenAI error shape."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, QueueFullError):
        return APIError(
            429,
            str(exc),
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(max(1, round(exc.retry_after)))},
        )
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="service_unavailable", code="engine_dead")
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, str(exc), type="timeout_error", code="request_timeout")
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), type="internal_error", code="engine_step_failed")
    return APIError(500, "internal server error", type="internal_error", code="internal_error")


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    parts = []
    first_param = None
    for error in errors:
        loc = [clip(str(p)) for p in error.get("loc", ()) if p != "body"]  # a key may be any length
        param = ".".join(loc) or None
        first_param = first_param or param
        if error.get("type") == "json_invalid":
            return f"request body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}", None
        if param is None:  # the body itself: missing, or not a JSON object
            what = "missing" if error.get("type") == "missing" else f"must be a JSON object ({error.get('msg')})"
            parts.append(f"request body: {what}")
        elif error.get("type") == "extra_forbidden":
            parts.append(f"unsupported field '{param}'")
        elif error.get("type") == "missing":
            parts.append(f"missing required field '{param}'")
        else:
            parts.append(f"{param}: {error.get('msg')}")
    return "; ".join(parts) or "invalid request", first_param


def _render(error: APIError, request: Request) -> JSONResponse:
    return JSONResponse(error.body_for(request.url.path), status_code=error.status_code, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer validation errors, HTTP errors, APIError and every engine error in the one shape."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return _render(APIError(400, message, param=param, code="invalid_request"), request)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}
        error = APIError(
            exc.status_code,
            str(exc.detail),
            type=kinds.get(exc.status_code, "invalid_request_error"),
            param=exc.param if isinstance(exc, RequestBodyError) else None,
            headers=dict(exc.headers or {}),
        )
        return _render(error, request)

    @app.exception_handler(APIError)
    async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return _render(exc, request)

    @app.exception_handler(KVServeError)
    async def _on_engine_error(request: Request, exc: KVServeError) -> JSONResponse:
        error = api_error_for(exc)
        if error.status_code >= 500:
            logger.error("request %s failed: %s", getattr(request.state, "request_id", "-"), exc)
        return _render(error, request)
