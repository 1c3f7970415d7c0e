"""Sequences' block tables against one BlockPool: grow, free, window release, prefix cache.

A sequence holds one block table per attention group (engine/core/kv_layout.py), all drawn from the
same pool. Every table covers the same positions; a sliding group's table points entries it no
longer needs at the null block. Each operation here acts on every group at once, so the scheduler
sees one sequence with one size.
"""

from __future__ import annotations

from engine.config import cdiv
from engine.core import block_pool
from engine.core.block_pool import NULL_BLOCK, BlockPool
from engine.core.kv_layout import AttentionGroup, plan_kv_layout
from engine.core.sequence import Sequence


class KVCacheManager:
    """Grows, trims and frees sequences' block tables; finds and publishes cached prefixes.

    `groups`: the attention groups, one block table each (a model whose layers all attend alike has
    one). `extra_key` names whatever else makes this cache's K/V differ for the same tokens; it seeds
    the hash chain, so blocks under different keys never match. A sequence's `cache_salt`
    (SamplingParams) is folded into the same seed, so requests with different salts never share a
    block. A block is published under its group's index and kind too: a block holds its own group's
    layers only.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        groups: tuple[AttentionGroup, ...],
        extra_key: tuple[object, ...] = (),
    ) -> None:
        if not groups:
            raise ValueError("a KV cache needs at least one attention group")
        self.pool = pool
        self.block_size = block_size
        self.groups = groups
        self._key = repr((block_size, *extra_key)).encode()
        self._root_hash = block_pool.root_block_hash(self._key)
        # Appended to a block's chained digest when it is published, so each group's blocks are its own.
        self._group_tags = [
            repr((g, group.sliding_window, group.num_sink_tokens)).encode() for g, group in enumerate(groups)
        ]

    @classmethod
    def single(
        cls,
        pool: BlockPool,
        block_size: int,
        sliding_window: int | None,
        num_sink_tokens: int = 0,
        extra_key: tuple[object, ...] = (),
    ) -> KVCacheManager:
        """A manager of one group: every layer attends with this window (None: full attention)."""
        return cls(pool, block_size, plan_kv_layout([sliding_window], num_sink_tokens).groups, extra_key)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks of one group's table that cover num_tokens positions."""
        return cdiv(num_tokens, self.block_size)

    def _tables(self, seq: Sequence) -> list[list[int]]:
        tables = seq.block_tables
        while len(tables) < len(self.groups):
            tables.append([])
        return tables

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def take_cached_prefix(self, seq: Sequence) -> int:
        """Fill empty tables from the prefix cache; returns the number of tokens found computed.

        Only blocks strictly before the one holding the last token are looked up, so at least one
        token is always computed (its logits are needed) and a shared block is never written to.
        Each group's first miss ends its match, and the prefix found is the shortest match of all
        groups: a prefix whose blocks one group lacks is computed again for every group.
        """
        tables = self._tables(seq)
        assert not any(tables) and seq.num_computed_tokens == 0
        if not self.pool.enable_prefix_caching:
            return 0
        self._update_hashes(seq, len(seq.token_ids))
        num_found = (len(seq.token_ids) - 1) // self.block_size
        for g, table in enumerate(tables):
            for i in range(num_found):
                parent = table[-1] if table else None
                key = self._published_key(seq.block_hashes[i], g)
                block = self.pool.take_cached(key, self._block_tokens(seq, i), parent)
                if block is None:
                    break
                table.append(block)
            num_found = len(table)
        for table in tables:  # groups matched before a shorter one give back what the others lack
            while len(table) > num_found:
                self.pool.release(table.pop())
        return num_found * self.block_size

    def _published_key(self, block_hash: bytes, group: int) -> bytes:
        return block_hash + self._group_tags[group]

    def _update_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq.block_hashes to cover every full block among its first num_tokens tokens."""
        while (len(seq.block_hashes) + 1) * self.block_size <= num_tokens:
            i = len(seq.block_hashes)
            parent_hash = seq.block_hashes[-1] if seq.block_hashes else self._salted_root(seq.params.cache_salt)
            # Through the module, so tests can substitute the hash function.
            seq.block_hashes.append(block_pool.hash_block_tokens(parent_hash, self._block_tokens(seq, i)))

    def _salted_root(self, cache_salt: str | None) -> bytes:
        """The chain's root for a salt; unsalted sequences keep the plain root."""
        if cache_salt is None:
            return self._root_hash
        # The key is a repr (no raw NUL byte), so the NUL keeps key and salt apart.
        return block_pool.root_block_hash(self._key + b"\0cache_salt\0" + cache_salt.encode())

    def register_computed_blocks(self, seq: Sequence) -> None:
        """After a step: publish every block that is now full of computed tokens, in every group.

        A block whose predecessor was already released by the window is not published: a hit must
        name the very block it followed.
        """
        if not self.pool.enable_prefix_caching:
            return
        self._update_hashes(seq, seq.num_computed_tokens)
        num_full = seq.num_computed_tokens // self.block_size
        for g, table in enumerate(self._tables(seq)):
            for i in range(seq.num_registered_blocks, num_full):
                block = table[i]
                parent = table[i - 1] if i > 0 else None
                if block != NULL_BLOCK and parent != NULL_BLOCK:
                    key = self._published_key(seq.block_hashes[i], g)
                    self.pool.register(block, key, self._block_tokens(seq, i), parent)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def release_out_of_window(self, seq: Sequence) -> None:
        """Give back, in each sliding group, blocks no query from position num_computed_tokens on can see.

        The next query sits at p = num_computed_tokens and sees keys > p - W (plus the sinks), so a
        block whose last position is <= p - W is dead. Full groups keep every block.
        """
        for group, table in zip(self.groups, self._tables(seq)):
            if group.sliding_window is None:
                continue
            first_visible = seq.num_computed_tokens - group.sliding_window + 1
            if first_visible <= 0:
                continue
            first_live_block = first_visible // self.block_size
            first_non_sink_block = self.num_blocks_for(group.num_sink_tokens)
            for i in range(first_non_sink_block, min(first_live_block, len(table))):
                block = table[i]
                if block != NULL_BLOCK:
                    self.pool.release(block)
                    table[i] = NULL_BLOCK

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make every table cover the first num_tokens positions; False (nothing taken) if out of blocks."""
        tables = self._tables(seq)
        wanted = self.num_blocks_for(num_tokens)
        needed = sum(max(0, wanted - len(table)) for table in tables)
        if needed == 0:
            return True
        if needed > self.pool.num_free_blocks:
            return False
        for table in tables:
            while len(table) < wanted:
                table.append(self.pool.allocate())
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens positions (rejected draft tokens' blocks).

        They were never published to the prefix cache: only blocks full of computed tokens are.
        """
        keep = self.num_blocks_for(num_tokens)
        for table in self._tables(seq):
            while len(table) > keep:
                self.pool.release(table.pop())

    def free(self, seq: Sequence) -> None:
        """Release every block of every table (each in reverse, so the tail is evicted first)."""
        for table in self._tables(seq):
            for block in reversed(table):
                self.pool.release(block)
            table.clear()
        seq.num_registered_blocks = 0
