"""The `kvserve serve` run: uvicorn with kvserve's connection limits, and its stop on SIGTERM/SIGINT
(drain, then cut, then exit: server/shutdown.py). With --replicas N the same app runs as N replicas on a
local Ray Serve instance instead (server/ray/local.py)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from server.cli.args import add_arguments, config_from_args, scale_out_from_args
from server.http.h11_protocol import ConnectionLimits, limited_h11_protocol
from server.http.request_cap import cap_requests_in_progress
from server.shutdown import DRAINING, SERVING, STOPPING

if TYPE_CHECKING:
    from server.state import ServerState

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Once the stop has cut the requests still running, seconds their last bytes (an SSE error event
# and [DONE]) get to reach a client before the process exits anyway; and seconds uvicorn then
# waits for connections still open. Small, so a stop ends within --shutdown-timeout + ~2 s.
FINISH_AFTER_CUT_S = 1.0
CLOSE_CONNECTIONS_S = 1.0

logger = logging.getLogger(__name__)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger().setLevel(level.upper())


GIL_SWITCH_INTERVAL_S = 0.0005


class _StoppingServer(uvicorn.Server):
    """uvicorn, stopped the kvserve way (server/shutdown.py): drain first, then cut, then exit.

    The first SIGTERM/SIGINT starts draining (while the models still load: stops at once); the
    requests in flight get `grace` seconds; a second signal cuts them at once. The signal handler
    only counts signals: the phases move on uvicorn's 0.1 s tick, on the event loop.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        stop_requests: Callable[[ServerState], Awaitable[None]],
        grace: float,
    ) -> None:
        super().__init__(config)
        self._state = state
        self._stop_requests = stop_requests
        self._grace = grace
        self._num_signals = 0
        self._cut_at = math.inf  # monotonic
        self._exit_at = math.inf  # monotonic

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Replaces uvicorn's handler: it would close the listening socket at once (no 503 phase) and
        # re-raise the signal at exit.
        self._num_signals += 1

    async def on_tick(self, counter: int) -> bool:
        if self._num_signals and not self.should_exit:
            await self._advance_stop()
        return await super().on_tick(counter)

    async def _advance_stop(self) -> None:
        shutdown = self._state.shutdown
        if shutdown.phase == SERVING:
            if not self._state.is_ready:
                logger.info("stop requested while the models load: stopping now")
                self.should_exit = True
                return
            shutdown.begin_draining()
            self._cut_at = time.monotonic() + self._grace
            logger.info(
                "draining: new requests get 503; %d in flight get up to %.1f s to finish",
                shutdown.num_in_flight,
                self._grace,
            )
        if shutdown.phase == DRAINING and (
            shutdown.num_in_flight == 0 or time.monotonic() >= self._cut_at or self._num_signals > 1
        ):
            if shutdown.num_in_flight:
                logger.warning("stopping %d request(s) still in flight: they end with 503", shutdown.num_in_flight)
            await self._stop_requests(self._state)
            self._exit_at = time.monotonic() + FINISH_AFTER_CUT_S
        if shutdown.phase == STOPPING and (shutdown.num_in_flight == 0 or time.monotonic() >= self._exit_at):
            self.should_exit = True


def _exit_before_serving(sig: int, frame: FrameType | None) -> None:
    """A stop before the server runs (flags, imports, the app): nothing needs an orderly end yet."""
    sys.stderr.flush()
    os._exit(0)


def _ignore_signal(sig: int, frame: FrameType | None) -> None:
    """After the server has stopped: a late signal must not change how the process ends."""


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT, then stop cleanly (server/shutdown.py) and return 0.

    A stop drains: the requests in flight get --shutdown-timeout seconds while new ones get 503;
    a second signal cuts them at once. A stop while the models load (or before the server runs)
    exits at once with 0, without waiting for the load: the process ends here (os._exit), since
    the torch thread still loading cannot be interrupted or joined.

    Returns 1 if a model fails to load, 2 on a bad flag combination.
    """
    previous = {sig: signal.signal(sig, _exit_before_serving) for sig in STOP_SIGNALS}
    try:
        return _serve(args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        scale_out = scale_out_from_args(args)
    except ValueError as exc:
        print(f"kvserve serve: {exc}", file=sys.stderr)
        return 2
    _setup_logging(config.log_level)
    if scale_out.is_distributed:
        from server.ray import local as ray_local

        missing = ray_local.missing_ray()
        if missing is not None:
            print(f"kvserve serve: {missing}", file=sys.stderr)
            return 2
        return ray_local.serve_replicas(config, scale_out)
    # Three threads share the GIL: the event loop, the text worker and the torch worker. A decode
    # step gives the GIL up at every native call (a torch op, a kernel) and must win it back each
    # time; under load the holder keeps it for up to the switch interval (5 ms by default), so a
    # 10 ms step could take 200 ms. A shorter interval hands it back sooner.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    from server.app import create_app, stop_requests
    from server.state import state_of

    exit_code = 0
    server: uvicorn.Server | None = None

    def on_fatal(exc: BaseException) -> None:
        nonlocal exit_code
        exit_code = 1
        if server is not None:
            server.should_exit = True

    app = create_app(config, on_fatal=on_fatal)
    state = state_of(app)
    uvicorn_config = uvicorn.Config(
        # The request cap counts requests in progress, not connections (server/http/request_cap.py).
        cap_requests_in_progress(app, config.limit_concurrency),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,  # the middleware writes one line per request with tokens and latency
        # Requests have drained (or been cut) before uvicorn's own shutdown starts: only stragglers are left.
        timeout_graceful_shutdown=CLOSE_CONNECTIONS_S,
        lifespan="on",
        timeout_keep_alive=config.timeout_keep_alive,
        # uvicorn's own limit counts open connections: idle sockets would refuse every request.
        limit_concurrency=None,
        # h11, not "auto": uvicorn's h11 protocol plus the head and body deadlines, the exact head-size
        # limit and the per-client connection cap (server/http/h11_protocol.py).
        http=limited_h11_protocol(
            ConnectionLimits(
                timeout_request_head=config.timeout_request_head,
                timeout_request_body=config.timeout_request_body,
                max_request_head_bytes=config.max_request_head_bytes,
                max_connections_per_client=config.max_connections_per_client,
            )
        ),
        h11_max_incomplete_event_size=config.max_request_head_bytes,
        # Not "auto": with uvloop installed, a client that hung up right after sending a
        # non-streamed request was sometimes never reported as gone, so its generation ran to
        # the end (tests/server/test_server_robustness.py failed ~40% of runs); asyncio's loop never missed it.
        loop="asyncio",
    )
    server = _StoppingServer(uvicorn_config, state, stop_requests, config.shutdown_timeout)
    server.run()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _ignore_signal)
    if state.shutdown.interrupted_load or server.started:
        # The stop is done: requests answered, engine and workers stopped (or a load that cannot be joined).
        # The interpreter's own teardown of torch and the models would take another second here, out of the
        # grace an orchestrator gives before SIGKILL: end the process now, logs flushed.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    if not server.started and exit_code == 0:
        return 1  # could not bind, or start-up failed
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve serve", description="Run the kvserve HTTP server.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
