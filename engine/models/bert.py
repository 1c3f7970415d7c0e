"""BERT-family encoder (BERT, RoBERTa, XLM-RoBERTa) over padding-free packed sequences.

A batch is one flat token tensor [N] holding B sequences back to back (`EncoderBatch`
says where each starts). Every position-wise op (embeddings, the Q/K/V/output
projections, LayerNorm, the MLP; ~98% of the FLOPs for short sentences) runs on the
flat [N, H] tensor, so no FLOP is spent on padding. Only attention needs sequences
side by side: sequences are split into groups of similar length, each group is
gathered into a padded [b, T] block, run through `scaled_dot_product_attention` with a
key padding mask (bidirectional, no causal mask, no KV cache), and scattered back.

Numerics follow Hugging Face's `BertModel` op for op (post-LayerNorm blocks, the same
addition order), so last hidden states agree with transformers to float32 rounding.
RoBERTa-style checkpoints differ only in position ids, which start at pad_token_id + 1.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
# Prefixes that task-head checkpoints (BertForMaskedLM, ...) put in front of the encoder weights.
_WEIGHT_PREFIXES = ("bert.", "roberta.", "model.")
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


@dataclass(frozen=True)
class BertConfig:
    """What an encoder's config.json says (only the fields the forward pass needs)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    @property
    def position_offset(self) -> int:
        """First position id: 0 for BERT; pad_token_id + 1 for RoBERTa/XLM-R (fairseq heritage)."""
        return self.pad_token_id + 1 if self.model_type in ("roberta", "xlm-roberta") else 0

    @property
    def max_seq_len(self) -> int:
        """Longest sequence the position table can hold (special tokens included)."""
        return self.max_position_embeddings - self.position_offset

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: dict) -> BertConfig:
        model_type = raw.get("model_type", "bert")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model_type {model_type!r} is not an encoder kvserve supports {SUPPORTED_MODEL_TYPES}"
            )
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(f"position_embedding_type {raw['position_embedding_type']!r} is not supported")
        if raw.get("is_decoder", False):
            raise ModelLoadError("decoder-configured BERT checkpoints are not supported as embedding models")
        hidden_act = raw.get("hidden_act", "gelu")
        if hidden_act not in _ACTIVATIONS:
            raise ModelLoadError(f"hidden_act {hidden_act!r} is not supported ({sorted(_ACTIVATIONS)})")
        config = cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            hidden_act=hidden_act,
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            pad_token_id=int(raw.get("pad_token_id") or 0),
        )
        if config.hidden_size % config.num_attention_heads:
            raise ModelLoadError(
                f"hidden_size {config.hidden_size} is not divisible by num_attention_heads {config.num_attention_heads}"
            )
        return config

    @classmethod
    def from_file(cls, path: Path) -> BertConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read encoder config {path}: {exc}") from exc
        return cls.from_dict(raw)


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences [seq_start, seq_end) of the batch, attended to as one padded [b, T] block.

    Their tokens are the contiguous flat range [token_start, token_end).
    gather_index: [b, T] flat token index per padded slot (pad slots repeat a valid index; masked).
    key_mask: [b, 1, 1, T] bool, True where the key is a real token; None when all lengths equal.
    valid_index: [token_end - token_start] positions of the real tokens in the flattened [b*T] block.
    """

    token_start: int
    token_end: int
    num_seqs: int
    max_len: int
    gather_index: torch.Tensor | None
    key_mask: torch.Tensor | None
    valid_index: torch.Tensor | None


@dataclass(frozen=True)
class EncoderBatch:
    """Where each packed sequence lives in the flat token tensor.

    seq_lens: [B] lengths; cu_seqlens: [B + 1] prefix sums (sequence i is tokens cu[i]:cu[i+1]);
    position_ids: [N] position within its own sequence (before the RoBERTa offset).
    """

    seq_lens: list[int]
    cu_seqlens: torch.Tensor
    position_ids: torch.Tensor
    groups: tuple[AttentionGroup, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @classmethod
    def from_seq_lens(
        cls, seq_lens: list[int], device: torch.device | str = "cpu", max_pad_ratio: float = 1.25
    ) -> EncoderBatch:
        """Build the metadata. Consecutive sequences share an attention group while the
        longest is at most `max_pad_ratio` times the shortest (plus a few tokens), so
        passing length-sorted sequences keeps attention padding small."""
        if not seq_lens or min(seq_lens) < 1:
            raise ValueError(f"every sequence needs at least one token, got lengths {seq_lens}")
        lens = torch.tensor(seq_lens, dtype=torch.long)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.long)
        torch.cumsum(lens, 0, out=cu[1:])
        num_tokens = int(cu[-1])
        # position within the sequence: global index minus the start of its sequence
        starts = torch.repeat_interleave(cu[:-1], lens)
        position_ids = torch.arange(num_tokens) - starts

        groups = []
        first = 0
        while first < len(seq_lens):
            lo = hi = seq_lens[first]
            last = first + 1
            while last < len(seq_lens):
                n = seq_lens[last]
                new_lo, new_hi = min(lo, n), max(hi, n)
                if new_hi > max_pad_ratio * new_lo + 8:
                    break
                lo, hi, last = new_lo, new_hi, last + 1
            groups.append(_make_group(seq_lens[first:last], int(cu[first]), int(cu[last]), device))
            first = last
        return cls(
            seq_lens=list(seq_lens),
            cu_seqlens=cu.to(device),
            position_ids=position_ids.to(device),
            groups=tuple(groups),
        )


def _make_group(lens: list[int], token_start: int, token_end: int, device: torch.device | str) -> AttentionGroup:
    num_seqs, max_len = len(lens), max(lens)
    if min(lens) == max_len:
        # equal lengths: the flat range is already a [b, T] block; no gather, no mask
        return AttentionGroup(token_start, token_end, num_seqs, max_len, None, None, None)
    lens_t = torch.tensor(lens, dtype=torch.long)
    starts = torch.cumsum(lens_t, 0) - lens_t  # relative to token_start
    slot = torch.arange(max_len)
    is_real = slot[None, :] < lens_t[:, None]  # [b, T]
    gather = starts[:, None] + torch.minimum(slot[None, :], lens_t[:, None] - 1)  # [b, T] rel. index
    valid = torch.nonzero(is_real.reshape(-1), as_tuple=False).squeeze(1)  # row-major = packed order
    return AttentionGroup(
        token_start,
        token_end,
        num_seqs,
        max_len,
        gather.to(device),
        is_real[:, None, None, :].to(device),
        valid.to(device),
    )


class BertLayer(nn.Module):
    """One post-LayerNorm transformer block; Q, K and V share one fused projection."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(hidden, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.act = _ACTIVATIONS[config.hidden_act]

    def attention(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        num_tokens, hidden = x.shape
        heads, head_dim = self.num_heads, self.head_dim
        qkv = self.qkv(x).view(num_tokens, 3, heads, head_dim)  # [N, 3, nh, hd]
        scale = 1.0 / math.sqrt(head_dim)
        outs = []
        for g in batch.groups:
            block = qkv[g.token_start : g.token_end]
            if g.gather_index is None:
                block = block.view(g.num_seqs, g.max_len, 3, heads, head_dim)
            else:
                block = block[g.gather_index]  # [b, T, 3, nh, hd]
            q, k, v = block.permute(2, 0, 3, 1, 4).unbind(0)  # each [b, nh, T, hd]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.key_mask, scale=scale)
            o = o.transpose(1, 2).reshape(g.num_seqs * g.max_len, hidden)  # [b*T, H]
            outs.append(o if g.valid_index is None else o[g.valid_index])
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)  # [N, H]

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        h = self.attn_norm(self.attn_out(self.attention(x, batch)) + x)
        return self.out_norm(self.output(self.act(self.intermediate(h))) + h)


