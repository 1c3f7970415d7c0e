"""Errors the engine raises at its edge.

Bad user input is an exception raised where it enters; running out of KV blocks
is never an exception, the scheduler handles it. The serving errors at the end are
one contract shared by every client of the torch worker (generation and embeddings):
the server maps each to one HTTP status.
"""

from __future__ import annotations


class KVServeError(Exception):
    """Base class of every error kvserve raises on purpose."""


class InvalidRequestError(KVServeError, ValueError):
    """A request the engine refuses: the HTTP layer maps it to 400.

    `param` names the offending field when there is one (OpenAI's error shape); `code` is the
    error's name in the server's one vocabulary of error codes.
    """

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """Prompt (plus requested output) does not fit in max_model_len."""

    code = "context_length_exceeded"  # OpenAI's code for the same refusal


class ForeignTokenIdsError(InvalidRequestError):
    """Token-id input the model's own tokenizer did not make (or token ids where the server takes none)."""

    code = "invalid_token_ids"


class ModelLoadError(KVServeError):
    """A model that cannot be loaded: names the file and the reason."""


class ModelNotAvailableError(ModelLoadError):
    """A named default model that is not in the local cache and cannot be fetched."""


class QueueFullError(KVServeError):
    """Too many requests are waiting (HTTP 429); retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeoutError(KVServeError):
    """The request outlived its deadline and was aborted (HTTP 504)."""


class EngineDeadError(KVServeError):
    """The worker is not running (died, or stopped): no request can be served (HTTP 503)."""


class EngineStepError(KVServeError):
    """A step or forward failed while this request was in it; it was aborted (HTTP 500)."""
