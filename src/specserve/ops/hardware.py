"""Published figures of machines the operator's tools can plan for, by name (`--hardware NAME`).

The figures are vendors' datasheet peaks (for the CPU entry, this project's own probes), so a
plan made from them is a ceiling: real kernels reach some fraction of each.
Units: memory and link bandwidth in GB/s (10^9 bytes per second), compute in TFLOP/s
(10^12 per second), memory capacity in GB (10^9 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.errors import SpecServeError


class UnknownHardwareError(SpecServeError, ValueError):
    """A hardware name that is not in the registry."""


@dataclass(frozen=True)
class HardwareSpec:
    """Peak figures of one accelerator (or CPU) that bound a decode step."""

    name: str
    description: str
    memory_gb_s: float  # device memory (HBM / DRAM) read bandwidth
    tflops: float  # dense matrix throughput at `tflops_dtype`, no sparsity
    tflops_dtype: str  # the precision the TFLOP/s figure is quoted for
    memory_gb: float  # device memory capacity
    link_gb_s: float | None  # bandwidth between two devices for KV transfer; None: not published
    source: str  # where the figures come from

    def __post_init__(self) -> None:
        for field_name in ("memory_gb_s", "tflops", "memory_gb"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"{self.name}: {field_name} must be positive")
        if self.link_gb_s is not None and self.link_gb_s <= 0:
            raise ValueError(f"{self.name}: link_gb_s must be positive or None")

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity (FLOP per byte read) above which compute, not memory, bounds a step."""
        return self.tflops * 1e12 / (self.memory_gb_s * 1e9)


HARDWARE: dict[str, HardwareSpec] = {
    spec.name: spec
    for spec in (
        HardwareSpec(
            name="h100",
            description="NVIDIA H100 SXM5 80GB",
            memory_gb_s=3350.0,
            tflops=989.0,
            tflops_dtype="bf16",
            memory_gb=80.0,
            link_gb_s=900.0,  # NVLink 4, both directions together
            source="NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
        ),
        HardwareSpec(
            name="h200",
            description="NVIDIA H200 SXM 141GB",
            memory_gb_s=4800.0,
            tflops=989.0,
            tflops_dtype="bf16",
            memory_gb=141.0,
            link_gb_s=900.0,
            source="NVIDIA H200 Tensor Core GPU datasheet (SXM)",
        ),
        HardwareSpec(
            name="a100",
            description="NVIDIA A100 SXM4 80GB",
            memory_gb_s=2039.0,
            tflops=312.0,
            tflops_dtype="bf16",
            memory_gb=80.0,
            link_gb_s=600.0,  # NVLink 3
            source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)",
        ),
        HardwareSpec(
            name="cpu-2core",
            description="2 x86 cores of a shared server (this project's CI and dev machines)",
            memory_gb_s=27.0,  # measured read bandwidth: 20-33 GB/s across the machines seen
            tflops=0.45,  # measured int8 multiply-add peak, 223 GMAC/s on 2 threads (2 ops per MAC)
            tflops_dtype="int8",
            memory_gb=24.0,
            link_gb_s=None,  # workers share memory; measure with `specserve profile`
            source="measured on an AVX2 EPYC, docs/performance.md (probes, not a datasheet)",
        ),
    )
}


def get_hardware(name: str) -> HardwareSpec:
    """The registered figures for `name` (case-insensitive)."""
    spec = HARDWARE.get(name.lower())
    if spec is None:
        raise UnknownHardwareError(
            f"Unknown hardware {name!r}; use one of: {', '.join(sorted(HARDWARE))}, or give the "
            "figures explicitly (--bandwidth-gbs, --tflops)."
        )
    return spec
