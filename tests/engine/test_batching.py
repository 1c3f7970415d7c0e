"""Continuous batching gives exactly what one-at-a-time generation gives."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams
from tests.support.workloads import mixed_params, random_prompts


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_sixteen_requests_together_equal_each_alone(tiny_llama_dir, seeded):
    engine = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=8, max_num_batched_tokens=64))
    prompts = random_prompts(engine, 16)
    params = [mixed_params(i, seeded) for i in range(16)]
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    for t, a in zip(together, alone):
        assert t[0].token_ids == a[0].token_ids
        assert t[0].text == a[0].text
    assert engine.engine.stats().num_used_blocks == 0


def test_small_pool_preempts_and_still_matches(tiny_llama_dir):
    params = [mixed_params(i, seeded=True) for i in range(12)]
    big = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4))
    prompts = random_prompts(big, 12, seed=1)
    expected = big.generate(prompts, params)
    # 30 usable blocks of 4 tokens cannot hold 12 sequences of up to ~60 tokens at once.
    small = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, num_blocks=31))
    got = small.generate(prompts, params)
    assert [g[0].token_ids for g in got] == [e[0].token_ids for e in expected]
    stats = small.engine.stats()
    assert stats.num_preemptions > 0
    # A preempted prompt is recomputed, but counted once.
    assert stats.num_prompt_tokens == big.engine.stats().num_prompt_tokens == sum(len(p) for p in prompts)
    assert stats.num_computed_prompt_tokens >= stats.num_prompt_tokens - stats.num_cached_prompt_tokens
    assert stats.num_used_blocks == 0
    assert small.engine.pool.num_free_blocks == 30


def test_prefix_caching_hits_and_matches_caching_off(tiny_llama_dir):
    shared = "The quick brown fox jumps over the lazy dog. " * 4
    suffixes = ["Hello world", "A paged cache", "keys and values", "lazy dog"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(caching: bool):
        engine = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, enable_prefix_caching=caching))
        outs = [engine.generate([shared + s], params)[0][0].token_ids for s in suffixes]
        return engine, outs

    cached_engine, cached = run(True)
    plain_engine, plain = run(False)
    assert cached == plain
    stats = cached_engine.engine.stats()
    assert stats.prefix_cache_hits > 0
    plain_stats = plain_engine.engine.stats()
    # Both count every prompt token once; later requests computed fewer of them than they had.
    assert stats.num_prompt_tokens == plain_stats.num_prompt_tokens
    assert stats.num_cached_prompt_tokens > 0 and plain_stats.num_cached_prompt_tokens == 0
    assert stats.num_computed_prompt_tokens == stats.num_prompt_tokens - stats.num_cached_prompt_tokens
    assert plain_stats.num_computed_prompt_tokens == plain_stats.num_prompt_tokens
    assert stats.num_used_blocks == 0


def test_n_samples_share_prompt_blocks(tiny_llama_dir):
    engine = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4))
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    results = engine.generate([prompt], params)[0]
    assert [r.index for r in results] == [0, 1, 2]
    assert len({tuple(r.token_ids) for r in results}) > 1  # different samples
    assert engine.engine.stats().prefix_cache_hits == 2 * ((len(prompt) - 1) // 4 * 4)
    # The n samples share one prompt: it counts once, and sample 0 found none of it cached.
    assert (engine.engine.stats().num_prompt_tokens, engine.engine.stats().num_cached_prompt_tokens) == (len(prompt), 0)
    # Each sample equals the same seed run alone as a single sample.
    for r in results:
        single = SamplingParams(temperature=1.0, seed=7 + r.index, max_tokens=8, ignore_eos=True)
        assert engine.generate([prompt], single)[0][0].token_ids == r.token_ids


def test_abort_frees_blocks_and_reports(tiny_llama_dir):
    engine = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4))
    rid = engine.engine.add_request(
        engine.tokenizer.encode("Hello world"), SamplingParams(max_tokens=50, ignore_eos=True)
    )
    engine.engine.step()
    engine.engine.step()
    assert engine.engine.stats().num_used_blocks > 0
    engine.engine.abort(rid)
    assert engine.engine.stats().num_used_blocks == 0
    outs = engine.engine.step()
    assert outs and outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert not engine.engine.has_unfinished_requests()


def test_prompt_too_long_states_both_numbers(tiny_llama_dir):
    from engine.errors import PromptTooLongError

    engine = LLM.from_config(EngineConfig(model=tiny_llama_dir, max_model_len=64))
    with pytest.raises(PromptTooLongError) as err:
        engine.engine.add_request(list(range(5, 75)), SamplingParams(max_tokens=4))
    assert "70" in str(err.value) and "64" in str(err.value)
    with pytest.raises(PromptTooLongError) as err:
        engine.engine.add_request(list(range(5, 45)), SamplingParams(max_tokens=40))
    assert "40" in str(err.value) and "64" in str(err.value) and "80" in str(err.value)


def test_unencodable_text_is_a_request_error(tiny_llama_dir):
    from engine.errors import InvalidRequestError

    engine = LLM.from_config(EngineConfig(model=tiny_llama_dir))
    with pytest.raises(InvalidRequestError):
        engine.tokenizer.encode("broken \ud800 surrogate")
    assert not engine.engine.has_unfinished_requests()


def test_prefix_cache_counts_each_sequence_once_under_pressure(tiny_llama_dir):
    """Re-admission attempts of a waiting sequence (pool full) must not inflate the counters."""
    engine = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, num_blocks=16))
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.generate([prompt] * 3, params)
    stats = engine.engine.stats()
    assert stats.prefix_cache_queries == 3 * len(prompt)
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries


def test_window_request_larger_than_pool_is_refused_up_front(tiny_model_dirs):
    from engine.errors import PromptTooLongError

    engine = LLM.from_config(EngineConfig(model=tiny_model_dirs["mistral"], block_size=4, num_blocks=4))
    with pytest.raises(PromptTooLongError):
        engine.engine.add_request(list(range(5, 60)), SamplingParams(max_tokens=4))
