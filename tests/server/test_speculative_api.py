"""Speculative decoding through the HTTP API: `--speculative-method ngram`, the per-request `speculative`
switch, the spec_decode_* counters on /metrics, and the flags' errors.

Two tiny llamas are served, each built from the command line as `kvserve serve` builds it:

- a random one, whose drafts are (almost) always rejected: the path where verification throws them away;
- a "copying" one whose attention and MLP outputs are zeroed and whose lm_head is set so that the next
  token is a fixed function of the last one, chosen here: a cycle through some tokens (the run), every
  other token followed by itself. A prompt that holds the run earlier on makes the n-gram proposer draft
  what the model then writes: drafts are accepted, several tokens arrive in one step, and acceptance
  falls off where the copied part of the run ends.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from engine.outputs import EngineStats
from server import cli
from server.app import create_app
from server.metrics.server_metrics import ServerMetrics
from tests.support.server_harness import ServerThread
from tests.support.tiny_models import SPECIAL_TOKENS, make_tiny_llama

MODEL = "tiny-llama"
NUM_SPECULATIVE_TOKENS = 4
SERVE_ARGS = [
    "--embedding-model",
    "none",
    "--max-model-len",
    "256",
    "--kv-cache-memory",
    "16MiB",
    "--max-num-seqs",
    "16",
    "--served-model-name",
    MODEL,
    "--log-level",
    "warning",
]
SPEC_ARGS = ["--speculative-method", "ngram", "--num-speculative-tokens", str(NUM_SPECULATIVE_TOKENS)]
COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
# The copying model's prompt: the first COPIED_RUN tokens of its run, other tokens, then the run's first
# RESTART tokens again. The model goes on with the run from there; the proposer drafts it from the earlier
# copy, which ends after COPIED_RUN tokens (drafts past that point are rejected). One step then brings
# expected[1:6] (4 accepted drafts and the token after them), the next expected[6:9] (2 of 4 accepted).
COPIED_RUN = 11
RESTART = 3
MAX_TOKENS = 16


def _parse(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(args))


def _config(model_dir: Path, *extra: str):
    return cli.config_from_args(_parse("--model", str(model_dir), *SERVE_ARGS, *extra))


def _make_copying_llama(directory: Path, run: list[int]) -> Path:
    """Make `directory`'s tiny llama one whose next token depends on the last token alone: each token of
    `run` is followed by the next one (the last by the first), every other token by itself.

    With o_proj and down_proj zero, no layer adds anything to the residual, so the final hidden state is
    the last token's embedding; lm_head's row for token b is then the embedding of the token a it follows,
    and a's own embedding scores highest against itself (checked here, with a wide margin).
    """
    weights = load_file(directory / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    embeddings = weights["model.embed_tokens.weight"]
    follows = list(range(len(embeddings)))  # follows[b]: the token b comes after
    for a, b in zip(run, run[1:] + run[:1]):
        follows[b] = a
    weights["lm_head.weight"] = embeddings[follows].clone()
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    eps = json.loads((directory / "config.json").read_text())["rms_norm_eps"]
    hidden = embeddings * torch.rsqrt(embeddings.pow(2).mean(-1, keepdim=True) + eps) * weights["model.norm.weight"]
    top = (hidden @ weights["lm_head.weight"].T).topk(2, dim=-1)
    assert (top.values[:, 0] - top.values[:, 1]).min() > 0.5  # no near-ties: float error cannot flip a choice
    assert [top.indices[a, 0].item() for a in run] == run[1:] + run[:1]
    return directory


@pytest.fixture(scope="module")
def random_server(tmp_path_factory):
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    with ServerThread(create_app(_config(model_dir, *SPEC_ARGS))) as srv:
        yield srv


@pytest.fixture(scope="module")
def copying(tmp_path_factory):
    """The copying model, served with speculation; a prompt whose continuation it drafts well, that
    continuation, and the tokenizer."""
    from transformers import AutoTokenizer

    model_dir = make_tiny_llama(tmp_path_factory.mktemp("copying-llama"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Tokens whose text is two or more printable ASCII characters: whole, distinct, readable in a failure.
    words = [
        t
        for t in range(len(SPECIAL_TOKENS), len(tokenizer))
        if len(text := tokenizer.decode([t])) > 1 and text.isascii() and text.isprintable()
    ]
    run, others = words[: RESTART + MAX_TOKENS + 1], words[RESTART + MAX_TOKENS + 1 :][:4]
    _make_copying_llama(model_dir, run)
    prompt = run[:COPIED_RUN] + others + run[:RESTART]
    with ServerThread(create_app(_config(model_dir, *SPEC_ARGS))) as srv:
        yield srv, prompt, run[RESTART : RESTART + MAX_TOKENS], tokenizer


def _samples(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.base_url}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _spec(samples: dict, prefix: str = "kvserve:") -> dict[str, float]:
    """The speculative counters (and per position, keyed by position) of the served model."""
    labels = (("model_name", MODEL),) if prefix == "kvserve:" else (("engine", "0"), ("model_name", MODEL))
    values = {name: samples[(f"{prefix}{name}_total", labels)] for name in COUNTERS}
    for position in range(NUM_SPECULATIVE_TOKENS):
        key = (f"{prefix}{PER_POS}_total", tuple(sorted((*labels, ("position", str(position))))))
        values[position] = samples[key]
    return values


def _delta(after: dict, before: dict) -> dict:
    return {key: after[key] - before[key] for key in after}


def _completion(server, **body) -> dict:
    request = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **body}
    response = httpx.post(f"{server.base_url}/v1/completions", json=request, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _same_answer(on: dict, off: dict) -> None:
    """Same text, same tokens (the logprob entries name them) and the same usage."""
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    assert on["choices"][0]["logprobs"]["tokens"] == off["choices"][0]["logprobs"]["tokens"]
    assert on["usage"] == off["usage"]
    assert on["choices"][0]["finish_reason"] == off["choices"][0]["finish_reason"] == "length"


# ---- greedy output is the same with and without speculation ----


def test_greedy_completion_is_identical_with_rejected_drafts(random_server):
    # 32 tokens of this random model's answer repeat a few pairs of tokens: enough for a few drafts.
    body = {"prompt": "Hello world", "max_tokens": 32, "logprobs": 0}
    before = _spec(_samples(random_server))
    on = _completion(random_server, **body)
    middle = _spec(_samples(random_server))
    off = _completion(random_server, **body, speculative=False)
    after = _spec(_samples(random_server))
    _same_answer(on, off)
    grew = _delta(middle, before)
    assert grew["spec_decode_num_draft_tokens"] > grew["spec_decode_num_accepted_tokens"]  # rejections happened
    assert not any(_delta(after, middle).values())  # the opted-out request did not


def test_greedy_completion_is_identical_with_accepted_drafts_and_counters_grow(copying):
    server, prompt, expected, tokenizer = copying
    before = _spec(_samples(server))
    on = _completion(server, prompt=prompt, logprobs=0)
    middle = _spec(_samples(server))
    off = _completion(server, prompt=prompt, logprobs=0, speculative=False)
    after = _spec(_samples(server))
    _same_answer(on, off)
    assert on["choices"][0]["text"] == tokenizer.decode(expected)  # the model continues the run

    grew = _delta(middle, before)
    drafts, proposed, accepted = (grew[name] for name in COUNTERS)
    assert drafts >= 1 and proposed >= accepted > 0
    # Position j counts the verifications that kept draft token j+1 (so also every token before it).
    per_position = [grew[j] for j in range(NUM_SPECULATIVE_TOKENS)]
    assert sum(per_position) == accepted
    assert drafts >= per_position[0] and all(a >= b for a, b in zip(per_position, per_position[1:]))
    assert per_position[-1] < per_position[0]  # drafts past the end of the copied run were rejected
    # Exactly: 4 of 4 drafts accepted, then 2 of 4 (the copy ends), then nothing left to copy.
    assert (drafts, proposed, accepted, per_position) == (2, 8, 6, [2, 2, 1, 1])
    assert not any(_delta(after, middle).values())  # speculative false: nothing proposed
    # vLLM's names carry the same values.
    assert _spec(_samples(server), "vllm:") == after


def test_n_samples_and_a_seeded_sampled_request_speculate(copying):
    server, prompt, _, _ = copying
    both = _completion(server, prompt=prompt, n=2)
    assert both["choices"][0]["text"] == both["choices"][1]["text"]  # greedy samples agree
    assert both["usage"]["completion_tokens"] == 2 * MAX_TOKENS
    sampled = _completion(server, prompt=prompt, temperature=1.0, seed=3)
    assert sampled["usage"]["completion_tokens"] == MAX_TOKENS
    again = _completion(server, prompt=prompt, temperature=1.0, seed=3)
    assert again["choices"][0]["text"] == sampled["choices"][0]["text"]  # a seed still fixes the sample


def test_streamed_chat_with_speculation(copying):
    """The chat template ends in a token the copying model repeats: every draft of it is accepted, so
    chunks carry several tokens."""
    server, _, _, _ = copying
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "temperature": 0.0}
    request["max_tokens"] = MAX_TOKENS
    before = _spec(_samples(server))
    chunks = list(
        client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        )
    )
    grew = _delta(_spec(_samples(server)), before)
    whole = client.chat.completions.create(**request, extra_body={"ignore_eos": True, "speculative": False})
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert grew["spec_decode_num_accepted_tokens"] > 0
    assert len(pieces) < MAX_TOKENS  # some chunks carried several tokens


def _stop_request(copying) -> tuple[dict, str, int]:
    """A completion of the copying prompt with a stop string that ends inside a step's accepted drafts:
    the step emits expected[1:6] at once, and the stop string is expected[3]'s text."""
    _, prompt, expected, tokenizer = copying
    stop = tokenizer.decode([expected[3]])
    before_stop = tokenizer.decode(expected[:3])
    assert tokenizer.decode(expected).find(stop) == len(before_stop)  # its first occurrence, where the token is
    body = {"prompt": prompt, "stop": [stop], "logprobs": 0}
    return body, before_stop, 4  # the tokens up to the one that completes the stop string


