"""decode_only_rows: a decode-only step's rows for the fused call, the same tensors as the full metadata's."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.metadata import build_group_metadata, decode_only_rows
from engine.models.fused_decode import decode_rows

KINDS = [(None, 0), (8, 0), (8, 4), (5, 2), (64, 0)]


@pytest.mark.parametrize("trial", range(40))
def test_decode_only_rows_equal_the_full_metadata(trial):
    rng = random.Random(trial)
    block_size = rng.choice([1, 4, 16])
    num_seqs = rng.randint(1, 5)
    kinds = [rng.choice(KINDS) for _ in range(rng.randint(1, 3))]
    starts = [rng.randrange(0, 60) for _ in range(num_seqs)]
    tables_by_group = [
        [[rng.randrange(1, 500) for _ in range(start // block_size + 1)] for start in starts] for _ in kinds
    ]
    metas = build_group_metadata(starts, [1] * num_seqs, tables_by_group, kinds, block_size, torch.device("cpu"))
    rows = decode_only_rows(starts, tables_by_group, kinds, block_size)
    assert len(rows) == len(metas)
    for (blocks, mask, slots), meta in zip(rows, metas, strict=True):
        expected = decode_rows(meta)
        assert torch.equal(blocks, expected.blocks)
        assert torch.equal(slots, expected.slots)
        assert (mask is None) == (expected.mask is None)
        if mask is not None:
            assert mask.dtype == torch.bool and torch.equal(mask, expected.mask)


def test_one_sequence_at_the_end_of_a_block_sees_every_key():
    # position 7 is the last slot of block 1 (block size 4): nothing to mask
    assert decode_only_rows([7], [[[3, 9]]], [(None, 0)], 4)[0][1] is None
    assert decode_only_rows([6], [[[3, 9]]], [(None, 0)], 4)[0][1] is not None


def test_groups_of_one_kind_share_their_mask():
    rows = decode_only_rows([5, 2], [[[1, 2], [3]], [[4, 5], [6]]], [(None, 0), (None, 0)], 4)
    assert rows[0][1] is rows[1][1]
    assert not torch.equal(rows[0][0], rows[1][0])
