"""Ollama's chat and generate requests as the chat request they stand for, so an answer is chat's, token
for token (the same template, sampling, tool calling, structured output and limits).

`options` become chat's sampling fields (`num_predict` its max_tokens, `repeat_penalty` its
repetition_penalty, a negative `seed` none); `format` "json" is a JSON-object response_format and a schema
object a JSON-schema one; `think` true or false sets the template's `enable_thinking` switch and "low",
"medium" or "high" is chat's reasoning_effort. An assistant turn's `tool_calls` keep their arguments as
JSON text; a `tool` turn answers the last call of its `tool_name` (or its `tool_call_id`).
"""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InvalidRequestError
from server.protocol.chat import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCall
from server.protocol.ollama import ChatRequest, GenerateRequest, Message, Options


def chat_request(body: ChatRequest | GenerateRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request of `body` whose conversation is `messages` (max_tokens is set by the route, which
    knows the prompt's length)."""
    fields: dict[str, Any] = sampling_fields(body.options)
    if isinstance(body.think, bool):
        fields["chat_template_kwargs"] = {"enable_thinking": body.think}
    elif body.think is not None:
        fields["reasoning_effort"] = body.think
    if body.format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": body.format}}
    tools = body.tools if isinstance(body, ChatRequest) else None
    if tools and "response_format" in fields:
        raise InvalidRequestError("format: cannot be combined with tools", "format")
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        tools=tools or None,
        stream=body.stream,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs if body.logprobs else None,
        **fields,
    )


def sampling_fields(options: Options | None) -> dict[str, Any]:
    if options is None:
        return {}
    fields: dict[str, Any] = {
        "temperature": options.temperature,
        "top_p": options.top_p,
        "seed": options.seed if options.seed is not None and options.seed >= 0 else None,
        "stop": options.stop or None,
    }
    for name, chat_name in (
        ("top_k", "top_k"),
        ("min_p", "min_p"),
        ("repeat_penalty", "repetition_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
    ):
        value = getattr(options, name)
        if value is not None:
            fields[chat_name] = value
    return fields


def max_tokens(options: Options | None, prompt_tokens: int, max_model_len: int) -> int | None:
    """The answer's token limit: `num_predict` (-1, -2 or absent: until the context is full), within
    `num_ctx` when given. A `num_ctx` over the model's context, or one the prompt fills, is a 400."""
    asked = options.num_predict if options is not None else None
    if asked == 0:
        raise InvalidRequestError("options.num_predict: must be positive, or -1 for no limit", "options.num_predict")
    limit = asked if asked is not None and asked > 0 else None
    num_ctx = options.num_ctx if options is not None else None
    if num_ctx is None:
        return limit
    if num_ctx > max_model_len:
        raise InvalidRequestError(
            f"options.num_ctx: {num_ctx} is more than the model's context of {max_model_len} tokens",
            "options.num_ctx",
        )
    room = num_ctx - prompt_tokens
    if room < 1:
        raise InvalidRequestError(
            f"the prompt's {prompt_tokens} tokens leave no room in options.num_ctx ({num_ctx})", "options.num_ctx"
        )
    return min(limit, room) if limit is not None else room


def chat_messages(messages: list[Message]) -> list[ChatMessage]:
    turns: list[ChatMessage] = []
    calls_by_name: dict[str, str] = {}  # a tool's name -> the id of its last call
    for position, message in enumerate(messages):
        if message.images:
            raise InvalidRequestError(
                f"messages[{position}].images: not supported (the served models read text)",
                f"messages[{position}].images",
            )
        if message.role == "assistant" and message.tool_calls:
            calls = []
            for index, call in enumerate(message.tool_calls):
                call_id = call.id or f"call_{position}_{index}"
                calls_by_name[call.function.name] = call_id
                arguments = json.dumps(call.function.arguments)
                calls.append(ToolCall(id=call_id, function=FunctionCall(name=call.function.name, arguments=arguments)))
            turns.append(ChatMessage(role="assistant", content=message.content or None, tool_calls=calls))
        elif message.role == "tool":
            call_id = message.tool_call_id or calls_by_name.get(message.tool_name or "")
            turns.append(ChatMessage(role="tool", content=message.content, tool_call_id=call_id))
        else:
            turns.append(ChatMessage(role=message.role, content=message.content))
    return turns


def generate_messages(body: GenerateRequest) -> list[ChatMessage]:
    """A generate request's prompt (and `system`) as the conversation the chat template renders."""
    if body.images:
        raise InvalidRequestError("images: not supported (the served models read text)", "images")
    for name in ("suffix", "template"):
        if getattr(body, name) is not None:
            what = "fill-in-the-middle" if name == "suffix" else "Ollama's Go templates (see --chat-template)"
            raise InvalidRequestError(f"{name}: not supported ({what})", name)
    turns = [ChatMessage(role="system", content=body.system)] if body.system else []
    return [*turns, ChatMessage(role="user", content=body.prompt or "")]
