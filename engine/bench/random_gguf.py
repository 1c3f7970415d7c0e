"""A LLaMA-shaped model with random weights, written as a GGUF file: a larger model to benchmark.

    python -m engine.bench.random_gguf OUT.gguf [--type Q4_0|Q8_0|F32] [--layers 22 --hidden 2048 ...]

The defaults are TinyLlama-1.1B's shape (22 layers, hidden 2048, 32 query / 4 KV heads, FFN 5632),
about 1.1 billion parameters with the default model's 49,152-token vocabulary. The tokenizer (its
vocabulary, merges, special tokens and chat template) is copied from a source GGUF, the default
generation model's by default, so the file serves like any other; the weights are random normal
(standard deviation 0.02, norms 1), so the text it writes is noise: it is for speed and memory, and
for comparing servers on the same quantized blocks. Weight matrices are quantized to `--type` with
the `gguf` package's own quantizer (the format llama.cpp reads); norms stay float32. The output
layer is its own matrix, as in TinyLlama. Nothing is downloaded; ~1.1 GB of memory per billion
parameters in Q8_0 while writing. The file is large: make it, do not commit it.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from engine.hub.models_hub import DEFAULT_GENERATION_MODEL

logger = logging.getLogger(__name__)

WEIGHT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F32")
_INIT_STD = 0.02


@dataclass(frozen=True)
class LlamaShape:
    num_layers: int = 22
    hidden_size: int = 2048
    num_heads: int = 32
    num_kv_heads: int = 4
    intermediate_size: int = 5632
    context_length: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def add_shape_metadata(writer, shape: LlamaShape, vocab_size: int) -> None:
    """The `llama.*` keys a reader needs to build the model: layer count, sizes, heads, RoPE and norm."""
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_vocab_size(vocab_size)


def _tensor_shapes(shape: LlamaShape, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names with their numpy shapes [rows, columns] (a linear layer's [out, in])."""
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab_size, h))]
    for i in range(shape.num_layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (h,)),
            (f"blk.{i}.attn_q.weight", (h, h)),
            (f"blk.{i}.attn_k.weight", (kv, h)),
            (f"blk.{i}.attn_v.weight", (kv, h)),
            (f"blk.{i}.attn_output.weight", (h, h)),
            (f"blk.{i}.ffn_norm.weight", (h,)),
            (f"blk.{i}.ffn_gate.weight", (shape.intermediate_size, h)),
            (f"blk.{i}.ffn_up.weight", (shape.intermediate_size, h)),
            (f"blk.{i}.ffn_down.weight", (h, shape.intermediate_size)),
        ]
    tensors += [("output_norm.weight", (h,)), ("output.weight", (vocab_size, h))]
    return tensors


def _copy_tokenizer(reader, writer) -> int:
    """Copy every tokenizer.* field of `reader` into `writer`; returns the vocabulary size."""
    import gguf

    vocab_size = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value_type = field.types[0]
        value = field.contents()
        if value_type == gguf.GGUFValueType.ARRAY:
            if name == "tokenizer.ggml.tokens":
                vocab_size = len(value)
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, value_type)
    if not vocab_size:
        raise ValueError("the source GGUF has no tokenizer.ggml.tokens")
    return vocab_size


def write_random_gguf(
    out: Path,
    weight_type: str = "Q4_0",
    shape: LlamaShape = LlamaShape(),
    tokenizer_from: Path | None = None,
    seed: int = 0,
    tensor_types: dict[str, str] | None = None,
    weight_std: float = _INIT_STD,
) -> Path:
    """Write the model to `out` and return it. tokenizer_from: a GGUF whose tokenizer is copied
    (None: the default generation model's, pulled if needed). tensor_types: a type other than
    `weight_type` for some matrices, keyed by tensor name ("blk.1.attn_v.weight") or by the name
    after the layer ("attn_v.weight"), e.g. to write a file that mixes types as real ones do.
    weight_std: the matrices' standard deviation (larger makes a small model's predictions peakier)."""
    import gguf

    tensor_types = tensor_types or {}
    for kind in (weight_type, *tensor_types.values()):
        if kind not in WEIGHT_TYPES:
            raise ValueError(f"weight type must be one of {WEIGHT_TYPES}, got {kind!r}")
    if tokenizer_from is None:
        from engine.bench.gguf_file import gguf_path

        tokenizer_from = gguf_path(DEFAULT_GENERATION_MODEL)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(f"random-llama-{shape.num_layers}x{shape.hidden_size}-{weight_type}")
    vocab_size = _copy_tokenizer(gguf.GGUFReader(str(tokenizer_from)), writer)
    add_shape_metadata(writer, shape, vocab_size)
    file_type = "ALL_F32" if weight_type == "F32" else f"MOSTLY_{weight_type}"
    writer.add_file_type(gguf.LlamaFileType[file_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    rng = np.random.default_rng(seed)
    tensors = _tensor_shapes(shape, vocab_size)
    for name, numpy_shape in tqdm(tensors, desc=f"random {weight_type} weights", unit="tensor"):
        if len(numpy_shape) == 1:  # norms: float32 ones, as a fresh model has them
            writer.add_tensor(name, np.ones(numpy_shape, dtype=np.float32))
            continue
        weight = rng.normal(0.0, weight_std, size=numpy_shape).astype(np.float32)
        kind = tensor_types.get(name, tensor_types.get(name.split(".", 2)[-1], weight_type))
        quant_type = gguf.GGMLQuantizationType[kind]
        if quant_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, weight)
        else:
            writer.add_tensor(name, gguf.quants.quantize(weight, quant_type), raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    logger.info("wrote %s (%.2f GB)", out, out.stat().st_size / 1e9)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--type", default="Q4_0", choices=WEIGHT_TYPES, help="weight matrices' format")
    defaults = LlamaShape()
    parser.add_argument("--layers", type=int, default=defaults.num_layers)
    parser.add_argument("--hidden", type=int, default=defaults.hidden_size)
    parser.add_argument("--heads", type=int, default=defaults.num_heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.num_kv_heads)
    parser.add_argument("--ffn", type=int, default=defaults.intermediate_size)
    parser.add_argument("--context", type=int, default=defaults.context_length)
    parser.add_argument("--tokenizer-from", type=Path, default=None, help="a GGUF to copy the tokenizer from")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shape = LlamaShape(args.layers, args.hidden, args.heads, args.kv_heads, args.ffn, args.context)
    write_random_gguf(args.out, args.type, shape, args.tokenizer_from, args.seed)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
