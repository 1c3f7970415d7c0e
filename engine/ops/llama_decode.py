"""One native call for every layer of a LLaMA-family decode step (llama_decode.c).

Used by LlamaForCausalLM for decode-only steps when the model runs int8 linear
layers in float32 on CPU; LlamaLayer.forward (torch) is the reference, and
tests/engine/test_fused_decode.py holds the two equal.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.ops.int8_linear import Int8Linear
from engine.ops.loader import load_function
from engine.runner.attention import AttentionMetadata

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Int8Weight(ctypes.Structure):
    _fields_ = [("weight", _ptr), ("scale", _ptr), ("bias", _ptr), ("out_features", _i64)]


class _LlamaLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_attention_norm", _ptr),
        ("qkv", _Int8Weight),
        ("o", _Int8Weight),
        ("gate_up", _Int8Weight),
        ("down", _Int8Weight),
        ("key_cache", _ptr),
        ("value_cache", _ptr),
    ]


class _DecodeStep(ctypes.Structure):
    _fields_ = [
        ("num_seqs", _i64),
        ("hidden_size", _i64),
        ("intermediate_size", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("block_size", _i64),
        ("num_blocks_per_seq", _i64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cos", _ptr),
        ("sin", _ptr),
        ("slot_mapping", _ptr),
        ("blocks", _ptr),
        ("mask", _ptr),
        ("num_threads", ctypes.c_int),
    ]


@functools.cache
def llama_decode_kernel():
    """The ctypes function kv_llama_decode_layers, or None when the torch layers must run."""
    argtypes = [ctypes.POINTER(_LlamaLayer), _i64, ctypes.POINTER(_DecodeStep), _ptr]
    return load_function("llama_decode", "kv_llama_decode_layers", argtypes, ctypes.c_int)


def _weight(linear: Int8Linear) -> _Int8Weight:
    bias = linear.bias.data_ptr() if linear.bias is not None else None
    return _Int8Weight(linear.quantized.data_ptr(), linear.scale.data_ptr(), bias, linear.out_features)


class FusedLlamaDecode:
    """Pointers to every layer's weights and KV cache, gathered once; call it once per decode step."""

    def __init__(self, layers, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], eps: float) -> None:
        first = layers[0]
        self.intermediate, self.num_heads, self.num_kv_heads = first.intermediate, first.num_heads, first.num_kv_heads
        self.head_dim, self.scale, self.eps = first.head_dim, first.scale, eps
        self.layers = (_LlamaLayer * len(layers))(
            *[
                _LlamaLayer(
                    layer.input_norm.weight.data_ptr(),
                    layer.post_attention_norm.weight.data_ptr(),
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
        # The tensors behind the pointers above must outlive this object.
        self._keep_alive = (layers, kv_caches)

    @staticmethod
    def supported(layers, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        int8 = all(isinstance(getattr(layer, name), Int8Linear) for layer in layers for name in projections)
        cache = kv_caches[0][0]
        float32_cpu = cache.dtype == torch.float32 and cache.device.type == "cpu" and cache.is_contiguous()
        norms = all(layer.input_norm.weight.dtype == torch.float32 for layer in layers)
        return bool(layers) and int8 and float32_cpu and norms and llama_decode_kernel() is not None

    def __call__(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """hidden [B, H] after the embedding -> [B, H] after the last layer (before the final norm)."""
        hidden = hidden.clone(memory_format=torch.contiguous_format)  # updated in place by the kernel
        num_seqs, hidden_size = hidden.shape
        cos = cos.reshape(num_seqs, self.head_dim).contiguous()
        sin = sin.reshape(num_seqs, self.head_dim).contiguous()
        blocks = meta.key_blocks.contiguous()
        mask = meta.attn_mask[:, 0].contiguous().view(torch.uint8) if meta.attn_mask is not None else None
        slots = meta.slot_mapping.contiguous()
        step = _DecodeStep(
            num_seqs,
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
        status = llama_decode_kernel()(self.layers, len(self.layers), ctypes.byref(step), hidden.data_ptr())
        if status != 0:
            raise MemoryError("the fused decode kernel could not allocate its scratch buffers")
        return hidden
