"""POST /tokenize, POST /detokenize and GET /tokenizer_info with the generation model's tokenizer
(vLLM's shapes). With /tokenizer_info, lm-evaluation-harness tokenizes through the server and needs
no local copy of the model's tokenizer.

The work and the JSON body are done on the text worker (server/openai/text.py): a 2 MB prompt is
over 400,000 token ids, and neither encoding it nor writing them out may hold up the event loop.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from engine.errors import InvalidRequestError
from server.http.json_body import StrictJSONRoute
from server.http.openapi import tokenizer_responses
from server.openai.params import check_token_ids
from server.openai.prompts import chat_prompt_ids
from server.openai.served_models import generation_model
from server.openai.text import text_size
from server.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from server.state import SharedState

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/tokenize", response_model=TokenizeResponse, responses=tokenizer_responses())
async def tokenize(body: TokenizeRequest, state: SharedState) -> Response:
    served = await generation_model(state, body.model)
    engine = served.engine
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", "prompt")
    size = text_size(body.prompt if body.prompt is not None else body.messages)
    special_in_content = state.config.allow_special_tokens_in_content
    return _json(await served.text.run(size, _tokenize, body, engine.max_model_len, special_in_content))


@router.post("/detokenize", response_model=DetokenizeResponse, responses=tokenizer_responses())
async def detokenize(body: DetokenizeRequest, state: SharedState) -> Response:
    served = await generation_model(state, body.model)
    check_token_ids(body.tokens, served.engine.vocab_size, "tokens")
    return _json(await served.text.run(len(body.tokens), _detokenize, body.tokens))


@router.get("/tokenizer_info", responses=tokenizer_responses())
async def tokenizer_info(state: SharedState, model: str | None = None) -> TokenizerInfo:
    engine = (await generation_model(state, model)).engine
    tokenizer = engine.tokenizer
    return TokenizerInfo(
        tokenizer_class=tokenizer.class_name,
        **tokenizer.special_tokens(),
        chat_template=tokenizer.chat_template,
        model_max_length=engine.max_model_len,
        vocab_size=engine.vocab_size,
    )


def _tokenize(tokenizer: Any, body: TokenizeRequest, max_model_len: int, special_in_content: bool) -> bytes:
    # messages as chat encodes them (the client's strings are text); a prompt as completions take it
    # (the model's raw input: special tokens' texts are tokens)
    if body.messages is not None:
        token_ids = chat_prompt_ids(tokenizer, body.messages, body.add_generation_prompt, None, special_in_content)
    else:
        token_ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    token_strs = [tokenizer.id_to_token(t) for t in token_ids] if body.return_token_strs else None
    answer = {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids, "token_strs": token_strs}
    return json.dumps(answer, ensure_ascii=False).encode()


def _detokenize(tokenizer: Any, token_ids: list[int]) -> bytes:
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    return json.dumps({"prompt": text}, ensure_ascii=False).encode()


def _json(content: bytes) -> Response:
    return Response(content, media_type="application/json")
