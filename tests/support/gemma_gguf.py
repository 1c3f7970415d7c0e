"""Write a tiny Hugging Face Gemma 2 or Gemma 3 text folder as a float32 GGUF file, the way llama.cpp's converter
lays it out: its tensor names, every norm weight stored as 1 + w (Gemma's RMSNorm scales by 1 + w; llama.cpp
multiplies by the stored weight), Q/K rows in their own order (llama.cpp rotates Gemma NeoX style, as
transformers does), no output tensor (the head is the tied embedding table), and the metadata the converter
writes: the head size as the key/value length, the sliding window, the softcaps (Gemma 2 always, Gemma 3 the
final one where set), and Gemma 3's full-layer RoPE base and linear scaling.

The layer types and query_pre_attn_scalar are not in the file: llama.cpp fixes the layer pattern per
architecture and scales attention by the head size (by hidden_size // num_heads in the 27B models)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.support.llama_gguf import add_weight

_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # Gemma 3
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gemma_gguf(model_dir: Path, out: Path, matrix_type: str = "F32") -> Path:
    """`model_dir` (a tiny Gemma2ForCausalLM or Gemma3ForCausalLM with tied embeddings) as a GGUF at `out`, its
    matrices in `matrix_type` (F32, or a block type such as Q8_0, quantized by the `gguf` package), norms F32."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    architecture = {"gemma2": "gemma2", "gemma3_text": "gemma3"}[config.model_type]
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    # The converter gives the vocabulary as its token list, whose length transformers reads as the vocab size;
    # these files carry no tokenizer, so they say the size outright.
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if architecture == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    else:
        full = config.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])  # the full layers'; llama.cpp fixes the sliding ones' base
        if full.get("rope_type") == "linear":  # applied to the full layers only
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    for name, tensor in state.items():
        weight = tensor.float().numpy()
        if name in _TOP_NAMES:
            gguf_name = _TOP_NAMES[name]
        else:
            layer, suffix = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{_LAYER_NAMES[suffix]}"
        if name.endswith("norm.weight"):
            weight = weight + np.float32(1.0)
        add_weight(writer, gguf_name, weight, matrix_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
