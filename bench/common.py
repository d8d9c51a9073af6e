"""Helpers shared by the benchmark scripts: machine description, commit, bandwidth, output."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
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
    """What the numbers were measured on."""
    cpu = platform.processor() or "unknown"
    flags = ""
    ids: dict[str, str] = {}  # family / model / stepping: VMs often report only "Intel(R) Xeon(R) Processor"
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key == "model name":
                    cpu = line.split(":", 1)[1].strip()
                elif key in ("cpu family", "model", "stepping") and key not in ids:
                    ids[key] = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line
    except OSError:
        pass
    isa = [x for x in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if f" {x}" in flags]
    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_family_model_stepping": "/".join(ids.get(k, "?") for k in ("cpu family", "model", "stepping")),
        "cpu_isa": isa,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    return info


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
    """Write results JSON under bench/results/."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path
