"""POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's shapes)."""

from __future__ import annotations

from pydantic import BaseModel

from server.protocol.chat import ChatMessage
from server.protocol.common import StrictRequest, StrictSwitch, TokenId


class TokenizeRequest(StrictRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictSwitch = True
    add_generation_prompt: StrictSwitch = True
    return_token_strs: StrictSwitch = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictRequest):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """What a client needs to tokenize as the server does (lm-evaluation-harness's remote tokenizer reads it)."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int
