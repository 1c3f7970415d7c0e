"""Sequences' block tables against one BlockPool: grow, free, window release, prefix cache.

A sequence holds one block table per attention group (engine/core/kv_layout.py), all drawn from the
same pool. Every table covers the same positions; a sliding group's table points entries it no
longer needs at the null block. Each operation here acts on every group at once, so the scheduler
sees one sequence with one size.

Prefix hits, per group: a full group needs every block of the prefix, found as a chain (each block
registered against the one before it). In a model that has a full group, the first one (the anchor)
proves the prefix for the sliding groups too: a sliding group's block is registered against the
anchor's block at the same position, so a sliding group needs only the blocks its window (and its
sinks) still sees from the end of the prefix, whatever it released before. A model without a full
group matches every group as a chain.
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
        self.extra_key = extra_key
        self._key = repr((block_size, *extra_key)).encode()
        self._root_hash = block_pool.root_block_hash(self._key)
        # Appended to a block's chained digest when it is published, so each group's blocks are its own.
        self._group_tags = [
            repr((g, group.sliding_window, group.num_sink_tokens)).encode() for g, group in enumerate(groups)
        ]
        # The first full group, whose chain proves a prefix for the sliding groups (module docstring).
        self._anchor = next((g for g, group in enumerate(groups) if not group.is_sliding), None)
        # The sliding groups registered against the anchor; none without a full group.
        self._windowed = [g for g, group in enumerate(groups) if group.is_sliding] if self._anchor is not None else []

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
        The prefix found is the longest that every group holds what it needs of (module docstring);
        a prefix one group lacks is computed again for every group.
        """
        tables = self._tables(seq)
        assert not any(tables) and seq.num_computed_tokens == 0
        if not self.pool.enable_prefix_caching:
            return 0
        self._update_hashes(seq, len(seq.token_ids))
        num_found = (len(seq.token_ids) - 1) // self.block_size
        chained = [g for g in range(len(tables)) if g not in self._windowed]
        for g in chained:  # the anchor first: it is the lowest full group
            table = tables[g]
            for i in range(num_found):
                key = self._published_key(seq.block_hashes[i], g)
                block = self.pool.take_cached(key, self._block_tokens(seq, i), table[-1] if table else None)
                if block is None:
                    break
                table.append(block)
            num_found = len(table)
        anchor = tables[self._anchor] if self._anchor is not None else []
        while True:  # each sliding group may shorten the prefix, which moves every window: repeat until none does
            shortest = min((self._window_hit(seq, g, anchor, num_found) for g in self._windowed), default=num_found)
            if shortest == num_found:
                break
            num_found = shortest
        for g in chained:  # groups matched before a shorter one give back what the others lack
            while len(tables[g]) > num_found:
                self.pool.release(tables[g].pop())
        for g in self._windowed:
            tables[g].extend([NULL_BLOCK] * num_found)
            for i in self._window_blocks(self.groups[g], num_found):
                block = self.pool.take_cached(*self._window_lookup(seq, g, anchor, i))
                assert block is not None, "a block _window_hit found is still cached"
                tables[g][i] = block
        return num_found * self.block_size

    def _window_blocks(self, group: AttentionGroup, num_blocks: int) -> list[int]:
        """The blocks a sliding group's next query sees after a prefix of num_blocks blocks: its sinks'
        and those its window reaches back to."""
        first_visible = num_blocks * self.block_size - group.sliding_window + 1
        first_live = max(first_visible, 0) // self.block_size
        sink_blocks = min(self.num_blocks_for(group.num_sink_tokens), num_blocks)
        return sorted({*range(sink_blocks), *range(first_live, num_blocks)})

    def _window_lookup(self, seq: Sequence, g: int, anchor: list[int], i: int) -> tuple[bytes, tuple[int, ...], int]:
        return self._published_key(seq.block_hashes[i], g), self._block_tokens(seq, i), anchor[i]

    def _window_hit(self, seq: Sequence, g: int, anchor: list[int], num_blocks: int) -> int:
        """The longest prefix of at most num_blocks blocks whose window blocks group g has cached.

        A missing block j is needed by every prefix longer than j (the window only moves forward),
        so the next candidate is j blocks long."""
        group = self.groups[g]
        while num_blocks > 0:
            missing = [
                i
                for i in self._window_blocks(group, num_blocks)
                if self.pool.find_cached(*self._window_lookup(seq, g, anchor, i)) is None
            ]
            if not missing:
                return num_blocks
            num_blocks = missing[-1]
        return 0

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

        A chained block whose predecessor was already released by the window is not published: a hit
        must name the very block it followed. A sliding group's block in a model with a full group is
        published against the anchor's block at its position, which is never released.
        """
        if not self.pool.enable_prefix_caching:
            return
        self._update_hashes(seq, seq.num_computed_tokens)
        num_full = seq.num_computed_tokens // self.block_size
        tables = self._tables(seq)
        for g, table in enumerate(tables):
            for i in range(seq.num_registered_blocks, num_full):
                block = table[i]
                if g in self._windowed:
                    parent = tables[self._anchor][i]
                else:
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
