"""Errors the engine raises at its edge.

Bad user input is an exception raised where it enters (DESIGN.md principle 5);
running out of KV blocks is never an exception, the scheduler handles it.
"""

from __future__ import annotations


class KVServeError(Exception):
    """Base class of every error kvserve raises on purpose."""


class InvalidRequestError(KVServeError, ValueError):
    """A request the engine refuses: the HTTP layer maps it to 400.

    `param` names the offending field when there is one (OpenAI's error shape).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """Prompt (plus requested output) does not fit in max_model_len."""


class ModelLoadError(KVServeError):
    """A model that cannot be loaded: names the file and the reason."""


class ModelNotAvailableError(ModelLoadError):
    """A named default model that is not in the local cache and cannot be fetched."""
