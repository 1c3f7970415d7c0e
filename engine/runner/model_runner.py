"""Owns the model and the KV-cache tensors; turns a ScheduledBatch into sampled token ids.

Everything per step is built once here as flat tensors (token ids, positions,
cache slots, masks) and passed into the model; the model never loops over
sequences. A batch that raises is run again split by request, so a failure that
one request causes fails that request only (`execute_isolating_failures`).
"""

from __future__ import annotations

import logging
import traceback
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata, build_attention_metadata, per_token_rows
from engine.config import TORCH_DTYPES, EngineConfig, ModelConfig
from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence
from engine.models.gpt2 import GPT2LMHeadModel
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_fused import FusedLlamaDecode
from engine.ops.gguf_linear import GgufEmbedding, GgufLinear
from engine.ops.int8_linear import quantize_linears
from engine.outputs import EmittedTokens, TokenLogprob
from engine.runner.decode_path import DecodePath, choose_decode_path
from engine.runner.prompt_logprobs import prompt_rows, score_prompt_tokens
from engine.runner.rejection import verify_drafts
from engine.runner.sampler import SamplingRow, sample
from engine.structured.masks import apply_grammar_masks

logger = logging.getLogger(__name__)

# Steps whose sequences each compute at most this many tokens run on the fused kernel, one query row per
# token; longer queries (prompt chunks) run the torch layers, whose attention handles them as a block.
FUSED_ROWS_MAX_QUERY = 32

_MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}


@dataclass
class StepResult:
    """What one forward of a batch gives."""

    sampled: list[EmittedTokens]  # one per sequence that samples, in batch order
    prompt_logprobs: dict[Sequence, list[TokenLogprob]]  # the prompt tokens scored this step, per sequence

    def parts(self) -> tuple[list[EmittedTokens], dict[Sequence, list[TokenLogprob]]]:
        return self.sampled, self.prompt_logprobs


