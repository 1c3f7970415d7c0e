"""What a loaded catalogue model is, to the routes: a generation model's engine with its tokenizer work and
think tokens, or an encoder's batcher; and the bytes it holds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine import AsyncEncoder, models_hub
from server.catalogue.entries import ModelEntry

if TYPE_CHECKING:
    from engine import AsyncEngine
    from server.openai.reasoning import ThinkTokens
    from server.openai.text import RequestText

# Weight files a model folder's bytes are counted from.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


@dataclass(frozen=True)
class ServedGeneration:
    """A loaded generation model: its name in answers, its engine, where its request text is tokenized (off
    the loop), and its <think> and </think> tokens under --reasoning-parser (None: no parser)."""

    name: str
    engine: AsyncEngine
    text: RequestText
    reasoning: ThinkTokens | None


Served = ServedGeneration | AsyncEncoder


def is_healthy(served: Served) -> bool:
    return served.engine.is_healthy if isinstance(served, ServedGeneration) else served.is_healthy


def num_requests_inside(served: Served) -> int:
    """Requests the model's own queue holds (a generation engine's running ones too)."""
    if isinstance(served, ServedGeneration):
        return served.engine.num_active_requests
    return served.num_queued_requests


async def stop(served: Served) -> None:
    await (served.engine.stop() if isinstance(served, ServedGeneration) else served.stop())


def measured_bytes(entry: ModelEntry, served: Served) -> int:
    """What a loaded model holds: a generation model's weights as held (quantized blocks included) plus its
    KV block pool; an encoder's weight files."""
    if isinstance(served, ServedGeneration):
        engine = served.engine
        stats = engine.stats()
        block_size = getattr(entry.config, "block_size", 16)
        return engine.model_info.weight_bytes + stats.num_total_blocks * block_size * stats.kv_bytes_per_token
    return file_bytes(entry.config.model)


def estimated_bytes(entry: ModelEntry) -> int:
    """What a model will hold once loaded, before it is: its weight files, plus a generation model's KV
    cache budget. 0 where the files are not on this machine (a Hub id to download)."""
    kv_bytes = getattr(entry.config, "kv_cache_memory_bytes", 0) if entry.task == "generate" else 0
    return file_bytes(entry.config.model) + kv_bytes


def file_bytes(model: str) -> int:
    try:
        path = models_hub.resolve_model(model, auto_pull=False)
    except Exception:  # not pulled, not a path: nothing to count before the load says why
        return 0
    return _bytes_at(path)


def _bytes_at(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    return 0
