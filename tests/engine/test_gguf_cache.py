"""The GGUF metadata cache (engine/hub/gguf_cache.py): the second load of a file reads transformers' config and
tokenizer back from the cache instead of parsing the file, and gets exactly what the first load got."""

from __future__ import annotations

import os

import pytest

from engine.hub import gguf_cache
from engine.hub.models_hub import resolve_model
from tests.support.llama_gguf import write_llama_gguf
from tests.support.tiny_models import make_tiny_llama

TEXTS = ["Hello, world!", "  spaces\tand\nlines  ", "ünïcödé 日本語 🙂", "<|im_start|>user\nhi<|im_end|>", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(gguf_cache.DISABLE_ENV, raising=False)
    return tmp_path / "home"


def _no_parse(monkeypatch) -> None:
    """Any parse of a GGUF file by transformers from here on fails the test."""
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    def refuse(*args, **kwargs):
        raise AssertionError("the file was parsed again")

    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", refuse)


def test_the_config_is_read_back_and_a_changed_file_is_read_afresh(cache_home, tmp_path, monkeypatch):
    gguf_file = write_llama_gguf(make_tiny_llama(tmp_path / "tiny"), tmp_path / "tiny.gguf", with_rope_freqs=False)
    first = gguf_cache.load_config(gguf_file)
    assert first["model_type"] == "llama" and first["num_hidden_layers"] >= 1
    folder = gguf_cache.entry_dir(gguf_file)
    assert (folder / gguf_cache.CONFIG_FILE).is_file()
    with monkeypatch.context() as patched:
        _no_parse(patched)
        assert gguf_cache.load_config(gguf_file) == first
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the file changed in place
    assert gguf_cache.entry_dir(gguf_file) != folder
    assert gguf_cache.load_config(gguf_file) == first  # parsed again, and the stale entry pruned
    assert not folder.exists() and gguf_cache.entry_dir(gguf_file).is_dir()


def test_an_unwritable_or_disabled_cache_loads_as_without_it(cache_home, tmp_path, monkeypatch):
    gguf_file = write_llama_gguf(make_tiny_llama(tmp_path / "tiny"), tmp_path / "tiny.gguf", with_rope_freqs=False)
    cache_home.write_text("a file where the cache folder would be")
    assert gguf_cache.load_config(gguf_file)["model_type"] == "llama"
    monkeypatch.setenv(gguf_cache.DISABLE_ENV, "0")
    assert gguf_cache.entry_dir(gguf_file) is None
    assert gguf_cache.load_config(gguf_file)["model_type"] == "llama"


def test_the_default_models_tokenizer_comes_back_the_same(monkeypatch, tmp_path):
    gguf_file = resolve_model("smollm2-135m-instruct")  # before the cache home moves: the models live in the real one
    assert gguf_file.suffix == ".gguf"
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(gguf_cache.DISABLE_ENV, raising=False)
    parsed = gguf_cache.load_tokenizer(gguf_file)
    with monkeypatch.context() as patched:
        _no_parse(patched)
        cached = gguf_cache.load_tokenizer(gguf_file)
    for text in TEXTS:
        assert cached(text).input_ids == parsed(text).input_ids
    assert cached.chat_template == parsed.chat_template
    rendered = [t.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False) for t in (parsed, cached)]
    assert rendered[0] == rendered[1]
    assert cached.all_special_ids == parsed.all_special_ids and cached.get_vocab() == parsed.get_vocab()
    assert (cached.bos_token_id, cached.eos_token_id) == (parsed.bos_token_id, parsed.eos_token_id)
