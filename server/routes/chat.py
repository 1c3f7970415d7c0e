"""POST /v1/chat/completions: messages through the chat template, n samples, JSON or SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine import CompletionOutput
from engine.errors import InvalidRequestError
from engine.outputs import FINISH_LENGTH
from server import serving
from server.errors import APIError
from server.http.access import request_cache_salt
from server.http.json_body import StrictJSONRoute
from server.http.openapi import generation_responses
from server.openai.logprobs import chat_logprobs, prompt_logprobs_entries
from server.openai.params import (
    check_admissible,
    check_before_load,
    max_tokens_for,
    reject_unsupported,
    sampling_params,
)
from server.openai.prompts import chat_prompt_ids
from server.openai.reasoning import ReasoningPlan, check_template_kwargs, template_kwargs
from server.openai.served_models import generation_model
from server.openai.structured import compile_structured, structured_output
from server.openai.text import text_size
from server.openai.tool_stream import ToolReplyStream
from server.openai.tools import ToolPlan, plan_tools
from server.protocol.chat import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
)
from server.protocol.common import CompletionTokensDetails, Usage
from server.serving import Generation
from server.state import SharedState

router = APIRouter(route_class=StrictJSONRoute)

NOT_STORED = "store: this server stores no completions; send store false or leave it out"


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses=generation_responses(ChatCompletionChunk),
)
@serving.abandoned_when_client_leaves
async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: SharedState) -> Response:
    reject_unsupported(body.unsupported_fields())
    if body.store:
        raise APIError(400, NOT_STORED, param="store", code="unsupported_field")
    check_template_kwargs(body.chat_template_kwargs)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs: requires logprobs to be true", "top_logprobs")
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = max_tokens_for(asked, state.config)
    num_top = body.top_logprobs or 0
    logprobs = num_top if body.logprobs else None
    structured = structured_output(body, body.response_format)  # plan_tools refuses response_format with tools
    # prompt_cache_key (OpenAI's) keeps its requests' cached prefixes apart as cache_salt (vLLM's) does.
    cache_salt = request_cache_salt(request, body.cache_salt or body.prompt_cache_key)
    check_before_load(body, max_tokens, logprobs, cache_salt)
    served = await generation_model(state, body.model)
    engine = served.engine
    engine.check_admission()  # a full queue answers 429 before the messages are rendered
    tools = plan_tools(body, engine.tokenizer.tool_call_format)
    kwargs = template_kwargs(
        state.config.default_chat_template_kwargs,
        body.chat_template_kwargs,
        body.reasoning_effort,
        engine.tokenizer.chat_template,
    )
    prompt_ids = await served.text.run(
        text_size(body.messages),
        chat_prompt_ids,
        body.messages,
        body.add_generation_prompt,
        tools,
        state.config.allow_special_tokens_in_content,
        kwargs,
    )
    reasoning = ReasoningPlan(served.reasoning, prompt_ids) if served.reasoning is not None else None
    tokenizer = engine.tokenizer  # the event loop's: logprob token texts, a few per step
    if tools is not None:
        if structured is not None:
            raise InvalidRequestError("tools: cannot be combined with structured_outputs or guided_*", "tools")
        structured = tools.spec
    thinking = reasoning.span if reasoning is not None else None
    params = sampling_params(body, max_tokens, logprobs, engine.vocab_size, cache_salt, structured, thinking=thinking)
    await compile_structured(served.text, engine, structured)
    check_admissible(
        state.config,
        [len(prompt_ids)],
        params,
        engine.max_model_len,
        engine.kv_cache_tokens,
        listed_prompt_tops=(body.prompt_logprobs,),
    )
    answer_id = serving.response_id(request, "chatcmpl")
    model_name = served.name
    timer = state.metrics.start_request(served.name)

    if body.stream:

        def usage_chunk(usage: Usage) -> dict:
            if reasoning is not None:
                usage.completion_tokens_details = CompletionTokensDetails(
                    reasoning_tokens=reasoning.streamed_reasoning_tokens
                )
            return ChatCompletionChunk(id=answer_id, model=model_name, choices=[], usage=usage).model_dump()

        def chunks(generation: Generation) -> AsyncIterator[dict]:
            if tools is not None:
                return _tool_chunks(generation, body, tools, answer_id, model_name, reasoning)
            return _chunks(generation, body, num_top, answer_id, model_name, tokenizer, reasoning)

        return await serving.generation_stream(
            engine, [prompt_ids], params, timer, chunks, usage_chunk, body.stream_options
        )

    async def answer(generation: Generation) -> dict:
        choices = []
        reasoning_tokens = 0
        for index, sample in enumerate(await generation.samples()):
            thought, answer_text = reasoning.split(sample.text) if reasoning is not None else (None, sample.text)
            if reasoning is not None:
                reasoning_tokens += reasoning.count(sample.token_ids)
            content, calls = (None, [])
            if answer_text is not None:  # None: the sample ended while thinking
                content, calls = tools.parse(answer_text) if tools is not None else (answer_text, [])
            logprobs = None
            if body.logprobs:  # many tokens' texts: made on the text worker, off the event loop
                logprobs = await served.text.run(len(sample.logprobs), chat_logprobs, sample.logprobs, num_top)
            choices.append(
                ChatChoice(
                    index=index,
                    message=ChatResponseMessage(content=content, reasoning_content=thought, tool_calls=calls or None),
                    logprobs=logprobs,
                    finish_reason="tool_calls" if calls else sample.finish_reason,
                    stop_reason=sample.stop_reason,
                )
            )
        usage = generation.usage()
        if reasoning is not None:
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        prompt_logprobs = None
        scored = generation.prompt_logprobs(0)
        if scored is not None and body.prompt_logprobs is not None:
            prompt_logprobs = await served.text.run(
                len(prompt_ids), prompt_logprobs_entries, scored, body.prompt_logprobs
            )
        return ChatCompletionResponse(
            id=answer_id, model=model_name, choices=choices, usage=usage, prompt_logprobs=prompt_logprobs
        ).model_dump()

    return await serving.generation_json(engine, [prompt_ids], params, timer, answer)


async def _chunks(
    generation: Generation,
    body: ChatCompletionRequest,
    num_top: int,
    answer_id: str,
    model_name: str,
    tokenizer: Any,
    reasoning: ReasoningPlan | None,
) -> AsyncIterator[dict]:
    def chunk(choices: list[ChatChunkChoice]) -> dict:
        return ChatCompletionChunk(id=answer_id, model=model_name, choices=choices).model_dump()

    # OpenAI's first chunk of each choice carries the role and an empty content.
    for index in range(body.n):
        yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
    async for _, output in generation.outputs():
        for delta in output.outputs:
            thought, text = _split_delta(reasoning, delta)
            if not (thought or text) and delta.finish_reason is None and not (body.logprobs and delta.logprobs):
                continue
            logprobs = chat_logprobs(tokenizer, delta.logprobs or [], num_top) if body.logprobs else None
            yield chunk(
                [
                    ChatChunkChoice(
                        index=delta.index,
                        delta=ChatDelta(content=text or None, reasoning_content=thought or None),
                        logprobs=logprobs,
                        finish_reason=delta.finish_reason,
                    )
                ]
            )


def _split_delta(reasoning: ReasoningPlan | None, delta: CompletionOutput) -> tuple[str, str]:
    """A delta's (thinking, answer) pieces (no parser: all answer)."""
    return reasoning.split_delta(delta) if reasoning is not None else ("", delta.text)


