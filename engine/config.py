"""Frozen configuration, each validated once in its own __post_init__.

`EngineConfig`, `EmbedderConfig` and `RerankerConfig` are what a user sets for the generation,
the embedding and the rerank model (server/cli/args.py builds them from `kvserve serve` flags).
`ModelConfig` is what the model's own files say, resolved at load time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_DTYPES = tuple(TORCH_DTYPES)
# The values of `--quantization`: one per method of engine/quantization/ (none, int8, gguf: how each
# loads and which layer replaces nn.Linear), and auto, which engine.quantization.resolve decides per
# checkpoint (gguf for a GGUF file on CPU in float32, none otherwise).
QUANTIZATION_MODES = ("none", "int8", "gguf", "auto")
# The methods whose layers run only on CPU with float32 activations.
CPU_FLOAT32_QUANTIZATIONS = ("int8", "gguf")
# The values of `--prefill-dtype`: the dtype GGUF block layers multiply large batches (prefill) in.
PREFILL_DTYPES = ("float32", "bfloat16")
# The values of `--kv-cache-dtype`: how the KV cache stores keys and values (engine/ops/kv_format.py);
# auto is decided there (resolve_kv_cache_dtype) from the device, the dtype and the quantization.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
# How an embedding model turns per-token hidden states into one vector (engine/pooling/embedder.py `pool`).
POOLING_MODES = ("mean", "cls", "last")


def check_dtype(dtype: str, device: str) -> None:
    """The dtype rules every model follows: a known dtype, and float16 only on CUDA."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
    if dtype == "float16" and not device.startswith("cuda"):
        raise ValueError("dtype float16 is only supported on CUDA; use float32 or bfloat16 on CPU")


SPECULATIVE_METHODS = ("ngram", "draft")
MAX_GREEDY_BURST = 64  # greedy decode steps in one native call, at most
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: propose up to `num_speculative_tokens` tokens per step, verify them in one forward.

    method: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the last
        n tokens, n from ngram_max down to ngram_min) or "draft" (a smaller model with the same
        tokenizer, `draft_model`, proposing greedily from its own paged KV cache).
    draft_quantization: the draft model's QUANTIZATION_MODES entry (a quantized copy of the target
        itself is a draft that agrees with it most of the time and reads a fraction of its bytes).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str | None = None
    draft_quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.draft_quantization not in QUANTIZATION_MODES:
            raise ValueError(f"draft quantization must be one of {QUANTIZATION_MODES}, got {self.draft_quantization!r}")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method draft needs a draft model (--draft-model)")
        if self.method != "draft" and self.draft_model:
            raise ValueError("a draft model is only used with speculative method draft")


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division: how many blocks of `denominator` tokens hold `numerator` tokens."""
    return -(-numerator // denominator)


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an LLMEngine.

    model: a default-model alias (see engine.hub.models_hub), a local HF directory,
        a local .gguf file, or a Hub id.
    kv_cache_memory_bytes: budget for the KV block pool; num_blocks overrides it.
    sliding_window: force a window on any model (None: the model's own, if any).
    num_sink_tokens: with a window, the first S tokens stay visible forever.
    long_prefill_token_threshold: while more than one request is in the engine, a prompt's chunk per step is
        at most this many tokens, so one long prompt does not stop every stream for seconds (0: no cap).
    quantization: one of QUANTIZATION_MODES; engine/loader.py resolves auto (engine.quantization.resolve).
    prefill_dtype: one of PREFILL_DTYPES: the dtype of the GGUF block layers' products over more rows than
        their integer kernel takes (prefill): the weight tile dequantized to it and the rounded activations
        cast to it. bfloat16 is several times faster where the CPU multiplies it in hardware (AVX-512 BF16,
        AMX) and further from float32 (docs/engine/kernels.md); float32 gives the decode kernel's numbers.
    kv_cache_dtype: one of KV_CACHE_DTYPES: the KV cache's format. float16 / bfloat16 halve a float32
        cache, int8 (a float32 scale per token and head) about quarters it; auto is the model's dtype on
        CUDA and on unquantized CPU models (float32 there: its tokens equal transformers'), float16 on CPU
        models with quantized weights.
    speculative: speculative decoding (None: off).
    greedy_burst: on the fused CPU decode path, a batch whose sequences are all plain greedy (no logprobs,
        penalties, logit bias, grammar or pending min_tokens) runs up to this many decode steps in one native
        call, with no Python between its tokens, while no other request waits (1: a step at a time). Streams
        then get their tokens several at a time; the tokens are the same.
    greedy_burst_ms: and only as many steps as the last decode steps' pace fits in this many milliseconds, so
        a stream gets tokens at least about this often (0: no such cap).
    tokenizer: a Hugging Face tokenizer directory used instead of the model's own tokenizer (for a GGUF
        file: instead of the one its metadata makes); its ids must fit the model's embedding table.
    chat_template: a Jinja file whose text replaces the chat template (the model's, or `tokenizer`'s).
        engine/loader.py reads and checks both when it loads the model.
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 512
    sliding_window: int | None = None
    num_sink_tokens: int = 0
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    quantization: str = "none"
    prefill_dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    speculative: SpeculativeConfig | None = None
    greedy_burst: int = 16
    greedy_burst_ms: float = 100.0
    tokenizer: str | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be set")
        for name in ("tokenizer", "chat_template"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a path or None, got {value!r}")
        check_dtype(self.dtype, self.device)
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {self.quantization!r}")
        if self.quantization in CPU_FLOAT32_QUANTIZATIONS and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError(f"quantization {self.quantization} runs on CPU with dtype float32; use bfloat16 on GPUs")
        if self.prefill_dtype not in PREFILL_DTYPES:
            raise ValueError(f"prefill_dtype must be one of {PREFILL_DTYPES}, got {self.prefill_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be 0 (no cap) or positive, got {self.long_prefill_token_threshold}"
            )
        if not 1 <= self.greedy_burst <= MAX_GREEDY_BURST:
            raise ValueError(f"greedy_burst must be in [1, {MAX_GREEDY_BURST}], got {self.greedy_burst}")
        if not self.greedy_burst_ms >= 0:
            raise ValueError(f"greedy_burst_ms must be 0 (no cap) or positive, got {self.greedy_burst_ms}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.num_sink_tokens < 0:
            raise ValueError(f"num_sink_tokens must be non-negative, got {self.num_sink_tokens}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


TOKEN_ID_INPUT_MODES = ("check", "accept", "reject")


def _check_encoder_fields(model: str, dtype: str, device: str, max_batch_tokens: int) -> None:
    """The rules the encoder models' configs (embedder, reranker) share."""
    if not model:
        raise ValueError("model must be set")
    check_dtype(dtype, device)
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be positive, got {max_batch_tokens}")


