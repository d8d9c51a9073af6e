"""specserve: an LLM inference engine built around speculative decoding and disaggregation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestMetrics", "RequestOutput", "SamplingParams"]

_EXPORTS = {
    "LLM": "specserve.llm",
    "SamplingParams": "specserve.sampling_params",
    "RequestOutput": "specserve.outputs",
    "CompletionOutput": "specserve.outputs",
    "RequestMetrics": "specserve.outputs",
}

if TYPE_CHECKING:
    from specserve.llm import LLM
    from specserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from specserve.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    # Imported lazily so `import specserve.kv_cache...` does not pull in torch and the models.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specserve' has no attribute {name!r}")
