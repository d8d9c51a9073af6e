"""Our decoder's logits against HF transformers (test-only reference), fp32, paged KV path.

For each model: logits after prefill, then after each of 20 greedy decode steps, must match
HF's logits at the same positions within 1e-3 (max abs).
"""

from __future__ import annotations

import pytest
import torch

from specserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from specserve.engine.engine import LLMEngine
from specserve.sampling_params import SamplingParams

TOL = 1e-3
NUM_DECODE = 20


def _engine(checkpoint, name="m", chunk=512, block_size=16):
    cfg = EngineConfig(
        model=ModelConfig(model=name, dtype="float32"),
        cache=CacheConfig(block_size=block_size, kv_cache_gib=0.25),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
    )
    eng = LLMEngine(cfg, checkpoint=checkpoint)
    eng.runner.keep_logits = True
    return eng


def _our_logits(engine: LLMEngine, prompt_ids: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """Logits row of the single request after its prefill and after each decode step."""
    engine.add_request(prompt_ids, SamplingParams(max_tokens=NUM_DECODE + 1, temperature=0, ignore_eos=True))
    rows, tokens = [], []
    while engine.has_unfinished_requests():
        outs = engine.step()
        if outs:  # a sampling step (not a mid-prompt chunk)
            rows.append(engine.runner.last_logits[0].clone())
            tokens = outs[0].token_ids
    return rows, tokens


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def _compare(hf_model, engine, prompt_ids):
    rows, gen = _our_logits(engine, prompt_ids)
    assert len(rows) == NUM_DECODE + 1
    full = prompt_ids + gen[:-1]
    ref = _hf_logits(hf_model, full)
    worst = 0.0
    for t, row in enumerate(rows):
        want = ref[len(prompt_ids) - 1 + t]
        worst = max(worst, (row - want).abs().max().item())
    assert worst < TOL, f"max |ours - HF| = {worst:.2e}"
    # The greedy tokens we emitted are HF's argmax at every position.
    assert gen[:-1] == ref[len(prompt_ids) - 1 :].argmax(-1).tolist()[: len(gen) - 1]
    return worst


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_tiny_random_models_match_hf(fixture, request):
    hf, ckpt = request.getfixturevalue(fixture)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, ckpt.arch.vocab_size, (37,), generator=g).tolist()
    _compare(hf, _engine(ckpt), prompt)
    # Chunked prefill and a small block size take the same code path to the same logits.
    _compare(hf, _engine(ckpt, chunk=8, block_size=4), prompt)


def test_tiny_tied_embeddings():
    from conftest import tiny_checkpoint

    hf, ckpt = tiny_checkpoint("tied", seed=3)
    assert ckpt.arch.tie_word_embeddings
    prompt = list(range(5, 30))
    _compare(hf, _engine(ckpt), prompt)


@pytest.fixture(scope="module")
def hf_smollm(smollm_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name, torch_dtype=torch.float32
    )
    return model.eval()


def test_smollm2_gguf_matches_hf(hf_smollm, smollm_checkpoint):
    tok = smollm_checkpoint.tokenizer
    prompt = tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    worst = _compare(hf_smollm, _engine(smollm_checkpoint), prompt)
    print(f"SmolLM2 max abs logit diff vs HF: {worst:.2e}")
