"""Tiny random-weight models of every supported architecture, built with transformers.

The tokenizer is a small byte-level BPE trained here on a fixed text (no hub, no
download), with ChatML special tokens and a chat template, so every test model
is a complete Hugging Face directory: config.json, model.safetensors, tokenizer.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import torch

from engine.models import registry

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks. "
    "Hello world! Continuous batching lets requests join and leave every step. 0123456789 "
    "Les élèves étudient à l'école. 東京は日本の首都です。 Emoji 🙂 are bytes too. "
    "def main():\n    return 42\n"
) * 4

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_SIZE = 384


@functools.lru_cache(maxsize=1)
def _tokenizer_dir() -> Path:
    """Train the BPE once per process and keep its files in a temp dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([_CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    out = Path(tempfile.mkdtemp(prefix="kvserve-tiny-tokenizer-"))
    fast.save_pretrained(out)
    return out


def tokenizer_vocab_size() -> int:
    # The trained vocab already holds the special tokens.
    return len(json.loads((_tokenizer_dir() / "tokenizer.json").read_text())["model"]["vocab"])


# model_type -> the transformers class of that architecture (named as the registry names it)
_MODEL_CLASSES = {entry.model_type: entry.name for entry in registry.entries()}


# The LLaMA family's tiny shape, and each model_type's tiny config where it differs.
_ROPE_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
# Phi-4-mini's RoPE at tiny size: 3/4 of each head (12 of 16 dims, 6 frequencies) rotates, under LongRoPE with a
# pretraining length past the tests' sequences (their short factors apply, as in transformers). pad_token_id:
# Phi-3's default (32000) is outside the tiny vocabulary.
PHI3_ROPE = dict(
    partial_rotary_factor=0.75,
    original_max_position_embeddings=256,
    rope_scaling={
        "type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.5],
        "long_factor": [1.1, 1.8, 3.0, 5.0, 8.0, 12.0],
    },
    pad_token_id=0,
)
# Gemma at tiny size: tied embeddings, as every Gemma checkpoint has; a window shorter than the tests' prompts;
# a query_pre_attn_scalar other than the head size, so the attention scale is the config's.
GEMMA_SIZES = dict(_ROPE_SIZES, head_dim=16, tie_word_embeddings=True, sliding_window=8, query_pre_attn_scalar=24)
# Gemma 3's RoPE by layer type: a small base for the sliding layers, a large, linearly scaled one for the full.
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
}
_TINY_CONFIGS = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "mistral": dict(_ROPE_SIZES, sliding_window=16),  # a window shorter than the tests' prompts
    "qwen3": dict(_ROPE_SIZES, head_dim=16),  # Qwen3's configs name head_dim (128 by default)
    "phi3": dict(_ROPE_SIZES, **PHI3_ROPE),
    "gemma2": dict(GEMMA_SIZES, attn_logit_softcapping=2.5, final_logit_softcapping=3.0),  # layers: sliding, full
    # Five sliding layers to one full (the config's default pattern); each kind rotates with its own RoPE.
    "gemma3_text": dict(GEMMA_SIZES, num_hidden_layers=6, final_logit_softcapping=3.0, rope_parameters=GEMMA3_ROPE),
}
# Architectures whose 1-D norm weights are an offset from one ((1 + w) RMSNorms): drawn around zero, not left
# at their init of zero, so the offset is exercised.
_OFFSET_NORMS = {"gemma2", "gemma3_text"}


def _base_config(arch: str, vocab_size: int, overrides: dict):
    from transformers import AutoConfig

    if arch not in _MODEL_CLASSES:
        raise ValueError(f"unknown tiny architecture {arch!r}; registered: {sorted(_MODEL_CLASSES)}")
    eos_id = SPECIAL_TOKENS.index("<|im_end|>")
    bos_id = SPECIAL_TOKENS.index("<|endoftext|>")
    common = dict(vocab_size=vocab_size, bos_token_id=bos_id, eos_token_id=eos_id, tie_word_embeddings=False)
    cfg = dict(common, **_TINY_CONFIGS.get(arch, _ROPE_SIZES))
    cfg.update(overrides)
    return AutoConfig.for_model(arch, **cfg)


def make_tiny_model(directory: Path, arch: str = "llama", seed: int = 0, **config_overrides) -> Path:
    """Write a tiny random `arch` model (a registered model_type) with the test tokenizer into `directory`.

    Weights are drawn with a larger std than the default init so logits are
    spread out (greedy ties would make token-exact comparisons meaningless).
    """
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = _base_config(arch, tokenizer_vocab_size(), config_overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, _MODEL_CLASSES[arch])(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15)
            elif "bias" in name:
                param.normal_(0.0, 0.05)
            elif arch in _OFFSET_NORMS:
                param.normal_(0.0, 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    for item in _tokenizer_dir().iterdir():
        shutil.copy(item, directory / item.name)
    return directory


def make_tiny_llama(directory: Path, **config_overrides) -> Path:
    return make_tiny_model(directory, "llama", **config_overrides)


def load_reference(directory: Path):
    """The transformers model for `directory`, float32, eval mode (the reference implementation)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval()
