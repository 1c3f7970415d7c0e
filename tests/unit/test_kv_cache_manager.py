"""KVCacheManager at block_size=2: table growth, freeing, window release and prefix lookup."""

from __future__ import annotations

import itertools

from engine.core import block_pool
from engine.core.block_pool import NULL_BLOCK, BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence
from engine.params import SamplingParams

_seq_ids = itertools.count()


def _seq(token_ids: list[int]) -> Sequence:
    return Sequence(
        seq_id=next(_seq_ids),
        request_id="r",
        index=0,
        prompt_token_ids=list(token_ids),
        params=SamplingParams(),
        arrival_time=0.0,
    )


def _manager(num_blocks: int = 16, sliding_window: int | None = None, num_sink_tokens: int = 0) -> KVCacheManager:
    return KVCacheManager.single(BlockPool(num_blocks), 2, sliding_window, num_sink_tokens)


def _computed(manager: KVCacheManager, token_ids: list[int]) -> Sequence:
    """A sequence whose whole prompt was computed and published."""
    seq = _seq(token_ids)
    assert manager.grow(seq, len(token_ids))
    seq.num_computed_tokens = len(token_ids)
    manager.register_computed_blocks(seq)
    return seq


def test_grow_takes_exactly_the_blocks_needed():
    manager = _manager()
    seq = _seq([1, 2, 3, 4, 5])
    assert manager.grow(seq, 5)
    assert len(seq.block_table) == 3
    assert manager.grow(seq, 6)
    assert len(seq.block_table) == 3
    assert manager.grow(seq, 7)
    assert len(seq.block_table) == 4
    assert manager.grow(seq, 3)  # never shrinks
    assert len(seq.block_table) == 4
    assert len(set(seq.block_table)) == 4 and NULL_BLOCK not in seq.block_table
    assert manager.pool.num_used_blocks == 4


def test_grow_takes_nothing_when_the_pool_is_short():
    manager = _manager(num_blocks=4)  # 3 usable
    seq = _seq([1] * 7)
    assert manager.grow(seq, 2)
    assert not manager.grow(seq, 8)  # needs 3 more, 2 free
    assert len(seq.block_table) == 1
    assert manager.pool.num_free_blocks == 2
    assert manager.grow(seq, 6)
    assert manager.pool.num_free_blocks == 0


def test_free_gives_every_reference_back_tail_first():
    manager = _manager(num_blocks=4)
    seq = _computed(manager, [1, 2, 3, 4, 5, 6])
    table = list(seq.block_table)
    shared = _seq([1, 2, 3, 4, 5, 6, 7])
    assert manager.take_cached_prefix(shared) == 6
    assert [manager.pool.ref_count(b) for b in table] == [2, 2, 2]
    manager.free(shared)
    assert shared.block_table == []
    assert [manager.pool.ref_count(b) for b in table] == [1, 1, 1]
    manager.free(seq)
    assert seq.block_table == [] and seq.num_registered_blocks == 0
    assert manager.pool.num_used_blocks == 0
    # The tail was released first, so it is evicted first and the head stays findable longest.
    assert [manager.pool.allocate() for _ in range(3)] == table[::-1]


def test_release_out_of_window_keeps_sinks_and_live_blocks():
    manager = _manager(sliding_window=4, num_sink_tokens=2)
    seq = _seq(list(range(12)))
    assert manager.grow(seq, 12)
    table = list(seq.block_table)
    free_before = manager.pool.num_free_blocks
    # The next query is position 10; it sees keys 7..10 and the sinks 0..1.
    seq.num_computed_tokens = 10
    manager.release_out_of_window(seq)
    assert seq.block_table == [table[0], NULL_BLOCK, NULL_BLOCK, table[3], table[4], table[5]]
    assert manager.pool.ref_count(table[1]) == manager.pool.ref_count(table[2]) == 0
    assert manager.pool.num_free_blocks == free_before + 2
    manager.release_out_of_window(seq)  # idempotent
    assert manager.pool.num_free_blocks == free_before + 2
    manager.free(seq)  # NULL entries give nothing back twice
    assert manager.pool.num_used_blocks == 0


def test_release_out_of_window_before_the_window_fills_is_a_no_op():
    manager = _manager(sliding_window=4, num_sink_tokens=0)
    seq = _seq(list(range(6)))
    assert manager.grow(seq, 6)
    seq.num_computed_tokens = 4  # query 4 sees keys 1..4: block 0 still holds key 1
    manager.release_out_of_window(seq)
    assert NULL_BLOCK not in seq.block_table
    seq.num_computed_tokens = 5  # query 5 sees keys 2..5: block 0 (keys 0, 1) is dead
    manager.release_out_of_window(seq)
    assert seq.block_table[0] == NULL_BLOCK and NULL_BLOCK not in seq.block_table[1:]