@dataclass
class IsolatedExecution:
    """A batch's results once the requests that make it fail are taken out of it."""

    batch: ScheduledBatch  # the sequences whose results are used, in batch order
    sampled: list[EmittedTokens]  # one per sequence of `batch` that samples, in order
    prompt_logprobs: dict[Sequence, list[TokenLogprob]] = field(default_factory=dict)  # see StepResult
    failed: dict[str, Exception] = field(default_factory=dict)  # request id -> what its part raised


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * model_config.head_dim * element


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        config: EngineConfig,
        num_blocks: int,
        sliding_window: int | None,
        num_sink_tokens: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.block_size = config.block_size
        self.sliding_window = sliding_window
        self.num_sink_tokens = num_sink_tokens
        self.eos_token_ids = eos_token_ids  # banned by the sampler until min_tokens
        with torch.device("meta"):
            model = _MODEL_CLASSES[model_config.architecture](model_config)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.load_weights(state_dict)
        if config.quantization in ("int8", "gguf"):
            # In gguf mode the layers the file's blocks filled are GgufLinear already; the rest become int8.
            blocks = Counter(m.qtype for m in model.modules() if isinstance(m, (GgufLinear, GgufEmbedding)))
            int8 = quantize_linears(model)
            logger.info("weights: GGUF blocks %s; int8 %d linear layers", dict(blocks) or "none", int8)
        self.model = model.eval().requires_grad_(False)
        shape = (num_blocks, config.block_size, model_config.num_kv_heads, model_config.head_dim)
        # One (key, value) pair per layer, allocated once for the whole life of the engine.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(model_config.num_layers)
        ]
        # The one place that decides which code runs decode-only steps (see forward).
        self.decode_plan = choose_decode_path(self.model, self.kv_caches)
        logger.info("%s", self.decode_plan.describe())
        is_fused = self.decode_plan.path is DecodePath.FUSED_NATIVE
        self.fused_decode = FusedLlamaDecode(self.model, self.kv_caches) if is_fused else None

    def build_inputs(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat input ids [T], positions [T] and the attention metadata for one step."""
        bs = self.block_size
        window, sinks = self.sliding_window, self.num_sink_tokens
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        counts = batch.num_new_tokens
        # A speculating sequence's new tokens end with its drafts, which are not in its token_ids.
        input_ids = np.concatenate(
            [
                np.asarray(s.token_ids[st : st + n - len(d)] + d, dtype=np.int64)
                for s, st, n, d in zip(batch.seqs, starts, counts, batch.draft_token_ids)
            ]
        )
        positions = np.concatenate([np.arange(st, st + n) for st, n in zip(starts, counts)])

        block_tables = [seq.block_table for seq in batch.seqs]
        meta = build_attention_metadata(starts, counts, block_tables, bs, window, sinks, self.device)
        dev = self.device
        return torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, short_queries: bool = False
    ) -> torch.Tensor:
        """Final hidden states [T, hidden]. On the fused path, decode-only steps run every layer in one
        native call, and so do steps where no sequence computes more than FUSED_ROWS_MAX_QUERY tokens
        (short_queries: a token and its speculative drafts, a draft model catching up): each token is then
        one query row, seeing what the step's mask lets it see."""
        if self.fused_decode is not None and self.decode_plan.path is DecodePath.FUSED_NATIVE:
            if meta.is_decode_only:
                return self.fused_decode(input_ids, positions, meta)
            if short_queries:
                blocks, mask = per_token_rows(meta, self.block_size)
                return self.fused_decode.run_rows(input_ids, positions, blocks, mask, meta.slot_mapping)
        return self.model(input_ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Forward the batch and sample: the tokens each sequence that samples appends this step (one,
        or accepted drafts and the token after them), and the prompt tokens this step scores for the
        sequences that asked for prompt logprobs."""
        hidden = self.run_model(batch)
        scored_prompts = {}
        wanted_prompt_rows = prompt_rows(batch)
        if wanted_prompt_rows:
            scored_prompts = score_prompt_tokens(hidden, wanted_prompt_rows, self.model.compute_logits)
        sampling = [i for i in range(len(batch.seqs)) if batch.is_sampling(i)]
        if not sampling:
            return StepResult([], scored_prompts)
        ends = np.cumsum(batch.num_new_tokens) - 1
        plain = [i for i in sampling if not batch.draft_token_ids[i]]
        speculating = [i for i in sampling if batch.draft_token_ids[i]]
        # One output-head product for every row sampled: each plain sequence's last position, then each
        # speculating sequence's last k+1 (after its last accepted token and after each draft).
        row_index = [int(ends[i]) for i in plain]
        for i in speculating:
            end = int(ends[i])
            row_index.extend(range(end - len(batch.draft_token_ids[i]), end + 1))
        logits = self.model.compute_logits(hidden[torch.tensor(row_index, device=self.device)])
        emitted: dict[int, EmittedTokens] = {}
        if plain:
            plain_logits = logits[: len(plain)]
            seqs = [batch.seqs[i] for i in plain]
            matchers = [s.matcher for s in seqs]
            if any(m is not None for m in matchers):
                apply_grammar_masks(plain_logits, matchers, self.eos_token_ids)
            output = sample(plain_logits, [self._sampling_row(s) for s in seqs])
            for i, token_id, logprob in zip(plain, output.token_ids, output.logprobs, strict=True):
                emitted[i] = EmittedTokens([token_id], [logprob])
        if speculating:
            verified = verify_drafts(
                logits[len(plain) :],
                [self._sampling_row(batch.seqs[i]) for i in speculating],
                [batch.draft_token_ids[i] for i in speculating],
            )
            emitted.update(zip(speculating, verified, strict=True))
        return StepResult([emitted[i] for i in sampling], scored_prompts)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        return SamplingRow(seq.params, seq.token_ids, seq.num_prompt_tokens, self.eos_token_ids, seq.generator)

    def execute_isolating_failures(self, batch: ScheduledBatch) -> IsolatedExecution:
        """`execute`, except that a failure pinned to some requests fails only those.

        When the batch raises, its requests are split in halves and each half runs
        alone, halving again whatever still raises: a part that succeeds keeps its
        results, a request that raises on its own lands in `failed`. The re-runs give
        exactly what the batch would have: K/V written again for the same positions get
        the same values, and every seeded generator is put back to its state before the
        failed attempt. Nothing in a sequence changes here (the scheduler advances the
        sequences of the returned batch). Raises the first error when no part succeeds:
        nothing pins the failure on a request, so the model itself is failing.
        """
        request_ids = list(dict.fromkeys(seq.request_id for seq in batch.seqs))
        if len(request_ids) == 1:  # a re-run alone is the same batch
            return IsolatedExecution(batch, *self.execute(batch).parts())
        generator_states = _generator_states(batch.seqs)
        try:
            return IsolatedExecution(batch, *self.execute(batch).parts())
        except Exception as exc:  # noqa: BLE001 - re-run below, raised again if no request explains it
            first_error = _without_locals(exc)
        logger.warning(
            "a batch of %d requests raised %r; running it again split by request", len(request_ids), first_error
        )
        sampled: dict[Sequence, EmittedTokens] = {}
        scored_prompts: dict[Sequence, list[TokenLogprob]] = {}
        succeeded: set[str] = set()
        failed: dict[str, Exception] = {}
        parts = _halves(request_ids)
        while parts:
            part_ids = parts.pop()
            part = batch.only(set(part_ids))
            for seq in part.seqs:
                if seq in generator_states:
                    seq.generator.set_state(generator_states[seq])
            try:
                output, part_prompts = self.execute(part).parts()
            except Exception as exc:  # noqa: BLE001 - pinned below, or split further
                if len(part_ids) == 1:
                    failed[part_ids[0]] = _without_locals(exc)
                else:
                    parts.extend(_halves(part_ids))
                continue
            succeeded.update(part_ids)
            scored_prompts.update(part_prompts)
            sampling_seqs = [seq for i, seq in enumerate(part.seqs) if part.is_sampling(i)]
            sampled.update(zip(sampling_seqs, output, strict=True))
        if not succeeded:
            raise first_error
        survivors = batch.only(succeeded)
        rows = [sampled[seq] for i, seq in enumerate(survivors.seqs) if survivors.is_sampling(i)]
        return IsolatedExecution(survivors, rows, scored_prompts, failed)

    def run_model(self, batch: ScheduledBatch) -> torch.Tensor:
        """The batch's final hidden states [T, hidden], one row per new token in batch order."""
        input_ids, positions, meta = self.build_inputs(batch)
        short_queries = max(batch.num_new_tokens) <= FUSED_ROWS_MAX_QUERY
        return self.forward(input_ids, positions, meta, short_queries=short_queries)

    def _sampling_logits(self, batch: ScheduledBatch, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [R, vocab]: one row per sequence that samples this step."""
        ends = np.cumsum(batch.num_new_tokens) - 1
        rows = [int(ends[i]) for i in range(len(batch.seqs)) if batch.is_sampling(i)]
        if not rows:
            return hidden.new_empty(0, self.model_config.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])

    @torch.inference_mode()
    def compute_logits(self, batch: ScheduledBatch, all_positions: bool = False) -> torch.Tensor:
        """float32 logits: one row per sequence that samples this step (or one per token if all_positions)."""
        hidden = self.run_model(batch)
        if all_positions:
            return self.model.compute_logits(hidden)
        return self._sampling_logits(batch, hidden)


def _halves(items: list[str]) -> list[list[str]]:
    middle = len(items) // 2
    return [items[:middle], items[middle:]]


def _without_locals(exc: Exception) -> Exception:
    """The error with its traceback's finished frames cleared, so the failed attempt's tensors are freed
    before the re-runs (an out-of-memory error would otherwise strike again)."""
    traceback.clear_frames(exc.__traceback__)
    return exc


def _generator_states(seqs: list[Sequence]) -> dict[Sequence, torch.Tensor]:
    """Each seeded sequence's generator state, to put back before a re-run."""
    return {seq: seq.generator.get_state() for seq in seqs if seq.generator is not None}
