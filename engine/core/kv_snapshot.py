"""A point-in-time picture of the KV block pool and the running sequences' block tables.

Ids and counts only: no token id or text of any request is in it, so it can be shown to anyone
who may see the server's metrics.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.core.block_pool import NULL_BLOCK, BlockPool
from engine.core.kv_layout import AttentionGroup
from engine.core.sequence import Sequence

# One character per block id 1..N-1 in KVCacheSnapshot.block_states.
BLOCK_IN_USE = "u"  # referenced by one sequence
BLOCK_SHARED = "s"  # referenced by several (a shared prompt prefix, the samples of one request)
BLOCK_CACHED_FREE = "c"  # referenced by none, still holding a prefix a later request can take back
BLOCK_FREE = "f"  # referenced by none, holding nothing reusable


@dataclass(frozen=True)
class GroupBlocks:
    """One sequence's table in one attention group. block_table[i] is the block holding positions
    [i*B, (i+1)*B) of the group's layers; NULL_BLOCK (0) where the sliding window released it.
    shared[i]: that block is referenced by more than one sequence."""

    block_table: tuple[int, ...]
    shared: tuple[bool, ...]


@dataclass(frozen=True)
class SequenceBlocks:
    """One running sequence: its table in each attention group, in the snapshot's group order."""

    seq_id: int
    num_tokens: int
    num_computed_tokens: int
    groups: tuple[GroupBlocks, ...]

    @property
    def block_table(self) -> tuple[int, ...]:
        """The first group's table (a model whose layers all attend alike has only it)."""
        return self.groups[0].block_table

    @property
    def shared(self) -> tuple[bool, ...]:
        return self.groups[0].shared


@dataclass(frozen=True)
class KVCacheSnapshot:
    block_size: int
    num_blocks: int  # usable blocks, the null block not counted
    block_states: str  # len num_blocks; char i is the state of block id i + 1 (BLOCK_* above)
    sliding_window: int | None  # the sliding layers' window (None: every layer is full)
    num_sink_tokens: int
    attention_groups: tuple[AttentionGroup, ...]  # the layers each sequence's tables serve, in order
    prefix_caching: bool
    num_running: int
    num_waiting: int
    sequences: tuple[SequenceBlocks, ...]

    def count(self, state: str) -> int:
        return self.block_states.count(state)


def block_state(pool: BlockPool, block: int) -> str:
    refs = pool.ref_count(block)
    if refs > 1:
        return BLOCK_SHARED
    if refs == 1:
        return BLOCK_IN_USE
    return BLOCK_CACHED_FREE if pool.holds_cached_prefix(block) else BLOCK_FREE


def take_snapshot(
    pool: BlockPool,
    running: Iterable[Sequence],
    num_waiting: int,
    block_size: int,
    sliding_window: int | None,
    num_sink_tokens: int,
    attention_groups: tuple[AttentionGroup, ...],
) -> KVCacheSnapshot:
    states = "".join(block_state(pool, block) for block in range(1, pool.num_blocks))

    def group_blocks(table: list[int]) -> GroupBlocks:
        shared = tuple(block != NULL_BLOCK and pool.ref_count(block) > 1 for block in table)
        return GroupBlocks(tuple(table), shared)

    sequences = tuple(
        SequenceBlocks(
            seq_id=seq.seq_id,
            num_tokens=len(seq.token_ids),
            num_computed_tokens=seq.num_computed_tokens,
            # A sequence scheduled before its first growth may hold fewer (empty) tables than there are groups.
            groups=tuple(
                group_blocks(seq.block_tables[g] if g < len(seq.block_tables) else [])
                for g in range(len(attention_groups))
            ),
        )
        for seq in running
    )
    return KVCacheSnapshot(
        block_size=block_size,
        num_blocks=pool.num_blocks - 1,
        block_states=states,
        sliding_window=sliding_window,
        num_sink_tokens=num_sink_tokens,
        attention_groups=attention_groups,
        prefix_caching=pool.enable_prefix_caching,
        num_running=len(sequences),
        num_waiting=num_waiting,
        sequences=sequences,
    )
