"""`kvserve bench`: a streaming load generator for any OpenAI-compatible completions server.

It drives kvserve, llama.cpp's `llama-server` or vLLM with the same workload: N requests with C in flight,
prompts of a given token length built from a seeded word list (sized with the server's own `/tokenize`, so
every server sees the same token counts), a given number of output tokens with EOS ignored. It measures
time to first token, inter-token latency, output tokens/s and the server's peak memory, and writes JSON
plus a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from clients.sse import aiter_sse_data

logger = logging.getLogger(__name__)

# Common, mostly single-token English words: a prompt of them tokenizes predictably on any BPE vocabulary.
_WORDS_TEXT = """the of and to in is was for that on as with by he it at from his an were are which this be or had not
    but first one their its new after who they have her she two been other when there all during into school
    time may years more most only over city some world would where later up such used many can state about
    national out known university united then made also three city year people water house river game under
    long part home great team small found life best light book music street road family early name line war
    north south east west high world work old end day good place number group area point power market art
    story field system court night land town film local country side open round paper member order report
    show way king table window garden morning history letter simple green blue red black white stone tree
    bird horse ship train summer winter spring autumn voice friend mother father child doctor teacher farmer
    village island forest mountain valley bridge station church castle museum library kitchen bottle coffee
    bread apple orange silver golden quiet happy strong young ancient modern public private central common"""
WORDS: tuple[str, ...] = tuple(_WORDS_TEXT.split())
# The tasks a workload's prompts can be. words: a completion prompt of seeded words. rewrite: a chat
# request to rewrite a seeded passage with misspellings, correcting the spelling (the answer copies its
# input: what speculative decoding speeds up). chat: a free-form chat question (nothing to copy).
TASKS = ("words", "rewrite", "chat")
_ADJECTIVES = """quiet happy strong young ancient modern public private central common green blue red black white
    golden silver small great early old famous narrow busy""".split()
_NOUNS = """river garden teacher farmer village island forest mountain valley bridge station church castle museum
    library kitchen bottle horse ship train doctor letter window market tower""".split()
_VERBS = """visited crossed painted described followed remembered repaired opened watched found built left
    reached cleaned""".split()
_PLACES = (
    "near the harbour",
    "after the long winter",
    "before the storm",
    "behind the old mill",
    "along the northern road",
    "during the summer fair",
    "beside the quiet lake",
    "under the stone arch",
)
_CHAT_QUESTIONS = (
    "Write a short story about a {adj} {noun} and the people who live around it.",
    "Explain to a child why the {noun} in the {noun2} looks so {adj} in the evening.",
    "Give me five ideas for a weekend trip to a {adj} {noun}, with one sentence on each.",
    "What would you tell a {noun} who wants to become a {noun2}? Answer in a few paragraphs.",
    "Describe a day in the life of a {adj} {noun} in a small town.",
)
REWRITE_INSTRUCTION = "Rewrite the following text, correcting the spelling:\n\n"
# The structured workload's schema: one free string, so an output can be as long as an unconstrained one.
STRUCTURED_SCHEMA = json.dumps(
    {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"], "additionalProperties": False}
)


@dataclass(frozen=True)
class Workload:
    """What to send. Lengths are token counts; `*_max` > `*_len` draws each request's length uniformly
    from [len, max] with the seeded generator (fixed lengths otherwise)."""

    name: str = "custom"
    num_requests: int = 16
    concurrency: int = 1
    prompt_len: int = 110
    prompt_len_max: int | None = None
    output_len: int = 128
    output_len_max: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    warmup_requests: int = 1
    json_schema: str | None = None  # JSON text: every request's output must match it (`structured_outputs`)
    task: str = "words"  # one of TASKS; rewrite and chat go to /v1/chat/completions
    speculative: bool | None = None  # False: ask each request to opt out of speculative decoding

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}")
        if self.num_requests < 1 or self.concurrency < 1:
            raise ValueError("num_requests and concurrency must be >= 1")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("prompt_len and output_len must be >= 1")
        if self.prompt_len_max is not None and self.prompt_len_max < self.prompt_len:
            raise ValueError("prompt_len_max must be >= prompt_len")
        if self.output_len_max is not None and self.output_len_max < self.output_len:
            raise ValueError("output_len_max must be >= output_len")


@dataclass(frozen=True)
class RequestSpec:
    prompt: str  # the completion prompt, or the one user message of a chat task
    prompt_tokens: int  # as counted by the tokenizer used to size it (-1: estimated, no tokenizer)
    max_tokens: int
    chat: bool = False  # send `prompt` as a user message to /v1/chat/completions


@dataclass
class RequestRecord:
    """Timings of one streamed request, all in seconds from the benchmark's start."""

    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from the server's usage, when it reports it
    ok: bool = False
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass
class BenchResult:
    """One workload against one server. Times in milliseconds, memory in MiB."""

    server: str
    model: str
    workload: dict[str, Any]
    num_requests: int
    num_failed: int
    duration_s: float
    total_prompt_tokens: int
    total_output_tokens: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    output_tokens_per_s: float  # all output tokens over the wall time of the run
    output_tokens_per_s_per_request: float | None  # mean over requests of output_tokens / latency
    decode_tokens_per_s_per_request: float | None  # mean over requests of (tokens - 1) / (last - first chunk)
    requests_per_s: float
    peak_memory_mib: float | None = None  # peak RSS of the server process tree sampled during the run
    peak_memory_hwm_mib: float | None = None  # kernel's VmHWM of the server process (since its start)
    errors: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]; None for no values."""
    if not values:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError("q must be in [0, 100]")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    server: str,
    model: str,
    workload: Workload,
    peak_memory_mib: float | None = None,
    peak_memory_hwm_mib: float | None = None,
) -> BenchResult:
    """Turn per-request timings into the reported statistics."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    # Inter-token latency: gaps between consecutive text chunks of the same request.
    itls = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    per_request_tps = [r.output_tokens / r.latency for r in ok if r.latency > 0]
    decode_tps = [
        (r.output_tokens - 1) / (r.chunk_times[-1] - r.chunk_times[0])
        for r in ok
        if r.output_tokens > 1 and len(r.chunk_times) > 1 and r.chunk_times[-1] > r.chunk_times[0]
    ]
    total_out = sum(r.output_tokens for r in ok)
    return BenchResult(
        server=server,
        model=model,
        workload=asdict(workload),
        num_requests=len(records),
        num_failed=len(records) - len(ok),
        duration_s=duration_s,
        total_prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        total_output_tokens=total_out,
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        itl_p50_ms=_ms(percentile(itls, 50)),
        itl_p99_ms=_ms(percentile(itls, 99)),
        output_tokens_per_s=total_out / duration_s if duration_s > 0 else 0.0,
        output_tokens_per_s_per_request=statistics.fmean(per_request_tps) if per_request_tps else None,
        decode_tokens_per_s_per_request=statistics.fmean(decode_tps) if decode_tps else None,
        requests_per_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        peak_memory_mib=peak_memory_mib,
        peak_memory_hwm_mib=peak_memory_hwm_mib,
        errors=sorted({r.error for r in records if r.error})[:10],
    )


