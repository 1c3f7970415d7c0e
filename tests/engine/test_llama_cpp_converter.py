"""GGUF files as people download them are written by llama.cpp's own converter (`convert_hf_to_gguf.py`), not by
kvserve's test writers. Each family's tiny random checkpoint, with a real tokenizer (rebuilt from the vocabulary
files llama.cpp ships for its tokenizer tests), goes through that converter to a float32 GGUF; kvserve serves the
file with the greedy tokens and logprobs transformers gives for the checkpoint's folder, the tokenizer read from
the file encodes as the folder's does, and the chat template renders the same text.

Llama 3 carries its rope scaling as the `rope_freqs` tensor the converter writes; Phi-3 is Phi-4-mini's shape
(partial rotary, LongRoPE, a GPT-2-style tokenizer); Gemma 3 has five sliding layers to one full, a window shorter
than the prompts, and the per-type RoPE the converter writes as two bases.

Runs where llama.cpp's source is unpacked (scripts/build_llama_cpp.sh puts it in third_party/llama.cpp); skipped
elsewhere."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.text.tokenizer import Tokenizer
from tests.support.checkpoint_greedy import greedy_from_checkpoint
from tests.support.tiny_models import make_tiny_model

LLAMA_CPP = Path(__file__).resolve().parents[2] / "third_party" / "llama.cpp"
CONVERTER = LLAMA_CPP / "convert_hf_to_gguf.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CONVERTER.is_file(), reason="llama.cpp's source not unpacked (scripts/build_llama_cpp.sh)"),
]

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # shorter than max_position_embeddings: every band is scaled
}
# family -> (model_type, the llama.cpp vocabulary its tokenizer comes from, config overrides)
FAMILIES = {
    "llama3": ("llama", "llama-bpe", dict(rope_scaling=LLAMA3_ROPE, max_position_embeddings=1024)),
    "qwen2": ("qwen2", "qwen2", {}),
    "qwen3": ("qwen3", "qwen2", dict(tie_word_embeddings=True)),
    # query_pre_attn_scalar: a Gemma GGUF has no key for it; llama.cpp and kvserve take the head size
    "gemma3": ("gemma3_text", "qwen2", dict(query_pre_attn_scalar=16)),
    "phi4_mini": ("phi3", "gpt-2", dict(tie_word_embeddings=True)),  # a GPT2Tokenizer, as Phi-4-mini's
}
TEXTS = ["Hello world! The quick brown fox jumps over the lazy dog.", "  def main():\n\treturn 42  # é 🙂 東京"]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """vocab name -> a Hugging Face tokenizer folder rebuilt by transformers from llama.cpp's vocab-only GGUF."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("vocab-tokenizers")
    made: dict[str, Path] = {}

    def make(vocab: str) -> Path:
        if vocab not in made:
            tokenizer = AutoTokenizer.from_pretrained(str(LLAMA_CPP / "models"), gguf_file=f"ggml-vocab-{vocab}.gguf")
            tokenizer.save_pretrained(root / vocab)
            made[vocab] = root / vocab
        return made[vocab]

    return make


def _checkpoint(directory: Path, family: str, tokenizer_dir: Path) -> Path:
    """A tiny random `family` folder with the tokenizer of `tokenizer_dir` and an embedding row per token."""
    from transformers import AutoTokenizer

    arch, _, overrides = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    make_tiny_model(directory, arch, vocab_size=len(tokenizer), **ids, **overrides)
    for item in directory.iterdir():  # the tiny test tokenizer's files, replaced by the real one's
        if item.name.startswith("tokenizer") or item.name in ("special_tokens_map.json", "chat_template.jinja"):
            item.unlink()
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, directory / item.name)
    return directory


def _convert(directory: Path, out: Path) -> Path:
    done = subprocess.run(
        [sys.executable, str(CONVERTER), str(directory), "--outfile", str(out), "--outtype", "f32"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _transformers_greedy(directory: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens from full forward passes (no cache), the reference the engine is held to."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    answers = []
    for prompt in prompts:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(max_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        answers.append(ids[len(prompt) :])
    return answers


@pytest.mark.parametrize("family", list(FAMILIES))
def test_files_written_by_llama_cpps_converter_serve_as_their_checkpoint(tmp_path, tokenizer_dirs, family):
    from transformers import AutoTokenizer

    folder = _checkpoint(tmp_path / family, family, tokenizer_dirs(FAMILIES[family][1]))
    gguf_path = _convert(folder, tmp_path / f"{family}.gguf")

    theirs = AutoTokenizer.from_pretrained(str(folder))
    ours = Tokenizer.from_path(gguf_path)
    prompts = [theirs.encode(text) for text in TEXTS]
    assert [ours.encode(text) for text in TEXTS] == prompts
    if theirs.chat_template:
        assert ours.render_chat(MESSAGES) == theirs.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=True
        )

    expected = _transformers_greedy(folder, prompts, max_tokens=6)
    from_file = greedy_from_checkpoint(gguf_path, prompts, max_tokens=6)
    from_folder = greedy_from_checkpoint(folder, prompts, max_tokens=6)
    assert [tokens for tokens, _ in from_file] == expected
    for (_, file_logprobs), (_, folder_logprobs) in zip(from_file, from_folder):
        assert max(abs(a - b) for a, b in zip(file_logprobs, folder_logprobs)) < 1e-4
