"""The fused native decode step (engine/ops/fused_decode.c) equals the torch layers it replaces, for
every registered architecture whose entry says fused_decode; the others are refused the fused path."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.models import registry
from engine.ops.loader import unavailable_reason
from engine.params import SamplingParams
from engine.runner.decode_path import DecodePath, DecodePlan
from tests.conftest import ARCHS
from tests.support.native_kernels import KERNELS_EXPECTED, needs_kernels
from tests.support.tiny_models import make_tiny_model

WORDS = "the quick brown fox jumps over lazy dog hello world paged cache".split()
# The registered architectures the fused kernel computes, by model_type (tiny_model_dirs' keys).
FUSED_ARCHS = [entry.model_type for entry in registry.entries() if entry.fused_decode]


def _engine(model_dir: str, **overrides) -> LLM:
    """An int8 engine over a float32 cache (unless overridden), whose rows both paths write bit for bit."""
    settings = {"block_size": 4, "quantization": "int8", "kv_cache_dtype": "float32", **overrides}
    return LLM.from_config(EngineConfig(model=model_dir, **settings))


def _prompts(engine: LLM, count: int) -> list[list[int]]:
    return [engine.tokenizer.encode(" ".join(WORDS[: 3 + 2 * i])) for i in range(count)]


def _decode_metadata(engine: LLM, prompts: list[list[int]]):
    """Prefill the prompts, then build (without running) the next decode step of all of them."""
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for prompt in prompts:
        engine.engine.add_request(prompt, params)
    while any(
        seq.num_generated_tokens == 0 for seq in engine.engine.scheduler.running + list(engine.engine.scheduler.waiting)
    ):
        engine.engine.step()
    batch = engine.engine.scheduler.schedule()
    assert all(count == 1 for count in batch.num_new_tokens)
    return engine.engine.runner.build_inputs(batch)


@needs_kernels
@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_fused_step_equals_torch_layers(tiny_model_dirs, arch):
    # mistral: window 16 is shorter than the longer prompts (a masked step); qwen2: q/k/v biases.
    engine = _engine(tiny_model_dirs[arch])
    runner = engine.engine.runner
    assert runner.decode_plan.path is DecodePath.FUSED_NATIVE
    input_ids, positions, metas = _decode_metadata(engine, _prompts(engine, 5))
    meta = metas[0]
    assert meta.is_decode_only
    if arch == "mistral":
        assert meta.attn_mask is not None
    fused = runner.forward(input_ids, positions, metas)
    reference = runner.model(input_ids, positions, runner.kv_caches, metas)  # the torch layers
    # The kernel's GELU and torch's differ in the last bit, which can move one int8 activation rounding of
    # a row (gemma: ~2e-5 of the largest value); a wrong norm, RoPE or mask is off by orders of magnitude more.
    assert (fused - reference).abs().max() <= 1e-4 * reference.abs().max()


@needs_kernels
@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_fused_step_equals_torch_layers_over_every_cache_format(tiny_model_dirs, arch, kv_cache_dtype):
    """The fused kernel writes the step's keys and values in the cache's format and reads every earlier row
    in it, as the torch layers do."""
    engine = _engine(tiny_model_dirs[arch], kv_cache_dtype=kv_cache_dtype)
    runner = engine.engine.runner
    assert runner.decode_plan.path is DecodePath.FUSED_NATIVE, runner.decode_plan.reason
    assert runner.kv_caches[0][0].dtype == getattr(torch, kv_cache_dtype)
    input_ids, positions, metas = _decode_metadata(engine, _prompts(engine, 5))
    fused = runner.forward(input_ids, positions, metas)
    reference = runner.model(input_ids, positions, runner.kv_caches, metas)

    assert (fused - reference).abs().max() <= 1e-4 * reference.abs().max()


@needs_kernels
def test_fused_step_with_heads_of_128_values(tmp_path):
    """Heads of 128 values (Qwen3's, LLaMA 3's) go key by key, in 512-bit registers where the CPU has AVX-512:
    the fused kernel's copy of the attention takes the same way as the torch layers' and gives their step, over
    a sequence of 600 keys (two spans of 512) beside short ones."""
    from engine.ops.decode_attention import use_wide_attention, wide_attention

    model_dir = make_tiny_model(tmp_path, "qwen3", head_dim=128, max_position_embeddings=1024)
    engine = _engine(str(model_dir), kv_cache_dtype="float16")
    runner = engine.engine.runner
    assert runner.decode_plan.path is DecodePath.FUSED_NATIVE, runner.decode_plan.reason
    long_prompt = [10 + (7 * i) % 290 for i in range(600)]
    input_ids, positions, metas = _decode_metadata(engine, _prompts(engine, 4) + [long_prompt])
    fused = runner.forward(input_ids, positions, metas)
    assert use_wide_attention("fused_decode", None) == wide_attention()
    assert ("decode attention in 512-bit registers" in runner._machine_line()) == wide_attention()
    reference = runner.model(input_ids, positions, runner.kv_caches, metas)
    assert (fused - reference).abs().max() <= 1e-4 * reference.abs().max()


@needs_kernels
def test_fused_step_of_a_gemma_with_exact_gelu_and_every_window_kind(tmp_path):
    """Gemma 2 with the exact (erf) GELU and softcapped scores: each of its two attention groups (sliding
    layers under a window of 8, full layers) gets its own block tables and mask in the one native call."""
    engine = _engine(str(make_tiny_model(tmp_path, "gemma2", hidden_activation="gelu")))
    runner = engine.engine.runner
    assert runner.decode_plan.path is DecodePath.FUSED_NATIVE, runner.decode_plan.reason
    assert "2 attention groups" in runner.decode_plan.describe()
    input_ids, positions, metas = _decode_metadata(engine, _prompts(engine, 4))
    assert sorted(group.is_sliding for group in runner.layout.groups) == [False, True]
    first, second = (metas[group.layers[0]] for group in runner.layout.groups)
    assert not torch.equal(first.key_blocks, second.key_blocks)  # each group's own blocks
    fused = runner.forward(input_ids, positions, metas)
    reference = runner.model(input_ids, positions, runner.kv_caches, metas)
    assert (fused - reference).abs().max() <= 1e-4 * reference.abs().max()


def _verification_metadata(engine: LLM, prompts: list[list[int]], drafts: list[list[int]]):
    """Prefill the prompts, then build the next step with each sequence's drafts after its token."""
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for prompt in prompts:
        engine.engine.add_request(prompt, params)
    scheduler = engine.engine.scheduler
    while any(seq.num_generated_tokens == 0 for seq in scheduler.running + list(scheduler.waiting)):
        engine.engine.step()
    batch = scheduler.schedule()
    for i, seq in enumerate(batch.seqs):
        assert engine.engine.kv_manager.grow(seq, seq.num_computed_tokens + 1 + len(drafts[i]))
        batch.num_draft_slots[i] = len(drafts[i])
    batch.set_drafts(drafts)
    assert batch.decodes_only
    return batch


