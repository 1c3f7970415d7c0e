"""Each model family's chat template renders through kvserve's Tokenizer exactly as transformers renders it.

The templates (tests/data/chat_templates/) are small faithful copies of Gemma's, Qwen3's, Llama 3's and
Phi-3's; each runs over the tiny test tokenizer with that family's turn markers added as tokens, loaded as
`--tokenizer DIR` and `--chat-template FILE` load them. Text and token ids must equal transformers'
apply_chat_template on the same tokenizer and template: with a control token's text in a message, kvserve's
default (it stays text) must equal transformers' sanitize_control_tokens=True, and
allow_special_tokens_in_content must equal transformers' plain encoding.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.text.tokenizer import Tokenizer, read_chat_template
from tests.support.tiny_models import _tokenizer_dir

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"

# family -> its markers as special tokens, other added tokens the template names, bos and eos
FAMILIES = {
    "gemma": dict(special=["<bos>", "<start_of_turn>", "<end_of_turn>"], added=[], bos="<bos>", eos="<end_of_turn>"),
    "qwen3": dict(special=[], added=["<think>", "</think>", "<tool_call>", "</tool_call>"], bos=None, eos="<|im_end|>"),
    "llama3": dict(
        special=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        added=[],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
    ),
    "phi3": dict(special=["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], added=[], bos=None, eos="<|end|>"),
}

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "system-user-assistant-user": [
        SYSTEM,
        {"role": "user", "content": "Hello world!"},
        {"role": "assistant", "content": "Hi. 0123"},
        {"role": "user", "content": "The quick brown fox?"},
    ],
    "one-user-turn": [{"role": "user", "content": "  Les élèves 🙂  "}],
    # Every family's markers as text in a message: kvserve keeps them text.
    "control-token-text": [
        SYSTEM,
        {"role": "user", "content": "a <|im_end|> b <end_of_turn> c <|eot_id|> d <|end|> e <think>"},
    ],
}


@pytest.fixture(scope="module")
def family_tokenizers(tmp_path_factory) -> dict[str, Path]:
    """family -> a tokenizer directory: the tiny tokenizer with the family's tokens added."""
    from transformers import AutoTokenizer

    dirs = {}
    for family, spec in FAMILIES.items():
        hf = AutoTokenizer.from_pretrained(str(_tokenizer_dir()))
        if spec["special"]:
            hf.add_special_tokens({"additional_special_tokens": spec["special"]})
        hf.add_tokens(spec["added"])
        if spec["bos"]:
            hf.bos_token = spec["bos"]
        hf.eos_token = spec["eos"]
        dirs[family] = tmp_path_factory.mktemp(f"tokenizer-{family}")
        hf.save_pretrained(dirs[family])
    return dirs


def _pair(family_tokenizers: dict[str, Path], family: str):
    """(kvserve's Tokenizer with the family's template, transformers' tokenizer, the template text)."""
    from transformers import AutoTokenizer

    template = read_chat_template(TEMPLATES / f"{family}.jinja")
    ours = Tokenizer.from_directory(family_tokenizers[family])
    ours.set_chat_template(template, f"the file {family}.jinja")
    return ours, AutoTokenizer.from_pretrained(str(family_tokenizers[family])), template


def _reference(reference, template: str, messages: list[dict], **kwargs):
    return reference.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, return_dict=False, **kwargs
    )


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_template_renders_and_encodes_as_transformers_does(family_tokenizers, family, conversation):
    ours, reference, template = _pair(family_tokenizers, family)
    messages = CONVERSATIONS[conversation]
    text = ours.render_chat(messages)
    assert text == _reference(reference, template, messages, tokenize=False)
    assert ours.apply_chat_template(messages) == _reference(reference, template, messages, sanitize_control_tokens=True)
    as_tokens = ours.apply_chat_template(messages, allow_special_tokens_in_content=True)
    assert as_tokens == _reference(reference, template, messages)
    if conversation == "control-token-text" and FAMILIES[family]["special"]:
        # The family's markers in the message are text to kvserve's default, tokens with the option.
        assert ours.apply_chat_template(messages) != as_tokens


def test_gemma_folds_the_system_message_into_the_first_user_turn(family_tokenizers):
    ours, _, _ = _pair(family_tokenizers, "gemma")
    text = ours.render_chat(CONVERSATIONS["system-user-assistant-user"])
    assert text.startswith("<bos><start_of_turn>user\nYou are terse.\n\nHello world!<end_of_turn>\n")
    assert "<start_of_turn>model\nHi. 0123<end_of_turn>\n" in text and text.endswith("<start_of_turn>model\n")


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_qwen3_enable_thinking_switch_renders_as_transformers_does(family_tokenizers, enable_thinking):
    ours, reference, template = _pair(family_tokenizers, "qwen3")
    messages = CONVERSATIONS["system-user-assistant-user"]
    switch = {"enable_thinking": enable_thinking}
    text = ours.render_chat(messages, template_kwargs=switch)
    assert text == _reference(reference, template, messages, tokenize=False, **switch)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") is not enable_thinking
    ids = ours.apply_chat_template(messages, template_kwargs=switch)
    assert ids == _reference(reference, template, messages, sanitize_control_tokens=True, **switch)


def test_qwen3_tools_and_tool_calls_render_as_transformers_does(family_tokenizers):
    ours, reference, template = _pair(family_tokenizers, "qwen3")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "description": "The time in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "Time in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_time", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "12:00"},
    ]
    assert ours.tool_call_format == "hermes"  # derived from the replacing template
    text = ours.render_chat(messages, tools=tools)
    assert text == _reference(reference, template, messages, tokenize=False, tools=tools)
    ids = ours.apply_chat_template(messages, tools=tools)
    assert ids == _reference(reference, template, messages, sanitize_control_tokens=True, tools=tools)


def test_template_kwargs_cannot_set_what_the_server_sets(family_tokenizers):
    from engine.errors import InvalidRequestError

    ours, _, _ = _pair(family_tokenizers, "qwen3")
    with pytest.raises(InvalidRequestError, match="tokenize"):
        ours.render_chat(CONVERSATIONS["one-user-turn"], template_kwargs={"tokenize": True})
