"""The synchronous engine core: add_request / abort / step. Token ids only, no text.

`step()` is three verbs: the scheduler picks the batch, the runner computes it
and samples, the scheduler advances the sequences, applies the stop check and
counts. The runner is composed here once: failure isolation around the model
runner (engine/runner/isolation.py), speculation around that when it is on.
A request whose computation raises on its own is finished with FINISH_ERROR
(its RequestOutput carries the error) and the rest of the step goes on; a
failure that no request explains is raised from `step()`.
Single-threaded by design: its one owner (engine.serving.async_engine in the
server, engine.llm.LLM offline) calls it from one thread at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.probe import AttentionWeights, attention_weights
from engine.config import EngineConfig, ModelConfig
from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_layout import plan_kv_layout
from engine.core.kv_snapshot import KVCacheSnapshot, take_snapshot
from engine.core.scheduler import Scheduler, StepCounters
from engine.core.sequence import Sequence
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.models import registry
from engine.ops import kv_format
from engine.outputs import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_STOP,
    CompletionOutput,
    EngineStats,
    RequestOutput,
    TokenLogprob,
)
from engine.params import SamplingParams
from engine.runner.isolation import BatchRunner, IsolatingRunner
from engine.runner.model_runner import ModelRunner, kv_bytes_per_block, kv_bytes_per_token
from engine.spec.speculative_runner import build_speculative_runner
from engine.structured.grammar import GrammarCompiler
from engine.structured.thinking import ThinkingFirst

logger = logging.getLogger(__name__)

_PROBE_TOKEN_ID = 0  # any id in the vocabulary will do: the probe asks only that the model computes
_PROBE_MAX_STEPS = 4  # a one-token prompt and one new token: one step, two with a chunked prefill


@dataclass
class _EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float
    prompt_logprobs_sent: bool = False

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs once they are all computed, the first time only (None otherwise)."""
        first = self.seqs[0]
        if self.prompt_logprobs_sent or first.params.prompt_logprobs is None or first.needs_prompt_logprobs:
            return None
        self.prompt_logprobs_sent = True
        return [None, *first.prompt_logprobs]


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        state_dict: dict,
        eos_token_ids: tuple[int, ...],
        grammar: GrammarCompiler | None = None,
        draft_model: tuple[EngineConfig, ModelConfig, dict] | None = None,
    ) -> None:
        """grammar: compiles the structured-output specs of requests (None: such requests are refused).

        draft_model: (its config, architecture, weights) for config.speculative's method "draft".
        """
        self.config = config
        self.grammar = grammar
        self.model_config = model_config
        self.eos_token_ids = eos_token_ids
        self.model_name = config.model
        # A window given to the engine applies to every layer; otherwise each layer has the model's own.
        windows = (
            (config.sliding_window,) * model_config.num_layers if config.sliding_window else model_config.windows()
        )
        self.layout = plan_kv_layout(windows, config.num_sink_tokens)
        # The sliding layers' window (None: every layer is full); sinks count only with a window.
        self.sliding_window = next((w for w in windows if w is not None), None)
        self.num_sink_tokens = config.num_sink_tokens if self.sliding_window is not None else 0
        self.max_model_len = self._derive_max_model_len()
        # The one bound on token ids a request may carry (prompt ids, logit_bias keys; the server checks
        # against it too): the model's embedding table size. An id at or past it would index past the
        # table, so the tokenizer's length is the wrong bound where the tokenizer has more entries
        # (added tokens the checkpoint lacks). Where the table is padded past the tokenizer, the ids in
        # between are ones the model itself can emit, so the detokenizer already handles them.
        self.vocab_size = model_config.vocab_size

        self.kv_cache_dtype = kv_format.kv_cache_dtype_of(config)
        per_block = kv_bytes_per_block(model_config, self.layout, config.block_size, self.kv_cache_dtype)
        self.kv_bytes_per_token = kv_bytes_per_token(model_config, self.kv_cache_dtype)
        blocks_per_seq = self.layout.max_blocks_per_seq(
            self.max_model_len, config.block_size, config.max_num_batched_tokens
        )
        useful = config.max_num_seqs * blocks_per_seq + 1  # more than this is never used at once
        num_blocks = config.num_blocks or max(2, min(config.kv_cache_memory_bytes // per_block, useful))
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB), %s, %d bytes per token, max_model_len %d, attention %s",
            num_blocks,
            config.block_size,
            num_blocks * per_block / 2**20,
            self.kv_cache_dtype,
            self.kv_bytes_per_token,
            self.max_model_len,
            self.layout.describe(),
        )
        self.runner = ModelRunner(model_config, state_dict, config, num_blocks, self.layout, eos_token_ids)
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        # The format is part of every block's hash: the same tokens' K/V differ between formats.
        self.kv_manager = KVCacheManager(
            self.pool, config.block_size, self.layout.groups, extra_key=(self.kv_cache_dtype,)
        )
        isolating = IsolatingRunner(self.runner)
        self.speculative = build_speculative_runner(isolating, config, self.max_model_len, self.vocab_size, draft_model)
        self.step_runner: BatchRunner = self.speculative or isolating  # what step() runs each batch with
        self.scheduler = Scheduler(
            self.kv_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            eos_token_ids,
            self.max_model_len,
            plan_drafts=self.speculative.plan_drafts if self.speculative is not None else None,
            on_finish=self.speculative.forget if self.speculative is not None else None,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            # Bursts and speculation both make one step emit several tokens: a speculating engine does not burst.
            plan_burst=self.runner.plan_burst if self.speculative is None and self.runner.max_burst > 1 else None,
        )
        self._requests: dict[str, _EngineRequest] = {}
        self._seq_ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []

    def _derive_max_model_len(self) -> int:
        model_limit = self.model_config.max_position_embeddings
        asked = self.config.max_model_len
        if asked is None:
            return model_limit
        if asked > model_limit:
            learned_positions = registry.lookup(self.model_config.architecture).has_learned_positions
            if not self.layout.every_layer_slides or learned_positions:
                raise ValueError(
                    f"max_model_len {asked} exceeds the model's context of {model_limit} tokens "
                    "(only RoPE models with a sliding window can stream past it)"
                )
        return asked

    # ----------------------------------------------------------------- requests

    def _check_prompt_ids(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}", "prompt")

    def _check_length(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise PromptTooLongError(
                f"the prompt has {num_prompt_tokens} tokens; this model's maximum context length is {limit} tokens "
                "(the prompt must leave room for at least one generated token)",
                "prompt",
            )
        if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > limit:
            raise PromptTooLongError(
                f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) is "
                f"{num_prompt_tokens + params.max_tokens} tokens, more than this model's maximum context length "
                f"of {limit} tokens",
                "max_tokens",
            )
        longest = min(limit, num_prompt_tokens + (params.max_tokens or limit))
        # Every group's table covers the sequence; a sliding group's never holds more than its live window
        # (plus a prefill chunk).
        blocks = self.layout.max_blocks_per_seq(longest, self.config.block_size, self.config.max_num_batched_tokens)
        if blocks > self.pool.num_blocks - 1:
            raise PromptTooLongError(
                f"a sequence of {longest} tokens needs {blocks} KV blocks but the cache has only "
                f"{self.pool.num_blocks - 1}; lower max_tokens or raise the KV cache memory",
                "max_tokens",
            )

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        prompt_ids = list(prompt_token_ids)
        self._check_prompt_ids(prompt_ids)
        self._check_length(len(prompt_ids), params)
        if params.structured is not None and self.grammar is None:
            raise InvalidRequestError(
                "structured output needs the model's tokenizer; this engine has none", params.structured.param
            )
        if params.structured is not None:
            assert self.grammar is not None
            self.grammar.compile(params.structured)  # raises for a spec that does not compile, before any state
        now = time.monotonic()
        seqs: list[Sequence] = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.runner.device)
                generator.manual_seed(params.seed + index)
            seq = Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                index=index,
                prompt_token_ids=prompt_ids,
                params=params,
                arrival_time=now,
                generator=generator,
                parent=seqs[0] if seqs else None,
                matcher=self._matcher(params),
            )
            seqs.append(seq)
            self.scheduler.add(seq)
        self._requests[request_id] = _EngineRequest(request_id, prompt_ids, seqs, now)
        return request_id

    def _matcher(self, params: SamplingParams) -> Any:
        """A new sequence's grammar matcher (None: unconstrained); behind the thinking of a reasoning model."""
        if params.structured is None:
            return None
        matcher = self.grammar.matcher(params.structured)
        return matcher if params.thinking is None else ThinkingFirst(matcher, params.thinking)

    def abort(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, FINISH_ABORT)
        self._pending_outputs.append(self._request_output(request, request.seqs, num_new_tokens=0))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending_outputs)

    # --------------------------------------------------------------------- step

    def end_bursts_early(self, on: bool) -> None:
        """on: a greedy burst under way (or starting) ends after its current step; off: bursts run whole.

        The one method safe to call from another thread than the engine's (a server's event loop calls it while
        a step runs): it writes one flag that the burst kernel reads between its steps."""
        self.runner.burst_interrupt.value = int(on)

    def stop_sample(self, request_id: str, index: int, stop_reason: str) -> None:
        """Finish one sample that its text already ended (a stop string); no output is emitted for it."""
        request = self._requests.get(request_id)
        if request is None:
            return
        self.scheduler.finish(request.seqs[index], FINISH_STOP, stop_reason)
        if request.is_finished:
            del self._requests[request_id]

    def step(self) -> list[RequestOutput]:
        """Schedule a batch, run it, advance its sequences: this step's outputs, after the notices waiting."""
        batch = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        if not batch.is_empty:
            # Raises when no request explains a failure: nothing advanced, the waiting notices go out later.
            result = self.step_runner.execute(batch)
            outputs += self._fail_requests(result.failed)
            appended = self.scheduler.update(result.batch, result.sampled, result.prompt_logprobs)
            outputs += self._collect_outputs(appended)
        notices, self._pending_outputs = self._pending_outputs, []
        return notices + outputs

    def probe(self) -> None:
        """One greedy token of a one-token prompt, alone in its step; raises whatever the model raises.

        For an engine with no request in it (a failed step's requests were just aborted): a step
        that held one request cannot tell a request that fails on its own from a model that fails
        everything, and this can. It leaves no trace: its steps count into throwaway counters, the
        abort notices waiting to go out wait on, and its KV blocks go back.
        """
        if self._requests:
            raise RuntimeError("probe() needs an engine with no request in it")
        request_id = f"kvserve-probe-{uuid.uuid4().hex}"
        notices, self._pending_outputs = self._pending_outputs, []
        try:
            with self.scheduler.counting_into(StepCounters()):
                self.add_request([_PROBE_TOKEN_ID], SamplingParams(temperature=0.0, max_tokens=1), request_id)
                for _ in range(_PROBE_MAX_STEPS):
                    if request_id not in self._requests:
                        return
                    self.step()
                raise RuntimeError(f"the probe request did not finish within {_PROBE_MAX_STEPS} steps")
        finally:
            self.abort(request_id)
            self._pending_outputs = notices

    def _fail_requests(self, failed: dict[str, Exception]) -> list[RequestOutput]:
        """Finish every sample of each request whose computation raised on its own; their blocks go back."""
        outputs = []
        for request_id, error in failed.items():
            request = self._requests.pop(request_id, None)
            if request is None:
                continue
            logger.error("request %s failed on its own and was finished with an error: %r", request_id, error)
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, FINISH_ERROR)
            output = self._request_output(request, request.seqs, num_new_tokens=0)
            outputs.append(dataclasses.replace(output, error=f"internal error while generating: {error!r}"))
        return outputs

    def _collect_outputs(self, appended: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        by_request: dict[str, list[tuple[Sequence, int]]] = {}
        for seq, count in appended:
            by_request.setdefault(seq.request_id, []).append((seq, count))
        outputs = []
        for request_id, seqs in by_request.items():
            request = self._requests.get(request_id)
            if request is None:
                continue
            outputs.append(self._request_output(request, [s for s, _ in seqs], num_new_tokens=[n for _, n in seqs]))
            if request.is_finished:
                del self._requests[request_id]
        return outputs

    def _request_output(
        self, request: _EngineRequest, seqs: list[Sequence], num_new_tokens: int | list[int]
    ) -> RequestOutput:
        """Each sample's newest `num_new_tokens` token ids (per sample, or one count for all; text is
        filled in on the async side)."""
        completions = []
        counts = num_new_tokens if isinstance(num_new_tokens, list) else [num_new_tokens] * len(seqs)
        for seq, num_new_tokens in zip(seqs, counts, strict=True):
            new_ids = seq.token_ids[len(seq.token_ids) - num_new_tokens :] if num_new_tokens else []
            new_logprobs = None
            if seq.params.logprobs is not None:
                new_logprobs = seq.logprobs[len(seq.logprobs) - num_new_tokens :] if num_new_tokens else []
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text="",
                    token_ids=new_ids,
                    logprobs=new_logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    num_generated_tokens=seq.num_generated_tokens,
                )
            )
        scheduled = [s.first_scheduled_time for s in request.seqs if s.first_scheduled_time is not None]
        return RequestOutput(
            request_id=request.request_id,
            outputs=completions,
            prompt_token_ids=request.prompt_token_ids,
            finished=request.is_finished,
            arrival_time=request.arrival_time,
            first_scheduled_time=min(scheduled) if scheduled else None,
            prompt_logprobs=request.take_prompt_logprobs(),
        )

    # -------------------------------------------------------------------- misc

    def kv_snapshot(self) -> KVCacheSnapshot:
        """The block pool and the running sequences' block tables, as of now (call it between steps)."""
        return take_snapshot(
            self.pool,
            self.scheduler.running,
            len(self.scheduler.waiting),
            self.config.block_size,
            self.sliding_window,
            self.num_sink_tokens,
            self.layout.groups,
        )

    def attention_weights(
        self,
        token_ids: list[int],
        sliding_window: int | None,
        num_sink_tokens: int,
        layer_windows: tuple[int | None, ...] | None = None,
    ) -> AttentionWeights:
        """Every layer's and head's attention weights over token_ids, by the reference path
        (engine/attention/probe.py) on this engine's model; the serving cache is not used. Every layer
        attends under sliding_window, or each under its own (layer_windows, one per layer)."""
        self._check_prompt_ids(token_ids)
        if len(token_ids) > self.max_model_len:
            limit = self.max_model_len
            raise PromptTooLongError(f"the prompt has {len(token_ids)} tokens; this model's limit is {limit}", "prompt")
        runner = self.runner
        return attention_weights(
            runner.model,
            token_ids,
            num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim,
            num_layers=self.model_config.num_layers,
            block_size=self.config.block_size,
            dtype=runner.dtype,
            device=runner.device,
            kv_cache_dtype=self.kv_cache_dtype,
            sliding_window=sliding_window,
            num_sink_tokens=num_sink_tokens if sliding_window is not None or layer_windows else 0,
            layer_windows=layer_windows,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_used_blocks=self.pool.num_used_blocks,
            num_total_blocks=self.pool.num_blocks - 1,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_bytes_per_token=self.kv_bytes_per_token,
            **dataclasses.asdict(self.scheduler.counters),
            **(self.speculative.stats_fields() if self.speculative is not None else {}),
        )
