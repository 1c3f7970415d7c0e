"""GET /health (readiness for load balancers; always open) and GET /metrics (Prometheus).

/metrics is behind --api-key when one is set, like every route but /health; its prefix-cache series
go to admin keys only (server/http/access.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from server.http.access import caller_of
from server.http.openapi import health_responses, metrics_responses
from server.metrics.server_metrics import CONTENT_TYPE
from server.state import SharedState

router = APIRouter()


@router.get("/health", responses=health_responses())
async def health(state: SharedState) -> JSONResponse:
    """503 {"status": "loading"} until the models are loaded, 200 {"status": "ok"} after; 503 if an engine died;
    503 {"status": "draining"} from the first SIGTERM/SIGINT on (server/shutdown.py), so load balancers stop sending."""
    if state.shutdown.is_draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if state.load_error is not None:
        return JSONResponse({"status": "error", "message": state.load_error}, status_code=503)
    if not state.is_ready:
        return JSONResponse({"status": "loading"}, status_code=503)
    if state.engine is not None and not state.engine.is_healthy:
        return JSONResponse({"status": "error", "message": "the generation engine is not running"}, status_code=503)
    if state.embedder is not None and not state.embedder.is_healthy:
        return JSONResponse({"status": "error", "message": "the embedding engine is not running"}, status_code=503)
    if state.reranker is not None and not state.reranker.is_healthy:
        return JSONResponse({"status": "error", "message": "the rerank engine is not running"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics", response_class=PlainTextResponse, responses=metrics_responses())
async def metrics(request: Request, state: SharedState) -> Response:
    return Response(state.metrics.render(private=caller_of(request).is_admin), media_type=CONTENT_TYPE)
