"""GET /v1/models: the loaded models, each with its task ("generate" or "embed") and context length."""

from __future__ import annotations

from fastapi import APIRouter

from server.openapi import gated_responses
from server.protocol.common import ModelCard, ModelList
from server.state import SharedState

router = APIRouter()


@router.get("/v1/models", responses=gated_responses())
async def list_models(state: SharedState) -> ModelList:
    config = state.config
    cards = []
    if state.engine is not None:
        cards.append(
            ModelCard(
                id=config.model_name,
                root=config.engine.model,
                max_model_len=state.engine.max_model_len,
                task="generate",
            )
        )
    if state.embedder is not None:
        cards.append(
            ModelCard(
                id=state.embedder.model_name,
                root=config.embedder.model if config.embedder is not None else state.embedder.model_name,
                max_model_len=state.embedder.max_model_len,
                task="embed",
            )
        )
    return ModelList(data=cards)
