"""A GGUF served on its own blocks (`--quantization gguf`, the default for .gguf on CPU) against the
same file dequantized to float32: every block type in one file, fused projections whose parts
differ in type, the fused decode step, batching, and the bytes the weights take."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import gguf
import pytest
import torch

from engine.bench.random_gguf import LlamaShape, write_random_gguf
from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams
from engine.quantization.gguf import GgufEmbedding, GgufLinear, GgufPartsLinear
from engine.quantization.int8 import Int8Linear
from engine.runner.decode_path import DecodePath, DecodePlan
from tests.support.native_kernels import needs_kernels

pytestmark = pytest.mark.slow

SHAPE = LlamaShape(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
# Every type with a block kernel, as real files mix them; layer 1's v differs from its q and k.
TYPES = {
    "token_embd.weight": "Q8_0",
    "attn_q.weight": "Q4_0",
    "attn_k.weight": "Q4_0",
    "attn_v.weight": "Q4_0",
    "blk.1.attn_v.weight": "Q8_0",
    "attn_output.weight": "Q8_0",
    "ffn_gate.weight": "Q4_1",
    "ffn_up.weight": "Q4_1",
    "ffn_down.weight": "Q8_0",
    "output.weight": "Q4_1",
}
WORDS = "the quick brown fox jumps over lazy dog hello world paged cache blocks of weights".split()


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gguf-blocks")
    # 0.02, the usual initialisation, leaves the logits of 128-wide layers nearly flat: differences would hide.
    return write_random_gguf(directory / "mixed.gguf", "Q4_0", SHAPE, seed=3, tensor_types=TYPES, weight_std=0.15)


@pytest.fixture(scope="module")
def engines(mixed_gguf):
    """(the file on its blocks, the file dequantized to float32): the second is the reference. Both over a
    float32 KV cache, so that only the weights' blocks and products differ from float32 (the cache formats:
    test_batched_generation_equals_one_at_a_time_over_each_cache_format)."""
    blocks = LLM.from_config(
        EngineConfig(model=str(mixed_gguf), quantization="gguf", block_size=4, kv_cache_dtype="float32")
    )
    reference = LLM(
        _float_engine(blocks, EngineConfig(model=str(mixed_gguf), quantization="none", block_size=4)),
        blocks.tokenizer,
    )
    return blocks, reference


def _float_engine(blocks: LLM, config: EngineConfig, keep_blocks: bool = False):
    """An engine over the same weights dequantized (or, keep_blocks, on the blocks): reads the file again."""
    from engine.engine_core import LLMEngine
    from engine.models.weights import load_checkpoint

    model_config, state = load_checkpoint(config.model, keep_gguf_blocks=keep_blocks)
    return LLMEngine(config, model_config, state, blocks.tokenizer.eos_token_ids)


def _through_torch_layers(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    """The tokens each prompt generates with decode steps through the torch layers (the fused step's reference)."""
    saved = llm.engine.runner.decode_plan
    llm.engine.runner.decode_plan = DecodePlan(DecodePath.TORCH_LAYERS, "the reference", ())
    try:
        return [out[0].token_ids for out in llm.generate(prompts, params)]
    finally:
        llm.engine.runner.decode_plan = saved


def _prompts(llm: LLM, count: int, extra: int = 0) -> list[list[int]]:
    return [llm.tokenizer.encode(" ".join((WORDS * 8)[: 3 + 3 * i + extra])) for i in range(count)]


def test_each_matrix_runs_on_the_files_blocks_and_takes_the_files_bytes(engines, mixed_gguf):
    model = engines[0].engine.runner.model
    layer0, layer1 = model.layers
    assert isinstance(model.embed_tokens, GgufEmbedding) and model.embed_tokens.qtype == "Q8_0"
    assert isinstance(model.lm_head, GgufLinear) and model.lm_head.qtype == "Q4_1"
    kinds = {name: getattr(layer0, name).qtype for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    assert kinds == {"qkv_proj": "Q4_0", "o_proj": "Q8_0", "gate_up_proj": "Q4_1", "down_proj": "Q8_0"}
    # q, k (Q4_0) and v (Q8_0) cannot share one block type: each part stays in its own
    assert isinstance(layer1.qkv_proj, GgufPartsLinear)
    assert [part.qtype for part in layer1.qkv_proj.parts] == ["Q4_0", "Q4_0", "Q8_0"]
    assert not any(isinstance(m, Int8Linear) for m in model.modules())
    _assert_blocks_take_the_files_bytes(model, mixed_gguf)


def _assert_blocks_take_the_files_bytes(model, path) -> None:
    """Block bytes in memory are the file's bytes of its quantized tensors, exactly: nothing dequantized."""
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type.name != "F32")
    held = {m.blocks.data_ptr(): m.blocks.nbytes for m in model.modules() if isinstance(m, GgufLinear | GgufEmbedding)}
    assert sum(held.values()) == file_bytes


def test_prompt_logprobs_follow_the_float32_reference(engines):
    """The only difference from float32 is the activations' rounding to 8-bit blocks."""
    blocks, reference = engines
    prompt = _prompts(blocks, 1, extra=60)[0]
    assert len(prompt) > 64  # the prefill runs the tiled BLAS path, not the kernel
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    ours = blocks.generate([prompt], params)[0][0].prompt_logprobs
    theirs = reference.generate([prompt], params)[0][0].prompt_logprobs
    assert [a.token_id for a in ours[1:]] == [b.token_id for b in theirs[1:]] == prompt[1:]
    differences = [abs(a.logprob - b.logprob) for a, b in zip(ours[1:], theirs[1:])]
    # Measured: max 0.083, mean 0.029 nats; with q and k left in llama.cpp's row order, 6.0 and 1.6.
    assert max(differences) < 0.3 and sum(differences) / len(differences) < 0.1


def test_bfloat16_prefill_products_stay_close_to_the_float32_ones(engines, mixed_gguf, caplog):
    """--prefill-dtype bfloat16: the prompt's products over 64 rows in bfloat16 tiles (oneDNN; any CPU runs
    them, slowly where it lacks AVX-512 BF16), decode steps on the same integer kernel as in float32."""
    blocks = engines[0]
    config = EngineConfig(
        model=str(mixed_gguf), quantization="gguf", block_size=4, prefill_dtype="bfloat16", kv_cache_dtype="float32"
    )
    with caplog.at_level(logging.INFO, logger="engine.runner.model_runner"):
        bf16 = LLM(_float_engine(blocks, config, keep_blocks=True), blocks.tokenizer)
    assert "prefill products in bfloat16" in caplog.text
    assert bf16.engine.runner.prefill_dtype == "bfloat16"
    assert bf16.engine.runner.model.lm_head.prefill_dtype == torch.bfloat16
    prompt = _prompts(blocks, 1, extra=60)[0]
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0, ignore_eos=True)
    ours, theirs = bf16.generate([prompt], params)[0][0], blocks.generate([prompt], params)[0][0]
    differences = [abs(a.logprob - b.logprob) for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:])]
    # Measured: max 0.12, mean 0.035 nats, as far as the 8-bit activations are from float32 (above): these
    # random 0.15-std weights make the logits sharp, which a trained model's are not.
    assert 0 < max(differences) < 0.3 and sum(differences) / len(differences) < 0.1
    assert ours.token_ids == theirs.token_ids