@needs_kernels
@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_fused_verification_step_equals_torch_layers(tiny_model_dirs, arch):
    """A decoding token and its speculative drafts as one row each: the fused kernel sees exactly the
    keys the torch layers' mask shows each of them (drafts of one sequence see the ones before them;
    mistral: under a window of 16, with a sink token)."""
    overrides = {"num_sink_tokens": 1} if arch == "mistral" else {}
    engine = _engine(tiny_model_dirs[arch], **overrides)
    runner = engine.engine.runner
    prompts = _prompts(engine, 5)
    drafts = [[5, 9, 13], [], [7], [11, 12, 13, 14], [3, 3]]
    batch = _verification_metadata(engine, prompts, drafts)
    input_ids, positions, metas = runner.build_inputs(batch)
    meta = metas[0]
    assert not meta.is_decode_only and meta.attn_mask is not None
    fused = runner.forward(input_ids, positions, metas, short_queries=True)
    reference = runner.model(input_ids, positions, runner.kv_caches, metas)  # the torch layers
    assert fused.shape == (len(prompts) + sum(map(len, drafts)), reference.shape[1])
    # int8 activations round at each layer, so float32 differences in attention can move a rounding
    # (measured up to 1.1e-4 of the largest value); a wrong mask (a draft seeing the key after it) is off by
    # 0.28 to 0.9 of it.
    assert (fused - reference).abs().max() <= 1e-3 * reference.abs().max()


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_generates_alike_on_both_paths_or_is_refused_the_fused_one(
    tiny_model_dirs, arch, monkeypatch
):
    """An architecture the registry gives fused_decode generates the same tokens and logprobs on the
    fused kernel as on its torch layers; any other never runs the fused kernel, and says why."""
    entry = registry.for_model_type(arch)
    fused_engine = _engine(tiny_model_dirs[arch])
    plan = fused_engine.engine.runner.decode_plan
    if not entry.fused_decode:
        assert plan.path is DecodePath.TORCH_LAYERS and fused_engine.engine.runner.fused_decode is None
        assert plan.reason == f"{entry.name} has no fused decode kernel"
        return
    unavailable = unavailable_reason("fused_decode")
    if unavailable is not None and not KERNELS_EXPECTED:
        pytest.skip(f"the fused decode kernel cannot run here: {unavailable}")
    assert plan.path is DecodePath.FUSED_NATIVE, plan.reason
    torch_engine = _engine(tiny_model_dirs[arch])
    # The same int8 engine, its runner told to decode through the torch layers.
    torch_engine.engine.runner.decode_plan = DecodePlan(DecodePath.TORCH_LAYERS, "the reference", ())
    prompts = _prompts(fused_engine, 6)
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True, logprobs=2) for i in range(len(prompts))
    ]
    fused = fused_engine.generate(prompts, params)
    # The reference runs its decode steps in the torch layers, never in the fused call its runner also holds.
    fused_calls = []
    original = type(torch_engine.engine.runner.fused_decode).__call__
    monkeypatch.setattr(
        type(torch_engine.engine.runner.fused_decode), "__call__", lambda *a: fused_calls.append(1) or original(*a)
    )
    reference = torch_engine.generate(prompts, params)
    assert not fused_calls
    assert [f[0].token_ids for f in fused] == [r[0].token_ids for r in reference]
    for f, r in zip(fused, reference):
        for got, expected in zip(f[0].logprobs, r[0].logprobs):
            assert abs(got.logprob - expected.logprob) < 1e-3  # float32 rounding, compounded over 20 steps


@needs_kernels
def test_float32_models_keep_the_torch_layers(tiny_model_dirs):
    engine = LLM.from_config(EngineConfig(model=tiny_model_dirs["llama"]))
    assert engine.engine.runner.decode_plan.path is DecodePath.TORCH_LAYERS
