"""Cross-encoders: the packed BERT encoder (engine/models/bert.py) plus a sequence-classification head.

A cross-encoder reads a (query, document) pair as one sequence and maps the hidden state of its
first token ([CLS] for BERT, <s> for RoBERTa / XLM-R) to `num_labels` logits. Hugging Face
checkpoints come with one of two head layouts:

- `BertForSequenceClassification`: the pooler (`bert.pooler.dense` + tanh), then `classifier`.
- `RobertaForSequenceClassification`, `XLMRobertaForSequenceClassification`: no pooler;
  `classifier.dense` + tanh, then `classifier.out_proj`.

Dropout does nothing at inference, so both are out(tanh(dense(x))) and differ only in their weight
names. The encoder is the packed, padding-free one the embedder uses, so the logits agree with
transformers to float32 rounding.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.models.bert import BertModel, EncoderBatch, load_bert, read_weights

logger = logging.getLogger(__name__)

# architecture (config.json) -> its head layout
ARCHITECTURES = {
    "BertForSequenceClassification": "bert",
    "RobertaForSequenceClassification": "roberta",
    "XLMRobertaForSequenceClassification": "roberta",
}
# head layout -> the checkpoint's names of (dense, output) layers
_HEAD_WEIGHTS = {
    "bert": ("bert.pooler.dense", "classifier"),
    "roberta": ("classifier.dense", "classifier.out_proj"),
}


class ClassificationHead(nn.Module):
    """[B, H] first-token hidden states -> [B, num_labels] logits: out(tanh(dense(x)))."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, num_labels)

    def forward(self, first_token: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(first_token)))


class CrossEncoder(nn.Module):
    """forward(flat ids [N], EncoderBatch, segment ids [N] or None) -> [B, num_labels] logits."""

    def __init__(self, encoder: BertModel, head: ClassificationHead, architecture: str) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = head
        self.architecture = architecture

    @property
    def num_labels(self) -> int:
        return self.head.out.out_features

    def forward(
        self, input_ids: torch.Tensor, batch: EncoderBatch, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.encoder(input_ids, batch, token_type_ids)  # [N, H]
        return self.head(hidden[batch.cu_seqlens[:-1]])  # each sequence's first token: [B, H] -> [B, L]


def _architecture(model_dir: Path, weights: dict[str, torch.Tensor]) -> tuple[str, str]:
    """(architecture, head layout): from config.json's `architectures`, or from the weight names without it."""
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc
    architectures = raw.get("architectures") or []
    if architectures:
        architecture = architectures[0]
        if architecture not in ARCHITECTURES:
            raise ModelLoadError(
                f"{model_dir}: architecture {architecture!r} is not a cross-encoder kvserve can rerank with "
                f"(one of {sorted(ARCHITECTURES)})"
            )
        return architecture, ARCHITECTURES[architecture]
    for architecture, layout in ARCHITECTURES.items():
        if f"{_HEAD_WEIGHTS[layout][1]}.weight" in weights and f"{_HEAD_WEIGHTS[layout][0]}.weight" in weights:
            return architecture, layout
    raise ModelLoadError(f"{model_dir}: config.json names no architecture and the weights hold no classification head")


def load_cross_encoder(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> CrossEncoder:
    """Build a CrossEncoder from a Hugging Face `*ForSequenceClassification` folder (config.json + weights)."""
    model_dir = Path(model_dir)
    weights = read_weights(model_dir)
    architecture, layout = _architecture(model_dir, weights)
    encoder = load_bert(model_dir, dtype=dtype, device=device, weights=weights)
    dense_name, out_name = _HEAD_WEIGHTS[layout]
    names = [f"{layer}.{kind}" for layer in (dense_name, out_name) for kind in ("weight", "bias")]
    missing = [name for name in names if name not in weights]
    if missing:
        raise ModelLoadError(f"{model_dir}: {architecture} weights are missing its classification head {missing}")
    hidden_size = encoder.config.hidden_size
    num_labels = weights[f"{out_name}.weight"].shape[0]
    head = ClassificationHead(hidden_size, num_labels)
    own = dict(zip(("dense.weight", "dense.bias", "out.weight", "out.bias"), (weights[n] for n in names), strict=True))
    for name, tensor in own.items():
        expected = tuple(head.state_dict()[name].shape)
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"{model_dir}: head weight {name} is {tuple(tensor.shape)}, expected {expected}")
    head.load_state_dict(own, strict=True)
    head = head.to(device=device, dtype=dtype).eval()
    head.requires_grad_(False)
    logger.info("loaded %s head from %s: %d label(s)", architecture, model_dir, num_labels)
    return CrossEncoder(encoder, head, architecture).eval()