# --------------------------------------------------------------------------- workload generation


def draw_lengths(workload: Workload) -> list[tuple[int, int]]:
    """(prompt_len, output_len) per request, from the workload's seed."""
    rng = random.Random(workload.seed)
    out = []
    for _ in range(workload.num_requests):
        p = rng.randint(workload.prompt_len, workload.prompt_len_max or workload.prompt_len)
        o = rng.randint(workload.output_len, workload.output_len_max or workload.output_len)
        out.append((p, o))
    return out


def fit_prompt(words: Sequence[str], target: int, count_tokens: Callable[[str], int]) -> tuple[str, int]:
    """Longest prefix of `words` with at most `target` tokens, then padded with one-token words to hit it.

    Binary search over the number of words: about log2(len(words)) tokenizer calls.
    """
    lo, hi = 1, len(words)
    best_n, best_count = 1, count_tokens(" ".join(words[:1]))
    while lo <= hi:
        mid = (lo + hi) // 2
        n = count_tokens(" ".join(words[:mid]))
        if n <= target:
            best_n, best_count = mid, n
            lo = mid + 1
        else:
            hi = mid - 1
    text = " ".join(words[:best_n])
    # Pad with the words of the list after the prefix, keeping each only if it does not overshoot.
    for word in words[best_n : best_n + 4 * target]:
        if best_count >= target:
            break
        candidate = f"{text} {word}"
        n = count_tokens(candidate)
        if n <= target:
            text, best_count = candidate, n
    return text, best_count


