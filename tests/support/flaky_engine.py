"""FlakyEngine: an LLMEngine with knobs the server tests steer (slow steps, failing steps, a failing add,
a failing request, a broken model)."""

from __future__ import annotations

import time


class FlakyEngine:
    """An LLMEngine with knobs: step_delay (seconds per step), fail_steps (next N steps raise), fail_adds,
    fail_seed (the model runner raises for any batch holding a request with this seed, as a bug that one
    request's parameters trigger would) and model_broken (the model runner raises for every batch)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.step_delay = 0.0
        self.fail_steps = 0
        self.fail_adds = False
        self.fail_seed: int | None = None
        self.model_broken = False
        run_batch = inner.runner.execute

        def execute(batch):
            if self.model_broken:
                raise RuntimeError("injected model failure")
            if self.fail_seed is not None and any(seq.params.seed == self.fail_seed for seq in batch.seqs):
                raise RuntimeError("injected failure of one request")
            return run_batch(batch)

        inner.runner.execute = execute

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

    def probe(self):
        """A step failure injected here is the engine's own: the probe of the model alone fails too."""
        if self.fail_steps > 0:
            raise RuntimeError("injected step failure")
        self._inner.probe()


def flaky_factory(engine_config):
    """An engine factory for create_app: the model loaded as usual, its engine core wrapped."""
    from engine.llm import LLM

    llm = LLM.from_config(engine_config)
    return LLM(FlakyEngine(llm.engine), llm.tokenizer)
