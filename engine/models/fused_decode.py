"""One native call for every layer of a decoder's decode step (engine/ops/fused_decode.c).

The model runner uses FusedDecode for decode-only steps (and for steps of a token and its speculative
drafts) when it chose the fused path at start-up: int8 or GGUF-block linear layers, float32, CPU, and a
model class that describes its layers to the kernel with `fused_recipe()` (a FusedRecipe: the LLaMA
family in engine/models/llama.py, Gemma in engine/models/gemma.py). Its torch reference is the model's
own forward, and tests/engine/test_fused_decode.py holds the two equal.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata, per_token_rows
from engine.ops.decode_attention import use_wide_attention
from engine.ops.kv_format import NATIVE_FORMAT_IDS
from engine.ops.loader import I64, PTR, avx512_kernels_allowed, bind, unavailable_reason
from engine.quantization import KernelWeight, kernel_weight

if TYPE_CHECKING:
    from engine.models.common import RotaryEmbedding

# The gate activations the kernel computes (fused_decode.c's ACT_*), by the name a recipe gives.
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}


class NotFusable(Exception):
    """A model's layers are outside what the fused kernel computes; the message says why."""


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer as the kernel runs it. Norm tensors are the float32 multipliers the RMSNorm
    applies (a Gemma norm's 1 + w); None: the layer has no such norm."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    qkv: nn.Module  # [q + 2 kv, hidden]: queries, keys, values
    o: nn.Module
    gate_up: nn.Module  # [2 intermediate, hidden]: gate rows, then up rows
    down: nn.Module
    rope: int = 0  # index into FusedRecipe.rotaries
    attn_out_norm: torch.Tensor | None = None  # on o's output before the residual add (Gemma)
    ffn_out_norm: torch.Tensor | None = None  # on down's output before the residual add (Gemma)
    q_norm: torch.Tensor | None = None  # [head_dim], every query head
    k_norm: torch.Tensor | None = None
    softcap: float | None = None  # attention scores capped to softcap * tanh(s / softcap)

    def norms(self) -> list[torch.Tensor]:
        present = (self.attn_norm, self.ffn_norm, self.attn_out_norm, self.ffn_out_norm, self.q_norm, self.k_norm)
        return [norm for norm in present if norm is not None]


@dataclass(frozen=True)
class GreedyTail:
    """What a greedy decode step does around the layers, where the kernel can do it too: the embedding rows of
    the input tokens (times embed_scale, None: not scaled), the final RMSNorm, the output head's logits."""

    embedding: nn.Module  # a GGUF-block or float32 embedding table [vocab, hidden]
    embed_scale: float | None
    final_norm: torch.Tensor  # [hidden] float32 multipliers
    final_eps: float
    head: nn.Module  # [vocab, hidden], an int8 or GGUF-block linear layer; logits are its float32 output


@dataclass(frozen=True)
class FusedRecipe:
    """A model's decode step as the kernel runs it: what every layer reads and the step's constants."""

    layers: tuple[FusedLayer, ...]
    rotaries: tuple[RotaryEmbedding, ...]
    embed: Callable[[torch.Tensor], torch.Tensor]  # input ids [T] -> a fresh hidden tensor [T, hidden]
    final_norm: Callable[[torch.Tensor], torch.Tensor]  # after the last layer
    activation: str  # an ACTIVATIONS key
    eps: float  # of every RMSNorm in the layers
    scale: float  # attention scores are q . k * scale
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    # The model's decode step past the layers, for several greedy steps in one call (engine/models/greedy_burst.py);
    # None: that step has more to it (a logit softcap, an embedding the kernel cannot read).
    tail: GreedyTail | None = None


class GroupRows(NamedTuple):
    """One attention group's view of a step of T query rows."""

    blocks: torch.Tensor  # [T, N] the cache blocks each row reads
    mask: torch.Tensor | None  # bool [T, N * block_size], the keys each row sees (None: all)
    slots: torch.Tensor  # [T] where each row's key and value go


def decode_rows(meta: AttentionMetadata) -> GroupRows:
    """A decode-only step's rows (one per sequence) in one group's metadata."""
    mask = meta.attn_mask[:, 0] if meta.attn_mask is not None else None
    return GroupRows(meta.key_blocks, mask, meta.slot_mapping)


def token_rows(meta: AttentionMetadata, block_size: int) -> GroupRows:
    """Any step as one row per new token (a token and its drafts are several rows of one sequence)."""
    blocks, mask = per_token_rows(meta, block_size)
    return GroupRows(blocks, mask, meta.slot_mapping)


class RopeRows:
    """Each position's cos and sin rows [rotary_dim] in float32, as `rotary.cos_sin` gives them for that position,
    kept in a table for the positions below TABLE_POSITIONS (filled TABLE_CHUNK positions at a time as steps
    reach them): a step looks its rows up instead of computing them (a dozen tensor operations). Positions at
    or past the table's reach are computed."""

    TABLE_POSITIONS = 16384  # at a 128-dim head, 16 MB of rows at most
    TABLE_CHUNK = 1024

    def __init__(self, rotary: RotaryEmbedding) -> None:
        self.rotary = rotary
        self.cos = torch.empty(0, rotary.rotary_dim)
        self.sin = torch.empty(0, rotary.rotary_dim)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> contiguous cos, sin [T, rotary_dim]."""
        reach = int(positions.max()) + 1 if positions.numel() else 0
        if reach > self.TABLE_POSITIONS:
            return self._computed(positions)
        if reach > self.cos.shape[0]:
            chunk = self.TABLE_CHUNK
            cos, sin = self._computed(torch.arange(self.cos.shape[0], -(-reach // chunk) * chunk))
            self.cos, self.sin = torch.cat((self.cos, cos)), torch.cat((self.sin, sin))
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)

    def _computed(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary.cos_sin(positions, torch.float32)
        shape = (positions.shape[0], self.rotary.rotary_dim)
        return cos.reshape(shape).contiguous(), sin.reshape(shape).contiguous()


class _Int8Weight(ctypes.Structure):
    pass


# next: the projection's next part (rows in a type of their own), or NULL
_Int8Weight._fields_ = [
    ("weight", PTR),
    ("scale", PTR),
    ("bias", PTR),
    ("out_features", I64),
    ("block_type", ctypes.c_int),
    ("next", ctypes.POINTER(_Int8Weight)),
]


class _DecoderLayer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", PTR),
        ("attn_out_norm", PTR),
        ("ffn_norm", PTR),
        ("ffn_out_norm", PTR),
        ("q_norm", PTR),
        ("k_norm", PTR),
        ("qkv", _Int8Weight),
        ("o", _Int8Weight),
        ("gate_up", _Int8Weight),
        ("down", _Int8Weight),
        ("key_cache", PTR),
        ("value_cache", PTR),
        ("group", I64),
        ("rope", I64),
        ("softcap", ctypes.c_float),
    ]


class _GroupStep(ctypes.Structure):
    _fields_ = [("blocks", PTR), ("mask", PTR), ("slot_mapping", PTR), ("num_blocks_per_seq", I64)]


class _RopeStep(ctypes.Structure):
    _fields_ = [("cos", PTR), ("sin", PTR)]


class _DecodeStep(ctypes.Structure):
    _fields_ = [
        ("num_seqs", I64),
        ("hidden_size", I64),
        ("intermediate_size", I64),
        ("num_heads", I64),
        ("num_kv_heads", I64),
        ("head_dim", I64),
        ("rotary_dim", I64),
        ("block_size", I64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("activation", ctypes.c_int),
        ("kv_format", ctypes.c_int),
        ("groups", ctypes.POINTER(_GroupStep)),
        ("ropes", ctypes.POINTER(_RopeStep)),
        ("num_threads", ctypes.c_int),
    ]


@functools.cache
def _kernel():
    """kv_fused_decode_layers(layers, num_layers, step, hidden) -> status, or None when it cannot be used."""
    argtypes = [ctypes.POINTER(_DecoderLayer), I64, ctypes.POINTER(_DecodeStep), PTR]
    kernel = bind("fused_decode", "kv_fused_decode_layers", argtypes, ctypes.c_int)
    if kernel is not None:
        use_wide_attention("fused_decode", avx512_kernels_allowed())
    return kernel


def available() -> bool:
    """Whether FusedDecode can run on this machine (for a model it supports)."""
    return _kernel() is not None


def _recipe(model: nn.Module) -> FusedRecipe:
    describe = getattr(model, "fused_recipe", None)
    if describe is None:
        raise NotFusable(f"{type(model).__name__} does not describe its layers to the fused kernel")
    return describe()


def unsupported_reason(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Why FusedDecode cannot run this model over these caches, or None when it can."""
    try:
        recipe = _recipe(model)
    except NotFusable as why:
        return str(why)
    if not recipe.layers:
        return "the model has no layers"
    if recipe.activation not in ACTIVATIONS:
        return f"its MLP activation {recipe.activation!r} is not one the fused kernel computes"
    if {rotary.rotary_dim for rotary in recipe.rotaries} != {recipe.rotaries[0].rotary_dim}:
        return "its RoPE kinds rotate different parts of each head"
    projections = [p for layer in recipe.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if any(kernel_weight(projection) is None for projection in projections):
        return "its linear layers are neither int8 nor GGUF blocks (the fused kernel reads only those)"
    cache = kv_caches[0][0]
    if cache.dtype not in NATIVE_FORMAT_IDS or cache.device.type != "cpu" or not cache.is_contiguous():
        return f"the KV cache is {cache.dtype} on {cache.device.type} (the kernel needs a contiguous CPU cache)"
    if any(norm.dtype != torch.float32 for layer in recipe.layers for norm in layer.norms()):
        return "its RMSNorm weights are not float32"
    reason = unavailable_reason("fused_decode")
    if reason is not None:
        return f"the fused decode kernel is unavailable: {reason}"
    return None


def _weight(linear: nn.Module, parts: list[_Int8Weight]) -> _Int8Weight:
    """The kernel's view of one projection (a layer `unsupported_reason` accepted). A projection of several
    parts chains them; the parts after the first are appended to `parts`, which must outlive the kernel's use."""
    weight: KernelWeight | None = kernel_weight(linear)
    if weight is None:
        raise ValueError(f"the fused decode kernel cannot read a {type(linear).__name__}")

    def view(part: KernelWeight) -> _Int8Weight:
        following = None
        if part.next is not None:
            parts.append(view(part.next))
            following = ctypes.pointer(parts[-1])
        return _Int8Weight(part.weight, part.scale, part.bias, part.out_features, part.block_type, following)

    return view(weight)


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return tensor.data_ptr() if tensor is not None else None


class FusedDecode:
    """A decode step of a decoder with every layer in one native call.

    Pointers to every layer's weights and KV cache are gathered once; call it with one GroupRows per
    attention group, once per step. `layer_group`: each layer's group index (the layers of a group share
    its block tables, mask and slots). Only for models where `unsupported_reason` is None.
    """

    def __init__(
        self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layer_group: Sequence[int]
    ) -> None:
        recipe = _recipe(model)
        self.recipe = recipe
        self._weight_parts: list[_Int8Weight] = []  # the later parts of projections split by type
        parts = self._weight_parts
        self.layers = (_DecoderLayer * len(recipe.layers))(
            *[
                _DecoderLayer(
                    layer.attn_norm.data_ptr(),
                    _pointer(layer.attn_out_norm),
                    layer.ffn_norm.data_ptr(),
                    _pointer(layer.ffn_out_norm),
                    _pointer(layer.q_norm),
                    _pointer(layer.k_norm),
                    _weight(layer.qkv, parts),
                    _weight(layer.o, parts),
                    _weight(layer.gate_up, parts),
                    _weight(layer.down, parts),
                    key_cache.data_ptr(),
                    value_cache.data_ptr(),
                    group,
                    layer.rope,
                    layer.softcap or 0.0,
                )
                for layer, (key_cache, value_cache), group in zip(recipe.layers, kv_caches, layer_group, strict=True)
            ]
        )
        self.num_groups = max(layer_group) + 1
        self.block_size = kv_caches[0][0].shape[1]
        self.kv_format = NATIVE_FORMAT_IDS[kv_caches[0][0].dtype]
        self.rotary_dim = recipe.rotaries[0].rotary_dim
        self.rope_rows = [RopeRows(rotary) for rotary in recipe.rotaries]
        # The model and caches own the tensors behind the pointers above; they must outlive this object.
        self.model = model
        self._kv_caches = kv_caches

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, groups: Sequence[GroupRows]) -> torch.Tensor:
        """Final hidden states [T, hidden] of T new tokens, each one query row (the model's forward).

        input_ids, positions: [T]; groups: each attention group's rows, in the layout's group order. Every
        row's K/V are written before any row attends, so several rows of one sequence (a token and the
        drafts after it) see each other as the mask allows."""
        if len(groups) != self.num_groups:
            raise ValueError(f"the fused decode needs {self.num_groups} attention groups' rows, got {len(groups)}")
        hidden = self.recipe.embed(input_ids).contiguous()  # a fresh tensor: the kernel updates it in place
        keep: list[torch.Tensor] = []  # the tensors behind the step's pointers, alive until the call returns
        group_steps = self.group_steps(groups, keep)
        rope_steps = self.rope_steps(positions, keep)
        step = self.decode_step(
            hidden.shape[0], (_GroupStep * len(group_steps))(*group_steps), (_RopeStep * len(rope_steps))(*rope_steps)
        )
        status = _kernel()(self.layers, len(self.layers), ctypes.byref(step), hidden.data_ptr())
        if status != 0:
            raise MemoryError("the fused decode kernel could not allocate its scratch buffers")
        return self.recipe.final_norm(hidden)

    def group_steps(self, groups: Sequence[GroupRows], keep: list[torch.Tensor]) -> list[_GroupStep]:
        """The kernel's view of each group's rows; the tensors behind its pointers are appended to `keep`."""

        def held(tensor: torch.Tensor) -> int:
            keep.append(tensor)
            return tensor.data_ptr()

        masks: dict[int, torch.Tensor] = {}  # groups of one kind share their mask tensor: convert it once
        steps = []
        for rows in groups:
            mask = None
            if rows.mask is not None:
                mask = masks.setdefault(id(rows.mask), rows.mask.contiguous().view(torch.uint8))
            blocks = rows.blocks.contiguous()
            slots = rows.slots.contiguous()
            steps.append(
                _GroupStep(held(blocks), held(mask) if mask is not None else None, held(slots), blocks.shape[1])
            )
        return steps

    def rope_steps(self, positions: torch.Tensor, keep: list[torch.Tensor], rows_per_step: int = 0) -> list[_RopeStep]:
        """Each RoPE kind's cos and sin rows of `positions` [T], held in `keep`. rows_per_step > 0: positions are
        several steps' rows one step after the other, and the list has one entry per step and kind (step-major)."""
        tables = []
        for rope_rows in self.rope_rows:
            cos, sin = rope_rows(positions)
            keep.extend((cos, sin))
            tables.append((cos, sin))
        count = positions.shape[0]
        per_step = rows_per_step or count
        row_bytes = self.rotary_dim * 4  # float32 rows
        return [
            _RopeStep(cos.data_ptr() + first * row_bytes, sin.data_ptr() + first * row_bytes)
            for first in range(0, count, per_step)
            for cos, sin in tables
        ]

    def decode_step(self, num_rows: int, groups: ctypes.Array, ropes: ctypes.Array) -> _DecodeStep:
        """The kernel's step description for num_rows query rows; groups and ropes must outlive its use."""
        recipe = self.recipe
        return _DecodeStep(
            num_rows,
            recipe.layers[0].attn_norm.shape[0],
            recipe.intermediate,
            recipe.num_heads,
            recipe.num_kv_heads,
            recipe.head_dim,
            self.rotary_dim,
            self.block_size,
            recipe.eps,
            recipe.scale,
            ACTIVATIONS[recipe.activation],
            self.kv_format,
            groups,
            ropes,
            torch.get_num_threads(),
        )
