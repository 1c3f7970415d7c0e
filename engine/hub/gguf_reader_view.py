"""transformers' GGUF metadata parse, fed from GgufFile's quick pass instead of the `gguf` package's reader.

transformers reads a GGUF file's config and tokenizer (`load_gguf_checkpoint`) through `gguf.GGUFReader`, which
makes a numpy view of every value of every key: ~3 s for a 49,152-token vocabulary and its merges, once for the
config and once more for the tokenizer, on a file's first load (later loads read both from the metadata cache).
`reading_with_quick_pass()` makes `gguf.GGUFReader` hand transformers a ReaderView for the time of those calls:
the same fields and tensors as far as transformers reads them (a field's `types`, and its `parts` at the
indices in `data`, each parsed by transformers' `_gguf_parse_value`; a tensor's `name`), built from
engine/hub/gguf_file.py's pass. A file that pass does not read goes to the `gguf` package's reader as before.
"""

from __future__ import annotations

import contextlib
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf.constants import GGUFValueType

from engine.hub.gguf_file import GgufField, GgufFile, UnreadableGguf

# One patched section at a time: the patch is a module attribute of the `gguf` package.
_PATCH_LOCK = threading.RLock()


@dataclass(frozen=True)
class FieldView:
    """A key's value as transformers reads a ReaderField: types [type] or [ARRAY, item type]; parts[data[i]] is
    the i-th value, a one-item list for a number or bool and the UTF-8 bytes for a string."""

    types: list[int]
    parts: list[Any]
    data: list[int]


class ReaderView:
    """`fields` by key and `tensors` (name, type, shape, data) of the GGUF file at `path`, from GgufFile; raises
    UnreadableGguf for what that pass does not read, or a value nested deeper than transformers reads."""

    def __init__(self, path: str | Path) -> None:
        gguf_file = GgufFile(path)
        # The package's reader lists the header's numbers first, as keys of their own.
        self.fields = {
            "GGUF.version": FieldView([GGUFValueType.UINT32], [[gguf_file.version]], [0]),
            "GGUF.tensor_count": FieldView([GGUFValueType.UINT64], [[len(gguf_file.tensors)]], [0]),
            "GGUF.kv_count": FieldView([GGUFValueType.UINT64], [[len(gguf_file.fields)]], [0]),
        }
        self.fields.update((key, _view(field)) for key, field in gguf_file.fields.items())
        self.tensors = gguf_file.tensors


def _view(field: GgufField) -> FieldView:
    value = field.contents()
    if field.value_type != GGUFValueType.ARRAY:
        return FieldView([field.value_type], [_part(value)], [0])
    (item_type,) = struct.unpack_from("<I", field.buffer, field.offset)
    if item_type == GGUFValueType.ARRAY:
        raise UnreadableGguf("an array of arrays")
    return FieldView([GGUFValueType.ARRAY, item_type], [_part(item) for item in value], list(range(len(value))))


def _part(value: Any) -> Any:
    return value.encode("utf-8") if isinstance(value, str) else [value]


def _quick_or_package_reader(package_reader: type) -> Any:
    def open_reader(path: str | Path, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:  # a mode or endianness asked for: the package's own reader
            return package_reader(path, *args, **kwargs)
        try:
            return ReaderView(path)
        except UnreadableGguf:
            return package_reader(path)

    return open_reader


@contextlib.contextmanager
def reading_with_quick_pass() -> Iterator[None]:
    """Within: `gguf.GGUFReader(path)` answers a ReaderView where GgufFile reads the file."""
    import gguf

    with _PATCH_LOCK:
        package_reader = gguf.GGUFReader
        gguf.GGUFReader = _quick_or_package_reader(package_reader)
        try:
            yield
        finally:
            gguf.GGUFReader = package_reader
