"""engine/hub/gguf_file.py reads what the gguf package's reader reads: every key's value, every tensor's
name, type, shape, byte count and data, on a file of every value type and several tensor types, and on the
default model's file (its tokenizer arrays among the keys)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.hub.gguf_file import GgufFile, open_gguf
from engine.hub.models_hub import resolve_model


def _assert_same(path) -> None:
    ours, theirs = GgufFile(path), gguf.GGUFReader(str(path))
    their_keys = [name for name in theirs.fields if not name.startswith("GGUF.")]  # the header, as fields
    assert list(ours.fields) == their_keys
    for key in their_keys:
        assert ours.get_field(key).contents() == theirs.get_field(key).contents(), key
    assert ours.get_field("no.such.key") is None
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.n_elements, mine.n_bytes, mine.data_offset) == (
            reference.name,
            reference.tensor_type,
            reference.n_elements,
            reference.n_bytes,
            reference.data_offset,
        )
        assert list(mine.shape) == [int(d) for d in reference.shape]
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
        assert np.array_equal(mine.data, reference.data, equal_nan=True)


def test_every_value_type_and_tensor_type_reads_as_the_gguf_package_reads_it(tmp_path):
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 255)
    writer.add_int8("t.i8", -128)
    writer.add_uint16("t.u16", 65535)
    writer.add_int16("t.i16", -32768)
    writer.add_uint32("t.u32", 2**32 - 1)
    writer.add_int32("t.i32", -(2**31))
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**64 - 1)
    writer.add_int64("t.i64", -(2**63))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "ünïcödé 🙂")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "日本"])
    writer.add_array("t.none", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    for name, qtype in (("q8", gguf.GGMLQuantizationType.Q8_0), ("q4", gguf.GGMLQuantizationType.Q4_0)):
        values = rng.standard_normal((3, 64)).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    bf16 = gguf.quants.quantize(rng.standard_normal((2, 8)).astype(np.float32), gguf.GGMLQuantizationType.BF16)
    writer.add_tensor("bf16", bf16, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_same(path)


def test_the_default_models_file_reads_as_the_gguf_package_reads_it():
    path = resolve_model("smollm2-135m-instruct")
    _assert_same(path)
    tokens = GgufFile(path).get_field("tokenizer.ggml.tokens").contents()
    assert len(tokens) == 49152 and tokens[0] == "<|endoftext|>"


def test_a_file_this_reader_does_not_read_goes_to_the_gguf_package(tmp_path):
    path = tmp_path / "big-endian.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_uint32("t.u32", 7)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    reader = open_gguf(path)
    assert isinstance(reader, gguf.GGUFReader) and reader.get_field("t.u32").contents() == 7
    text = tmp_path / "text.gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        GgufFile(text)
