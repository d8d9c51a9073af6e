"""A GGUF file's metadata and tensor table, parsed with `struct`; tensor data as memmap views.

gguf-py's GGUFReader builds a NumPy view for every part of every metadata value: the tokenizer's
vocabulary and merges (100k-300k strings) took 2.7 s to open SmolLM2-135M and about 8 s for a
Qwen2.5 model on a 2-core Zen 3, on every engine start. Here a string costs one `unpack_from`
and one decode, and only the tensors' data are NumPy views of the mapped file. The interface is
the part of GGUFReader specserve reads: `get_field(key).contents()` and `tensors` with the
fields of gguf's ReaderTensor.

Layout (GGUF v2 / v3, little- or big-endian): magic "GGUF", uint32 version, uint64 tensor count,
uint64 metadata count; metadata as (string key, uint32 type, value), arrays as (uint32 item type,
uint64 count, items); tensor infos as (string name, uint32 n_dims, uint64 dims[n_dims], uint32
ggml type, uint64 offset); tensor data from the next multiple of `general.alignment` (32 by
default), each tensor at that start plus its offset. Strings are a uint64 byte length and UTF-8.
Anything that runs past the end of the file raises ValueError.
"""

from __future__ import annotations

import functools
import os
import struct
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {  # GGUF value type -> struct format
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}
_STRING, _ARRAY = 8, 9
_PLAIN_DTYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFField(NamedTuple):
    """One metadata value: a Python scalar, str, or list (arrays; nested arrays as lists)."""

    name: str
    value: Any

    def contents(self) -> Any:
        return self.value


class GGUFTensor(NamedTuple):
    """One tensor: gguf's ReaderTensor fields (shape in GGUF order, innermost dimension first;
    data shaped like the tensor, quantized types as uint8 rows of whole blocks)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """The metadata (`get_field`) and tensors of a GGUF file, mapped read-only."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.data = np.memmap(path, mode="r").view(np.ndarray)  # a view keeps the mapping alive
        buf = memoryview(self.data)
        self._buf, self._size = buf, len(buf)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        self._order = "<"
        (version,) = self._unpack("I", 4)
        if version not in (2, 3):
            self._order = ">"
            (version,) = self._unpack("I", 4)
            if version not in (2, 3):
                raise ValueError("unsupported GGUF version (this reader reads versions 2 and 3)")
        self.version = version
        self._length = struct.Struct(self._order + "Q")  # a string's byte length
        n_tensors, n_fields = self._unpack("QQ", 8)
        off = 24
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_fields):
            key, off = self._string(off)
            (kind,), off = self._unpack("I", off), off + 4
            value, off = self._value(kind, off)
            self.fields[key] = GGUFField(key, value)
        infos = []
        for _ in range(n_tensors):
            name, off = self._string(off)
            (n_dims,), off = self._unpack("I", off), off + 4
            if n_dims > 8:
                raise ValueError(f"tensor {name} has {n_dims} dimensions")
            dims, off = self._unpack(f"{n_dims}Q", off), off + 8 * n_dims
            (raw_type, rel), off = self._unpack("IQ", off), off + 12
            infos.append((name, dims, raw_type, rel))
        align = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else 32
        if align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align} is not a power of two")
        start = -(-off // align) * align
        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, dims, raw_type, rel in infos:
            if name in seen:
                raise ValueError(f"tensor {name} occurs twice")
            seen.add(name)
            self.tensors.append(self._tensor(name, dims, GGMLQuantizationType(raw_type), start + rel))

    def get_field(self, key: str) -> GGUFField | None:
        """The metadata value under `key`, or None."""
        return self.fields.get(key)

    # ------------------------------------------------------------------ parsing
    def _unpack(self, fmt: str, off: int) -> tuple:
        fmt = self._order + fmt
        if off + struct.calcsize(fmt) > self._size:
            raise ValueError(f"metadata runs past the end of the file (at byte {off})")
        return struct.unpack_from(fmt, self._buf, off)

    def _string(self, off: int) -> tuple[str, int]:
        if off + 8 > self._size:  # the vocabulary's 150k strings come here: no format strings built per call
            raise ValueError(f"a string at byte {off} runs past the end of the file")
        (n,) = self._length.unpack_from(self._buf, off)
        off += 8
        if off + n > self._size:
            raise ValueError(f"a string at byte {off} runs past the end of the file")
        return str(self._buf[off : off + n], "utf-8"), off + n

    def _value(self, kind: int, off: int) -> tuple[Any, int]:
        if kind == _STRING:
            return self._string(off)
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            return self._unpack(fmt, off)[0], off + struct.calcsize(fmt)
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind} at byte {off}")
        item, count = self._unpack("IQ", off)
        off += 12
        if item in _SCALARS:  # one unpack for the whole array
            fmt = _SCALARS[item]
            size = struct.calcsize(fmt)
            if off + count * size > self._size:
                raise ValueError(f"an array at byte {off} runs past the end of the file")
            return list(self._unpack(f"{count}{fmt}", off)), off + count * size
        if count * 8 > self._size - off:  # every string or array item takes at least 8 bytes
            raise ValueError(f"an array at byte {off} runs past the end of the file")
        read = self._string if item == _STRING else functools.partial(self._value, item)
        out = []
        for _ in range(count):
            value, off = read(off)
            out.append(value)
        return out, off

    def _tensor(self, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, at: int) -> GGUFTensor:
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[kind]
        shape = tuple(reversed(dims))  # outermost first
        if shape and shape[-1] % block:
            raise ValueError(f"tensor {name}: rows of {shape[-1]} values are not whole blocks of {block}")
        n_bytes = n_elements * type_size // block
        if at + n_bytes > self._size:
            raise ValueError(f"tensor {name} ends at byte {at + n_bytes} but the file has {self._size}")
        dtype = _PLAIN_DTYPES.get(kind)
        if dtype is None:  # quantized: rows of whole blocks as bytes
            view = self.data[at : at + n_bytes].reshape(*shape[:-1], shape[-1] // block * type_size)
        else:
            view = self.data[at : at + n_bytes].view(np.dtype(dtype).newbyteorder(self._order)).reshape(shape)
        return GGUFTensor(name, kind, np.array(dims, dtype=np.uint64), n_elements, n_bytes, at, view)
