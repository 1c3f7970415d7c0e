"""Prefix-cache hits are exact even when block hashes collide."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core import block_pool
from engine.llm import LLM
from engine.params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
FIRST = list(range(100, 118))
SECOND = list(range(200, 218))  # every block differs from FIRST's


def _every_hash_collides(monkeypatch) -> None:
    monkeypatch.setattr(block_pool, "hash_block_tokens", lambda parent_hash, token_ids: b"\0" * 32)


def _engine(model_dir: str, prefix_caching: bool) -> LLM:
    return LLM.from_config(EngineConfig(model=model_dir, block_size=4, enable_prefix_caching=prefix_caching))


def _tokens(engine: LLM, prompt: list[int]) -> list[int]:
    return engine.generate([prompt], PARAMS)[0][0].token_ids


def test_a_colliding_block_of_another_prompt_is_never_reused(tiny_llama_dir, monkeypatch):
    _every_hash_collides(monkeypatch)
    expected = _tokens(_engine(tiny_llama_dir, prefix_caching=False), SECOND)
    engine = _engine(tiny_llama_dir, prefix_caching=True)
    _tokens(engine, FIRST)  # publishes FIRST's first block under the one digest
    assert _tokens(engine, SECOND) == expected
    stats = engine.engine.stats()
    assert stats.prefix_cache_hits == 0
    assert stats.prefix_cache_queries == len(FIRST) + len(SECOND)


def test_equal_tokens_at_another_position_are_not_a_hit(tiny_llama_dir, monkeypatch):
    _every_hash_collides(monkeypatch)
    repeats_first_block = FIRST[:4] * 4 + FIRST[:2]
    expected = _tokens(_engine(tiny_llama_dir, prefix_caching=False), repeats_first_block)
    engine = _engine(tiny_llama_dir, prefix_caching=True)
    _tokens(engine, FIRST)
    assert _tokens(engine, repeats_first_block) == expected
    # Only position 0 holds FIRST[:4] after nothing: the copies at positions 1..3 are computed.
    assert engine.engine.stats().prefix_cache_hits == 4


def test_prefix_cache_hits_are_counted_only_within_a_cache_salt(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, prefix_caching=True)
    expected = _tokens(_engine(tiny_llama_dir, prefix_caching=False), FIRST)

    def run(cache_salt: str | None) -> int:
        """The prefix-cache hits (tokens) of one request for FIRST under this salt."""
        before = engine.engine.stats().prefix_cache_hits
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, cache_salt=cache_salt)
        assert engine.generate([FIRST], params)[0][0].token_ids == expected
        return engine.engine.stats().prefix_cache_hits - before

    assert run("tenant-a") == 0
    assert run("tenant-b") == 0  # same tokens, another tenant: computed again
    assert run(None) == 0
    full_blocks = (len(FIRST) - 1) // 4 * 4  # every full block before the one holding the last token
    assert run("tenant-a") == full_blocks
    assert run("tenant-b") == full_blocks
    assert run(None) == full_blocks
