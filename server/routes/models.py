"""GET /v1/models: the loaded models, each with its task ("generate", "embed" or "rerank") and context length
(the generation model's with its `runtime`: device, CPU features, kernel build, prefill dtype, KV cache format
and bytes per token);
GET /v1/models/{id}: one of them (404 `model_not_found` for any other name)."""

from __future__ import annotations

from fastapi import APIRouter

from server.errors import APIError
from server.http.openapi import error_responses, gated_responses
from server.protocol.common import ModelCard, ModelList, ModelRuntime
from server.state import SharedState

router = APIRouter()


@router.get("/v1/models", responses=gated_responses())
async def list_models(state: SharedState) -> ModelList:
    config = state.config
    cards = []
    if state.engine is not None:
        info = state.engine.model_info
        runtime = ModelRuntime(
            device=info.device,
            cpu_features=list(info.cpu_features),
            kernel_build=info.kernel_build,
            prefill_dtype=info.prefill_dtype,
            kv_cache_dtype=info.kv_cache_dtype,
            kv_bytes_per_token=info.kv_bytes_per_token,
        )
        for name in config.model_names:  # one card per alias, as each is a name a request may use
            cards.append(
                ModelCard(
                    id=name,
                    root=config.engine.model,
                    max_model_len=state.engine.max_model_len,
                    task="generate",
                    runtime=runtime,
                )
            )
    for batcher, encoder_config, task in (
        (state.embedder, config.embedder, "embed"),
        (state.reranker, config.reranker, "rerank"),
    ):
        if batcher is not None:
            root = encoder_config.model if encoder_config is not None else batcher.model_name
            cards.append(ModelCard(id=batcher.model_name, root=root, max_model_len=batcher.max_model_len, task=task))
    return ModelList(data=cards)


# `:path`: a served name may contain slashes (a Hugging Face repo id served under its own name)
@router.get("/v1/models/{model_id:path}", responses=error_responses(404, 401, 413, 500, 503))
async def retrieve_model(model_id: str, state: SharedState) -> ModelCard:
    for card in (await list_models(state)).data:
        if card.id == model_id:
            return card
    raise APIError(
        404,
        f"the model {model_id!r} is not served here (GET /v1/models lists the served models)",
        type="not_found_error",
        param="model",
        code="model_not_found",
    )
