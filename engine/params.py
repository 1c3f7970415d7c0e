"""Per-request parameters, validated once at construction.

Invalid values raise `InvalidRequestError` naming the field, so the HTTP layer
can answer 400 without knowing the rules itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


def _require(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise InvalidRequestError(f"{param}: {message}", param=param)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples its continuation(s).

    `max_tokens=None` means "until max_model_len". `top_k <= 0` disables top-k.
    `logprobs=None` returns no logprobs; `logprobs=k` returns the sampled token's
    logprob plus the k most likely alternatives (k may be 0).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept lists / a single string for convenience; store tuples (frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})

        _require(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _require(self.n <= 128, "n", f"must be at most 128, got {self.n}")
        if self.max_tokens is not None:
            _require(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _require(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None:
            _require(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        _require(0.0 <= self.temperature <= 100.0, "temperature", f"must be in [0, 100], got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= -1, "top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        _require(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _require(
            0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            f"must be in (0, 10], got {self.repetition_penalty}",
        )
        _require(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _require(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        for token_id, bias in (self.logit_bias or {}).items():
            _require(token_id >= 0, "logit_bias", f"token id must be non-negative, got {token_id}")
            _require(-100.0 <= bias <= 100.0, "logit_bias", f"bias must be in [-100, 100], got {bias}")
        _require(all(len(s) > 0 for s in self.stop), "stop", "stop strings must be non-empty")
        _require(len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}")
        _require(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "token ids must be non-negative")
        if self.logprobs is not None:
            _require(
                0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}",
            )
        if self.seed is not None:
            _require(0 <= self.seed < 2**63, "seed", f"must be in [0, 2^63), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        # Below this, logits / temperature overflows float32; the argmax is what it means anyway.
        return self.temperature < 1e-5