def misspell(word: str, rng: random.Random, rate: float = 0.15) -> str:
    """The word with two neighbouring inner letters swapped, at `rate` for words of 4+ letters."""
    if len(word) < 4 or rng.random() >= rate:
        return word
    i = rng.randrange(1, len(word) - 2)
    return word[:i] + word[i + 1] + word[i] + word[i + 2 :]


def rewrite_passage(rng: random.Random, target: int, count_tokens: Callable[[str], int] | None) -> tuple[str, int]:
    """A seeded passage of simple sentences with misspelled words, about `target` tokens long.

    Sentences are added until the passage reaches the target (counted every few sentences; without a
    tokenizer, words stand in for tokens, at about 1.3 tokens each).
    """
    sentences: list[str] = []
    count = 0
    while count < target:
        for _ in range(4):
            sentence = (
                f"The {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the "
                f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_PLACES)}."
            )
            sentences.append(" ".join(misspell(w, rng) for w in sentence.split()))
        text = " ".join(sentences)
        count = count_tokens(text) if count_tokens is not None else round(1.3 * len(text.split()))
    return text, count


def chat_question(rng: random.Random) -> str:
    """A seeded free-form question: the answer has nothing in the prompt to copy."""
    template = rng.choice(_CHAT_QUESTIONS)
    return template.format(adj=rng.choice(_ADJECTIVES), noun=rng.choice(_NOUNS), noun2=rng.choice(_NOUNS))


def build_requests(workload: Workload, count_tokens: Callable[[str], int] | None) -> list[RequestSpec]:
    """Deterministic prompts: the same seed gives the same word sequences on every server.

    Each prompt starts with a distinct request number so no server can reuse another request's prompt cache.
    Without a tokenizer the word count stands in for the token count (these words are mostly one token).
    A rewrite task's passage is about prompt_len tokens (the chat template and instruction come on top);
    a chat task's question is a sentence, whatever prompt_len says.
    """
    rng = random.Random(workload.seed + 1)
    if workload.task == "rewrite":
        specs = []
        for _, output_len in draw_lengths(workload):
            passage, n = rewrite_passage(rng, workload.prompt_len, count_tokens)
            specs.append(RequestSpec(REWRITE_INSTRUCTION + passage, n, output_len, chat=True))
        return specs
    if workload.task == "chat":
        return [RequestSpec(chat_question(rng), -1, output_len, chat=True) for _, output_len in draw_lengths(workload)]
    specs = []
    for i, (prompt_len, output_len) in enumerate(draw_lengths(workload)):
        # Twice the target in words is always enough text; each word is at least one token.
        words = [f"Request {i}:"] + [rng.choice(WORDS) for _ in range(2 * prompt_len + 8)]
        if count_tokens is None:
            specs.append(RequestSpec(" ".join(words[:prompt_len]), -1, output_len))
        else:
            text, n = fit_prompt(words, prompt_len, count_tokens)
            specs.append(RequestSpec(text, n, output_len))
    return specs


# --------------------------------------------------------------------------- server access


class TokenCounter:
    """Counts tokens with the server's `/tokenize` endpoint.

    Shapes known: kvserve / vLLM `{"model", "prompt"} -> {"tokens": [...], "count": n}` and llama.cpp
    `{"content"} -> {"tokens": [...]}` (ids, or objects with an "id" when pieces are asked for).
    """

    def __init__(self, base_url: str, model: str, timeout: float = 30.0) -> None:
        self._client = httpx.Client(base_url=_root_url(base_url), timeout=timeout)
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


def _root_url(base_url: str) -> str:
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


# --------------------------------------------------------------------------- memory


