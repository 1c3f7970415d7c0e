"""A model with random weights, written as a GGUF file: a larger model to benchmark.

    python -m engine.bench.random_gguf OUT.gguf [--arch llama|qwen3|gemma3] [--type TYPE] [--layers 22 ...]

TYPE: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS or F32 (default Q4_0).

Each `--arch` has its family's shape by default, with the default model's 49,152-token vocabulary:
- llama: TinyLlama-1.1B's (22 layers, hidden 2048, 32 query / 4 KV heads, FFN 5632), about 1.1 billion
  parameters; the output layer is its own matrix, as in TinyLlama.
- qwen3: Qwen3-0.6B's (28 layers, hidden 1024, 16 query / 8 KV heads of 128, FFN 3072, an RMSNorm over
  each head's query and key), about 0.5 billion parameters; the output head is the tied embedding table.
- gemma3: Gemma-3-1B's (26 layers, hidden 1152, 4 query / 1 KV head of 256, FFN 6912, a 512-token
  window on five layers of every six, RoPE base 10000 on those and 1e6 on the full ones, attention scaled
  by 256 ** -0.5), about 0.75 billion parameters; the head is the tied embedding table.
Tensor names and metadata keys are those llama.cpp's converter writes for the architecture. What a Gemma 3
file does not carry (the layer pattern, the sliding layers' RoPE base, the attention scale) readers fix
per architecture, to the values above. A Gemma 3 file's vocabulary gains a `<mask>` control token where the
source lacks one (transformers' Gemma tokenizer adds it otherwise, past the embedding table).

The tokenizer (its vocabulary, merges, special tokens and chat template) is copied from a source GGUF, the
default generation model's by default, so the file serves like any other; the weights are random normal
(standard deviation 0.02, norms 1 as stored), so the text it writes is noise: it is for speed and memory,
and for comparing servers on the same quantized blocks. Weight matrices are quantized to `--type` with the
`gguf` package's own quantizer (the format llama.cpp reads); the K-quant and IQ4 types, which it cannot
write, are random blocks of that type with scales for the same spread (and, as llama.cpp does, Q5_0 / Q5_1 /
Q8_0 / IQ4_NL where a row is not a multiple of 256); norms stay float32. Nothing is downloaded;
~1.1 GB of memory per billion parameters in Q8_0 while writing. The file is large: make it, do not commit it.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
from tqdm import tqdm

from engine.hub.models_hub import DEFAULT_GENERATION_MODEL

logger = logging.getLogger(__name__)

WEIGHT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "F32")
# A type of 256-weight blocks -> the type llama.cpp writes instead for a matrix whose rows are not a multiple of 256.
ROW_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}
# The standard deviation of a block's values when its fp16 scale d is 1 and its other bits are uniformly
# random (with Q4_K's / Q5_K's dmin at the value that centres them), for the types the `gguf` package
# cannot quantize to, which are written as random blocks.
_RANDOM_BLOCK_UNIT_STD = {"Q4_K": 258.0, "Q5_K": 527.0, "Q6_K": 1370.0, "IQ4_NL": 67.4, "IQ4_XS": 1246.0}
RANDOM_BLOCK_TYPES = tuple(_RANDOM_BLOCK_UNIT_STD)
ARCHITECTURES = ("llama", "qwen3", "gemma3")
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
    architecture: ClassVar[str] = "llama"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class Qwen3Shape:
    """Qwen3-0.6B's shape: heads of 128 (wider than hidden_size // num_heads), q/k norms, tied head."""

    num_layers: int = 28
    hidden_size: int = 1024
    num_heads: int = 16
    num_kv_heads: int = 8
    intermediate_size: int = 3072
    context_length: int = 40960
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    head_dim: int = 128
    architecture: ClassVar[str] = "qwen3"


@dataclass(frozen=True)
class Gemma3Shape:
    """Gemma-3-1B's shape. rope_theta is the full layers' base; the sliding layers' base (10000), the layer
    pattern (five sliding to one full) and the attention scale (head_dim ** -0.5, query_pre_attn_scalar 256)
    are not written: llama.cpp and kvserve fix them for the architecture."""

    num_layers: int = 26
    hidden_size: int = 1152
    num_heads: int = 4
    num_kv_heads: int = 1
    intermediate_size: int = 6912
    context_length: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    head_dim: int = 256
    sliding_window: int = 512
    architecture: ClassVar[str] = "gemma3"


ModelShape = LlamaShape | Qwen3Shape | Gemma3Shape
DEFAULT_SHAPES: dict[str, ModelShape] = {"llama": LlamaShape(), "qwen3": Qwen3Shape(), "gemma3": Gemma3Shape()}


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


