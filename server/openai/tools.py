"""Tool calling: the tools go to the model the way its chat template knows, the reply is constrained
so a call always parses and validates, and it is read back into OpenAI's `tool_calls`.

Two formats, chosen by the chat template (`Tokenizer.tool_call_format`):

- "hermes": templates that render `tools` themselves and write each call as a block
      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>
  (Qwen2.5, Hermes and their kin). The template gets the tool definitions and the earlier turns'
  `tool_calls` and `tool` results as it expects them. "required" and a named function constrain
  the reply to such blocks by a grammar (the JSON inside by each tool's schema); "auto" leaves the
  reply free and reads any blocks back.
- "generic", every other template (the default SmolLM2's has no tool support): the tool
  definitions and one reply format go into the system prompt, and the reply is one JSON object,
  constrained by a JSON schema:
      {"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}
      {"response":"It is sunny."}                       (only with "auto")
  Earlier assistant `tool_calls` are rendered as that JSON, `tool` turns as "tool" turns.

"required" needs at least one call, a named function exactly one call of it, and with
`parallel_tool_calls` false at most one call is allowed. Objects in a tool's parameters that list
their properties and say nothing of `additionalProperties` are closed (OpenAI's strict mode).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine import StructuredOutput
from engine.errors import InvalidRequestError
from server.errors import clip
from server.openai.tool_stream import GENERIC, GENERIC_CALLS_ONLY, HERMES, Framing, decode_string_prefix
from server.protocol.chat import ChatCompletionRequest, ChatMessage, ResponseToolCall, Tool, ToolCallFunction

GENERIC_PROMPT = """You can call these tools. Each one's arguments follow its JSON schema.
{tools}

Reply with one JSON object and nothing else.
To call tools: {{"tool_calls":[{{"name":"<tool name>","arguments":{{...}}}}]}}.
{rule}"""
RULE_AUTO = 'To answer without a tool: {"response":"<your answer>"}.'
RULE_REQUIRED = "Call at least one tool."
RULE_NAMED = "Call the tool {name}."
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_COMPACT = {"whitespace_flexible": False}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_DATA = ("const", "enum", "default", "examples")  # keywords whose values are JSON data


@dataclass(frozen=True)
class ToolPlan:
    """How a request with tools is prompted, constrained and read back."""

    style: str  # "generic" or "hermes"
    spec: StructuredOutput | None  # what the reply must match (None: free, "hermes" with "auto")
    instructions: str  # "generic": appended to the system prompt
    definitions: tuple[dict[str, Any], ...]  # "hermes": the tool definitions the template renders

    @property
    def stream_framing(self) -> Framing | None:
        """How a stream reads the reply as it grows; None for a free reply (read whole)."""
        if self.style == "hermes":
            return HERMES if self.spec is not None else None
        return GENERIC if self.spec is not None and '"response"' in (self.spec.json or "") else GENERIC_CALLS_ONLY

    def parse(self, text: str) -> tuple[str | None, list[ResponseToolCall]]:
        """(content, tool calls) from a whole reply; a reply cut short (by max_tokens) is left as content."""
        if self.style == "hermes":
            return _parse_hermes(text)
        try:
            value = json.loads(text)
        except ValueError:
            return _partial_response(text), []
        if "tool_calls" in value:
            return None, [_call(call["name"], call["arguments"]) for call in value["tool_calls"]]
        return value.get("response", text), []


def plan_tools(body: ChatCompletionRequest, native_format: str | None) -> ToolPlan | None:
    """None when the request has no tools or `tool_choice` is "none"; 400s name the bad field.

    native_format: the chat template's own tool format ("hermes") or None (generic).
    """
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
            raise InvalidRequestError(f"tool_choice: no tool is named {clip(name)!r}", "tool_choice")
        rule, max_calls, may_answer = RULE_NAMED.format(name=name), 1, False
    elif choice == "required":
        rule, max_calls, may_answer = RULE_REQUIRED, None, False
    elif choice == "auto":
        rule, max_calls, may_answer = RULE_AUTO, None, True
    else:
        given = clip(str(choice))
        raise InvalidRequestError(
            f'tool_choice: must be "none", "auto", "required" or a named function, got {given!r}', "tool_choice"
        )
    if not body.parallel_tool_calls:
        max_calls = 1
    if body.response_format is not None and body.response_format.type != "text":
        raise InvalidRequestError(
            "response_format: cannot be combined with tools (use tool_choice none)", "response_format"
        )
    if native_format == "hermes":
        spec = None if may_answer else StructuredOutput(grammar=_hermes_grammar(tools, max_calls), param="tools")
        definitions = tuple(tool.model_dump(exclude_none=True) for tool in body.tools)
        return ToolPlan(style="hermes", spec=spec, instructions="", definitions=definitions)
    schema = _generic_schema(tools, max_calls, may_answer)
    instructions = GENERIC_PROMPT.format(tools="\n".join(_describe(tool) for tool in body.tools), rule=rule)
    return ToolPlan(
        style="generic",
        spec=StructuredOutput(json=json.dumps(schema), param="tools"),
        instructions=instructions,
        definitions=(),
    )


def render_messages(
    messages: list[ChatMessage], plan: ToolPlan | None, native_format: str | None
) -> list[dict[str, Any]]:
    """The messages as the chat template takes them ("developer" is the system role): earlier tool
    calls in the template's own shape ("hermes") or as the generic reply JSON, and the generic tool
    instructions added to the system prompt."""
    rendered = []
    for message in messages:
        item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
        item["content"] = message.text()
        if message.tool_calls and native_format == "hermes":
            item["tool_calls"] = [
                {
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in message.tool_calls
            ]
        elif message.tool_calls:
            calls = [
                {"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in message.tool_calls
            ]
            item["content"] = json.dumps({"tool_calls": calls}, separators=(",", ":"), ensure_ascii=False)
        if message.name:
            item["name"] = message.name
        rendered.append(item)
    if plan is not None and plan.instructions:
        if rendered and rendered[0]["role"] == "system":
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{plan.instructions}"
        else:
            rendered.insert(0, {"role": "system", "content": plan.instructions})
    return rendered


def _call_schemas(tools: list[Tool]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One schema per tool's call, and the `$defs` the schema combining them needs.

    A tool's parameters that refer into themselves ("#", "#/$defs/node") would point at the combined
    schema's root once nested under `arguments`: such parameters move to the top `$defs`, under the
    tool's name, with their references rebased there ("#/$defs/node" -> "#/$defs/<name>/$defs/node")."""
    calls, defs = [], {}
    for tool in tools:
        name = tool.function.name  # [A-Za-z0-9_.-]: a JSON-pointer segment as it is
        arguments = _closed(tool.function.parameters or {"type": "object"})
        rebased = _rebased(arguments, f"#/$defs/{name}")
        if rebased != arguments:
            defs[name] = rebased
            arguments = {"$ref": f"#/$defs/{name}"}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return calls, defs


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with each local `$ref` ("#...") made relative to `base` instead of the document root."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rebased[key] = base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> schemas: a name is no keyword
            rebased[key] = {name: _rebased(item, base) for name, item in value.items()}
        elif key in _SCHEMA_DATA:  # JSON values, not schemas: a "$ref" in them is data
            rebased[key] = value
        else:
            rebased[key] = _rebased(value, base)
    return rebased


