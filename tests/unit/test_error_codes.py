"""One vocabulary of error codes: every code the server raises is in ERROR_CODES, snake_case, and the
error table of docs/api/errors.md lists exactly those codes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.errors import InvalidRequestError, PromptTooLongError
from server.errors import ERROR_CODES, APIError, api_error_for

REPO = Path(__file__).resolve().parents[2]
SNAKE_CASE = re.compile(r"[a-z]+(_[a-z]+)*")


def _codes_in_source() -> set[str]:
    """Every `code="..."` in the server and the engine, but the Responses API's own `ResponseError`
    codes (OpenAI's enum inside a response object, not the error body)."""
    found = set()
    for path in [*REPO.joinpath("server").rglob("*.py"), *REPO.joinpath("engine").rglob("*.py")]:
        for line in path.read_text().splitlines():
            if "ResponseError(" not in line:
                found.update(re.findall(r'\bcode\s*=\s*"([^"]+)"', line))
    return found


def test_every_code_raised_in_the_source_is_in_the_vocabulary():
    codes = _codes_in_source()
    assert codes, "the scan found no code"
    assert codes <= set(ERROR_CODES), codes - set(ERROR_CODES)
    assert all(SNAKE_CASE.fullmatch(code) for code in ERROR_CODES)


def test_the_errors_page_lists_the_vocabulary():
    page = REPO.joinpath("docs", "api", "errors.md").read_text()
    table = page.split("## Request limits", 1)[0]
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", table, flags=re.MULTILINE))
    assert listed == set(ERROR_CODES)


def test_errors_without_a_code_get_one_from_their_status_and_unknown_codes_are_refused():
    assert APIError(400, "bad").code == "invalid_request"
    assert APIError(404, "gone").code == "not_found"
    assert APIError(503, "down").code == "model_not_running"
    assert APIError(500, "bug").code == "internal_error"
    with pytest.raises(ValueError, match="ERROR_CODES"):
        APIError(400, "bad", code="SomethingElse")
    assert api_error_for(InvalidRequestError("x", "n")).code == "invalid_request"
    assert api_error_for(PromptTooLongError("x", "prompt")).code == "context_length_exceeded"
    assert api_error_for(RuntimeError("boom")).code == "internal_error"
