"""/metrics under kvserve's names and vLLM's (--metrics-names): what vLLM-built tooling reads is there.

A real server (tiny generator, the default embedder when cached) answers a completion twice (the
repeat is served from the prefix cache), a streamed chat and an embedding request; its /metrics
page is parsed with prometheus_client's own parser. The single-family choices are checked on a
ServerMetrics fed by hand, which needs no server.
"""

from __future__ import annotations

import argparse
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.params import SamplingParams
from server.app import create_app
from server.config import ServerConfig
from server.metrics.server_metrics import ServerMetrics, TokenCounts
from tests.support.server_harness import ServerThread, make_server_config
from tests.support.tiny_models import make_tiny_llama

MODEL = "tiny-llama"
EMBEDDING_MODEL = "all-minilm-l6-v2"
BLOCK_SIZE = 16
PROMPT_IDS = list(range(5, 49))  # 44 tokens: a repeat finds its first 2 full blocks (32 tokens) cached
MAX_TOKENS = 3
CHAT_MAX_TOKENS = 4

# What a vLLM-built router scrapes (sample names, as its parser yields them).
ROUTER_SAMPLES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:gpu_prefix_cache_hit_rate",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
)
# What vLLM's example Grafana dashboard queries, filtered by model_name.
DASHBOARD_SAMPLES = (
    *(f"vllm:e2e_request_latency_seconds_{part}" for part in ("bucket", "sum", "count")),
    *(f"vllm:time_to_first_token_seconds_{part}" for part in ("bucket", "sum", "count")),
    *(f"vllm:time_per_output_token_seconds_{part}" for part in ("bucket", "sum", "count")),
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
# vLLM names kept for tools that still read them; kvserve's own names have one name per quantity.
VLLM_ALIASES = {
    "gpu_cache_usage_perc",
    "gpu_prefix_cache_hit_rate",
    "gpu_prefix_cache_hits",
    "gpu_prefix_cache_queries",
    "time_per_output_token_seconds",
    "time_per_output_token_seconds_created",
    "prompt_tokens_by_source",
}


def _families(text: str) -> dict[str, str]:
    """family name -> its type, for every family on a /metrics page."""
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    """A sample of the generation model: `vllm:` names carry vLLM's engine label too."""
    labels = {"model_name": MODEL, **({"engine": "0"} if name.startswith("vllm:") else {}), **labels}
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# ---- a real server, default names (both) ----


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from engine.hub import models_hub

    embedding_model = EMBEDDING_MODEL if models_hub.is_cached(EMBEDDING_MODEL) else None
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    config = make_server_config(model_dir, embedding_model=embedding_model, block_size=BLOCK_SIZE)
    with ServerThread(create_app(config)) as srv:
        srv.embedding_model = embedding_model
        yield srv


@pytest.fixture(scope="module")
def scraped(server):
    """/metrics before and after: a completion, its repeat, a streamed chat, an embedding request."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    before = httpx.get(f"{server.base_url}/metrics").text
    greedy = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
    for _ in range(2):
        completion = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=MAX_TOKENS, **greedy)
        assert completion.usage.prompt_tokens == len(PROMPT_IDS)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Which metrics does a router read?"}],
            max_tokens=CHAT_MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            **greedy,
        )
    )
    chat_usage = chunks[-1].usage
    assert chat_usage.completion_tokens == CHAT_MAX_TOKENS
    if server.embedding_model is not None:
        client.embeddings.create(model=server.embedding_model, input=["Hello world", "Bonjour"])
    return _samples(before), httpx.get(f"{server.base_url}/metrics").text, chat_usage.prompt_tokens


def test_names_vllm_tooling_reads_are_there_with_the_model_label(scraped):
    _, text, _ = scraped
    names = {name for name, labels in _samples(text) if ("model_name", MODEL) in labels}
    missing = sorted(set(ROUTER_SAMPLES + DASHBOARD_SAMPLES) - names)
    assert not missing, missing
    families = _families(text)
    assert families["vllm:num_requests_running"] == families["vllm:gpu_cache_usage_perc"] == "gauge"
    assert families["vllm:prompt_tokens"] == families["vllm:gpu_prefix_cache_hits"] == "counter"
    assert families["vllm:time_to_first_token_seconds"] == families["vllm:request_prompt_tokens"] == "histogram"


def test_both_exports_the_kvserve_names_too(scraped):
    _, text, _ = scraped
    families = _families(text)
    for name in (
        "num_requests_running",
        "kv_cache_usage_perc",
        "prefix_cache_hits",
        "prompt_tokens",
        "prompt_tokens_cached",
        "generation_tokens",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_success",
    ):
        assert families["kvserve:" + name] == families["vllm:" + name], name


def test_prompt_tokens_count_the_whole_repeated_prompt_and_the_cached_part_apart(scraped):
    before, text, chat_prompt_tokens = scraped
    after = _samples(text)
    expected_cached = (len(PROMPT_IDS) - 1) // BLOCK_SIZE * BLOCK_SIZE  # full blocks before the last token
    for prefix in ("kvserve:", "vllm:"):

        def delta(name: str, prefix: str = prefix, **labels: str) -> float:
            return _value(after, prefix + name, **labels) - _value(before, prefix + name, **labels)

        assert delta("prompt_tokens_total") == 2 * len(PROMPT_IDS) + chat_prompt_tokens, prefix
        assert delta("prompt_tokens_cached_total") == expected_cached, prefix
        assert delta("generation_tokens_total") == 2 * MAX_TOKENS + CHAT_MAX_TOKENS, prefix
        assert delta("request_success_total", finished_reason="length") == 3, prefix
    computed = _value(after, "vllm:prompt_tokens_by_source_total", source="local_compute")
    cached = _value(after, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert (computed + cached, cached) == (
        _value(after, "vllm:prompt_tokens_total"),
        _value(after, "vllm:prompt_tokens_cached_total"),
    )


def test_per_request_histograms_count_each_request_once(scraped):
    before, text, chat_prompt_tokens = scraped
    after = _samples(text)
    for prefix in ("kvserve:", "vllm:"):

        def delta(name: str, prefix: str = prefix) -> float:
            return _value(after, prefix + name) - _value(before, prefix + name)

        assert delta("request_prompt_tokens_count") == 3, prefix
        assert delta("request_prompt_tokens_sum") == 2 * len(PROMPT_IDS) + chat_prompt_tokens, prefix
        assert delta("request_generation_tokens_count") == 3, prefix
        assert delta("request_generation_tokens_sum") == 2 * MAX_TOKENS + CHAT_MAX_TOKENS, prefix
        assert delta("request_max_num_generation_tokens_sum") == 2 * MAX_TOKENS + CHAT_MAX_TOKENS, prefix
        assert delta("request_params_max_tokens_sum") == 2 * MAX_TOKENS + CHAT_MAX_TOKENS, prefix
        assert (delta("request_params_n_count"), delta("request_params_n_sum")) == (3, 3), prefix
        for name in (
            "time_to_first_token_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "request_inference_time_seconds",
            "request_time_per_output_token_seconds",
        ):
            assert delta(f"{name}_count") == 3, (prefix, name)
        # One observation per step after the first token: (max_tokens - 1) per request.
        itl = delta("inter_token_latency_seconds_count")
        assert itl == 2 * (MAX_TOKENS - 1) + CHAT_MAX_TOKENS - 1, prefix
    assert _value(after, "vllm:time_per_output_token_seconds_count") == _value(
        after, "vllm:inter_token_latency_seconds_count"
    )


def test_embedding_series_carry_the_embedding_model_name(server, scraped):
    if server.embedding_model is None:
        pytest.skip(f"{EMBEDDING_MODEL} is not in the local cache (kvserve pull {EMBEDDING_MODEL})")
    after = _samples(scraped[1])
    labels = (("endpoint", "/v1/embeddings"), ("model_name", EMBEDDING_MODEL))
    assert after[("kvserve:embedding_inputs_total", labels)] == 2
    assert after[("kvserve:embedding_prompt_tokens_total", labels)] > 2
    assert after[("kvserve:embedding_request_latency_seconds_count", labels)] == 1


# ---- one family of names: no server needed ----


def _page(metrics_names: str) -> str:
    """The page of a ServerMetrics that saw one two-token request and one embedding request (on an engine
    that speculates, so the spec_decode series are there too)."""
    stats = EngineStats(
        0, 0, 0, 10, 44, 32, 0, 44, 2, num_cached_prompt_tokens=32, num_computed_prompt_tokens=12,
        num_spec_drafts=1, num_spec_draft_tokens=2, num_spec_accepted_tokens=1, spec_accepted_per_position=(1, 0),
    )  # fmt: skip
    metrics = ServerMetrics(MODEL, lambda: stats, metrics_names, embedding_model_name=EMBEDDING_MODEL)
    timer = metrics.start_request()
    timer.on_submit(SamplingParams(max_tokens=2))
    now = time.monotonic()
    tokens = TokenCounts()
    for i in range(2):
        sample = CompletionOutput(0, "", [7 + i], None, "length" if i else None, num_generated_tokens=i + 1)
        output = RequestOutput("r", [sample], PROMPT_IDS, bool(i), now - 0.2, first_scheduled_time=now - 0.1)
        tokens.add(0, output)
        timer.on_output(output)
    timer.finish("length", tokens)
    metrics.observe_embedding_request(endpoint="/embed", num_inputs=1, num_prompt_tokens=5, latency_seconds=0.01)
    return metrics.render().decode()


def test_kvserve_names_only():
    families = _families(_page("kvserve"))
    assert not [name for name in families if not name.startswith("kvserve:")]


def test_vllm_names_only_but_for_the_series_vllm_has_none_of():
    families = _families(_page("vllm"))
    kvserve = {name for name in families if name.startswith("kvserve:")}
    # series vLLM has none of
    kvserve_always = ("kvserve:embedding_", "kvserve:kv_cache_bytes_per_token", "kvserve:greedy_burst")
    assert kvserve and all(name.startswith(kvserve_always) for name in kvserve)
    assert not [name for name in families if not name.startswith(("vllm:", *kvserve_always))]
    # Every kvserve series has its vLLM name, and every vLLM name but the aliases is a kvserve series.
    kvserve_only = {n.removeprefix("kvserve:") for n in _families(_page("kvserve"))} - {
        n.removeprefix("kvserve:") for n in kvserve
    }
    assert {n.removeprefix("vllm:") for n in families if n.startswith("vllm:")} - VLLM_ALIASES == kvserve_only


def test_the_flag_its_variable_and_its_default(monkeypatch):
    from server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.config_from_args(parser.parse_args([])).metrics_names == "both"
    assert cli.config_from_args(parser.parse_args(["--metrics-names", "VLLM"])).metrics_names == "vllm"
    with pytest.raises(SystemExit):
        parser.parse_args(["--metrics-names", "prometheus"])
    monkeypatch.setenv("KVSERVE_METRICS_NAMES", "kvserve")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.config_from_args(parser.parse_args([])).metrics_names == "kvserve"
    with pytest.raises(ValueError, match="metrics_names must be one of"):
        ServerConfig(metrics_names="prometheus")
