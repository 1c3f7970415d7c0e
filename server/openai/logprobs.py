"""The engine's token logprobs in OpenAI's two shapes (completions' parallel lists, chat's objects) and
vLLM's prompt_logprobs entries."""

from __future__ import annotations

from typing import Any

from engine.outputs import TokenLogprob
from server.protocol.chat import ChatLogprobs, ChatTokenLogprob, TopLogprob
from server.protocol.common import PromptLogprobs, PromptTokenLogprob
from server.protocol.completions import CompletionLogprobs


def completion_logprobs(
    tokenizer: Any, items: list[TokenLogprob], text_offset: int, num_top: int | None = None
) -> CompletionLogprobs:
    """`text_offset`: where the first token starts in the choice's text (after any echoed prompt).
    num_top: how many of each item's alternatives to list (None: all it has)."""
    result = CompletionLogprobs()
    for item in items:
        token = tokenizer.id_to_token(item.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(item.logprob)
        top: dict[str, float] = {}
        for token_id, logprob in [*item.top[:num_top], (item.token_id, item.logprob)]:
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


def echo_logprobs(
    tokenizer: Any, prompt_ids: list[int], scored: list[TokenLogprob | None], num_top: int
) -> CompletionLogprobs:
    """The echoed prompt's part of a completion's logprobs: every prompt token, null for the first
    (nothing comes before it), offsets counted from the start of the echoed text. `scored` is the
    engine's prompt logprobs: None, then one item per later prompt token."""
    first = tokenizer.id_to_token(prompt_ids[0])
    head = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
    rest = [item for item in scored[1:] if item is not None]
    return joined(head, completion_logprobs(tokenizer, rest, len(first), num_top))


def joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    """One choice's logprobs from its echoed prompt's and its completion's."""
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


def prompt_logprobs_entries(tokenizer: Any, scored: list[TokenLogprob | None], num_top: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token, {token id: {logprob, rank, decoded_token}} for the
    token itself and its `num_top` likeliest alternatives (null for the first token)."""
    entries: PromptLogprobs = []
    for item in scored:
        if item is None:
            entries.append(None)
            continue
        entry = {
            str(item.token_id): PromptTokenLogprob(
                logprob=item.logprob, rank=item.rank, decoded_token=tokenizer.id_to_token(item.token_id)
            )
        }
        for rank, (top_id, logprob) in enumerate(item.top[:num_top], start=1):
            entry.setdefault(
                str(top_id),
                PromptTokenLogprob(logprob=logprob, rank=rank, decoded_token=tokenizer.id_to_token(top_id)),
            )
        entries.append(entry)
    return entries
