"""Decode attention over the paged cache as Triton kernels: one query token per sequence, with split-K.

The GPU counterpart of engine/ops/decode_attention.py. It computes visibility itself from the
positions in AttentionMetadata (key_block_logical, query_starts, sliding_window, num_sink_tokens:
the rule of engine/attention/'s visible_mask) instead of reading a dense mask, and reads the
cache in place through each sequence's key_blocks.

Program grid of the main kernel: (sequence, KV head, split). A program loads the G = H_q / H_kv query
rows of its KV head's group as one [G_PAD, D] tile (G padded to a power of 2, the padding rows masked),
walks its share of the sequence's key_blocks entries, skips an entry none of whose keys is visible
(padding, wholly after the query, wholly behind the window and holding no sink) before loading anything
of it, and otherwise folds the entry's [block_size] keys into an online softmax (running max m, running
sum l, accumulator rescaled by exp(m_old - m_new), in base 2), all in float32 whatever the cache dtype.
With a softcap (SOFTCAP), each scaled score s becomes softcap * tanh(s / softcap) before masking and the
softmax; without one the kernel is compiled without that step.
With one split it writes the normalised output; with several (flash decoding, for long contexts
and few sequences) each split writes its partial (m, l, unnormalised accumulator) to float32 scratch and
a second kernel, one program per (sequence, query head), combines the splits with log-sum-exp weights.

Scores: broadcast-multiply-sum for G_PAD < 16 (tl.dot needs every dimension >= 16, and decode groups are
usually 1-8 heads); tl.dot with input_precision="ieee" (exact float32, no TF32) when G_PAD >= 16 and
block_size >= 16. Limits: head_dim a power of 2 in [16, 256] (tested at 32, 64, 128), block_size a
power of 2, caches float16 / bfloat16 / float32, or int8 rows with a float32 scale each (engine/ops/
kv_format.py: the values and the scales are passed as two strided views of the one cache, QUANTIZED);
the output takes the query's dtype.

triton is a dev / CUDA dependency, not a CPU runtime one: it is imported under a guard and available()
says whether the kernels can run here (a CUDA device, or Triton's interpreter: TRITON_INTERPRET=1 set
before this module is first imported, which runs them on CPU tensors). tests/engine/
test_triton_decode_attention.py holds them equal to the dense reference and the torch paged path.
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
except ImportError:  # a CPU install without the dev extras: available() is False
    triton = None
    tl = None

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CACHE_DTYPES = (*_DTYPES, torch.int8)
# Scores are kept in base 2 (scaled by log2(e)) so the softmax uses exp2, the GPU's native exponential.
_LOG2E = math.log2(math.e)
# Split-K heuristic: a split reads at least this many blocks (below that the reduction kernel costs more
# than the parallelism gains), the grid aims at about this many programs (a few waves of a large GPU),
# and a sequence is cut into at most this many splits.
_MIN_ENTRIES_PER_SPLIT = 16
_TARGET_PROGRAMS = 512
_MAX_SPLITS = 16


def _interpreted() -> bool:
    """Whether the kernels were decorated for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_decode_kernel, InterpretedFunction)


def available() -> bool:
    """Whether triton_paged_decode can run on this machine: triton installed, and a CUDA device or the interpreter.

    Under the interpreter the kernels run on CPU tensors; otherwise they need CUDA tensors.
    """
    if triton is None:
        return False
    return _interpreted() or torch.cuda.is_available()


