"""The offline LLM loads on a thread that ends with the load, so the thread that generates holds the process's
only OpenMP team (a second, live team makes every parallel region of the native kernels wait to be woken)."""

from __future__ import annotations

import threading

import engine.llm as llm_module
from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams
from tests.support.tiny_models import make_tiny_model


def test_llm_loads_on_a_thread_that_has_ended(tmp_path, monkeypatch):
    loaders: list[threading.Thread] = []
    load = llm_module.load_generation

    def recording_load(config):
        loaders.append(threading.current_thread())
        return load(config)

    monkeypatch.setattr(llm_module, "load_generation", recording_load)
    llm = LLM.from_config(EngineConfig(model=str(make_tiny_model(tmp_path)), quantization="int8", block_size=4))
    assert len(loaders) == 1
    assert loaders[0] is not threading.current_thread()
    assert not loaders[0].is_alive()
    # and the caller generates as before
    [[result]] = llm.generate(["hello world"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(result.token_ids) == 3
