"""Every numeric request field is bounded, at the HTTP edge (server/protocol) and in the engine's
SamplingParams (the engine is used offline too): a bad value is refused naming its field."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from engine.errors import InvalidRequestError
from engine.params import MAX_COUNT, MAX_SAMPLES, MAX_SEED, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from server.protocol.chat import ChatCompletionRequest
from server.protocol.completions import CompletionRequest
from server.protocol.embeddings import EmbeddingRequest, EmbedRequest
from server.protocol.tokenize import DetokenizeRequest

HUGE = 10**30

BAD_ENGINE_PARAMS = [
    ({"top_k": HUGE}, "top_k"),
    ({"top_k": MAX_COUNT + 1}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": MAX_SAMPLES + 1}, "n"),
    ({"n": True}, "n"),
    ({"n": 2.0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": HUGE}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": HUGE, "max_tokens": None}, "min_tokens"),
    ({"seed": -1}, "seed"),
    ({"seed": MAX_SEED + 1}, "seed"),
    ({"seed": True}, "seed"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": math.inf}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logit_bias": {True: 1.0}}, "logit_bias"),
    ({"logit_bias": {HUGE: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"logit_bias": {5: math.nan}}, "logit_bias"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [HUGE]}, "stop_token_ids"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
    ({"stop": [5]}, "stop"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_ENGINE_PARAMS, ids=[str(f) for f, _ in BAD_ENGINE_PARAMS])
def test_sampling_params_refuse_out_of_range_values_naming_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**fields)
    assert info.value.param == param
    assert info.value.message.startswith(f"{param}: ")


def test_sampling_params_accept_the_bounds_themselves():
    params = SamplingParams(
        n=MAX_SAMPLES,
        max_tokens=MAX_COUNT,
        min_tokens=MAX_COUNT,
        top_k=MAX_COUNT,
        seed=MAX_SEED,
        temperature=100,
        top_p=1,
        presence_penalty=-2,
        logit_bias={MAX_COUNT: -100},
        stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        logprobs=20,
    )
    assert params.logit_bias == {MAX_COUNT: -100.0}
    assert SamplingParams(top_k=-1).top_k == -1


def test_the_largest_accepted_values_sample_without_error():
    """The bounds are safe all the way down: sample i seeds its generator with seed + i
    (engine/engine_core.py), and a top_k past the vocabulary keeps every token."""
    from engine.runner.sampler import SamplingRow, sample

    largest = SamplingParams(
        top_k=MAX_COUNT, seed=MAX_SEED, temperature=100, repetition_penalty=10, presence_penalty=2, logit_bias={3: 100}
    )
    generator = torch.Generator().manual_seed(MAX_SEED + MAX_SAMPLES - 1)
    rows = [
        SamplingRow(largest, [1, 2, 3], 2, eos_token_ids=(0,), generator=generator),
        SamplingRow(SamplingParams(top_k=MAX_COUNT), [1, 2, 3], 2, eos_token_ids=(0,), generator=None),
    ]
    token_ids = sample(torch.randn(2, 50), rows).token_ids
    assert len(token_ids) == 2 and all(0 <= t < 50 for t in token_ids)


def _refused(model, body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    errors = info.value.errors()
    assert len(errors) == 1, errors
    return ".".join(str(part) for part in errors[0]["loc"])


COMPLETION = {"prompt": "Hi"}
BAD_COMPLETIONS = [
    ({"top_k": HUGE}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"n": MAX_SAMPLES + 1}, "n"),
    ({"n": True}, "n"),
    ({"max_tokens": HUGE}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"min_tokens": HUGE}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -1}, "seed"),
    ({"temperature": 101}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": math.inf}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"5": True}}, "logit_bias.5"),
    ({"stop_token_ids": [True]}, "stop_token_ids.0"),
    ({"stop_token_ids": [HUGE]}, "stop_token_ids.0"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
    ({"stop": ["ok", "x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
    ({"best_of": 0}, "best_of"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [[1], [True]]}, "prompt"),
    ({"prompt": [1.0]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
]


@pytest.mark.parametrize(("fields", "loc"), BAD_COMPLETIONS, ids=[str(f)[:60] for f, _ in BAD_COMPLETIONS])
def test_completion_request_bounds_every_number(fields, loc):
    assert _refused(CompletionRequest, {**COMPLETION, **fields}) == loc


def test_prompt_and_stop_errors_name_the_field_once_and_say_what_fits():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": [True], "stop": ["x"] * 17})
    errors = {error["loc"]: error["msg"] for error in info.value.errors()}
    assert set(errors) == {("prompt",), ("stop",)}
    assert "token id" in errors[("prompt",)] and "non-negative integer" in errors[("prompt",)]
    assert f"at most {MAX_STOP_STRINGS} strings" in errors[("stop",)]
    assert f"{MAX_STOP_STRING_CHARS} characters" in errors[("stop",)]


def test_completion_request_accepts_the_bounds_and_the_usual_spellings():
    body = CompletionRequest.model_validate(
        {
            "prompt": [[1, 2], [3]],
            "top_k": -1,
            "n": MAX_SAMPLES,
            "max_tokens": MAX_COUNT,
            "seed": MAX_SEED,
            "temperature": 0,  # an integer is a fine number
            "stop": ["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
            "logprobs": 20,
            "logit_bias": {"5": -100},
        }
    )
    assert body.temperature == 0.0 and body.top_k == -1
    assert CompletionRequest.model_validate({"prompt": "Hi", "stop": ""}).stop == ""


CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
BAD_CHATS = [
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"max_completion_tokens": HUGE}, "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": HUGE}, "top_k"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"tool_choice": 5}, "tool_choice"),
    ({"function_call": [1]}, "function_call"),
]


@pytest.mark.parametrize(("fields", "loc"), BAD_CHATS, ids=[str(f)[:60] for f, _ in BAD_CHATS])
def test_chat_request_bounds_every_number(fields, loc):
    assert _refused(ChatCompletionRequest, {**CHAT, **fields}) == loc


@pytest.mark.parametrize("model", [EmbeddingRequest, EmbedRequest])
def test_embedding_requests_refuse_bools_as_token_ids_and_bound_dimensions(model):
    field = "input" if model is EmbeddingRequest else "inputs"
    assert _refused(model, {field: [True, 2]}) == field
    assert _refused(model, {field: [[1, 2], [False]]}) == field
    assert _refused(model, {field: "x", "dimensions": HUGE}) == "dimensions"
    assert _refused(model, {field: "x", "dimensions": 0}) == "dimensions"
    assert _refused(model, {field: "x", "dimensions": True}) == "dimensions"
    assert getattr(model.model_validate({field: [1, 2]}), field) == [1, 2]


def test_detokenize_refuses_bools_as_token_ids():
    assert _refused(DetokenizeRequest, {"tokens": [1, True]}) == "tokens.1"
    assert DetokenizeRequest.model_validate({"tokens": [1, 2]}).tokens == [1, 2]
