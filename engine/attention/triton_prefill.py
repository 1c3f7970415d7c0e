"""Prefill / mixed-step attention over the paged KV cache as a Triton FlashAttention-style kernel.

`triton_paged_prefill` computes what `engine.runner.attention.paged_attention_torch` computes, for any
step (prompts, chunked prefill continuing a cached prefix, prompts mixed with one-token decodes), from
the same `AttentionMetadata`, without gathering the blocks and without building the [B, Q, K] mask:

* grid (sequence, query tile, query head): one program takes BLOCK_M consecutive new tokens of one
  sequence for one query head. Query head h reads KV head h // (H_q // H_kv) (GQA); the heads of a group
  re-read the same K/V blocks, which on a GPU come from L2 after the first head.
* the program walks its sequence's `key_blocks` entries. An entry is one whole cache block: BLOCK_SIZE
  keys at positions key_block_logical * BLOCK_SIZE + slot, loaded through the physical block id. An entry
  no query of the tile can see is skipped before anything of it is loaded: padding (logical -1), wholly
  after the tile's last query (causal), or wholly before the window of the tile's first query and holding
  no sink token.
* scores of the [BLOCK_M, BLOCK_SIZE] tile are masked from positions (`visible_mask`'s rule) and folded
  into an online softmax: a running row max m, running row sum l and an accumulator rescaled by
  exp(m_old - m_new) whenever the max grows, all in float32. The [Q, K] score matrix never exists.
* with a softcap (SOFTCAP), each scaled score s becomes softcap * tanh(s / softcap) before the mask;
  without one the kernel is compiled without that step.

Limits: BLOCK_M = 16 (tl.dot needs every dimension >= 16); block_size and head_dim powers of two in
[16, 256] (tl.arange needs powers of two, tl.dot >= 16; above 256 the tiles outgrow the registers);
a query in float16, bfloat16 or float32 and caches in any of those or int8 rows with a float32 scale each
(engine/ops/kv_format.py: values and scales passed as two strided views of the one cache, QUANTIZED),
read into the query's dtype; output in the query's dtype. The dots
ask for IEEE precision: 16-bit inputs run on the tensor cores regardless, float32 inputs multiply exactly
(not in TF32, which would cost ~1e-3) so the result matches the torch path to ~1e-5.

triton is a dev/CUDA dependency only: without it this module still imports, `available()` is False,
and nothing else here may be called. The kernel runs on CUDA tensors, or on CPU tensors in Triton's
interpreter when TRITON_INTERPRET=1 was set before this module was first imported (the tests do that).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from engine.ops import kv_format

if TYPE_CHECKING:  # the runner imports this module when it dispatches to it
    from engine.attention.metadata import AttentionMetadata

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves every step there
    triton = None

# Queries per program. 16 is tl.dot's smallest tile.
BLOCK_M = 16
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CACHE_DTYPES = (*_DTYPES, torch.int8)
_LOG2E = 1.4426950408889634


if triton is not None:

    @triton.jit
    def _tanh(x):
        # tanh from exp2 (libdevice's tanh has no interpreter implementation): e = exp(-2|x|) lies in
        # (0, 1] for every x, so nothing overflows, and tanh(+-inf) = +-1.
        e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 * log2(e)
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def _paged_prefill_kernel(
        query_ptr,  # [T, H_q, D]
        key_cache_ptr,  # [num_blocks, BLOCK_SIZE, H_kv, D]
        value_cache_ptr,  # [num_blocks, BLOCK_SIZE, H_kv, D]
        key_scale_ptr,  # float32 [num_blocks, BLOCK_SIZE, H_kv]: each int8 key row's scale (QUANTIZED only)
        value_scale_ptr,  # float32 [num_blocks, BLOCK_SIZE, H_kv] (QUANTIZED only)
        out_ptr,  # [T, H_q, D]
        key_blocks_ptr,  # int64 [B, N]: physical block of each entry
        key_logical_ptr,  # int32 [B, N]: logical block of each entry, -1 for padding
        query_starts_ptr,  # int32 [B]
        query_lens_ptr,  # int32 [B]
        query_offsets_ptr,  # int32 [B]
        visits_ptr,  # int32 [B, num_tiles, H_q]: entries each program loaded (only when COUNT_VISITS)
        qk_scale,  # scale * log2(e) (scores in base 2, for exp2); scale / softcap with SOFTCAP
        softcap_log2,  # softcap * log2(e), used only with SOFTCAP
        num_entries,  # N
        sliding_window,  # W (unused without HAS_WINDOW)
        num_sink_tokens,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_zb,  # the scales' strides (block, slot, head), the same for keys and values
        stride_zs,
        stride_zh,
        stride_kbl,  # row stride of key_blocks
        stride_lbl,  # row stride of key_block_logical
        GROUP: tl.constexpr,  # H_q // H_kv
        BLOCK_M: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        COUNT_VISITS: tl.constexpr,
        SOFTCAP: tl.constexpr,  # scores s -> softcap * tanh(s / softcap)
        QUANTIZED: tl.constexpr,  # int8 cache rows, each times its scale
    ):
        seq = tl.program_id(0)
        tile = tl.program_id(1)
        head = tl.program_id(2)
        query_len = tl.load(query_lens_ptr + seq)
        tile_first = tile * BLOCK_M
        if tile_first >= query_len:  # the grid is sized for the longest sequence
            return
        kv_head = head // GROUP
        query_start = tl.load(query_starts_ptr + seq)
        query_offset = tl.load(query_offsets_ptr + seq)

        rows = tile_first + tl.arange(0, BLOCK_M)  # [BLOCK_M] index among the sequence's new tokens
        row_valid = rows < query_len
        query_pos = query_start + rows  # [BLOCK_M]
        # Positions of the tile's first and last real query: the block-skipping bounds.
        first_pos = query_start + tile_first
        last_pos = query_start + tl.minimum(query_len, tile_first + BLOCK_M) - 1

        dims = tl.arange(0, HEAD_DIM)
        slots = tl.arange(0, BLOCK_SIZE)
        tokens = (query_offset + rows).to(tl.int64)  # [BLOCK_M] flat token index
        q = tl.load(
            query_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
            mask=row_valid[:, None],
            other=0.0,
        )  # [BLOCK_M, D]

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running sum of exp2(score - m_i) * v

        for n in range(num_entries):
            logical = tl.load(key_logical_ptr + seq * stride_lbl + n)
            block_first = logical * BLOCK_SIZE  # position of the block's slot 0
            # The block can be seen by some query of the tile iff it is real, starts at or before the
            # last query, and (with a window) ends inside the first query's window or holds a sink.
            needed = (logical >= 0) & (block_first <= last_pos)
            if HAS_WINDOW:
                in_window = first_pos - (block_first + BLOCK_SIZE - 1) < sliding_window
                needed = needed & (in_window | (block_first < num_sink_tokens))
            if needed:
                block = tl.load(key_blocks_ptr + seq * stride_kbl + n).to(tl.int64)
                k = tl.load(
                    key_cache_ptr + block * stride_kb + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
                )  # [BLOCK_SIZE, D]
                v = tl.load(
                    value_cache_ptr
                    + block * stride_vb
                    + slots[:, None] * stride_vs
                    + kv_head * stride_vh
                    + dims[None, :]
                )  # [BLOCK_SIZE, D]
                if QUANTIZED:
                    z_offsets = block * stride_zb + slots * stride_zs + kv_head * stride_zh  # [BLOCK_SIZE]
                    k = k.to(tl.float32) * tl.load(key_scale_ptr + z_offsets)[:, None]
                    v = v.to(tl.float32) * tl.load(value_scale_ptr + z_offsets)[:, None]
                k = k.to(q.dtype)  # a cache of another format is read into the query's dtype
                v = v.to(q.dtype)
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_SIZE]
                if SOFTCAP:  # scores are s / softcap here: tanh, then back to the softcap range in base 2
                    scores = _tanh(scores) * softcap_log2

                key_pos = block_first + slots  # [BLOCK_SIZE]
                visible = key_pos[None, :] <= query_pos[:, None]
                if HAS_WINDOW:
                    distance = query_pos[:, None] - key_pos[None, :]
                    visible = visible & ((distance < sliding_window) | (key_pos[None, :] < num_sink_tokens))
                scores = tl.where(visible, scores, float("-inf"))

                m_new = tl.maximum(m_i, tl.max(scores, 1))  # [BLOCK_M]
                # A row that has seen nothing yet keeps max -inf; subtracting 0 instead keeps its
                # exp2 terms at exactly 0 rather than NaN (-inf - -inf).
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M] rescale of what was summed under the old max
                p = tl.exp2(scores - m_safe[:, None])  # [BLOCK_M, BLOCK_SIZE]
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None]
                acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
                m_i = m_new
                if COUNT_VISITS:  # each program owns its counter: no atomics needed
                    counter = visits_ptr + (seq * tl.num_programs(1) + tile) * tl.num_programs(2) + head
                    tl.store(counter, tl.load(counter) + 1)

        # Every real query sees at least its own key, so l_i > 0 on real rows; padding rows are not stored.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )


def _interpreted() -> bool:
    """Whether the kernel was decorated in Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_paged_prefill_kernel, InterpretedFunction)