@dataclass(frozen=True)
class EmbedderConfig:
    """Everything needed to build an Embedder (engine/pooling/embedder.py).

    model: alias (engine.hub.models_hub), or a local Hugging Face directory.
    max_batch_tokens: token budget of one encoder forward (real tokens; batches are packed, no padding).
    pooling: one of POOLING_MODES; None = from the model's sentence-transformers files (mean when
        there are none).
    normalize: default for requests that do not say; None = from the model's files (a Normalize
        module in modules.json), True when the model has no sentence-transformers files.
    max_model_len: None = the position table's limit; a smaller value lowers it.
    token_ids: what token-id inputs may be (TOKEN_ID_INPUT_MODES): "check" (default) takes only what the
        model's tokenizer makes of a text, special tokens included (ids made by another tokenizer are
        refused, not embedded as a wrong vector), "accept" takes any id in the vocabulary, "reject"
        refuses token-id input altogether.
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_batch_tokens: int = 8192
    pooling: str | None = None
    normalize: bool | None = None
    max_model_len: int | None = None
    token_ids: str = "check"

    def __post_init__(self) -> None:
        _check_encoder_fields(self.model, self.dtype, self.device, self.max_batch_tokens)
        if self.pooling is not None and self.pooling not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {POOLING_MODES}, got {self.pooling!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.token_ids not in TOKEN_ID_INPUT_MODES:
            raise ValueError(f"token_ids must be one of {TOKEN_ID_INPUT_MODES}, got {self.token_ids!r}")


@dataclass(frozen=True)
class RerankerConfig:
    """Everything needed to build a Reranker (engine/pooling/reranker.py): a cross-encoder scoring
    (query, document) pairs.

    model: a local Hugging Face directory of a `BertForSequenceClassification`,
        `RobertaForSequenceClassification` or `XLMRobertaForSequenceClassification` checkpoint, or a Hub id.
    max_batch_tokens: token budget of one encoder forward (real tokens of whole pairs, packed).
    max_model_len: longest pair, special tokens included; None = the position table's limit.
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_batch_tokens: int = 8192
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _check_encoder_fields(self.model, self.dtype, self.device, self.max_batch_tokens)
        if self.max_model_len is not None and self.max_model_len < 8:
            # room for a pair's special tokens (<s> q </s></s> d </s> in XLM-R) and a token of each text,
            # so truncation can always fit a pair
            raise ValueError(f"max_model_len must be at least 8, got {self.max_model_len}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts read from config.json or GGUF metadata.

    `hf_config` keeps the full transformers config for architecture-specific
    fields (rope scaling, norm eps, ...); everything the engine itself needs is
    a named field.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_window: int | None
    hf_config: Any = field(compare=False, repr=False)
    # Divisors of RoPE's inverse frequencies, one per rotary pair: a GGUF file's `rope_freqs` tensor, where
    # llama.cpp's converter bakes a Llama 3 style frequency scaling into the file (None: no such tensor).
    rope_freq_factors: tuple[float, ...] | None = None
    # Each layer's sliding window (None: that layer sees every key) where the layers differ, as in models
    # that interleave sliding and full layers; None: every layer uses `sliding_window`.
    layer_windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.layer_windows is not None and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")

    def windows(self) -> tuple[int | None, ...]:
        """The sliding window of every layer (None: full attention)."""
        return self.layer_windows if self.layer_windows is not None else (self.sliding_window,) * self.num_layers
