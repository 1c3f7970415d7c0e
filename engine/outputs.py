"""What the engine hands back each step: plain dataclasses, deltas only."""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"  # computing the request raised; RequestOutput.error says what


@dataclass
class TokenLogprob:
    """Logprob of one token and its `top` alternatives (token_id, logprob), best first.

    rank: 1 + how many tokens the model found likelier (set for prompt tokens, None for sampled ones).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass
class EmittedTokens:
    """What one sequence that sampled appends in a step: one token, or accepted drafts and the token after them."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # one per token id (None entries when the request asked for none)
    num_accepted_drafts: int = 0


@dataclass
class CompletionOutput:
    """The new part of one sample (index among the request's n) since the last step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    num_generated_tokens: int = 0  # total so far, including this delta

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One step's news for one request: only the samples that changed."""

    request_id: str
    outputs: list[CompletionOutput]
    prompt_token_ids: list[int]
    finished: bool  # every sample of the request has finished
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None  # time.monotonic() when first scheduled
    # Set when the engine finished the request because computing it raised (the other
    # requests of that step went on); the request is over and `finished` is True.
    error: str | None = None
    # When the request asked for prompt logprobs: one per prompt token, None for the first; sent
    # once, with the first output after the whole prompt is computed.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class GenerationResult:
    """A whole finished sample, as returned by LLM.generate() (engine/llm.py)."""

    request_id: str
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EngineStats:
    """A snapshot of engine counters for /metrics.

    Prompt tokens are counted three ways. num_prompt_tokens: every prompt token of every request,
    once, when its prompt is first fully computed (its first sampled token), cached tokens
    included; a request's n samples share one prompt, a recomputed (preempted) prompt is not
    counted again. num_cached_prompt_tokens: of those, the ones its first scheduling found in the
    prefix cache. num_computed_prompt_tokens: prompt tokens the model actually computed, each
    recomputation included; it grows with every step that prefills (the step loop's progress check).
    """

    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_prompt_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    # Greedy bursts (engine/models/greedy_burst.py): native calls of several decode steps, and the tokens
    # appended from them (part of num_generation_tokens).
    num_greedy_bursts: int = 0
    num_greedy_burst_tokens: int = 0
    # Speculative decoding (all 0 when it is off): verifications, tokens proposed and verified, of
    # those accepted, and per draft position j the verifications whose token j+1 was accepted.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # The KV cache's format (a KV_CACHE_DTYPES name, auto resolved) and one token's bytes in it over every layer.
    kv_cache_dtype: str = "float32"
    kv_bytes_per_token: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks if self.num_total_blocks else 0.0
