"""An Anthropic Messages request as the chat request it stands for, so the answer is chat's, token for token.

`system` becomes a system message first; a user turn's `tool_result` blocks become `tool` turns (before the
turn's text, as chat templates expect them right after the assistant's calls); an assistant turn's
`tool_use` blocks become its `tool_calls`; earlier thinking blocks are dropped (templates leave the
thinking of past turns out). Tools keep their JSON schema; `tool_choice` `any` is chat's `required`.
`thinking` sets the template's `enable_thinking` switch; `output_config` gives chat's `reasoning_effort`
(`max` is `xhigh`) and a JSON schema `response_format`.
"""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InvalidRequestError
from server.protocol.anthropic import (
    CountTokensRequest,
    ImageBlock,
    Message,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from server.protocol.chat import ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition, Tool, ToolCall


def chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request `body` stands for (a count_tokens request: its prompt only)."""
    messages: list[ChatMessage] = []
    if body.system is not None:
        system = body.system if isinstance(body.system, str) else "".join(block.text for block in body.system)
        messages.append(ChatMessage(role="system", content=system))
    for position, message in enumerate(body.messages):
        messages.extend(_chat_messages(message, f"messages[{position}]"))
    tools = [
        Tool(
            type="function",
            function=FunctionDefinition(name=tool.name, description=tool.description, parameters=tool.input_schema),
        )
        for tool in body.tools or []
    ]
    choice = body.tool_choice
    fields: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        fields = dict(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k if body.top_k is not None else 0,
            stop=body.stop_sequences or None,
            stream=body.stream,
            user=body.metadata.user_id if body.metadata is not None else None,
        )
    kwargs = None
    if body.thinking is not None and body.thinking.type in ("enabled", "disabled"):
        kwargs = {"enable_thinking": body.thinking.type == "enabled"}
    output = body.output_config
    if output is not None and output.effort is not None:
        fields["reasoning_effort"] = "xhigh" if output.effort == "max" else output.effort
    if output is not None and output.format is not None:
        if tools and (choice is None or choice.type != "none"):
            raise InvalidRequestError("output_config.format: cannot be combined with tools", "output_config.format")
        schema = {"name": "output", "schema": output.format.schema_}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        tools=tools or None,
        tool_choice=_chat_tool_choice(choice, bool(tools)),
        parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
        chat_template_kwargs=kwargs,
        **fields,
    )


def _chat_tool_choice(choice: Any, has_tools: bool) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequestError("tool_choice: type tool needs the tool's name", "tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    if not has_tools:
        if choice.type in ("auto", "none"):
            return None
        raise InvalidRequestError("tool_choice: any needs tools", "tool_choice")
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _chat_messages(message: Message, where: str) -> list[ChatMessage]:
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    texts: list[str] = []
    calls: list[ToolCall] = []
    results: list[ChatMessage] = []
    for index, block in enumerate(message.content):
        if isinstance(block, ImageBlock):
            raise InvalidRequestError(
                f"{where}.content[{index}]: {block.type} blocks are not supported (the served models read text)",
                f"{where}.content",
            )
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise InvalidRequestError(f"{where}: tool_use blocks belong to assistant turns", f"{where}.content")
            calls.append(
                ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=json.dumps(block.input)))
            )
        elif isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise InvalidRequestError(f"{where}: tool_result blocks belong to user turns", f"{where}.content")
            text = block.text()
            results.append(
                ChatMessage(
                    role="tool", content=f"Error: {text}" if block.is_error else text, tool_call_id=block.tool_use_id
                )
            )
        elif isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            continue
    text = "".join(texts)
    if message.role == "assistant":
        return [ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)]
    return [*results, *([ChatMessage(role="user", content=text)] if text or not results else [])]
