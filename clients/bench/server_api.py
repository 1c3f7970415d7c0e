"""The server routes the load generator calls: `/tokenize` to size prompts, and streamed completions timed
chunk by chunk."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from clients.bench.results import RequestRecord
from clients.bench.workload import RequestSpec, Workload
from clients.sse import aiter_sse_data


class TokenCounter:
    """Counts tokens with the server's `/tokenize` endpoint.

    Shapes known: kvserve / vLLM `{"model", "prompt"} -> {"tokens": [...], "count": n}` and llama.cpp
    `{"content"} -> {"tokens": [...]}` (ids, or objects with an "id" when pieces are asked for).
    """

    def __init__(self, base_url: str, model: str, timeout: float = 30.0) -> None:
        self._client = httpx.Client(base_url=root_url(base_url), timeout=timeout)
        self._model = model
        self._shape: str | None = None

    def close(self) -> None:
        self._client.close()

    def _post(self, shape: str, text: str) -> httpx.Response:
        if shape == "openai":
            body = {"model": self._model, "prompt": text, "add_special_tokens": False}
        elif shape == "openai-plain":  # for servers whose schema forbids fields it does not know
            body = {"model": self._model, "prompt": text}
        else:
            body = {"content": text, "add_special": False}
        return self._client.post("/tokenize", json=body)

    def available(self) -> bool:
        """Find the request shape this server understands: one whose counts grow with the text.

        (llama.cpp answers a body without "content" with 200 and no tokens, so a 200 alone proves nothing.)
        """
        for shape in ("openai", "openai-plain", "llamacpp"):
            try:
                short, long = (self._post(shape, text) for text in ("hello world", "hello world hello world"))
            except httpx.HTTPError:
                return False
            if short.status_code != 200 or long.status_code != 200:
                continue
            n_short, n_long = _token_count(short.json()), _token_count(long.json())
            if n_short and n_long and n_long > n_short:
                self._shape = shape
                return True
        return False

    def count(self, text: str) -> int:
        if self._shape is None and not self.available():
            raise RuntimeError("server has no usable /tokenize endpoint")
        assert self._shape is not None
        resp = self._post(self._shape, text)
        resp.raise_for_status()
        n = _token_count(resp.json())
        if n is None:
            raise RuntimeError(f"unexpected /tokenize response: {resp.text[:200]}")
        return n


def _token_count(body: Any) -> int | None:
    if not isinstance(body, dict):
        return None
    if isinstance(body.get("count"), int):
        return body["count"]
    tokens = body.get("tokens")
    return len(tokens) if isinstance(tokens, list) else None


def root_url(base_url: str) -> str:
    """Server root without a trailing /v1: /tokenize lives at the root for kvserve and llama.cpp."""
    url = base_url.rstrip("/")
    return url.removesuffix("/v1")


def completion_body(model: str, spec: RequestSpec, workload: Workload) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model}
    if spec.chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    body.update(
        {
            "max_tokens": spec.max_tokens,
            "temperature": workload.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            # vLLM, llama.cpp and kvserve all spell it `ignore_eos` (llama.cpp: tools/server/server-schema.cpp).
            "ignore_eos": workload.ignore_eos,
        }
    )
    if workload.json_schema is not None:  # vLLM's and kvserve's spelling
        body["structured_outputs"] = {"json": json.loads(workload.json_schema)}
    if workload.speculative is not None:  # kvserve's per-request switch
        body["speculative"] = workload.speculative
    return body


async def stream_one(client: httpx.AsyncClient, body: dict[str, Any], t0: float) -> RequestRecord:
    """Send one streaming completion and time every chunk that carries text."""
    record = RequestRecord(start=time.perf_counter() - t0)
    num_text_chunks = 0
    usage_tokens: int | None = None
    try:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {text[:200]}")
            async for data in aiter_sse_data(resp.aiter_lines()):
                now = time.perf_counter() - t0
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {json.dumps(chunk['error'])[:200]}")
                for choice in chunk.get("choices") or []:
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        record.chunk_times.append(now)
                        num_text_chunks += 1
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens")
                    record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage_tokens if usage_tokens is not None else num_text_chunks
        record.ok = True
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, the run goes on
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter() - t0
    return record
