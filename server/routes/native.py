"""kvserve's own routes: /health, /metrics, /tokenize, /detokenize (vLLM's shapes)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.errors import InvalidRequestError
from server.metrics import CONTENT_TYPE
from server.routes.openai import chat_prompt_ids, check_token_ids, generation_engine
from server.schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """503 {"status": "loading"} until the models are loaded, 200 {"status": "ok"} after; 503 if an engine died."""
    state = request.app.state
    if state.load_error is not None:
        return JSONResponse({"status": "error", "message": state.load_error}, status_code=503)
    if not state.is_ready:
        return JSONResponse({"status": "loading"}, status_code=503)
    if state.engine is not None and not state.engine.is_healthy:
        return JSONResponse({"status": "error", "message": "the generation engine is not running"}, status_code=503)
    embedder = state.embedder
    if embedder is not None and not getattr(embedder, "is_healthy", True):
        return JSONResponse({"status": "error", "message": "the embedding engine is not running"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    engine = generation_engine(request, body.model)
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


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    engine = generation_engine(request, body.model)
    check_token_ids(body.tokens, engine.vocab_size, "tokens")
    return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens, skip_special_tokens=False))
