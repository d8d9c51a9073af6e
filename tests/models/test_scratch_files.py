"""Test helpers leave nothing behind: tiny models and head files live in directories removed at exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def test_scratch_dirs_of_tiny_models_are_removed_when_the_process_exits():
    code = textwrap.dedent("""
        from specserve.testing import scratch_dir, tiny_checkpoint
        d = scratch_dir("scratch-test-")
        (d / "head.safetensors").write_bytes(b"x" * 1024)
        _, ckpt = tiny_checkpoint("llama", seed=1, vocab=64, layers=1)
        print(d)
        print(ckpt.source)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    made = [Path(p) for p in out.stdout.split()]
    assert len(made) == 2 and all(p.is_absolute() for p in made), out.stdout
    assert not any(p.exists() for p in made), [str(p) for p in made if p.exists()]
