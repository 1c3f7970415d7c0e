"""POST /api/chat and /api/generate: Ollama's generation API, served by the chat machinery.

A request is turned into the chat request it stands for (server/ollama/chat_request.py): the same
template, tool plan, sampling parameters and admission checks as chat, so a greedy answer is chat's,
token for token. The reply goes out as Ollama's lines (server/ollama/replies.py): newline-delimited JSON
while `stream` is true (Ollama's default), one JSON object otherwise. A request with nothing to generate
(no messages, no prompt) answers at once with `done_reason` "load", as Ollama does when a client asks for
a model to be loaded. Errors on /api routes are Ollama's `{"error": message}`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.errors import InvalidRequestError
from server import serving
from server.catalogue.served import ServedGeneration
from server.http.access import request_cache_salt
from server.http.json_body import AnyContentTypeJSONRoute
from server.http.openapi import ollama_responses
from server.ollama.chat_request import chat_messages, chat_request, generate_messages, max_tokens
from server.ollama.replies import OllamaReply, loaded_line
from server.ollama.served import request_keep_alive, served_name
from server.openai.logprobs import chat_logprobs
from server.openai.params import check_admissible, check_before_load, sampling_params
from server.openai.prompts import request_chat_prompt
from server.openai.reasoning import ReasoningPlan
from server.openai.served_models import generation_model, model_entry
from server.openai.structured import compile_structured, structured_output
from server.openai.tool_stream import ToolReplyStream
from server.openai.tools import ToolPlan, plan_tools
from server.protocol.chat import ChatCompletionRequest
from server.protocol.ollama import ChatLine, ChatRequest, GenerateLine, GenerateRequest
from server.serving import Generation
from server.state import SharedState

router = APIRouter(route_class=AnyContentTypeJSONRoute)


@router.post("/api/chat", response_model=ChatLine, responses=ollama_responses(ChatLine))
@serving.abandoned_when_client_leaves
async def chat(body: ChatRequest, request: Request, state: SharedState) -> Response:
    model = served_name(state, body.model)
    keep_alive = request_keep_alive(body.keep_alive)
    if not body.messages:
        return await _load_or_unload(state, body.model, model, keep_alive, "chat")
    chat_body = chat_request(body, chat_messages(body.messages))
    _check_before_load(chat_body)
    served = await generation_model(state, model, keep_alive)
    engine = served.engine
    _check_think(body, served)
    engine.check_admission()  # a full queue answers 429 before rendering
    tools = plan_tools(chat_body, engine.tokenizer.tool_call_format)
    prompt_ids = await request_chat_prompt(state, served, chat_body, tools)
    return await _answer(body, "chat", chat_body, tools, prompt_ids, served, request, state)


@router.post("/api/generate", response_model=GenerateLine, responses=ollama_responses(GenerateLine))
@serving.abandoned_when_client_leaves
async def generate(body: GenerateRequest, request: Request, state: SharedState) -> Response:
    model = served_name(state, body.model)
    keep_alive = request_keep_alive(body.keep_alive)
    if not body.prompt and not body.context:
        return await _load_or_unload(state, body.model, model, keep_alive, "generate")
    if body.raw and (body.system or body.think not in (None, False)):
        raise InvalidRequestError("raw: a raw prompt goes to the model as is, without system or think", "raw")
    chat_body = chat_request(body, generate_messages(body))
    _check_before_load(chat_body)
    served = await generation_model(state, model, keep_alive)
    engine = served.engine
    _check_think(body, served)
    engine.check_admission()
    if body.raw:
        # Ollama's raw prompt is the model's input as it stands: BOS first on a fresh conversation only.
        fresh = not body.context
        prompt = body.prompt or ""
        ids = await served.text.run(len(prompt), _encode, prompt, fresh)
    else:
        ids = await request_chat_prompt(state, served, chat_body, None)
    prompt_ids = [*(body.context or []), *ids]
    if any(token >= engine.vocab_size for token in prompt_ids):
        raise InvalidRequestError(
            f"context: token ids must be below the vocabulary size ({engine.vocab_size})", "context"
        )
    return await _answer(body, "generate", chat_body, None, prompt_ids, served, request, state)


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens)


async def _load_or_unload(state: Any, asked: str, model: str, keep_alive: float | None, kind: str) -> Response:
    """Ollama's requests with nothing to generate: keep_alive 0 unloads the model, anything else loads it."""
    entry = model_entry(state, model, "generate")
    if keep_alive == 0:
        await state.models.unload(entry)
        return JSONResponse(loaded_line(asked, kind, "unload"))
    await generation_model(state, model, keep_alive)
    return JSONResponse(loaded_line(asked, kind))


