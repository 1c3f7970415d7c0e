"""Qwen3 (dense): the LLaMA layers with an RMSNorm over each head's query and key before RoPE, no biases.

Its checkpoints' per-layer `self_attn.q_norm.weight` and `self_attn.k_norm.weight` ([head_dim]) fill
those norms; everything else loads as LLaMA's does (engine/models/llama.py).
"""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    has_qk_norm = True
