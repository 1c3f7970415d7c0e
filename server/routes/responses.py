"""POST /v1/responses: OpenAI's Responses API, served by the chat machinery.

A request is turned into a chat request: `instructions` become a system message first, input
messages chat messages, a `function_call` item an assistant turn with `tool_calls` and a
`function_call_output` item a `tool` turn; the flat function tools become chat's nested ones and
`text.format` a structured-output spec. From there it is chat: the same template, tool plan,
sampling parameters and admission checks (so a greedy answer's text is chat's, token for token),
and the same submit, disconnect and SSE handling (server/serving.py). The reply is read into
output items, streamed or not, by server/openai/responses_events.py.

Responses are not stored: `store` is accepted, `previous_response_id` is a 400, and there is no
GET /v1/responses/{id}. `reasoning.effort` goes to the chat template (as chat's reasoning_effort); under
--reasoning-parser a reasoning model's thinking is a reasoning item before its message.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine import StructuredOutput
from engine.errors import InvalidRequestError
from engine.params import SamplingParams
from server import serving
from server.errors import APIError
from server.http.access import request_cache_salt
from server.http.json_body import StrictJSONRoute
from server.http.openapi import named_event_responses
from server.openai.params import (
    check_admissible,
    check_before_load,
    max_tokens_for,
    reject_unsupported,
    sampling_params,
)
from server.openai.prompts import chat_prompt_ids
from server.openai.reasoning import ReasoningPlan, template_kwargs
from server.openai.responses_events import ResponseEvents
from server.openai.served_models import generation_model
from server.openai.structured import compile_structured
from server.openai.text import text_size
from server.openai.tool_stream import ToolReplyStream, builder_events
from server.openai.tools import ToolPlan, plan_tools
from server.protocol.chat import ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition, Tool, ToolCall
from server.protocol.common import CompletionTokensDetails
from server.protocol.responses import (
    FunctionCallItem,
    FunctionChoice,
    MessageItem,
    ResponsesRequest,
    TextFormatJsonSchema,
)
from server.protocol.responses_output import ReasoningEcho, ResponseObject, ResponseStreamEvent, TextEcho
from server.serving import Generation
from server.state import SharedState

router = APIRouter(route_class=StrictJSONRoute)

NOT_STORED = (
    "previous_response_id: this server does not store responses; send the whole conversation in `input` "
    "(an earlier response's output items can be sent back as they are)"
)

# Chat's field -> this API's, in errors raised by the code the two share (n is always 1 here: a cost
# over the cap is lowered with max_output_tokens).
_OWN_PARAMS = {"max_tokens": "max_output_tokens", "prompt": "input", "messages": "input", "n": "max_output_tokens"}


@router.post(
    "/v1/responses",
    response_model=ResponseObject,
    responses=named_event_responses(ResponseStreamEvent),
)
@serving.abandoned_when_client_leaves
async def create_response(body: ResponsesRequest, request: Request, state: SharedState) -> Response:
    try:
        return await _create_response(body, request, state)
    except (InvalidRequestError, APIError) as exc:
        # The shared chat code names chat's fields; the client sent this API's.
        exc.param = _OWN_PARAMS.get(exc.param, exc.param)
        raise


async def _create_response(body: ResponsesRequest, request: Request, state: SharedState) -> Response:
    if body.previous_response_id is not None:
        raise APIError(400, NOT_STORED, param="previous_response_id", code="unsupported_field")
    reject_unsupported(body.unsupported_fields())
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options: only allowed when stream is true", "stream_options")
    chat = chat_request(body)
    structured = _text_format(body)
    max_tokens = max_tokens_for(body.max_output_tokens, state.config)
    # prompt_cache_key (OpenAI's) keeps its requests' cached prefixes apart as cache_salt (vLLM's) does.
    cache_salt = request_cache_salt(request, body.cache_salt or body.prompt_cache_key)
    check_before_load(chat, max_tokens, None, cache_salt)
    served = await generation_model(state, body.model)
    engine = served.engine
    engine.check_admission()  # a full queue answers 429 before the messages are rendered
    tools = plan_tools(chat, engine.tokenizer.tool_call_format)
    if tools is not None and structured is not None:
        raise InvalidRequestError("text.format: cannot be combined with tools (use tool_choice none)", "text.format")
    special_in_content = state.config.allow_special_tokens_in_content
    kwargs = template_kwargs(
        state.config.default_chat_template_kwargs, None, chat.reasoning_effort, engine.tokenizer.chat_template
    )
    prompt_ids = await served.text.run(
        text_size(chat.messages), chat_prompt_ids, chat.messages, True, tools, special_in_content, kwargs
    )
    reasoning = ReasoningPlan(served.reasoning, prompt_ids) if served.reasoning is not None else None
    spec = tools.spec if tools is not None else structured
    thinking = reasoning.span if reasoning is not None else None
    params = sampling_params(chat, max_tokens, None, engine.vocab_size, cache_salt, spec, thinking=thinking)
    await compile_structured(served.text, engine, spec)
    check_admissible(state.config, [len(prompt_ids)], params, engine.max_model_len, engine.kv_cache_tokens)
    response_id = f"resp_{request.state.request_id}"  # OpenAI's spelling, with the X-Request-Id as chat's ids
    builder = ResponseEvents(_base_response(body, chat, params, response_id, served.name))
    timer = state.metrics.start_request(served.name)

    if body.stream:
        return await serving.named_event_stream(
            engine,
            prompt_ids,
            params,
            timer,
            lambda generation: _events(generation, builder, tools, reasoning),
            builder.failed,
        )

    async def answer(generation: Generation) -> dict:
        sample = (await generation.samples())[0]
        thought, text = reasoning.split(sample.text) if reasoning is not None else (None, sample.text)
        if thought:
            builder.reasoning(thought)
        content, calls = (None, [])
        if text is not None:  # None: the reply ended while thinking
            content, calls = tools.parse(text) if tools is not None else (text, [])
        builder.whole(content, calls)
        usage = generation.usage()
        if reasoning is not None:
            usage.completion_tokens_details = CompletionTokensDetails(
                reasoning_tokens=reasoning.count(sample.token_ids)
            )
        builder.finished(sample.finish_reason, usage)
        return builder.response().model_dump()

    return await serving.generation_json(engine, [prompt_ids], params, timer, answer)


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this one stands for (its fields are valid already: they share chat's types)."""
    messages: list[ChatMessage] = []
    if body.instructions is not None:
        messages.append(ChatMessage(role="system", content=body.instructions))
    for item in body.input:
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            previous = messages[-1] if messages else None
            if previous is not None and previous.role == "assistant" and previous.tool_calls:
                previous.tool_calls.append(call)  # parallel calls: one assistant turn, as chat has them
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        else:
            messages.append(ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id))
    tools = [
        Tool(
            type="function",
            function=FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
            ),
        )
        for tool in body.tools or []
    ]
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        speculative=body.speculative,
        user=body.user,
        reasoning_effort=body.reasoning.effort if body.reasoning is not None else None,
        stream=body.stream,
        tools=tools or None,
        tool_choice=_chat_tool_choice(body),
        parallel_tool_calls=body.parallel_tool_calls is not False,
    )