def choose_num_splits(num_entries: int, num_programs: int) -> int:
    """How many splits to cut each sequence's num_entries key blocks into, for num_programs = B * H_kv.

    One split for short contexts; otherwise enough that each split reads >= _MIN_ENTRIES_PER_SPLIT
    blocks, no more than it takes to give the GPU about _TARGET_PROGRAMS programs, and <= _MAX_SPLITS.
    """
    if num_entries < 2 * _MIN_ENTRIES_PER_SPLIT:
        return 1
    by_length = num_entries // _MIN_ENTRIES_PER_SPLIT
    by_occupancy = max(1, _TARGET_PROGRAMS // max(num_programs, 1))
    return max(1, min(by_length, by_occupancy, _MAX_SPLITS))


if triton is not None:

    @triton.jit
    def _tanh(x):
        # tanh from exp2 (libdevice's tanh has no interpreter implementation): e = exp(-2|x|) lies in
        # (0, 1] for every x, so nothing overflows, and tanh(+-inf) = +-1.
        e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 * log2(e)
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def _decode_kernel(
        query_ptr,  # [B, H_q, D]
        key_cache_ptr,  # [num_blocks, block_size, H_kv, D]
        value_cache_ptr,  # [num_blocks, block_size, H_kv, D]
        key_scale_ptr,  # float32 [num_blocks, block_size, H_kv]: each int8 key row's scale (QUANTIZED only)
        value_scale_ptr,  # float32 [num_blocks, block_size, H_kv] (QUANTIZED only)
        key_blocks_ptr,  # int64 [B, N] physical block of each entry
        key_logical_ptr,  # int32 [B, N] logical block of each entry, -1 for padding
        num_entries_ptr,  # int32 [B] entries to visit (last non-padding entry + 1)
        query_starts_ptr,  # int32 [B] position of each sequence's query token
        out_ptr,  # [B, H_q, D], written when NUM_SPLITS == 1
        part_max_ptr,  # float32 [B, H_q, NUM_SPLITS], log2 domain, written when NUM_SPLITS > 1
        part_sum_ptr,  # float32 [B, H_q, NUM_SPLITS]
        part_acc_ptr,  # float32 [B, H_q, NUM_SPLITS, D], unnormalised
        visits_ptr,  # int32 [B, H_kv, NUM_SPLITS]: entries each program loaded (only when COUNT_VISITS)
        qk_scale,  # scale * log2(e) (scores go through exp2); scale / softcap with SOFTCAP
        softcap_log2,  # softcap * log2(e), used only with SOFTCAP
        sliding_window,
        num_sink_tokens,
        stride_qb,
        stride_qh,
        stride_qd,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,
        stride_zb,  # the scales' strides (block, slot, head), the same for keys and values
        stride_zs,
        stride_zh,
        stride_tb,
        stride_tn,
        stride_lb,
        stride_ln,
        stride_ob,
        stride_oh,
        stride_od,
        GROUP: tl.constexpr,  # query heads per KV head
        GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of 2
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        USE_DOT: tl.constexpr,
        COUNT_VISITS: tl.constexpr,
        SOFTCAP: tl.constexpr,  # scores s -> softcap * tanh(s / softcap)
        QUANTIZED: tl.constexpr,  # int8 cache rows, each times its scale
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        num_heads = tl.num_programs(1) * GROUP

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_j = tl.arange(0, BLOCK_SIZE)
        row_ok = offs_g < GROUP
        # Query head kv_head * GROUP + g reads KV head kv_head (the repeat_interleave grouping).
        heads = kv_head * GROUP + offs_g
        q_ptrs = query_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)  # [G_PAD, D]
        q = q * qk_scale

        q_pos = tl.load(query_starts_ptr + seq)
        num_entries = tl.load(num_entries_ptr + seq)
        per_split = tl.cdiv(num_entries, NUM_SPLITS)
        entry_begin = split * per_split
        entry_end = tl.minimum(entry_begin + per_split, num_entries)

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (log2 domain)
        l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)  # running sum of exp2(score - m_i) * v
        visited = tl.zeros([], tl.int32)

        for n in range(entry_begin, entry_end):
            logical = tl.load(key_logical_ptr + seq * stride_lb + n * stride_ln)
            first = logical * BLOCK_SIZE  # position of the entry's slot 0
            # Some key of the entry is visible: it is not padding, starts at or before the query,
            # and (with a window) ends inside the window or starts among the sinks.
            live = (logical >= 0) & (first <= q_pos)
            if USE_WINDOW:
                live = live & ((q_pos - (first + BLOCK_SIZE - 1) < sliding_window) | (first < num_sink_tokens))
            if live:
                block = tl.load(key_blocks_ptr + seq * stride_tb + n * stride_tn)  # int64: no slot overflow
                key_pos = first + offs_j  # [BLOCK_SIZE]
                visible = key_pos <= q_pos
                if USE_WINDOW:
                    visible = visible & (((q_pos - key_pos) < sliding_window) | (key_pos < num_sink_tokens))
                k_ptrs = (
                    key_cache_ptr
                    + block * stride_kb
                    + offs_j[:, None] * stride_ks
                    + kv_head * stride_kh
                    + offs_d[None, :] * stride_kd
                )
                # Masked loads: slots not yet written (or stale) never reach the sums, even as NaN.
                k = tl.load(k_ptrs, mask=visible[:, None], other=0.0).to(tl.float32)  # [BLOCK_SIZE, D]
                if QUANTIZED:
                    z_offsets = block * stride_zb + offs_j * stride_zs + kv_head * stride_zh  # [BLOCK_SIZE]
                    k = k * tl.load(key_scale_ptr + z_offsets, mask=visible, other=0.0)[:, None]
                if USE_DOT:
                    scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [G_PAD, BLOCK_SIZE]
                else:
                    scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G_PAD, BLOCK_SIZE]
                if SOFTCAP:  # q carries scale / softcap: tanh, then back to the softcap range in base 2
                    scores = _tanh(scores) * softcap_log2
                scores = tl.where(visible[None, :], scores, float("-inf"))
                # The entry has a visible key, so m_new is finite and exp2(-inf - m_new) = 0 below.
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [G_PAD]
                alpha = tl.exp2(m_i - m_new)  # rescales what was summed against the old max
                p = tl.exp2(scores - m_new[:, None])  # [G_PAD, BLOCK_SIZE]
                v_ptrs = (
                    value_cache_ptr
                    + block * stride_vb
                    + offs_j[:, None] * stride_vs
                    + kv_head * stride_vh
                    + offs_d[None, :] * stride_vd
                )
                v = tl.load(v_ptrs, mask=visible[:, None], other=0.0).to(tl.float32)  # [BLOCK_SIZE, D]
                if QUANTIZED:
                    v = v * tl.load(value_scale_ptr + z_offsets, mask=visible, other=0.0)[:, None]
                if USE_DOT:
                    pv = tl.dot(p, v, input_precision="ieee")  # [G_PAD, D]
                else:
                    pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [G_PAD, D]
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
                visited += 1

        if COUNT_VISITS:  # each program owns its counter: no atomics needed
            tl.store(visits_ptr + (seq * tl.num_programs(1) + kv_head) * NUM_SPLITS + split, visited)
        if NUM_SPLITS == 1:
            out = acc / l_i[:, None]
            o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            # A split with no visible entry stores m = -inf, l = 0, acc = 0: weight 0 in the reduction.
            part = (seq * num_heads + heads) * NUM_SPLITS + split  # [G_PAD] row of the scratch tensors
            tl.store(part_max_ptr + part, m_i, mask=row_ok)
            tl.store(part_sum_ptr + part, l_i, mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def _combine_splits_kernel(
        part_max_ptr,  # float32 [B, H_q, NUM_SPLITS]
        part_sum_ptr,  # float32 [B, H_q, NUM_SPLITS]
        part_acc_ptr,  # float32 [B, H_q, NUM_SPLITS, D]
        out_ptr,  # [B, H_q, D]
        stride_ob,
        stride_oh,
        stride_od,
        HEAD_DIM: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,  # NUM_SPLITS rounded up to a power of 2
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        split_ok = offs_s < NUM_SPLITS
        part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
        m = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
        sums = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
        acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=split_ok[:, None], other=0.0)
        # Each split summed against its own max; bring all to the global max (log-sum-exp).
        m_all = tl.max(m, axis=0)  # finite: the query's own key is visible in some split
        weight = tl.exp2(m - m_all)  # [SPLITS_PAD], 0 for empty splits
        total = tl.sum(weight * sums, axis=0)
        out = tl.sum(weight[:, None] * acc, axis=0) / total  # [D]
        o_ptrs = out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


def _is_power_of_2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def triton_paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention of one query per sequence, query [B, H_q, D], over the paged cache -> [B, H_q, D].

    meta: build_attention_metadata for a decode-only step (the new tokens' K/V already written by
    write_kv). key_cache, value_cache: [num_blocks, block_size, H_kv, D], float16 / bfloat16 / float32.
    num_splits: split-K parts per sequence; None chooses from the number of entries (choose_num_splits).
    softcap: scores s become softcap * tanh(s / softcap) before the softmax; None: no cap.
    The output has the query's dtype.
    """
    return _paged_decode(query, key_cache, value_cache, meta, scale, num_splits, softcap=softcap)


def _paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None,
    visits: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """triton_paged_decode; `visits` (int32 [B, H_kv, num_splits]) receives the entries each program loaded."""
    if triton is None:
        raise RuntimeError("triton_paged_decode needs triton (the dev extras or a CUDA install)")
    if not meta.is_decode_only:
        raise ValueError("triton_paged_decode computes decode-only steps (one new token per sequence)")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    cache_head_dim = kv_format.head_dim_of(key_cache)
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError("key_cache and value_cache must have the same shape and dtype")
    if key_cache.dtype not in _CACHE_DTYPES or query.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtypes: query {query.dtype}, cache {key_cache.dtype}")
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"query [{num_heads}, {head_dim}] does not fit cache heads [{num_kv_heads}, {cache_head_dim}]")
    if not (_is_power_of_2(head_dim) and 16 <= head_dim <= 256):
        raise ValueError(f"head_dim {head_dim} is not a power of 2 in [16, 256]")
    if not _is_power_of_2(block_size):
        raise ValueError(f"block_size {block_size} is not a power of 2")
    if num_seqs != meta.num_seqs:
        raise ValueError(f"{num_seqs} queries for {meta.num_seqs} sequences")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if softcap is not None and not (0 < softcap < math.inf):
        raise ValueError(f"softcap must be positive and finite, got {softcap}")

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    max_entries = meta.key_blocks.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(max_entries, num_seqs * num_kv_heads)
    logical = meta.key_block_logical
    # Entries to visit per sequence: through the last non-padding one (on device, no sync).
    columns = torch.arange(1, max_entries + 1, device=logical.device, dtype=torch.int32)
    num_entries = torch.where(logical >= 0, columns, 0).amax(dim=1).to(torch.int32)  # [B]
    query_starts = meta.query_starts.to(torch.int32)

    out = torch.empty_like(query)
    if num_splits > 1:
        part_max = torch.empty(num_seqs, num_heads, num_splits, device=query.device, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, device=query.device, dtype=torch.float32)
    else:  # unused by the kernel when NUM_SPLITS == 1
        part_max = part_sum = part_acc = out
    window = meta.sliding_window
    count_visits = visits is not None
    if visits is None:
        visits = num_entries  # never touched: COUNT_VISITS is off
    elif visits.shape != (num_seqs, num_kv_heads, num_splits) or visits.dtype != torch.int32:
        raise ValueError(f"visits must be int32 [{num_seqs}, {num_kv_heads}, {num_splits}]")
    keys, key_scales = kv_format.kernel_views(key_cache)
    values, value_scales = kv_format.kernel_views(value_cache)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        keys,
        values,
        key_scales,
        value_scales,
        meta.key_blocks,
        logical,
        num_entries,
        query_starts,
        out,
        part_max,
        part_sum,
        part_acc,
        visits,
        scale * _LOG2E if softcap is None else scale / softcap,
        softcap * _LOG2E if softcap is not None else 0.0,
        window if window is not None else 0,
        meta.num_sink_tokens,
        *query.stride(),
        *keys.stride(),
        *values.stride(),
        *key_scales.stride()[:3],
        *meta.key_blocks.stride(),
        *logical.stride(),
        *out.stride(),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        USE_WINDOW=window is not None,
        USE_DOT=group_pad >= 16 and block_size >= 16,
        COUNT_VISITS=count_visits,
        SOFTCAP=softcap is not None,
        QUANTIZED=key_cache.dtype == torch.int8,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_seqs, num_heads)](
            part_max,
            part_sum,
            part_acc,
            out,
            *out.stride(),
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out
