"""The model catalogue: entries from repeated model flags, a models directory and a TOML models file, their
names, per-model settings and keep-alive durations, and the errors a bad one gets at start."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from server.catalogue.entries import FOREVER, parse_keep_alive, split_named_path
from server.cli.args import add_arguments, config_from_args
from server.config import ServerConfig, parse_memory_budget


def _config(*argv: str) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_repeated_model_flags_make_the_first_the_default_and_the_rest_on_demand_with_the_servers_flags():
    config = _config(
        "--model", "fast=/m/fast.gguf", "--model", "/m/Big-Model.Q4_K_M.gguf", "--embedding-model", "e1",
        "--embedding-model", "e2=/m/bge", "--quantization", "int8", "--max-model-len", "512",
    )  # fmt: skip
    assert config.model_names == ("fast",) and config.engine.model == "/m/fast.gguf"
    assert [(e.names, e.task, e.preload) for e in config.catalogue] == [
        (("fast",), "generate", True),
        (("e1",), "embed", True),
        (("Big-Model.Q4_K_M",), "generate", False),
        (("e2",), "embed", False),
    ]
    big = config.models[0].config
    assert (big.model, big.quantization, big.max_model_len) == ("/m/Big-Model.Q4_K_M.gguf", "int8", 512)


def test_the_default_models_tokenizer_template_and_draft_model_are_not_inherited(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    config = _config("--model", "a", "--model", "b", "--chat-template", str(template))
    assert config.engine.chat_template == str(template)
    assert config.models[0].config.chat_template is None


def test_a_name_given_twice_is_refused_at_start():
    with pytest.raises(ValueError, match="two models are named 'x'"):
        _config("--model", "x=/m/a.gguf", "--model", "x=/m/b.gguf")


def test_a_models_file_gives_names_roles_keep_alive_and_per_model_engine_settings(tmp_path):
    file = tmp_path / "models.toml"
    file.write_text(
        """
[[models]]
names = ["coder", "qwen-coder"]
path = "/m/coder.gguf"
keep_alive = "30m"
preload = true
max_model_len = 1024
kv_cache_memory = "64MiB"
speculative_method = "ngram"
speculative_num_speculative_tokens = 5

[[models]]
path = "/m/bge-small"
role = "embed"
max_batch_tokens = 1024
"""
    )
    config = _config("--models-file", str(file))
    coder, bge = config.models
    assert coder.names == ("coder", "qwen-coder") and coder.keep_alive == 1800.0 and coder.preload
    assert coder.config.max_model_len == 1024 and coder.config.kv_cache_memory_bytes == 64 << 20
    assert coder.config.speculative.method == "ngram" and coder.config.speculative.num_speculative_tokens == 5
    assert bge.names == ("bge-small",) and bge.task == "embed" and bge.config.max_batch_tokens == 1024


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[models]]\npath = "/m/a.gguf"\nmax_model_lenn = 3\n', "unknown setting 'max_model_lenn'"),
        ('[[models]]\npath = "/m/a.gguf"\nrole = "chat"\n', "role must be generate, embed or rerank"),
        ('[[models]]\nname = "a"\n', "`path`"),
        ("[[models]\n", "not valid TOML"),
        ('[model]\npath = "x"\n', "unknown top-level keys"),
        ('[[models]]\npath = "/m/a.gguf"\nkeep_alive = "soon"\n', "not a duration"),
    ],
)
def test_a_bad_models_file_names_the_file_and_the_model(tmp_path, text, message):
    file = tmp_path / "models.toml"
    file.write_text(text)
    with pytest.raises(ValueError, match=message) as raised:
        _config("--models-file", str(file))
    assert str(file) in str(raised.value)


def test_a_models_dir_serves_each_gguf_and_folder_by_its_role(tmp_path):
    (tmp_path / "qwen.gguf").write_bytes(b"GGUF")
    (tmp_path / "big-00001-of-00002.gguf").write_bytes(b"GGUF")
    (tmp_path / "big-00002-of-00002.gguf").write_bytes(b"GGUF")
    (tmp_path / "mmproj-vision.gguf").write_bytes(b"GGUF")
    for name, config in {
        "minilm": {"model_type": "bert", "architectures": ["BertModel"]},
        "reranker": {"model_type": "bert", "architectures": ["BertForSequenceClassification"]},
        "llama-folder": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    (tmp_path / "notes").mkdir()  # no config.json: not a model
    config = _config("--models-dir", str(tmp_path))
    assert {e.name: e.task for e in config.models} == {
        "big": "generate",
        "llama-folder": "generate",
        "minilm": "embed",
        "qwen": "generate",
        "reranker": "rerank",
    }


def test_an_empty_models_dir_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no .gguf file"):
        _config("--models-dir", str(tmp_path))


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, None), (30, 30.0), ("90", 90.0), ("90s", 90.0), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25),
     (-1, FOREVER), ("-1", FOREVER), ("-5m", FOREVER), (0, 0.0), ("0", 0.0)],
)  # fmt: skip
def test_keep_alive_reads_ollamas_durations(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m5", "", True, math.nan])
def test_keep_alive_refuses_what_is_not_a_duration(value):
    with pytest.raises(ValueError):
        parse_keep_alive(value)


def test_names_memory_budgets_and_the_server_flags():
    assert split_named_path("coder=/m/a.gguf") == ("coder", "/m/a.gguf")
    assert split_named_path("/m/a=b.gguf") == (None, "/m/a=b.gguf")
    assert parse_memory_budget("0.5") == 0.5 and parse_memory_budget("16GiB") == 16 << 30
    assert parse_memory_budget("1000") == 1000
    config = _config("--keep-alive", "-1", "--max-loaded-models", "2", "--memory-budget", "0.8")
    assert (config.keep_alive, config.max_loaded_models, config.memory_budget) == (FOREVER, 2, 0.8)
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        ServerConfig(memory_budget=1.5)