def _check_before_load(chat_body: ChatCompletionRequest) -> None:
    """The request's options and format, checked before its model is acquired (max_tokens, which depends on
    the prompt's length, afterwards)."""
    structured_output(chat_body, chat_body.response_format)
    check_before_load(chat_body, None, chat_body.top_logprobs if chat_body.logprobs else None)


def _check_think(body: ChatRequest | GenerateRequest, served: ServedGeneration) -> None:
    if body.think not in (None, False) and served.reasoning is None:
        raise InvalidRequestError(
            f"think: {body.model!r} is not served as a thinking model (start the server with --reasoning-parser)",
            "think",
        )


async def _answer(
    body: ChatRequest | GenerateRequest,
    kind: str,
    chat_body: ChatCompletionRequest,
    tools: ToolPlan | None,
    prompt_ids: list[int],
    served: ServedGeneration,
    request: Request,
    state: Any,
) -> Response:
    engine = served.engine
    reasoning = ReasoningPlan(served.reasoning, prompt_ids) if served.reasoning is not None else None
    spec = tools.spec if tools is not None else structured_output(chat_body, chat_body.response_format)
    limit = max_tokens(body.options, len(prompt_ids), engine.max_model_len)
    num_top = chat_body.top_logprobs or 0
    logprobs = num_top if chat_body.logprobs else None
    thinking = reasoning.span if reasoning is not None else None
    cache_salt = request_cache_salt(request, None)
    params = sampling_params(chat_body, limit, logprobs, engine.vocab_size, cache_salt, spec, thinking=thinking)
    await compile_structured(served.text, engine, spec)
    check_admissible(state.config, [len(prompt_ids)], params, engine.max_model_len, engine.kv_cache_tokens)
    reply = OllamaReply(body.model, kind, prompt_ids)
    timer = state.metrics.start_request(served.name)
    tokenizer = engine.tokenizer

    if body.stream:
        lines = lambda generation: _lines(generation, reply, tools, reasoning, tokenizer, logprobs)  # noqa: E731
        return await serving.ndjson_stream(engine, prompt_ids, params, timer, lines, reply.failed)

    async def whole(generation: Generation) -> dict:
        sample = (await generation.samples())[0]
        thought, text = reasoning.split(sample.text) if reasoning is not None else (None, sample.text)
        content, calls = ("", [])
        if text is not None:  # None: the reply ended while thinking
            content, calls = tools.parse(text) if tools is not None else (text, [])
        entries = None
        if logprobs is not None:
            entries = await served.text.run(len(sample.logprobs), chat_logprobs, sample.logprobs, num_top)
        eval_count = generation.usage().completion_tokens
        first = generation.first_token_time
        return reply.last(
            sample.finish_reason, eval_count, content or "", thought, calls, entries, sample.token_ids, first
        )

    return await serving.generation_json(engine, [prompt_ids], params, timer, whole)


async def _lines(
    generation: Generation,
    reply: OllamaReply,
    tools: ToolPlan | None,
    reasoning: ReasoningPlan | None,
    tokenizer: Any,
    num_top: int | None,
) -> AsyncIterator[dict]:
    """The stream's lines as the reply is generated. With tools, an answer in text streams as it comes
    (a constrained reply is read as it grows); the calls are sent whole once the reply has ended."""
    reader = ToolReplyStream(tools.stream_framing) if tools is not None and tools.stream_framing else None
    parts: list[str] = []
    finish_reason = None
    async for _, output in generation.outputs():
        for delta in output.outputs:
            thought, text = reasoning.split_delta(delta) if reasoning is not None else ("", delta.text)
            parts.append(text)
            finish_reason = delta.finish_reason or finish_reason
            if tools is not None:  # the answer is known only as the constrained reply is read
                text = "".join(f.get("content", "") for f in reader.feed(text)) if reader is not None else ""
            entries = chat_logprobs(tokenizer, delta.logprobs or [], num_top) if num_top is not None else None
            line = reply.piece(thought, text, list(delta.token_ids), entries)
            if line is not None:
                yield line
    if tools is not None:
        content, calls = tools.parse("".join(parts))
        if calls:
            yield reply.calls(calls)
        elif content and not (reader is not None and reader.is_answering):
            yield reply.text(content)
    yield reply.last(finish_reason, generation.usage().completion_tokens)
