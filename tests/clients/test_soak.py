"""clients/bench/soak.py: the plan and the leak arithmetic offline, and a short soak against a real server process
(a tiny generation model, plus the default embedding model when it is cached): no leak, no 5xx."""

from __future__ import annotations

import json

import pytest

from clients.bench.soak import (
    SoakOutcome,
    _judge,
    _parse_args,
    main,
    parse_gauges,
    rss_slope,
    rss_slope_per_requests,
)
from clients.bench.soak_plan import GENERATION_KINDS, SoakPlan, build_plan
from tests.support.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow


def test_the_plan_is_seeded_and_mixes_every_kind() -> None:
    plan = SoakPlan(num_requests=400, seed=3)
    requests = build_plan(plan, "m", "e")
    assert requests == build_plan(plan, "m", "e")
    kinds = {r.kind for r in requests}
    assert kinds == {*GENERATION_KINDS, "embedding", "malformed"}
    streams = [r for r in requests if r.kind.endswith("_stream")]
    assert 0 < sum(r.abandon for r in streams) < len(streams)
    assert not any(r.abandon for r in requests if not r.kind.endswith("_stream"))
    assert any(isinstance(r.body, dict) and r.body.get("n", 1) > 1 for r in requests)
    assert "embedding" not in {r.kind for r in build_plan(plan, "m", None)}


def test_the_long_soak_is_10000_requests_unless_told_otherwise() -> None:
    args, _ = _parse_args(["--long"])
    assert (args.requests, args.duration) == (10_000, 7200.0)
    args, serve = _parse_args(["--long", "--requests", "50", "--", "--max-num-seqs", "4"])
    assert (args.requests, args.duration, serve) == (50, 7200.0, ["--max-num-seqs", "4"])
    args, _ = _parse_args([])
    assert (args.requests, args.duration) == (SoakPlan().num_requests, SoakPlan().duration_s)


def test_judging_outcomes() -> None:
    assert _judge(SoakOutcome("malformed", status=400)) is None
    assert "malformed" in _judge(SoakOutcome("malformed", status=200))
    assert "[DONE]" in _judge(SoakOutcome("chat_stream", status=200))
    assert _judge(SoakOutcome("chat_stream", status=200, saw_done=True)) is None
    assert _judge(SoakOutcome("chat_stream", status=200, abandoned=True)) is None
    assert "no answer" in _judge(SoakOutcome("completion", error="ReadError"))


def test_rss_slope_and_gauges() -> None:
    mib = 1024 * 1024
    assert rss_slope([(0.0, 100 * mib), (30.0, 101 * mib), (60.0, 102 * mib)]) == pytest.approx(2.0)
    assert rss_slope([(0.0, mib)]) is None
    # 500 requests answered between the samples at 10 s and 20 s, while RSS grew 1 MiB: 2 MiB per 1,000.
    samples = [(10.0, 100 * mib), (20.0, 101 * mib), (30.0, 102 * mib)]
    done_at = [10.0 + i / 50 for i in range(1000)]  # 50 a second from 10 s on
    assert rss_slope_per_requests(samples, done_at) == pytest.approx(2.0, rel=0.01)
    assert rss_slope_per_requests(samples[:1], done_at) is None
    text = (
        "# HELP kvserve:num_requests_running Requests.\n"
        'kvserve:num_requests_running{model_name="m"} 0.0\n'
        'kvserve:kv_cache_usage_perc{model_name="m"} 0.25\n'
    )
    assert parse_gauges(text) == {"kvserve:num_requests_running": 0.0, "kvserve:kv_cache_usage_perc": 0.25}


def test_a_short_soak_leaks_nothing(tmp_path) -> None:
    from engine.hub import models_hub

    model_dir = make_tiny_llama(tmp_path / "tiny-llama")
    embedding_model = "all-minilm-l6-v2" if models_hub.is_cached("all-minilm-l6-v2") else "none"
    report_path = tmp_path / "soak.json"
    # --duration only bounds a stuck run: 150 requests take ~20-40 s on 2 busy cores.
    soak_args = ["--requests", "150", "--concurrency", "6", "--max-tokens", "8", "--duration", "300"]
    soak_args += ["--json", str(report_path)]
    serve_args = [
        "--model",
        str(model_dir),
        "--served-model-name",
        "tiny-llama",
        "--embedding-model",
        embedding_model,
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
        "--log-level",
        "warning",
    ]
    exit_code = main([*soak_args, "--", *serve_args])
    report = json.loads(report_path.read_text())
    assert exit_code == 0, report
    assert (report["requests"], report["not_sent"]) == (150, 0)
    assert report["status_5xx"] == 0 and report["transport_errors"] == 0
    assert report["leaks"] == [] and report["failures"] == []
    assert report["abandoned"] > 0 and report["status_4xx"] > 0
    assert report["rss_start_mib"] and report["rss_slope_mib_per_min"] is not None


def test_what_the_server_still_holds_is_reported_as_a_leak() -> None:
    import asyncio

    import httpx

    from clients.bench.soak import _settle

    def answer(running: float) -> httpx.MockTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/health":
                return httpx.Response(200, json={"status": "ok"})
            text = (
                f'kvserve:num_requests_running{{model_name="m"}} {running}\n'
                'kvserve:num_requests_waiting{model_name="m"} 0.0\n'
                'kvserve:kv_cache_usage_perc{model_name="m"} 0.0\n'
            )
            return httpx.Response(200, text=text)

        return httpx.MockTransport(handle)

    async def settle(running: float) -> list[str]:
        async with httpx.AsyncClient(base_url="http://soak", transport=answer(running)) as client:
            return (await _settle(client, timeout_s=0.3))[1]

    assert asyncio.run(settle(0.0)) == []
    assert asyncio.run(settle(1.0)) == ["kvserve:num_requests_running = 1 after the load stopped"]
