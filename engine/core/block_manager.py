"""The KV block pool: free blocks, reference counts and the prefix cache.

One owner (DESIGN.md principle 2): only BlockPool changes ref counts and the
free list. Sequences hold block ids in their own `block_table`; the
`BlockManager` methods are the only way those tables grow or shrink.

Block 0 is the null block. It is never handed out: table entries of blocks
released by a sliding window point at it so the table keeps its positions.

Prefix caching: a full block is identified by a chained hash of (parent hash,
its tokens). Freed blocks keep their hash and stay findable until the slot is
reused (least recently freed first), so a later request with the same prefix
takes them back instead of recomputing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.config import cdiv
from engine.core.sequence import Sequence

NULL_BLOCK = 0


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # of which found computed in the cache


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("the block pool needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[int | None] = [None] * num_blocks
        # Blocks with ref count 0, evicted from the front.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block id
        self.cache_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by live sequences (cached-but-free blocks count as free)."""
        return self.num_blocks - 1 - len(self._free)

    def allocate(self) -> int | None:
        """A fresh block with ref count 1, or None when the pool is exhausted."""
        if not self._free:
            return None
        block, _ = self._free.popitem(last=False)
        old_hash = self._hashes[block]
        if old_hash is not None:
            if self._cached.get(old_hash) == block:
                del self._cached[old_hash]
            self._hashes[block] = None
        self._ref_counts[block] = 1
        return block

    def take_cached(self, block_hash: int) -> int | None:
        """The cached block with this hash, with one more reference; None on a miss."""
        block = self._cached.get(block_hash)
        if block is None:
            return None
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1
        return block

    def release(self, block: int) -> None:
        if block == NULL_BLOCK:
            return
        count = self._ref_counts[block] - 1
        if count < 0:
            raise RuntimeError(f"block {block} released more often than taken")
        self._ref_counts[block] = count
        if count == 0:
            self._free[block] = None
            if self._hashes[block] is None:
                # Holds nothing reusable: hand it out before blocks that may still hit.
                self._free.move_to_end(block, last=False)

    def register(self, block: int, block_hash: int) -> None:
        """Make a full, computed block findable by its hash (first writer wins)."""
        if not self.enable_prefix_caching or self._hashes[block] is not None:
            return
        if block_hash not in self._cached:
            self._cached[block_hash] = block
            self._hashes[block] = block_hash

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]


class BlockManager:
    """Grows, trims and frees sequences' block tables against one BlockPool."""

    def __init__(self, pool: BlockPool, block_size: int, sliding_window: int | None, num_sink_tokens: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_sink_tokens = num_sink_tokens  # 0 without a window (the engine derives it)

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def take_cached_prefix(self, seq: Sequence) -> int:
        """Fill an empty table from the prefix cache; returns the number of tokens found computed.

        Only blocks strictly before the one holding the last token are looked
        up, so at least one token is always computed (its logits are needed)
        and a shared block is never written to.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.pool.enable_prefix_caching:
            return 0
        self.update_hashes(seq, len(seq.token_ids))
        num_candidates = min((len(seq.token_ids) - 1) // self.block_size, len(seq.block_hashes))
        found = 0
        for block_hash in seq.block_hashes[:num_candidates]:
            block = self.pool.take_cached(block_hash)
            if block is None:
                break
            seq.block_table.append(block)
            found += 1
        return found * self.block_size

    def update_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq.block_hashes to cover every full block among its first num_tokens tokens."""
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= num_tokens:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(chain_hash(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))

    def register_computed_blocks(self, seq: Sequence) -> None:
        """After a step: publish every block that is now full of computed tokens."""
        if not self.pool.enable_prefix_caching:
            return
        self.update_hashes(seq, seq.num_computed_tokens)
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            block = seq.block_table[i]
            if block != NULL_BLOCK:
                self.pool.register(block, seq.block_hashes[i])
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def release_out_of_window(self, seq: Sequence) -> None:
        """Give back blocks no query from position num_computed_tokens on can see.

        The next query sits at p = num_computed_tokens and sees keys > p - W
        (plus the sinks), so a block whose last position is <= p - W is dead.
        """
        if self.sliding_window is None:
            return
        first_visible = seq.num_computed_tokens - self.sliding_window + 1
        if first_visible <= 0:
            return
        bs = self.block_size
        first_live_block = first_visible // bs
        first_non_sink_block = self.num_blocks_for(self.num_sink_tokens)
        for i in range(first_non_sink_block, min(first_live_block, len(seq.block_table))):
            block = seq.block_table[i]
            if block != NULL_BLOCK:
                self.pool.release(block)
                seq.block_table[i] = NULL_BLOCK

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the table cover the first num_tokens positions; False (nothing taken) if out of blocks."""
        needed = self.num_blocks_for(num_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self.pool.allocate())
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of the table (in reverse, so the tail is evicted first)."""
        for block in reversed(seq.block_table):
            self.pool.release(block)
        seq.block_table.clear()
        seq.num_registered_blocks = 0
