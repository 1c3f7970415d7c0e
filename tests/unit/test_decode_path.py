"""The runner picks one decode path at start-up, holds it in its DecodePlan and logs it."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.models import registry
from engine.ops import loader
from engine.ops.cpu_features import cpu_features
from engine.params import SamplingParams
from engine.runner.decode_path import DecodePath, choose_decode_path
from engine.runner.model_runner import FUSED_ROWS_MAX_QUERY, ModelRunner
from tests.support.native_kernels import KERNELS_EXPECTED, needs_kernels

REPO_ROOT = Path(__file__).resolve().parents[2]


def _runner(model_dir: str, **overrides) -> ModelRunner:
    return LLM.from_config(EngineConfig(model=model_dir, block_size=4, **overrides)).engine.runner


@needs_kernels
def test_int8_llama_on_cpu_runs_the_fused_decode_and_says_so(tiny_model_dirs, caplog):
    with caplog.at_level(logging.INFO, logger="engine.runner.model_runner"):
        runner = _runner(tiny_model_dirs["llama"], quantization="int8")
    assert runner.decode_plan.path is DecodePath.FUSED_NATIVE
    assert runner.fused_decode is not None
    assert runner.decode_plan.native_ops == ("rms_norm", "decode_attention", "int8_linear")
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.runner.model_runner"]
    decode_lines = [line for line in lines if line.startswith("decode path:")]
    assert decode_lines == [runner.decode_plan.describe() + runner._machine_line()]
    # on CPU the line ends with what the kernels were chosen by and built for (no GGUF layers: no prefill dtype)
    features = " ".join(cpu_features())
    assert runner._machine_line() == f"; CPU {features}; kernels built for {loader.chosen_isa()}"
    assert "fused native decode" in decode_lines[0] and "quantized float32 LlamaForCausalLM on CPU" in decode_lines[0]


def test_float32_llama_runs_the_torch_layers(tiny_model_dirs, caplog):
    with caplog.at_level(logging.INFO, logger="engine.runner.model_runner"):
        runner = _runner(tiny_model_dirs["llama"])
    plan = runner.decode_plan
    assert plan.path is DecodePath.TORCH_LAYERS and runner.fused_decode is None
    assert "neither int8 nor GGUF" in plan.reason
    assert plan.native_ops == (("rms_norm", "decode_attention") if KERNELS_EXPECTED else ())
    assert plan.describe() + runner._machine_line() in [r.getMessage() for r in caplog.records]
    assert "decode path: torch layers" in plan.describe()


def test_gpt2_runs_the_torch_layers_even_in_int8(tiny_model_dirs):
    plan = _runner(tiny_model_dirs["gpt2"], quantization="int8").decode_plan
    assert plan.path is DecodePath.TORCH_LAYERS
    assert plan.reason == "GPT2LMHeadModel has no fused decode kernel"
    assert plan.native_ops == (("decode_attention", "int8_linear") if KERNELS_EXPECTED else ())


def test_the_fused_decode_runs_only_where_the_registry_entry_says_so(tiny_model_dirs, monkeypatch):
    """The model's class alone never picks the fused kernel: an entry without fused_decode keeps the torch
    layers, even for a LlamaForCausalLM the kernel could read."""
    runner = _runner(tiny_model_dirs["llama"], quantization="int8")
    entry = registry.lookup("LlamaForCausalLM")
    monkeypatch.setitem(registry._BY_NAME, entry.name, dataclasses.replace(entry, fused_decode=False))
    plan = choose_decode_path(runner.model, runner.kv_caches, runner.layout)
    assert plan.path is DecodePath.TORCH_LAYERS
    assert plan.reason == "LlamaForCausalLM has no fused decode kernel"


@pytest.mark.slow
def test_native_kernels_off_runs_the_torch_layers_with_torch_ops(tiny_model_dirs):
    # The switch is read when a library first loads, so it needs a fresh process.
    script = (
        "import sys\n"
        "from engine.config import EngineConfig\n"
        "from engine.llm import LLM\n"
        "plan = LLM.from_config(EngineConfig(model=sys.argv[1], quantization='int8')).engine.runner.decode_plan\n"
        "print(plan.path.name, plan.native_ops, plan.reason, sep='|')\n"
    )
    env = {**os.environ, "KVSERVE_NATIVE_KERNELS": "0"}
    result = subprocess.run(
        [sys.executable, "-c", script, tiny_model_dirs["llama"]],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    path, native_ops, reason = result.stdout.strip().splitlines()[-1].split("|")
    assert (path, native_ops) == ("TORCH_LAYERS", "()")
    assert reason == "the fused decode kernel is unavailable: KVSERVE_NATIVE_KERNELS=0"


@pytest.mark.parametrize(
    "quantization,expected_forwards",
    [("none", [False, True, True]), pytest.param("int8", [False], marks=needs_kernels)],
    ids=["torch layers", "fused"],
)
def test_the_runner_performs_its_chosen_path(tiny_model_dirs, monkeypatch, quantization, expected_forwards):
    """model.forward runs every step on the torch path, only the prefill on the fused one (a prompt longer
    than FUSED_ROWS_MAX_QUERY: shorter ones run on the fused kernel too, a row per token)."""
    llm = LLM.from_config(EngineConfig(model=tiny_model_dirs["llama"], block_size=4, quantization=quantization))
    model = llm.engine.runner.model
    forward = model.forward
    forwards = []

    def recording_forward(input_ids, positions, kv_caches, metas):
        forwards.append(metas[0].is_decode_only)
        return forward(input_ids, positions, kv_caches, metas)

    monkeypatch.setattr(model, "forward", recording_forward)
    long_prompt = [5 + i % 50 for i in range(FUSED_ROWS_MAX_QUERY + 8)]
    llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert forwards == expected_forwards
    forwards.clear()
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert forwards == (expected_forwards if quantization == "none" else [])
