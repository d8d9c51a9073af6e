"""Qwen2 / Qwen2.5: the Llama block with biases on the q/k/v projections."""

from __future__ import annotations

from specserve.models.arch import ArchConfig
from specserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM; differs from Llama only by q/k/v biases, which ArchConfig switches on."""

    def __init__(self, cfg: ArchConfig, max_positions: int | None = None) -> None:
        if not cfg.attention_bias:
            raise ValueError("Qwen2 checkpoints carry q/k/v biases; ArchConfig.attention_bias must be True")
        super().__init__(cfg, max_positions)
