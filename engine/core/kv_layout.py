"""How the KV cache is laid out: layers grouped by attention kind, one block table per group.

Layers that attend alike (every key; a sliding window of W keys, with or without sinks) form an
attention kind. A sequence holds one block table per attention *group*: full groups keep every
block, sliding groups give blocks back as they leave the window, so a model that mixes kinds holds
only its full layers' K/V for the whole context.

Every group holds the same number of layers, P (the greatest common divisor of the kinds' layer
counts), so one pool of equal blocks serves them all: a block holds P layers' K/V, and P cache
tensors (one per slot) hold every block. Layer l writes slot `layer_slot[l]` of the blocks in its
group's table; a block belongs to one group at a time, so slots never collide. A model whose layers
all attend alike has one group of every layer (P = num_layers), the plain paged cache. With five
sliding layers to one full (26 layers: 22 and 4), P = 2: 11 sliding groups and 2 full ones, and
the memory of a block is exactly what its two layers need.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import cdiv


@dataclass(frozen=True)
class AttentionGroup:
    """Layers of one attention kind whose K/V share block tables."""

    sliding_window: int | None  # None: every key is visible (a full group)
    num_sink_tokens: int  # the first S positions stay visible; 0 without a window
    layers: tuple[int, ...]  # the model layers, in slot order: layers[j] writes slot j of the group's blocks

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    def max_live_blocks(self, max_model_len: int, block_size: int, max_chunk_tokens: int) -> int:
        """The most blocks one sequence of this group holds at once: its whole context when full; the window,
        the sinks and one chunk of new tokens when sliding."""
        whole = cdiv(max_model_len, block_size)
        if self.sliding_window is None:
            return whole
        live = cdiv(self.sliding_window, block_size) + 1 + cdiv(self.num_sink_tokens, block_size)
        return min(whole, live + cdiv(max_chunk_tokens, block_size) + 1)


@dataclass(frozen=True)
class KVLayout:
    """The attention groups of a model and where each layer's K/V lives."""

    groups: tuple[AttentionGroup, ...]
    layer_group: tuple[int, ...]  # per layer: its group's index
    layer_slot: tuple[int, ...]  # per layer: its slot (cache tensor) in its group's blocks

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layers_per_group(self) -> int:
        """P: the layers one block holds (the number of cache tensors)."""
        return len(self.groups[0].layers)

    @property
    def every_layer_slides(self) -> bool:
        """No layer sees the whole context, so a sequence may run past the model's trained length."""
        return all(group.is_sliding for group in self.groups)

    @property
    def kinds(self) -> tuple[tuple[int | None, int], ...]:
        """The distinct (sliding_window, num_sink_tokens) of the groups, in group order."""
        return tuple(dict.fromkeys((g.sliding_window, g.num_sink_tokens) for g in self.groups))

    def window_of_layer(self, layer: int) -> int | None:
        return self.groups[self.layer_group[layer]].sliding_window

    def bytes_per_block(self, block_size: int, num_kv_heads: int, row_bytes: int) -> int:
        """Keys and values of P layers for block_size tokens; row_bytes: one token's key for one head."""
        return 2 * self.layers_per_group * block_size * num_kv_heads * row_bytes

    def max_blocks_per_seq(self, max_model_len: int, block_size: int, max_chunk_tokens: int) -> int:
        """The most blocks one sequence holds at once, over all its groups."""
        return sum(g.max_live_blocks(max_model_len, block_size, max_chunk_tokens) for g in self.groups)

    def describe(self) -> str:
        """One line for the start-up log: each kind's layers and groups."""
        parts = []
        for window, sinks in self.kinds:
            groups = [g for g in self.groups if (g.sliding_window, g.num_sink_tokens) == (window, sinks)]
            kind = "full" if window is None else f"sliding {window}" + (f" + {sinks} sinks" if sinks else "")
            parts.append(f"{kind}: {len(groups) * self.layers_per_group} layers in {len(groups)} groups")
        return f"{'; '.join(parts)}; {self.layers_per_group} layers per block"


def plan_kv_layout(layer_windows: Sequence[int | None], num_sink_tokens: int) -> KVLayout:
    """Group layers with these per-layer windows (None: full attention) into equal groups by kind.

    Sinks apply to sliding layers only. Within a kind, layers fill groups in layer order.
    """
    if not layer_windows:
        raise ValueError("a model has at least one layer")
    by_kind: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        if window is not None and window < 1:
            raise ValueError(f"layer {layer}: sliding window must be positive, got {window}")
        by_kind.setdefault(window, []).append(layer)
    per_group = math.gcd(*(len(layers) for layers in by_kind.values()))
    groups: list[AttentionGroup] = []
    layer_group = [0] * len(layer_windows)
    layer_slot = [0] * len(layer_windows)
    for window, layers in by_kind.items():
        sinks = num_sink_tokens if window is not None else 0
        for start in range(0, len(layers), per_group):
            members = tuple(layers[start : start + per_group])
            for slot, layer in enumerate(members):
                layer_group[layer] = len(groups)
                layer_slot[layer] = slot
            groups.append(AttentionGroup(window, sinks, members))
    return KVLayout(tuple(groups), tuple(layer_group), tuple(layer_slot))
