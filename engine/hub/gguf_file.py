"""A GGUF file's metadata and tensors, memory-mapped, read in one quick pass.

The `gguf` package's reader makes a numpy view for every value of every key, the tokenizer's vocabulary and
merges among them: about 2.3 s for SmolLM2-135M's 49,152 tokens and 48,900 merges, on every load. This pass
only walks past arrays (their lengths tell where the next key starts) and decodes a key's value when it is
asked for, so the same file takes a few tens of milliseconds. Its tensors are what that reader gives: the same
names, types, shapes (innermost dimension first) and numpy views of the file's bytes (float and integer types
as their dtype, outermost dimension first; every other type as uint8 rows of its blocks).

A file this pass does not read (a big-endian file, a version other than 2 and 3) is read by the `gguf`
package instead: `open_gguf` returns whichever reader read it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# Tensor types whose data is read as numbers of this dtype; every other type as uint8 bytes of its blocks.
_NUMERIC_TENSORS = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class UnreadableGguf(ValueError):
    """What this pass does not read (open_gguf then uses the gguf package's reader)."""


@dataclass(frozen=True)
class GgufField:
    """One key's value, decoded when contents() is called: a number, bool or str, or a list of them."""

    buffer: Any
    value_type: int
    offset: int  # where the value starts (after the key and its type)

    def contents(self) -> Any:
        return _decode(self.buffer, self.value_type, self.offset)[0]


@dataclass(frozen=True)
class GgufTensor:
    """One tensor: name, type, shape (GGUF order, innermost first), element and byte counts, its data."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GgufFile:
    """The file at `path`, memory-mapped: `fields` by key (get_field) and `tensors` in the file's order."""

    def __init__(self, path: str | Path) -> None:
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        buffer = self._map
        if bytes(buffer[:4]) != MAGIC:
            raise UnreadableGguf(f"{path}: not a GGUF file")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buffer, 4)
        if version not in VERSIONS:
            raise UnreadableGguf(f"{path}: GGUF version {version} (this reader reads {VERSIONS})")
        self.version = version
        offset = 24
        self.fields: dict[str, GgufField] = {}
        for _ in range(kv_count):
            key, offset = _string(buffer, offset)
            (value_type,) = struct.unpack_from("<I", buffer, offset)
            self.fields[key] = GgufField(buffer, value_type, offset + 4)
            offset = _skip(buffer, value_type, offset + 4)
        infos = []
        for _ in range(tensor_count):
            name, offset = _string(buffer, offset)
            (n_dims,) = struct.unpack_from("<I", buffer, offset)
            dims = struct.unpack_from(f"<{n_dims}Q", buffer, offset + 4)
            tensor_type, data_offset = struct.unpack_from("<IQ", buffer, offset + 4 + 8 * n_dims)
            offset += 4 + 8 * n_dims + 12
            infos.append((name, dims, tensor_type, data_offset))
        alignment_field = self.fields.get("general.alignment")
        alignment = int(alignment_field.contents()) if alignment_field is not None else DEFAULT_ALIGNMENT
        start = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({tensor.name for tensor in self.tensors}) != len(self.tensors):
            raise ValueError(f"{path}: two tensors have the same name")

    def get_field(self, key: str) -> GgufField | None:
        return self.fields.get(key)

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> GgufTensor:
        tensor_type = GGMLQuantizationType(raw_type)
        n_elements = int(np.prod(dims, dtype=np.int64))
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        n_bytes = n_elements * type_size // block_size
        outermost_first = tuple(reversed(dims))
        data_offset = start + offset
        dtype = _NUMERIC_TENSORS.get(tensor_type)
        if dtype is not None:
            data = self._map[data_offset : data_offset + n_bytes].view(dtype).reshape(outermost_first)
        else:  # rows of blocks: the innermost dimension in bytes
            byte_shape = (*outermost_first[:-1], outermost_first[-1] // block_size * type_size)
            data = self._map[data_offset : data_offset + n_bytes].reshape(byte_shape)
        return GgufTensor(name, tensor_type, dims, n_elements, n_bytes, data_offset, data)


def open_gguf(path: str | Path) -> Any:
    """The file read by GgufFile, or by the gguf package's reader where GgufFile does not read it (both have
    get_field(key).contents() and tensors with name, tensor_type, shape, n_bytes and data)."""
    try:
        return GgufFile(path)
    except UnreadableGguf:
        import gguf

        return gguf.GGUFReader(str(path))


def _string(buffer: Any, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buffer, offset)
    start = offset + 8
    return bytes(buffer[start : start + length]).decode("utf-8"), start + length


def _skip(buffer: Any, value_type: int, offset: int) -> int:
    """Where the value of `value_type` at `offset` ends, without decoding it."""
    if value_type in _SCALARS:
        return offset + struct.calcsize(_SCALARS[value_type])
    if value_type == GGUFValueType.STRING:
        return offset + 8 + struct.unpack_from("<Q", buffer, offset)[0]
    if value_type == GGUFValueType.ARRAY:
        item_type, count = struct.unpack_from("<IQ", buffer, offset)
        offset += 12
        if item_type in _SCALARS:
            return offset + count * struct.calcsize(_SCALARS[item_type])
        unpack = struct.Struct("<Q").unpack_from
        if item_type == GGUFValueType.STRING:
            for _ in range(count):
                offset += 8 + unpack(buffer, offset)[0]
            return offset
        for _ in range(count):
            offset = _skip(buffer, item_type, offset)
        return offset
    raise UnreadableGguf(f"unknown GGUF value type {value_type}")


def _decode(buffer: Any, value_type: int, offset: int) -> tuple[Any, int]:
    """(the value of `value_type` at `offset`, where it ends)."""
    if value_type in _SCALARS:
        fmt = _SCALARS[value_type]
        return struct.unpack_from(fmt, buffer, offset)[0], offset + struct.calcsize(fmt)
    if value_type == GGUFValueType.STRING:
        return _string(buffer, offset)
    if value_type == GGUFValueType.ARRAY:
        item_type, count = struct.unpack_from("<IQ", buffer, offset)
        offset += 12
        if item_type in _SCALARS:
            fmt = _SCALARS[item_type]
            size = struct.calcsize(fmt)
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", buffer, offset)) if count else []
            return values, offset + count * size
        values = []
        for _ in range(count):
            value, offset = _decode(buffer, item_type, offset)
            values.append(value)
        return values, offset
    raise UnreadableGguf(f"unknown GGUF value type {value_type}")
