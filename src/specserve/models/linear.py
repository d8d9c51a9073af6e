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
    if isinstance(module, OneDNNLinear):
        return module.weight_nbytes
    if isinstance(module, nn.Linear):
        return module.weight.numel() * module.weight.element_size()
    return 0
