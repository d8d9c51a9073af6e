"""Files the commands write: checked before the work that fills them, written whole or not at all.

A command that trains for ten minutes, profiles for five or simulates a workload must not find
out at its last step that it cannot write its output. `output_file` / `output_dir` check a path
when the command starts (without creating anything: a refused command leaves nothing behind),
and `write_atomic` writes through a temporary file beside the target, so an interrupted or
failed write never leaves a torn file under the final name.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

from specserve.errors import ConfigError


def _writable_ancestor(path: Path, flag: str) -> None:
    """The nearest existing folder at or above `path` takes a new file, else a ConfigError."""
    folder = path
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: {folder} is a file, not a folder.")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".specserve-probe-")
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write in {folder} ({exc.strerror or exc}).") from None
    os.close(fd)
    os.unlink(probe)


def output_file(path: str | os.PathLike, flag: str, suffixes: Iterable[str] | None = None) -> Path:
    """`path` as a file this command can write (its folders may not exist yet), or a ConfigError
    naming `flag`; `suffixes`: the endings the writer understands (e.g. an image format)."""
    p = Path(path).expanduser()
    if not str(path).strip():
        raise ConfigError(f"{flag} is empty; give a file name.")
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file name (e.g. {p / 'out'}).")
    if suffixes is not None:
        known = sorted({s.lower() for s in suffixes})
        if p.suffix.lower() not in known:
            raise ConfigError(f"{flag} {path}: the file name must end in one of {', '.join(known)}.")
    if p.exists() and not os.access(p, os.W_OK):
        raise ConfigError(f"{flag} {path} exists and is not writable.")
    _writable_ancestor(p.parent, flag)
    return p


def output_dir(path: str | os.PathLike, flag: str) -> Path:
    """`path` as a folder this command can create and write in, or a ConfigError naming `flag`."""
    p = Path(path).expanduser()
    if not str(path).strip():
        raise ConfigError(f"{flag} is empty; give a folder.")
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path} is a file; give a folder.")
    _writable_ancestor(p, flag)
    return p


def _read_umask() -> int:
    mask = os.umask(0o022)  # (read by setting it: there is no getter before Python 3.13's os.getumask)
    os.umask(mask)
    return mask


# Read once, at import (before any thread of ours runs): setting it later, even for an instant,
# would give a file another thread creates meanwhile the wrong permissions.
_UMASK = _read_umask()


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """write(file) into a temporary file beside path, then rename it over path: a crash never
    leaves a half-written file under the final name, and a failed write leaves nothing."""

    def write_named(name: str) -> None:
        with open(name, "wb") as f:
            write(f)

    write_atomic_named(path, write_named)


def write_atomic_named(path: Path, write: Callable[[str], object]) -> None:
    """write_atomic for writers that take a file name (safetensors' save_file): write(name) fills
    a temporary file beside path, which is then renamed over path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, 0o666 & ~_UMASK)  # as open() would have made it (mkstemp's file is 0600)
        finally:
            os.close(fd)
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