def _closed(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others, unless it says
    otherwise (as OpenAI's strict function calling requires): left open, a small model keeps
    inventing keys and the arguments never end."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> schemas, not a schema itself
            closed[key] = {name: _closed(item) for name, item in value.items()}
        else:
            closed[key] = _closed(value)
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _generic_schema(tools: list[Tool], max_calls: int | None, may_answer: bool) -> dict[str, Any]:
    calls, defs = _call_schemas(tools)
    with_defs = {"$defs": defs} if defs else {}
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
        return {**call_reply, **with_defs}
    text_reply = {
        "type": "object",
        "properties": {"response": {"type": "string"}},
        "required": ["response"],
        "additionalProperties": False,
    }
    return {"anyOf": [call_reply, text_reply], **with_defs}


def _hermes_grammar(tools: list[Tool], max_calls: int | None) -> str:
    """Lark (llguidance's dialect, `%json` for a schema): one or more `<tool_call>` blocks."""
    calls, defs = _call_schemas(tools)
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": _COMPACT}
    if defs:
        schema["$defs"] = defs
    repeat = "" if max_calls == 1 else ' ("\\n" call)*'
    return f'start: call{repeat}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {json.dumps(schema)}\n'


def _parse_hermes(text: str) -> tuple[str | None, list[ResponseToolCall]]:
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        try:
            value = json.loads(block)
            calls.append(_call(value["name"], value.get("arguments", {})))
        except (ValueError, KeyError, TypeError):
            return text, []  # not a well-formed call: the reply is text
    if not calls:
        return text, []
    content = _HERMES_BLOCK.sub("", text).strip()
    return content or None, calls


def _call(name: str, arguments: Any) -> ResponseToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ResponseToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=ToolCallFunction(name=name, arguments=text))


def _describe(tool: Tool) -> str:
    function = tool.function
    parameters = json.dumps(function.parameters or {"type": "object"}, separators=(",", ":"), ensure_ascii=False)
    description = f": {function.description}" if function.description else ""
    return f"- {function.name}{description}\n  arguments: {parameters}"


def _partial_response(text: str) -> str:
    """The text answer of a reply cut short inside its `{"response":"...` string; else the reply as is."""
    prefix = GENERIC.answer_open
    assert prefix is not None
    return decode_string_prefix(text[len(prefix) :]) if text.startswith(prefix) else text


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # kept as the string the client sent
