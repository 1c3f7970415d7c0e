"""One native call for every layer of a LLaMA-family decode step (llama_decode.c).

The model runner uses FusedLlamaDecode for decode-only steps when it chose the
fused path at start-up (int8 or GGUF-block linear layers, float32, CPU). Its torch reference
is the model itself (LlamaForCausalLM.forward), and
tests/engine/test_fused_decode.py holds the two equal.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import torch

from engine.attention.metadata import AttentionMetadata
from engine.ops.loader import I64, PTR, bind, unavailable_reason
from engine.quantization import KernelWeight, kernel_weight

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM


class _Int8Weight(ctypes.Structure):
    _fields_ = [("weight", PTR), ("scale", PTR), ("bias", PTR), ("out_features", I64), ("block_type", ctypes.c_int)]


class _LlamaLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", PTR),
        ("post_attention_norm", PTR),
        ("q_norm", PTR),
        ("k_norm", PTR),
        ("qkv", _Int8Weight),
        ("o", _Int8Weight),
        ("gate_up", _Int8Weight),
        ("down", _Int8Weight),
        ("key_cache", PTR),
        ("value_cache", PTR),
    ]


class _DecodeStep(ctypes.Structure):
    _fields_ = [
        ("num_seqs", I64),
        ("hidden_size", I64),
        ("intermediate_size", I64),
        ("num_heads", I64),
        ("num_kv_heads", I64),
        ("head_dim", I64),
        ("block_size", I64),
        ("num_blocks_per_seq", I64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cos", PTR),
        ("sin", PTR),
        ("slot_mapping", PTR),
        ("blocks", PTR),
        ("mask", PTR),
        ("num_threads", ctypes.c_int),
    ]


@functools.cache
def _kernel():
    """kv_llama_decode_layers(layers, num_layers, step, hidden) -> status, or None when it cannot be used."""
    argtypes = [ctypes.POINTER(_LlamaLayer), I64, ctypes.POINTER(_DecodeStep), PTR]
    return bind("llama_decode", "kv_llama_decode_layers", argtypes, ctypes.c_int)


def available() -> bool:
    """Whether FusedLlamaDecode can run on this machine (for a model it supports)."""
    return _kernel() is not None


def unsupported_reason(model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Why FusedLlamaDecode cannot run this model over these caches, or None when it can."""
    layers = list(model.layers)
    if not layers:
        return "the model has no layers"
    head_norms = [norm for layer in layers for norm in (layer.q_norm, layer.k_norm) if norm is not None]
    if any(norm.eps != layer.input_norm.eps for layer in layers for norm in (layer.q_norm, layer.k_norm) if norm):
        return "its q/k norms have another eps than its layer norms (the fused kernel uses one)"
    if model.rotary is not None and model.rotary.rotary_dim != layers[0].head_dim:
        return "RoPE rotates only part of each head (the fused kernel rotates all of it)"
    projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    if any(kernel_weight(getattr(layer, name)) is None for layer in layers for name in projections):
        return "its linear layers are neither int8 nor GGUF blocks (the fused kernel reads only those)"
    cache = kv_caches[0][0]
    if cache.dtype != torch.float32 or cache.device.type != "cpu" or not cache.is_contiguous():
        return f"the KV cache is {cache.dtype} on {cache.device.type} (the kernel needs contiguous float32 on CPU)"
    norms = [norm.weight for layer in layers for norm in (layer.input_norm, layer.post_attention_norm)]
    norms += [norm.weight for norm in head_norms]
    if any(weight.dtype != torch.float32 for weight in [*norms, model.norm.weight]):
        return "its RMSNorm weights are not float32"
    reason = unavailable_reason("llama_decode")
    if reason is not None:
        return f"the fused decode kernel is unavailable: {reason}"
    return None


def _weight(linear: torch.nn.Module) -> _Int8Weight:
    """The kernel's view of one projection (a layer `unsupported_reason` accepted)."""
    weight: KernelWeight | None = kernel_weight(linear)
    if weight is None:
        raise ValueError(f"the fused decode kernel cannot read a {type(linear).__name__}")
    return _Int8Weight(weight.weight, weight.scale, weight.bias, weight.out_features, weight.block_type)


class FusedLlamaDecode:
    """A decode-only step of a LLaMA-family model with every layer in one native call.

    Pointers to every layer's weights and KV cache are gathered once; call it like
    the model's forward, once per decode-only step. Only for models where
    `unsupported_reason` is None.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        layers = list(model.layers)
        first = layers[0]
        self.intermediate, self.num_heads, self.num_kv_heads = first.intermediate, first.num_heads, first.num_kv_heads
        self.head_dim, self.scale, self.eps = first.head_dim, first.scale, first.input_norm.eps
        self.layers = (_LlamaLayer * len(layers))(
            *[
                _LlamaLayer(
                    layer.input_norm.weight.data_ptr(),
                    layer.post_attention_norm.weight.data_ptr(),
                    layer.q_norm.weight.data_ptr() if layer.q_norm is not None else None,
                    layer.k_norm.weight.data_ptr() if layer.k_norm is not None else None,
                    _weight(layer.qkv_proj),
                    _weight(layer.o_proj),
                    _weight(layer.gate_up_proj),
                    _weight(layer.down_proj),
                    key_cache.data_ptr(),
                    value_cache.data_ptr(),
                )
                for layer, (key_cache, value_cache) in zip(layers, kv_caches)
            ]
        )
        self.block_size = kv_caches[0][0].shape[1]
        # The model and caches own the tensors behind the pointers above; they must outlive this object.
        self.model = model
        self._kv_caches = kv_caches

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [B] (one new token per sequence) -> final hidden states [B, hidden]."""
        mask = meta.attn_mask[:, 0] if meta.attn_mask is not None else None
        return self.run_rows(input_ids, positions, meta.key_blocks, mask, meta.slot_mapping)

    def run_rows(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        blocks: torch.Tensor,
        mask: torch.Tensor | None,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of T new tokens, each one query row with its own keys.

        blocks: [T, N] the cache blocks row t reads; mask: bool [T, N * block_size] the keys it sees (None:
        all); slots: [T] where its K/V go. Every row's K/V are written before any row attends, so several
        rows of one sequence (a token and the drafts after it) see each other as the mask allows.
        """
        hidden = self.model.embed_tokens(input_ids).contiguous()  # a fresh tensor: the kernel updates it in place
        cos, sin = self.model.rotary.cos_sin(positions, hidden.dtype)
        num_rows, hidden_size = hidden.shape
        cos = cos.reshape(num_rows, self.head_dim).contiguous()
        sin = sin.reshape(num_rows, self.head_dim).contiguous()
        blocks = blocks.contiguous()
        mask = mask.contiguous().view(torch.uint8) if mask is not None else None
        slots = slots.contiguous()
        step = _DecodeStep(
            num_rows,
            hidden_size,
            self.intermediate,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            blocks.shape[1],
            self.eps,
            self.scale,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            blocks.data_ptr(),
            mask.data_ptr() if mask is not None else None,
            torch.get_num_threads(),
        )
        status = _kernel()(self.layers, len(self.layers), ctypes.byref(step), hidden.data_ptr())
        if status != 0:
            raise MemoryError("the fused decode kernel could not allocate its scratch buffers")
        return self.model.norm(hidden)
