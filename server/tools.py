"""Tool calling, the same way on every chat template: the tool definitions go into the system
prompt, the reply is constrained by a JSON schema to a tool call (with `tool_choice` "auto": a tool
call or a text answer), and the JSON is parsed back into OpenAI's `tool_calls`.

The reply the model writes, always one JSON object on one line:
    {"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}
    {"response":"It is sunny."}                       (only with "auto")
"required" needs at least one call; a named function exactly one call of it; with
`parallel_tool_calls` false at most one call. Earlier turns are rendered the same way: an
assistant turn's `tool_calls` become that JSON, a `tool` turn's content follows as a "tool" turn.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutput
from server.protocol.chat import ChatCompletionRequest, ChatMessage, ResponseToolCall, Tool, ToolCallFunction

TOOLS_PROMPT = """You can call these tools. Each one's arguments follow its JSON schema.
{tools}

Reply with one JSON object and nothing else.
To call tools: {{"tool_calls":[{{"name":"<tool name>","arguments":{{...}}}}]}}.
{rule}"""
RULE_AUTO = 'To answer without a tool: {"response":"<your answer>"}.'
RULE_REQUIRED = "Call at least one tool."
RULE_NAMED = "Call the tool {name}."


@dataclass(frozen=True)
class ToolPlan:
    """How a request with tools is prompted, constrained and read back."""

    spec: StructuredOutput  # what the reply must match
    instructions: str  # appended to the system prompt

    def parse(self, text: str) -> tuple[str | None, list[ResponseToolCall]]:
        """(content, tool calls) from a whole reply; a reply cut short (by max_tokens) is left as content."""
        try:
            value = json.loads(text)
        except ValueError:
            return _partial_response(text), []
        if "tool_calls" in value:
            calls = [
                ResponseToolCall(
                    id=f"call_{uuid.uuid4().hex[:24]}",
                    function=ToolCallFunction(name=call["name"], arguments=json.dumps(call["arguments"])),
                )
                for call in value["tool_calls"]
            ]
            return None, calls
        return value.get("response", text), []


def plan_tools(body: ChatCompletionRequest) -> ToolPlan | None:
    """None when the request has no tools or `tool_choice` is "none"; 400s name the bad field."""
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    if choice == "none":
        return None
    if not body.tools:
        raise InvalidRequestError("tool_choice: needs tools", "tool_choice")
    tools = list(body.tools)
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise InvalidRequestError(
                'tool_choice: an object must be {"type": "function", "function": {"name": ...}}', "tool_choice"
            )
        tools = [tool for tool in tools if tool.function.name == name]
        if not tools:
            raise InvalidRequestError(f"tool_choice: no tool is named {name!r}", "tool_choice")
        rule, max_calls, may_answer = RULE_NAMED.format(name=name), 1, False
    elif choice == "required":
        rule, max_calls, may_answer = RULE_REQUIRED, None, False
    elif choice == "auto":
        rule, max_calls, may_answer = RULE_AUTO, None, True
    else:
        raise InvalidRequestError(
            f'tool_choice: must be "none", "auto", "required" or a named function, got {choice!r}', "tool_choice"
        )
    if not body.parallel_tool_calls:
        max_calls = 1
    if body.response_format is not None and body.response_format.type != "text":
        raise InvalidRequestError(
            "response_format: cannot be combined with tools (use tool_choice none)", "response_format"
        )
    schema = _reply_schema(tools, max_calls, may_answer)
    return ToolPlan(
        spec=StructuredOutput(json=json.dumps(schema), param="tools"),
        instructions=TOOLS_PROMPT.format(tools="\n".join(_describe(tool) for tool in body.tools), rule=rule),
    )


def render_messages(messages: list[ChatMessage], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: tool calls and tool results as text, and the
    tool instructions added to the system prompt ("developer" is the system role)."""
    rendered = []
    for message in messages:
        content = message.text()
        if message.tool_calls:
            calls = [
                {"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in message.tool_calls
            ]
            content = json.dumps({"tool_calls": calls}, separators=(",", ":"), ensure_ascii=False)
        item = {"role": "system" if message.role == "developer" else message.role, "content": content}
        if message.name:
            item["name"] = message.name
        rendered.append(item)
    if plan is not None:
        if rendered and rendered[0]["role"] == "system":
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{plan.instructions}"
        else:
            rendered.insert(0, {"role": "system", "content": plan.instructions})
    return rendered


def _reply_schema(tools: list[Tool], max_calls: int | None, may_answer: bool) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "arguments": tool.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    items: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if max_calls is not None:
        items["maxItems"] = max_calls
    call_reply = {
        "type": "object",
        "properties": {"tool_calls": items},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    if not may_answer:
        return call_reply
    text_reply = {
        "type": "object",
        "properties": {"response": {"type": "string"}},
        "required": ["response"],
        "additionalProperties": False,
    }
    return {"anyOf": [call_reply, text_reply]}


def _describe(tool: Tool) -> str:
    function = tool.function
    parameters = json.dumps(function.parameters or {"type": "object"}, separators=(",", ":"), ensure_ascii=False)
    description = f": {function.description}" if function.description else ""
    return f"- {function.name}{description}\n  arguments: {parameters}"


def _partial_response(text: str) -> str:
    """The text answer of a reply cut short inside its `{"response":"...` string; else the reply as is."""
    prefix = '{"response":"'
    if not text.startswith(prefix):
        return text
    body = text[len(prefix) :]
    for end in range(len(body), max(len(body) - 12, -1), -1):  # an escape may be cut: drop its start
        try:
            return json.loads(f'"{body[:end]}"')
        except ValueError:
            continue
    return text


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # kept as the string the client sent
