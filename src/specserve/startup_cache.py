"""What a start measures about this machine and model, kept so the next start need not.

Three things a start computes depend only on the machine, the model files, the settings and the
code: the native kernels' tunings (prefetch distances, where 512-bit passes pay; ~2.6 s for the
Qwen2.5-Coder 1.5B on a 2-vCPU Zen 4), the speculation policy's step costs (`profile_costs`:
target forwards of 1-33 tokens, draft passes; ~6.4 s) and a GGUF's matrices requantized to 4-bit
blocks for `int4` (the default for a draft: ~2 s for the 0.5B). Each is saved under
``$SPECSERVE_CACHE/profiles/<kind>-<key>.json`` (tensors beside it, ``.safetensors``) where the
key hashes everything that decides the result: the CPU (model name, flags), torch's thread count, specserve's source files, torch's
version, the model files (path, size, modification time) and the settings. Any change measures
afresh. ``$SPECSERVE_PROFILE_CACHE=0`` neither reads nor writes the cache (every start measures).

A file that cannot be read or parsed is ignored and replaced; writes are atomic (a temporary
file renamed over the old one), so two processes starting together never read half a file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from specserve.files import write_atomic, write_atomic_named

logger = logging.getLogger(__name__)

SCHEMA = 1  # bumped when a kind's saved fields change meaning
TENSOR_FILES_KEPT = 4  # tensor files of one kind kept (the newest), whatever their identity
JSON_FILES_KEPT = 64  # measurements of one kind kept (a few kB each: every upgrade or setting adds one)


def enabled() -> bool:
    """The cache is used unless $SPECSERVE_PROFILE_CACHE is 0, off, false or no."""
    return os.environ.get("SPECSERVE_PROFILE_CACHE", "").strip().lower() not in ("0", "off", "false", "no")


def machine_identity() -> dict[str, Any]:
    """The CPU (what the native kernels' build is keyed by: architecture, model name, flags) and
    the threads torch runs on: what decides how fast the same code runs the same model."""
    from specserve.kernels import _cpu_key

    return {"cpu": _cpu_key(), "threads": torch.get_num_threads(), "torch": torch.__version__}


@functools.cache
def code_identity(*files: str) -> str:
    """A hash of specserve's own source files (Python and C++; or only `files`, paths relative to
    the package): another version may time or compute differently, so it measures again."""
    root = Path(__file__).resolve().parent
    digest = hashlib.blake2b(digest_size=12)
    paths = [root / f for f in files] if files else sorted(root.rglob("*"))
    for path in paths:
        if path.suffix in (".py", ".cpp", ".h") and path.is_file():
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def file_identity(path: object) -> dict[str, Any] | None:
    """(real path, size, modification and change times, inode) of a model file or directory; None where it is no
    file (a checkpoint built in memory): such a model is measured every time."""
    try:
        real = os.path.realpath(str(path))
        st = os.stat(real)
    except (OSError, TypeError, ValueError):
        return None
    # The inode and the change time too: a copy that keeps the modification time (cp -p, rsync,
    # tar) or a rewrite in place that restores it would otherwise reuse what another file measured.
    return {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "ctime_ns": st.st_ctime_ns}


class StartupCache:
    """One kind of start-up measurement for one identity (a dict of JSON values)."""

    def __init__(self, kind: str, identity: dict[str, Any], code: str | None = None) -> None:
        """`code`: what identifies the code that computes this kind (default: all of specserve's
        source, code_identity(); a kind that depends on a few files names their hash)."""
        from specserve.models.bundled import cache_dir

        self.kind = kind
        self.identity = {"schema": SCHEMA, "kind": kind, "machine": machine_identity(),
                         "code": code or code_identity(), **identity}
        key = hashlib.blake2b(json.dumps(self.identity, sort_keys=True, default=str).encode(), digest_size=12)
        self.path = cache_dir() / "profiles" / f"{kind}-{key.hexdigest()}.json"

    def load(self) -> dict[str, Any] | None:
        """The saved measurement, or None (none saved, the cache off, or a file that does not parse)."""
        if not enabled() or not self.path.is_file():
            return None
        try:
            saved = json.loads(self.path.read_text(encoding="utf-8"))
            if saved.get("identity") != json.loads(json.dumps(self.identity, default=str)):
                return None  # (a hash collision, or a file edited by hand)
            data = saved["data"]
            if not isinstance(data, dict):
                raise TypeError("data is not an object")
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            logger.warning("ignoring the unreadable start-up profile %s (%s); measuring again", self.path, exc)
            return None
        return data

    def save(self, data: dict[str, Any]) -> None:
        """Keep `data` for the next start (atomically; a failure to write only logs)."""
        if not enabled():
            return
        try:
            text = json.dumps({"identity": self.identity, "saved_at": time.time(), "data": data}, default=str)
            write_atomic(self.path, lambda f: f.write(text.encode("utf-8")))
            # Each identity (source, settings, model files) has its own file: keep the newest of a kind.
            older = sorted(self.path.parent.glob(f"{self.kind}-*.json"), key=lambda p: p.stat().st_mtime)
            for stale in older[:-JSON_FILES_KEPT]:
                stale.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("could not save the start-up profile %s (%s)", self.path, exc)

    def forget(self) -> None:
        """Remove the saved measurement (it proved stale)."""
        self.path.unlink(missing_ok=True)
        self.tensor_path.unlink(missing_ok=True)

    @property
    def tensor_path(self) -> Path:
        """Where `save_tensors` keeps tensors for this identity (beside the JSON)."""
        return self.path.with_suffix(".safetensors")

    def load_tensors(self) -> dict[str, torch.Tensor] | None:
        """Tensors saved by save_tensors, or None (none saved, the cache off, or a torn file)."""
        if not enabled() or not self.tensor_path.is_file():
            return None
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(self.tensor_path))
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            logger.warning("ignoring the unreadable %s (%s)", self.tensor_path, exc)
            return None

    def save_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `tensors` for the next start (atomically; a failure to write only logs)."""
        if not enabled():
            return
        from safetensors.torch import save_file

        try:
            blocks = {k: v.contiguous() for k, v in tensors.items()}
            write_atomic_named(self.tensor_path, lambda name: save_file(blocks, name))
            # Tensor files are large (a 0.5B draft's 4-bit blocks: 250 MB): keep the newest few of a kind.
            older = sorted(self.path.parent.glob(f"{self.kind}-*.safetensors"), key=lambda p: p.stat().st_mtime)
            for stale in older[:-TENSOR_FILES_KEPT]:
                stale.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("could not save %s (%s)", self.tensor_path, exc)
