"""Sequences' block tables against one BlockPool: grow, free, window release, prefix cache."""

from __future__ import annotations

from engine.config import cdiv
from engine.core import block_pool
from engine.core.block_pool import NULL_BLOCK, BlockPool
from engine.core.sequence import Sequence


class KVCacheManager:
    """Grows, trims and frees sequences' block tables; finds and publishes cached prefixes.

    `extra_key` names whatever else (besides the window and sink count, which
    are always included) makes this cache's K/V differ for the same tokens;
    it seeds the hash chain, so blocks under different keys never match. A
    sequence's `cache_salt` (SamplingParams) is folded into the same seed, so
    requests with different salts never share a block.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        sliding_window: int | None,
        num_sink_tokens: int,
        extra_key: tuple[object, ...] = (),
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_sink_tokens = num_sink_tokens  # 0 without a window (the engine derives it)
        self._key = repr((block_size, sliding_window, num_sink_tokens, *extra_key)).encode()
        self._root_hash = block_pool.root_block_hash(self._key)

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def take_cached_prefix(self, seq: Sequence) -> int:
        """Fill an empty table from the prefix cache; returns the number of tokens found computed.

        Only blocks strictly before the one holding the last token are looked
        up, so at least one token is always computed (its logits are needed)
        and a shared block is never written to. The first miss ends the match.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.pool.enable_prefix_caching:
            return 0
        self._update_hashes(seq, len(seq.token_ids))
        num_candidates = (len(seq.token_ids) - 1) // self.block_size
        for i in range(num_candidates):
            parent = seq.block_table[-1] if seq.block_table else None
            block = self.pool.take_cached(seq.block_hashes[i], self._block_tokens(seq, i), parent)
            if block is None:
                break
            seq.block_table.append(block)
        return len(seq.block_table) * self.block_size

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
        """After a step: publish every block that is now full of computed tokens.

        A block whose predecessor was already released by the window is not
        published: a hit must name the very block it followed.
        """
        if not self.pool.enable_prefix_caching:
            return
        self._update_hashes(seq, seq.num_computed_tokens)
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            block = seq.block_table[i]
            parent = seq.block_table[i - 1] if i > 0 else None
            if block != NULL_BLOCK and parent != NULL_BLOCK:
                self.pool.register(block, seq.block_hashes[i], self._block_tokens(seq, i), parent)
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
        first_live_block = first_visible // self.block_size
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

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens positions (rejected draft tokens' blocks).

        They were never published to the prefix cache: only blocks full of computed tokens are.
        """
        keep = self.num_blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self.pool.release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        """Release every block of the table (in reverse, so the tail is evicted first)."""
        for block in reversed(seq.block_table):
            self.pool.release(block)
        seq.block_table.clear()
        seq.num_registered_blocks = 0
