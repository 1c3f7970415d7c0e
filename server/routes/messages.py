"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, served by the chat machinery.

A request is turned into the chat request it stands for (server/anthropic/chat_request.py): the same
template, tool plan, sampling parameters and admission checks as chat, so a greedy answer is chat's, token
for token. The reply is read into content blocks, streamed or not, by server/anthropic/message_events.py:
a reasoning model's thinking (--reasoning-parser) as a `thinking` block, the answer as `text`, calls as
`tool_use` blocks. Errors on these routes come in Anthropic's shape (`{"type": "error", "error": {...}}`),
and the `x-api-key` header is read as the API key, as Anthropic's clients send it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server import serving
from server.anthropic.chat_request import chat_request
from server.anthropic.message_events import MessageEvents
from server.http.access import request_cache_salt
from server.http.json_body import StrictJSONRoute
from server.http.openapi import anthropic_responses
from server.openai.params import check_admissible, check_before_load, sampling_params
from server.openai.prompts import request_chat_prompt
from server.openai.reasoning import ReasoningPlan
from server.openai.served_models import generation_model
from server.openai.structured import compile_structured, structured_output
from server.openai.tool_stream import ToolReplyStream, builder_events
from server.openai.tools import ToolPlan, plan_tools
from server.protocol.anthropic import (
    CountTokensRequest,
    MessageObject,
    MessagesRequest,
    MessagesStreamEvent,
    TokenCount,
)
from server.serving import Generation
from server.state import SharedState

router = APIRouter(route_class=StrictJSONRoute)


async def _prompt(
    body: MessagesRequest | CountTokensRequest, state: Any, admit: bool = True
) -> tuple[Any, Any, ToolPlan | None, list[int]]:
    """(the chat request, the model, the tool plan, the prompt's token ids) of a Messages request."""
    chat = chat_request(body)
    if isinstance(body, MessagesRequest):  # its sampling fields, before its model is acquired
        check_before_load(chat, body.max_tokens, None)
    served = await generation_model(state, body.model)
    if admit:
        served.engine.check_admission()  # a full queue answers 429 before rendering
    tools = plan_tools(chat, served.engine.tokenizer.tool_call_format)
    prompt_ids = await request_chat_prompt(state, served, chat, tools)
    return chat, served, tools, prompt_ids


@router.post("/v1/messages", response_model=MessageObject, responses=anthropic_responses(MessagesStreamEvent))
@serving.abandoned_when_client_leaves
async def create_message(body: MessagesRequest, request: Request, state: SharedState) -> Response:
    chat, served, tools, prompt_ids = await _prompt(body, state)
    engine = served.engine
    reasoning = ReasoningPlan(served.reasoning, prompt_ids) if served.reasoning is not None else None
    spec = tools.spec if tools is not None else structured_output(chat, chat.response_format)
    cache_salt = request_cache_salt(request, None)
    thinking = reasoning.span if reasoning is not None else None
    # Anthropic's clients ask for a max_tokens sized for Anthropic's models (32,000 and more): an upper
    # bound, so it is held to the room the context leaves (a prompt that fills the context is still a 400).
    room = engine.max_model_len - len(prompt_ids)
    max_tokens = min(body.max_tokens, room) if room > 0 else body.max_tokens
    params = sampling_params(chat, max_tokens, None, engine.vocab_size, cache_salt, spec, thinking=thinking)
    await compile_structured(served.text, engine, spec)
    check_admissible(state.config, [len(prompt_ids)], params, engine.max_model_len, engine.kv_cache_tokens)
    builder = MessageEvents(f"msg_{request.state.request_id}", served.name, len(prompt_ids))
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
        content, calls = (None, [])
        if text is not None:  # None: the reply ended while thinking
            content, calls = tools.parse(text) if tools is not None else (text, [])
        builder.whole(thought, content, calls)
        thinking_tokens = reasoning.count(sample.token_ids) if reasoning is not None else None
        builder.finished(
            sample.finish_reason, sample.stop_reason, generation.usage().completion_tokens, thinking_tokens
        )
        return builder.message().model_dump()

    return await serving.generation_json(engine, [prompt_ids], params, timer, answer)


async def _events(
    generation: Generation, builder: MessageEvents, tools: ToolPlan | None, reasoning: ReasoningPlan | None
) -> AsyncIterator[dict]:
    """The stream's events as the reply is generated: thinking and text deltas; with a constrained tool
    reply, each call as soon as its name is complete, then its input JSON in fragments. A free tool reply
    (`auto` on a template with its own format) is read whole first: only then is it known whether it
    holds calls."""
    for event in builder.started():
        yield event
    framing = tools.stream_framing if tools is not None else None
    reader = ToolReplyStream(framing) if framing is not None else None
    parts: list[str] = []
    finish_reason, stop = None, None
    async for _, output in generation.outputs():
        for delta in output.outputs:
            thought, text = reasoning.split_delta(delta) if reasoning is not None else ("", delta.text)
            parts.append(text)
            if delta.finish_reason is not None:
                finish_reason, stop = delta.finish_reason, delta.stop_reason
            events = builder.thinking(thought)
            if tools is None:
                events += builder.text(text)
            elif reader is not None:
                events += [event for fields in reader.feed(text) for event in builder_events(builder, fields)]
            for event in events:
                yield event
    if tools is not None and not (reader is not None and (reader.made_calls or reader.is_answering)):
        content, calls = tools.parse("".join(parts))
        for event in builder.whole(None, content, calls):
            yield event
    thinking_tokens = reasoning.streamed_reasoning_tokens if reasoning is not None else None
    for event in builder.finished(finish_reason, stop, generation.usage().completion_tokens, thinking_tokens):
        yield event


@router.post("/v1/messages/count_tokens", response_model=TokenCount, responses=anthropic_responses(None))
async def count_tokens(body: CountTokensRequest, state: SharedState) -> TokenCount:
    """The prompt's tokens as /v1/messages would render it (system, messages, tools)."""
    _, _, _, prompt_ids = await _prompt(body, state, admit=False)
    return TokenCount(input_tokens=len(prompt_ids))
