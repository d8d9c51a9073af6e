"""Turn GGUF tensor payloads (plain floats or llama.cpp block quantisations) into float32 tensors.

Every block format below is decoded with whole-tensor torch integer ops, so the work runs in C++
across torch's intra-op threads instead of in numpy temporaries.  The arithmetic is arranged in the
same order as ggml's reference dequantisers (e.g. ``(d * scale) * q - dmin * m`` for the K-quants)
so the float32 results are bit-identical to ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from specserve.errors import CorruptModelError, UnsupportedModelError

__all__ = ["dequantize", "dequantize_many", "supported_fast_types"]

Q = GGMLQuantizationType

# Blocks decoded per kernel call.  Working in slices keeps every temporary (a few MB) in cache,
# which matters more than call overhead once a slice holds tens of thousands of values.
_TARGET_VALUES_PER_CHUNK = 1 << 22


def _f16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian float16 at byte ``start`` of every block, as an (n, 1) float32 tensor."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, out: torch.Tensor) -> None:
    """Split (n, 16) bytes into out[:, :16] = low nibbles, out[:, 16:] = high nibbles.

    ggml's 32-value legacy blocks put value j in the low nibble of byte j and value j+16 in the high
    nibble of the same byte.
    """
    halves = out.view(out.shape[0], 2, 16)
    halves[:, 0].copy_(packed & 0x0F)
    halves[:, 1].copy_(packed >> 4)


_BIT_SHIFTS_8 = torch.arange(8, dtype=torch.uint8)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Expand the 4 bytes (a little-endian uint32) of Q5 high bits into (n, 32) values 0 or 16.

    Bit i of the uint32 is bit (i % 8) of byte i // 8, and belongs to value i of the block.
    """
    bits = (qh.unsqueeze(-1) >> _BIT_SHIFTS_8) & 1
    return bits.reshape(qh.shape[0], 32) << 4


# --- legacy 32-value formats ------------------------------------------------------------------


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # [f16 d][16 bytes of nibbles]; value = d * (q - 8)
    d = _f16_column(blocks, 0)
    _nibbles(blocks[:, 2:18], out)
    out.sub_(8.0).mul_(d)


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # [f16 d][f16 m][16 bytes of nibbles]; value = d * q + m
    d = _f16_column(blocks, 0)
    m = _f16_column(blocks, 2)
    _nibbles(blocks[:, 4:20], out)
    out.mul_(d).add_(m)


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # [f16 d][u32 fifth bits][16 bytes of nibbles]; value = d * (q - 16)
    d = _f16_column(blocks, 0)
    low = torch.cat((blocks[:, 6:22] & 0x0F, blocks[:, 6:22] >> 4), dim=1)
    out.copy_(low | _fifth_bits(blocks[:, 2:6]))
    out.sub_(16.0).mul_(d)


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # [f16 d][f16 m][u32 fifth bits][16 bytes of nibbles]; value = d * q + m
    d = _f16_column(blocks, 0)
    m = _f16_column(blocks, 2)
    low = torch.cat((blocks[:, 8:24] & 0x0F, blocks[:, 8:24] >> 4), dim=1)
    out.copy_(low | _fifth_bits(blocks[:, 4:8]))
    out.mul_(d).add_(m)


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # [f16 d][32 signed bytes]; value = q * d
    d = _f16_column(blocks, 0)
    out.copy_(blocks[:, 2:34].view(torch.int8))
    out.mul_(d)