def _chat_tool_choice(body: ResponsesRequest) -> str | dict[str, Any] | None:
    """Chat's spelling of `tool_choice`; "auto" and "none" without tools mean no tools, as OpenAI takes them."""
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if not body.tools and choice in ("auto", "none"):
        return None
    return choice


def _text_format(body: ResponsesRequest) -> StructuredOutput | None:
    """`text.format` as the engine's structured-output spec (None: free text)."""
    given = body.text.format if body.text is not None else None
    if given is None or given.type == "text":
        return None
    if isinstance(given, TextFormatJsonSchema):
        return StructuredOutput(json=json.dumps(given.schema_), param="text.format")
    return StructuredOutput(json_object=True, param="text.format")


def _base_response(
    body: ResponsesRequest, chat: ChatCompletionRequest, params: SamplingParams, response_id: str, model: str
) -> ResponseObject:
    """The response before any output: the request's settings echoed as they apply (the sampling
    defaults filled in), as OpenAI's response object has them."""
    given = body.text.format if body.text is not None else None
    text_format = given.model_dump(by_alias=True, exclude_none=True) if given is not None else {"type": "text"}
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if body.tools else "none"
    return ResponseObject(
        id=response_id,
        status="in_progress",
        instructions=body.instructions,
        max_output_tokens=params.max_tokens,
        model=model,
        parallel_tool_calls=chat.parallel_tool_calls,
        temperature=params.temperature,
        top_p=params.top_p,
        text=TextEcho(format=text_format, verbosity=body.text.verbosity if body.text is not None else None),
        tool_choice=choice.model_dump() if isinstance(choice, FunctionChoice) else choice,
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
        truncation=body.truncation or "disabled",
        user=body.user,
        metadata=body.metadata or {},
        reasoning=ReasoningEcho(effort=chat.reasoning_effort),
    )


async def _events(
    generation: Generation, builder: ResponseEvents, tools: ToolPlan | None, reasoning: ReasoningPlan | None
) -> AsyncIterator[dict]:
    """The stream's events as the reply is generated. A reasoning model's thinking first, as a reasoning
    item. Without tools, text deltas; with a constrained tool reply, each call as soon as its name is
    complete, then its arguments in fragments (or a text answer as text). A free tool reply (`auto` on a
    template with its own format) is read whole first: only then is it known whether it holds calls."""
    for event in builder.started():
        yield event
    framing = tools.stream_framing if tools is not None else None
    reader = ToolReplyStream(framing) if framing is not None else None
    parts: list[str] = []
    finish_reason = None
    async for _, output in generation.outputs():
        for delta in output.outputs:
            thought, text = reasoning.split_delta(delta) if reasoning is not None else ("", delta.text)
            parts.append(text)
            finish_reason = delta.finish_reason or finish_reason
            events = builder.reasoning(thought)
            if tools is None:
                events += builder.text(text) if text else []
            elif reader is not None:
                events += [event for fields in reader.feed(text) for event in builder_events(builder, fields)]
            for event in events:
                yield event
    if tools is not None and not (reader is not None and (reader.made_calls or reader.is_answering)):
        content, calls = tools.parse("".join(parts))
        for event in builder.whole(content, calls):
            yield event
    usage = generation.usage()
    if reasoning is not None:
        usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=reasoning.streamed_reasoning_tokens)
    for event in builder.finished(finish_reason, usage):
        yield event