class BertModel(nn.Module):
    """Encoder: embeddings + N blocks. forward(flat ids [N], EncoderBatch) -> last hidden states [N, H]."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.embed_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(
        self, input_ids: torch.Tensor, batch: EncoderBatch, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        # same addition order as transformers: (word + token_type) + position
        type_emb = (
            self.token_type_embeddings.weight[0].expand(input_ids.shape[0], -1)
            if token_type_ids is None
            else self.token_type_embeddings(token_type_ids)
        )
        x = self.word_embeddings(input_ids) + type_emb
        x = x + self.position_embeddings(batch.position_ids + self.config.position_offset)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, batch)
        return x

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face BERT/RoBERTa state dict (any task-head prefix; heads are ignored)."""
        weights = {_strip_prefix(name): t for name, t in weights.items()}
        own: dict[str, torch.Tensor] = {
            "word_embeddings.weight": weights.get("embeddings.word_embeddings.weight"),
            "position_embeddings.weight": weights.get("embeddings.position_embeddings.weight"),
            "token_type_embeddings.weight": weights.get("embeddings.token_type_embeddings.weight"),
            "embed_norm.weight": weights.get("embeddings.LayerNorm.weight"),
            "embed_norm.bias": weights.get("embeddings.LayerNorm.bias"),
        }
        for i in range(self.config.num_hidden_layers):
            src, dst = f"encoder.layer.{i}.", f"layers.{i}."
            for kind in ("weight", "bias"):
                parts = [weights.get(f"{src}attention.self.{p}.{kind}") for p in ("query", "key", "value")]
                own[f"{dst}qkv.{kind}"] = None if any(p is None for p in parts) else torch.cat(parts, 0)
                own[f"{dst}attn_out.{kind}"] = weights.get(f"{src}attention.output.dense.{kind}")
                own[f"{dst}attn_norm.{kind}"] = weights.get(f"{src}attention.output.LayerNorm.{kind}")
                own[f"{dst}intermediate.{kind}"] = weights.get(f"{src}intermediate.dense.{kind}")
                own[f"{dst}output.{kind}"] = weights.get(f"{src}output.dense.{kind}")
                own[f"{dst}out_norm.{kind}"] = weights.get(f"{src}output.LayerNorm.{kind}")
        if own["token_type_embeddings.weight"] is None and self.config.type_vocab_size >= 1:
            # some RoBERTa exports drop the (all-zero, single-row) token type table
            own["token_type_embeddings.weight"] = torch.zeros(self.config.type_vocab_size, self.config.hidden_size)
        missing = sorted(name for name, t in own.items() if t is None)
        if missing:
            raise ModelLoadError(f"encoder weights are missing {len(missing)} tensors, e.g. {missing[:3]}")
        expected = self.state_dict()
        for name, t in own.items():
            if tuple(t.shape) != tuple(expected[name].shape):
                raise ModelLoadError(
                    f"weight {name} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)}"
                )
        self.load_state_dict(own, strict=True)


