"""The reference page's words for each `kvserve serve` flag (server/cli/flags.py holds the flags themselves):
the longer Markdown meaning the configuration page shows beside the flag's environment variable and default, and
a note on the default where the configs' value alone does not say it (what an unset value means, or where the
image differs). server/cli/reference.py renders the page from FLAGS, their defaults and these; a test fails
when a flag has no entry here or an entry names no flag."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FlagDoc:
    """meaning: Markdown for the reference page. default_note: for an unset default (None, empty), what that
    means (shown instead of "none"); for a set one, a remark shown after the value in parentheses."""

    meaning: str
    default_note: str = ""


FLAG_DOCS: dict[str, FlagDoc] = {
    "model": FlagDoc(
        (
            "generation model: a default-model name, a local HF folder or `.gguf` file, or a Hub id; `NAME=PATH` "
            "serves it as `NAME`. Repeat it to serve several: the first is the default (loaded at start), the "
            "others load on their first request (see [Several models](several-models.md))"
        ),
    ),
    "embedding_model": FlagDoc(
        "embedding model (same forms, repeatable the same way); `none` serves no embeddings",
    ),
    "rerank_model": FlagDoc(
        (
            "rerank model, a one-label cross-encoder (local HF folder or Hub id: see "
            "[Reranking](../api/embeddings-and-reranking.md#reranking)); served by `/rerank`, "
            "`/v1/rerank`, `/v1/score`; its forwards take `--dtype`, `--device` and `--embedding-max-batch-tokens`"
        ),
    ),
    "models_dir": FlagDoc(
        (
            "serve every `.gguf` file and model folder in the directory too, each under its file or folder name "
            "and loaded on its first request (encoder folders serve embeddings, `...ForSequenceClassification` "
            "ones reranking)"
        ),
        default_note="no directory",
    ),
    "models_file": FlagDoc(
        (
            "a TOML file of `[[models]]` tables (`name`, `path`, `role`, `keep_alive`, `preload`, and any engine "
            "setting of the role, such as `max_model_len`, `quantization`, `kv_cache_memory`, "
            "`speculative_method`): see [Several models](several-models.md#a-models-file)"
        ),
        default_note="no file",
    ),
    "keep_alive": FlagDoc(
        (
            "how long a model loaded on demand stays loaded once idle: seconds, or `90s`, `5m`, `1h`; negative: "
            "forever. A request's `keep_alive` (Ollama's field) overrides it for its model"
        ),
    ),
    "max_loaded_models": FlagDoc(
        "most models loaded at once; past it the least recently used idle model is unloaded first",
        default_note="no limit",
    ),
    "memory_budget": FlagDoc(
        (
            "bytes the loaded models may hold, weights plus KV cache (`16GiB`), or a fraction of the machine's "
            "memory (`0.8`: of RAM, or of the GPU's for a CUDA model); past it the least recently used idle "
            "model is unloaded first, and a model that alone needs more is refused (400 `model_too_large`)"
        ),
        default_note="no budget",
    ),
    "served_model_name": FlagDoc(
        (
            "the name clients use for the generation model; repeat it (or give a comma-separated list) for "
            "aliases: every API accepts each one, `/v1/models` lists each, and answers name the first"
        ),
        default_note="the `--model` value",
    ),
    "tokenizer": FlagDoc(
        (
            "a Hugging Face tokenizer directory (`tokenizer.json` / `tokenizer_config.json`) used instead of the "
            "generation model's tokenizer; for a `.gguf` file, instead of the one transformers makes from its metadata "
            "(a file with no tokenizer in it needs one). Refused at start, in one line, when the directory holds no "
            "tokenizer or its ids go past the model's embedding table (a smaller vocabulary is fine)"
        ),
        default_note="the model's own",
    ),
    "chat_template": FlagDoc(
        (
            "a Jinja file whose text replaces the chat template (the model's, or `--tokenizer`'s), for a model that "
            "carries none or a wrong one; compiled at start with transformers' Jinja environment (a file that is "
            "missing or does not parse is refused in one line). The log says where the template came from; tool-call "
            "format and control tokens follow it"
        ),
        default_note="the tokenizer's own",
    ),
    "host": FlagDoc(
        "address to listen on",
        default_note="`0.0.0.0` in Docker",
    ),
    "port": FlagDoc(
        "TCP port",
    ),
    "dtype": FlagDoc(
        "`float32`, `bfloat16`, or `float16` (CUDA)",
    ),
    "quantization": FlagDoc(
        (
            "`gguf`: a `.gguf` file's matrices stay in its own Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K "
            "/ IQ4_NL / IQ4_XS blocks and run in AVX2 integer kernels (other block types are dequantized and "
            "rounded to int8, with a warning naming them; CPU, float32; see [Kernels](../engine/kernels.md)); "
            "`int8`: weight-only int8 linear layers with an AVX2 kernel for decode (CPU, float32); `none`: weights "
            "in `--dtype`; `auto`: `gguf` for a `.gguf` model on CPU in float32, else `none`"
        ),
    ),
    "prefill_dtype": FlagDoc(
        (
            "dtype of the GGUF block layers' products over more than 64 rows (prefill): `float32` (the decode kernel's "
            "numbers to float32 rounding) or `bfloat16` (each weight tile dequantized to it and the rounded "
            "activations cast to it, float32 accumulation: 2.4-3.3x faster prefill on AVX-512 BF16, KL to float32 "
            "1.2x; see [Kernels](../engine/kernels.md))"
        ),
    ),
    "kv_cache_dtype": FlagDoc(
        (
            "how the KV cache stores keys and values: `float32`, `float16`, `bfloat16`, or `int8` (each token's "
            "key and value per head as int8 with a float32 scale: 0.53x the bytes of a 16-bit cache at head size "
            "64); `auto`: the model's dtype on CUDA and for unquantized CPU models (so float32 stays exact), "
            "`float16` on CPU for int8 or GGUF weights. Every attention path reads every format; see "
            "[KV cache](../engine/kv-cache.md#cache-formats)"
        ),
    ),
    "device": FlagDoc(
        "`cpu`, `cuda`, `cuda:1`, ...",
    ),
    "max_model_len": FlagDoc(
        "longest prompt plus output, in tokens",
        default_note="the model's context",
    ),
    "kv_cache_memory": FlagDoc(
        "memory for the paged KV cache (bytes or `2GB`, `512MiB`)",
    ),
    "block_size": FlagDoc(
        "tokens per KV-cache block",
    ),
    "max_num_seqs": FlagDoc(
        "most sequences in one running batch",
    ),
    "max_num_batched_tokens": FlagDoc(
        "token budget of one engine step (chunked prefill above it)",
    ),
    "long_prefill_token_threshold": FlagDoc(
        (
            "while other requests run, a prompt computes at most this many tokens a step: streams pause for a "
            "512-token chunk, not a whole budget's; a request alone keeps the whole budget; `0`: no cap "
            "([scheduling](../engine/architecture.md))"
        ),
    ),
    "greedy_burst": FlagDoc(
        (
            "on the fused CPU decode path (GGUF or int8 weights), while every running sequence is plain greedy (no "
            "logprobs, penalties, logit bias, structured output or pending `min_tokens`) and no request waits: run "
            "up to this many decode steps in one native call, with no Python between the tokens. Streams get their "
            "tokens several at a time; the tokens are the same as one step at a time. A request that arrives, "
            "leaves or hits a stop string ends a burst after its current step; `1`: a step at a time (see "
            "[Greedy bursts](../engine/architecture.md#greedy-bursts))"
        ),
    ),
    "greedy_burst_ms": FlagDoc(
        (
            "and only as many steps as fit in this many milliseconds at the last decode steps' pace, so a stream "
            "gets tokens at least about this often (a 135M model's ~5 ms steps: 16 a burst; a 1B model's ~25 ms: "
            "4; a 150 ms step: none); `0`: no such cap"
        ),
    ),
    "sliding_window": FlagDoc(
        "force a sliding attention window of this many tokens",
        default_note="model's own / none",
    ),
    "num_sink_tokens": FlagDoc(
        "with a sliding window: first N tokens stay visible",
    ),
    "enable_prefix_caching": FlagDoc(
        "reuse KV blocks of shared prompt prefixes",
    ),
    "max_queued_requests": FlagDoc(
        ("most requests waiting to start, for generation and for embeddings each; past it: 429 with `Retry-After`"),
    ),
    "api_key": FlagDoc(
        (
            "require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every route but `/health` "
            "(`/metrics` included); repeat it, or give a comma-separated list, for several keys (one per client)"
        ),
    ),
    "api_key_file": FlagDoc(
        ("more keys, one per line (blank lines and lines starting with `#` skipped); a file with no key is an error"),
    ),
    "admin_api_key": FlagDoc(
        (
            "repeatable; a key that can do all a key can, and also reads `/metrics`' prefix-cache series and "
            "`/kv_cache`'s `blocks` and `sequences`; with none, only a server's single `--api-key` (or anyone, with no "
            "key) does"
        ),
    ),
    "prefix_cache_scope": FlagDoc(
        (
            "`api-key`: each API key's requests share cached prompt prefixes only among themselves (a salt derived "
            "from the key by HMAC, with the request's `cache_salt`), so timing cannot tell one client what another "
            "sent; with one key or none it changes nothing; `shared`: across keys, split only by `cache_salt`"
        ),
    ),
    "allowed_origins": FlagDoc(
        "comma-separated CORS origins, `*` for any",
        default_note="empty (CORS off)",
    ),
    "request_timeout": FlagDoc(
        "seconds a generation or embedding request may take before it is aborted (504)",
    ),
    "max_request_bytes": FlagDoc(
        "largest request body (413 above it)",
    ),
    "shutdown_timeout": FlagDoc(
        (
            "on SIGTERM/SIGINT, seconds the requests in flight get to finish while new ones get 503; the rest then end "
            "with 503 `shutting_down`; a second signal cuts them at once (8 s plus the ~0.5 s the stop takes fit "
            "Docker's 10 s)"
        ),
    ),
    "max_client_batch_size": FlagDoc(
        "most prompts or inputs in one completions or embeddings request (413 above it)",
    ),
    "max_request_cost": FlagDoc(
        (
            "most tokens one completions or chat request may hold: prompts x `n` x (prompt tokens + `max_tokens`, at "
            "most `max_model_len`); above it: 400 `request_too_large`"
        ),
        default_note="the KV cache's capacity in tokens, at least 8 x `max_model_len`",
    ),
    "max_request_logprobs": FlagDoc(
        (
            "most logprob entries one completions or chat request may return: each listed token and each alternative, "
            "over every prompt token listed (`prompt_logprobs`, and echo's `logprobs`, in every choice for "
            "completions) and every token it may generate (n x `max_tokens`, unset: the rest of the context, x "
            "(`logprobs` + 1)); above it: 400 `request_too_large`"
        ),
    ),
    "embedding_max_batch_tokens": FlagDoc(
        (
            "token budget of one embedding forward pass while generation is idle (while it runs, a forward holds one "
            "generation step's worth: see [How it works](../engine/architecture.md))"
        ),
    ),
    "pooling": FlagDoc(
        "embedding pooling (`mean`, `cls`, `last`)",
        default_note="the model's own",
    ),
    "embedding_token_ids": FlagDoc(
        (
            "token-id input to the embedding routes: `check` takes only what the embedding model's tokenizer makes of "
            "a text, special tokens included (see [Embeddings from token "
            "ids](../api/embeddings-and-reranking.md#embeddings-from-token-ids)), `accept` takes any id in the "
            "vocabulary, "
            "`reject` takes text only; refused input is a 400 `invalid_token_ids`"
        ),
    ),
    "default_max_tokens": FlagDoc(
        (
            "`max_tokens` of a generation request that sets none; unset, chat and responses run to the context limit "
            "(as OpenAI and vLLM do) and completions stop at 16 (OpenAI's default there)"
        ),
    ),
    "timeout_keep_alive": FlagDoc(
        "seconds an idle keep-alive connection is held open after a response, then closed",
    ),
    "timeout_request_head": FlagDoc(
        (
            "seconds a connection gets to send a complete request head, counted from when it opens or from its "
            "previous response; then the server closes it (with a `408 Request Timeout` if part of a head arrived). "
            "Requests whose head is complete (slow body uploads, SSE streams) are not affected"
        ),
    ),
    "timeout_request_body": FlagDoc(
        (
            "seconds a request's whole body gets to arrive once its head is in; then `408 Request Timeout` and the "
            "connection closed. 60 s carries a `--max-request-bytes` body (2 MiB) over a ~300 kbit/s link; a body "
            "trickled byte by byte holds its request slot no longer. Responses, SSE streams included, are not affected"
        ),
    ),
    "limit_concurrency": FlagDoc(
        (
            "most requests in progress at once (from a complete head to the answer's last byte): a request that finds "
            "this many gets a plain-text 503; `none`: no cap. Open connections between requests hold no slot, and "
            "`/health` is always answered, so idle sockets cannot starve requests or a liveness probe"
        ),
    ),
    "max_connections_per_client": FlagDoc(
        (
            "most open connections from one client address; further ones are closed at once (one log line per address "
            "every 10 s); `none`: no cap. 512 is above what one client can have admitted at the defaults "
            "(`--max-num-seqs` + `--max-queued-requests` = 320) plus idle pooled connections; behind a proxy or load "
            "balancer every client shares its address, so raise it or set `none` there"
        ),
    ),
    "max_request_head_bytes": FlagDoc(
        (
            "largest request line plus headers, line endings and the blank line included, however the head is split "
            "into reads (one read or many, pipelined or kept alive); a longer head gets 400 and its connection closed"
        ),
    ),
    "log_level": FlagDoc(
        "`debug`, `info`, `warning`, `error`, `critical`",
    ),
    "metrics_names": FlagDoc(
        (
            "names of the `/metrics` series vLLM also has: `kvserve` (`kvserve:` names), `vllm` (vLLM's exact `vllm:` "
            "names, which dashboards, autoscalers and routers built for vLLM read) or `both`, so both kinds of tooling "
            "work with no flag, for a page about twice as long (see [Metrics](../api/metrics.md))"
        ),
    ),
    "playground": FlagDoc(
        (
            "serve the browser playground at `GET /` and its two routes, `POST /attention` and `GET /kv_cache`; "
            "`--no-playground` (or `false`) turns all three off (404; `GET /` 405, as `POST /` stays TEI's embed route)"
        ),
    ),
    "allow_special_tokens_in_content": FlagDoc(
        (
            "`true`: a special token's text in a chat message (content, name, tool-call arguments, tool definitions; "
            "chat, responses and `/tokenize` messages) is that token, as before; `false`: it is text, and only the "
            "chat template's own markers are control tokens (see [Endpoints](../api/endpoints.md))"
        ),
    ),
    "reasoning_parser": FlagDoc(
        (
            "`think` (also named `qwen3` and `deepseek_r1`): a reasoning model's `<think>...</think>` is split from "
            "its answer, as `reasoning_content` beside `content` in chat and as reasoning items in Responses; "
            "structured output and tool calls apply to the answer. Refused at start when the vocabulary has "
            "no `<think>` and `</think>` tokens (see [Reasoning models](../api/reasoning.md))"
        ),
    ),
    "default_chat_template_kwargs": FlagDoc(
        (
            "a JSON object of chat template variables for every chat and responses request, "
            "e.g. `'{\"enable_thinking\": false}'`; a request's `chat_template_kwargs` override them"
        ),
    ),
    "num_threads": FlagDoc(
        "torch CPU threads",
        default_note="torch's choice",
    ),
    "speculative_method": FlagDoc(
        (
            "speculative decoding: `ngram` (drafts copied from earlier in the prompt and output) or `draft` (drafts "
            "from `--draft-model`); see [Speculative decoding](../engine/speculative-decoding.md)"
        ),
        default_note="none (off)",
    ),
    "num_speculative_tokens": FlagDoc(
        (
            "with `--speculative-method`: most draft tokens verified per sequence and step, 1 to 16 (3 fills the GGUF "
            "kernel's 4-row tile: a token and its drafts)"
        ),
    ),
    "ngram_min": FlagDoc(
        "with `ngram`: the shortest tail of the text (in tokens) looked up earlier in it",
    ),
    "ngram_max": FlagDoc(
        "with `ngram`: the longest tail looked up, tried first; at least `--ngram-min`",
    ),
    "draft_model": FlagDoc(
        (
            "with `draft` (and only then: set without it, it is an error): the draft model, in `--model`'s forms, with "
            "`--model`'s tokenizer"
        ),
    ),
    "draft_quantization": FlagDoc(
        (
            "with `draft`: the draft model's `--quantization` (`none`, `int8`, `gguf`, `auto`); a quantized copy of "
            "`--model` itself makes a draft that agrees with it most of the time and reads a fraction of its bytes"
        ),
    ),
    "replicas": FlagDoc(
        (
            "run this many replicas, one engine each, on a local Ray Serve instance behind one address (see "
            "[Scale-out on Ray Serve](ray-serve.md)); `0`: one process, no Ray. Needs `pip install 'kvserve[ray]'`"
        ),
    ),
    "max_replicas": FlagDoc(
        (
            "with `--replicas N`: autoscale between N and this many replicas on ongoing requests per replica (target: "
            "`--max-num-seqs`); none: exactly N"
        ),
    ),
    "replica_routing": FlagDoc(
        (
            "with `--replicas`: `prefix` sends requests that share a prompt prefix to one replica, so its prefix cache "
            "pays off (the least-loaded replica when that one is busy); `least-loaded`: Ray Serve's power of two "
            "choices"
        ),
    ),
    "model_deployments": FlagDoc(
        (
            "with `--replicas`: `shared`, every replica serves every catalogue model (loading each when asked); "
            "`per-model`, each model is a Ray Serve deployment of its own with `--replicas` replicas, and a "
            "request goes to the one of the model it names (see [Scale-out on Ray Serve](ray-serve.md))"
        ),
    ),
    "replica_metrics_port": FlagDoc(
        ("with `--replicas`: port on 127.0.0.1 of the Prometheus endpoint that carries every replica's series"),
        default_note="a free port, logged",
    ),
}
