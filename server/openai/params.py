"""Request fields -> engine parameters, and the checks every route applies to them.

Bad values raise InvalidRequestError (400, naming the field) or APIError (413 for a batch
over --max-client-batch-size, 400 for a field kvserve does not implement, 400 `request_too_large`
for a request that could never be admitted or is over --max-request-cost).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from engine import StructuredOutput, ThinkingSpan
from engine.errors import InvalidRequestError
from engine.params import SamplingParams
from server.config import ServerConfig
from server.errors import APIError
from server.protocol.common import SamplingFields

_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,10}", re.ASCII)


def check_batch_size(config: ServerConfig, num_items: int, param: str) -> None:
    """413 naming --max-client-batch-size when a request carries more items than it allows."""
    limit = config.max_client_batch_size
    if num_items > limit:
        raise APIError(
            413,
            f"{param} has {num_items} items, more than this server's limit of {limit} "
            f"(--max-client-batch-size); split it into several requests",
            param=param,
            code="batch_too_large",
        )


DEFAULT_COST_CONTEXTS = 8


def check_admissible(
    config: ServerConfig,
    prompt_lengths: list[int],
    params: SamplingParams,
    max_model_len: int,
    kv_cache_tokens: int,
    listed_prompt_tops: Sequence[int | None] = (),
    prompt_listed_per_choice: bool = False,
) -> None:
    """400 for a generation request that could never be served fairly, before anything is queued.

    Each prompt is one queued request, so more prompts than --max-queued-requests could never be
    admitted (a 429 would invite retries that cannot succeed). The request's cost is the tokens
    its samples may hold: the sum over its prompts of n x (prompt tokens + max_tokens), each
    sample capped at the context length (max_tokens unset: the whole context). Above
    --max-request-cost the request would hold the engine long enough to starve everyone else. Its
    default is what the KV cache holds (`kv_cache_tokens`), but at least DEFAULT_COST_CONTEXTS full
    contexts: a few samples without max_tokens must always be admissible.

    Logprobs are priced on their own (`logprob_entries`), against --max-request-logprobs:
    `listed_prompt_tops` holds the top-k of each listing of the prompt's tokens the answer carries
    (completions: prompt_logprobs, and echo's logprobs; None entries list nothing), repeated in
    every choice when `prompt_listed_per_choice`.
    """
    num_prompts = len(prompt_lengths)
    if num_prompts > config.max_queued_requests:
        raise APIError(
            400,
            f"prompt has {num_prompts} prompts, more than this server queues at once "
            f"({config.max_queued_requests}, --max-queued-requests), so it could never be admitted; "
            "split it into several requests",
            param="prompt",
            code="request_too_large",
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
    cost = sum(params.n * min(max_model_len, length + max_tokens) for length in prompt_lengths)
    limit = config.max_request_cost
    if limit is None:
        limit = max(kv_cache_tokens, DEFAULT_COST_CONTEXTS * max_model_len)
    if cost > limit:
        raise APIError(
            400,
            f"this request may hold {cost} tokens (prompts x n x (prompt tokens + max_tokens)), more than "
            f"this server's limit of {limit} (--max-request-cost); lower n or max_tokens, "
            "or split it into several requests",
            param="max_tokens" if params.max_tokens is not None else "n",
            code="request_too_large",
        )
    entries = logprob_entries(prompt_lengths, params, max_model_len, listed_prompt_tops, prompt_listed_per_choice)
    if entries > config.max_request_logprobs:
        raise APIError(
            400,
            f"this request may return {entries} logprob entries (each listed token and alternative, over every "
            f"prompt token it lists and every token it may generate, in every choice), more than this server's "
            f"limit of {config.max_request_logprobs} (--max-request-logprobs); ask for fewer top logprobs, "
            "lower n or max_tokens, or split it into several requests",
            param="logprobs" if params.logprobs is not None else "prompt_logprobs",
            code="request_too_large",
        )


def logprob_entries(
    prompt_lengths: Sequence[int],
    params: SamplingParams,
    max_model_len: int,
    listed_prompt_tops: Sequence[int | None] = (),
    prompt_listed_per_choice: bool = False,
) -> int:
    """The logprob entries (a token with its logprob, or one alternative) a request may return.

    Each generated token lists itself and `logprobs` alternatives, in each of n samples, for up to
    max_tokens tokens (unset: the rest of the context). Each listing of the prompt names every
    prompt token with its top-k; vLLM's prompt_logprobs also the token itself, so k + 1 each. The
    prompt's own scoring (the engine reduces a [vocab] row per prompt token) is counted by the same
    rows, so one number bounds the engine's work, the answer's objects and its bytes.
    """
    repeat = params.n if prompt_listed_per_choice else 1
    total = 0
    for length in prompt_lengths:
        room = max(0, max_model_len - length)
        generated = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.logprobs is not None:
            total += params.n * generated * (params.logprobs + 1)
        for top in listed_prompt_tops:
            if top is not None:
                total += repeat * length * (top + 1)
    return total


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            message = f"{param}: token id {token_id} is outside the vocabulary [0, {vocab_size})"
            raise InvalidRequestError(message, param)


def reject_unsupported(fields: list[str]) -> None:
    """400 naming the OpenAI fields a request set that kvserve does not implement."""
    if fields:
        raise APIError(
            400,
            f"unsupported field(s) for this server: {', '.join(fields)}",
            param=fields[0],
            code="unsupported_field",
        )


def max_tokens_for(asked: int | None, config: ServerConfig, route_default: int | None = None) -> int | None:
    """A generation request's max_tokens: what it asked, else --default-max-tokens, else the route's own
    default (None: up to the context limit, as chat and responses run without one)."""
    if asked is not None:
        return asked
    return config.default_max_tokens if config.default_max_tokens is not None else route_default


def check_before_load(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    cache_salt: str | None = None,
    prompt_logprobs: int | None = None,
) -> None:
    """400 for what a generation request gets wrong on its body alone (its sampling fields, their ranges and
    combinations), checked before its model is acquired: a request that cannot be served neither loads a
    model that is not loaded nor waits for one. What needs the model (token ids against its vocabulary, the
    prompt against its context) is checked once it is there."""
    sampling_params(body, max_tokens, logprobs, None, cache_salt, prompt_logprobs=prompt_logprobs)


def sampling_params(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    vocab_size: int | None,
    cache_salt: str | None = None,
    structured: StructuredOutput | None = None,
    prompt_logprobs: int | None = None,
    thinking: ThinkingSpan | None = None,
) -> SamplingParams:
    """The engine's SamplingParams for a completion or chat request (SamplingParams checks the ranges).

    prompt_logprobs: top alternatives wanted per prompt token, beside the request's own
    `prompt_logprobs` field (the larger wins; completions' echo asks through this). thinking: a reasoning
    model's thinking, which `structured` leaves free (kept only where there is a structured output).
    vocab_size None: logit_bias's token ids are not held to a vocabulary (check_before_load)."""
    logit_bias = None
    if body.logit_bias:
        logit_bias = {}
        for key, bias in body.logit_bias.items():
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise InvalidRequestError(f"logit_bias: keys must be token ids, got {key[:32]!r}", "logit_bias")
            logit_bias[int(key)] = bias
        if vocab_size is not None:
            check_token_ids(list(logit_bias), vocab_size, "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options: only allowed when stream is true", "stream_options")
    if body.prompt_logprobs is not None and body.stream:
        raise InvalidRequestError(
            "prompt_logprobs: not available on streams (a streamed completion with echo and logprobs has them)",
            "prompt_logprobs",
        )
    asked = [k for k in (body.prompt_logprobs, prompt_logprobs) if k is not None]
    return SamplingParams(
        n=body.n,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=logit_bias,
        seed=body.seed,
        stop=body.stop or (),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=max(asked) if asked else None,
        skip_special_tokens=body.skip_special_tokens,
        cache_salt=cache_salt,
        structured=structured,
        thinking=thinking if structured is not None else None,
        speculative=body.speculative,
    )
