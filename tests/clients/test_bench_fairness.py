"""clients/bench/fairness.py against a tiny server: every probe it can run there, and its table."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from clients.bench.fairness import Probe, format_table, run
from server.app import create_app
from tests.support.server_harness import ServerThread, make_server_config
from tests.support.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow


def test_the_health_probes_run_against_a_live_server_and_print_ratios(tmp_path):
    # Loads long enough (a few hundred ms) that the prober, sampling every ~10 ms, lands samples in each
    # window even on a busy 2-core machine; 5,000 characters and 4 tokens once finished between samples.
    args = argparse.Namespace(
        skip_health=False,
        idle_seconds=0.3,
        tokenize_clients=2,
        tokenize_chars=300_000,
        streams=2,
        max_tokens=48,
        itl_tokens=8,
        embed_clients=2,
        embed_batch_clients=1,
    )
    with ServerThread(create_app(make_server_config(make_tiny_llama(tmp_path)))) as srv:
        probes = asyncio.run(run(srv.base_url, args))
    assert [(p.name, p.condition) for p in probes] == [
        ("/health", "idle"),
        ("/health", "tokenize"),
        ("/health", "streams"),
    ]  # no embedding model on this server: no inter-token probes
    assert all(p.values_ms and min(p.values_ms) > 0 for p in probes)
    assert "2 x 0.3 MB" in probes[1].note
    table = format_table(probes)
    assert table.count("\n") == 4 and "| /health | idle |" in table and "1.00x" in table


def test_ratios_are_against_the_idle_probe_of_the_same_name():
    probes = [Probe("itl", "idle", [10.0, 10.0, 10.0]), Probe("itl", "flood", [20.0, 20.0, 20.0], "load")]
    row = format_table(probes).splitlines()[-1]
    assert "| itl | flood | 3 | 20.0 | 20.0 |" in row and row.count("2.00x") == 3
    assert Probe("x", "idle", []).mean() != Probe("x", "idle", []).mean()  # nan: no samples
