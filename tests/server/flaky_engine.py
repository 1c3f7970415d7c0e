"""FlakyEngine: an LLMEngine with knobs the server tests steer (slow steps, failing steps, a failing add)."""

from __future__ import annotations

import time


class FlakyEngine:
    """An LLMEngine with knobs: step_delay (seconds per step), fail_steps (next N steps raise), fail_adds."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.step_delay = 0.0
        self.fail_steps = 0
        self.fail_adds = False

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def add_request(self, prompt, params, request_id=None):
        if self.fail_adds:
            raise RuntimeError("injected bug in add_request")
        return self._inner.add_request(prompt, params, request_id)

    def step(self):
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_steps > 0:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        return self._inner.step()


def flaky_factory(engine_config):
    """An engine factory for create_app: the model loaded as usual, its engine core wrapped."""
    from engine.llm import LLM

    llm = LLM.from_config(engine_config)
    return LLM(FlakyEngine(llm.engine), llm.tokenizer)
