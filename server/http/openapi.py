"""What /openapi.json says each route answers: every status code, body, header and content type.

The routes take their `responses=` from the functions here, built from one table of the error
answers (server/errors.py, server/http/middleware.py, server/openai/served_models.py say when each happens).
`install_openapi` finishes the document FastAPI generates: its 422 goes (a bad request is a 400
here), the error body and the SSE event shapes join the components, and every answer documents
X-Request-Id.

499 (the client left before a JSON answer) is not documented: no client is there to read it; it
shows in the access log only. Nor is uvicorn's 400 to a malformed or oversized request head
(--max-request-head-bytes): it comes before the request is parsed, so it belongs to no route.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server.protocol.anthropic import AnthropicError, MessagesStreamEvent
from server.protocol.chat import ChatCompletionChunk
from server.protocol.common import ErrorResponse, HealthStatus
from server.protocol.completions import CompletionResponse
from server.protocol.ollama import OllamaError
from server.protocol.responses_output import ResponseStreamEvent

Responses = dict[int | str, dict[str, Any]]

_REF = "#/components/schemas/{model}"
# The bodies of SSE events (besides the error body): each `generation_responses` chunk model and each
# `named_event_responses` event model is one of these.
STREAM_EVENT_MODELS: tuple[type[BaseModel], ...] = (
    CompletionResponse,
    ChatCompletionChunk,
    ResponseStreamEvent,
    MessagesStreamEvent,
)

_RETRY_AFTER = {
    "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer", "minimum": 1}}
}
_ERRORS: dict[int, tuple[str, dict[str, Any]]] = {
    400: (
        "Invalid request: the body is not JSON, a field is missing, unknown, of the wrong type or out of "
        "range, or the model serves the other task, or it alone needs more than --memory-budget (`code` "
        "model_too_large). `param` names the field.",
        {},
    ),
    401: (
        "An API key is configured (--api-key) and the request did not send 'Authorization: Bearer <key>' "
        "or 'x-api-key: <key>' (`code` invalid_api_key).",
        {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}},
    ),
    403: ("The route takes an admin API key (`code` admin_required).", {}),
    404: (
        "The `model` named is not served, or this server serves no embedding (or rerank) model "
        "(`code` model_not_found).",
        {},
    ),
    413: (
        "The body is larger than --max-request-bytes (`code` request_too_large), or carries more prompts or "
        "inputs than --max-client-batch-size (`code` batch_too_large).",
        {},
    ),
    429: (
        "--max-queued-requests requests already wait for this model (`code` queue_full); retry after Retry-After.",
        _RETRY_AFTER,
    ),
    500: (
        "Computing this request failed (`code` engine_step_failed; the other requests go on), the model it "
        "names failed to load (`code` model_load_failed; the other models serve on), or an unexpected internal "
        "error failed this request alone.",
        {},
    ),
    503: (
        "The models are still loading (Retry-After), the server is shutting down (`code` shutting_down, "
        "Retry-After), the engine has stopped (`code` engine_dead), or the model named is not loaded and every "
        "loaded one is in use with no room for another (`code` models_busy, Retry-After).",
        _RETRY_AFTER,
    ),
    504: ("The request outlived --request-timeout (`code` request_timeout).", {}),
}
# uvicorn's own answer, before the app (server/http/request_cap.py's cap): without X-Request-Id.
_OVER_LIMIT = "--limit-concurrency requests are already in progress: a plain-text 503, before the app."
_PLAIN_TEXT = {"text/plain": {"schema": {"type": "string"}}}
_ERROR_BODY = {"$ref": _REF.format(model=ErrorResponse.__name__)}
_ANTHROPIC_ERROR_BODY = {"$ref": _REF.format(model=AnthropicError.__name__)}
_OLLAMA_ERROR_BODY = {"$ref": _REF.format(model=OllamaError.__name__)}
_X_REQUEST_ID = {
    "description": "the request's id: the client's own X-Request-Id echoed, or a new one "
    "(not on the plain-text 503 past --limit-concurrency)",
    "schema": {"type": "string"},
}
# Every route behind the middleware's checks: API key, readiness, body size, and its catch-all.
_GATED = (401, 413, 500, 503)


def error_responses(*codes: int, body: dict[str, Any] = _ERROR_BODY) -> Responses:
    """The error answers `codes`, each with the error body (OpenAI's shape unless told) and its headers."""
    responses: Responses = {}
    for code in sorted(codes):
        description, headers = _ERRORS[code]
        # The body is named by reference, not by `model`: FastAPI would file it under the route's media
        # type, and /metrics answers text/plain but its errors in JSON.
        responses[code] = {"description": description, "content": {"application/json": {"schema": body}}}
        if code == 503:
            responses[code]["description"] += " " + _OVER_LIMIT
            responses[code]["content"].update(_PLAIN_TEXT)
        if headers:
            responses[code]["headers"] = headers
    return responses


def generation_responses(chunk: type[BaseModel]) -> Responses:
    """/v1/completions and /v1/chat/completions: a JSON answer, or (`stream`) SSE `chunk` events, then [DONE]."""
    if chunk not in STREAM_EVENT_MODELS:
        raise ValueError(f"{chunk.__name__} must be listed in STREAM_EVENT_MODELS")
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "description": f"a {chunk.__name__} chunk, the error body if the stream fails after it "
                "started, then the literal [DONE]",
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "not": {"const": "[DONE]"},
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "anyOf": [
                                {"$ref": _REF.format(model=chunk.__name__)},
                                _ERROR_BODY,
                            ]
                        },
                    },
                ],
            },
            "event": {"type": "string"},
        },
    }
    streamed = {
        200: {
            "description": "One JSON body, or with `stream` true server-sent events: `data: <chunk>` each, "
            "then `data: [DONE]`",
            "content": {"text/event-stream": {"itemSchema": event}},
        }
    }
    return {**streamed, **error_responses(400, 404, 429, 504, *_GATED)}


