"""Read-only looks inside a running generation engine: what the playground shows.

`AsyncEngine.kv_snapshot()` answers a KVCacheSnapshot (the block pool and the block tables, ids and
counts only; each block's state is one of the BLOCK_* characters) and `AsyncEngine.attention_weights()`
answers AttentionWeights (a prompt's weights from the reference attention path). Both are taken between
steps, on the torch worker; this module names their shapes so that callers need nothing of the engine's
internals. ModelInfo.attention_kinds names each layer's kind with the ATTENTION_* strings.
"""

from __future__ import annotations

from engine.attention.probe import AttentionWeights
from engine.core.kv_snapshot import (
    BLOCK_CACHED_FREE,
    BLOCK_FREE,
    BLOCK_IN_USE,
    BLOCK_SHARED,
    KVCacheSnapshot,
    SequenceBlocks,
)
from engine.model_info import ATTENTION_FULL, ATTENTION_SLIDING

__all__ = [
    "ATTENTION_FULL",
    "ATTENTION_SLIDING",
    "BLOCK_CACHED_FREE",
    "BLOCK_FREE",
    "BLOCK_IN_USE",
    "BLOCK_SHARED",
    "AttentionWeights",
    "KVCacheSnapshot",
    "SequenceBlocks",
]
