"""The packed BERT encoder against transformers (the reference), on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from engine.errors import ModelLoadError
from engine.models.bert import BertConfig, EncoderBatch, load_bert

_TINY = {"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37}


def _make_reference(kind: str, tmp_path, **overrides):
    """A tiny random transformers encoder saved as a HF directory (safetensors)."""
    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(**_TINY, max_position_embeddings=64, **overrides)
        model = transformers.BertModel(config, add_pooling_layer=False)
    elif kind == "roberta":
        config = transformers.RobertaConfig(**_TINY, max_position_embeddings=66, pad_token_id=1, **overrides)
        model = transformers.RobertaModel(config, add_pooling_layer=False)
    else:
        config = transformers.XLMRobertaConfig(**_TINY, max_position_embeddings=66, pad_token_id=1, **overrides)
        model = transformers.XLMRobertaModel(config, add_pooling_layer=False)
    model.eval()
    model.save_pretrained(tmp_path)
    return model, config


def _reference_hidden(model, config, ids: list[torch.Tensor]) -> torch.Tensor:
    """transformers on a right-padded [B, T] batch, valid rows packed back to [N, H]."""
    lens = [len(x) for x in ids]
    padded = torch.full((len(ids), max(lens)), config.pad_token_id)
    mask = torch.zeros_like(padded)
    for i, x in enumerate(ids):
        padded[i, : len(x)] = x
        mask[i, : len(x)] = 1
    with torch.no_grad():
        out = model(input_ids=padded, attention_mask=mask).last_hidden_state
    return torch.cat([out[i, :n] for i, n in enumerate(lens)])


@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta"])
def test_last_hidden_states_match_transformers(kind, tmp_path):
    ref_model, config = _make_reference(kind, tmp_path)
    ours = load_bert(tmp_path)
    assert ours.config.max_seq_len == 64  # RoBERTa: 66 positions minus the pad offset
    gen = torch.Generator().manual_seed(1)
    lens = [5, 17, 3, 64, 1, 30, 31, 30, 12]  # unsorted, with equal lengths, 1 token and the limit
    ids = [torch.randint(3, config.vocab_size, (n,), generator=gen) for n in lens]
    batch = EncoderBatch.from_seq_lens(lens)
    with torch.inference_mode():
        hidden = ours(torch.cat(ids), batch)
    expected = _reference_hidden(ref_model, config, ids)
    assert hidden.shape == expected.shape
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("act", ["gelu_new", "relu"])
def test_other_activations_match_transformers(act, tmp_path):
    ref_model, config = _make_reference("bert", tmp_path, hidden_act=act)
    ours = load_bert(tmp_path)
    ids = [torch.arange(3, 3 + n) for n in (7, 20)]
    with torch.inference_mode():
        hidden = ours(torch.cat(ids), EncoderBatch.from_seq_lens([7, 20]))
    torch.testing.assert_close(hidden, _reference_hidden(ref_model, config, ids), atol=1e-5, rtol=0)


def test_bfloat16_is_close_to_float32(tmp_path):
    _make_reference("bert", tmp_path)
    ids = torch.arange(3, 43)
    batch = EncoderBatch.from_seq_lens([40])
    with torch.inference_mode():
        full = load_bert(tmp_path)(ids, batch)
        half = load_bert(tmp_path, dtype=torch.bfloat16)(ids, batch).float()
    assert torch.nn.functional.cosine_similarity(full, half).min() > 0.99


def test_encoder_batch_layout():
    lens = [3, 3, 4, 10, 50, 51]
    batch = EncoderBatch.from_seq_lens(lens)
    assert batch.cu_seqlens.tolist() == [0, 3, 6, 10, 20, 70, 121]
    assert batch.position_ids[:10].tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 3]
    assert batch.position_ids[-1].item() == 50
    # groups tile the tokens in order, and every group's padding is bounded
    assert batch.groups[0].token_start == 0 and batch.groups[-1].token_end == 121
    for before, after in zip(batch.groups, batch.groups[1:]):
        assert before.token_end == after.token_start
    for g in batch.groups:
        assert g.num_seqs * g.max_len <= 1.25 * (g.token_end - g.token_start) + 8 * g.num_seqs
        if g.key_mask is not None:
            assert int(g.key_mask.sum()) == g.token_end - g.token_start == len(g.valid_index)
    # equal lengths need neither a gather nor a mask
    same = EncoderBatch.from_seq_lens([8, 8, 8])
    assert len(same.groups) == 1 and same.groups[0].key_mask is None
    with pytest.raises(ValueError):
        EncoderBatch.from_seq_lens([3, 0])


def test_config_rejects_what_it_cannot_run(tmp_path):
    base = {
        "model_type": "bert",
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
        "max_position_embeddings": 16,
    }
    assert BertConfig.from_dict(base).position_offset == 0
    assert BertConfig.from_dict({**base, "model_type": "roberta", "pad_token_id": 1}).max_seq_len == 14
    for bad in (
        {"model_type": "llama"},
        {"position_embedding_type": "relative_key"},
        {"hidden_act": "mish"},
        {"num_attention_heads": 3},
    ):
        with pytest.raises(ModelLoadError):
            BertConfig.from_dict({**base, **bad})


def test_missing_weights_are_named(tmp_path):
    _make_reference("bert", tmp_path)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["encoder.layer.1.output.dense.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing"):
        load_bert(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_bert(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError):
        load_bert(tmp_path)