async def _tool_chunks(
    generation: Generation,
    body: ChatCompletionRequest,
    tools: ToolPlan,
    answer_id: str,
    model_name: str,
    reasoning: ReasoningPlan | None,
) -> AsyncIterator[dict]:
    """A constrained reply streams as it is generated (server/openai/tool_stream.py): each call's name, then
    its arguments in fragments, or a text answer as content. A free one (`auto` on a template with
    its own format) is read whole first: only then is it known whether it holds calls."""

    def chunk(choice: ChatChunkChoice) -> dict:
        return ChatCompletionChunk(id=answer_id, model=model_name, choices=[choice]).model_dump()

    for index in range(body.n):
        yield chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content="")))
    framing = tools.stream_framing
    streams = {index: ToolReplyStream(framing) for index in range(body.n)} if framing is not None else {}
    texts: dict[int, list[str]] = {}
    async for _, output in generation.outputs():
        for delta in output.outputs:
            thought, text = _split_delta(reasoning, delta)  # the calls are read from the answer only
            if thought:
                yield chunk(ChatChunkChoice(index=delta.index, delta=ChatDelta(reasoning_content=thought)))
            texts.setdefault(delta.index, []).append(text)
            stream = streams.get(delta.index)
            if stream is not None:
                for fields in stream.feed(text):
                    yield chunk(ChatChunkChoice(index=delta.index, delta=ChatDelta(**fields)))
            if delta.finish_reason is None:
                continue
            if stream is not None and (stream.made_calls or stream.is_answering):
                # A reply cut by max_tokens ends for that reason, as the whole answer does: its calls are unfinished.
                cut = delta.finish_reason == FINISH_LENGTH
                reason = "tool_calls" if stream.made_calls and not cut else delta.finish_reason
                yield chunk(ChatChunkChoice(index=delta.index, delta=ChatDelta(), finish_reason=reason))
                continue
            content, calls = tools.parse("".join(texts[delta.index]))
            if calls:
                for position, call in enumerate(calls):
                    tool_delta = {"index": position, **call.model_dump()}
                    yield chunk(ChatChunkChoice(index=delta.index, delta=ChatDelta(tool_calls=[tool_delta])))
                yield chunk(ChatChunkChoice(index=delta.index, delta=ChatDelta(), finish_reason="tool_calls"))
            else:
                answer = ChatDelta(content=content)
                yield chunk(ChatChunkChoice(index=delta.index, delta=answer, finish_reason=delta.finish_reason))
