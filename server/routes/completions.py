"""POST /v1/completions: prompts (text or token ids, one or many) x n samples, JSON or SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server import serving
from server.http.access import request_cache_salt
from server.http.json_body import StrictJSONRoute
from server.http.openapi import generation_responses
from server.openai.logprobs import completion_logprobs, echo_logprobs, joined, prompt_logprobs_entries
from server.openai.params import (
    check_admissible,
    check_before_load,
    max_tokens_for,
    reject_unsupported,
    sampling_params,
)
from server.openai.prompts import completion_prompts, echoed_prompts
from server.openai.served_models import generation_model
from server.openai.structured import compile_structured, structured_output
from server.openai.text import RequestText, has_text, text_size
from server.protocol.common import PromptLogprobs
from server.protocol.completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from server.serving import Generation
from server.state import SharedState

router = APIRouter(route_class=StrictJSONRoute)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's, when neither the request nor --default-max-tokens sets one


@router.post("/v1/completions", response_model=CompletionResponse, responses=generation_responses(CompletionResponse))
@serving.abandoned_when_client_leaves
async def create_completion(body: CompletionRequest, request: Request, state: SharedState) -> Response:
    reject_unsupported(body.unsupported_fields())
    structured = structured_output(body)
    # echo with logprobs scores the echoed prompt too (what lm-evaluation-harness's loglikelihood reads)
    echo_logprobs_top = body.logprobs if body.echo else None
    max_tokens = max_tokens_for(body.max_tokens, state.config, COMPLETIONS_DEFAULT_MAX_TOKENS)
    cache_salt = request_cache_salt(request, body.cache_salt)
    check_before_load(body, max_tokens, body.logprobs, cache_salt, echo_logprobs_top)
    served = await generation_model(state, body.model)
    engine, text = served.engine, served.text
    engine.check_admission()  # a full queue answers 429 before any prompt is tokenized
    params = sampling_params(
        body, max_tokens, body.logprobs, engine.vocab_size, cache_salt, structured, prompt_logprobs=echo_logprobs_top
    )
    await compile_structured(text, engine, structured)
    if has_text(body.prompt):
        prompts = await text.run(text_size(body.prompt), completion_prompts, body, engine.vocab_size, state.config)
    else:  # token ids need no tokenizer: they do not queue for the text worker
        prompts = completion_prompts(None, body, engine.vocab_size, state.config)
    check_admissible(
        state.config,
        [len(ids) for _, ids in prompts],
        params,
        engine.max_model_len,
        engine.kv_cache_tokens,
        listed_prompt_tops=(body.prompt_logprobs, echo_logprobs_top),
        prompt_listed_per_choice=True,
    )
    if body.echo:
        echoes = await text.run(sum(len(ids) for _, ids in prompts), echoed_prompts, prompts)
    else:
        echoes = [""] * len(prompts)
    tokenizer = engine.tokenizer  # the event loop's: logprob token texts, a few per step
    answer_id = serving.response_id(request, "cmpl")
    model_name = served.name
    prompt_ids = [ids for _, ids in prompts]
    timer = state.metrics.start_request(served.name)

    if body.stream:

        def usage_chunk(usage) -> dict:
            return CompletionResponse(id=answer_id, model=model_name, choices=[], usage=usage).model_dump()

        def chunks(generation: Generation) -> AsyncIterator[dict]:
            return _chunks(generation, body, echoes, prompt_ids, text, answer_id, model_name, tokenizer)

        return await serving.generation_stream(
            engine, prompt_ids, params, timer, chunks, usage_chunk, body.stream_options
        )

    async def answer(generation: Generation) -> dict:
        choices = []
        samples = await generation.samples()
        scores = [await _prompt_scores(text, generation, i, prompt_ids[i], body) for i in range(len(prompt_ids))]
        for index, sample in enumerate(samples):
            prompt_index = index // params.n
            echo = echoes[prompt_index]
            echoed_logprobs, prompt_logprobs = scores[prompt_index]
            logprobs = None
            if params.logprobs is not None:
                # Many tokens' texts: made on the text worker, off the event loop.
                logprobs = await text.run(len(sample.logprobs), completion_logprobs, sample.logprobs, len(echo))
                if echoed_logprobs is not None:
                    logprobs = joined(echoed_logprobs, logprobs)
            choices.append(
                CompletionChoice(
                    index=index,
                    text=echo + sample.text,
                    logprobs=logprobs,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        usage = generation.usage()
        return CompletionResponse(id=answer_id, model=model_name, choices=choices, usage=usage).model_dump()

    return await serving.generation_json(engine, prompt_ids, params, timer, answer)


async def _prompt_scores(
    text: RequestText, generation: Generation, prompt_index: int, prompt_ids: list[int], body: CompletionRequest
) -> tuple[CompletionLogprobs | None, PromptLogprobs | None]:
    """A prompt's echoed logprobs (echo with logprobs) and vLLM's prompt_logprobs entries (when asked);
    token texts for a long prompt are many, so they are made on the text worker."""
    scored = generation.prompt_logprobs(prompt_index)
    if scored is None:
        return None, None

    def build(tokenizer: Any) -> tuple[CompletionLogprobs | None, PromptLogprobs | None]:
        echoed = None
        if body.echo and body.logprobs is not None:
            echoed = echo_logprobs(tokenizer, prompt_ids, scored, body.logprobs)
        entries = None
        if body.prompt_logprobs is not None:
            entries = prompt_logprobs_entries(tokenizer, scored, body.prompt_logprobs)
        return echoed, entries

    return await text.run(len(prompt_ids), build)


async def _chunks(
    generation: Generation,
    body: CompletionRequest,
    echoes: list[str],
    prompt_ids: list[list[int]],
    text: RequestText,
    answer_id: str,
    model_name: str,
    tokenizer: Any,
) -> AsyncIterator[dict]:
    wants_logprobs = body.logprobs is not None
    offsets: dict[int, int] = {}  # choice index -> where its next token starts in its text
    # With logprobs, a prompt's echo waits for its first output, which brings the prompt's scores.
    echo_waits_for_scores = body.echo and wants_logprobs
    echoed: set[int] = set()  # prompts whose echo went out

    def chunk(choices: list[CompletionChoice]) -> dict:
        return CompletionResponse(id=answer_id, model=model_name, choices=choices).model_dump()

    if body.echo and not echo_waits_for_scores:
        for index in range(generation.num_choices):
            yield chunk([CompletionChoice(index=index, text=echoes[index // body.n])])
    async for prompt_index, output in generation.outputs():
        if echo_waits_for_scores and prompt_index not in echoed:
            echoed.add(prompt_index)
            scores, _ = await _prompt_scores(text, generation, prompt_index, prompt_ids[prompt_index], body)
            for sample in range(body.n):
                yield chunk(
                    [CompletionChoice(index=prompt_index * body.n + sample, text=echoes[prompt_index], logprobs=scores)]
                )
        for delta in output.outputs:
            if not delta.text and delta.finish_reason is None and not (wants_logprobs and delta.logprobs):
                continue
            index = generation.choice_index(prompt_index, delta)
            logprobs = None
            if wants_logprobs:
                offset = offsets.get(index, len(echoes[prompt_index]))
                logprobs = completion_logprobs(tokenizer, delta.logprobs or [], offset)
                offsets[index] = offset + sum(len(t) for t in logprobs.tokens)
            yield chunk(
                [
                    CompletionChoice(
                        index=index,
                        text=delta.text,
                        logprobs=logprobs,
                        finish_reason=delta.finish_reason,
                        stop_reason=delta.stop_reason,
                    )
                ]
            )
