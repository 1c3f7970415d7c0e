"""Tests for the benchmark client: statistics, workload determinism, the table, and one run over real HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from clients.bench.load import run_benchmark
from clients.bench.results import (
    BenchResult,
    RequestRecord,
    markdown_table,
    percentile,
    summarize,
    write_results,
)
from clients.bench.workload import Workload, build_requests, draw_lengths, fit_prompt
from tests.support.server_harness import free_port

pytestmark = pytest.mark.slow


def fake_count(text: str) -> int:
    """A stand-in tokenizer: one token per word, two for words longer than six letters."""
    return sum(2 if len(w) > 6 else 1 for w in text.split())


# --------------------------------------------------------------------------- statistics


def test_percentile_matches_linear_interpolation() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 25) == 2.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_from_synthetic_timings() -> None:
    # Two requests over a 2 s run: 5 tokens each, one chunk every 0.1 s after a 0.5 s / 0.3 s first token.
    a = RequestRecord(
        start=0.0, end=1.0, chunk_times=[0.5, 0.6, 0.7, 0.8, 0.9], output_tokens=5, prompt_tokens=10, ok=True
    )
    b = RequestRecord(
        start=1.0, end=2.0, chunk_times=[1.3, 1.4, 1.5, 1.6, 1.7], output_tokens=5, prompt_tokens=12, ok=True
    )
    bad = RequestRecord(start=0.0, end=0.1, ok=False, error="RuntimeError: HTTP 500")
    result = summarize([a, b, bad], 2.0, server="s", model="m", workload=Workload(num_requests=3))
    assert result.num_requests == 3
    assert result.num_failed == 1
    assert result.errors == ["RuntimeError: HTTP 500"]
    assert result.total_output_tokens == 10
    assert result.total_prompt_tokens == 22
    assert result.output_tokens_per_s == pytest.approx(5.0)  # 10 tokens / 2 s
    assert result.requests_per_s == pytest.approx(1.0)
    assert result.ttft_p50_ms == pytest.approx(400.0)  # median of 500 and 300 ms
    assert result.ttft_p99_ms == pytest.approx(498.0)
    assert result.itl_p50_ms == pytest.approx(100.0)
    assert result.itl_p99_ms == pytest.approx(100.0)
    assert result.output_tokens_per_s_per_request == pytest.approx(5.0)  # 5 tokens in 1 s each
    assert result.decode_tokens_per_s_per_request == pytest.approx(10.0)  # 4 gaps of 0.1 s
    assert result.tpot_p50_ms == pytest.approx(100.0)


def test_time_per_output_token_counts_every_token_of_a_chunk() -> None:
    """Chunks of several tokens (a greedy burst): the gaps between chunks are long, the time per token is not."""
    bursty = RequestRecord(start=0.0, end=1.0, chunk_times=[0.1, 0.5, 0.9], output_tokens=9, ok=True)
    result = summarize([bursty], 1.0, server="s", model="m", workload=Workload(num_requests=1))
    assert result.itl_p50_ms == pytest.approx(400.0)
    assert result.tpot_p50_ms == pytest.approx(100.0)  # 0.8 s over the 8 tokens after the first


def test_summarize_with_no_successful_request() -> None:
    bad = RequestRecord(start=0.0, end=0.1, ok=False, error="x")
    result = summarize([bad], 0.1, server="s", model="m", workload=Workload(num_requests=1))
    assert result.ttft_p50_ms is None and result.itl_p99_ms is None
    assert result.output_tokens_per_s == 0.0
    assert "—" in markdown_table([result])


# --------------------------------------------------------------------------- workload


def test_workload_is_deterministic_and_sized() -> None:
    wl = Workload(num_requests=5, prompt_len=20, prompt_len_max=40, output_len=8, output_len_max=16, seed=3)
    first = build_requests(wl, fake_count)
    assert first == build_requests(wl, fake_count)
    assert build_requests(Workload(num_requests=5, prompt_len=20, prompt_len_max=40, seed=4), fake_count) != first
    for spec, (p, o) in zip(first, draw_lengths(wl)):
        assert 20 <= p <= 40 and 8 <= o <= 16
        assert spec.max_tokens == o
        assert spec.prompt_tokens == fake_count(spec.prompt) == p
    assert len({s.prompt for s in first}) == 5  # distinct prompts: no cross-request cache hits


def test_fixed_lengths_without_tokenizer() -> None:
    specs = build_requests(Workload(num_requests=3, prompt_len=12, output_len=7), None)
    assert [s.max_tokens for s in specs] == [7, 7, 7]
    assert all(s.prompt_tokens == -1 for s in specs)


def test_fit_prompt_pads_to_exact_length() -> None:
    words = ["alpha", "international", "be", "a", "c", "dd", "e"]
    text, n = fit_prompt(words, 4, fake_count)
    assert n == 4 == fake_count(text)


def test_workload_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        Workload(num_requests=0)
    with pytest.raises(ValueError):
        Workload(prompt_len=10, prompt_len_max=5)


# --------------------------------------------------------------------------- report


def test_markdown_table_and_files(tmp_path: Path) -> None:
    rec = RequestRecord(start=0.0, end=1.0, chunk_times=[0.25, 0.5], output_tokens=2, ok=True)
    result = summarize([rec], 1.0, server="llamacpp", model="m", workload=Workload(name="one", num_requests=1))
    result.peak_memory_mib = 321.4
    table = markdown_table([result])
    lines = table.splitlines()
    assert lines[0].startswith("| server | workload | requests |")
    assert len(lines) == 3
    assert "| llamacpp | one | 1 | 0 | 250.0 |" in lines[2]
    assert "321" in lines[2]
    write_results([result], tmp_path / "r.json", tmp_path / "r.md")
    loaded = json.loads((tmp_path / "r.json").read_text())
    assert loaded[0]["server"] == "llamacpp"
    assert BenchResult(**loaded[0]) == result
    assert (tmp_path / "r.md").read_text().strip() == table


# --------------------------------------------------------------------------- end to end over HTTP


def _fake_openai_app(tokenize_shape: str) -> FastAPI:
    app = FastAPI()
    app.state.bodies = []

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        if tokenize_shape == "llamacpp":
            # Like llama.cpp: a body without "content" still gets 200, with no tokens.
            return JSONResponse({"tokens": list(range(fake_count(body.get("content", ""))))})
        if "prompt" not in body:
            return JSONResponse({"error": "prompt required"}, status_code=400)
        n = fake_count(body["prompt"])
        return JSONResponse({"tokens": list(range(n)), "count": n, "max_model_len": 8192})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        sent = sum(1 for b in app.state.bodies if b.get("speculative", True))
        lines = [
            f'kvserve:spec_decode_num_drafts_total{{model_name="m"}} {10.0 * sent}',
            f'kvserve:spec_decode_num_draft_tokens_total{{model_name="m"}} {30.0 * sent}',
            f'kvserve:spec_decode_num_accepted_tokens_total{{model_name="m"}} {24.0 * sent}',
            f'vllm:spec_decode_num_drafts_total{{model_name="m",engine="0"}} {10.0 * sent}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        app.state.bodies.append(body)
        is_chat = "messages" in body

        async def events():
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.002)
                choice = {"index": 0, "delta": {"content": f" t{i}"}} if is_chat else {"index": 0, "text": f" t{i}"}
                chunk = {"id": "x", "choices": [{**choice, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            last = {"id": "x", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
            yield f"data: {json.dumps(last)}\n\n"
            prompt = body["messages"][0]["content"] if is_chat else body["prompt"]
            usage = {"prompt_tokens": fake_count(prompt), "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(params=["openai", "llamacpp"])
def fake_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, object]]:
    import uvicorn

    app = _fake_openai_app(request.param)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_run_benchmark_end_to_end(fake_server: tuple[str, object]) -> None:
    import os

    url, app = fake_server
    wl = Workload(name="e2e", num_requests=6, concurrency=3, prompt_len=15, output_len=5, output_len_max=9, seed=1)
    result = asyncio.run(
        run_benchmark(url + "/v1", "m", wl, server_label="fake", server_pid=os.getpid(), progress=False)
    )
    expected = build_requests(wl, fake_count)
    assert result.num_failed == 0, result.errors
    assert result.num_requests == 6
    assert result.total_output_tokens == sum(s.max_tokens for s in expected)
    assert result.total_prompt_tokens == 6 * 15
    assert result.extra["prompt_tokens_by_tokenize_mean"] == 15
    assert result.ttft_p50_ms is not None and 1.0 < result.ttft_p50_ms < 2000
    assert result.itl_p50_ms is not None and 1.0 < result.itl_p50_ms < 1000
    assert result.output_tokens_per_s > 0 and result.requests_per_s > 0
    assert result.peak_memory_mib is not None and result.peak_memory_mib > 10
    # The timed requests (after the warm-up) carried the workload's prompts and the ignore-EOS switch.
    bodies = app.state.bodies[wl.warmup_requests :]
    assert sorted(b["prompt"] for b in bodies) == sorted(s.prompt for s in expected)
    assert all(b["ignore_eos"] is True and b["stream"] is True for b in bodies)
    assert all(b["stream_options"] == {"include_usage": True} for b in bodies)


def test_rewrite_task_streams_chat_requests_that_opt_out(fake_server: tuple[str, object]) -> None:
    url, app = fake_server
    wl = Workload(
        name="rw", task="rewrite", num_requests=3, concurrency=2, prompt_len=60, output_len=7, seed=2, speculative=False
    )
    result = asyncio.run(run_benchmark(url, "m", wl, server_label="fake", progress=False))
    assert result.num_failed == 0, result.errors
    assert result.total_output_tokens == 3 * 7  # chat deltas are counted like completion text
    bodies = app.state.bodies[wl.warmup_requests :]
    expected = build_requests(wl, fake_count)
    assert sorted(b["messages"][0]["content"] for b in bodies) == sorted(s.prompt for s in expected)
    assert all(b["speculative"] is False and "prompt" not in b for b in bodies)


# --------------------------------------------------------------------------- tasks


def test_rewrite_passages_are_seeded_sized_and_misspelled() -> None:
    from clients.bench.workload import _ADJECTIVES, _NOUNS, _PLACES, _VERBS, REWRITE_INSTRUCTION

    wl = Workload(task="rewrite", num_requests=4, prompt_len=300, output_len=256, seed=5)
    specs = build_requests(wl, fake_count)
    assert specs == build_requests(wl, fake_count)  # deterministic
    assert len({s.prompt for s in specs}) == 4
    known = {*(w.lower() for w in _ADJECTIVES + _NOUNS + _VERBS), *" ".join(_PLACES).split()}
    for spec in specs:
        assert spec.chat and spec.max_tokens == 256
        assert spec.prompt.startswith(REWRITE_INSTRUCTION)
        passage = spec.prompt[len(REWRITE_INSTRUCTION) :]
        assert 300 <= spec.prompt_tokens == fake_count(passage) < 370  # sentences are added four at a time
        words = [w.strip(".").lower() for w in passage.split()]
        long_words = [w for w in words if len(w) >= 4]
        misspelled = [w for w in long_words if w not in known and w.isalpha()]
        # About 15% of the long words, each one of a known word with two neighbouring letters swapped.
        assert 0.05 < len(misspelled) / len(long_words) < 0.4
        assert all(any(sorted(m) == sorted(k) and len(m) == len(k) for k in known) for m in misspelled if m[:1] != "t")


def test_chat_task_asks_free_form_questions() -> None:
    wl = Workload(task="chat", num_requests=5, output_len=128, seed=1)
    specs = build_requests(wl, None)
    assert all(s.chat and s.max_tokens == 128 and s.prompt.endswith((".", "?")) for s in specs)
    assert len({s.prompt for s in specs}) > 1
    with pytest.raises(ValueError, match="task"):
        Workload(task="poetry")


def test_speculative_report_reads_counters_and_prints_ratios(fake_server: tuple[str, object]) -> None:
    from clients.bench.speculative import Comparison, _acceptance, comparison_table, spec_counters, workloads

    url, app = fake_server
    app.state.bodies.extend([{"speculative": True}, {"speculative": False}])
    counters = spec_counters(url)
    assert counters == {
        "spec_decode_num_drafts": 10.0,
        "spec_decode_num_draft_tokens": 30.0,
        "spec_decode_num_accepted_tokens": 24.0,
    }
    assert _acceptance({}, counters) == (0.8, 2.4)
    assert _acceptance(counters, {}) == (None, None)  # a server that does not speculate
    result = summarize([], 1.0, server="s", model="m", workload=Workload())
    row = Comparison("ngram", "rewrite, 1 stream", 50.0, 110.0, 0.8, 2.4, result, result)
    table = comparison_table([row])
    assert "| ngram | rewrite, 1 stream | 50.0 | 110.0 | 2.20x | 80% | 2.40 |" in table
    names = [w.name for w in workloads(quick=False)]
    assert names == ["rewrite, 1 stream", "rewrite, 8 streams", "chat, 1 stream"]
    rewrite = workloads(quick=False)[0]
    assert (rewrite.task, rewrite.prompt_len, rewrite.output_len, rewrite.temperature) == ("rewrite", 300, 256, 0.0)


# --------------------------------------------------------------------------- suite report


def test_comparison_table_has_ratios() -> None:
    from clients.bench.processes import llama_server_command
    from clients.bench.suite import comparison_table, suite_workloads

    workloads = suite_workloads(quick=True)
    assert [sw.key for sw in workloads] == ["a", "b", "c", "d"]
    assert workloads[1].workload.concurrency == 32 and workloads[2].workload.prompt_len == 512
    assert workloads[3].workload.concurrency == 8

    from clients.bench.processes import kvserve_command, split_serve_args

    argv, serve_args = split_serve_args(["--quick", "--", "--embedding-model", "none"])
    assert argv == ["--quick"] and kvserve_command("m", 1, serve_args)[-2:] == ["--embedding-model", "none"]

    def result(server: str, tokens: int, ttft: float) -> BenchResult:
        recs = [RequestRecord(start=0.0, end=1.0, chunk_times=[ttft, 1.0], output_tokens=tokens, ok=True)]
        r = summarize(recs, 1.0, server=server, model="m", workload=workloads[0].workload)
        r.extra["workload_key"] = "a"
        return r

    table = comparison_table([result("kvserve", 300, 0.1), result("llamacpp", 100, 0.4)], workloads)
    assert "| metric | kvserve | llamacpp | kvserve / llamacpp |" in table
    assert "| output tok/s (total) ↑ | 300.0 | 100.0 | 3.00× |" in table
    assert "| TTFT p50 (ms) ↓ | 100 | 400 | 0.25× |" in table
    assert "(b)" not in table  # no results for workload b: no section

    cmd = llama_server_command(Path("/x/llama-server"), Path("/m.gguf"), 1234)
    assert cmd[:3] == ["/x/llama-server", "-m", "/m.gguf"] and "-np" in cmd and "-kvu" in cmd


def test_rounds_report_each_metrics_median_and_the_ratio_round_by_round() -> None:
    from clients.bench.suite import comparison_table, median_of_rounds, suite_workloads

    workloads = suite_workloads(quick=True)

    def result(server: str, tokens: int, ttft: float) -> BenchResult:
        recs = [RequestRecord(start=0.0, end=1.0, chunk_times=[ttft, 1.0], output_tokens=tokens, ok=True)]
        r = summarize(recs, 1.0, server=server, model="m", workload=workloads[0].workload)
        r.extra["workload_key"] = "a"
        return r

    # The servers take turns: kvserve, llama.cpp, kvserve, llama.cpp, ... (the second round ran on a slow minute).
    rounds = [(300, 0.1, 100, 0.4), (150, 0.3, 60, 0.6), (280, 0.2, 120, 0.5)]
    results = [r for k, kt, o, ot in rounds for r in (result("kvserve", k, kt), result("llamacpp", o, ot))]
    merged = {r.server: r for r in median_of_rounds(results)}
    assert merged["kvserve"].output_tokens_per_s == 280 and merged["llamacpp"].output_tokens_per_s == 100
    assert merged["kvserve"].ttft_p50_ms == 200 and merged["kvserve"].num_requests == 3
    assert merged["kvserve"].extra["rounds"] == [300, 150, 280]
    table = comparison_table(list(merged.values()), workloads)
    assert "| output tok/s (total) ↑ | 280.0 | 100.0 | 2.80× |" in table
    assert "Medians of 3 rounds; kvserve / llamacpp output tok/s by round: 3.00×, 2.50×, 2.33×" in table
    assert median_of_rounds(results[:2]) == results[:2]  # one round: the results as they are


def test_the_avx2_environment_holds_kvserve_to_an_avx2_only_cpus_kernels() -> None:
    """`--isa avx2`: kvserve's process, started with this environment, picks the AVX2 build of its kernels, no
    512-bit products, and torch's AVX2 kernels, whatever this CPU has beyond AVX2."""
    import subprocess
    import sys

    from clients.bench.processes import KVSERVE_ISA_ENV, llama_server_path, python_env
    from clients.bench.suite import parse_args

    probe = (
        "import torch; from engine.ops import gguf_linear, loader; "
        "print(loader.chosen_isa(), gguf_linear.wide_products(), torch.backends.cpu.get_cpu_capability())"
    )
    env = {**python_env(), **KVSERVE_ISA_ENV["avx2"]}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["avx2", "False", "AVX2"]
    assert parse_args(["--isa", "avx2"]).isa == "avx2" and parse_args([]).isa == "native"
    assert llama_server_path("avx2").parent.parent.name == "build-avx2"
    assert llama_server_path().parent.parent.name == "build"


