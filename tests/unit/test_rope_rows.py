"""RopeRows: the fused step's table of cos/sin rows gives each position what cos_sin computes for it alone."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config

from engine.models.common import RotaryEmbedding
from engine.models.fused_decode import RopeRows

HEAD_DIM = 64


def _rotaries() -> dict[str, RotaryEmbedding]:
    cpu = torch.device("cpu")
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama3["original_max_position_embeddings"] = 1024
    long_factors = [1.0 + 0.1 * i for i in range(HEAD_DIM // 4)]
    phi3 = Phi3Config(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        max_position_embeddings=4096,
        original_max_position_embeddings=1024,
        partial_rotary_factor=0.5,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * (HEAD_DIM // 4), "long_factor": long_factors},
    )
    shape = {"hidden_size": 4 * HEAD_DIM, "num_attention_heads": 4}
    return {
        "default": RotaryEmbedding(LlamaConfig(rope_theta=500000.0, **shape), HEAD_DIM, cpu),
        "llama3": RotaryEmbedding(LlamaConfig(rope_scaling=llama3, **shape), HEAD_DIM, cpu),
        "freq_factors": RotaryEmbedding(LlamaConfig(**shape), HEAD_DIM, cpu, freq_factors=tuple(range(1, 33))),
        "longrope_partial": RotaryEmbedding(phi3, HEAD_DIM, cpu, rotary_dim=HEAD_DIM // 2),
    }


@pytest.mark.parametrize("kind", ["default", "llama3", "freq_factors", "longrope_partial"])
def test_rows_equal_each_position_computed_alone(kind):
    rotary = _rotaries()[kind]
    rows = RopeRows(rotary)
    steps = [[0], [5, 1023, 1024], [3000, 17], [RopeRows.TABLE_POSITIONS + 7], [RopeRows.TABLE_POSITIONS - 1, 2]]
    for step in steps:
        positions = torch.tensor(step)
        cos, sin = rows(positions)
        assert cos.shape == sin.shape == (len(step), rotary.rotary_dim) and cos.is_contiguous()
        for i, position in enumerate(step):
            alone_cos, alone_sin = rotary.cos_sin(torch.tensor([position]), torch.float32)
            assert torch.equal(cos[i], alone_cos[0, 0]) and torch.equal(sin[i], alone_sin[0, 0])
    assert rows.cos.shape[0] == RopeRows.TABLE_POSITIONS  # grown to the reach, never past it