class MemorySampler:
    """Samples the RSS of a process and its children in a thread; also reads the kernel's VmHWM."""

    def __init__(self, pid: int | None, interval_s: float = 0.2) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_rss_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _rss(self) -> int:
        import psutil

        try:
            proc = psutil.Process(self.pid)
            total = proc.memory_info().rss
            for child in proc.children(recursive=True):
                try:
                    total += child.memory_info().rss
                except psutil.Error:
                    pass
            return total
        except psutil.Error:
            return 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_rss_bytes = max(self.peak_rss_bytes, self._rss())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> MemorySampler:  # noqa: PYI034 - keeps Python 3.10 working
        if self.pid is not None:
            self._thread = threading.Thread(target=self._loop, name="mem-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.peak_rss_bytes = max(self.peak_rss_bytes, self._rss())

    @property
    def peak_rss_mib(self) -> float | None:
        return self.peak_rss_bytes / 2**20 if self.pid is not None and self.peak_rss_bytes else None

    def vm_hwm_mib(self) -> float | None:
        if self.pid is None:
            return None
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB -> MiB
        except OSError:
            return None
        return None


# --------------------------------------------------------------------------- the run


async def run_benchmark(
    base_url: str,
    model: str,
    workload: Workload,
    *,
    server_label: str = "server",
    server_pid: int | None = None,
    progress: bool = True,
    timeout_s: float = 600.0,
) -> BenchResult:
    """Run `workload` against the OpenAI-compatible server at `base_url` (with or without /v1)."""
    tokenizer = TokenCounter(base_url, model)
    try:
        has_tokenize = await asyncio.to_thread(tokenizer.available)
        if not has_tokenize:
            logger.warning("%s has no /tokenize: prompt lengths are estimated from word counts", base_url)
        count = tokenizer.count if has_tokenize else None
        specs = await asyncio.to_thread(build_requests, workload, count)
    finally:
        tokenizer.close()

    limits = httpx.Limits(max_connections=workload.concurrency + 2, max_keepalive_connections=workload.concurrency + 2)
    async with httpx.AsyncClient(base_url=_root_url(base_url), timeout=timeout_s, limits=limits) as client:
        # Warm-up: first-request costs (lazy init, allocation) are not part of steady-state serving.
        if workload.warmup_requests:
            warm_spec = RequestSpec(prompt=" ".join(WORDS[:16]), prompt_tokens=-1, max_tokens=4)
            for _ in range(workload.warmup_requests):
                rec = await stream_one(client, completion_body(model, warm_spec, workload), time.perf_counter())
                if not rec.ok:
                    raise RuntimeError(f"warm-up request to {base_url} failed: {rec.error}")

        queue: asyncio.Queue[RequestSpec] = asyncio.Queue()
        for spec in specs:
            queue.put_nowait(spec)
        records: list[RequestRecord] = []
        bar = _progress_bar(len(specs), f"{server_label}/{workload.name}", progress)

        async def worker(t0: float) -> None:
            while True:
                try:
                    spec = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                records.append(await stream_one(client, completion_body(model, spec, workload), t0))
                if bar is not None:
                    bar.update(1)

        load_before = os.getloadavg()[0]
        with MemorySampler(server_pid) as sampler:
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(t0) for _ in range(min(workload.concurrency, len(specs)))))
            duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()

    load_after = os.getloadavg()[0]
    result = summarize(
        records,
        duration,
        server=server_label,
        model=model,
        workload=workload,
        peak_memory_mib=sampler.peak_rss_mib,
        peak_memory_hwm_mib=sampler.vm_hwm_mib(),
    )
    sized = [s.prompt_tokens for s in specs if s.prompt_tokens >= 0]
    result.extra["prompt_tokens_by_tokenize_mean"] = statistics.fmean(sized) if sized else None
    # Other processes on the machine skew every number: keep the 1-minute load average next to them.
    result.extra["load_avg_1m"] = {"before": load_before, "after": load_after}
    if result.num_failed:
        logger.warning("%d of %d requests failed: %s", result.num_failed, result.num_requests, result.errors)
    return result


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False)


# --------------------------------------------------------------------------- reporting

_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (header, BenchResult attribute, format)
    ("requests", "num_requests", "{:d}"),
    ("failed", "num_failed", "{:d}"),
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.1f}"),
    ("ITL p50 (ms)", "itl_p50_ms", "{:.2f}"),
    ("ITL p99 (ms)", "itl_p99_ms", "{:.2f}"),
    ("output tok/s", "output_tokens_per_s", "{:.1f}"),
    ("tok/s per request", "output_tokens_per_s_per_request", "{:.1f}"),
    ("req/s", "requests_per_s", "{:.3f}"),
    ("peak mem (MiB)", "peak_memory_mib", "{:.0f}"),
)


