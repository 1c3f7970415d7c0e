"""Owns the model and the KV-cache tensors; turns a ScheduledBatch into sampled token ids.

Everything per step is built once here as flat tensors (token ids, positions,
cache slots, masks) and passed into the model; the model never loops over
sequences. A speculating sequence's drafts are verified in the same forward
(engine/runner/rejection.py); engine/runner/isolation.py runs `execute` so that
a failure one request causes fails that request only.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine import quantization
from engine.attention.metadata import AttentionMetadata, build_group_metadata, decode_only_rows
from engine.config import TORCH_DTYPES, EngineConfig, ModelConfig
from engine.core.kv_layout import KVLayout
from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence
from engine.models import greedy_burst, registry
from engine.models.fused_decode import FusedDecode, GroupRows, decode_rows, token_rows
from engine.models.greedy_burst import GreedyBurst
from engine.ops import decode_attention, gguf_linear, int8_linear, kv_format, loader
from engine.ops.cpu_features import cpu_features
from engine.outputs import EmittedTokens, TokenLogprob
from engine.runner.decode_path import DecodePath, choose_decode_path
from engine.runner.prompt_logprobs import prompt_rows, score_prompt_tokens
from engine.runner.rejection import verify_drafts
from engine.runner.sampler import SamplingRow, needs_adjusting, sample
from engine.structured.masks import apply_grammar_masks

logger = logging.getLogger(__name__)

# Steps whose sequences each compute at most this many tokens run on the fused kernel, one query row per
# token; longer queries (prompt chunks) run the torch layers, whose attention handles them as a block.
FUSED_ROWS_MAX_QUERY = 32

# Most sequences a greedy burst runs: the head products of the step by step path take the integer kernels
# (the burst's) up to this many rows.
BURST_MAX_ROWS = min(gguf_linear.MAX_KERNEL_ROWS, int8_linear.MAX_KERNEL_ROWS)

_MODEL_CLASSES = {entry.name: entry.model_class for entry in registry.entries()}


@dataclass
class StepResult:
    """What one forward of a batch gives."""

    sampled: list[EmittedTokens]  # one per sequence that samples, in batch order
    prompt_logprobs: dict[Sequence, list[TokenLogprob]]  # the prompt tokens scored this step, per sequence

    def parts(self) -> tuple[list[EmittedTokens], dict[Sequence, list[TokenLogprob]]]:
        return self.sampled, self.prompt_logprobs


def kv_bytes_per_block(model_config: ModelConfig, layout: KVLayout, block_size: int, kv_cache_dtype: str) -> int:
    """The bytes one block id holds over every layer, in a cache of format `kv_cache_dtype` (a KV_CACHE_DTYPES
    name other than auto)."""
    row = kv_format.row_bytes(kv_cache_dtype, model_config.head_dim)
    return layout.bytes_per_block(block_size, model_config.num_kv_heads, row)


def kv_bytes_per_token(model_config: ModelConfig, kv_cache_dtype: str) -> int:
    """One token's keys and values over every layer (a sliding layer's too: what a token costs while it is in
    the cache)."""
    row = kv_format.row_bytes(kv_cache_dtype, model_config.head_dim)
    return 2 * model_config.num_layers * model_config.num_kv_heads * row


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        config: EngineConfig,
        num_blocks: int,
        layout: KVLayout,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.model_config = model_config
        self.quantization = config.quantization  # the method the loader resolved (never "auto" here)
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.block_size = config.block_size
        self.layout = layout
        self._group_kinds = [(g.sliding_window, g.num_sink_tokens) for g in layout.groups]
        self.eos_token_ids = eos_token_ids  # banned by the sampler until min_tokens
        with torch.device("meta"):
            model = _MODEL_CLASSES[model_config.architecture](model_config)
        # Counted before any layer is quantized: each weight's own elements, an output matrix tied to the
        # embeddings once.
        tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
        self.num_parameters = sum(
            parameter.numel() for name, parameter in model.named_parameters() if not (tied and name == "lm_head.weight")
        )
        model = model.to_empty(device=self.device).to(self.dtype)
        model.load_weights(state_dict)
        # The layers the quantization method swapped in while the weights loaded stay; it replaces the rest.
        quantized = quantization.method(config.quantization).quantize_model(model)
        if quantized is not None:
            logger.info("weights: %s", quantized)
        # What GGUF block layers multiply prefill batches in (None: the model has no such layers).
        self.prefill_dtype = quantization.apply_prefill_dtype(model, config)
        self.model = model.eval().requires_grad_(False)
        # The weights as they are held (quantized blocks included), parameters and buffers.
        self.weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        self.kv_cache_dtype = kv_format.kv_cache_dtype_of(config)
        shape = (num_blocks, config.block_size, model_config.num_kv_heads, model_config.head_dim)
        # One (key, value) pair per slot of a block, allocated once for the whole life of the engine; each
        # layer reads and writes its slot's pair through its group's block tables (engine/core/kv_layout.py).
        slots = [
            (
                kv_format.allocate(self.kv_cache_dtype, *shape, device=self.device),
                kv_format.allocate(self.kv_cache_dtype, *shape, device=self.device),
            )
            for _ in range(layout.layers_per_group)
        ]
        self.kv_caches = [slots[slot] for slot in layout.layer_slot]  # per layer
        # The one place that decides which code runs decode-only steps (see forward).
        self.decode_plan = choose_decode_path(self.model, self.kv_caches, layout)
        logger.info("%s%s", self.decode_plan.describe(), self._machine_line())
        is_fused = self.decode_plan.path is DecodePath.FUSED_NATIVE
        self.fused_decode = FusedDecode(self.model, self.kv_caches, layout.layer_group) if is_fused else None
        # Several greedy steps in one call (greedy_burst > 1); the flag ends a burst early from any thread.
        self.greedy_burst: GreedyBurst | None = None
        self.max_burst = 1
        self.burst_seconds = config.greedy_burst_ms / 1000  # 0: bursts are not capped by their length
        # The last decode-only step's seconds (a burst's per step), by the number of sequences in it: a step of 32
        # takes several times one of 1, so a pace is only ever taken from a batch of the same size.
        self.decode_step_seconds: dict[int, float] = {}
        self.burst_interrupt = ctypes.c_int32(0)
        if self.fused_decode is not None and config.greedy_burst > 1:
            reason = greedy_burst.unsupported_reason(self.fused_decode.recipe.tail)
            if reason is None:
                self.greedy_burst = GreedyBurst(self.fused_decode, self.fused_decode.recipe.tail)
                self.max_burst = config.greedy_burst
                cap = f", {config.greedy_burst_ms:g} ms of steps at most" if self.burst_seconds else ""
                logger.info("greedy bursts: up to %d decode steps in one call%s", self.max_burst, cap)
            else:
                logger.info("greedy bursts off: %s", reason)

    def _machine_line(self) -> str:
        """What the decode-path log line adds on CPU: the features the kernels were chosen by, their build,
        and the prefill products' dtype."""
        if self.device.type != "cpu":
            return ""
        build = f"; kernels built for {loader.chosen_isa()}" if self.decode_plan.native_ops else ""
        if "decode_attention" in self.decode_plan.native_ops and decode_attention.takes_wide(
            self.model_config.head_dim
        ):
            build += "; decode attention in 512-bit registers"
        kernel_types = [getattr(module, "kernel_type", 0) for module in self.model.modules()]
        interleaved = [t for t in kernel_types if t & gguf_linear.INTERLEAVED]
        if interleaved:
            widths = sorted({"256-bit" if t & gguf_linear.NARROW else "512-bit" for t in interleaved})
            build += f"; GGUF weights interleaved for the {' and '.join(widths)} register-tiled products"
        prefill = f"; prefill products in {self.prefill_dtype}" if self.prefill_dtype is not None else ""
        return f"; CPU {' '.join(cpu_features()) or 'features unknown'}{build}{prefill}"

    def build_inputs(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
        """Flat input ids [T], positions [T] and each layer's attention metadata for one step (layers of one
        attention group share one)."""
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

        tables_by_group = [[seq.block_tables[g] for seq in batch.seqs] for g in range(self.layout.num_groups)]
        group_metas = build_group_metadata(
            starts, counts, tables_by_group, self._group_kinds, self.block_size, self.device
        )
        metas = [group_metas[g] for g in self.layout.layer_group]
        dev = self.device
        return torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), metas

    def _fuses_decode(self) -> bool:
        """Whether decode-only steps run in the fused native call (the plan can be switched to the torch layers,
        the fused step's reference)."""
        return self.fused_decode is not None and self.decode_plan.path is DecodePath.FUSED_NATIVE

    def decode_inputs(
        self, batch: ScheduledBatch, num_steps: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor, list[list[GroupRows]]]:
        """num_steps decode-only steps' (one new token per sequence each) inputs: the first step's input ids [B],
        the positions [num_steps * B] step by step, and each step's rows of every attention group, the fused
        call's inputs: what `forward` takes from build_inputs' metadata for such a step, built without the rest
        of it. Step k's rows sit at positions k past the first's (a greedy burst's later steps)."""
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        input_ids = torch.tensor([seq.token_ids[start] for seq, start in zip(batch.seqs, starts)], dtype=torch.int64)
        tables_by_group = [[seq.block_tables[g] for seq in batch.seqs] for g in range(self.layout.num_groups)]
        positions = [start + k for k in range(num_steps) for start in starts]
        steps = []
        for k in range(num_steps):
            rows = decode_only_rows(
                positions[k * len(starts) : (k + 1) * len(starts)], tables_by_group, self._group_kinds, self.block_size
            )
            steps.append([GroupRows(*group) for group in rows])
        return input_ids, torch.tensor(positions, dtype=torch.int64), steps

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: list[AttentionMetadata],
        short_queries: bool = False,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden]. On the fused path, decode-only steps run every layer in one
        native call, and so do steps where no sequence computes more than FUSED_ROWS_MAX_QUERY tokens
        (short_queries: a token and its speculative drafts, a draft model catching up): each token is then
        one query row, seeing what the step's mask lets it see."""
        if self._fuses_decode():
            group_metas = [metas[group.layers[0]] for group in self.layout.groups]
            if group_metas[0].is_decode_only:  # the same for every group: it counts each sequence's new tokens
                return self.fused_decode(input_ids, positions, [decode_rows(meta) for meta in group_metas])
            if short_queries:
                rows = [token_rows(meta, self.block_size) for meta in group_metas]
                return self.fused_decode(input_ids, positions, rows)
        return self.model(input_ids, positions, self.kv_caches, metas)

    def plan_burst(self, seqs: list[Sequence]) -> int:
        """How many greedy steps a decode-only batch of these sequences may run in one call (1: one step): up to
        max_burst where every sequence is plain greedy and the batch fits the burst kernel."""
        if self.greedy_burst is None or len(seqs) > BURST_MAX_ROWS or not self._fuses_decode():
            return 1
        for seq in seqs:
            params = seq.params
            if not params.is_greedy or params.logprobs is not None or seq.matcher is not None:
                return 1
            if needs_adjusting(self._sampling_row(seq)):
                return 1
        if not self.burst_seconds:
            return self.max_burst
        pace = self.decode_step_seconds.get(len(seqs))
        if pace is None:
            return 1  # a plain step first, which gives the pace
        return max(1, min(self.max_burst, int(self.burst_seconds / pace)))

    def _execute_burst(self, batch: ScheduledBatch) -> StepResult:
        """Up to batch.burst greedy steps in one call: each sequence emits the tokens its steps chose."""
        assert self.greedy_burst is not None
        input_ids, positions, steps = self.decode_inputs(batch, batch.burst)
        stop_ids = set(self.eos_token_ids).union(*(seq.params.stop_token_ids for seq in batch.seqs))
        tokens = self.greedy_burst(input_ids, positions, steps, sorted(stop_ids), self.burst_interrupt)
        columns = tokens.t().tolist()  # [B, steps done]
        return StepResult([EmittedTokens(ids, [None] * len(ids)) for ids in columns], {})

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Forward the batch and sample: the tokens each sequence that samples appends this step (one,
        or accepted drafts and the token after them, or a burst's tokens), and the prompt tokens this step
        scores for the sequences that asked for prompt logprobs."""
        start = time.perf_counter()
        if batch.burst > 1:
            result = self._execute_burst(batch)
            steps = len(result.sampled[0].token_ids) if result.sampled else 1
            self.decode_step_seconds[len(batch.seqs)] = (time.perf_counter() - start) / steps
            return result
        result = self._execute(batch)
        if batch.decodes_only and not batch.num_drafts:
            self.decode_step_seconds[len(batch.seqs)] = time.perf_counter() - start
        return result

    def _execute(self, batch: ScheduledBatch) -> StepResult:
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
        if row_index != list(range(hidden.shape[0])):  # a decode step samples every row, in order
            hidden = hidden[torch.tensor(row_index, device=self.device)]
        logits = self.model.compute_logits(hidden)
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

    def run_model(self, batch: ScheduledBatch) -> torch.Tensor:
        """The batch's final hidden states [T, hidden], one row per new token in batch order."""
        if self._fuses_decode() and max(batch.num_new_tokens) == 1:
            input_ids, positions, (groups,) = self.decode_inputs(batch)
            return self.fused_decode(input_ids, positions, groups)
        input_ids, positions, metas = self.build_inputs(batch)
        short_queries = max(batch.num_new_tokens) <= FUSED_ROWS_MAX_QUERY
        return self.forward(input_ids, positions, metas, short_queries=short_queries)

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