def add_family_metadata(writer, shape: Qwen3Shape | Gemma3Shape, vocab_size: int) -> None:
    """The `qwen3.*` / `gemma3.*` keys llama.cpp's converter writes: sizes, heads, the head size as the key
    and value length (neither family's is hidden_size // num_heads), RoPE base and norm epsilon; Gemma 3's
    sliding window too. No rotary dimension count: both rotate whole heads."""
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    if isinstance(shape, Gemma3Shape):
        writer.add_sliding_window(shape.sliding_window)
    writer.add_vocab_size(vocab_size)


def _tensor_shapes(shape: ModelShape, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names with their numpy shapes [rows, columns] (a linear layer's [out, in]).

    Qwen3 and Gemma 3 add per-head query/key norms ([head_dim]); Gemma 3 a norm after attention and after
    the MLP. Only LLaMA has an output matrix: the others' head is the embedding table."""
    h, q = shape.hidden_size, shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    qk_norm = shape.architecture in ("qwen3", "gemma3")
    post_norms = shape.architecture == "gemma3"
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab_size, h))]
    for i in range(shape.num_layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (h,)),
            (f"blk.{i}.attn_q.weight", (q, h)),
            (f"blk.{i}.attn_k.weight", (kv, h)),
            (f"blk.{i}.attn_v.weight", (kv, h)),
        ]
        if qk_norm:
            tensors += [
                (f"blk.{i}.attn_q_norm.weight", (shape.head_dim,)),
                (f"blk.{i}.attn_k_norm.weight", (shape.head_dim,)),
            ]
        tensors.append((f"blk.{i}.attn_output.weight", (h, q)))
        if post_norms:
            tensors.append((f"blk.{i}.post_attention_norm.weight", (h,)))
        tensors += [
            (f"blk.{i}.ffn_norm.weight", (h,)),
            (f"blk.{i}.ffn_gate.weight", (shape.intermediate_size, h)),
            (f"blk.{i}.ffn_up.weight", (shape.intermediate_size, h)),
            (f"blk.{i}.ffn_down.weight", (h, shape.intermediate_size)),
        ]
        if post_norms:
            tensors.append((f"blk.{i}.post_ffw_norm.weight", (h,)))
    tensors.append(("output_norm.weight", (h,)))
    if shape.architecture == "llama":
        tensors.append(("output.weight", (vocab_size, h)))
    return tensors


# Special tokens that transformers' tokenizer class for an architecture adds when the vocabulary lacks them
# (Gemma's tokenizer has a `<mask>`): appended to the copied vocabulary as control tokens, so that no token id
# lies past the embedding table.
_ARCHITECTURE_TOKENS: dict[str, tuple[str, ...]] = {"gemma3": ("<mask>",)}


def _copy_tokenizer(reader, writer, extra_tokens: tuple[str, ...] = ()) -> int:
    """Copy every tokenizer.* field of `reader` into `writer`, with `extra_tokens` the vocabulary lacks
    appended as control tokens; returns the vocabulary size."""
    import gguf

    source = reader.get_field("tokenizer.ggml.tokens")
    if source is None:
        raise ValueError("the source GGUF has no tokenizer.ggml.tokens")
    tokens = source.contents()
    known = set(tokens)
    missing = [token for token in extra_tokens if token not in known]
    appended = {
        "tokenizer.ggml.tokens": missing,
        "tokenizer.ggml.token_type": [int(gguf.TokenType.CONTROL)] * len(missing),
        "tokenizer.ggml.scores": [0.0] * len(missing),
    }
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value_type = field.types[0]
        value = field.contents()
        if value_type == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, [*value, *appended.get(name, ())])
        else:
            writer.add_key_value(name, value, value_type)
    return len(tokens) + len(missing)