def _strip_prefix(name: str) -> str:
    for prefix in _WEIGHT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every float tensor of a Hugging Face folder, as float32 on the CPU: its *.safetensors files, or
    else its pytorch_model.bin (read with weights_only, so no pickled code runs)."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    weights: dict[str, torch.Tensor] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    for file in files:
        weights.update(load_file(str(file)))
    if not files:
        bin_file = model_dir / "pytorch_model.bin"
        if not bin_file.exists():
            raise ModelLoadError(f"no .safetensors weights (nor pytorch_model.bin) in {model_dir}")
        try:
            weights = torch.load(bin_file, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ModelLoadError(f"cannot read {bin_file}: {exc}") from exc
    return {k: v.float() for k, v in weights.items() if v.is_floating_point()}


def load_bert(
    model_dir: Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    weights: dict[str, torch.Tensor] | None = None,
) -> BertModel:
    """Build a BertModel from a Hugging Face directory (config.json + weights).

    weights: the folder's tensors when the caller has read them already (`read_weights`), e.g. to
    load a task head from the same files."""
    model_dir = Path(model_dir)
    config = BertConfig.from_file(model_dir / "config.json")
    if weights is None:
        weights = read_weights(model_dir)
    with torch.device("meta"):
        model = BertModel(config)
    model = model.to_empty(device="cpu")
    model.load_weights(weights)
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    logger.info(
        "loaded %s encoder from %s: %d layers, hidden %d, %d positions, %s on %s",
        config.model_type,
        model_dir,
        config.num_hidden_layers,
        config.hidden_size,
        config.max_seq_len,
        dtype,
        device,
    )
    return model
