"""POST /attention: a prompt's attention weights for one layer and head (or the mean over heads).

Computed by the reference path (engine/attention/probe.py), not the serving kernels: the
model's own layers with explicit softmax attention over a private cache. At most
MAX_ATTENTION_TOKENS tokens (400 past it; a prompt over MAX_ATTENTION_PROMPT_CHARS characters is
refused before it is tokenized), a window and sink count within the context length, and one forward
at a time (429 meanwhile).
"""

from __future__ import annotations

import json

from fastapi import APIRouter
from fastapi.responses import Response

from engine import Tokenizer
from engine.inspect import ATTENTION_SLIDING, AttentionWeights
from server.errors import APIError
from server.http.json_body import StrictJSONRoute
from server.http.openapi import attention_responses
from server.openai.params import check_token_ids
from server.openai.served_models import generation_model
from server.playground.protocol import (
    MAX_ATTENTION_PROMPT_CHARS,
    MAX_ATTENTION_TOKENS,
    AttentionRequest,
    AttentionResponse,
)
from server.state import SharedState

router = APIRouter(route_class=StrictJSONRoute)

# Significant digits sent per weight (the matrix is up to 65,536 numbers): a relative error of 5e-7,
# and a tiny weight stays non-zero (it is 0 only where float32's softmax itself underflows, a score
# about 100 below its row's largest).
WEIGHT_FORMAT = ".6g"


@router.post("/attention", response_model=AttentionResponse, responses=attention_responses())
async def attention(body: AttentionRequest, state: SharedState) -> Response:
    served = await generation_model(state, body.model)
    engine = served.engine
    if (body.prompt is None) == (body.token_ids is None):
        raise APIError(400, "give exactly one of prompt or token_ids", param="prompt")
    text = served.text
    limit = min(MAX_ATTENTION_TOKENS, engine.max_model_len)
    _check_masking(body, engine.max_model_len)
    if body.prompt is not None and len(body.prompt) > MAX_ATTENTION_PROMPT_CHARS:
        raise APIError(
            400,
            f"the prompt is {len(body.prompt)} characters; attention weights are computed for at most {limit} "
            f"tokens, and a prompt over {MAX_ATTENTION_PROMPT_CHARS} characters is longer than that",
            param="prompt",
            code="context_length_exceeded",
        )
    if body.prompt is not None:
        token_ids = await text.run(len(body.prompt), _encode, body.prompt, body.add_special_tokens)
    else:
        token_ids = list(body.token_ids or [])
    if not token_ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    if len(token_ids) > limit:
        raise APIError(
            400,
            f"the prompt is {len(token_ids)} tokens; attention weights are computed for at most {limit} "
            f"(at most {MAX_ATTENTION_TOKENS}, and not past the model's context length)",
            param="prompt",
            code="context_length_exceeded",
        )
    check_token_ids(token_ids, engine.vocab_size, "token_ids")
    model = engine.model_info
    window, sinks = _masking(body, model.sliding_window, model.num_sink_tokens)
    # A model that mixes full and sliding layers shows each layer under its own mask unless a window is asked.
    layer_windows = None
    if "sliding_window" not in body.model_fields_set and len(set(model.attention_kinds)) > 1:
        layer_windows = tuple(window if kind == ATTENTION_SLIDING else None for kind in model.attention_kinds)

    num_layers = model.num_layers
    num_heads = model.num_heads
    if body.layer >= num_layers:
        raise APIError(400, f"layer must be in [0, {num_layers}); got {body.layer}", param="layer")
    if body.head != "mean" and body.head >= num_heads:
        raise APIError(400, f"head must be 'mean' or in [0, {num_heads}); got {body.head}", param="head")

    result = await state.attention_view.weights(engine, token_ids, window, sinks, layer_windows)
    content = await text.run(len(token_ids) ** 2, _answer, result, body.layer, body.head, engine.model_name)
    return Response(content, media_type="application/json")


def _check_masking(body: AttentionRequest, max_model_len: int) -> None:
    """A window or sink count past the model's context length masks nothing more: a 400 naming it."""
    for param, value in (("sliding_window", body.sliding_window), ("num_sink_tokens", body.num_sink_tokens)):
        if value is not None and value > max_model_len:
            message = f"{param} must be at most the model's context length, {max_model_len}; got {value}"
            raise APIError(400, message, param=param)


def _masking(body: AttentionRequest, server_window: int | None, server_sinks: int) -> tuple[int | None, int]:
    """(window, sinks) the request asks for: absent fields take the server's own masking."""
    window_given = "sliding_window" in body.model_fields_set
    window = body.sliding_window if window_given else server_window
    if body.num_sink_tokens is not None:
        sinks = body.num_sink_tokens
    else:
        sinks = 0 if window_given else server_sinks
    return window, sinks if window is not None else 0


def _encode(tokenizer: Tokenizer, prompt: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)


def _answer(tokenizer: Tokenizer, result: AttentionWeights, layer: int, head: int | str, model: str) -> bytes:
    per_head = result.weights[layer]  # [H, T, T]
    chosen = per_head.mean(dim=0) if head == "mean" else per_head[head]
    token_ids = list(result.token_ids)
    body = AttentionResponse(
        model=model,
        token_ids=token_ids,
        tokens=[tokenizer.id_to_token(t) for t in token_ids],
        num_layers=result.num_layers,
        num_heads=result.num_heads,
        layer=layer,
        head=head,
        sliding_window=result.layer_windows[layer],  # the mask of the layer shown
        num_sink_tokens=result.num_sink_tokens if result.layer_windows[layer] is not None else 0,
        max_tokens=MAX_ATTENTION_TOKENS,
        weights=[],
    ).model_dump()
    # Filled in after the model: pydantic would validate each of up to 65,536 numbers.
    body["weights"] = [[float(format(w, WEIGHT_FORMAT)) for w in row] for row in chosen.tolist()]
    return json.dumps(body, separators=(",", ":")).encode()
