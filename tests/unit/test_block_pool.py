"""BlockPool: reference counts, the free list's eviction order, and verified prefix-cache hits."""

from __future__ import annotations

import pytest

from engine.core.block_pool import NULL_BLOCK, BlockPool, hash_block_tokens, root_block_hash

ROOT = root_block_hash(b"test")


def _digest(*token_ids: int) -> bytes:
    return hash_block_tokens(ROOT, token_ids)


def _cached_free_block(pool: BlockPool, token_ids: tuple[int, ...], parent: int | None = None) -> int:
    """A block registered under token_ids, then released: free, but still findable."""
    block = pool.allocate()
    pool.register(block, _digest(*token_ids), token_ids, parent)
    pool.release(block)
    return block


def test_hash_chain_depends_on_parent_tokens_and_root():
    assert len(_digest(1, 2)) == 32
    assert _digest(1, 2) == _digest(1, 2)
    assert _digest(1, 2) != _digest(2, 1)
    assert hash_block_tokens(_digest(1, 2), (3, 4)) != hash_block_tokens(_digest(1, 5), (3, 4))
    assert hash_block_tokens(root_block_hash(b"a"), (1, 2)) != hash_block_tokens(root_block_hash(b"b"), (1, 2))


def test_ref_counts_follow_take_and_release():
    pool = BlockPool(4)
    block = pool.allocate()
    assert pool.ref_count(block) == 1
    pool.register(block, _digest(1, 2), (1, 2), None)
    assert pool.take_cached(_digest(1, 2), (1, 2), None) == block
    assert pool.ref_count(block) == 2
    assert pool.num_used_blocks == 1
    pool.release(block)
    pool.release(block)
    assert pool.ref_count(block) == 0
    assert pool.num_used_blocks == 0
    with pytest.raises(RuntimeError, match="released more often than taken"):
        pool.release(block)


def test_null_block_is_never_handed_out():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(3)]
    assert sorted(blocks) == [1, 2, 3]
    assert pool.allocate() is None
    assert pool.num_free_blocks == 0
    pool.release(NULL_BLOCK)  # a window-released table entry: nothing to give back
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        BlockPool(1)


def test_cached_free_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    for block, tokens in ((a, (1, 1)), (b, (2, 2)), (c, (3, 3))):
        pool.register(block, _digest(*tokens), tokens, None)
    for block in (b, a, c):
        pool.release(block)
    assert [pool.allocate() for _ in range(3)] == [b, a, c]
    # Evicted blocks are no longer findable.
    assert pool.take_cached(_digest(2, 2), (2, 2), None) is None


def test_blocks_without_a_hash_are_handed_out_before_cached_ones():
    pool = BlockPool(4)
    cached = _cached_free_block(pool, (1, 2))
    plain = pool.allocate()
    pool.release(plain)  # freed last, but holds nothing reusable
    never_used = next(b for b in (1, 2, 3) if b not in (cached, plain))
    handed_out = [pool.allocate() for _ in range(3)]
    assert handed_out[2] == cached
    assert set(handed_out[:2]) == {plain, never_used}


def test_a_cached_block_taken_back_leaves_the_free_list():
    pool = BlockPool(3)
    cached = _cached_free_block(pool, (1, 2))
    assert pool.num_free_blocks == 2
    assert pool.take_cached(_digest(1, 2), (1, 2), None) == cached
    assert pool.num_free_blocks == 1
    other = pool.allocate()
    assert other != cached
    assert pool.allocate() is None  # the held cached block is not evictable


def test_register_is_first_writer_wins():
    pool = BlockPool(4)
    first, second = pool.allocate(), pool.allocate()
    pool.register(first, _digest(1, 2), (1, 2), None)
    pool.register(second, _digest(1, 2), (1, 2), None)
    assert pool.take_cached(_digest(1, 2), (1, 2), None) == first
    pool.release(second)
    # The loser was never registered: it is handed out first and unregisters nothing.
    assert pool.allocate() == second
    assert pool.take_cached(_digest(1, 2), (1, 2), None) == first
    # A block registers once; a later digest for it is ignored.
    pool.register(first, _digest(7, 7), (7, 7), None)
    assert pool.take_cached(_digest(7, 7), (7, 7), None) is None


def test_a_block_holding_other_tokens_is_a_miss():
    pool = BlockPool(3)
    cached = _cached_free_block(pool, (1, 2))
    colliding = _digest(1, 2)  # as if (1, 3) hashed to the same digest
    assert pool.take_cached(colliding, (1, 3), None) is None
    assert pool.ref_count(cached) == 0
    assert pool.num_free_blocks == 2  # still free, still cached
    assert pool.take_cached(colliding, (1, 2), None) == cached


def test_a_block_that_followed_another_parent_is_a_miss():
    pool = BlockPool(5)
    parent = pool.allocate()
    pool.register(parent, _digest(1, 2), (1, 2), None)
    child = pool.allocate()
    child_digest = hash_block_tokens(_digest(1, 2), (3, 4))
    pool.register(child, child_digest, (3, 4), parent)
    other = pool.allocate()
    assert pool.take_cached(child_digest, (3, 4), other) is None
    assert pool.take_cached(child_digest, (3, 4), None) is None
    assert pool.take_cached(child_digest, (3, 4), parent) == child
    pool.release(child)


def test_a_parent_reused_for_other_tokens_no_longer_leads_to_its_old_children():
    pool = BlockPool(3)
    parent = _cached_free_block(pool, (1, 2))
    child = pool.allocate()
    child_digest = hash_block_tokens(_digest(1, 2), (3, 4))
    pool.register(child, child_digest, (3, 4), parent)
    pool.release(child)
    # The parent's slot is evicted and refilled with another block's K/V.
    assert pool.allocate() == parent
    assert pool.take_cached(child_digest, (3, 4), parent) is None


def test_register_does_nothing_with_prefix_caching_off():
    pool = BlockPool(3, enable_prefix_caching=False)
    block = pool.allocate()
    pool.register(block, _digest(1, 2), (1, 2), None)
    pool.release(block)
    assert pool.take_cached(_digest(1, 2), (1, 2), None) is None
