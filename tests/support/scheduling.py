"""Schedulers and sequences built directly at block_size=2, no model: for the scheduler's table tests.

A sequence can be put straight into the running set at any progress, with its blocks held and its
full computed blocks published, as the steps before would have left it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.params import SamplingParams

BLOCK_SIZE = 2
EOS = 2
MAX_MODEL_LEN = 64
FIRST_PROMPT_TOKEN = 100  # prompt tokens are 100, 101, ...: never EOS nor a test's sampled token

_seq_ids = itertools.count()


def make_scheduler(
    num_blocks: int = 64,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = MAX_MODEL_LEN,
    prefix_caching: bool = True,
    plan_drafts: Callable[[list[Sequence], int], list[int]] | None = None,
    plan_burst: Callable[[list[Sequence]], int] | None = None,
) -> Scheduler:
    """A scheduler over a pool of num_blocks blocks (block 0 is the null block) of BLOCK_SIZE tokens; EOS ends."""
    manager = KVCacheManager.single(BlockPool(num_blocks, prefix_caching), BLOCK_SIZE, None)
    return Scheduler(
        manager,
        max_num_seqs,
        max_num_batched_tokens,
        (EOS,),
        max_model_len=max_model_len,
        plan_drafts=plan_drafts,
        plan_burst=plan_burst,
    )


def make_seq(num_prompt_tokens: int, generated: Iterable[int] = (), params: SamplingParams | None = None) -> Sequence:
    """A waiting sequence whose prompt is FIRST_PROMPT_TOKEN, +1, ... and which has already generated `generated`."""
    prompt = list(range(FIRST_PROMPT_TOKEN, FIRST_PROMPT_TOKEN + num_prompt_tokens))
    seq_id = next(_seq_ids)
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        index=0,
        prompt_token_ids=prompt,
        params=params if params is not None else SamplingParams(max_tokens=16),
        arrival_time=0.0,
        token_ids=prompt + list(generated),
    )


def put_running(scheduler: Scheduler, seq: Sequence, num_computed_tokens: int) -> Sequence:
    """Make seq a running sequence whose first num_computed_tokens tokens have their K/V in held blocks.

    The table covers exactly the computed positions and its full blocks are published, as after a step.
    """
    manager = scheduler.kv_manager
    assert manager.grow(seq, num_computed_tokens), "the pool is too small for this sequence"
    seq.num_computed_tokens = num_computed_tokens
    manager.register_computed_blocks(seq)
    seq.status = SequenceStatus.RUNNING
    seq.first_scheduled_time = 0.0
    scheduler.running.append(seq)
    return seq
