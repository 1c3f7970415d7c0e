"""Shared fixtures: tiny random models (session-scoped, built once) and engines."""

from __future__ import annotations

import pytest

from engine.models import registry
from tests.support.tiny_models import make_tiny_model

# Every registered decoder, by model_type: the keys of tiny_model_dirs.
ARCHS = tuple(entry.model_type for entry in registry.entries())


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """One tiny random model directory per supported architecture."""
    return {arch: str(make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]