@needs_kernels
def test_the_fused_decode_step_equals_the_torch_layers(engines):
    llm = engines[0]
    runner = llm.engine.runner
    assert runner.decode_plan.path is DecodePath.FUSED_NATIVE
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    request_ids = [llm.engine.add_request(prompt, params) for prompt in _prompts(llm, 5)]
    scheduler = llm.engine.scheduler
    while any(seq.num_generated_tokens == 0 for seq in scheduler.running + list(scheduler.waiting)):
        llm.engine.step()
    batch = scheduler.schedule()
    input_ids, positions, metas = runner.build_inputs(batch)
    meta = metas[0]
    assert meta.is_decode_only
    fused = runner.forward(input_ids, positions, metas)
    reference = runner.model(input_ids, positions, runner.kv_caches, metas)
    assert (fused - reference).abs().max() <= 1e-5 * reference.abs().max()
    for request_id in request_ids:
        llm.engine.abort(request_id)
    llm.engine.step()
    assert not llm.engine.has_unfinished_requests()


def test_batched_generation_equals_one_at_a_time(engines):
    llm = engines[0]
    prompts = _prompts(llm, 6)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(len(prompts))]
    batched = [out[0].token_ids for out in llm.generate(prompts, params)]
    alone = [llm.generate([p], [s])[0][0].token_ids for p, s in zip(prompts, params)]
    assert batched == alone
    assert _through_torch_layers(llm, prompts, params) == batched  # not the fused step


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16", "int8"])
def test_batched_generation_equals_one_at_a_time_over_each_cache_format(mixed_gguf, kv_cache_dtype):
    """Over a 16-bit or int8 cache too, a sequence's tokens do not depend on the batch it ran in. The batch's
    prompts fit one integer-kernel prefill (at most 64 rows, as each alone does): past that, the batched
    prefill's float32 tiles differ from the kernel in the last bits, which a cache's rounding can carry. Prefix
    caching is off: a prompt continued from cached blocks attends through the masked path instead of SDPA's
    causal one, another last-bit difference."""
    config = EngineConfig(
        model=str(mixed_gguf),
        quantization="gguf",
        block_size=4,
        kv_cache_dtype=kv_cache_dtype,
        enable_prefix_caching=False,
    )
    llm = LLM.from_config(config)
    prompts = _prompts(llm, 5)
    assert sum(map(len, prompts)) <= 64
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(len(prompts))]
    batched = [out[0].token_ids for out in llm.generate(prompts, params)]
    assert batched == [llm.generate([p], [s])[0][0].token_ids for p, s in zip(prompts, params)]
    # Not held to the torch layers' tokens here: their RoPE and the fused kernel's give keys that differ in
    # the last float32 bit, which a 16-bit rounding can turn into a step of the cache's own precision (each
    # step's outputs agree: test_fused_decode's test over every cache format).