def named_event_responses(event: type[BaseModel]) -> Responses:
    """/v1/responses: a JSON answer, or (`stream`) SSE events named after their type (`event: <type>`,
    then `data: <event>`); a failure is events of its own, and no [DONE] ends the stream."""
    if event not in STREAM_EVENT_MODELS:
        raise ValueError(f"{event.__name__} must be listed in STREAM_EVENT_MODELS")
    item = {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"type": "string", "description": "the event's `type`"},
            "data": {
                "description": f"a {event.__name__}",
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"$ref": _REF.format(model=event.__name__)},
            },
        },
    }
    streamed = {
        200: {
            "description": "One JSON body, or with `stream` true server-sent events: `event: <type>` and "
            "`data: <event>` each",
            "content": {"text/event-stream": {"itemSchema": item}},
        }
    }
    return {**streamed, **error_responses(400, 404, 429, 504, *_GATED)}


def anthropic_responses(event: type[BaseModel] | None) -> Responses:
    """/v1/messages (`event`: its stream's events, named after their type, a failure an `error` event) and
    /v1/messages/count_tokens (None: JSON only); errors in Anthropic's shape."""
    if event is None:
        return error_responses(400, 404, *_GATED, body=_ANTHROPIC_ERROR_BODY)
    streamed = {200: named_event_responses(event)[200]}
    return {**streamed, **error_responses(400, 404, 429, 504, *_GATED, body=_ANTHROPIC_ERROR_BODY)}


def ollama_responses(line: type[BaseModel]) -> Responses:
    """/api/chat and /api/generate: one JSON object, or (`stream`, the default) newline-delimited JSON, a
    `line` each and a failure after the stream began as an error line; errors in Ollama's shape."""
    item = {"anyOf": [{"$ref": _REF.format(model=line.__name__)}, _OLLAMA_ERROR_BODY]}
    streamed = {
        200: {
            "description": "One JSON body (`stream` false), or newline-delimited JSON: a line per piece of the "
            "reply, then one with `done` true",
            "content": {"application/x-ndjson": {"itemSchema": item}},
        }
    }
    return {**streamed, **ollama_info_responses(400, 404, 429, 504)}


