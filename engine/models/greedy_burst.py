"""Several greedy decode steps of a batch in one native call (fused_decode.c `kv_fused_decode_greedy`).

A decode step on the fused path is one native call for the layers and a millisecond or two of Python around
it: the embedding lookup, the final norm, the head, the argmax, the scheduler's bookkeeping, and on a server
the event loop's hand-out of the token. That Python runs from cold caches after every step's weight stream,
so it does not shrink piece by piece. For sequences that need nothing from Python between their tokens
(greedy, no logprobs, penalties, bias, grammar or min_tokens ban), GreedyBurst runs up to N steps in one call:
each step embeds the tokens the step before chose, runs the same layers kernel, the same final RMSNorm and
head product, and takes each row's first maximum as the sampler's argmax does. The tokens are the step by
step path's, bit for bit (tests/engine/test_greedy_burst.py).

The run ends early after a step that chose a stop token for any row, or once `interrupt` is set (the server
sets it when a request arrives, leaves or must stop, so a burst holds nobody up for more than a step).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch
from torch import nn

from engine.models.fused_decode import (
    FusedDecode,
    GreedyTail,
    GroupRows,
    _DecoderLayer,
    _DecodeStep,
    _GroupStep,
    _Int8Weight,
    _RopeStep,
    _weight,
)
from engine.ops.loader import I64, PTR, bind
from engine.quantization import kernel_weight
from engine.quantization.gguf import GgufEmbedding


class _GreedyTail(ctypes.Structure):
    _fields_ = [
        ("embedding", PTR),
        ("embed_type", ctypes.c_int),
        ("has_scale", ctypes.c_int),
        ("embed_scale", ctypes.c_float),
        ("final_norm", PTR),
        ("final_eps", ctypes.c_float),
        ("head", _Int8Weight),
        ("vocab_size", I64),
    ]


class _GreedyRun(ctypes.Structure):
    _fields_ = [
        ("num_steps", I64),
        ("num_groups", I64),
        ("num_ropes", I64),
        ("groups", ctypes.POINTER(_GroupStep)),
        ("ropes", ctypes.POINTER(_RopeStep)),
        ("stop_ids", PTR),
        ("num_stop_ids", I64),
        ("interrupt", PTR),
    ]


@functools.cache
def _kernel():
    argtypes = [
        ctypes.POINTER(_DecoderLayer),
        I64,
        ctypes.POINTER(_DecodeStep),
        ctypes.POINTER(_GreedyTail),
        ctypes.POINTER(_GreedyRun),
        PTR,
        PTR,
        PTR,
    ]
    return bind("fused_decode", "kv_fused_decode_greedy", argtypes, ctypes.c_int)


def _embedding_view(embedding: nn.Module) -> tuple[int, int, int] | None:
    """(pointer, kernel type: 0 for float32 rows, rows) of a table the kernel reads, or None."""
    if isinstance(embedding, GgufEmbedding):
        return embedding.blocks.data_ptr(), embedding.kernel_type, embedding.num_embeddings
    if (
        isinstance(embedding, nn.Embedding)
        and embedding.weight.dtype == torch.float32
        and embedding.weight.is_contiguous()
    ):
        return embedding.weight.data_ptr(), 0, embedding.num_embeddings
    return None


def unsupported_reason(tail: GreedyTail | None) -> str | None:
    """Why GreedyBurst cannot run a model with this tail (its recipe's), or None when it can."""
    if tail is None:
        return "its decode step past the layers is not one the kernel computes"
    view = _embedding_view(tail.embedding)
    if view is None:
        return "its embedding table is neither GGUF blocks nor contiguous float32 rows"
    if kernel_weight(tail.head) is None:
        return "its output head is neither int8 nor GGUF blocks"
    if tail.head.out_features > view[2]:
        return "its output head has more rows than its embedding table"
    if tail.final_norm.dtype != torch.float32:
        return "its final norm is not float32"
    if _kernel() is None:
        return "the fused decode kernel is unavailable"
    return None


class GreedyBurst:
    """Runs up to N greedy decode steps of a batch over a FusedDecode's layers in one native call. Only for a
    tail `unsupported_reason` accepts."""

    def __init__(self, fused: FusedDecode, tail: GreedyTail) -> None:
        self.fused = fused
        self._parts: list[_Int8Weight] = []  # the head's later parts, alive as long as this object
        pointer, embed_type, _ = _embedding_view(tail.embedding)
        self.vocab_size = tail.head.out_features
        self.tail = _GreedyTail(
            pointer,
            embed_type,
            tail.embed_scale is not None,
            tail.embed_scale or 0.0,
            tail.final_norm.data_ptr(),
            tail.final_eps,
            _weight(tail.head, self._parts),
            self.vocab_size,
        )
        self._owner = tail  # the tensors behind the pointers above

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        steps: Sequence[Sequence[GroupRows]],
        stop_ids: Sequence[int],
        interrupt: ctypes.c_int32 | None = None,
    ) -> torch.Tensor:
        """The tokens chosen, int64 [S, B]: S <= len(steps) steps of the B sequences whose current tokens are
        input_ids [B].

        positions: int64 [len(steps) * B], step by step (step k's row b at k * B + b); steps: each step's rows of
        every attention group, as FusedDecode takes them; stop_ids: the run ends after a step that chose one of
        these for any row; interrupt: a flag read after each step (nonzero: the run ends there)."""
        fused = self.fused
        num_steps, num_rows = len(steps), input_ids.shape[0]
        keep: list[torch.Tensor] = []
        group_steps = [step for rows in steps for step in fused.group_steps(rows, keep)]
        rope_steps = fused.rope_steps(positions, keep, rows_per_step=num_rows)
        groups = (_GroupStep * len(group_steps))(*group_steps)
        ropes = (_RopeStep * len(rope_steps))(*rope_steps)
        stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.int64)
        run = _GreedyRun(
            num_steps,
            fused.num_groups,
            len(fused.rope_rows),
            groups,
            ropes,
            stops.data_ptr() if stops.numel() else None,
            stops.numel(),
            ctypes.addressof(interrupt) if interrupt is not None else None,
        )
        step = fused.decode_step(num_rows, groups, ropes)
        first = input_ids.to(torch.int64).contiguous()
        out = torch.empty(num_steps, num_rows, dtype=torch.int64)
        done = ctypes.c_int64(0)
        status = _kernel()(
            fused.layers,
            len(fused.layers),
            ctypes.byref(step),
            ctypes.byref(self.tail),
            ctypes.byref(run),
            first.data_ptr(),
            out.data_ptr(),
            ctypes.addressof(done),
        )
        if status != 0:
            raise MemoryError("the greedy decode kernel could not allocate its buffers or run a product")
        return out[: done.value]