def unavailable_reason() -> str | None:
    """Why triton_paged_prefill cannot run on this machine, or None when it can."""
    if triton is None:
        return "triton is not installed"
    if not _interpreted() and not torch.cuda.is_available():
        return "no CUDA device (and TRITON_INTERPRET=1 was not set when the module was imported)"
    return None


def available() -> bool:
    """Whether triton_paged_prefill can run on this machine."""
    return unavailable_reason() is None


def unsupported_reason(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> str | None:
    """Why the kernel cannot take these tensors (limits in the module docstring), or None when it can."""
    block_size, num_kv_heads = key_cache.shape[1:3]
    head_dim = kv_format.head_dim_of(key_cache)
    num_heads = query.shape[1]
    if query.dtype not in _DTYPES or key_cache.dtype != value_cache.dtype or key_cache.dtype not in _CACHE_DTYPES:
        dtypes = f"{query.dtype}/{key_cache.dtype}/{value_cache.dtype}"
        return f"dtypes {dtypes}: needs a float16, bfloat16 or float32 query and caches of one KV format"
    if query.shape[2] != head_dim or value_cache.shape != key_cache.shape:
        return f"query {tuple(query.shape)} and caches {tuple(key_cache.shape)}/{tuple(value_cache.shape)} disagree"
    for name, size in (("head_dim", head_dim), ("block_size", block_size)):
        if size < 16 or size > 256 or size & (size - 1):
            return f"{name} {size} is not a power of two in [16, 256]"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    device = "cpu" if _interpreted() else "cuda"
    if {query.device.type, key_cache.device.type, value_cache.device.type} != {device}:
        return f"the tensors must be on {device} here (query is on {query.device})"
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        return "the head dimension of the query and caches must be contiguous"
    return None


def _launch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    visits: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """Run the kernel; `visits` (int32 [B, num_tiles, H_q], zeroed) receives the blocks each program loaded."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs, num_entries = meta.key_blocks.shape
    # query_index is [B, max query_len]: its shape gives the grid without reading query_lens back.
    num_tiles = triton.cdiv(meta.query_index.shape[1], BLOCK_M)
    out = query.new_empty(num_tokens, num_heads, head_dim)
    if num_tokens == 0:
        return out
    key_blocks = meta.key_blocks.to(torch.int64)
    key_logical = meta.key_block_logical.to(torch.int32)
    query_starts = meta.query_starts.to(torch.int32)
    query_lens = meta.query_lens.to(torch.int32)
    query_offsets = meta.query_offsets.to(torch.int32)
    count_visits = visits is not None
    if visits is None:
        visits = query_lens  # never touched: COUNT_VISITS is off
    has_window = meta.sliding_window is not None
    keys, key_scales = kv_format.kernel_views(key_cache)
    values, value_scales = kv_format.kernel_views(value_cache)
    _paged_prefill_kernel[(num_seqs, num_tiles, num_heads)](
        query,
        keys,
        values,
        key_scales,
        value_scales,
        out,
        key_blocks,
        key_logical,
        query_starts,
        query_lens,
        query_offsets,
        visits,
        scale * _LOG2E if softcap is None else scale / softcap,
        softcap * _LOG2E if softcap is not None else 0.0,
        num_entries,
        meta.sliding_window if has_window else 0,
        meta.num_sink_tokens,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        *key_scales.stride()[:3],
        key_blocks.stride(0),
        key_logical.stride(0),
        GROUP=num_heads // num_kv_heads,
        BLOCK_M=BLOCK_M,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HAS_WINDOW=has_window,
        COUNT_VISITS=count_visits,
        SOFTCAP=softcap is not None,
        QUANTIZED=key_cache.dtype == torch.int8,
    )
    return out


def triton_paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of T flat queries [T, H_q, D] over the paged cache -> [T, H_q, D] in the query's dtype.

    Same contract as paged_attention_torch: `meta` from build_attention_metadata for any step, the new
    tokens' K/V already written to the caches [num_blocks, block_size, H_kv, D] (write_kv). softcap:
    scores s become softcap * tanh(s / softcap) before the mask and softmax; None: no cap.
    """
    reason = unavailable_reason() or unsupported_reason(query, key_cache, value_cache)
    if reason is not None:
        raise ValueError(f"triton_paged_prefill cannot run: {reason}")
    if not math.isfinite(scale):
        raise ValueError(f"scale {scale} is not finite")
    if softcap is not None and not (0 < softcap < math.inf):
        raise ValueError(f"softcap must be positive and finite, got {softcap}")
    return _launch(query, key_cache, value_cache, meta, scale, softcap=softcap)
