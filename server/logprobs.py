"""The engine's token logprobs in OpenAI's two shapes: completions' parallel lists, chat's objects."""

from __future__ import annotations

from typing import Any

from engine.outputs import TokenLogprob
from server.protocol.chat import ChatLogprobs, ChatTokenLogprob, TopLogprob
from server.protocol.completions import CompletionLogprobs


def completion_logprobs(tokenizer: Any, items: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """`text_offset`: where the first token starts in the choice's text (after any echoed prompt)."""
    result = CompletionLogprobs()
    for item in items:
        token = tokenizer.id_to_token(item.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(item.logprob)
        top: dict[str, float] = {}
        for token_id, logprob in [*item.top, (item.token_id, item.logprob)]:
            text = tokenizer.id_to_token(token_id)
            # Keys are token texts: distinct byte tokens can share one (U+FFFD); keep the best logprob.
            top[text] = max(logprob, top.get(text, logprob))
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(tokenizer: Any, items: list[TokenLogprob], num_top: int) -> ChatLogprobs:
    content = []
    for item in items:
        token = tokenizer.id_to_token(item.token_id)
        top = [
            TopLogprob(token=(t := tokenizer.id_to_token(tid)), logprob=lp, bytes=list(t.encode()))
            for tid, lp in item.top[:num_top]
        ]
        content.append(
            ChatTokenLogprob(token=token, logprob=item.logprob, bytes=list(token.encode()), top_logprobs=top)
        )
    return ChatLogprobs(content=content)
