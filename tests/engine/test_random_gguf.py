"""engine/bench/random_gguf.py writes a GGUF that kvserve and transformers read alike (tiny shapes here;
the defaults are TinyLlama-1.1B's, Qwen3-0.6B's and Gemma-3-1B's, for benchmarks), with the tensor names and
metadata keys llama.cpp's converter writes for each architecture."""

from __future__ import annotations

import pytest
import torch

from engine.bench.random_gguf import LlamaShape, main, write_random_gguf
from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams

pytestmark = pytest.mark.slow

TINY = LlamaShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
PROMPT = "The quick brown fox jumps over the lazy dog."
# The tiny Qwen3 and Gemma 3 as the script's flags give them. The Gemma 3 keeps the family's head size (256):
# transformers' reading of the file leaves query_pre_attn_scalar at its default, 256, which llama.cpp and
# kvserve take from the head size. Six layers: five sliding (window 8, shorter than the prompt), one full.
# A wider spread of weights than the default, so that greedy tokens are not near-ties.
_TINY_FLAGS = {
    "qwen3": ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--ffn", "128"],
    "gemma3": ["--layers", "6", "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--ffn", "128", "--window", "8"],
}


def _tensor_types(path) -> dict[str, str]:
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def test_q8_0_weights_are_written_as_q8_0_blocks(tmp_path):
    types = _tensor_types(write_random_gguf(tmp_path / "random-Q8_0.gguf", "Q8_0", TINY))
    assert types["blk.1.ffn_down.weight"] == "Q8_0" and types["token_embd.weight"] == "Q8_0"
    assert types["output_norm.weight"] == "F32" and len(types) == 3 + 9 * TINY.num_layers


def test_a_random_gguf_serves_as_transformers_reads_it(tmp_path):
    """Loading parses the copied 49,152-token vocabulary twice (kvserve and transformers): ~30 s."""
    from transformers import AutoModelForCausalLM

    weight_type = "Q4_0"
    path = write_random_gguf(tmp_path / f"random-{weight_type}.gguf", weight_type, TINY, seed=1)
    types = _tensor_types(path)
    assert types["blk.0.attn_q.weight"] == weight_type and types["output.weight"] == weight_type
    assert types["blk.0.attn_norm.weight"] == "F32"

    llm = LLM.from_config(EngineConfig(model=str(path)))  # float32, the blocks dequantized
    assert llm.tokenizer.has_chat_template  # the tokenizer came along
    ids = llm.tokenizer.encode(PROMPT)
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0][0].token_ids
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    input_ids = torch.tensor([ids])
    expected = reference.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=8, min_new_tokens=8, do_sample=False
    )[0, len(ids) :].tolist()
    assert ours == expected


def test_unknown_weight_types_are_refused(tmp_path):
    with pytest.raises(ValueError, match="weight type"):
        write_random_gguf(tmp_path / "x.gguf", "IQ2_XXS", TINY)


@pytest.fixture(scope="module")
def family_gguf(tmp_path_factory):
    """arch -> the tiny Q8_0 file `python -m engine.bench.random_gguf --arch ARCH` writes (each written once)."""
    files = {}

    def get(arch: str):
        if arch not in files:
            out = tmp_path_factory.mktemp(f"random-{arch}") / f"random-{arch}.gguf"
            assert main([str(out), "--arch", arch, "--type", "Q8_0", "--std", "0.2", *_TINY_FLAGS[arch]]) == 0
            files[arch] = out
        return files[arch]

    return get


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_family_files_carry_llama_cpp_names_and_keys(family_gguf, arch):
    """Every tensor is one llama.cpp's table lists for the architecture (the gguf package's MODEL_TENSORS), the
    head is the tied embedding table, and the head size, window and vocabulary are in the metadata."""
    import gguf

    reader = gguf.GGUFReader(str(family_gguf(arch)))
    model_arch = {"qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3": gguf.MODEL_ARCH.GEMMA3}[arch]
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[model_arch]}
    tensors = {t.name: t for t in reader.tensors}
    for name in tensors:
        stem = name.removesuffix(".weight")
        if stem.startswith("blk."):
            stem = "blk.{bid}." + stem.split(".", 2)[2]
        assert stem in allowed, name
    assert "output.weight" not in tensors
    field = lambda key: reader.get_field(key).contents()  # noqa: E731
    assert reader.get_field("general.architecture").contents() == arch
    head_dim = 32 if arch == "qwen3" else 256
    assert field(f"{arch}.attention.key_length") == field(f"{arch}.attention.value_length") == head_dim
    assert list(tensors["blk.0.attn_q_norm.weight"].shape) == [head_dim]
    assert list(tensors["blk.1.attn_q.weight"].shape)[1] == field(f"{arch}.attention.head_count") * head_dim
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == "Q8_0"
    tokens = field("tokenizer.ggml.tokens")
    assert list(tensors["token_embd.weight"].shape)[1] == len(tokens) == field(f"{arch}.vocab_size")
    if arch == "gemma3":
        assert field("gemma3.attention.sliding_window") == 8
        assert {"blk.5.post_attention_norm.weight", "blk.5.post_ffw_norm.weight"} <= set(tensors)
        assert tokens[-1] == "<mask>" and field("tokenizer.ggml.token_type")[-1] == gguf.TokenType.CONTROL
    else:
        assert "<mask>" not in tokens and f"{arch}.attention.sliding_window" not in reader.fields


# Gemma 3 only: each load parses the copied 49k vocabulary (~30 s); Qwen3's GGUF path is held to transformers by
# tests/engine/test_gguf_model_facts.py on a tiny tokenizer.
@pytest.mark.parametrize("arch", ["gemma3"])
def test_family_files_serve_as_transformers_reads_them(family_gguf, arch):
    """kvserve loads the file and gives transformers' greedy tokens for it (float32, the blocks dequantized);
    the Gemma 3's layers fall into five sliding and one full. ~30 s each (the copied vocabulary is parsed)."""
    from transformers import AutoModelForCausalLM

    path = family_gguf(arch)
    llm = LLM.from_config(EngineConfig(model=str(path)))
    assert llm.engine.model_config.architecture == {"qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]
    if arch == "gemma3":
        assert (
            llm.engine.layout.describe()
            == "sliding 8: 5 layers in 5 groups; full: 1 layers in 1 groups; 1 layers per block"
        )
    ids = llm.tokenizer.encode(PROMPT * 2)
    assert len(ids) > 8  # past the window
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0][0].token_ids
    # transformers' reading of a Qwen3 file leaves the head size at its config default (128): give it.
    head_dim = llm.engine.model_config.head_dim
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, head_dim=head_dim
    ).eval()
    input_ids = torch.tensor([ids])
    expected = reference.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=8, min_new_tokens=8, do_sample=False
    )[0, len(ids) :].tolist()
    assert ours == expected


def test_a_flag_the_family_lacks_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x.gguf"), "--arch", "qwen3", "--window", "8"])
    assert "--window" in capsys.readouterr().err
