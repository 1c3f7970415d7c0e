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


def test_transformers_reads_the_same_metadata_through_the_quick_pass(tmp_path):
    """engine/hub/gguf_reader_view.py: transformers' config, tokenizer fields and tokenizer are the same when
    `gguf.GGUFReader` answers from the engine's own pass, and the package's reader is back afterwards."""
    import gguf
    from transformers import AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from engine.hub.gguf_reader_view import ReaderView, reading_with_quick_pass

    gguf_file = _write_metadata_gguf(tmp_path / "tiny.gguf")
    package_reader = gguf.GGUFReader
    package = load_gguf_checkpoint(str(gguf_file), return_tensors=False)
    package_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_file.name)
    with reading_with_quick_pass():
        assert isinstance(gguf.GGUFReader(str(gguf_file)), ReaderView)
        assert isinstance(gguf.GGUFReader(str(gguf_file), "r"), package_reader)  # a mode asked: the package's
        quick = load_gguf_checkpoint(str(gguf_file), return_tensors=False)
        quick_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_file.name)
    assert gguf.GGUFReader is package_reader
    assert set(package) == set(quick) and all(package[key] == quick[key] for key in package)
    assert package["tokenizer"]["tokens"] and package["config"]["num_hidden_layers"] >= 1  # real content compared
    assert quick_tokenizer.backend_tokenizer.to_str() == package_tokenizer.backend_tokenizer.to_str()
    assert quick_tokenizer.chat_template == package_tokenizer.chat_template
    for text in [*TEXTS, "the world"]:
        assert quick_tokenizer(text).input_ids == package_tokenizer(text).input_ids


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: each of the 256 bytes as one printable character."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(shifted)) for b in range(256)]


def _write_metadata_gguf(path):
    """A one-tensor llama GGUF whose metadata holds every kind of value transformers reads: numbers, a float,
    a bool, strings, and arrays of strings and of numbers (a byte-level BPE tokenizer, small)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    merges = ["Ġ t", "h e", "Ġt he", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    tokens = [*_byte_level_alphabet(), "Ġt", "he", "Ġthe", "Ġw", "or", "Ġwor", "ld", "Ġworld"]
    tokens += ["<|im_start|>", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
