"""Per-request parameters, validated once at construction.

Invalid values raise `InvalidRequestError` naming the field, so the HTTP layer
can answer 400 without knowing the rules itself. The bounds below are the same
ones the server's request models apply at the edge (server/protocol/common.py);
they are checked here too because the engine is also used offline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutput
from engine.structured.thinking import ThinkingSpan

MAX_TOP_LOGPROBS = 20
MAX_SAMPLES = 128  # n
# Token counts (max_tokens, min_tokens, top_k) and token ids: anything larger is no real request, and
# every value up to here fits the int64 tensors the sampler builds from them.
MAX_COUNT = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
# Sample i of a request seeds its generator with seed + i, which must fit torch's unsigned 64-bit seed.
MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PENALTY = 2.0  # presence_penalty, frequency_penalty
MAX_ABS_LOGIT_BIAS = 100.0
MAX_CACHE_SALT_CHARS = 256


def _require(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise InvalidRequestError(f"{param}: {message}", param=param)


def _is_int(value: object) -> bool:
    """An integer that is not a bool (True is no token id, count or seed)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(value: object, param: str, low: int, high: int) -> None:
    _require(_is_int(value), param, f"must be an integer, got {value!r}")
    _require(low <= value <= high, param, f"must be in [{low}, {high}], got {value}")


def _require_number(value: object, param: str, low: float, high: float, low_open: bool = False) -> None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    _require(is_number and math.isfinite(value), param, f"must be a finite number, got {value!r}")
    in_range = (low < value if low_open else low <= value) and value <= high
    _require(in_range, param, f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples its continuation(s).

    `max_tokens=None` means "until max_model_len". `top_k <= 0` disables top-k.
    `logprobs=None` returns no logprobs; `logprobs=k` returns the sampled token's
    logprob plus the k most likely alternatives (k may be 0).
    `prompt_logprobs=k`: the same for every prompt token after the first (the first has no
    context to be scored in), under the raw model distribution; computed during prefill.
    `cache_salt`: requests with different salts never share a prefix-cache block; requests
    with the same salt, or none, share as usual (tenant isolation).
    `structured`: what the output must match (a JSON schema, regex, choice or grammar), enforced
    token by token; the sequence ends when the grammar is complete.
    `thinking`: a reasoning model's thinking tokens, which `structured` leaves free: the grammar starts
    after the thinking's end token (engine/structured/thinking.py).
    `speculative`: False opts this request out of the engine's speculative decoding (it changes
    no token: greedy and seeded output are identical, unseeded sampling has the same distribution).
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
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    structured: StructuredOutput | None = None
    thinking: ThinkingSpan | None = None
    speculative: bool = True

    def __post_init__(self) -> None:
        # Accept lists / a single string for convenience; store tuples (frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        for token_id in self.stop_token_ids:
            _require_int(token_id, "stop_token_ids", 0, MAX_COUNT)
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                _require_int(token_id, "logit_bias", 0, MAX_COUNT)
                _require_number(bias, "logit_bias", -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)
            object.__setattr__(self, "logit_bias", {k: float(v) for k, v in self.logit_bias.items()})

        _require_int(self.n, "n", 1, MAX_SAMPLES)
        if self.max_tokens is not None:
            _require_int(self.max_tokens, "max_tokens", 1, MAX_COUNT)
        _require_int(self.min_tokens, "min_tokens", 0, MAX_COUNT)
        if self.max_tokens is not None:
            _require(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        _require_number(self.temperature, "temperature", 0.0, MAX_TEMPERATURE)
        _require_number(self.top_p, "top_p", 0.0, 1.0, low_open=True)
        # -1 and 0 disable top-k; the sampler treats any k over the vocabulary as the whole vocabulary.
        _require_int(self.top_k, "top_k", -1, MAX_COUNT)
        _require_number(self.min_p, "min_p", 0.0, 1.0)
        _require_number(self.repetition_penalty, "repetition_penalty", 0.0, MAX_REPETITION_PENALTY, low_open=True)
        _require_number(self.presence_penalty, "presence_penalty", -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        _require_number(self.frequency_penalty, "frequency_penalty", -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        _require(all(isinstance(s, str) for s in self.stop), "stop", "stop strings must be strings")
        _require(all(len(s) > 0 for s in self.stop), "stop", "stop strings must be non-empty")
        _require(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
        )
        longest = max((len(s) for s in self.stop), default=0)
        _require(
            longest <= MAX_STOP_STRING_CHARS,
            "stop",
            f"each stop string has at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}",
        )
        if self.logprobs is not None:
            _require_int(self.logprobs, "logprobs", 0, MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _require_int(self.prompt_logprobs, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
        if self.seed is not None:
            _require_int(self.seed, "seed", 0, MAX_SEED)
        _require(isinstance(self.speculative, bool), "speculative", f"must be a boolean, got {self.speculative!r}")
        if self.cache_salt is not None:
            _require(
                isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS,
                "cache_salt",
                f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            )

    @property
    def is_greedy(self) -> bool:
        # Below this, logits / temperature overflows float32; the argmax is what it means anyway.
        return self.temperature < 1e-5
