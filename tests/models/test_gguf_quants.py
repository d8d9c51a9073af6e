"""The torch dequantisers must reproduce gguf-py's numpy reference bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from specserve.errors import CorruptModelError, ModelPackageMissingError, UnsupportedModelError
from specserve.models import gguf_quants as quants_module
from specserve.models.bundled import ensure_bundled
from specserve.models.gguf_quants import dequantize, dequantize_many, supported_fast_types
from specserve.models.loader import open_gguf


def _bundled_or_skip(name: str):
    try:
        return ensure_bundled(name, progress=False)
    except ModelPackageMissingError as exc:
        pytest.skip(f"bundled model {name} is not installed: {exc}")


def _reference(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    values = gguf_quants.dequantize(raw, qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))


def _assert_same_bits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == tuple(ref.shape)
    # Comparing bit patterns also treats identical NaNs as equal.
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))


def _hf_shape(tensor) -> tuple[int, ...]:
    return tuple(reversed([int(d) for d in tensor.shape]))


@pytest.fixture(scope="module")
def smollm2_reader():
    return open_gguf(_bundled_or_skip("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def qwen05_reader():
    return open_gguf(_bundled_or_skip("qwen2.5-coder-0.5b-instruct"))


def _check_types(reader, types: list[Q], largest: tuple[Q, ...] = (), per_type: int = 2) -> None:
    """Compare the smallest tensors of each type, and the largest of ``largest`` types.

    The largest tensors span many kernel chunks, so chunk borders get checked too.
    """
    for qtype in types:
        tensors = sorted(
            (t for t in reader.tensors if t.tensor_type == qtype), key=lambda t: t.n_elements
        )
        assert tensors, f"expected {qtype.name} tensors in the file"
        picks = tensors[:per_type] + ([tensors[-1]] if qtype in largest else [])
        for t in picks:
            shape = _hf_shape(t)
            _assert_same_bits(
                dequantize(t.data, t.tensor_type, shape), _reference(t.data, qtype, shape)
            )


def test_smollm2_tensor_types_match_gguf(smollm2_reader):
    _check_types(smollm2_reader, [Q.Q4_1, Q.Q8_0, Q.F32], largest=(Q.Q8_0, Q.Q4_1))


def test_qwen05_tensor_types_match_gguf(qwen05_reader):
    _check_types(qwen05_reader, [Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F32], largest=(Q.Q4_K, Q.Q6_K))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.BF16])
def test_synthetic_quantised_data_matches_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    # Mixed magnitudes (and an all-zero row) exercise the scales as well as the packed bits.
    values = (rng.standard_normal((7, 512)) * rng.uniform(0.01, 10, (7, 1))).astype(np.float32)
    values[3] = 0.0
    raw = gguf_quants.quantize(values, qtype)
    _assert_same_bits(dequantize(raw, qtype, values.shape), _reference(raw, qtype, values.shape))


def _random_blocks(qtype: Q, n_blocks: int, seed: int, f16_offsets: tuple[int, ...]) -> np.ndarray:
    """Random block bytes whose float16 scale fields hold finite, moderate values."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for off in f16_offsets:
        scales = rng.uniform(-2, 2, n_blocks).astype(np.float16)
        raw[:, off : off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw


@pytest.mark.parametrize(
    ("qtype", "f16_offsets"),
    [(Q.Q5_K, (0, 2)), (Q.Q4_K, (0, 2)), (Q.Q6_K, (208,)), (Q.Q5_0, (0,)), (Q.Q5_1, (0, 2))],
)
def test_random_blocks_match_gguf(qtype, f16_offsets):
    # gguf cannot quantise to K formats, so random payloads (with sane scales) stand in for real
    # data; every bit pattern of the packed fields gets exercised.
    raw = _random_blocks(qtype, 3000, int(qtype), f16_offsets)
    block_size, _ = GGML_QUANT_SIZES[qtype]
    shape = (3000 * block_size // 768, 768)
    _assert_same_bits(
        dequantize(raw.reshape(shape[0], -1), qtype, shape), _reference(raw, qtype, shape)
    )


def test_plain_float_types():
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((5, 6)).astype(np.float32)
    assert torch.equal(dequantize(f32, Q.F32, (5, 6)), torch.from_numpy(f32))
    f16 = rng.standard_normal((4, 8)).astype(np.float16)
    assert torch.equal(dequantize(f16, Q.F16, (4, 8)), torch.from_numpy(f16.astype(np.float32)))
    # Every bfloat16 bit pattern, including infinities and NaNs, widens exactly.
    bf16 = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(256, 512)
    _assert_same_bits(dequantize(bf16, Q.BF16, (256, 256)), _reference(bf16, Q.BF16, (256, 256)))


def test_output_is_a_fresh_float32_tensor():
    data = np.ones((2, 3), dtype=np.float32)
    out = dequantize(data, Q.F32, (2, 3))
    out += 1
    assert data[0, 0] == 1.0  # no aliasing with the (possibly memory-mapped) source


def test_other_types_fall_back_to_gguf():
    assert Q.Q2_K not in supported_fast_types()
    raw = _random_blocks(Q.Q2_K, 40, 1, (80, 82))
    _assert_same_bits(dequantize(raw, Q.Q2_K, (40, 256)), _reference(raw, Q.Q2_K, (40, 256)))


def test_undecodable_type_is_unsupported():
    _, type_size = GGML_QUANT_SIZES[Q.Q8_K]
    with pytest.raises(UnsupportedModelError, match="Q8_K"):
        dequantize(np.zeros((2, type_size), np.uint8), Q.Q8_K, (2, 256))


def test_short_payload_is_corrupt():
    with pytest.raises(CorruptModelError, match="truncated"):
        dequantize(np.zeros(17, np.uint8), Q.Q4_0, (32,))
    with pytest.raises(CorruptModelError):
        dequantize(np.zeros(18, np.uint8), Q.Q4_0, (31,))


def test_many_tensors_split_into_pieces(monkeypatch):
    # Tiny pieces and kernel chunks force every tensor through the split-and-parallel path.
    monkeypatch.setattr(quants_module, "_PIECE_VALUES", 1000)
    monkeypatch.setattr(quants_module, "_TARGET_VALUES_PER_CHUNK", 700)
    threads = torch.get_num_threads()
    items, refs = [], []
    for qtype, offsets in [(Q.Q4_K, (0, 2)), (Q.Q6_K, (208,)), (Q.Q8_0, (0,)), (Q.Q4_1, (0, 2))]:
        block_size, _ = GGML_QUANT_SIZES[qtype]
        n_blocks = 96 * 512 // block_size
        raw = _random_blocks(qtype, n_blocks, int(qtype) + 7, offsets).reshape(96, -1)
        items.append((raw, qtype, (96, 512)))
        refs.append(_reference(raw, qtype, (96, 512)))
    f32 = np.random.default_rng(5).standard_normal((33, 40)).astype(np.float32)
    items.append((f32, Q.F32, (33, 40)))
    refs.append(torch.from_numpy(f32))
    for ours, ref in zip(dequantize_many(items), refs, strict=True):
        _assert_same_bits(ours, ref)
    assert torch.get_num_threads() == threads  # the temporary single-threading is undone
