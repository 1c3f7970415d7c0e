"""`--tokenizer DIR` and `--chat-template FILE` through the loader (engine.load_generation): the override is
the tokenizer and the template the engine's chats use, and each unusable one is refused in one line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.llm import LLM
from engine.loader import load_generation
from engine.params import SamplingParams
from tests.support.llama_gguf import write_llama_gguf
from tests.support.tiny_models import SPECIAL_TOKENS, _tokenizer_dir, load_reference, make_tiny_model

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
GEMMA_TEMPLATE = TEMPLATES / "gemma.jinja"
QWEN3_TEMPLATE = TEMPLATES / "qwen3.jinja"  # renders tools: tool_call_format follows it
PHI3_TEMPLATE = TEMPLATES / "phi3.jinja"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello world!"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "The quick brown fox?"},
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("override-llama"), "llama")


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> Path:
    """A smaller tokenizer than the model's (under 300 ids), trained on other text, with no chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(["Hello there, Hello world. Worldly hellos, all told. " * 8], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    out = tmp_path_factory.mktemp("other-tokenizer")
    fast.save_pretrained(out)
    return out


def _load(model: Path, **overrides):
    return load_generation(EngineConfig(model=str(model), num_blocks=16, **overrides))


def _reference_ids(tokenizer_dir: Path, template: str | None, messages: list[dict]) -> list[int]:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return reference.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, return_dict=False
    )


def test_chat_template_file_replaces_the_models_template(tiny_llama, caplog):
    own = _load(tiny_llama).tokenizer
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        loaded = _load(tiny_llama, chat_template=str(GEMMA_TEMPLATE))
    template = GEMMA_TEMPLATE.read_text()
    tokenizer = loaded.tokenizer
    assert tokenizer.chat_template == template
    ids = tokenizer.apply_chat_template(CHAT)
    assert ids == _reference_ids(tiny_llama, template, CHAT)
    assert ids != own.apply_chat_template(CHAT)
    assert tokenizer.copy().apply_chat_template(CHAT) == ids  # the server's text worker's copy too
    lines = [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]
    assert lines == [f"chat template of {tiny_llama}: from the file {GEMMA_TEMPLATE}"]
    # What the template decides follows it: the model's ChatML template renders no tools, Qwen3's does.
    qwen3 = _load(tiny_llama, chat_template=str(QWEN3_TEMPLATE)).tokenizer
    assert (own.tool_call_format, tokenizer.tool_call_format, qwen3.tool_call_format) == (None, None, "hermes")


def test_tokenizer_directory_replaces_the_models_tokenizer(tiny_llama, other_tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        loaded = _load(tiny_llama, tokenizer=str(other_tokenizer))
    tokenizer = loaded.tokenizer
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(str(other_tokenizer))
    assert tokenizer.vocabulary() == other.get_vocab()
    text = "Hello world, hello there"
    assert tokenizer.encode(text) == other.encode(text)
    assert tokenizer.encode(text) != AutoTokenizer.from_pretrained(str(tiny_llama)).encode(text)
    assert tokenizer.id_limit == len(other) < loaded.engine.vocab_size  # smaller than the embedding table: fine
    assert not tokenizer.has_chat_template  # the other tokenizer has none, and the model's is not kept
    assert any("has no chat template" in r.getMessage() for r in caplog.records)


def test_both_overrides_the_file_wins_over_the_tokenizer_directory(tiny_llama, other_tokenizer):
    tokenizer = _load(tiny_llama, tokenizer=str(other_tokenizer), chat_template=str(PHI3_TEMPLATE)).tokenizer
    template = PHI3_TEMPLATE.read_text()
    assert tokenizer.chat_template_source == f"the file {PHI3_TEMPLATE}"
    assert tokenizer.apply_chat_template(CHAT) == _reference_ids(other_tokenizer, template, CHAT)


def test_a_gguf_without_a_tokenizer_serves_chats_with_both_overrides(tiny_llama, tmp_path):
    """The test GGUF carries no tokenizer.* metadata: alone it cannot load; with --tokenizer and
    --chat-template it generates, greedy, exactly what transformers generates for the same chat."""
    import torch

    gguf_file = write_llama_gguf(tiny_llama, tmp_path / "tiny-F32.gguf", with_rope_freqs=False)
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        _load(gguf_file)
    engine, tokenizer = _load(gguf_file, tokenizer=str(_tokenizer_dir()), chat_template=str(PHI3_TEMPLATE))
    prompt = tokenizer.apply_chat_template(CHAT)
    assert prompt == _reference_ids(_tokenizer_dir(), PHI3_TEMPLATE.read_text(), CHAT)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ours = LLM(engine, tokenizer).generate([prompt], params)[0][0].token_ids
    with torch.no_grad():
        expected = load_reference(tiny_llama).generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None
        )[0, len(prompt) :]
    assert ours == expected.tolist()


def _refusal(model: Path, **overrides) -> str:
    with pytest.raises(ModelLoadError) as err:
        _load(model, **overrides)
    message = str(err.value)
    assert "\n" not in message  # the server logs a ModelLoadError as one line
    return message


def test_unusable_overrides_are_refused_in_one_line(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    assert "cannot read it" in _refusal(tiny_llama, chat_template=str(tmp_path / "missing.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}{{ message['content'] }}\n\n{% endfor")
    assert "not a jinja template" in _refusal(tiny_llama, chat_template=str(broken))
    (tmp_path / "empty").mkdir()
    assert "no tokenizer there" in _refusal(tiny_llama, tokenizer=str(tmp_path / "empty"))
    assert "not a directory" in _refusal(tiny_llama, tokenizer=str(tmp_path / "missing"))
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    (unreadable / "tokenizer_config.json").write_text("{}")
    assert "cannot load the tokenizer" in _refusal(tiny_llama, tokenizer=str(unreadable))
    # More ids than the model's embedding table holds: an id past it would index out of range.
    larger = AutoTokenizer.from_pretrained(str(_tokenizer_dir()))
    larger.add_tokens(["<extra_0>", "<extra_1>"])
    larger.save_pretrained(tmp_path / "larger")
    message = _refusal(tiny_llama, tokenizer=str(tmp_path / "larger"))
    assert "up to 385" in message and "embedding table of 384 tokens" in message


def test_engine_config_refuses_empty_override_paths():
    for field in ("tokenizer", "chat_template"):
        with pytest.raises(ValueError, match=field):
            EngineConfig(model="m", **{field: " "})
