"""Load a model's config and weights: a Hugging Face directory or a GGUF file.

Both end as (ModelConfig, state_dict with Hugging Face parameter names), so the
model files only ever see one naming scheme.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.hub import gguf_cache
from engine.hub.gguf_file import open_gguf
from engine.models import gemma, phi3, registry
from engine.ops.gguf_linear import BLOCK_TYPES, BlockWeight

logger = logging.getLogger(__name__)


def _architecture_named(architectures: object, model_type: object) -> str | None:
    """The architecture a config names: its first `architectures` entry, else the registry entry of its
    model_type (GGUF metadata carries no `architectures`), else the model_type itself."""
    if isinstance(architectures, list | tuple) and architectures and isinstance(architectures[0], str):
        return architectures[0]
    if not isinstance(model_type, str):
        return None
    entry = registry.for_model_type(model_type)
    return entry.name if entry is not None else model_type


def _model_config_from_hf(hf_config, path: Path) -> ModelConfig:
    architecture = _architecture_named(getattr(hf_config, "architectures", None), hf_config.model_type)
    return registry.lookup(architecture, path).model_config(hf_config, path)


def _refuse_unserved_architecture(config_file: Path, path: Path) -> None:
    """The registry's one-line refusal, before transformers is asked to parse an architecture we do not serve
    (and, for one it does not know either, answers with paragraphs)."""
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_file}: cannot parse the model config: {exc}") from exc
    if isinstance(raw, dict) and (architecture := _architecture_named(raw.get("architectures"), raw.get("model_type"))):
        registry.lookup(architecture, path)


# Not a weight: the Llama 3 frequency scaling, read into ModelConfig.rope_freq_factors.
_GGUF_ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class _GgufFacts:
    """What the engine reads from a GGUF file itself, beside transformers' reading of its metadata."""

    reader: Any  # the parsed file (engine/hub/gguf_file.py, memory-mapped), for the tensor pass
    architecture: str | None  # general.architecture
    key_length: int | None  # <architecture>.attention.key_length: the head size, where the file gives it
    rope_freq_factors: tuple[float, ...] | None  # the rope_freqs tensor: one RoPE divisor per rotary pair


def _read_gguf_facts(path: Path) -> _GgufFacts:
    import gguf

    try:
        reader = open_gguf(path)
        field = reader.get_field("general.architecture")
        architecture = field.contents() if field is not None else None
        key_field = reader.get_field(f"{architecture}.attention.key_length") if architecture else None
        key_length = int(key_field.contents()) if key_field is not None else None
        rope_freqs = next((t for t in reader.tensors if t.name == _GGUF_ROPE_FREQS), None)
        factors = None
        if rope_freqs is not None:
            values = gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type).reshape(-1)
            factors = tuple(float(f) for f in values)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF metadata: {exc}") from exc
    return _GgufFacts(reader, architecture if isinstance(architecture, str) else None, key_length, factors)


def _refuse_unserved_gguf_architecture(path: Path, architecture: str | None) -> None:
    """The one-line refusal of a GGUF whose `general.architecture` no registry entry reads."""
    if architecture is not None and registry.for_gguf(architecture) is None:
        served = sorted({name for entry in registry.entries() for name in entry.gguf_architectures})
        raise ModelLoadError(
            f"{path}: GGUF architecture {architecture!r} is not supported; supported: {', '.join(served)}"
        )