# --------------------------------------------------------------------------- transformers baseline


def test_hf_baseline_generates_exact_lengths_with_timings() -> None:
    """The suite's requests, generated by engine.bench.hf_baseline, read back through its JSON into a result."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from clients.bench.suite import baseline_requests, baseline_result
    from clients.bench.workload import WORDS
    from engine.bench.hf_baseline import BaselineRequest, generate_requests

    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(dict.fromkeys(WORDS))}}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<eos>")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=1,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    wl = Workload(name="hf", num_requests=2, prompt_len=12, output_len=5, output_len_max=7, seed=5)
    requests = [BaselineRequest(**r) for r in json.loads(json.dumps(baseline_requests(wl)))]
    run = generate_requests(model, tokenizer, requests, progress=False)
    result = baseline_result(json.loads(json.dumps(run.to_dict())), wl, "tiny", peak_memory_mib=None)
    expected = build_requests(wl, lambda t: len(t.split()))
    assert result.server == "transformers" and result.model == "tiny"
    assert result.num_failed == 0
    assert result.total_output_tokens == sum(s.max_tokens for s in expected)
    assert result.total_prompt_tokens == 24
    assert result.ttft_p50_ms is not None and result.itl_p50_ms is not None
    assert result.output_tokens_per_s > 0
    assert all(len(r.token_times) == r.output_tokens for r in run.requests)


def test_hf_baseline_refuses_a_prompt_shorter_than_its_token_count() -> None:
    from engine.bench.hf_baseline import BaselineRequest, generate_requests

    class WordTokenizer:
        eos_token_id = 0

        def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
            return {"input_ids": list(range(1, len(text.split()) + 1))}

    with pytest.raises(ValueError, match="fewer than the 5"):
        generate_requests(None, WordTokenizer(), [BaselineRequest("two words", 5, 3)], progress=False)


# --------------------------------------------------------------------------- `kvserve bench`


@pytest.mark.parametrize("fake_server", ["openai"], indirect=True)
def test_kvserve_bench_runs_the_bench_program(fake_server: tuple[str, object], tmp_path: Path) -> None:
    import subprocess
    import sys

    url, _ = fake_server
    repo_root = Path(__file__).resolve().parents[2]
    out = tmp_path / "r.json"
    args = ["-n", "2", "--prompt-len", "6", "--output-len", "3", "--no-progress", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "server", "bench", "--base-url", url, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        cwd=repo_root,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("| server | workload | requests |")
    (result,) = json.loads(out.read_text())
    assert result["num_requests"] == 2 and result["total_output_tokens"] == 6

    bad = subprocess.run(
        [sys.executable, "-m", "server", "bench", "-n", "0"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        cwd=repo_root,
    )
    assert bad.returncode == 2 and "bad workload" in bad.stderr


def test_the_structured_workload_asks_for_the_schema_and_runs_on_kvserve(tmp_path: Path) -> None:
    from clients.bench.load import run_benchmark
    from clients.bench.server_api import completion_body
    from clients.bench.workload import STRUCTURED_SCHEMA, RequestSpec, Workload
    from server.app import create_app
    from tests.support.server_harness import ServerThread, make_server_config
    from tests.support.tiny_models import make_tiny_llama

    workload = Workload(num_requests=4, concurrency=2, prompt_len=8, output_len=12, json_schema=STRUCTURED_SCHEMA)
    body = completion_body("m", RequestSpec("hi", 1, 12), workload)
    assert body["structured_outputs"] == {"json": json.loads(STRUCTURED_SCHEMA)}
    assert "structured_outputs" not in completion_body("m", RequestSpec("hi", 1, 12), Workload())
    with ServerThread(create_app(make_server_config(make_tiny_llama(tmp_path)))) as srv:
        result = asyncio.run(run_benchmark(srv.base_url, "tiny-llama", workload, progress=False))
    assert result.num_failed == 0 and result.total_output_tokens > 0
