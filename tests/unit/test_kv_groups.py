"""Attention groups in the KV cache: the layout of mixed models, and a manager of two groups at block size 2
(one full, one sliding with window 4) through growth, window release, prefix hits, trim and preemption."""

from __future__ import annotations

import itertools

import pytest

from engine.core.block_pool import NULL_BLOCK, BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_layout import plan_kv_layout
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.params import SamplingParams

_seq_ids = itertools.count()
FULL, SLIDING = 0, 1


def _seq(token_ids: list[int]) -> Sequence:
    return Sequence(next(_seq_ids), "r", 0, list(token_ids), SamplingParams(), 0.0)


def _manager(num_blocks: int = 32, window: int = 4, sinks: int = 0) -> KVCacheManager:
    # Layer 0 full, layer 1 sliding: one layer per block, two groups.
    layout = plan_kv_layout([None, window], sinks)
    return KVCacheManager(BlockPool(num_blocks), 2, layout.groups)


def _computed(manager: KVCacheManager, token_ids: list[int]) -> Sequence:
    seq = _seq(token_ids)
    assert manager.grow(seq, len(token_ids))
    seq.num_computed_tokens = len(token_ids)
    manager.register_computed_blocks(seq)
    return seq


# ------------------------------------------------------------------ layout


def test_five_sliding_layers_to_one_full_split_into_equal_groups():
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # 22 sliding, 4 full
    layout = plan_kv_layout(windows, num_sink_tokens=0)
    assert layout.layers_per_group == 2
    assert layout.num_groups == 13
    assert sum(g.sliding_window is None for g in layout.groups) == 2
    assert sorted(layer for g in layout.groups for layer in g.layers) == list(range(26))
    for layer, window in enumerate(windows):
        group = layout.groups[layout.layer_group[layer]]
        assert group.sliding_window == window
        assert group.layers[layout.layer_slot[layer]] == layer
    assert not layout.every_layer_slides
    assert layout.kinds == ((512, 0), (None, 0))


def test_alternating_layers_make_two_groups_and_a_uniform_model_one():
    layout = plan_kv_layout([4, None] * 3, num_sink_tokens=2)
    assert layout.layers_per_group == 3 and layout.num_groups == 2
    assert [(g.sliding_window, g.num_sink_tokens, g.layers) for g in layout.groups] == [
        (4, 2, (0, 2, 4)),
        (None, 0, (1, 3, 5)),  # sinks are for sliding layers only
    ]
    uniform = plan_kv_layout([None] * 4, 0)
    assert uniform.num_groups == 1 and uniform.layers_per_group == 4
    assert uniform.layer_slot == (0, 1, 2, 3)


def test_a_block_holds_its_groups_layers_only():
    mixed = plan_kv_layout([None if (i + 1) % 6 == 0 else 1024 for i in range(24)], 0)  # 20 and 4
    full = plan_kv_layout([None] * 24, 0)
    assert mixed.bytes_per_block(16, 2, 64 * 4) * 6 == full.bytes_per_block(16, 2, 64 * 4)
    # Decoding at 8k tokens (block 16): the full groups hold the context, the sliding ones the window.
    mixed_bytes = mixed.max_blocks_per_seq(8192, 16, 1) * mixed.bytes_per_block(16, 2, 64 * 4)
    full_bytes = full.max_blocks_per_seq(8192, 16, 1) * full.bytes_per_block(16, 2, 64 * 4)
    assert 3.5 < full_bytes / mixed_bytes < 3.7


# ------------------------------------------------------------------ the manager


def test_growth_takes_blocks_in_every_group_or_none():
    manager = _manager(num_blocks=6)  # 5 usable
    seq = _seq([1, 2, 3, 4, 5])
    assert manager.grow(seq, 4)  # 2 blocks per group
    assert [len(t) for t in seq.block_tables] == [2, 2]
    assert manager.pool.num_free_blocks == 1
    assert not manager.grow(seq, 5)  # one more in each group: 2 needed, 1 free
    assert [len(t) for t in seq.block_tables] == [2, 2]
    assert set(seq.block_tables[FULL]).isdisjoint(seq.block_tables[SLIDING])


def test_only_the_sliding_group_gives_blocks_back_as_the_window_passes():
    manager = _manager(window=4)
    seq = _seq(list(range(10)))
    assert manager.grow(seq, 10)
    seq.num_computed_tokens = 9  # the next query is at 9 and sees 6..9
    used = manager.pool.num_used_blocks
    manager.release_out_of_window(seq)
    assert NULL_BLOCK not in seq.block_tables[FULL]
    assert seq.block_tables[SLIDING][:3] == [NULL_BLOCK] * 3  # positions 0..5
    assert NULL_BLOCK not in seq.block_tables[SLIDING][3:]
    assert manager.pool.num_used_blocks == used - 3
    manager.free(seq)
    assert manager.pool.num_used_blocks == 0


def test_sinks_stay_in_the_sliding_group():
    manager = _manager(window=4, sinks=2)
    seq = _seq(list(range(12)))
    assert manager.grow(seq, 12)
    seq.num_computed_tokens = 11
    manager.release_out_of_window(seq)
    assert seq.block_tables[SLIDING][0] != NULL_BLOCK  # the sink block
    assert seq.block_tables[SLIDING][1:4] == [NULL_BLOCK] * 3


def test_a_prefix_is_found_in_both_groups():
    manager = _manager()
    first = _computed(manager, [1, 2, 3, 4, 5, 6, 7])
    second = _seq([1, 2, 3, 4, 5, 6, 9])
    assert manager.take_cached_prefix(second) == 6
    assert second.block_tables[FULL] == first.block_tables[FULL][:3]
    # The next query (position 6) sees 3..6: the sliding group takes blocks 1 and 2 only.
    assert second.block_tables[SLIDING] == [NULL_BLOCK, *first.block_tables[SLIDING][1:3]]