def _load_hf_directory(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json; expected a Hugging Face model directory or a .gguf file")
    _refuse_unserved_architecture(config_file, path)
    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{config_file}: cannot parse the model config: {exc}") from exc
    model_config = _model_config_from_hf(hf_config, path)

    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        shard_names = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
        shards = [path / name for name in shard_names]
    else:
        shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{path}: no *.safetensors weights found (pickled .bin checkpoints are not loaded)")
    state: dict[str, torch.Tensor] = {}
    from tqdm.auto import tqdm

    for shard in tqdm(shards, desc="Loading weights", unit="shard", disable=len(shards) < 2):
        try:
            state.update(load_file(str(shard)))
        except Exception as exc:
            raise ModelLoadError(f"{shard}: cannot read safetensors weights: {exc}") from exc
    return model_config, state


def _load_gguf(path: Path, keep_blocks: bool) -> tuple[ModelConfig, dict[str, torch.Tensor | BlockWeight]]:
    """Dequantize a GGUF file into Hugging Face-named float tensors via transformers' converter.

    With `keep_blocks`, in a file whose architecture's registry entry has gguf_blocks (LLaMA),
    the matrices of a type with a block kernel stay as the file stores them (BlockWeight) instead.

    transformers maps GGUF names to its own and undoes llama.cpp's Q/K row
    permutation; it needs the target model's parameter names, so we build the
    model on the meta device (no memory) just to hand it over.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    facts = _read_gguf_facts(path)
    _refuse_unserved_gguf_architecture(path, facts.architecture)
    try:
        config_dict = gguf_cache.load_config(path)
        model_type = config_dict.pop("model_type")
        config_dict.pop("_model_name_or_path", None)
        if facts.key_length is not None:
            # transformers' mapping skips the head size for some architectures (Qwen3), whose configs then
            # default to 128 whatever the file says.
            config_dict["head_dim"] = facts.key_length
        if facts.architecture == "phi3":  # its rotary dims, LongRoPE and window, which the mapping drops
            config_dict = phi3.gguf_config(facts.reader, config_dict)
        elif facts.architecture in ("gemma2", "gemma3"):  # their softcaps, attention scale and per-type RoPE
            config_dict = gemma.gguf_config(facts.reader, facts.architecture, config_dict)
        hf_config = AutoConfig.for_model(model_type, **config_dict)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF metadata: {exc}") from exc
    model_config = _model_config_from_hf(hf_config, path)
    if facts.rope_freq_factors is not None:
        model_config = dataclasses.replace(model_config, rope_freq_factors=facts.rope_freq_factors)
    if registry.lookup(model_config.architecture).gguf_blocks:
        tensors = _read_llama_gguf_tensors(facts.reader, path, model_config, facts.architecture, keep_blocks)
        if tensors is not None:
            return model_config, tensors
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_config)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot dequantize GGUF tensors: {exc}") from exc
    return model_config, {name: torch.as_tensor(t) for name, t in tensors.items()}


# A layer's tensors in the GGUF files of the architectures whose entries read their blocks (gguf_blocks):
# LLaMA's, plus Qwen2's q/k/v biases and Qwen3's per-head q/k norms under their llama.cpp names.
_LLAMA_GGUF_NAMES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's: four norms a layer, q/k norms (Gemma 3), no biases. llama.cpp stores every Gemma norm as 1 + w.
_GEMMA_GGUF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    **{name: hf for name, hf in _LLAMA_GGUF_NAMES.items() if "proj" in hf and ".bias" not in name},
}
# Phi-3's: its checkpoint's fused projections keep one tensor each (ffn_up holds gate then up).
_PHI3_GGUF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_LAYER_NAMES = {"gemma2": _GEMMA_GGUF_NAMES, "gemma3": _GEMMA_GGUF_NAMES, "phi3": _PHI3_GGUF_NAMES}
# Not weights: RoPE facts read into the config (the Llama 3 scaling; Phi-3's LongRoPE factors).
_GGUF_ROPE_TENSORS = (_GGUF_ROPE_FREQS, "rope_factors_long.weight", "rope_factors_short.weight")
_NORMS_STORED_PLUS_ONE = ("gemma2", "gemma3")
_LLAMA_GGUF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (rotary pairs interleaved per head) -> HF's half-split order."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# llama.cpp's converter interleaves the rotary pairs of LLaMA's q/k rows (its rope is GPT-J style); it keeps
# Qwen's rows as they are (NeoX style rope).
_PERMUTED_QK_ARCHITECTURES = ("llama",)


def _read_llama_gguf_tensors(
    reader: Any, path: Path, model_config: ModelConfig, architecture: str, keep_blocks: bool = False
) -> dict[str, torch.Tensor | BlockWeight] | None:
    """One pass over a LLaMA-family GGUF's tensors (`reader`: the file as open_gguf read it;
    `architecture`: its general.architecture): dequantize and rename (~3x faster than transformers'
    converter, which parses the file again). None when a tensor is not one we know, so the caller falls
    back to transformers. With `keep_blocks`, matrices of the types in BLOCK_TYPES are copied as the file's
    bytes (BlockWeight), never dequantized."""
    import gguf

    permuted = architecture in _PERMUTED_QK_ARCHITECTURES
    layer_names = _GGUF_LAYER_NAMES.get(architecture, _LLAMA_GGUF_NAMES)
    norms_plus_one = architecture in _NORMS_STORED_PLUS_ONE

    try:
        tensors: dict[str, torch.Tensor | BlockWeight] = {}
        dequantized: Counter[str] = Counter()  # GGUF type -> the file's bytes of its dequantized matrices
        for tensor in reader.tensors:
            name = tensor.name
            if name in _GGUF_ROPE_TENSORS:
                continue  # read by _read_gguf_facts (rope_freqs) or phi3.gguf_config (LongRoPE)
            if name in _LLAMA_GGUF_TOP:
                hf_name = _LLAMA_GGUF_TOP[name]
            else:
                prefix, _, rest = name.partition(".")
                layer, _, suffix = rest.partition(".")
                if prefix != "blk" or not layer.isdigit() or suffix not in layer_names:
                    logger.debug("%s: unknown GGUF tensor %s; using transformers' converter", path, name)
                    return None
                hf_name = f"model.layers.{layer}.{layer_names[suffix]}"
            qtype = tensor.tensor_type.name
            is_matrix = len(tensor.data.shape) == 2
            keep = keep_blocks and is_matrix and qtype in BLOCK_TYPES
            if keep:
                weight = torch.from_numpy(tensor.data.copy())  # uint8 [rows, row_bytes]: the file's bytes
            else:
                weight = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy()).float()
                if keep_blocks and is_matrix:
                    dequantized[qtype] += int(tensor.n_bytes)
            if norms_plus_one and hf_name.endswith("norm.weight"):
                weight = weight - 1.0  # the checkpoint's offset from one, as Gemma's RMSNorm reads it
            if permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                weight = _unpermute_rows(weight, model_config.num_heads)
            elif permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                weight = _unpermute_rows(weight, model_config.num_kv_heads)
            # GGUF lists dimensions innermost first: shape[0] is a row's length.
            tensors[hf_name] = BlockWeight(qtype, weight, int(tensor.shape[0])) if keep else weight
        if dequantized:
            logger.warning(
                "%s: GGUF types %s have no block kernel; those matrices are dequantized (then rounded to int8)",
                path,
                ", ".join(f"{t} ({dequantized[t] / 2**20:.1f} MiB in the file)" for t in sorted(dequantized)),
            )
        return tensors
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot dequantize GGUF tensors: {exc}") from exc


def load_checkpoint(
    path: str | Path, keep_gguf_blocks: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor | BlockWeight]]:
    """(ModelConfig, state_dict in HF names) for a HF directory or a .gguf file.

    Tensors are float, except that with `keep_gguf_blocks` a LLaMA GGUF's matrices of a
    type with a block kernel (engine/ops/gguf_linear.py) stay in the file's blocks."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be .gguf; otherwise pass the model directory")
        return _load_gguf(path, keep_gguf_blocks)
    return _load_hf_directory(path)
