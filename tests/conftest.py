"""Shared fixtures: tiny random Llama/Qwen2 models and the bundled SmolLM2."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from specserve.testing import tiny_checkpoint  # noqa: F401 - tests import it from here

# Two cores: keep torch from oversubscribing when pytest runs alongside other work.
torch.set_num_threads(int(os.environ.get("SPECSERVE_TEST_THREADS", "2")))
# Every engine measures its start-up figures afresh, as before the start-up cache: a test's
# timings never come from another test's run (tests/engine/test_startup_cache.py turns it on).
os.environ.setdefault("SPECSERVE_PROFILE_CACHE", "0")


@pytest.fixture(autouse=True)
def _collector_skips_earlier_tests_objects():
    """Each test's garbage collections scan only the objects it made. By the middle of the suite
    the process holds every session fixture's model and tokenizer (300k+ objects): a full
    collection took 0.3 s, and a test making 10^6 small objects (the tree-verification trials)
    spent 40% of its time in them. gc.freeze() and gc.unfreeze() only move list heads.

    At the end the test's own cyclic garbage (engines and their caches) is collected while the
    earlier heap is still frozen, so that pass is cheap. Unfrozen without it, that garbage was
    frozen again by the next test and collections seldom ran between tests: the suite's peak
    resident memory reached 17 GB."""
    gc.freeze()
    yield
    gc.collect()
    gc.unfreeze()


@pytest.fixture(scope="session")
def tiny_llama():
    """A tiny random Llama (untied) and its checkpoint."""
    return tiny_checkpoint("llama", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2():
    """A tiny random Qwen2 (q/k/v biases) and its checkpoint."""
    return tiny_checkpoint("qwen2", seed=2)


@pytest.fixture(scope="session")
def smollm_path():
    """Path of the bundled SmolLM2-135M-Instruct GGUF (skips when its package is missing)."""
    from specserve.errors import ModelPackageMissingError
    from specserve.models.bundled import resolve_model

    try:
        return resolve_model("smollm2-135m-instruct")
    except ModelPackageMissingError as e:  # pragma: no cover - CI installs it
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm_checkpoint(smollm_path):
    """Our loader's view of SmolLM2 (float32 weights + tokenizer), loaded once per session."""
    from specserve.models.loader import load_model_files

    return load_model_files(smollm_path)


@pytest.fixture(scope="session")
def smollm_llm(smollm_checkpoint):
    """An fp32 LLM on SmolLM2 shared by tests that only read from it."""
    from specserve import LLM

    return LLM("smollm2-135m-instruct", dtype="float32", checkpoint=smollm_checkpoint, kv_cache_gib=0.5)


def make_head_file(ckpt, path, seed: int = 0, method: str = "eagle", **card):
    """A randomly initialised EAGLE (or Medusa, 3 heads, or MTP) head file for the target `ckpt`."""
    from specserve.testing import write_random_head

    return write_random_head(ckpt, path, method, seed, **card)
