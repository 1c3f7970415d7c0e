"""Request prompts -> token ids: completion prompts (text or ids, one or many) and chat messages.

A completion prompt is the model's raw input: a special token's text in it is that token (as in
vLLM). Chat messages are the client's text: only the chat template writes control tokens.

Each function takes the tokenizer first and runs on the text worker (server/openai/text.py).
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from server.catalogue.served import ServedGeneration
from server.config import ServerConfig
from server.openai.params import check_batch_size, check_token_ids
from server.openai.reasoning import template_kwargs
from server.openai.text import text_size
from server.openai.tools import ToolPlan, render_messages
from server.protocol.chat import ChatCompletionRequest, ChatMessage
from server.protocol.completions import CompletionRequest


def completion_prompts(
    tokenizer: Any, body: CompletionRequest, vocab_size: int, config: ServerConfig
) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) for each prompt; token-id prompts must lie in [0, vocab_size)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        raw: list = [prompt]
    elif len(prompt) == 0:
        raise InvalidRequestError("prompt: must not be empty", "prompt")
    elif isinstance(prompt[0], int):
        raw = [prompt]
    else:
        raw = list(prompt)
    check_batch_size(config, len(raw), "prompt")
    prompts = []
    for item in raw:
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=body.add_special_tokens)
            prompts.append((item, ids))
        else:
            check_token_ids(item, vocab_size, "prompt")
            prompts.append((None, list(item)))
        if not prompts[-1][1]:
            raise InvalidRequestError("prompt: must contain at least one token", "prompt")
    return prompts


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    tools: ToolPlan | None = None,
    allow_special_tokens_in_content: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The messages through the model's chat template (server/openai/tools.py renders tool turns, and the
    tool definitions as the template takes them). Everything the request holds is encoded as text,
    so only the template's own markers are control tokens, unless the server allows special tokens
    in content (`--allow-special-tokens-in-content`). template_kwargs: the template's extra variables
    (server/openai/reasoning.py)."""
    native = tokenizer.tool_call_format
    rendered = render_messages(messages, tools, native)
    definitions = list(tools.definitions) if tools is not None and tools.definitions else None
    return tokenizer.apply_chat_template(
        rendered,
        add_generation_prompt=add_generation_prompt,
        tools=definitions,
        allow_special_tokens_in_content=allow_special_tokens_in_content,
        template_kwargs=template_kwargs or None,
    )


def echoed_prompts(tokenizer: Any, prompts: list[tuple[str | None, list[int]]]) -> list[str]:
    """Each prompt's text as an echo shows it: as sent, or its token ids decoded."""
    return [text if text is not None else tokenizer.decode(ids, skip_special_tokens=False) for text, ids in prompts]


async def request_chat_prompt(
    state: Any, generation: ServedGeneration, chat: ChatCompletionRequest, tools: ToolPlan | None
) -> list[int]:
    """A translated request's (Messages, Ollama) prompt: its chat request through the template, on the text
    worker, with the server's template defaults, then the request's reasoning effort and kwargs."""
    kwargs = template_kwargs(
        state.config.default_chat_template_kwargs,
        chat.chat_template_kwargs,
        chat.reasoning_effort,
        generation.engine.tokenizer.chat_template,
    )
    special_in_content = state.config.allow_special_tokens_in_content
    return await generation.text.run(
        text_size(chat.messages), chat_prompt_ids, chat.messages, True, tools, special_in_content, kwargs
    )