def ollama_info_responses(*codes: int) -> Responses:
    """Ollama's other routes: the middleware's checks and `codes`, errors in Ollama's shape."""
    return error_responses(*codes, *_GATED, body=_OLLAMA_ERROR_BODY)


def engine_responses() -> Responses:
    """/v1/embeddings, /embed and the rerank routes: the model, the batch, the queue and the deadline can refuse."""
    return error_responses(400, 404, 429, 504, *_GATED)


def tokenizer_responses() -> Responses:
    """/tokenize and /detokenize: a model and a body, no queue."""
    return error_responses(400, 404, *_GATED)


def attention_responses() -> Responses:
    """/attention: a model, a body and the length limit (400), one forward at a time (429)."""
    responses = error_responses(400, 404, 429, *_GATED)
    responses[429] = {
        **responses[429],
        "description": "Another prompt's attention weights are being computed (`code` attention_busy); "
        "retry after Retry-After.",
    }
    return responses


def page_responses(*media_types: str) -> Responses:
    """GET / and its assets: the files themselves (media_types); without the key, a sign-in page."""
    text = {"schema": {"type": "string"}}
    responses = error_responses(404, *_GATED)
    responses[200] = {
        "description": "The playground page or one of its files.",
        "content": dict.fromkeys(media_types, text),
    }
    responses[401] = {
        "description": "An API key is configured (--api-key) and the request sent neither 'Authorization: Bearer "
        "<key>' nor the cookie POST /playground/sign-in sets: a sign-in page.",
        "content": {"text/html": text},
        "headers": _ERRORS[401][1],
    }
    responses[404]["description"] = "No playground file has that name."
    return responses


def sign_in_responses() -> Responses:
    """POST /playground/sign-in: the middleware's checks only; 200 sets the page's cookie."""
    responses = error_responses(*_GATED)
    responses[200] = {
        "description": "Signed in: with --api-key, an HttpOnly cookie that opens the playground page and its files.",
        "content": {"application/json": {"schema": {"type": "object", "properties": {"signed_in": {"const": True}}}}},
    }
    return responses


def gated_responses() -> Responses:
    """/v1/models: the middleware's checks only."""
    return error_responses(*_GATED)


def health_responses() -> Responses:
    """/health: its own body for 200 and 503; no API key, answered while loading and draining."""
    status = {"model": HealthStatus}
    unready = {
        "description": f"Loading, draining, or an engine has stopped (`message` says which). {_OVER_LIMIT}",
        "content": {"application/json": {}, **_PLAIN_TEXT},  # JSON first: HealthStatus fills it in
    }
    return {200: status, 503: {**status, **unready}, **error_responses(500)}


def metrics_responses() -> Responses:
    """/metrics: Prometheus text (the route's response_class); answered while loading and draining."""
    return {**error_responses(401, 500), 503: {"description": _OVER_LIMIT, "content": _PLAIN_TEXT}}


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` (GET /openapi.json, /docs) the document described above, built once."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                description=app.description,
                routes=app.routes,
            )
            _finish(document)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _finish(document: dict[str, Any]) -> None:
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for operations in document["paths"].values():
        for operation in operations.values():
            # Request validation errors are answered 400 in the one error shape (server/errors.py).
            operation["responses"].pop("422", None)
            for status, response in operation["responses"].items():
                header = {**_X_REQUEST_ID, "required": status != "503"}
                response.setdefault("headers", {})["X-Request-Id"] = header
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    error_models = (ErrorResponse, AnthropicError, OllamaError)
    models = [(model, "serialization") for model in (*error_models, *STREAM_EVENT_MODELS)]
    _, referenced = models_json_schema(models, ref_template=_REF)
    for name, schema in referenced.get("$defs", {}).items():
        schemas.setdefault(name, schema)  # the response models FastAPI documented already keep its schema