def _computed_then_slid_past(manager: KVCacheManager, tokens: list[int]) -> Sequence:
    """A sequence computed over `tokens` whose sliding group then released what its window left behind,
    and those blocks handed out again (every free block taken by another sequence)."""
    first = _computed(manager, tokens)
    manager.release_out_of_window(first)
    _hand_out_every_free_block(manager.pool)
    return first


def _hand_out_every_free_block(pool: BlockPool) -> None:
    while pool.allocate() is not None:
        pass


def test_a_sliding_group_needs_only_what_its_window_sees_at_the_end_of_the_prefix():
    manager = _manager(num_blocks=12, window=4)
    tokens = list(range(1, 11))
    first = _computed_then_slid_past(manager, tokens)  # 5 blocks per group; the sliding one kept 3 and 4
    assert first.block_tables[SLIDING][:3] == [NULL_BLOCK] * 3
    second = _seq(tokens + [99])
    assert manager.take_cached_prefix(second) == 10  # the next query (position 10) sees 7..10
    assert second.block_tables[FULL] == first.block_tables[FULL]
    assert second.block_tables[SLIDING] == [NULL_BLOCK] * 3 + first.block_tables[SLIDING][3:]
    assert all(manager.pool.ref_count(b) == 2 for b in first.block_tables[FULL])


def test_a_sliding_hit_keeps_the_sink_blocks_too():
    manager = _manager(num_blocks=12, window=4, sinks=2)
    tokens = list(range(1, 11))
    first = _computed_then_slid_past(manager, tokens)  # the sliding group kept its sink block 0, and 3 and 4
    second = _seq(tokens + [99])
    assert manager.take_cached_prefix(second) == 10
    sliding = first.block_tables[SLIDING]
    assert second.block_tables[SLIDING] == [sliding[0], NULL_BLOCK, NULL_BLOCK, sliding[3], sliding[4]]


def test_a_prefix_whose_window_blocks_are_gone_is_not_a_hit_in_the_full_group_either():
    manager = _manager(num_blocks=12, window=4)
    tokens = list(range(1, 11))
    first = _computed_then_slid_past(manager, tokens)
    pool = manager.pool
    # Ending at 6 tokens, the window would need blocks 1 and 2, then 0 and 1, then 0: all handed out again.
    second = _seq(tokens[:6] + [99])
    assert manager.take_cached_prefix(second) == 0
    assert not second.holds_blocks
    assert all(pool.ref_count(b) == 1 for b in first.block_tables[FULL])  # what the full group took went back


def test_a_model_without_a_full_group_matches_each_group_as_a_chain():
    layout = plan_kv_layout([4, 8], 0)  # two sliding kinds, no full group to anchor them
    manager = KVCacheManager(BlockPool(12), 2, layout.groups)
    tokens = list(range(1, 11))
    first = _computed(manager, tokens)
    manager.release_out_of_window(first)  # the window-4 group frees blocks 0..2, the window-8 one block 0
    _hand_out_every_free_block(manager.pool)
    assert manager.take_cached_prefix(_seq(tokens + [99])) == 0  # each chain starts with a block handed out


def test_groups_never_take_each_others_blocks():
    manager = _manager()
    first = _computed(manager, [1, 2, 3, 4, 5])
    full_blocks, sliding_blocks = (list(t) for t in first.block_tables)
    second = _seq([1, 2, 3, 4, 5])
    assert manager.take_cached_prefix(second) == 4
    assert second.block_tables[FULL] == full_blocks[:2]
    assert second.block_tables[SLIDING] == sliding_blocks[:2]


def test_trim_gives_back_draft_blocks_in_every_group():
    manager = _manager()
    seq = _seq([1, 2, 3])
    assert manager.grow(seq, 8)  # room for drafts
    assert [len(t) for t in seq.block_tables] == [4, 4]
    manager.trim(seq, 4)
    assert [len(t) for t in seq.block_tables] == [2, 2]
    assert manager.pool.num_used_blocks == 4


def test_preemption_frees_every_group_and_the_sequence_comes_back_whole():
    manager = _manager(num_blocks=9)  # 8 usable: two sequences of 4 tokens need 8
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, eos_token_ids=(), max_model_len=64)
    old, new = _seq([1, 2, 3]), _seq([4, 5, 6])
    scheduler.add(old)
    scheduler.add(new)
    batch = scheduler.schedule()
    assert batch.seqs == [old, new]
    for seq in batch.seqs:
        seq.num_computed_tokens = 3
        seq.token_ids.append(7)
    # Each grows to 4 tokens then 5: the second growth needs a third block per group, so the newest goes.
    scheduler.schedule()
    for seq in (old, new):
        if seq.status is SequenceStatus.RUNNING:
            seq.num_computed_tokens = len(seq.token_ids)
            seq.token_ids.append(8)
    scheduler.schedule()
    assert new.status is SequenceStatus.WAITING and not new.holds_blocks
    assert [len(t) for t in old.block_tables] == [3, 3]
    assert manager.pool.num_used_blocks == 6


@pytest.mark.parametrize("window", [2, 4, 6])
def test_the_sliding_group_never_holds_more_than_the_window_needs(window):
    manager = _manager(window=window)
    seq = _seq([0])
    for n in range(1, 40):
        manager.release_out_of_window(seq)
        assert manager.grow(seq, n + 1)
        seq.num_computed_tokens = n
        seq.token_ids.append(n)
        live = [b for b in seq.block_tables[SLIDING] if b != NULL_BLOCK]
        assert len(live) <= window // 2 + 2
        assert len(seq.block_tables[FULL]) == (n + 2) // 2
