"""How linear layers store and multiply their weights, picked by name from a registry.

`dense` keeps torch's nn.Linear (MKL sgemm on CPU). `onednn` re-lays float32 weights out
once in oneDNN's blocked format: on the AVX2 EPYC CI/dev machine this reads a 1536x8960
matrix 1.6x faster at one token and keeps a 5-token verify at 1.5x the cost of one token,
where MKL's small-M sgemm costs 3.1x (measured with /tmp-style microbenchmarks, see the
bench notes). The cheap verify is what lets speculative decoding pay on a CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from specserve.config import QUANTIZATIONS

logger = logging.getLogger(__name__)


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


class Int8Linear(nn.Module):
    """Weight-only int8 linear layer: one symmetric scale per output row, activations stay float.

    The weight is read as int8 (a quarter of float32's bytes) by `torch._weight_int8pack_mm`,
    which dequantizes inside the kernel; decode is bound by weight reads, so fewer bytes is
    directly fewer milliseconds. Rounding error per weight is at most scale/2 = max|w_row|/254.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.out_dtype = linear.weight.dtype
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("qweight", q.contiguous(), persistent=False)
        self.register_buffer("scales", scale.contiguous(), persistent=False)  # float32, [out]
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        self.weight_nbytes = q.numel() + scale.numel() * scale.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        """x @ (q * scale)^T + b, computed in float32."""
        y = torch._weight_int8pack_mm(x.float().contiguous(), self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight this layer effectively multiplies by (for tests and diagnostics)."""
        return self.qweight.float() * self.scales[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=int8 per-row"


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
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, OneDNNLinear(child))
                count += 1
    return count


def _to_int8(model: nn.Module) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child))
                count += 1
    return count


def int8_usable(device: torch.device) -> bool:
    """The int8 weight-only kernel is there and agrees with a float reference on this device."""
    try:
        lin = nn.Linear(64, 16).to(device)
        x = torch.randn(3, 64, device=device)
        with torch.no_grad():
            q = Int8Linear(lin)
            ref = torch.nn.functional.linear(x, q.dequantized_weight(), lin.bias)
            return bool(torch.allclose(q(x), ref, atol=1e-4, rtol=1e-4))
    except Exception:  # noqa: BLE001 - any failure means: not available here
        return False


def apply_quantization(model: nn.Module, quantization: str) -> int:
    """Replace the model's nn.Linear layers by quantized ones; returns how many were replaced.

    Embeddings stay in float (a lookup reads one row per token). A tied LM head gets its own
    int8 copy of the embedding matrix, since it is read in full every step.
    """
    if quantization == "none":
        return 0
    if quantization == "int8":
        return _to_int8(model)
    raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}")


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
    if isinstance(module, OneDNNLinear | Int8Linear):
        return module.weight_nbytes
    if isinstance(module, nn.Linear):
        return module.weight.numel() * module.weight.element_size()
    return 0
