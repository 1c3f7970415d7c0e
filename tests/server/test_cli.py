"""`kvserve serve`'s command line: every flag documented with its env var, each feeding a real config
field, the nested configs it builds, and env vars as defaults that flags override."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

# Every `kvserve serve` flag; each keeps its name (and KVSERVE_<NAME>) whichever config it feeds.
SERVE_FLAGS = (
    "model",
    "embedding_model",
    "rerank_model",
    "models_dir",
    "models_file",
    "keep_alive",
    "max_loaded_models",
    "memory_budget",
    "served_model_name",
    "tokenizer",
    "chat_template",
    "host",
    "port",
    "dtype",
    "quantization",
    "prefill_dtype",
    "device",
    "max_model_len",
    "kv_cache_memory",
    "kv_cache_dtype",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "greedy_burst",
    "greedy_burst_ms",
    "sliding_window",
    "num_sink_tokens",
    "enable_prefix_caching",
    "max_queued_requests",
    "api_key",
    "api_key_file",
    "admin_api_key",
    "prefix_cache_scope",
    "allow_special_tokens_in_content",
    "reasoning_parser",
    "default_chat_template_kwargs",
    "allowed_origins",
    "request_timeout",
    "max_request_bytes",
    "shutdown_timeout",
    "max_client_batch_size",
    "max_request_cost",
    "max_request_logprobs",
    "embedding_max_batch_tokens",
    "pooling",
    "embedding_token_ids",
    "default_max_tokens",
    "timeout_keep_alive",
    "timeout_request_head",
    "timeout_request_body",
    "limit_concurrency",
    "max_connections_per_client",
    "max_request_head_bytes",
    "log_level",
    "metrics_names",
    "playground",
    "num_threads",
    "speculative_method",
    "num_speculative_tokens",
    "ngram_min",
    "ngram_max",
    "draft_model",
    "draft_quantization",
    "replicas",
    "max_replicas",
    "replica_routing",
    "model_deployments",
    "replica_metrics_port",
)


def test_help_documents_every_flag_and_its_env_var(capsys):
    from server import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert sorted(flag.name for flag in cli.FLAGS) == sorted(SERVE_FLAGS)
    for name in SERVE_FLAGS:
        assert "--" + name.replace("_", "-") in text, name
        assert "KVSERVE_" + name.upper() in text, name


def test_every_flag_feeds_a_real_config_field_and_every_server_setting_has_a_flag():
    import dataclasses

    from engine.config import EmbedderConfig, EngineConfig, RerankerConfig, SpeculativeConfig
    from server import cli
    from server.catalogue.sources import ModelSources
    from server.config import ServerConfig

    classes = {
        "server": ServerConfig,
        "engine": EngineConfig,
        "embedder": EmbedderConfig,
        "reranker": RerankerConfig,
        "speculative": SpeculativeConfig,
        "catalogue": ModelSources,
    }
    targets = {(config, field) for flag in cli.FLAGS for config, field in flag.targets}
    for config, field in targets:
        assert field in {f.name for f in dataclasses.fields(classes[config])}, (config, field)
    # `models` is made of the model flags and the catalogue's sources (server/catalogue/sources.py);
    # `only_model` is set for each model's own deployment on Ray Serve (server/ray/model_routes.py).
    not_flags = {"engine", "embedder", "reranker", "models", "only_model"}
    own_fields = {f.name for f in dataclasses.fields(ServerConfig)} - not_flags
    assert own_fields == {field for config, field in targets if config == "server"}


def test_flags_build_the_nested_configs(monkeypatch):
    import argparse

    from server import cli

    monkeypatch.setenv("KVSERVE_POOLING", "cls")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = ["--dtype", "bfloat16", "--embedding-max-batch-tokens", "300", "--quantization", "none", "--block-size", "8"]
    config = cli.config_from_args(parser.parse_args(args))
    assert (config.engine.dtype, config.embedder.dtype) == ("bfloat16", "bfloat16")  # one flag, both models
    assert (config.engine.quantization, config.engine.block_size) == ("none", 8)
    assert (config.embedder.max_batch_tokens, config.embedder.pooling) == (300, "cls")
    with pytest.raises(ValueError, match="float16 is only supported on CUDA"):
        cli.config_from_args(parser.parse_args(["--dtype", "float16"]))
    with pytest.raises(ValueError, match="pooling must be one of"):
        cli.config_from_args(parser.parse_args(["--pooling", "max"]))


def test_reasoning_and_alias_flags(monkeypatch, capsys):
    import argparse

    from server import cli

    monkeypatch.setenv("KVSERVE_SERVED_MODEL_NAME", "env-name")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = ["--served-model-name", "a,b", "--served-model-name", "c", "--reasoning-parser", "DeepSeek_R1"]
    args += ["--default-chat-template-kwargs", '{"enable_thinking": false}']
    config = cli.config_from_args(parser.parse_args(args))
    assert config.model_names == ("a", "b", "c") and config.model_name == "a"
    assert config.reasoning_parser == "deepseek_r1"
    assert config.default_chat_template_kwargs == {"enable_thinking": False}
    assert cli.config_from_args(parser.parse_args([])).model_names == ("env-name",)
    for bad in ('["not", "an", "object"]', "{not json"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--default-chat-template-kwargs", bad])
    assert "must be a JSON object" in capsys.readouterr().err


def test_env_vars_set_defaults_and_flags_win(monkeypatch):
    import argparse

    from server import cli

    monkeypatch.setenv("KVSERVE_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("KVSERVE_KV_CACHE_MEMORY", "2GB")
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    config = cli.config_from_args(parser.parse_args(["--max-num-seqs", "5", "--embedding-model", "none"]))
    assert config.engine.max_num_seqs == 5 and config.engine.kv_cache_memory_bytes == 2 * 10**9
    assert config.api_key == "from-env"
    assert config.embedder is None and config.engine.model == "smollm2-135m-instruct"
    defaults = cli.config_from_args(argparse.ArgumentParser().parse_args([]))  # no flags at all
    assert defaults.engine.model == "smollm2-135m-instruct" and defaults.embedder.model == "all-minilm-l6-v2"
    assert defaults.engine.quantization == "auto"
    assert (defaults.host, defaults.port) == ("127.0.0.1", 8000)


def test_tokenizer_and_chat_template_flags_reach_the_engine_config(monkeypatch, tmp_path):
    import argparse

    from server import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVSERVE_CHAT_TEMPLATE", "from-env.jinja")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    engine = cli.config_from_args(parser.parse_args(["--tokenizer", "tok"])).engine
    # Absolute: a Ray replica may not start in this directory.
    assert (engine.tokenizer, engine.chat_template) == (str(tmp_path / "tok"), str(tmp_path / "from-env.jinja"))
    engine = cli.config_from_args(parser.parse_args(["--chat-template", "none"])).engine
    assert (engine.tokenizer, engine.chat_template) == (None, None)
    help_text = parser.format_help()
    assert "--tokenizer DIR" in help_text and "--chat-template FILE" in help_text


def test_an_architecture_not_served_is_one_line_at_start_and_a_failing_exit(tmp_path):
    """No traceback: the line names the architecture and every supported one, and the process exits non-zero."""
    import json

    from engine.models import registry
    from tests.support.server_harness import ServerProcess

    model_dir = tmp_path / "gemma3"
    model_dir.mkdir()
    # Gemma 3's multimodal model: its text-only sibling is served, it is not.
    (model_dir / "config.json").write_text(
        json.dumps({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "x"})
    )
    proc = ServerProcess(["--model", str(model_dir), "--embedding-model", "none"], tmp_path / "server.log")
    try:
        assert proc.wait(timeout=120) != 0
    finally:
        proc.kill()
    log = proc.log()
    refusals = [line for line in log.splitlines() if "model loading failed" in line]
    assert len(refusals) == 1, log
    assert (
        "architecture 'Gemma3ForConditionalGeneration' is not supported; supported: " + ", ".join(registry.names())
        in log
    )
    assert "Traceback" not in log
