"""EngineConfig, EmbedderConfig and ServerConfig: one rule set per config, checked at construction."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import EmbedderConfig, EngineConfig
from engine.hub.models_hub import DEFAULT_EMBEDDING_MODEL, DEFAULT_GENERATION_MODEL
from server.config import ServerConfig


@pytest.mark.parametrize("config_class", [EngineConfig, EmbedderConfig])
def test_both_model_configs_follow_the_same_dtype_rules(config_class):
    assert config_class(model="m", dtype="bfloat16").dtype == "bfloat16"
    assert config_class(model="m", dtype="float16", device="cuda:1").dtype == "float16"  # built, not run
    with pytest.raises(ValueError, match="float16 is only supported on CUDA"):
        config_class(model="m", dtype="float16")
    with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'bfloat16', 'float16'\)"):
        config_class(model="m", dtype="int4")
    with pytest.raises(ValueError, match="model must be set"):
        config_class(model="")


def test_engine_config_takes_a_prompt_chunk_cap_or_zero_for_none():
    assert EngineConfig(model="m", long_prefill_token_threshold=0).long_prefill_token_threshold == 0
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be 0 .no cap. or positive"):
        EngineConfig(model="m", long_prefill_token_threshold=-1)


def test_embedder_config_checks_pooling_and_its_limits():
    assert EmbedderConfig(model="m", pooling="last").pooling == "last"
    with pytest.raises(ValueError, match=r"pooling must be one of \('mean', 'cls', 'last'\)"):
        EmbedderConfig(model="m", pooling="max")
    with pytest.raises(ValueError, match="max_batch_tokens must be positive"):
        EmbedderConfig(model="m", max_batch_tokens=0)
    with pytest.raises(ValueError, match="max_model_len must be at least 2"):
        EmbedderConfig(model="m", max_model_len=1)


def test_server_config_holds_the_default_models():
    config = ServerConfig()
    assert config.engine == EngineConfig(model=DEFAULT_GENERATION_MODEL, quantization="auto")
    assert config.embedder == EmbedderConfig(model=DEFAULT_EMBEDDING_MODEL)
    assert config.model_name == DEFAULT_GENERATION_MODEL
    assert ServerConfig(served_model_name="mine").model_name == "mine"
    assert ServerConfig(embedder=None).embedder is None


def test_server_config_declares_no_model_setting_twice():
    own = {f.name for f in dataclasses.fields(ServerConfig)} - {"engine", "embedder"}
    assert not own & {f.name for f in dataclasses.fields(EngineConfig)}
    assert not own & {f.name for f in dataclasses.fields(EmbedderConfig)}


def test_server_config_normalises_and_checks_its_own_fields():
    config = ServerConfig(allowed_origins=" a, b ,", api_keys="", request_timeout=0, max_request_bytes="1KiB")
    assert config.allowed_origins == ("a", "b")
    assert config.api_key is None and config.request_timeout is None and config.max_request_bytes == 1024
    with pytest.raises(ValueError, match="port must be in"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="log_level must be one of"):
        ServerConfig(log_level="loud")
    with pytest.raises(ValueError, match="max_queued_requests must be at least 1"):
        ServerConfig(max_queued_requests=0)
