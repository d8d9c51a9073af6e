"""How linear layers store and multiply their weights, picked by name from a registry.

`dense` keeps torch's nn.Linear (MKL sgemm on CPU). `onednn` re-lays float32 weights out
once in oneDNN's blocked format: on the AVX2 EPYC CI/dev machine this reads a 1536x8960
matrix 1.6x faster at one token and keeps a 5-token verify at 1.5x the cost of one token,
where MKL's small-M sgemm costs 3.1x (measured with /tmp-style microbenchmarks, see the
bench notes). The cheap verify is what lets speculative decoding pay on a CPU.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable

import torch
from torch import nn

from specserve.config import QUANTIZATIONS, Quantization

logger = logging.getLogger(__name__)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes behind `tensors`, each storage counted once (views and shared buffers share one).
    oneDNN's packed weights (OneDNNLinear) have no storage to look at: their own size."""
    storages: dict[int, int] = {}
    for t in tensors:
        if t.is_mkldnn:
            storages[id(t)] = t.numel() * t.element_size()
        else:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def row_reader(linear: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """ids -> those rows of a linear layer's weight, float32, read without decoding the rest:
    nn.Linear, GGUF blocks (BlockQuantLinear.rows), int8 per row (Int8Linear.rows); None for a
    layout whose rows only come out whole (oneDNN's packing, fbgemm's)."""
    if isinstance(linear, nn.Linear):
        w = linear.weight
        return lambda ids: w.detach().index_select(0, ids.to(w.device)).float()
    rows = getattr(linear, "rows", None)
    return rows if callable(rows) else None


class OneDNNLinear(nn.Module):
    """A float32 linear layer whose weight lives in oneDNN's packed layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 8) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight_nbytes = w.numel() * w.element_size()
        # The hint only tunes the blocking; any number of rows can be multiplied afterwards.
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(w, batch_hint), persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        """x @ W^T + b."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def _int8_per_row(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per output row: w ~= q * scale[:, None], |error| <= scale/2.

    The scale is rounded to `scale_dtype` *before* quantizing (nudged up so |w|/scale <= 127
    still holds), so the bound is exact for the scale the kernel actually multiplies by.
    """
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    if scale_dtype != torch.float32:
        scale = (scale * (1 + 2.0**-7)).to(scale_dtype).float()
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(scale_dtype).contiguous()


class _QuantizedLinear(nn.Module):
    """What the quantized linear layers share: shape, output dtype, float32 bias, description."""

    kind = ""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.out_dtype = linear.weight.dtype
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class Int8Linear(_QuantizedLinear):
    """Weight-only int8 linear layer (W8A16): one scale per output row, bf16 activations.

    `torch._weight_int8pack_mm` reads the int8 weight (a quarter of float32's bytes) and
    dequantizes in-register. Its CPU kernel is vectorised for bf16 activations only (float32
    input is ~12x slower), so activations are rounded to bf16 on the way in; accumulation is
    float32. One token reads 8960x1536 in 0.55 ms vs 1.64 ms for oneDNN float32, but the
    cost grows ~linearly with rows (5 rows: 2.5 ms), so it suits drafting more than verifying.
    """

    kind = "weight=int8 per-row, act=bf16"

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        q, scale = _int8_per_row(linear.weight, torch.bfloat16)
        self.register_buffer("qweight", q, persistent=False)
        self.register_buffer("scales", scale, persistent=False)
        self.weight_nbytes = q.numel() + scale.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        """x @ (q * scale)^T + b."""
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.qweight, self.scales).float()
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight this layer effectively multiplies by (for tests and diagnostics)."""
        return self.qweight.float() * self.scales.float()[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Those rows of dequantized_weight (1-D ids)."""
        ids = ids.to(self.qweight.device)
        return self.qweight.index_select(0, ids).float() * self.scales.index_select(0, ids).float()[:, None]


class DynamicInt8Linear(_QuantizedLinear):
    """W8A8 linear layer: int8 per-row weights, activations quantized per call (fbgemm).

    Each call quantizes the input rows to 8 bits with a scale taken from that input, multiplies
    int8 x int8 with int32 accumulation, and rescales to float32. fbgemm packs the weight for
    AVX2, and the cost barely grows with rows (8960x1536: 0.26 ms at 1 row, 0.49 ms at 5), which
    makes verifying K+1 tokens nearly as cheap as decoding one. Activation rounding adds error
    on top of the weight's; the model-level bound is in tests/models/test_quantization.py.
    """

    kind = "weight=int8 per-row, act=int8 dynamic"

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        q, scale = _int8_per_row(linear.weight)
        zero = torch.zeros(q.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch flags the quantized-tensor API as legacy; it is pinned
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
            self._packed = torch.ops.quantized.linear_prepack(qw, self.bias)  # fbgemm adds the bias
        self.weight_nbytes = q.numel() + scale.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        """Quantize x, int8 GEMM, rescale."""
        y = torch.ops.quantized.linear_dynamic(x.float().contiguous(), self._packed, True)
        return y.to(self.out_dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight this layer effectively multiplies by."""
        w, _ = torch.ops.quantized.linear_unpack(self._packed)
        return w.dequantize()


def _onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:  # a self-test: the private op must exist and agree with F.linear
        lin = nn.Linear(16, 8)
        x = torch.randn(3, 16)
        with torch.no_grad():
            ok = torch.allclose(OneDNNLinear(lin)(x), lin(x), atol=1e-5)
        return bool(ok)
    except Exception:  # noqa: BLE001 - any failure means: do not use it
        logger.info("oneDNN packed linear unavailable; using dense linear layers")
        return False


def _to_onednn(model: nn.Module) -> int:
    return _replace_linears(model, OneDNNLinear)


def _replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))
                count += 1
    return count


def _int4_blocks(linear: nn.Linear) -> nn.Module:
    """4-bit blocks (block_linear.quantize_4bit) for a float layer. Layers kept in a file's blocks
    were made 4-bit before the model was built (ModelRunner, block_linear.requantize_4bit)."""
    from specserve.models.block_linear import BlockQuantLinear, quantize_4bit

    return BlockQuantLinear(quantize_4bit(linear.weight), linear.bias)


QUANTIZED_LINEARS: dict[Quantization, Callable[[nn.Linear], nn.Module]] = {
    Quantization.INT8: Int8Linear,
    Quantization.W8A8: DynamicInt8Linear,
    Quantization.INT4: _int4_blocks,
    Quantization.AUTO: lambda linear: linear,  # blocks were kept at load time; float tensors stay float
}


def quantization_usable(quantization: Quantization | str, device: torch.device) -> bool:
    """The kernel is there and agrees with a float reference on this device (a self-test)."""
    quantization = Quantization(quantization)
    if quantization is Quantization.NONE:
        return True
    if quantization.cpu_only and device.type != "cpu":
        return False
    if quantization.blocks:
        from specserve.kernels import kernels_available

        return kernels_available()
    try:
        lin = nn.Linear(64, 16).to(device)
        x = torch.randn(3, 64, device=device)
        with torch.no_grad():
            q = QUANTIZED_LINEARS[quantization](lin)
            ref = torch.nn.functional.linear(x, q.dequantized_weight().to(device), lin.bias)
            return bool(torch.allclose(q(x), ref, atol=0.05, rtol=0.05))
    except Exception:  # noqa: BLE001 - any failure means: not available here
        return False


def apply_quantization(model: nn.Module, quantization: Quantization | str) -> int:
    """Replace the model's nn.Linear layers by quantized ones; returns how many were replaced.

    Embeddings stay in float (a lookup reads one row per token). A tied LM head gets its own
    int8 copy of the embedding matrix, since it is read in full every step.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
    quantization = Quantization(quantization)
    if quantization is Quantization.NONE:
        return 0
    return _replace_linears(model, QUANTIZED_LINEARS[quantization])


LINEAR_BACKENDS: dict[str, Callable[[nn.Module], int]] = {
    "dense": lambda model: 0,
    "onednn": _to_onednn,
}


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """'auto' -> the fastest backend that works for this device and dtype."""
    if name == "auto":
        return "onednn" if _onednn_usable(device, dtype) else "dense"
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {name!r}; use one of auto, {', '.join(LINEAR_BACKENDS)}")
    if name == "onednn" and not _onednn_usable(device, dtype):
        raise ValueError("the onednn linear backend needs a CPU, float32 weights and oneDNN support")
    return name


def apply_linear_backend(model: nn.Module, name: str) -> int:
    """Convert the model's nn.Linear layers in place; returns how many were converted."""
    return LINEAR_BACKENDS[name](model)


def linear_weight_bytes(module: nn.Module) -> int:
    """Bytes of the weight matrix a linear-like module reads per forward."""
    from specserve.models.block_linear import BlockQuantLinear

    if isinstance(module, OneDNNLinear | _QuantizedLinear | BlockQuantLinear):
        return module.weight_nbytes
    if isinstance(module, nn.Linear):
        return module.weight.numel() * module.weight.element_size()
    return 0