# --- 256-value K formats ----------------------------------------------------------------------


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte table of eight 6-bit scales and eight 6-bit mins used by Q4_K and Q5_K.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 hold mins 0-3 the same way, and bytes
    8-11 hold the low 4 bits of scale/min 4-7 (low/high nibble); the missing top 2 bits of those
    come from the spare top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    rows = packed.reshape(packed.shape[0], 3, 4)
    a, b, c = rows[:, 0], rows[:, 1], rows[:, 2]
    scales = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)), dim=1)
    mins = torch.cat((b & 0x3F, (c >> 4) | ((b >> 6) << 4)), dim=1)
    return scales, mins


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # [f16 d][f16 dmin][12 bytes scales/mins][128 bytes nibbles]; eight sub-blocks of 32 values.
    # Each 32-byte run of nibbles carries two sub-blocks: low nibbles first, then high nibbles.
    n = blocks.shape[0]
    d = _f16_column(blocks, 0)
    dmin = _f16_column(blocks, 2)
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    q = blocks[:, 16:144].reshape(n, 4, 1, 32)
    sub = out.view(n, 4, 2, 32)
    sub[:, :, 0:1].copy_(q & 0x0F)
    sub[:, :, 1:2].copy_(q >> 4)
    scale = (d * sc.float()).view(n, 8, 1)
    offset = (dmin * mn.float()).view(n, 8, 1)
    vals = out.view(n, 8, 32)
    vals.mul_(scale).sub_(offset)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # [f16 d][f16 dmin][12 bytes scales/mins][32 bytes fifth bits][128 bytes nibbles].
    # Value l of sub-block s takes its fifth bit from bit s of high-bit byte l.
    n = blocks.shape[0]
    d = _f16_column(blocks, 0)
    dmin = _f16_column(blocks, 2)
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    qh = blocks[:, 16:48].reshape(n, 1, 32)
    high = ((qh >> _BIT_SHIFTS_8.view(1, 8, 1)) & 1) << 4  # (n, 8 sub-blocks, 32)
    q = blocks[:, 48:176].reshape(n, 4, 1, 32)
    low = torch.cat((q & 0x0F, q >> 4), dim=2).view(n, 8, 32)
    vals = out.view(n, 8, 32)
    vals.copy_(low | high)
    scale = (d * sc.float()).view(n, 8, 1)
    offset = (dmin * mn.float()).view(n, 8, 1)
    vals.mul_(scale).sub_(offset)


_Q6_HIGH_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # [128 bytes low nibbles][64 bytes 2-bit highs][16 int8 scales][f16 d].
    # The block is two halves of 128 values; in half h, quarter k (32 values) takes its low 4 bits
    # from byte l (+32 if k is odd) of that half's 64 low-nibble bytes (low nibble for k < 2, high
    # for k >= 2) and its top 2 bits from bits 2k..2k+1 of that half's 32 high bytes.
    # Every 16 consecutive values share one int8 scale.
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 2, 32)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2)  # (n, half, quarter, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    high = ((qh >> _Q6_HIGH_SHIFTS) & 3) << 4
    vals = out.view(n, 16, 16)
    vals.copy_((low | high).view(n, 16, 16))
    vals.sub_(32.0)
    d = _f16_column(blocks, 208)
    scale = (d * blocks[:, 192:208].view(torch.int8).float()).view(n, 16, 1)
    vals.mul_(scale)


_BLOCK_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}

_FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


def supported_fast_types() -> frozenset[GGMLQuantizationType]:
    """Tensor types decoded by the torch kernels here (others go through gguf's numpy code)."""
    return frozenset(_BLOCK_KERNELS) | frozenset(_FLOAT_TYPES)


def _raw_bytes(raw: np.ndarray) -> torch.Tensor:
    """View a numpy payload (often a read-only memmap) as a flat uint8 tensor, without copying."""
    arr = np.asarray(raw)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not np.little_endian):
        # GGUF payloads are little-endian; a byte-swapped reader hands us non-native floats.
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        # torch warns that a read-only memmap is not writable; the tensor is only ever read here.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def _type_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"#{int(qtype)}"


class _Job(NamedTuple):
    """One validated tensor: its raw bytes, format and the float32 output they decode into."""

    qtype: GGMLQuantizationType
    data: torch.Tensor  # flat uint8, exactly the tensor's bytes
    out: torch.Tensor  # flat float32, freshly allocated
    rows: int  # independent row groups the work may be split along
    shape: tuple[int, ...]


def _prepare(raw: np.ndarray, qtype: GGMLQuantizationType | int, shape: tuple[int, ...]) -> _Job:
    """Validate a payload against its declared type and shape, and allocate its output."""
    shape = tuple(int(s) for s in shape)
    n_values = math.prod(shape)
    try:
        qtype = GGMLQuantizationType(int(qtype))
    except ValueError:
        raise UnsupportedModelError(
            f"Tensor type {_type_name(qtype)} is unknown to this version of gguf; "
            "re-quantise the model to a common type such as Q8_0, Q4_K or F16."
        ) from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if n_values % block_size:
        raise CorruptModelError(
            f"A {qtype.name} tensor of shape {shape} does not split into {block_size}-value "
            "blocks; the file is damaged, so download or re-convert it."
        )
    n_bytes = n_values // block_size * type_size
    data = _raw_bytes(raw)
    if data.numel() < n_bytes:
        raise CorruptModelError(
            f"A {qtype.name} tensor of shape {shape} needs {n_bytes} bytes but only "
            f"{data.numel()} are present; the file is truncated, so download or re-convert it."
        )
    if qtype not in _BLOCK_KERNELS and qtype not in _FLOAT_TYPES:
        _check_gguf_can_decode(qtype)
    # Rows along the first axis hold whole blocks (ggml quantises each innermost row separately),
    # so they can be decoded independently.
    rows = shape[0] if len(shape) > 1 and (n_values // shape[0]) % block_size == 0 else 1
    out = torch.empty(n_values, dtype=torch.float32)
    return _Job(qtype, data[:n_bytes], out, rows, shape)


def _check_gguf_can_decode(qtype: GGMLQuantizationType) -> None:
    type_size = GGML_QUANT_SIZES[qtype][1]
    try:
        gguf_quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"Tensor type {qtype.name} cannot be decoded by specserve or by the installed gguf "
            "package; re-quantise the model to Q8_0, Q4_K, Q6_K or F16, or upgrade gguf."
        ) from None


