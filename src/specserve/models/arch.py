"""Architecture hyper-parameters shared by every loader and model implementation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from specserve.errors import UnsupportedModelError


@dataclass(frozen=True)
class ArchConfig:
    """Shape of a decoder-only transformer, independent of where its weights came from."""

    architecture: str  # registry key, e.g. "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has biases on q/k/v projections
    name: str = ""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} is {value!r}; it must be a positive integer")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ValueError(f"{name} is {value!r}; it must be a finite positive number")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs whole groups."
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for rotary embeddings.")

    @cached_property
    def q_size(self) -> int:
        """Width of the query projection."""
        return self.num_heads * self.head_dim

    @cached_property
    def kv_size(self) -> int:
        """Width of each of the key and value projections."""
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """KV bytes one token occupies across all layers: 2 * layers * kv_heads * head_dim * bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element
