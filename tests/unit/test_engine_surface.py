"""engine/__init__.py: the public surface. Its names, their lazy import, and ModelInfo."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import engine
from engine import LLM, AsyncEngine, EngineConfig, ModelInfo
from engine.model_info import ATTENTION_FULL, ATTENTION_SLIDING, read_model_info
from engine.ops import loader
from engine.ops.cpu_features import cpu_features

SURFACE = Path(engine.__file__)


def _type_checking_imports() -> dict[str, str]:
    """name -> the module after `from`, in the `if TYPE_CHECKING:` block (what type checkers and readers see)."""
    tree = ast.parse(SURFACE.read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
    names = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module
        names.update((alias.name, node.module) for alias in node.names)
    return names


def test_the_name_lists_agree() -> None:
    typed = _type_checking_imports()
    assert sorted(typed) == sorted(engine._EXPORTS) == sorted(engine.__all__)
    assert len(engine.__all__) == len(set(engine.__all__))
    for name, module in typed.items():
        # `from engine.hub import models_hub` is the module engine.hub.models_hub itself
        assert engine._EXPORTS[name] in (module, f"{module}.{name}"), name


def test_every_name_is_its_defining_modules_object() -> None:
    for name, module_name in engine._EXPORTS.items():
        module = importlib.import_module(module_name)
        expected = module if module_name.rsplit(".", 1)[-1] == name else getattr(module, name)
        assert getattr(engine, name) is expected, name
    assert set(engine.__all__) <= set(dir(engine))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchName"):
        engine.NoSuchName  # noqa: B018


@pytest.mark.slow
def test_the_light_names_import_without_torch() -> None:
    """`kvserve pull` and `kvserve models` import these: the surface must not pull torch in behind them."""
    code = (
        "import sys\n"
        "import engine.errors, engine.params, engine.outputs\n"
        "from engine import models_hub, DEFAULT_GENERATION_MODEL, InvalidRequestError, SamplingParams\n"
        "from engine import StructuredOutput, Tokenizer, TextWorker, AsyncEngine\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    root = SURFACE.parent.parent
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_model_info_describes_the_engine_as_it_runs_the_model(tiny_llama_dir: str) -> None:
    llm = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, max_model_len=64))
    model = llm.engine.model_config
    info = AsyncEngine(llm.engine, llm.tokenizer).model_info
    assert info == ModelInfo(
        model_name=tiny_llama_dir,
        architecture="llama",
        num_parameters=sum(p.numel() for p in llm.engine.runner.model.parameters()),  # float32: nothing quantized
        weight_bytes=4 * sum(p.numel() for p in llm.engine.runner.model.parameters()),
        quantization="none",
        hidden_size=model.hidden_size,
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        attention_kinds=(ATTENTION_FULL,) * model.num_layers,
        sliding_window=None,
        num_sink_tokens=0,
        max_model_len=64,
        vocab_size=model.vocab_size,
        device="cpu",
        cpu_features=cpu_features(),
        kernel_build=loader.chosen_isa() if llm.engine.runner.decode_plan.native_ops else None,
        prefill_dtype=None,  # a float32 folder: no GGUF block layers
        kv_cache_dtype="float32",  # auto, unquantized float32: the exact mode keeps a float32 cache
        kv_bytes_per_token=2 * model.num_layers * model.num_kv_heads * model.head_dim * 4,
    )

    windowed = LLM.from_config(EngineConfig(model=tiny_llama_dir, block_size=4, sliding_window=8, num_sink_tokens=2))
    info = read_model_info(windowed.engine)
    assert info.attention_kinds == (ATTENTION_SLIDING,) * model.num_layers
    assert (info.sliding_window, info.num_sink_tokens) == (8, 2)
