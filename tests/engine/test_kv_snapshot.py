"""KV cache snapshots: block states and block tables against the pool's own counts."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.block_pool import NULL_BLOCK
from engine.core.kv_snapshot import BLOCK_CACHED_FREE, BLOCK_FREE, BLOCK_IN_USE, BLOCK_SHARED
from engine.llm import LLM
from engine.params import SamplingParams


def _counts(snapshot) -> dict[str, int]:
    return {s: snapshot.count(s) for s in (BLOCK_IN_USE, BLOCK_SHARED, BLOCK_CACHED_FREE, BLOCK_FREE)}


def test_snapshot_follows_shared_prefixes_and_frees(tiny_llama_dir):
    llm = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, num_blocks=64))
    engine = llm.engine
    prefix = list(range(10, 30))  # 5 full blocks, shared by both requests
    engine.add_request(prefix + [40, 41], SamplingParams(temperature=0, max_tokens=8, min_tokens=8))
    engine.step()
    engine.add_request(prefix + [50, 51, 52], SamplingParams(temperature=0, max_tokens=8, min_tokens=8))
    engine.step()

    snapshot = engine.kv_snapshot()
    assert snapshot.num_blocks == 63 and len(snapshot.block_states) == 63
    counts = _counts(snapshot)
    assert sum(counts.values()) == 63
    assert counts[BLOCK_IN_USE] + counts[BLOCK_SHARED] == engine.pool.num_used_blocks
    assert snapshot.num_running == 2 and len(snapshot.sequences) == 2
    first, second = snapshot.sequences
    # The second request took the first one's 5 prompt blocks from the prefix cache.
    assert second.block_table[:5] == first.block_table[:5]
    assert first.shared[:5] == second.shared[:5] == (True,) * 5
    assert not any(first.shared[5:]) and not any(second.shared[5:])
    assert counts[BLOCK_SHARED] == 5
    for seq in snapshot.sequences:
        assert len(seq.block_table) == len(seq.shared) >= -(-seq.num_computed_tokens // 4)
        for block in seq.block_table:
            state = snapshot.block_states[block - 1]
            assert state in (BLOCK_SHARED, BLOCK_IN_USE)

    while engine.has_unfinished_requests():
        engine.step()
    done = engine.kv_snapshot()
    assert done.sequences == () and done.num_running == 0
    counts = _counts(done)
    assert counts[BLOCK_IN_USE] == counts[BLOCK_SHARED] == 0
    assert counts[BLOCK_CACHED_FREE] >= 5  # the shared prefix stays findable
    assert counts[BLOCK_CACHED_FREE] + counts[BLOCK_FREE] == 63


def test_snapshot_shows_blocks_released_by_the_window(tiny_llama_dir):
    llm = LLM.from_config(
        EngineConfig(model=tiny_llama_dir, block_size=4, num_blocks=64, sliding_window=8, num_sink_tokens=4)
    )
    engine = llm.engine
    engine.add_request(list(range(10, 40)), SamplingParams(temperature=0, max_tokens=4, min_tokens=4))
    engine.step()
    engine.step()
    (seq,) = engine.kv_snapshot().sequences
    assert seq.block_table[0] != NULL_BLOCK  # the sink block stays
    assert NULL_BLOCK in seq.block_table[1:]  # blocks behind the window went back to the pool
    assert seq.shared[seq.block_table.index(NULL_BLOCK)] is False
    snapshot = engine.kv_snapshot()
    assert snapshot.sliding_window == 8 and snapshot.num_sink_tokens == 4