def random_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int, std: float) -> np.ndarray:
    """uint8 [rows, cols / block * block bytes]: blocks of `qtype` (one of RANDOM_BLOCK_TYPES) of uniformly
    random bits (every bit pattern is a valid block), their fp16 scales set so the weights have about `std`
    as standard deviation and mean 0 (the IQ4 types, whose grid is not centred, through a random sign of each
    scale). The `gguf` package cannot quantize to these types; llama.cpp's llama-quantize can, for real
    mixtures."""
    from engine.ops.gguf_linear import BLOCK_TYPES

    _, block_bytes, block = BLOCK_TYPES[qtype]
    if cols % block:
        raise ValueError(f"{qtype} rows hold a multiple of {block} weights, not {cols}")
    unit_std, nb = _RANDOM_BLOCK_UNIT_STD[qtype], cols // block
    blocks = rng.integers(0, 256, size=(rows, nb, block_bytes), dtype=np.uint8)
    d = (std / unit_std * rng.uniform(0.5, 1.5, size=(rows, nb))).astype(np.float16)
    if qtype in ("IQ4_NL", "IQ4_XS"):
        d = np.where(rng.integers(0, 2, size=d.shape) == 1, d, -d).astype(np.float16)
        blocks[..., 0:2] = d.view(np.uint8).reshape(rows, nb, 2)
    elif qtype == "Q6_K":
        blocks[..., 208:210] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    else:  # d, then dmin = d times the mean 4-bit (7.5) or 5-bit (15.5) value, so the weights centre on 0
        dmin = (d.astype(np.float32) * (7.5 if qtype == "Q4_K" else 15.5)).astype(np.float16)
        blocks[..., 0:2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
        blocks[..., 2:4] = dmin.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def write_random_gguf(
    out: Path,
    weight_type: str = "Q4_0",
    shape: ModelShape = LlamaShape(),
    tokenizer_from: Path | None = None,
    seed: int = 0,
    tensor_types: dict[str, str] | None = None,
    weight_std: float = _INIT_STD,
) -> Path:
    """Write the model to `out` and return it; `shape`'s type names the architecture. tokenizer_from: a
    GGUF whose tokenizer is copied (None: the default generation model's, pulled if needed). tensor_types:
    a type other than `weight_type` for some matrices, keyed by tensor name ("blk.1.attn_v.weight") or by
    the name after the layer ("attn_v.weight"), e.g. to write a file that mixes types as real ones do.
    weight_std: the matrices' standard deviation (larger makes a small model's predictions peakier)."""
    import gguf

    tensor_types = tensor_types or {}
    for kind in (weight_type, *tensor_types.values()):
        if kind not in WEIGHT_TYPES:
            raise ValueError(f"weight type must be one of {WEIGHT_TYPES}, got {kind!r}")
    if tokenizer_from is None:
        from engine.bench.gguf_file import gguf_path

        tokenizer_from = gguf_path(DEFAULT_GENERATION_MODEL)
    architecture = shape.architecture
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_name(f"random-{architecture}-{shape.num_layers}x{shape.hidden_size}-{weight_type}")
    source = gguf.GGUFReader(str(tokenizer_from))
    vocab_size = _copy_tokenizer(source, writer, _ARCHITECTURE_TOKENS.get(architecture, ()))
    if isinstance(shape, LlamaShape):
        add_shape_metadata(writer, shape, vocab_size)
    else:
        add_family_metadata(writer, shape, vocab_size)
    # The file-type names of GGUF files: Q4_K and Q5_K ones are the "_S" (small) mixtures of that type.
    file_type = {"F32": "ALL_F32", "Q4_K": "MOSTLY_Q4_K_S", "Q5_K": "MOSTLY_Q5_K_S"}.get(
        weight_type, f"MOSTLY_{weight_type}"
    )
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
        if kind in ROW_FALLBACK and numpy_shape[-1] % 256:
            kind = ROW_FALLBACK[kind]
        quant_type = gguf.GGMLQuantizationType[kind]
        if quant_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, weight)
        elif kind in RANDOM_BLOCK_TYPES:
            blocks = random_blocks(rng, kind, *numpy_shape, weight_std)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=quant_type)
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
    parser.add_argument("--arch", default="llama", choices=ARCHITECTURES, help="the family, and its default shape")
    parser.add_argument("--type", default="Q4_0", choices=WEIGHT_TYPES, help="weight matrices' format")
    # Unset: the --arch default shape's value.
    parser.add_argument("--layers", type=int, dest="num_layers")
    parser.add_argument("--hidden", type=int, dest="hidden_size")
    parser.add_argument("--heads", type=int, dest="num_heads")
    parser.add_argument("--kv-heads", type=int, dest="num_kv_heads")
    parser.add_argument("--ffn", type=int, dest="intermediate_size")
    parser.add_argument("--context", type=int, dest="context_length")
    parser.add_argument("--head-dim", type=int, dest="head_dim", help="qwen3, gemma3 (llama: hidden / heads)")
    parser.add_argument("--window", type=int, dest="sliding_window", help="gemma3's sliding window")
    parser.add_argument("--tokenizer-from", type=Path, default=None, help="a GGUF to copy the tokenizer from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=_INIT_STD, help="the matrices' standard deviation")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shape = DEFAULT_SHAPES[args.arch]
    names = {f.name for f in fields(shape)}
    given = {name: value for name, value in vars(args).items() if name in _SHAPE_FLAGS and value is not None}
    if unknown := sorted(set(given) - names):
        parser.error(f"--arch {args.arch} has no {', '.join(_SHAPE_FLAGS[name] for name in unknown)}")
    shape = replace(shape, **given)
    write_random_gguf(args.out, args.type, shape, args.tokenizer_from, args.seed, weight_std=args.std)
    print(args.out)
    return 0


# ModelShape field -> its flag
_SHAPE_FLAGS = {
    "num_layers": "--layers",
    "hidden_size": "--hidden",
    "num_heads": "--heads",
    "num_kv_heads": "--kv-heads",
    "intermediate_size": "--ffn",
    "context_length": "--context",
    "head_dim": "--head-dim",
    "sliding_window": "--window",
}


if __name__ == "__main__":
    raise SystemExit(main())
