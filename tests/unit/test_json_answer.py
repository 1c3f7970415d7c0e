"""server/http/json_answer.py: the same bytes as Starlette's JSONResponse, and a large body gives the loop turns."""

from __future__ import annotations

import asyncio
import math

import pytest
from fastapi.responses import JSONResponse

from server.http.json_answer import encode_json, iter_json


def _large_logprobs_body(num_tokens: int) -> dict:
    # The shape of a completion with echo and logprobs: parallel lists and a dict per token.
    return {
        "id": "cmpl-1",
        "choices": [
            {
                "text": 'é ☃ "quoted"',
                "logprobs": {
                    "tokens": [f"t{i}" for i in range(num_tokens)],
                    "token_logprobs": [None, *(-0.5 * i for i in range(1, num_tokens))],
                    "top_logprobs": [None, *({f"a{i}": -1.25, f"b{i}": -2.5} for i in range(1, num_tokens))],
                },
                "prompt_logprobs": [{str(i): {"logprob": -0.1, "rank": 1}} for i in range(num_tokens)],
            }
        ],
        "usage": {"prompt_tokens": num_tokens, "nested": [[1, 2, [3, {"k": True}]], []], "empty": {}},
    }


@pytest.mark.parametrize("value", [_large_logprobs_body(2_000), _large_logprobs_body(3), {"a": [1.5, None, "x"]}, []])
def test_the_bytes_are_the_json_response_bytes(value):
    assert asyncio.run(encode_json(value)) == JSONResponse(value).body
    assert "".join(iter_json(value)).encode() == JSONResponse(value).body


def test_nan_is_refused_as_json_response_refuses_it():
    with pytest.raises(ValueError):
        asyncio.run(encode_json({"x": [math.nan] * 1000}))


def test_a_large_body_lets_other_tasks_run_while_it_is_encoded():
    async def main() -> int:
        turns = 0

        async def ticker() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        start = turns
        await encode_json(_large_logprobs_body(20_000))
        task.cancel()
        return turns - start

    assert asyncio.run(main()) > 50  # one big json.dumps would give none
