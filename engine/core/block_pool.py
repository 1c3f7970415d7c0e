"""The KV block pool: free blocks, reference counts and the prefix cache.

One owner: only BlockPool changes ref counts, the free list and the cache
index. Sequences hold block ids in their own `block_table`; the
`KVCacheManager` methods are the only way those tables grow or shrink.

Block 0 is the null block. It is never handed out: table entries of blocks
released by a sliding window point at it so the table keeps its positions.

Prefix caching: a full, computed block is indexed by a chained sha256 digest
(`hash_block_tokens`). Freed blocks keep their entry and stay findable until
the slot is reused (least recently freed first), so a later request with the
same prefix takes them back instead of recomputing. The digest only finds a
candidate: a hit also needs the block's stored token ids to equal the
requested ones and its stored parent to be the very block the request took
for the previous position (same id, not reused since). By induction from the
first block, a hit therefore holds K/V computed for exactly the requested
prefix, whatever the hash function returns. (A sliding-window group's block
may name another proven block as its parent instead: KVCacheManager.)
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

NULL_BLOCK = 0


def root_block_hash(extra_key: bytes) -> bytes:
    """The chain's starting digest: names everything besides the tokens that changes the K/V."""
    return hashlib.sha256(b"kvserve-prefix-root\0" + extra_key).digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256 of the parent block's digest (32 bytes) and this block's token ids as int64s."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


@dataclass(frozen=True)
class _CachedBlock:
    """What a registered block holds, checked on every hit."""

    block_hash: bytes
    token_ids: tuple[int, ...]
    parent: tuple[int, int] | None  # (block id, generation) of the previous position; None for the first


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("the block pool needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # Bumped each time a block is handed out fresh: (id, generation) names one content.
        self._generations = [0] * num_blocks
        self._entries: list[_CachedBlock | None] = [None] * num_blocks
        # Blocks with ref count 0, evicted from the front.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._cached: dict[bytes, int] = {}  # digest -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by live sequences (cached-but-free blocks count as free)."""
        return self.num_blocks - 1 - len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def holds_cached_prefix(self, block: int) -> bool:
        """Whether the block is registered in the prefix cache (findable until it is handed out again)."""
        return self._entries[block] is not None

    def allocate(self) -> int | None:
        """A fresh block with ref count 1, or None when the pool is exhausted."""
        if not self._free:
            return None
        block, _ = self._free.popitem(last=False)
        entry = self._entries[block]
        if entry is not None:
            del self._cached[entry.block_hash]
            self._entries[block] = None
        self._generations[block] += 1
        self._ref_counts[block] = 1
        return block

    def find_cached(self, block_hash: bytes, token_ids: tuple[int, ...], parent: int | None) -> int | None:
        """The cached block for these tokens after `parent`, untouched; None on a miss.

        `parent` is the block the caller holds that the block was registered against: the one for the
        previous position (None for the first block), or another block that proves the same prefix (see
        KVCacheManager). A digest whose block holds other tokens or was registered against another
        parent is a miss.
        """
        block = self._cached.get(block_hash)
        if block is None:
            return None
        entry = self._entries[block]
        if entry is None or entry.token_ids != token_ids or entry.parent != self._identity(parent):
            return None
        return block

    def take_cached(self, block_hash: bytes, token_ids: tuple[int, ...], parent: int | None) -> int | None:
        """find_cached's block with one more reference; None on a miss."""
        block = self.find_cached(block_hash, token_ids, parent)
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
            if self._entries[block] is None:
                # Holds nothing reusable: hand it out before blocks that may still hit.
                self._free.move_to_end(block, last=False)

    def register(self, block: int, block_hash: bytes, token_ids: tuple[int, ...], parent: int | None) -> None:
        """Make a full, computed block findable by its digest (first writer wins)."""
        if not self.enable_prefix_caching or self._entries[block] is not None or block_hash in self._cached:
            return
        self._cached[block_hash] = block
        self._entries[block] = _CachedBlock(block_hash, token_ids, self._identity(parent))

    def _identity(self, block: int | None) -> tuple[int, int] | None:
        return None if block is None else (block, self._generations[block])
