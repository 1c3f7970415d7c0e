"""The `kvserve serve` flags: FLAGS, the one table argparse, the KVSERVE_<NAME> variables and the defaults
are all built from (server/cli/args.py), and that server/ray/app.py parses a Serve config's args with."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from engine.config import (
    KV_CACHE_DTYPES,
    POOLING_MODES,
    PREFILL_DTYPES,
    SPECULATIVE_METHODS,
    SUPPORTED_DTYPES,
    TOKEN_ID_INPUT_MODES,
)
from server.cli.kinds import (
    boolean,
    byte_size,
    duration,
    json_object,
    key_file,
    key_list,
    memory_budget,
    model_list,
    name_list,
    one_of,
    optional,
    path_text,
)
from server.config import LOG_LEVELS, METRICS_NAMES, REASONING_PARSERS
from server.http.access import PREFIX_CACHE_SCOPES
from server.ray.scale_out import MODEL_DEPLOYMENTS, ROUTINGS

ENV_PREFIX = "KVSERVE_"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


@dataclasses.dataclass(frozen=True)
class Flag:
    """One `kvserve serve` flag: `--<name>` and KVSERVE_<NAME>.

    targets: where its value goes, as (config, field) pairs; config is "server" (ServerConfig), "catalogue"
    (where more models come from: server/catalogue/sources.py),
    "engine" (EngineConfig), "embedder" (EmbedderConfig), "reranker" (RerankerConfig) or "speculative"
    (SpeculativeConfig, the engine's `speculative`). Its default is the first target's (a reranker field's:
    None, since no rerank model is served by default; the speculative method's: None, speculation off).
    scale_out: instead of targets, the ScaleOut field it sets (server/ray/scale_out.py): how many replicas
    run, not how each one serves, so no replica's config holds it.
    """

    name: str
    targets: tuple[tuple[str, str], ...]
    kind: Callable[[str], Any]
    help: str
    scale_out: str | None = None
    # Given several times, its values add up (a tuple); flags of one field add up too.
    repeatable: bool = False


def _flag(name: str, target: str, kind: Callable[[str], Any], help_text: str, repeatable: bool = False) -> Flag:
    """target: "server", "engine", "embedder", "reranker", "speculative", or several joined by "+"; the field
    is `name` unless the target says "config.field"."""
    targets = []
    for part in target.split("+"):
        config_name, _, field_name = part.partition(".")
        targets.append((config_name, field_name or name))
    return Flag(name, tuple(targets), kind, help_text, repeatable=repeatable)


def _scale_flag(name: str, field_name: str, kind: Callable[[str], Any], help_text: str) -> Flag:
    return Flag(name, (), kind, help_text, scale_out=field_name)


FLAGS: tuple[Flag, ...] = (
    _flag(
        "model",
        "engine",
        model_list,
        "generation model: a default-model name, a local HF directory or .gguf file, or a Hub id; NAME=PATH "
        "serves it as NAME. Repeat it to serve more: the first is the default (loaded at start), the others "
        "load on their first request",
        repeatable=True,
    ),
    _flag(
        "embedding_model",
        "embedder.model",
        model_list,
        "embedding model (same forms as --model, repeatable the same way); 'none' serves no embeddings",
        repeatable=True,
    ),
    _flag(
        "rerank_model",
        "reranker.model",
        model_list,
        "rerank model, a cross-encoder (BertForSequenceClassification or XLMRobertaForSequenceClassification): "
        "a local HF directory or a Hub id; served by /v1/rerank, /rerank and /v1/score ('none': no reranking); "
        "repeatable as --model is",
        repeatable=True,
    ),
    _flag(
        "models_dir",
        "catalogue",
        optional(path_text("DIR")),
        "serve every .gguf file and model folder in DIR too, each under its file or folder name, loaded on its "
        "first request (folders of encoders serve embeddings, of ...ForSequenceClassification reranking)",
    ),
    _flag(
        "models_file",
        "catalogue",
        optional(path_text("FILE")),
        "a TOML file of [[models]] tables (name, path, role, keep_alive, preload, and any engine setting of "
        "its role such as max_model_len, quantization, kv_cache_memory, speculative_method) served too",
    ),
    _flag(
        "keep_alive",
        "server",
        duration,
        "how long a model loaded on demand stays loaded once idle (seconds, or 90s, 5m, 1h; -1: forever); a "
        "request's keep_alive overrides it for its model",
    ),
    _flag(
        "max_loaded_models",
        "server",
        optional(int),
        "most models loaded at once; past it the least recently used idle model is unloaded (none: no limit)",
    ),
    _flag(
        "memory_budget",
        "server",
        memory_budget,
        "bytes the loaded models may hold, weights plus KV cache (16GiB), or a fraction of the machine's memory "
        "(0.8: of RAM, or of the GPU's on CUDA); past it the least recently used idle model is unloaded "
        "(none: no budget)",
    ),
    _flag(
        "served_model_name",
        "server",
        name_list,
        "the name clients use for the generation model (default: --model); repeat it (or give a "
        "comma-separated list) for aliases, each accepted by every API and listed by /v1/models, the first "
        "one in every answer's model field",
        repeatable=True,
    ),
    _flag(
        "tokenizer",
        "engine",
        optional(path_text("DIR")),
        "a Hugging Face tokenizer directory (tokenizer.json / tokenizer_config.json) used instead of the "
        "generation model's own tokenizer (for a .gguf: instead of the one its metadata makes); refused when "
        "its ids go past the model's embedding table",
    ),
    _flag(
        "chat_template",
        "engine",
        optional(path_text("FILE")),
        "a Jinja chat template file whose text replaces the generation model's chat template (after "
        "--tokenizer's, with both); checked to compile at start",
    ),
    _flag("host", "server", str, "address to listen on"),
    _flag("port", "server", int, "TCP port to listen on"),
    _flag(
        "dtype",
        "engine+embedder+reranker",
        str,
        f"weights and activations dtype of every model: {', '.join(SUPPORTED_DTYPES)} (float16: CUDA only)",
    ),
    _flag(
        "quantization",
        "engine",
        str,
        "none, int8 (weight-only int8 linear layers, CPU float32), gguf (a .gguf file's own Q4_0 / Q4_1 / Q5_0 / "
        "Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / IQ4_NL / IQ4_XS blocks, other types int8; CPU float32) or auto (gguf "
        "for a .gguf on CPU, else none)",
    ),
    _flag(
        "prefill_dtype",
        "engine",
        one_of(*PREFILL_DTYPES),
        "dtype of the GGUF block layers' prefill products (batches over 64 rows): float32 (the decode kernel's "
        "numbers to float32 rounding) or bfloat16 (each weight tile and the rounded activations cast to it, "
        "float32 accumulation: 2.4-3.3x faster prefill on AVX-512 BF16, further from float32)",
    ),
    _flag(
        "kv_cache_dtype",
        "engine",
        one_of(*KV_CACHE_DTYPES),
        "how the KV cache stores keys and values: float32, float16, bfloat16, int8 (a float32 scale per token "
        "and head) or auto (the model's dtype on CUDA and for unquantized CPU models, float16 on CPU for "
        "quantized weights)",
    ),
    _flag("device", "engine+embedder+reranker", str, "torch device of every model: cpu, cuda, cuda:1, ..."),
    _flag(
        "max_model_len",
        "engine",
        optional(int),
        "longest prompt plus output, in tokens (default: the model's context)",
    ),
    _flag(
        "kv_cache_memory",
        "engine.kv_cache_memory_bytes",
        byte_size,
        "memory for the paged KV cache: bytes or with a unit (512MiB, 2GB)",
    ),
    _flag("block_size", "engine", int, "tokens per KV-cache block (a power of two)"),
    _flag("max_num_seqs", "engine", int, "most sequences in one running batch"),
    _flag("max_num_batched_tokens", "engine", int, "token budget of one engine step (chunked prefill above it)"),
    _flag(
        "long_prefill_token_threshold",
        "engine",
        int,
        "while other requests run, a prompt computes at most this many tokens a step, so a long prompt does not "
        "stop every stream for seconds; a request alone keeps the whole budget (0: no cap)",
    ),
    _flag(
        "greedy_burst",
        "engine",
        int,
        "on the fused CPU decode path, while every running sequence is plain greedy and no request waits, run up "
        "to this many decode steps in one native call (tokens reach streams several at a time; the tokens are "
        "the same); 1: a step at a time",
    ),
    _flag(
        "greedy_burst_ms",
        "engine",
        float,
        "and only as many steps as fit in this many milliseconds at the last steps' pace, so streams get tokens "
        "at least about this often (0: no such cap)",
    ),
    _flag(
        "sliding_window",
        "engine",
        optional(int),
        "force a sliding attention window of this many tokens on any model",
    ),
    _flag("num_sink_tokens", "engine", int, "with a sliding window: the first N tokens stay visible forever"),
    _flag("enable_prefix_caching", "engine", boolean, "reuse KV blocks of shared prompt prefixes (true/false)"),
    _flag(
        "max_queued_requests",
        "server",
        int,
        "most requests waiting to start, for generation and for embeddings each; past it: 429 with Retry-After",
    ),
    _flag(
        "api_key",
        "server.api_keys",
        key_list,
        "require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health (/metrics too); "
        "repeat it (or give a comma-separated list) for several keys, one per client",
        repeatable=True,
    ),
    _flag(
        "api_key_file",
        "server.api_keys",
        key_file,
        "more keys, one per line of this file ('#' starts a comment line); a file with no key is an error",
    ),
    _flag(
        "admin_api_key",
        "server.admin_api_keys",
        key_list,
        "a key that also reads what tells clients about each other's requests: /metrics' prefix-cache "
        "series and /kv_cache's blocks and sequences (repeatable). Without one, only a server's single "
        "--api-key (or everyone, with no key) reads them",
        repeatable=True,
    ),
    _flag(
        "prefix_cache_scope",
        "server",
        one_of(*PREFIX_CACHE_SCOPES),
        "api-key (the default): each API key's requests share cached prompt prefixes only among "
        "themselves, since a cached prefix answers much faster and would tell one client by timing what "
        "another sent (with one key or none it changes nothing); shared: across all keys, split only by "
        "a request's cache_salt",
    ),
    _flag("allowed_origins", "server", str, "comma-separated CORS origins ('*' for any; empty: CORS off)"),
    _flag(
        "request_timeout",
        "server",
        optional(float),
        "seconds a generation or embedding request may take before it is aborted (none: no limit)",
    ),
    _flag(
        "max_request_bytes",
        "server",
        byte_size,
        "largest request body accepted (413 above it): bytes or with a unit",
    ),
    _flag(
        "shutdown_timeout",
        "server",
        float,
        "on SIGTERM/SIGINT, seconds the requests in flight get to finish while new ones get 503 "
        "(the rest then end with 503 shutting_down); a second signal cuts them at once",
    ),
    _flag(
        "max_client_batch_size",
        "server",
        int,
        "most prompts or inputs in one completions or embeddings request (413 above it)",
    ),
    _flag(
        "max_request_cost",
        "server",
        optional(int),
        "most tokens one completions or chat request may hold: prompts x n x (prompt tokens + max_tokens, "
        "at most the context length); above it: 400 request_too_large "
        "(default: the KV cache's capacity, at least 8 contexts)",
    ),
    _flag(
        "max_request_logprobs",
        "server",
        int,
        "most logprob entries one generation request may return (each listed token and alternative: prompt "
        "logprobs, echoed ones and sampled tokens', over every choice, max_tokens counted in full); "
        "above it: 400 request_too_large",
    ),
    _flag(
        "embedding_max_batch_tokens",
        "embedder.max_batch_tokens+reranker.max_batch_tokens",
        int,
        "token budget of one embedding (or rerank) forward pass",
    ),
    _flag(
        "default_max_tokens",
        "server",
        optional(int),
        "max_tokens of a generation request that sets none (default: chat and responses run to the context "
        "limit, as OpenAI and vLLM do; completions stop at 16, OpenAI's default there)",
    ),
    _flag(
        "embedding_token_ids",
        "embedder.token_ids",
        one_of(*TOKEN_ID_INPUT_MODES),
        "token-id input to the embedding routes: check (default; only what the embedding model's tokenizer "
        "makes of a text, special tokens included: refuses e.g. tiktoken's ids), accept (any id in the "
        "vocabulary), reject (text only)",
    ),
    _flag(
        "pooling",
        "embedder",
        optional(str),
        f"embedding pooling, one of {', '.join(POOLING_MODES)} (default: the model's own)",
    ),
    _flag(
        "timeout_keep_alive",
        "server",
        float,
        "seconds an idle keep-alive connection is held open after a response",
    ),
    _flag(
        "timeout_request_head",
        "server",
        float,
        "seconds a connection gets to send a complete request head, from its opening or its previous "
        "response; then it is closed (408 if a head was begun). Requests under way are not affected",
    ),
    _flag(
        "timeout_request_body",
        "server",
        float,
        "seconds a request's whole body gets to arrive once its head is in; then 408 and the connection "
        "closed. 60 carries a --max-request-bytes body (2MiB) over a ~300 kbit/s link, while a body "
        "trickled byte by byte holds its request slot no longer; responses (SSE streams too) are not affected",
    ),
    _flag(
        "limit_concurrency",
        "server",
        optional(int),
        "most requests in progress at once (from a complete head to the end of the answer; idle "
        "connections hold none); past it: a plain-text 503. /health is always answered (none: no cap)",
    ),
    _flag(
        "max_connections_per_client",
        "server",
        optional(int),
        "most open connections from one client address; further ones are closed at once. 512 is above "
        "what one client can have admitted at the defaults (--max-num-seqs + --max-queued-requests: 320) "
        "plus idle pooled connections; behind a proxy every client shares its address (none: no cap)",
    ),
    _flag(
        "max_request_head_bytes",
        "server",
        byte_size,
        "largest request line plus headers, blank line included, however the head is split into reads "
        "(400 and the connection closed above it): bytes or with a unit",
    ),
    _flag("log_level", "server", str, f"logging level: {', '.join(LOG_LEVELS)}"),
    _flag(
        "metrics_names",
        "server",
        one_of(*METRICS_NAMES),
        "names of the /metrics series vLLM also has: kvserve (kvserve: prefix), vllm (vLLM's exact vllm: "
        "names, read by dashboards, autoscalers and routers built for vLLM) or both (the default: kvserve's "
        "and vLLM's tooling both work with no flag, for a /metrics page about twice as long)",
    ),
    _flag(
        "playground",
        "server",
        boolean,
        "serve the browser playground at GET / and its two routes, POST /attention and GET /kv_cache "
        "(false, or --no-playground: all three are gone, 404; GET / 405, as POST / stays TEI's embed route)",
    ),
    _flag(
        "allow_special_tokens_in_content",
        "server",
        boolean,
        "chat messages (and /tokenize messages): a special token's text in a client's string is that token, "
        "as if the template wrote it (default false: it is text, and only the template's markers are tokens)",
    ),
    _flag(
        "reasoning_parser",
        "server",
        one_of(*REASONING_PARSERS),
        "split a reasoning model's <think>...</think> from its answer: chat's message.reasoning_content, "
        "streamed as delta.reasoning_content, and Responses' reasoning items (think, qwen3 and deepseek_r1 "
        "are one parser; default none: the output is all content)",
    ),
    _flag(
        "default_chat_template_kwargs",
        "server",
        json_object,
        "a JSON object of chat template variables every chat request gets, under its own "
        "chat_template_kwargs (e.g. '{\"enable_thinking\": false}')",
    ),
    _flag("num_threads", "engine", optional(int), "torch CPU threads (default: torch's choice)"),
    _flag(
        "speculative_method",
        "speculative.method",
        optional(one_of(*SPECULATIVE_METHODS)),
        "speculative decoding: ngram (drafts copied from the prompt and the output so far) or draft (drafts "
        "from --draft-model); none: off. Greedy output is unchanged, sampled output keeps its distribution",
    ),
    _flag(
        "num_speculative_tokens",
        "speculative",
        int,
        "with --speculative-method: most draft tokens verified per sequence and step (1 to 16)",
    ),
    _flag(
        "ngram_min",
        "speculative",
        int,
        "with --speculative-method ngram: the shortest tail of the text looked up for an earlier occurrence",
    ),
    _flag(
        "ngram_max",
        "speculative",
        int,
        "with --speculative-method ngram: the longest tail looked up first (at least --ngram-min)",
    ),
    _flag(
        "draft_model",
        "speculative",
        optional(str),
        "with --speculative-method draft: the draft model (same forms as --model), small, with --model's tokenizer",
    ),
    _flag(
        "draft_quantization",
        "speculative",
        str,
        "with --speculative-method draft: the draft model's --quantization (a quantized copy of --model "
        "itself is a draft that reads a fraction of its bytes)",
    ),
    _scale_flag(
        "replicas",
        "replicas",
        int,
        "run this many replicas (one engine each) on a local Ray Serve instance behind one address; "
        "0: one process, no Ray. Needs pip install 'kvserve[ray]'",
    ),
    _scale_flag(
        "max_replicas",
        "max_replicas",
        optional(int),
        "with --replicas N: autoscale between N and this many replicas on ongoing requests per replica "
        "(target: --max-num-seqs); none: exactly N",
    ),
    _scale_flag(
        "replica_routing",
        "routing",
        one_of(*ROUTINGS),
        "with --replicas: prefix (requests sharing a prompt prefix go to one replica, so its prefix cache "
        "pays off; the least-loaded one when that replica is busy) or least-loaded",
    ),
    _scale_flag(
        "model_deployments",
        "model_deployments",
        one_of(*MODEL_DEPLOYMENTS),
        "with --replicas: shared (every replica serves every model, loading them when asked) or per-model "
        "(each model a Ray Serve deployment of its own with --replicas replicas, routed by the request's "
        "model name)",
    ),
    _scale_flag(
        "replica_metrics_port",
        "metrics_port",
        int,
        "with --replicas: port of the Prometheus endpoint carrying every replica's series, on 127.0.0.1 "
        "(0: a free port, logged at start)",
    ),
)