def test_gguf_quantization_needs_a_gguf_file(tiny_model_dirs):
    with pytest.raises(ValueError, match="needs a .gguf"):
        LLM.from_config(EngineConfig(model=tiny_model_dirs["llama"], quantization="gguf"))


@needs_kernels
def test_five_bit_blocks_serve_on_their_own_blocks_as_the_float32_file_does(tmp_path):
    """Q5_0 and Q5_1, the types llama.cpp falls back to in small models' Q4_K_M files: kept in blocks, the
    fused decode on them, greedy tokens and prompt logprobs as the same file in float32."""
    types = {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_0", "attn_v.weight": "Q5_0", "ffn_down.weight": "Q5_1"}
    path = write_random_gguf(tmp_path / "q5.gguf", "Q5_1", SHAPE, seed=4, tensor_types=types, weight_std=0.15)
    blocks = LLM.from_config(EngineConfig(model=str(path), quantization="gguf", block_size=4))
    model = blocks.engine.runner.model
    assert {layer.qkv_proj.qtype for layer in model.layers} == {"Q5_0"}
    assert {layer.down_proj.qtype for layer in model.layers} == {"Q5_1"}
    assert model.lm_head.qtype == "Q5_1" and blocks.engine.runner.decode_plan.path is DecodePath.FUSED_NATIVE
    reference = LLM(_float_engine(blocks, EngineConfig(model=str(path), quantization="none")), blocks.tokenizer)
    prompt = _prompts(blocks, 1, extra=6)[0]
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, ignore_eos=True)
    ours, theirs = blocks.generate([prompt], params)[0][0], reference.generate([prompt], params)[0][0]
    assert ours.token_ids[:2] == theirs.token_ids[:2]
    differences = [abs(a.logprob - b.logprob) for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:])]
    assert max(differences) < 0.3 and sum(differences) / len(differences) < 0.1


def _assert_follows_the_float32_file(blocks: LLM, path: Path) -> None:
    """Greedy tokens equal and prompt logprobs of a 60-token prompt within the 256-weight types' bounds of the
    same file run in float32."""
    reference = LLM(_float_engine(blocks, EngineConfig(model=str(path), quantization="none")), blocks.tokenizer)
    prompt = _prompts(blocks, 1, extra=60)[0]  # past 64 tokens: the prefill takes the tiled BLAS path
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, ignore_eos=True)
    ours, theirs = blocks.generate([prompt], params)[0][0], reference.generate([prompt], params)[0][0]
    assert ours.token_ids == theirs.token_ids
    differences = [abs(a.logprob - b.logprob) for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:])]
    assert max(differences) < 1.0 and sum(differences) / len(differences) < 0.15


