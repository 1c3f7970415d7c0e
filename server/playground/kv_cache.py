"""GET /kv_cache: the KV block pool and every running sequence's block table, as of now.

Ids and counts only (engine/core/kv_snapshot.py): nothing of any request's text or tokens. The
per-block states and the sequences (whose shared blocks tell whose prompt is cached) go to admin keys
only (server/http/access.py); any other key gets the pool's counts.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from engine.inspect import BLOCK_CACHED_FREE, BLOCK_FREE, BLOCK_IN_USE, BLOCK_SHARED
from server.http.access import caller_of
from server.http.openapi import tokenizer_responses
from server.openai.served_models import generation_model
from server.playground.protocol import AttentionGroupView, GroupBlocksView, KVCacheResponse, SequenceBlocksView
from server.state import SharedState

router = APIRouter()


@router.get("/kv_cache", response_model=KVCacheResponse, responses=tokenizer_responses())
async def kv_cache(request: Request, state: SharedState, model: str | None = None) -> KVCacheResponse:
    snapshot = await (await generation_model(state, model)).engine.kv_snapshot()
    shared = snapshot.count(BLOCK_SHARED)
    detail = caller_of(request).is_admin
    sequences = None
    if detail:
        sequences = [
            SequenceBlocksView(
                id=seq.seq_id,
                num_tokens=seq.num_tokens,
                num_computed_tokens=seq.num_computed_tokens,
                block_table=list(seq.block_table),
                shared=list(seq.shared),
                groups=[GroupBlocksView(block_table=list(g.block_table), shared=list(g.shared)) for g in seq.groups],
            )
            for seq in snapshot.sequences
        ]
    return KVCacheResponse(
        block_size=snapshot.block_size,
        num_blocks=snapshot.num_blocks,
        num_used_blocks=snapshot.count(BLOCK_IN_USE) + shared,
        num_shared_blocks=shared,
        num_cached_free_blocks=snapshot.count(BLOCK_CACHED_FREE),
        num_free_blocks=snapshot.count(BLOCK_FREE),
        detail=detail,
        blocks=snapshot.block_states if detail else None,
        sliding_window=snapshot.sliding_window,
        num_sink_tokens=snapshot.num_sink_tokens,
        attention_groups=[
            AttentionGroupView(
                sliding_window=g.sliding_window, num_sink_tokens=g.num_sink_tokens, layers=list(g.layers)
            )
            for g in snapshot.attention_groups
        ],
        prefix_caching=snapshot.prefix_caching,
        num_running=snapshot.num_running,
        num_waiting=snapshot.num_waiting,
        sequences=sequences,
    )
