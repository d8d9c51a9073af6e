"""Model architectures by name; loaders report a name, the runner builds the class from here."""

from __future__ import annotations

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
