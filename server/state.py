"""ServerState: what the routes share, stored once on the app; a route reads it as a `SharedState` parameter.

`models` (server/catalogue/pool.py) owns which models are loaded; `engine`, `text`, `reasoning`, `embedder` and
`reranker` read its default models. The lifespan (server/app.py) starts it, then sets `is_ready`; a failed load
of a default model sets `load_error` instead. `shutdown` is the server's stop
(server/shutdown.py): the CLI moves its phase, the middleware counts requests in it. Routes only read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, Request

from server.catalogue.pool import Factories, ModelPool
from server.catalogue.served import Served, ServedGeneration
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
    models: ModelPool = field(init=False)  # every catalogue model, loaded or not
    is_ready: bool = False  # every model is loaded: the middleware stops answering 503
    load_error: str | None = None  # why loading failed; /health reports it
    shutdown: Shutdown = field(default_factory=Shutdown)  # serving -> draining -> stopping
    attention_view: AttentionView = field(default_factory=AttentionView)  # POST /attention's one forward at a time
    metrics: ServerMetrics = field(init=False)  # its engine gauges read `engine` at scrape time

    def __post_init__(self) -> None:
        self.models = ModelPool(self.config, Factories(*_default_factories()))
        generation, embedding = self.models.default("generate"), self.models.default("embed")
        self.metrics = ServerMetrics(
            generation.name if generation is not None else self.config.model_name,
            self._engine_stats,
            metrics_names=self.config.metrics_names,
            embedding_model_name=embedding.name if embedding is not None else None,
            more_stats=self._more_stats,
        )

    def _engine_stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    def _more_stats(self) -> list[tuple[str, EngineStats]]:
        """Each loaded generation model but the default, by its name."""
        default = self.models.default("generate")
        loaded = ((entry, self.models.loaded(entry)) for entry in self.models.entries if entry is not default)
        return [(entry.name, s.engine.stats()) for entry, s in loaded if isinstance(s, ServedGeneration)]

    def _default(self, task: str) -> Served | None:
        entry = self.models.default(task)
        return self.models.loaded(entry) if entry is not None else None

    @property
    def generation(self) -> ServedGeneration | None:
        """The default generation model, once loaded."""
        served = self._default("generate")
        return served if isinstance(served, ServedGeneration) else None

    @property
    def engine(self) -> AsyncEngine | None:
        return self.generation.engine if self.generation is not None else None

    @property
    def text(self) -> RequestText | None:
        """Tokenizer work on the default generation model's request text, off the loop."""
        return self.generation.text if self.generation is not None else None

    @property
    def reasoning(self) -> ThinkTokens | None:
        """The default generation model's <think> and </think> tokens under --reasoning-parser (None: no parser)."""
        return self.generation.reasoning if self.generation is not None else None

    @property
    def embedder(self) -> AsyncEncoder | None:
        """The default embedding model's batcher once loaded (None too when no embedding model is served)."""
        served = self._default("embed")
        return served if not isinstance(served, ServedGeneration) else None

    @property
    def reranker(self) -> AsyncEncoder | None:
        """The default rerank model (a cross-encoder) batched by an AsyncEncoder of its own, once loaded."""
        served = self._default("rerank")
        return served if not isinstance(served, ServedGeneration) else None


def _default_factories() -> tuple[Callable[[Any], Any], ...]:
    from engine import Embedder, Reranker, load_generation

    return load_generation, Embedder, Reranker


def attach_state(app: FastAPI, state: ServerState) -> None:
    app.state.kvserve = state


def state_of(app: FastAPI) -> ServerState:
    return app.state.kvserve


def get_state(request: Request) -> ServerState:
    return state_of(request.app)


# What a route declares to receive the state: `state: SharedState`.
SharedState = Annotated[ServerState, Depends(get_state)]
