"""Helpers shared by the benchmark scripts: machine description, commit, bandwidth, output."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    """Short hash of HEAD, with '+dirty' when the work tree has changes."""
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "src"], cwd=root).returncode != 0
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on (specserve.ops.profile.machine_info) and the commit."""
    from specserve.ops.profile import machine_info as package_machine_info

    return {**package_machine_info(), "commit": git_commit()}


def measure_read_bandwidth(gib: float = 1.0, repeats: int = 5, device: str = "cpu") -> float:
    """Sustained read bandwidth in bytes/s: best of `repeats` full sums over a large tensor."""
    n = int(gib * (1 << 30)) // 4
    x = torch.ones(n, dtype=torch.float32, device=device)
    x.sum()  # touch every page before timing
    best = float("inf")
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        x.sum()
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del x
    return n * 4 / best


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Write results JSON under bench/results/ (a name with folders in it gets them)."""
    path = RESULTS_DIR / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def product_calls(model: torch.nn.Module, rows: int) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """Every quantized product of a model (its BlockQuantLinear layers, in forward order) with
    `rows` random activation rows for it: one forward's matrix products, to time alone."""
    from specserve.models.block_linear import BlockQuantLinear

    return [(m, torch.randn(rows, m.in_features)) for m in model.modules() if isinstance(m, BlockQuantLinear)]


def time_products(calls: list[tuple[torch.nn.Module, torch.Tensor]], repeats: int, warmup: int = 1) -> float:
    """Best-of-`repeats` seconds of one pass over `calls`, each product once and in order (the
    weights stream from memory as in a forward), after `warmup` untimed passes."""
    for _ in range(warmup):
        for mod, x in calls:
            mod(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for mod, x in calls:
            mod(x)
        best = min(best, time.perf_counter() - t0)
    return best
