"""A tiny "reasoning model" that writes a script: its greedy output is a text chosen by the test.

Each layer's attention and MLP write nothing (zero output projections), so the last hidden state is the
current token's embedding; the script's tokens get orthonormal embeddings and the output matrix maps each
one to the next, so greedy decoding walks the script and then ends (EOS). The tokenizer is the tiny test
tokenizer with `<think>` and `</think>` added as ordinary tokens (as Qwen3's and DeepSeek-R1's are), and
its ChatML template takes Qwen3's `enable_thinking` switch or opens the thinking block itself.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny_models import make_tiny_model, tokenizer_vocab_size

# Qwen3's: the model opens its own thinking; `enable_thinking: false` writes an empty, closed block.
SWITCH_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)
# DeepSeek-R1's (and Qwen3.5's): the prompt ends inside an open thinking block.
OPENING_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}"
)
THINK_TAGS = ["<think>", "</think>"]


def make_thinking_model(directory: Path, script: str, template: str = SWITCH_TEMPLATE, **config_overrides) -> Path:
    """A model whose greedy answer to any chat prompt of `template` is `script`, then EOS. The script's
    tokens (and the prompt's last one, which leads into it) must all differ: each one's successor is fixed."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    directory = Path(directory)
    make_tiny_model(directory, "llama", vocab_size=tokenizer_vocab_size() + len(THINK_TAGS), **config_overrides)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens(THINK_TAGS)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)

    prompt_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    chain = [prompt[-1], *tokenizer.encode(script, add_special_tokens=False), tokenizer.eos_token_id]
    if len(set(chain[:-1])) != len(chain) - 1:
        raise ValueError(f"the script's tokens repeat, so no token has one successor: {chain}")

    weights_path = directory / "model.safetensors"
    weights = load_file(weights_path)
    hidden = weights["model.embed_tokens.weight"].shape[1]
    if len(chain) - 1 > hidden:
        raise ValueError(f"a script of {len(chain) - 1} tokens needs a hidden size of at least that ({hidden})")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name].zero_()
    directions = torch.linalg.qr(torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(0)))[0]
    embed = weights["model.embed_tokens.weight"]
    lm_head = torch.zeros_like(weights["lm_head.weight"])
    for position, (token, successor) in enumerate(zip(chain, chain[1:], strict=False)):
        embed[token] = directions[position]
        lm_head[successor] = directions[position]
    weights["lm_head.weight"] = lm_head
    save_file(weights, weights_path, metadata={"format": "pt"})
    return directory


def thinking_server_config(directory: Path, script: str, **overrides):
    """A ServerConfig serving a scripted model as a reasoning model: --reasoning-parser qwen3, thinking off
    unless a request turns it on (--default-chat-template-kwargs), a 2,048-token context."""
    from tests.support.server_harness import make_server_config

    model_dir = make_thinking_model(directory, script, max_position_embeddings=2048)
    settings = {
        "max_model_len": 2048,
        "reasoning_parser": "qwen3",
        "default_chat_template_kwargs": {"enable_thinking": False},
        **overrides,
    }
    return make_server_config(model_dir, **settings)