def test_a_stop_string_inside_accepted_drafts_cuts_the_text_there(copying):
    server = copying[0]
    body, text, _ = _stop_request(copying)
    for speculative in (True, False):
        choice = _completion(server, **body, speculative=speculative)["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (text, "stop", body["stop"][0])


def test_a_stop_string_inside_accepted_drafts_counts_the_tokens_up_to_it(copying):
    server = copying[0]
    body, _, num_tokens = _stop_request(copying)
    off = _completion(server, **body, speculative=False)
    assert off["usage"]["completion_tokens"] == len(off["choices"][0]["logprobs"]["tokens"]) == num_tokens
    on = _completion(server, **body)
    assert on["usage"] == off["usage"]
    assert on["choices"][0]["logprobs"]["tokens"] == off["choices"][0]["logprobs"]["tokens"]


# ---- the request field ----


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("value", ["yes", 1, None, "true"])
def test_speculative_must_be_a_boolean(random_server, route, value):
    body = {"model": MODEL, "max_tokens": 2, "speculative": value}
    if route == "/v1/completions":
        body["prompt"] = "Hello"
    elif route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "Hello"}]
    else:
        body = {"model": MODEL, "input": "Hello", "max_output_tokens": 2, "speculative": value}
    response = httpx.post(f"{random_server.base_url}{route}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "speculative" and error["type"] == "invalid_request_error"


def test_responses_take_the_switch_too(random_server):
    body = {"model": MODEL, "input": "Hello there", "max_output_tokens": 6, "temperature": 0.0}

    def text(extra: dict) -> str:
        response = httpx.post(f"{random_server.base_url}/v1/responses", json={**body, **extra}, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["output"][0]["content"][0]["text"]

    assert text({}) == text({"speculative": False})


# ---- /metrics: only while speculating ----


def _page(metrics_names: str, stats: EngineStats) -> dict[str, dict[tuple, float]]:
    """family name -> {labels: value} of a ServerMetrics page over `stats`."""
    text = ServerMetrics(MODEL, lambda: stats, metrics_names).render().decode()
    return {
        family.name: {tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name.endswith("_total")}
        for family in text_string_to_metric_families(text)
    }


SPECULATING = EngineStats(
    0, 0, 0, 10, 0, 0, 0, 44, 20, 0, 44, num_spec_drafts=5, num_spec_draft_tokens=20,
    num_spec_accepted_tokens=9, spec_accepted_per_position=(5, 2, 1, 1),
)  # fmt: skip


@pytest.mark.parametrize("metrics_names", ["kvserve", "vllm", "both"])
def test_spec_series_under_each_name_family_only_while_speculating(metrics_names):
    prefixes = {"kvserve": ("kvserve:",), "vllm": ("vllm:",), "both": ("kvserve:", "vllm:")}[metrics_names]
    page = _page(metrics_names, SPECULATING)
    for prefix in prefixes:
        engine = (("engine", "0"),) if prefix == "vllm:" else ()
        labels = tuple(sorted((("model_name", MODEL), *engine)))
        assert page[prefix + "spec_decode_num_drafts"] == {labels: 5}
        assert page[prefix + "spec_decode_num_draft_tokens"] == {labels: 20}
        assert page[prefix + "spec_decode_num_accepted_tokens"] == {labels: 9}
        per_position = {tuple(sorted((*labels, ("position", str(j))))): v for j, v in enumerate((5, 2, 1, 1))}
        assert page[prefix + PER_POS] == per_position
    assert len([name for name in page if "spec_decode" in name]) == 4 * len(prefixes)
    not_speculating = _page(metrics_names, EngineStats(0, 0, 0, 10, 0, 0, 0, 44, 20, 0, 44))
    assert not [name for name in not_speculating if "spec_decode" in name]


# ---- the flags ----


def test_speculation_is_off_by_default_and_the_flags_build_its_config(monkeypatch):
    assert cli.config_from_args(_parse()).engine.speculative is None
    assert cli.config_from_args(_parse("--speculative-method", "none")).engine.speculative is None
    args = ["--speculative-method", "NGRAM", "--num-speculative-tokens", "6", "--ngram-min", "1", "--ngram-max", "3"]
    spec = cli.config_from_args(_parse(*args)).engine.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max) == ("ngram", 6, 1, 3)
    spec = cli.config_from_args(_parse("--speculative-method", "draft", "--draft-model", "/models/small")).engine
    assert (spec.speculative.method, spec.speculative.draft_model) == ("draft", "/models/small")
    monkeypatch.setenv("KVSERVE_SPECULATIVE_METHOD", "ngram")
    monkeypatch.setenv("KVSERVE_NUM_SPECULATIVE_TOKENS", "2")
    spec = cli.config_from_args(_parse("--ngram-max", "5")).engine.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.ngram_max) == ("ngram", 2, 5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--draft-model", "/models/small"], "--draft-model is only used with --speculative-method draft"),
        (["--speculative-method", "ngram", "--draft-model", "/models/small"], "only used with speculative method"),
        (["--speculative-method", "draft"], "needs a draft model (--draft-model)"),
        (["--speculative-method", "ngram", "--ngram-min", "5", "--ngram-max", "2"], "ngram_min <= ngram_max"),
        (["--ngram-min", "5", "--ngram-max", "2"], "ngram_min <= ngram_max"),  # checked with speculation off too
        (["--speculative-method", "ngram", "--num-speculative-tokens", "17"], "num_speculative_tokens must be in"),
        (["--num-speculative-tokens", "0"], "num_speculative_tokens must be in"),
    ],
)
def test_a_bad_speculative_flag_is_a_command_line_error(args, message, capsys):
    assert cli.main(["--model", "/models/none", "--embedding-model", "none", *args]) == 2
    assert message in capsys.readouterr().err


def test_an_unknown_method_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse("--speculative-method", "medusa")
    assert exit_info.value.code == 2
    assert "must be one of ngram, draft" in capsys.readouterr().err
