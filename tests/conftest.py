"""Shared fixtures: tiny random Llama/Qwen2 models and the bundled SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch

# Two cores: keep torch from oversubscribing when pytest runs alongside other work.
torch.set_num_threads(int(os.environ.get("SPECSERVE_TEST_THREADS", "2")))


def _tiny_hf_model(arch: str, seed: int = 0, vocab: int = 256, layers: int = 2):
    import transformers

    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, initializer_range=0.15, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=10000.0, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(rope_theta=1000000.0, **common)
        cls = transformers.Qwen2ForCausalLM
    else:  # llama with tied embeddings (SmolLM2-style)
        common["tie_word_embeddings"] = True
        cfg = transformers.LlamaConfig(rope_theta=100000.0, **common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    return model


def tiny_checkpoint(arch: str = "llama", seed: int = 0, vocab: int = 256, layers: int = 2, tmp_dir=None):
    """(hf_model, LoadedCheckpoint) for a tiny random model, loaded through our HF-dir loader."""
    import tempfile

    from specserve.models.loader import load_model_files

    hf = _tiny_hf_model(arch, seed, vocab, layers)
    d = tmp_dir or tempfile.mkdtemp(prefix=f"tiny-{arch}-")
    hf.save_pretrained(d, safe_serialization=True)
    from pathlib import Path

    return hf, load_model_files(Path(d))


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
    from specserve.spec.eagle import write_random_head

    return write_random_head(ckpt, path, method, seed, **card)