def format_value(value: Any, fmt: str) -> str:
    if value is None:
        return "—"
    return fmt.format(value)


def markdown_table(results: Sequence[BenchResult]) -> str:
    """One row per result: server, workload and the reported statistics."""
    headers = ["server", "workload", *(h for h, _, _ in _COLUMNS)]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    for r in results:
        cells = [r.server, str(r.workload.get("name", "")), *(format_value(getattr(r, a), f) for _, a, f in _COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(results: Sequence[BenchResult], json_path: Path | None, markdown_path: Path | None) -> None:
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps([r.to_dict() for r in results], indent=2) + "\n")
    if markdown_path is not None:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        markdown_path.write_text(markdown_table(results) + "\n")


# --------------------------------------------------------------------------- command line


def _length_range(text: str) -> tuple[int, int | None]:
    """'110' -> (110, None); '80-140' -> (80, 140): uniform draw per request."""
    if "-" in text:
        lo, hi = text.split("-", 1)
        return int(lo), int(hi)
    return int(text), None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (or .../v1)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name sent in each request")
    parser.add_argument("--server-label", default="server", help="name of the server in the report")
    parser.add_argument("--num-requests", "-n", type=int, default=16)
    parser.add_argument("--concurrency", "-c", type=int, default=1, help="requests in flight")
    parser.add_argument("--prompt-len", default="110", help="prompt tokens: N, or LO-HI drawn per request")
    parser.add_argument("--output-len", default="128", help="output tokens: N, or LO-HI drawn per request")
    parser.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at EOS")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1, help="warm-up requests before timing")
    parser.add_argument(
        "--json-schema",
        nargs="?",
        const=STRUCTURED_SCHEMA,
        default=None,
        help="every output must match this JSON schema (JSON text; without a value: an object holding one "
        "free string, so outputs can run to --output-len)",
    )
    parser.add_argument(
        "--task",
        choices=TASKS,
        default="words",
        help="words: completion prompts of seeded words; rewrite: chat requests to correct the spelling of a "
        "seeded ~--prompt-len-token passage (the answer copies its input); chat: free-form chat questions",
    )
    parser.add_argument(
        "--no-speculative", action="store_true", help="ask each request to opt out of speculative decoding"
    )
    parser.add_argument("--server-pid", type=int, default=None, help="server PID for peak-memory sampling")
    parser.add_argument("--json", type=Path, default=None, help="write the result as JSON here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the Markdown table here")
    parser.add_argument("--no-progress", action="store_true")


def workload_from_args(args: argparse.Namespace) -> Workload:
    prompt_len, prompt_max = _length_range(args.prompt_len)
    output_len, output_max = _length_range(args.output_len)
    return Workload(
        name=f"n{args.num_requests}-c{args.concurrency}-p{args.prompt_len}-o{args.output_len}"
        + ("-json" if args.json_schema else "")
        + (f"-{args.task}" if args.task != "words" else "")
        + ("-nospec" if args.no_speculative else ""),
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        prompt_len=prompt_len,
        prompt_len_max=prompt_max,
        output_len=output_len,
        output_len_max=output_max,
        ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature,
        seed=args.seed,
        warmup_requests=args.warmup,
        json_schema=args.json_schema,
        task=args.task,
        speculative=False if args.no_speculative else None,
    )


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the table
    try:
        workload = workload_from_args(args)
    except ValueError as exc:
        logger.error("bad workload: %s", exc)
        return 2
    try:
        result = asyncio.run(
            run_benchmark(
                args.base_url,
                args.model,
                workload,
                server_label=args.server_label,
                server_pid=args.server_pid,
                progress=not args.no_progress,
            )
        )
    except (httpx.HTTPError, RuntimeError) as exc:
        logger.error("benchmark failed: %s", exc)
        return 1
    print(markdown_table([result]))
    write_results([result], args.json, args.markdown)
    return 0 if result.num_failed == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("KVSERVE_LOG_LEVEL", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    parser = argparse.ArgumentParser(prog="kvserve bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
