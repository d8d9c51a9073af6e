"""Our GGUF parser reads what gguf-py's reader reads: every metadata value and tensor, any
value type, either byte order; damaged files raise ValueError instead of reading past the end."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from specserve.models.gguf_file import GGUFFile  # noqa: E402
from specserve.testing import plain_memmap  # noqa: E402


def _same_as_gguf_py(path) -> GGUFFile:
    with plain_memmap():  # only speeds up gguf-py's reader
        theirs = gguf.GGUFReader(path)
    ours = GGUFFile(path)
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key in ours.fields:
        a, b = ours.get_field(key).contents(), theirs.get_field(key).contents()
        assert a == b and type(a) is type(b), key
    assert ours.get_field("no.such.key") is None
    assert len(ours.tensors) == len(theirs.tensors)
    for x, y in zip(ours.tensors, theirs.tensors):
        assert (x.name, x.tensor_type, x.n_elements, x.n_bytes, x.data_offset) == (
            y.name, y.tensor_type, y.n_elements, y.n_bytes, y.data_offset)
        assert x.shape.tolist() == y.shape.tolist()
        assert x.data.shape == y.data.shape and x.data.dtype == y.data.dtype and np.array_equal(x.data, y.data)
    return ours


def _write(path, endianess=None, alignment=None):
    kw = {} if endianess is None else {"endianess": endianess}
    w = gguf.GGUFWriter(str(path), "llama", **kw)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "ünïcode", "x" * 300])
    w.add_array("t.ints", [1, 2, 3, -4])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    q = rng.integers(0, 255, (2, 2 * 18), dtype=np.uint8)  # two rows of two Q4_0 blocks (18 bytes each)
    w.add_tensor("q4", q, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endianess", [None, "big"])
def test_every_value_type_and_tensor_kind_reads_as_gguf_py_reads_it(tmp_path, endianess):
    order = None if endianess is None else gguf.GGUFEndian.BIG
    f = _same_as_gguf_py(_write(tmp_path / "t.gguf", order))
    assert f.get_field("t.strs").contents() == ["a", "", "ünïcode", "x" * 300]
    assert f.get_field("t.u64").contents() == 2**63 + 5 and f.get_field("t.bool").contents() is True
    q4 = next(t for t in f.tensors if t.name == "q4")
    assert q4.data.shape == (2, 36) and q4.shape.tolist() == [64, 2] and q4.n_elements == 128


def test_a_custom_alignment_places_the_tensor_data(tmp_path):
    f = _same_as_gguf_py(_write(tmp_path / "t.gguf", alignment=64))
    assert all(t.data_offset % 64 == 0 for t in f.tensors)


def test_the_bundled_smollm2_reads_as_gguf_py_reads_it():
    from specserve.errors import ModelPackageMissingError
    from specserve.models.bundled import resolve_model

    try:
        path = resolve_model("smollm2-135m-instruct")
    except ModelPackageMissingError as e:  # pragma: no cover - CI installs it
        pytest.skip(str(e))
    f = _same_as_gguf_py(path)
    assert len(f.get_field("tokenizer.ggml.tokens").contents()) == 49152


@pytest.mark.parametrize("cut", [3, 10, 30, 200, -100, -30])
def test_a_cut_file_raises_value_error(tmp_path, cut):
    raw = _write(tmp_path / "t.gguf").read_bytes()  # ends in the last tensor (72 bytes) and 24 of padding
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(raw[:cut])
    with pytest.raises(ValueError):
        GGUFFile(bad)


def test_damaged_headers_raise_value_error(tmp_path):
    raw = bytearray(_write(tmp_path / "t.gguf").read_bytes())
    cases = {
        "version": raw[:4] + (7).to_bytes(4, "little") + raw[8:],
        "huge string": raw[:24] + (2**60).to_bytes(8, "little") + raw[32:],
        "huge field count": raw[:16] + (2**40).to_bytes(8, "little") + raw[24:],
    }
    for name, data in cases.items():
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(bytes(data))
        with pytest.raises(ValueError):
            GGUFFile(p)
