"""ServerState: what the routes share, stored once on the app; a route reads it as a `SharedState` parameter.

The lifespan (server/app.py) fills in `engine`, `text`, `embedder` and `reranker` once the models are loaded, then
sets `is_ready`; a failed load sets `load_error` instead. `shutdown` is the server's stop
(server/shutdown.py): the CLI moves its phase, the middleware counts requests in it. Routes only read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, FastAPI, Request

from server.config import ServerConfig
from server.metrics.server_metrics import ServerMetrics
from server.playground.attention_view import AttentionView
from server.shutdown import Shutdown

if TYPE_CHECKING:
    from engine import AsyncEncoder, AsyncEngine
    from engine.outputs import EngineStats
    from server.openai.reasoning import ThinkTokens
    from server.openai.text import RequestText


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine | None = None  # None until loaded
    embedder: AsyncEncoder | None = None  # None until loaded, or when no embedding model is served
    # The rerank model (engine/pooling/reranker.py), batched by an AsyncEncoder of its own; None until loaded,
    # or when no rerank model is served.
    reranker: AsyncEncoder | None = None
    text: RequestText | None = None  # tokenizer work on request text, off the loop; set with `engine`
    # The generation model's <think> and </think> tokens under --reasoning-parser (None: no parser); set with `engine`
    reasoning: ThinkTokens | None = None
    is_ready: bool = False  # every model is loaded: the middleware stops answering 503
    load_error: str | None = None  # why loading failed; /health reports it
    shutdown: Shutdown = field(default_factory=Shutdown)  # serving -> draining -> stopping
    attention_view: AttentionView = field(default_factory=AttentionView)  # POST /attention's one forward at a time
    metrics: ServerMetrics = field(init=False)  # its engine gauges read `engine` at scrape time

    def __post_init__(self) -> None:
        embedder = self.config.embedder
        self.metrics = ServerMetrics(
            self.config.model_name,
            self._engine_stats,
            metrics_names=self.config.metrics_names,
            embedding_model_name=embedder.model if embedder is not None else None,
        )

    def _engine_stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None


def attach_state(app: FastAPI, state: ServerState) -> None:
    app.state.kvserve = state


def state_of(app: FastAPI) -> ServerState:
    return app.state.kvserve


def get_state(request: Request) -> ServerState:
    return state_of(request.app)


# What a route declares to receive the state: `state: SharedState`.
SharedState = Annotated[ServerState, Depends(get_state)]
