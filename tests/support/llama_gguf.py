"""Write a tiny Hugging Face LLaMA folder as a float32 GGUF file, the way llama.cpp's converter lays it out:
llama.cpp's tensor names, Q/K rows in its interleaved rotary order, and a Llama 3 RoPE scaling baked into a
`rope_freqs` tensor (one divisor per rotary pair) instead of the config's rope_parameters. Qwen3 and Phi-3
folders too, each as the converter writes its architecture."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.bench.random_gguf import LlamaShape, add_shape_metadata

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Qwen3's per-head query and key norms, Qwen2's q/k/v biases.
_QK_NORM_NAMES = {
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def add_weight(writer, name: str, weight: np.ndarray, matrix_type: str) -> None:
    """Add a float32 tensor: a matrix in `matrix_type` (F32, or a block type quantized by the `gguf` package as
    llama.cpp quantizes), anything else (norms, biases) as F32."""
    import gguf

    if matrix_type != "F32" and weight.ndim == 2:
        quant_type = gguf.GGMLQuantizationType[matrix_type]
        writer.add_tensor(name, gguf.quants.quantize(weight, quant_type), raw_dtype=quant_type)
    else:
        writer.add_tensor(name, np.ascontiguousarray(weight))


def _permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF's half-split rotary rows -> llama.cpp's pairs interleaved per head."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def rope_freq_factors(hf_config) -> np.ndarray:
    """The divisors that turn the default inverse frequencies into the config's scaled ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = hf_config.rope_parameters
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    default = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    scaled, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, torch.device("cpu"))
    return (default / scaled).numpy().astype(np.float32)


def write_llama_gguf(model_dir: Path, out: Path, *, with_rope_freqs: bool = True) -> Path:
    """`model_dir` (a tiny LLaMA with rope_type llama3) as an F32 GGUF at `out`; without `with_rope_freqs`
    the scaling is left out, as a converter that drops it would."""
    return _write_gguf(model_dir, out, "llama", with_rope_freqs=with_rope_freqs)


def write_qwen3_gguf(model_dir: Path, out: Path, matrix_type: str = "F32") -> Path:
    """`model_dir` (a tiny Qwen3) as a GGUF at `out`: llama.cpp keeps Qwen's rotary row order (NeoX
    style), so no rows are permuted, and the q/k norms get their own names. Matrices in `matrix_type`
    (F32, or a block type such as Q8_0, quantized by the `gguf` package as llama.cpp quantizes), norms F32."""
    return _write_gguf(model_dir, out, "qwen3", with_rope_freqs=False, matrix_type=matrix_type)


def write_qwen2_gguf(model_dir: Path, out: Path, matrix_type: str = "F32") -> Path:
    """`model_dir` (a tiny Qwen2) as a GGUF at `out`: rows unpermuted, as for Qwen3, and its q/k/v biases."""
    return _write_gguf(model_dir, out, "qwen2", with_rope_freqs=False, matrix_type=matrix_type)


def _write_gguf(
    model_dir: Path, out: Path, architecture: str, *, with_rope_freqs: bool, matrix_type: str = "F32"
) -> Path:
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_name(f"tiny-{architecture}")
    shape = LlamaShape(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        context_length=config.max_position_embeddings,
        rope_theta=config.rope_parameters["rope_theta"],
        rms_norm_eps=config.rms_norm_eps,
    )
    add_shape_metadata(writer, shape, config.vocab_size)
    head_dim = getattr(config, "head_dim", None)
    if head_dim:  # a config that names its head size (Qwen3): llama.cpp's converter writes it as the key length
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(
        gguf.LlamaFileType.ALL_F32 if matrix_type == "F32" else gguf.LlamaFileType[f"MOSTLY_{matrix_type}"]
    )
    if with_rope_freqs:
        writer.add_tensor("rope_freqs.weight", rope_freq_factors(config))
    for name, tensor in state.items():
        weight = tensor.float().numpy()
        if name in _TOP_NAMES:
            gguf_name = _TOP_NAMES[name]
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            layer, suffix = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{_LAYER_NAMES.get(suffix) or _QK_NORM_NAMES[suffix]}"
            # Only LLaMA's Q/K rows are stored permuted.
            if architecture == "llama" and suffix == "self_attn.q_proj.weight":
                weight = _permute_rows(weight, config.num_attention_heads)
            elif architecture == "llama" and suffix == "self_attn.k_proj.weight":
                weight = _permute_rows(weight, config.num_key_value_heads)
        add_weight(writer, gguf_name, weight, matrix_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# Phi-3's fused projections keep their fused names in llama.cpp: attn_qkv, and ffn_up for gate/up (gate rows first).
_PHI3_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_phi3_gguf(model_dir: Path, out: Path, matrix_type: str = "F32") -> Path:
    """`model_dir` (a tiny Phi-3) as a GGUF at `out` (matrices in `matrix_type`, norms F32), laid out as
    llama.cpp's converter does: the rotary dim count for partial rotary, the sliding window (0: none), and a
    LongRoPE scaling as the original context length, the attention factor and the `rope_factors_long` /
    `rope_factors_short` tensors. Rows are not permuted (llama.cpp rotates Phi-3 NeoX style, as transformers
    does)."""
    import math

    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    rope = config.rope_parameters
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    head_dim = config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(out), "phi3")
    writer.add_name("tiny-phi3")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    # The special token ids the converter writes with the vocabulary (Phi-3's default pad id, 32000, is past the
    # tiny vocabulary).
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_sliding_window(config.sliding_window or 0)
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        )
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for name, tensor in state.items():
        if name in _TOP_NAMES:
            gguf_name = _TOP_NAMES[name]
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            layer, suffix = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{_PHI3_LAYER_NAMES[suffix]}"
        weight = tensor.float().numpy()
        add_weight(writer, gguf_name, weight, matrix_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
