"""`kvserve serve` with a slow model load or slow engine steps: a program the shutdown tests run.

    python -m tests.support.slow_serve [serve flags]

SLOW_SERVE_LOAD_DELAY: seconds the generation model load sleeps first, on the torch thread, where
    nothing can interrupt it (as a large model read from disk or downloaded).
SLOW_SERVE_STEP_DELAY: seconds every engine step sleeps first, so a request's length in time is
    known however fast the machine is.
SLOW_SERVE_APP_DELAY: seconds building the app sleeps first, before the HTTP server runs; it
    writes APP_DELAY_MARKER to stderr as it starts sleeping.
"""

from __future__ import annotations

import os
import sys
import time

APP_DELAY_MARKER = "slow_serve: building the app"


def _patch() -> None:
    import server.app
    from engine.engine_core import LLMEngine
    from engine.llm import LLM

    load_delay = float(os.environ.get("SLOW_SERVE_LOAD_DELAY", "0"))
    step_delay = float(os.environ.get("SLOW_SERVE_STEP_DELAY", "0"))
    app_delay = float(os.environ.get("SLOW_SERVE_APP_DELAY", "0"))
    if load_delay:
        load = LLM.from_config.__func__

        def slow_load(cls, config):
            time.sleep(load_delay)
            return load(cls, config)

        LLM.from_config = classmethod(slow_load)
    if step_delay:
        step = LLMEngine.step

        def slow_step(self):
            time.sleep(step_delay)
            return step(self)

        LLMEngine.step = slow_step
    if app_delay:
        create_app = server.app.create_app

        def slow_create_app(*args, **kwargs):
            print(APP_DELAY_MARKER, file=sys.stderr, flush=True)
            time.sleep(app_delay)
            return create_app(*args, **kwargs)

        server.app.create_app = slow_create_app


if __name__ == "__main__":
    _patch()
    from server.cli.runner import main

    sys.exit(main(sys.argv[1:]))