# Q4_K_M's mixture as llama.cpp writes it: Q4_K, Q6_K for the output matrix and half the v / down
# projections, Q5_0 (Q8_0 for Q6_K) where a row is not a multiple of 256 (down's rows here are 640 long).
K_SHAPE = LlamaShape(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=640)
K_TYPES = {"output.weight": "Q6_K", "blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K"}


@needs_kernels
def test_k_quant_blocks_serve_on_their_own_blocks_as_the_float32_file_does(tmp_path, caplog):
    path = write_random_gguf(tmp_path / "qk.gguf", "Q4_K", K_SHAPE, seed=5, tensor_types=K_TYPES, weight_std=0.15)
    with caplog.at_level(logging.INFO, logger="engine.runner.model_runner"):
        blocks = LLM.from_config(EngineConfig(model=str(path), quantization="gguf", block_size=4))
    # The load log names each type kept with its layers and bytes, and the layers left to int8.
    kept = re.search(r"weights: GGUF blocks (.*); int8 none", caplog.text)
    assert kept, caplog.text
    assert re.fullmatch(
        r"Q4_K 8 layers [\d.]+ MiB, Q5_0 1 layers [\d.]+ MiB, Q6_K 2 layers [\d.]+ MiB, Q8_0 1 layers [\d.]+ MiB",
        kept[1],
    )
    model = blocks.engine.runner.model
    layer0, layer1 = model.layers
    assert (model.embed_tokens.qtype, model.lm_head.qtype, layer1.qkv_proj.qtype) == ("Q4_K", "Q6_K", "Q4_K")
    assert [part.qtype for part in layer0.qkv_proj.parts] == ["Q4_K", "Q4_K", "Q6_K"]  # each in its own type
    assert (layer0.down_proj.qtype, layer1.down_proj.qtype, layer0.gate_up_proj.qtype) == ("Q8_0", "Q5_0", "Q4_K")
    _assert_blocks_take_the_files_bytes(model, path)
    assert blocks.engine.runner.decode_plan.path is DecodePath.FUSED_NATIVE

    # Coarser than the 32-weight types' (activations share one scale per 256): measured max 0.51 nats (a
    # token at -16), mean 0.086.
    _assert_follows_the_float32_file(blocks, path)

    prompts = _prompts(blocks, 5)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batched = [out[0].token_ids for out in blocks.generate(prompts, greedy)]
    assert batched == [blocks.generate([p], greedy)[0][0].token_ids for p in prompts]
    assert _through_torch_layers(blocks, prompts, greedy) == batched


# An IQ4_XS file as llama.cpp writes it: IQ4_XS, IQ4_NL where a row is not a multiple of 256 (down's here).
IQ4_TYPES = {"output.weight": "Q6_K"}


@needs_kernels
def test_iq4_blocks_serve_on_their_own_blocks_as_the_float32_file_does(tmp_path):
    path = write_random_gguf(tmp_path / "iq4.gguf", "IQ4_XS", K_SHAPE, seed=6, tensor_types=IQ4_TYPES, weight_std=0.15)
    blocks = LLM.from_config(EngineConfig(model=str(path), quantization="gguf", block_size=4))
    model = blocks.engine.runner.model
    assert (model.embed_tokens.qtype, model.lm_head.qtype) == ("IQ4_XS", "Q6_K")
    assert {(layer.qkv_proj.qtype, layer.gate_up_proj.qtype, layer.down_proj.qtype) for layer in model.layers} == {
        ("IQ4_XS", "IQ4_XS", "IQ4_NL")
    }
    _assert_blocks_take_the_files_bytes(model, path)
    assert blocks.engine.runner.decode_plan.path is DecodePath.FUSED_NATIVE

    _assert_follows_the_float32_file(blocks, path)
    prompts = _prompts(blocks, 3)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    batched = [out[0].token_ids for out in blocks.generate(prompts, greedy)]
    assert batched == [blocks.generate([p], greedy)[0][0].token_ids for p in prompts]
    assert _through_torch_layers(blocks, prompts, greedy) == batched
