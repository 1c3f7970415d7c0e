"""Draft-model proposals: a smaller model with the same tokenizer guesses the next k tokens greedily.

The draft model has its own ModelRunner, block pool and paged KV cache. For each target sequence it
keeps a mirror Sequence whose K/V it has computed; before proposing, the mirror is brought in step
with the target's tokens: the K/V of drafts the target accepted are kept, those of rejected drafts
are dropped (the mirror's computed count is cut back to the common prefix, whole blocks past it freed).
A proposal is then one catch-up forward (the target's new tokens, batched over sequences) and k-1
one-token decodes.
"""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig, ModelConfig, cdiv
from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_layout import plan_kv_layout
from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence
from engine.ops import kv_format
from engine.params import SamplingParams
from engine.runner.model_runner import ModelRunner, kv_bytes_per_block

logger = logging.getLogger(__name__)

_DRAFT_PARAMS = SamplingParams(temperature=0.0, max_tokens=None)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer:
    """Greedy proposals from a draft model kept in step with each target sequence."""

    def __init__(
        self,
        model_config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        config: EngineConfig,
        num_speculative_tokens: int,
        max_num_seqs: int,
    ) -> None:
        self.model_config = model_config
        self.max_model_len = model_config.max_position_embeddings
        layout = plan_kv_layout(model_config.windows(), 0)
        per_block = kv_bytes_per_block(model_config, layout, config.block_size, kv_format.kv_cache_dtype_of(config))
        # Every running sequence's whole context plus its drafts, or the memory budget, whichever is less.
        useful = (
            max_num_seqs
            * layout.num_groups
            * (cdiv(self.max_model_len + num_speculative_tokens, config.block_size) + 1)
            + 1
        )
        num_blocks = max(2, min(config.kv_cache_memory_bytes // per_block, useful))
        self.runner = ModelRunner(model_config, state_dict, config, num_blocks, layout, ())
        self.pool = BlockPool(num_blocks, enable_prefix_caching=False)
        self.kv_manager = KVCacheManager(self.pool, config.block_size, layout.groups)
        self._mirrors: dict[int, Sequence] = {}
        logger.info(
            "draft model: %s, %d KV blocks (%.1f MiB)", config.model, num_blocks, num_blocks * per_block / 2**20
        )

    def _mirror(self, seq: Sequence) -> Sequence:
        """The draft-side sequence for seq, its tokens set to seq's and its K/V cut back to what still holds."""
        mirror = self._mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = Sequence(seq.seq_id, seq.request_id, 0, list(seq.prompt_token_ids), _DRAFT_PARAMS, 0.0)
            self._mirrors[seq.seq_id] = mirror
        keep = _common_prefix(mirror.token_ids, seq.token_ids)
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, keep)
        mirror.token_ids = list(seq.token_ids)
        return mirror

    def _drop(self, seq_id: int) -> None:
        mirror = self._mirrors.pop(seq_id, None)
        if mirror is not None:
            self.kv_manager.free(mirror)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        active: list[int] = []
        for i, (seq, k) in enumerate(zip(seqs, num_tokens)):
            if len(seq.token_ids) + k > self.max_model_len:
                self._drop(seq.seq_id)  # past the draft model's context: the target decodes plainly
                continue
            mirror = self._mirror(seq)
            self.kv_manager.trim(mirror, mirror.num_computed_tokens)
            self.kv_manager.release_out_of_window(mirror)
            if not self.kv_manager.grow(mirror, len(mirror.token_ids) + k - 1):
                self._drop(seq.seq_id)  # the draft cache is full: no proposal this step
                continue
            active.append(i)
        for _ in range(max((num_tokens[i] for i in active), default=0)):
            active = [i for i in active if len(drafts[i]) < num_tokens[i]]
            if not active:
                break
            mirrors = [self._mirrors[seqs[i].seq_id] for i in active]
            for mirror in mirrors:
                self.kv_manager.release_out_of_window(mirror)
            batch = ScheduledBatch(mirrors, [m.num_uncomputed_tokens for m in mirrors])
            logits = self.runner.compute_logits(batch)  # [len(active), vocab], at each mirror's last token
            for i, mirror, token_id in zip(active, mirrors, logits.argmax(dim=-1).tolist()):
                mirror.num_computed_tokens = len(mirror.token_ids)
                mirror.token_ids.append(token_id)
                drafts[i].append(token_id)
        return drafts

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._drop(seq_id)

    @property
    def num_mirrors(self) -> int:
        return len(self._mirrors)
