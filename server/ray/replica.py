"""KVServe: one Ray Serve replica running kvserve's own app (server/app.py create_app) with one engine.

The ingress deployment (server/ray/ingress.py) reads each HTTP request and calls `handle` through a
DeploymentHandle; `handle` runs the request through the app in this process, exactly as uvicorn would,
and streams back the ASGI messages the app sends: a stream's events leave the replica as they are made.
Everything kvserve does per request (API key, limits, the engine's own 429, metrics, the access log)
happens here, unchanged.

Life cycle, mapped onto Serve's:
- start: the constructor enters the app's lifespan (the models load on its torch worker thread) and
  returns once they are loaded, so Serve only routes to a replica that can serve; a failed load raises,
  and Serve reports the replica failed and tries another.
- health: Serve's health check fails when the engine has died, and Serve replaces the replica.
- stop: Serve routes nothing new to a stopping replica (new requests go to the others) and waits for the
  requests in flight, up to graceful_shutdown_timeout_s (--shutdown-timeout). Then the destructor leaves
  the lifespan: the engine stops, so anything still running ends as kvserve's own stop ends it (503
  shutting_down; a stream: an SSE error event, then [DONE]). If the grace runs out first, Serve kills the
  process, and the ingress ends each request it cut the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from starlette.types import Message

from engine.outputs import EngineStats
from server.app import create_app
from server.config import ServerConfig
from server.ray.metrics import MetricsMirror
from server.state import state_of

logger = logging.getLogger(__name__)

# Names the replica that answered, on every response: which replica holds a prefix, whose log to read.
REPLICA_HEADER = b"x-kvserve-replica"
# As in server/cli/runner.py: the event loop, the text worker and the torch worker share the GIL, and a decode
# step that must win it back at every native call runs far slower at the default 5 ms switch interval.
GIL_SWITCH_INTERVAL_S = 0.0005
READY_POLL_S = 0.05
# What an ASGI scope carries over from the ingress's (the rest is per process: state, app, extensions).
SCOPE_KEYS = ("http_version", "method", "scheme", "path", "raw_path", "query_string", "root_path", "headers")


def _threads_from_reservation(config: ServerConfig) -> ServerConfig:
    """Without --num-threads, torch would start a thread per core of the node, however many replicas share
    it: run as many as the CPUs Ray reserved for this replica (ray_actor_options num_cpus)."""
    if config.engine.num_threads is not None:
        return config
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    if not cpus:
        return config
    engine = dataclasses.replace(config.engine, num_threads=max(1, int(cpus)))
    return dataclasses.replace(config, engine=engine)


class KVServe:
    """One engine per replica; `handle` serves one HTTP request (see the module docstring)."""

    async def __init__(self, config: ServerConfig) -> None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        # A Ray worker's root logger has no handler: kvserve's own lines (the access log among them) go to
        # stderr, which Ray writes to the replica's log file and, for a local instance, to the driver's.
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        logging.getLogger().setLevel(config.log_level.upper())
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        config = _threads_from_reservation(config)
        self._app = create_app(config)
        self._state = state_of(self._app)
        self._lifespan = self._app.router.lifespan_context(self._app)
        await self._lifespan.__aenter__()
        try:
            while not self._state.is_ready:
                if self._state.load_error is not None:
                    raise RuntimeError(self._state.load_error)
                await asyncio.sleep(READY_POLL_S)
        except BaseException:
            await self._lifespan.__aexit__(None, None, None)
            raise
        mirror = MetricsMirror(config.catalogue[0].name, self._engine_stats)
        self._mirror_task = asyncio.create_task(mirror.run(), name="kvserve-metrics-mirror")
        logger.info("replica %s ready", self._replica_id)

    def _engine_stats(self) -> EngineStats | None:
        return self._state.engine.stats() if self._state.engine is not None else None

    async def handle(
        self, head: dict[str, Any], body: bytes, prefix_hashes: list[int] | None = None
    ) -> AsyncIterator[list[Message]]:
        """Serve one HTTP request: `head` is the ingress's ASGI scope (SCOPE_KEYS, "client", "server"), `body` the
        whole request body. Yields the app's ASGI messages, in batches of what is ready at once.
        prefix_hashes is for the request router (server/ray/router.py), not used here.

        A cancelled call (the client left) tells the app the client disconnected and cancels it.
        """
        scope: dict[str, Any] = {key: head[key] for key in SCOPE_KEYS if key in head}
        scope.update(type="http", asgi={"version": "3.0", "spec_version": "2.3"}, state={})
        for key in ("client", "server"):
            scope[key] = tuple(head[key]) if head.get(key) else None
        outbox: asyncio.Queue[Message | None] = asyncio.Queue()
        finished = asyncio.Event()
        body_sent = False

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await finished.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (REPLICA_HEADER, self._replica_id.encode())]
                message = {**message, "headers": headers}
            outbox.put_nowait(message)

        async def run_app() -> None:
            try:
                await self._app(scope, receive, send)
            finally:
                outbox.put_nowait(None)

        task = asyncio.create_task(run_app())
        try:
            while True:
                batch = [await outbox.get()]
                while not outbox.empty():
                    batch.append(outbox.get_nowait())
                messages = [message for message in batch if message is not None]
                if messages:
                    yield messages
                if None in batch:
                    break
        finally:
            finished.set()
            if not task.done():
                task.cancel()
            # The app answers its own errors (500) and then re-raises them; the middleware logged it already.
            await asyncio.gather(task, return_exceptions=True)

    async def check_health(self) -> None:
        """Raises (Serve then replaces this replica) when a model's engine has died."""
        for name, engine in (
            ("generation", self._state.engine),
            ("embedding", self._state.embedder),
            ("rerank", self._state.reranker),
        ):
            if engine is not None and not engine.is_healthy and not self._state.shutdown.is_draining:
                raise RuntimeError(f"the {name} engine is not running")

    async def __del__(self) -> None:
        """Serve's stop, after its drain: stop the engine (what still runs ends with 503 shutting_down)."""
        task = getattr(self, "_mirror_task", None)
        if task is not None:
            task.cancel()
        if hasattr(self, "_lifespan"):
            self._state.shutdown.begin_draining()
            await self._lifespan.__aexit__(None, None, None)
