"""Model architectures by name; loaders report a name, the runner builds the class from here."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

from specserve.errors import UnsupportedModelError
from specserve.models.arch import ArchConfig
from specserve.models.llama import LlamaForCausalLM
from specserve.models.qwen2 import Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
}


def build_model(cfg: ArchConfig, max_positions: int | None = None) -> nn.Module:
    """Instantiate the registered class for cfg.architecture (weights uninitialised)."""
    try:
        cls = MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"Architecture {cfg.architecture!r} is not supported; supported: "
            f"{', '.join(sorted(MODEL_REGISTRY))}. Use a Llama-, SmolLM2- or Qwen2-family model."
        ) from None
    return cls(cfg, max_positions)


# torch.nn.init's in-place initialisers, which module constructors call on their new parameters.
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def unset_weights(device: torch.device | str) -> Iterator[None]:
    """Build modules whose weights a checkpoint replaces: no random initialisation.

    On the CPU the modules get uninitialised tensors (torch.empty: memory the kernel maps only
    when written, and the checkpoint's tensors replace them first) and torch.nn.init's
    initialisers do nothing meanwhile. Elsewhere they are built on the meta device. (On the
    meta device every initialiser runs through torch's Python reference ops, whose first use
    imports torch._dynamo: 1.6 s of every start on a 2-vCPU Zen 4, for nothing else needs it.)
    """
    if torch.device(device).type != "cpu":
        with torch.device("meta"):
            yield
        return
    with _INIT_LOCK:
        saved = {name: getattr(nn.init, name) for name in _INITIALISERS if hasattr(nn.init, name)}
        try:
            for name in saved:
                setattr(nn.init, name, _unchanged)
            with torch.device("cpu"):
                yield
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)


def _unchanged(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor
