"""POST /tokenize and POST /detokenize with the generation model's tokenizer (vLLM's shapes)."""

from __future__ import annotations

from fastapi import APIRouter

from engine.errors import InvalidRequestError
from server.openapi import tokenizer_responses
from server.params import check_token_ids
from server.prompts import chat_prompt_ids
from server.protocol.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.served_models import generation_engine
from server.state import SharedState

router = APIRouter()


@router.post("/tokenize", responses=tokenizer_responses())
async def tokenize(body: TokenizeRequest, state: SharedState) -> TokenizeResponse:
    engine = generation_engine(state, body.model)
    tokenizer = engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        token_ids = chat_prompt_ids(tokenizer, body.messages, body.add_generation_prompt)
    else:
        token_ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    token_strs = [tokenizer.id_to_token(t) for t in token_ids] if body.return_token_strs else None
    return TokenizeResponse(
        count=len(token_ids), max_model_len=engine.max_model_len, tokens=token_ids, token_strs=token_strs
    )


@router.post("/detokenize", responses=tokenizer_responses())
async def detokenize(body: DetokenizeRequest, state: SharedState) -> DetokenizeResponse:
    engine = generation_engine(state, body.model)
    check_token_ids(body.tokens, engine.vocab_size, "tokens")
    return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens, skip_special_tokens=False))