def _decode_into(qtype: GGMLQuantizationType, data: torch.Tensor, out: torch.Tensor) -> None:
    """Decode flat payload bytes into the flat float32 ``out`` (same number of values)."""
    if qtype == Q.F32:
        out.copy_(data.view(torch.float32))
    elif qtype == Q.F16:
        out.copy_(data.view(torch.float16))
    elif qtype == Q.BF16:
        # bfloat16 is the top half of a float32, so widening is exact.
        out.copy_(data.view(torch.bfloat16))
    else:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        blocks = data.view(-1, type_size)
        values = out.view(-1, block_size)
        kernel = _BLOCK_KERNELS.get(qtype)
        if kernel is None:
            # Rarer formats: gguf-py's numpy reference decoder.
            decoded = gguf_quants.dequantize(blocks.numpy(), qtype)
            values.copy_(torch.from_numpy(np.ascontiguousarray(decoded, dtype=np.float32)))
            return
        step = max(1, _TARGET_VALUES_PER_CHUNK // block_size)
        for start in range(0, blocks.shape[0], step):
            kernel(blocks[start : start + step], values[start : start + step])


# Work is cut into pieces of about this many values so that two workers stay busy even when one
# tensor (typically the embedding) dominates the file.
_PIECE_VALUES = 1 << 24

_THREADS_LOCK = threading.Lock()


@contextmanager
def _one_thread_per_op() -> Iterator[int]:
    """Make torch ops single-threaded for a while; yields the thread count to use as workers.

    Each torch op normally splits across an OpenMP team and waits at a barrier for all of its
    threads. When another process occupies a core, every such barrier stalls for a scheduler
    slice, which made decoding ~40x slower in practice. Independent pieces on a small pool of
    Python threads (torch releases the GIL inside ops) degrade gracefully instead.
    """
    with _THREADS_LOCK:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield before
        finally:
            torch.set_num_threads(before)


def dequantize_many(
    items: Sequence[tuple[np.ndarray, GGMLQuantizationType | int, tuple[int, ...]]],
) -> list[torch.Tensor]:
    """Decode many ``(raw, qtype, shape)`` payloads in parallel; same results as ``dequantize``."""
    jobs = [_prepare(raw, qtype, shape) for raw, qtype, shape in items]
    pieces: list[tuple[GGMLQuantizationType, torch.Tensor, torch.Tensor]] = []
    for job in jobs:
        per_row = job.out.numel() // job.rows
        bytes_per_row = job.data.numel() // job.rows
        step = max(1, _PIECE_VALUES // max(per_row, 1))
        for r in range(0, job.rows, step):
            end = min(job.rows, r + step)
            pieces.append(
                (
                    job.qtype,
                    job.data[r * bytes_per_row : end * bytes_per_row],
                    job.out[r * per_row : end * per_row],
                )
            )
    with _one_thread_per_op() as workers:
        if workers <= 1 or len(pieces) <= 1:
            for piece in pieces:
                _decode_into(*piece)
        else:
            # Biggest pieces first so that no worker is left with a long tail on its own.
            pieces.sort(key=lambda p: p[2].numel(), reverse=True)
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for _ in pool.map(lambda p: _decode_into(*p), pieces):
                    pass
    return [job.out.view(job.shape) for job in jobs]


def dequantize(
    raw: np.ndarray, qtype: GGMLQuantizationType | int, shape: tuple[int, ...]
) -> torch.Tensor:
    """Decode a GGUF payload into a new float32 tensor of row-major (numpy/HF order) ``shape``."""
    return dequantize_many([(raw, qtype, shape)])[0]