def test_prefix_lookup_takes_full_blocks_before_the_last_token():
    manager = _manager()
    first = _computed(manager, [1, 2, 3, 4, 5, 6, 7])
    assert first.num_registered_blocks == 3  # the partial block (7,) is not published

    same = _seq([1, 2, 3, 4, 5, 6, 7])
    assert manager.take_cached_prefix(same) == 6
    assert same.block_table == first.block_table[:3]

    # The block holding the last token is computed again, even when cached.
    ends_on_a_block = _seq([1, 2, 3, 4, 5, 6])
    assert manager.take_cached_prefix(ends_on_a_block) == 4
    assert ends_on_a_block.block_table == first.block_table[:2]

    one_block = _seq([1, 2])
    assert manager.take_cached_prefix(one_block) == 0
    assert one_block.block_table == []


def test_prefix_lookup_stops_at_the_first_differing_block():
    manager = _manager()
    first = _computed(manager, [1, 2, 3, 4, 5, 6, 7])
    differs_first = _seq([9, 2, 3, 4, 5, 6, 7])
    assert manager.take_cached_prefix(differs_first) == 0
    differs_second = _seq([1, 2, 9, 4, 5, 6, 7])
    assert manager.take_cached_prefix(differs_second) == 2
    assert differs_second.block_table == first.block_table[:1]


def test_a_later_block_is_chained_to_its_prefix():
    manager = _manager()
    first = _computed(manager, [1, 2, 3, 4, 5])
    _computed(manager, [8, 8, 0])
    # Block (3, 4) is cached after (1, 2); after (8, 8) it is another block.
    probe = _seq([8, 8, 3, 4, 5])
    assert manager.take_cached_prefix(probe) == 2
    assert probe.block_hashes[1] != first.block_hashes[1]


def test_a_colliding_hash_never_serves_another_blocks_tokens(monkeypatch):
    monkeypatch.setattr(block_pool, "hash_block_tokens", lambda parent_hash, token_ids: b"same")
    manager = _manager()
    first = _computed(manager, [1, 2, 3, 4, 5])  # only (1, 2) is published: every digest is equal
    assert manager.take_cached_prefix(_seq([9, 9, 3, 4, 5])) == 0
    # Same tokens at another position: (1, 2) after (1, 2) is not the cached (1, 2) at position 0.
    repeated = _seq([1, 2, 1, 2, 1])
    assert manager.take_cached_prefix(repeated) == 2
    assert repeated.block_table == first.block_table[:1]


def test_the_window_and_sinks_are_part_of_the_key():
    pool = BlockPool(16)
    full = KVCacheManager.single(pool, 2, None)
    windowed = KVCacheManager.single(pool, 2, 4, 2)
    _computed(full, [1, 2, 3, 4, 5])
    assert windowed.take_cached_prefix(_seq([1, 2, 3, 4, 5])) == 0
    assert full.take_cached_prefix(_seq([1, 2, 3, 4, 5])) == 4
    extra = KVCacheManager.single(pool, 2, None, extra_key=("int8",))
    assert extra.take_cached_prefix(_seq([1, 2, 3, 4, 5])) == 0


def test_blocks_after_a_window_released_block_are_not_published():
    manager = _manager(sliding_window=2)
    seq = _seq(list(range(7)))
    assert manager.grow(seq, 7)
    seq.num_computed_tokens = 2
    manager.register_computed_blocks(seq)  # block 0
    seq.num_computed_tokens = 4
    manager.release_out_of_window(seq)  # query 4 sees keys 3, 4: block 0 is dead
    assert seq.block_table[0] == NULL_BLOCK
    seq.num_computed_tokens = 6
    manager.register_computed_blocks(seq)  # block 1 followed a released block; block 2 follows block 1
    assert seq.num_registered_blocks == 3
    probe = _seq(list(range(7)))
    assert manager.take_cached_prefix(probe) == 2  # block 0 is still cached; block 1 was not published


def _salted(token_ids: list[int], cache_salt: str | None) -> Sequence:
    seq = _seq(token_ids)
    seq.params = SamplingParams(cache_salt=cache_salt)
    return seq


def test_a_different_cache_salt_never_hits_and_the_same_salt_does():
    manager = _manager()
    tenant_a = _salted([1, 2, 3, 4, 5], "tenant-a")
    assert manager.grow(tenant_a, 5)
    tenant_a.num_computed_tokens = 5
    manager.register_computed_blocks(tenant_a)
    assert manager.take_cached_prefix(_salted([1, 2, 3, 4, 5], "tenant-b")) == 0
    assert manager.take_cached_prefix(_salted([1, 2, 3, 4, 5], None)) == 0
    assert manager.take_cached_prefix(_salted([1, 2, 3, 4, 5], "tenant-a")) == 4


def test_unsalted_sequences_share_as_before_and_a_salt_does_not_see_them():
    manager = _manager()
    _computed(manager, [1, 2, 3, 4, 5])
    assert manager.take_cached_prefix(_salted([1, 2, 3, 4, 5], "tenant-a")) == 0
    assert manager.take_cached_prefix(_salted([1, 2, 3, 4, 5], None)) == 4
